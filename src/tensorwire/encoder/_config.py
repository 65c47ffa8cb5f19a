"""Configuration of the reference encoders: input limits, resolution policy, built-in ViT shape."""

from __future__ import annotations

from dataclasses import dataclass

from tensorwire.errors import ConfigError


@dataclass(frozen=True)
class PreprocessConfig:
    """Input limits and the resize policy shared by every encoder.

    The built-in encoder's resize follows Qwen2-VL's dynamic resolution: keep the aspect ratio, make both sides a
    multiple of ``patch_size * merge_size`` and keep ``min_pixels <= h * w <= max_pixels``, then ``mean``/``std``.
    A Hugging Face model (``--model DIR``) uses only the limits here; its resize and normalization come from its
    own image processor configuration. The limits run before decoding
    (``max_image_bytes``) and right after reading the header (``max_image_pixels``), so a decompression bomb
    is refused without allocating its pixels.
    """

    max_images: int = 16
    max_image_bytes: int = 32 * 1024 * 1024
    max_image_pixels: int = 8192 * 8192
    min_pixels: int = 56 * 56
    max_pixels: int = 1280 * 28 * 28
    mean: tuple[float, float, float] = (0.48145466, 0.4578275, 0.40821073)  # OpenAI CLIP
    std: tuple[float, float, float] = (0.26862954, 0.26130258, 0.27577711)

    def __post_init__(self) -> None:
        for name in ("max_images", "max_image_bytes", "max_image_pixels", "min_pixels", "max_pixels"):
            if int(getattr(self, name)) <= 0:
                raise ConfigError(f"PreprocessConfig.{name} must be > 0, got {getattr(self, name)}")
        if self.min_pixels > self.max_pixels:
            raise ConfigError(f"PreprocessConfig.min_pixels ({self.min_pixels}) > max_pixels ({self.max_pixels})")
        if len(self.mean) != 3 or len(self.std) != 3 or any(s <= 0 for s in self.std):
            raise ConfigError("PreprocessConfig.mean/std need 3 values each, std > 0")


@dataclass(frozen=True)
class BuiltinViTConfig:
    """Shape of the built-in ViT. Small on purpose: a 2048x1365 image encodes in well under a second on 2 cores.

    Each output token covers ``patch_size * merge_size`` pixels square (28 px, like Qwen2-VL); ``out_dim`` plays
    the role of the LLM hidden size the merger projects to, so it sets the size of what the transport moves.
    """

    patch_size: int = 14
    merge_size: int = 2
    hidden: int = 256
    depth: int = 2
    heads: int = 4
    mlp_ratio: int = 4
    out_dim: int = 2048
    seed: int = 20261129

    def __post_init__(self) -> None:
        for name in ("patch_size", "merge_size", "hidden", "depth", "heads", "mlp_ratio", "out_dim"):
            if int(getattr(self, name)) <= 0:
                raise ConfigError(f"BuiltinViTConfig.{name} must be > 0, got {getattr(self, name)}")
        if self.hidden % self.heads or self.hidden % 4:
            raise ConfigError(f"BuiltinViTConfig.hidden ({self.hidden}) must divide by heads ({self.heads}) and 4")
