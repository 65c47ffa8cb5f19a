"""``--model DIR``: a Hugging Face vision tower loaded from a local directory, never from the network.

Supported ``config.json`` model types:
- ``clip``, ``clip_vision_model`` (CLIPVisionModel; the CLS token is dropped so tokens match the patch grid),
- ``siglip``, ``siglip_vision_model`` (SiglipVisionModel),
- ``qwen2_vl`` (its ``vision_config``; weights under ``visual.`` or ``model.visual.``) and ``qwen2_vl_vision``
  (a tower saved on its own): dynamic resolution, output tokens after the 2x2 merger.

What the directory must hold, and why:
- Weights as safetensors only (``model.safetensors`` or its shards). Pickled weights (``pytorch_model.bin``,
  ``*.pt``, ...) are refused with ``UnsafeWeights`` before transformers sees them: unpickling a file can run
  code, and a model directory is often downloaded from somewhere else.
- The model's own image processor configuration (``preprocessor_config.json``, as ``save_pretrained`` writes
  it). Images go through ``AutoImageProcessor`` built from it, so the tower sees exactly the pixels it was
  trained on (CLIP: shortest edge resized, then center-cropped; SigLIP: resized to its square; Qwen2-VL: its
  own min/max pixels and patch layout). Nothing is guessed: without that file the directory is refused.
Nothing is downloaded (``local_files_only``, ``HF_HUB_OFFLINE``) and no code from the directory runs
(``trust_remote_code=False``).
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from tensorwire.encoder._base import ImageEmbedding, VisionEncoder
from tensorwire.encoder._config import PreprocessConfig
from tensorwire.encoder._preprocess import grid_position_ids, open_image, to_rgb
from tensorwire.errors import ConfigError, InvalidPayload, Reason, UnsafeWeights

log = logging.getLogger(__name__)

_CLIP_TYPES = ("clip", "clip_vision_model")
_SIGLIP_TYPES = ("siglip", "siglip_vision_model")
_QWEN_TYPES = ("qwen2_vl", "qwen2_vl_vision")
# Weight files that torch.load would unpickle; listed so the refusal can name what it found.
_PICKLED_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt", ".pkl", ".pickle")
_CONVERT_HINT = (
    'convert them once, in an environment you trust: python -c "import transformers as t; '
    "t.AutoModel.from_pretrained('{root}', use_safetensors=False).save_pretrained('{root}')\" "
    "(writes model.safetensors), then delete {names}"
)


def _import_transformers() -> Any:
    # Refuse the network before transformers reads its environment; a missing file must fail, not download.
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
    try:
        import transformers
    except ImportError as exc:
        raise ConfigError(
            "--model DIR needs Hugging Face transformers: pip install 'tensorwire[hf]'",
            reason=Reason.PROVIDER_UNAVAILABLE,
        ) from exc
    return transformers


def check_safetensors(root: Path) -> list[Path]:
    """The directory's ``*.safetensors`` files; ``UnsafeWeights`` when it has only pickled weights.

    A directory with both loads the safetensors and ignores the rest. One with neither raises ``ConfigError``.
    """
    safe = sorted(root.glob("*.safetensors"))
    if safe:
        return safe
    pickled = sorted(p.name for p in root.iterdir() if p.is_file() and p.suffix.lower() in _PICKLED_SUFFIXES)
    if pickled:
        names = ", ".join(pickled)
        raise UnsafeWeights(
            f"--model {root}: only pickled weights ({names}); tensorwire loads safetensors only, because "
            f"unpickling can run code: " + _CONVERT_HINT.format(root=root, names=names)
        )
    raise ConfigError(f"--model {root}: no weights there (expected model.safetensors or model-*.safetensors)")


def _load_processor(tf: Any, root: Path) -> Any:
    try:
        return tf.AutoImageProcessor.from_pretrained(root, local_files_only=True, trust_remote_code=False)
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise ConfigError(
            f"--model {root}: cannot load the model's image processor ({exc}); the directory needs the "
            "preprocessor_config.json that belongs to the model (AutoImageProcessor.from_pretrained(<the model's "
            f"repository>).save_pretrained('{root}') writes it); tensorwire does not guess preprocessing"
        ) from exc


class HFVisionEncoder(VisionEncoder):
    """A transformers vision model from ``path`` (see the module docstring for the accepted types).

    ``preprocess`` supplies the request limits (images per request, bytes, decoded pixels); the resize and
    normalization come from the directory's image processor (``self.image_processor``), not from it.
    """

    def __init__(
        self,
        path: str | os.PathLike[str],
        *,
        device: str = "cpu",
        preprocess: PreprocessConfig | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        root = Path(path)
        if not (root / "config.json").is_file():
            raise ConfigError(f"--model {root}: no config.json there; pass 'builtin' or a saved model directory")
        try:
            model_type = json.loads((root / "config.json").read_text()).get("model_type", "")
        except (OSError, ValueError) as exc:
            raise ConfigError(f"--model {root}: unreadable config.json ({exc})") from exc
        if model_type not in (*_CLIP_TYPES, *_SIGLIP_TYPES, *_QWEN_TYPES):
            raise ConfigError(
                f"--model {root}: model_type {model_type!r} is not supported "
                f"({', '.join((*_CLIP_TYPES, *_SIGLIP_TYPES, *_QWEN_TYPES))})"
            )
        weights = check_safetensors(root)
        tf = _import_transformers()
        self._qwen = model_type in _QWEN_TYPES
        self._drop_cls = model_type in _CLIP_TYPES
        try:
            if model_type in _CLIP_TYPES:
                model = tf.CLIPVisionModel.from_pretrained(root, local_files_only=True, use_safetensors=True)
            elif model_type in _SIGLIP_TYPES:
                model = tf.SiglipVisionModel.from_pretrained(root, local_files_only=True, use_safetensors=True)
            else:
                model = self._load_qwen_tower(root, model_type, weights)
        except ConfigError:
            raise
        except (OSError, ValueError, KeyError) as exc:
            raise ConfigError(f"--model {root}: cannot load {model_type} weights: {exc}") from exc
        self.image_processor = _load_processor(tf, root)
        super().__init__(name=f"hf:{root.name}", device=device, preprocess=preprocess or PreprocessConfig())
        self._dtype = dtype or (torch.bfloat16 if self.device.type == "cuda" else torch.float32)
        # dtype applied after loading: from_pretrained's dtype keyword changed name across transformers versions.
        self.model = model.to(device=self.device, dtype=self._dtype).eval()
        cfg = self.model.config
        self._patch = int(cfg.patch_size)
        if self._qwen:
            self._merge = int(cfg.spatial_merge_size)
            self._hidden = int(getattr(cfg, "hidden_size", None) or cfg.embed_dim)
        else:
            self._image_size = int(cfg.image_size)
            self._hidden = int(cfg.hidden_size)
        self._check_processor(root)
        log.info("loaded %s from %s, preprocessing with %s", model_type, root, type(self.image_processor).__name__)

    def _load_qwen_tower(self, root: Path, model_type: str, weights: list[Path]) -> Any:
        from transformers.models.qwen2_vl.configuration_qwen2_vl import Qwen2VLConfig, Qwen2VLVisionConfig
        from transformers.models.qwen2_vl.modeling_qwen2_vl import Qwen2VisionTransformerPretrainedModel

        if model_type == "qwen2_vl_vision":
            return Qwen2VisionTransformerPretrainedModel.from_pretrained(
                root, local_files_only=True, use_safetensors=True
            )
        # A full Qwen2-VL checkpoint: build only the tower and take its weights from the state dict.
        from safetensors.torch import load_file

        vcfg = Qwen2VLConfig.from_pretrained(root, local_files_only=True).vision_config
        if not isinstance(vcfg, Qwen2VLVisionConfig):
            raise ConfigError(f"--model {root}: config.json has no Qwen2-VL vision_config ({type(vcfg).__name__})")
        # transformers leaves _from_config unannotated
        tower = Qwen2VisionTransformerPretrainedModel._from_config(vcfg)  # type: ignore[no-untyped-call]
        state: dict[str, torch.Tensor] = {}
        for f in weights:
            for key, value in load_file(str(f)).items():
                for prefix in ("model.visual.", "visual."):
                    if key.startswith(prefix):
                        state[key[len(prefix) :]] = value
        missing, unexpected = tower.load_state_dict(state, strict=False)
        if missing:
            raise ConfigError(f"--model {root}: {len(missing)} vision tower weights missing, e.g. {missing[:3]}")
        return tower

    def _check_processor(self, root: Path) -> None:
        """Run the processor on a small non-square image: a processor that does not fit the tower fails here."""
        from PIL import Image

        name = type(self.image_processor).__name__
        try:
            out, grids = self._process([Image.new("RGB", (96, 64), (128, 64, 32))])
        except (InvalidPayload, KeyError, RuntimeError) as exc:
            raise ConfigError(f"--model {root}: its image processor {name} failed on a test image ({exc})") from exc
        pixels = out["pixel_values"]
        if self._qwen:
            p, m = self._patch, self._merge
            width = 3 * int(self.model.config.temporal_patch_size) * p * p
            rows, cols = grids[0]
            if pixels.dim() != 2 or pixels.shape[1] != width or pixels.shape[0] != rows * cols * m * m:
                raise ConfigError(
                    f"--model {root}: image processor {name} gives patches {tuple(pixels.shape)}, "
                    f"the Qwen2-VL tower takes [n, {width}] in {m}x{m} merge units"
                )
        elif pixels.dim() != 4 or tuple(pixels.shape[1:]) != (3, self._image_size, self._image_size):
            raise ConfigError(
                f"--model {root}: image processor {name} gives pixels {tuple(pixels.shape)}, the "
                f"tower takes [n, 3, {self._image_size}, {self._image_size}]"
            )

    def _process(self, images: list[Any]) -> tuple[Any, list[tuple[int, int]]]:
        """The processor's output (``pixel_values``, Qwen2-VL also ``image_grid_thw``) and each token grid."""
        try:
            out = self.image_processor(images=images, return_tensors="pt")
        except (ValueError, TypeError, OSError) as exc:  # e.g. an image mode the processor cannot read
            raise InvalidPayload(f"{type(self.image_processor).__name__} cannot process the request: {exc}") from exc
        if self._qwen:
            return out, [(int(h) // self._merge, int(w) // self._merge) for _, h, w in out["image_grid_thw"].tolist()]
        pixels = out["pixel_values"]
        return out, [(int(pixels.shape[-2]) // self._patch, int(pixels.shape[-1]) // self._patch)] * len(images)

    @property
    def hidden_size(self) -> int:
        return self._hidden

    @property
    def dtype(self) -> torch.dtype:
        return self._dtype

    def _open(self, data: bytes, index: int) -> Any:
        img = open_image(data, self.preprocess, index=index)
        if getattr(self.image_processor, "do_convert_rgb", False):
            return img  # the processor converts, compositing transparency onto white: leave that to it
        return to_rgb(img, index=index)

    def _encode(self, images: Sequence[bytes]) -> list[ImageEmbedding]:
        decoded = [self._open(d, i) for i, d in enumerate(images)]
        sizes = [(img.size[1], img.size[0]) for img in decoded]
        if self._qwen:
            # One image per forward: the tower's attention is per image anyway, and the output then does not depend
            # on what else shares the request.
            return [self._encode_qwen(img, size) for img, size in zip(decoded, sizes, strict=True)]
        out, grids = self._process(decoded)
        pixels = out["pixel_values"].to(device=self.device, dtype=self._dtype)
        hidden = self.model(pixel_values=pixels).last_hidden_state
        if self._drop_cls:
            hidden = hidden[:, 1:]
        return [
            ImageEmbedding(
                embedding=hidden[i].contiguous().clone(),
                position_ids=grid_position_ids(*grids[i]).to(self.device),
                grid=grids[i],
                original_size=sizes[i],
            )
            for i in range(len(decoded))
        ]

    def _encode_qwen(self, image: Any, size: tuple[int, int]) -> ImageEmbedding:
        # The processor's patch order and grid_thw go to the tower as they are: both define the layout.
        out, [grid] = self._process([image])
        emb = self.model(
            out["pixel_values"].to(device=self.device, dtype=self._dtype),
            grid_thw=out["image_grid_thw"].to(self.device),
        )
        if not isinstance(emb, torch.Tensor):  # transformers 5 returns a model output; the merged tokens are pooled
            emb = emb.pooler_output if getattr(emb, "pooler_output", None) is not None else emb.last_hidden_state
        return ImageEmbedding(
            embedding=emb.contiguous(),
            position_ids=grid_position_ids(*grid).to(self.device),
            grid=grid,
            original_size=size,
        )
