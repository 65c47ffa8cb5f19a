"""Reference vision encoders for the encoder service: image bytes in, embeddings + 2-D position ids out.

``load_encoder("builtin")``: a small deterministic ViT; ``load_encoder("/path/to/dir")``: a local Hugging Face
CLIP/SigLIP or Qwen2-VL vision tower (safetensors only; never downloads). Knows nothing of transports.
``sample_paths()`` lists the demo's images.
"""

from __future__ import annotations

from pathlib import Path

from tensorwire.encoder._base import ImageEmbedding, VisionEncoder
from tensorwire.encoder._builtin import BuiltinEncoder, BuiltinViT
from tensorwire.encoder._config import BuiltinViTConfig, PreprocessConfig
from tensorwire.encoder._preprocess import decode_image, grid_position_ids, smart_resize

SAMPLES_DIR = Path(__file__).with_name("samples")


def load_encoder(
    model: str = "builtin", *, device: str = "cpu", preprocess: PreprocessConfig | None = None
) -> VisionEncoder:
    """``"builtin"`` or a local model directory; raises ``ConfigError`` for anything else."""
    if model == "builtin":
        return BuiltinEncoder(device=device, preprocess=preprocess)
    from tensorwire.encoder._hf import HFVisionEncoder

    return HFVisionEncoder(model, device=device, preprocess=preprocess)


def sample_paths() -> list[Path]:
    """The sample images shipped in the package (made by scripts/make_samples.py), sorted by name."""
    return sorted(p for p in SAMPLES_DIR.iterdir() if p.suffix.lower() in (".png", ".jpg", ".jpeg"))


__all__ = [
    "BuiltinEncoder",
    "BuiltinViT",
    "BuiltinViTConfig",
    "ImageEmbedding",
    "PreprocessConfig",
    "SAMPLES_DIR",
    "VisionEncoder",
    "decode_image",
    "grid_position_ids",
    "load_encoder",
    "sample_paths",
    "smart_resize",
]
