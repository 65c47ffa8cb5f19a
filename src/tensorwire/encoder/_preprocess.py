"""Image bytes -> normalized pixel tensor on a patch grid. Every rejection is an ``InvalidPayload``."""

from __future__ import annotations

import io
import math
import re
import warnings
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from tensorwire.encoder._config import PreprocessConfig
from tensorwire.errors import InvalidPayload, Reason

if TYPE_CHECKING:
    from PIL import Image

_REPR = re.compile(r"<[\w.]+ object at 0x[0-9a-fA-F]+>")

_FORMATS = ("JPEG", "PNG", "WEBP", "BMP", "GIF")


@dataclass(frozen=True)
class Prepared:
    """One image ready for a vision tower: ``pixels`` is float32 [3, H, W], H and W multiples of the grid unit."""

    pixels: torch.Tensor
    original_size: tuple[int, int]  # (height, width) as decoded
    grid: tuple[int, int]  # (rows, cols) of output tokens


def check_request(images: list[bytes], cfg: PreprocessConfig) -> None:
    """Refuse an empty request or one over ``max_images`` before any decoding."""
    if not images:
        raise InvalidPayload("empty request: no images to encode", reason=Reason.INVALID_REQUEST)
    if len(images) > cfg.max_images:
        raise InvalidPayload(
            f"too many images: {len(images)} > max_images={cfg.max_images}; split the request",
            reason=Reason.INVALID_REQUEST,
        )


def open_image(data: bytes, cfg: PreprocessConfig, *, index: int = 0) -> Image.Image:
    """Decode JPEG/PNG (and a few other Pillow formats), enforcing the byte and pixel limits; mode as stored.

    The pixel limit is checked on the header, before the pixels are allocated.
    """
    from PIL import Image

    if not data:
        raise InvalidPayload(f"image {index}: empty payload (0 bytes)")
    if len(data) > cfg.max_image_bytes:
        raise InvalidPayload(f"image {index}: {len(data)} bytes > max_image_bytes={cfg.max_image_bytes}")
    try:
        with warnings.catch_warnings():
            # Pillow's own bomb check warns or raises at its global limit; ours is per-config and explicit.
            warnings.simplefilter("ignore", Image.DecompressionBombWarning)
            img = Image.open(io.BytesIO(data), formats=_FORMATS)
            w, h = img.size
            if w <= 0 or h <= 0 or w * h > cfg.max_image_pixels:
                raise InvalidPayload(
                    f"image {index}: {w}x{h} = {w * h} pixels > max_image_pixels={cfg.max_image_pixels}"
                )
            img.load()
            return img
    except InvalidPayload:
        raise
    except (OSError, ValueError, SyntaxError, Image.DecompressionBombError) as exc:
        # Pillow reports truncated/unknown data as OSError (UnidentifiedImageError) or SyntaxError.
        raise InvalidPayload(f"image {index}: cannot decode {len(data)} bytes as an image ({_no_repr(exc)})") from exc


def _no_repr(exc: BaseException) -> str:
    """Pillow's message without the object reprs it embeds ("cannot identify image file <_io.BytesIO object at
    0x7f...>"): the address means nothing to the caller, and it makes every message unique to alerting."""
    return " ".join(_REPR.sub("", str(exc)).split()) or type(exc).__name__


def to_rgb(img: Image.Image, *, index: int = 0) -> Image.Image:
    """Pillow's plain RGB conversion (alpha dropped); ``InvalidPayload`` for a mode it cannot convert."""
    try:
        return img.convert("RGB")
    except (OSError, ValueError) as exc:
        raise InvalidPayload(f"image {index}: cannot convert mode {img.mode} to RGB ({exc})") from exc


def decode_image(data: bytes, cfg: PreprocessConfig, *, index: int = 0) -> Image.Image:
    """``open_image`` converted to RGB, what the built-in encoder feeds its tower."""
    return to_rgb(open_image(data, cfg, index=index), index=index)


def smart_resize(height: int, width: int, unit: int, min_pixels: int, max_pixels: int) -> tuple[int, int]:
    """Qwen2-VL's dynamic resolution: sides multiples of ``unit``, area within [min_pixels, max_pixels].

    Raises ``InvalidPayload`` for an aspect ratio above 200 (the result would be a one-token-wide sliver).
    """
    if max(height, width) / max(1, min(height, width)) > 200:
        raise InvalidPayload(f"aspect ratio of {width}x{height} is above 200; crop the image")
    h = max(unit, round(height / unit) * unit)
    w = max(unit, round(width / unit) * unit)
    if h * w > max_pixels:
        beta = math.sqrt((height * width) / max_pixels)
        h = max(unit, math.floor(height / beta / unit) * unit)
        w = max(unit, math.floor(width / beta / unit) * unit)
    elif h * w < min_pixels:
        beta = math.sqrt(min_pixels / (height * width))
        h = math.ceil(height * beta / unit) * unit
        w = math.ceil(width * beta / unit) * unit
    return h, w


def to_tensor(img: Image.Image, size: tuple[int, int], cfg: PreprocessConfig) -> torch.Tensor:
    """Resize (bicubic) to ``size`` = (h, w) and normalize; returns float32 [3, h, w]."""
    import numpy as np
    from PIL import Image

    h, w = size
    if img.size != (w, h):
        img = img.resize((w, h), Image.Resampling.BICUBIC)
    arr = torch.from_numpy(np.asarray(img, dtype=np.uint8).copy()).permute(2, 0, 1).float().div_(255.0)
    mean = torch.tensor(cfg.mean, dtype=torch.float32).view(3, 1, 1)
    std = torch.tensor(cfg.std, dtype=torch.float32).view(3, 1, 1)
    return arr.sub_(mean).div_(std)


def prepare(data: bytes, cfg: PreprocessConfig, unit: int, *, index: int = 0) -> Prepared:
    """Decode, resize onto a grid of ``unit``-pixel tokens (dynamic resolution), normalize."""
    img = decode_image(data, cfg, index=index)
    original = (img.size[1], img.size[0])
    size = smart_resize(original[0], original[1], unit, cfg.min_pixels, cfg.max_pixels)
    pixels = to_tensor(img, size, cfg)
    return Prepared(pixels=pixels, original_size=original, grid=(size[0] // unit, size[1] // unit))


def grid_position_ids(rows: int, cols: int) -> torch.Tensor:
    """Row-major 2-D position ids, int64 [rows * cols, 2] with (row, col) per token."""
    r = torch.arange(rows, dtype=torch.int64).repeat_interleave(cols)
    c = torch.arange(cols, dtype=torch.int64).repeat(rows)
    return torch.stack([r, c], dim=1)
