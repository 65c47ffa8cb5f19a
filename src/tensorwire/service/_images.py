"""ImageLimits: the pixel budget of one encoder worker, checked from the image headers before anything is decoded.

``check_pixels`` refuses an item over ``max_item_pixels`` or a request over ``max_request_pixels``
(``InvalidPayload``, reason ``invalid_request``), and an item whose header does not parse (``invalid_payload``).
Environment: ``TENSORWIRE_WORKER_<FIELD>``; flags ``--<field>`` of ``serve-encoder``.
"""

from __future__ import annotations

import io
import warnings
from collections.abc import Sequence
from dataclasses import dataclass

from tensorwire.errors import ConfigError, InvalidPayload, Reason

ENV_IMAGE_PREFIX = "TENSORWIRE_WORKER_"
_FORMATS = ("JPEG", "PNG", "WEBP", "BMP", "GIF")  # the formats the reference encoders decode


@dataclass(frozen=True)
class ImageLimits:
    max_item_pixels: int = 25_000_000  # a 6000x4000 photo; the 8192x8192 bomb is refused
    max_request_pixels: int = 100_000_000

    def __post_init__(self) -> None:
        for name in ("max_item_pixels", "max_request_pixels"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise ConfigError(f"{name}={value!r} must be a positive integer")
        if self.max_item_pixels > self.max_request_pixels:
            raise ConfigError(
                f"max_item_pixels={self.max_item_pixels} must be <= max_request_pixels={self.max_request_pixels}"
            )


def header_size(data: bytes, index: int) -> tuple[int, int]:
    """(width, height) from the image header, without decoding pixels; ``InvalidPayload`` when it does not parse."""
    from PIL import Image

    from tensorwire.encoder._preprocess import _no_repr  # the decoder's wording, without Pillow's object reprs

    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", Image.DecompressionBombWarning)  # the budget below is the check
            with Image.open(io.BytesIO(data), formats=_FORMATS) as img:
                width, height = img.size
    except (OSError, ValueError, SyntaxError, Image.DecompressionBombError) as exc:
        # The reason the decoder gives a file it cannot decode (invalid_payload): the check only comes first.
        raise InvalidPayload(
            f"image {index}: cannot decode the header of {len(data)} bytes as an image ({_no_repr(exc)})"
        ) from exc
    return int(width), int(height)


def check_pixels(images: Sequence[bytes], limits: ImageLimits) -> int:
    """Refuses (``InvalidPayload``) an item or a request over the pixel budget; returns the request's pixels."""
    total = 0
    for i, data in enumerate(images):
        width, height = header_size(data, i)
        pixels = width * height
        if pixels > limits.max_item_pixels:
            raise InvalidPayload(
                f"image {i}: {width}x{height} = {pixels} pixels > max_item_pixels="
                f"{limits.max_item_pixels}; refused before decoding",
                reason=Reason.INVALID_REQUEST,
            )
        total += pixels
        if total > limits.max_request_pixels:
            raise InvalidPayload(
                f"images 0..{i}: {total} pixels > max_request_pixels={limits.max_request_pixels}; split the request",
                reason=Reason.INVALID_REQUEST,
            )
    return total


__all__ = ["ENV_IMAGE_PREFIX", "ImageLimits", "check_pixels", "header_size"]
