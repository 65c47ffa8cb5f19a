"""ImageLimits: the pixel budget read from image headers before decoding (issue 15, finding 7)."""

from __future__ import annotations

import io
import time

import pytest
from PIL import Image

from tensorwire.errors import ConfigError, InvalidPayload, Reason
from tensorwire.service._images import ImageLimits, check_pixels, header_size
from tensorwire.testing.hostile import pixel_bomb_png


def _jpeg(w: int, h: int) -> bytes:
    buf = io.BytesIO()
    Image.new("RGB", (w, h)).save(buf, format="JPEG")
    return buf.getvalue()


def test_the_header_names_the_size_without_decoding() -> None:
    bomb = pixel_bomb_png(8192)
    assert len(bomb) < 200_000
    t0 = time.perf_counter()
    assert header_size(bomb, 0) == (8192, 8192)
    assert time.perf_counter() - t0 < 0.2  # a decode of 67 M pixels takes seconds
    assert header_size(_jpeg(640, 480), 1) == (640, 480)
    with pytest.raises(InvalidPayload, match="image 3: cannot decode") as info:
        header_size(b"\x89PNG\r\n not really", 3)
    assert info.value.reason is Reason.INVALID_PAYLOAD  # as the decoder counts it (tensorwire_mm_errors_total)
    assert " object at 0x" not in str(info.value)  # no object reprs (Pillow's "<_io.BytesIO object at 0x..>")


def test_item_and_request_budgets() -> None:
    limits = ImageLimits(max_item_pixels=1000 * 1000, max_request_pixels=2_500_000)
    assert check_pixels([_jpeg(1000, 1000), _jpeg(1000, 1000)], limits) == 2_000_000
    with pytest.raises(InvalidPayload, match=r"image 0: 8192x8192 = 67108864 pixels > max_item_pixels=1000000"):
        check_pixels([pixel_bomb_png(8192)], limits)
    with pytest.raises(InvalidPayload, match="max_request_pixels=2500000"):
        check_pixels([_jpeg(1000, 1000)] * 3, limits)
    assert ImageLimits().max_item_pixels < 8192 * 8192  # the default refuses the bomb of the finding
    with pytest.raises(ConfigError):
        ImageLimits(max_item_pixels=10, max_request_pixels=5)
    with pytest.raises(ConfigError):
        ImageLimits(max_item_pixels=0)
