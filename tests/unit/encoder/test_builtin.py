"""Built-in ViT and preprocessing: real images through real decoding, shapes, determinism, rejections."""

from __future__ import annotations

import io

import pytest
import torch
from PIL import Image

import tensorwire.encoder as enc
from tensorwire.encoder import BuiltinEncoder, PreprocessConfig, load_encoder, sample_paths, smart_resize
from tensorwire.errors import ClosedError, ConfigError, InvalidPayload, Reason


def _png(w: int, h: int, colour: tuple[int, int, int] = (200, 30, 60)) -> bytes:
    buf = io.BytesIO()
    Image.new("RGB", (w, h), colour).save(buf, format="PNG")
    return buf.getvalue()


@pytest.fixture(scope="module")
def encoder() -> BuiltinEncoder:
    return BuiltinEncoder()


def test_public_names() -> None:
    public = {n for n in vars(enc) if not n.startswith("_") and n not in ("annotations", "Path")}
    assert set(enc.__all__) == public
    for name in enc.__all__:
        assert hasattr(enc, name)


def test_samples_shipped() -> None:
    names = [p.name for p in sample_paths()]
    assert "scene_2048x1365.jpg" in names and any(n.endswith(".png") for n in names)
    assert sum(p.stat().st_size for p in sample_paths()) < 2 * 1024 * 1024
    with Image.open(enc.SAMPLES_DIR / "scene_2048x1365.jpg") as im:
        assert im.size == (2048, 1365) and im.format == "JPEG"


@pytest.mark.parametrize("h,w", [(1365, 2048), (448, 448), (30, 30), (57, 5000), (4000, 4000)])
def test_smart_resize_keeps_grid_and_area(h: int, w: int) -> None:
    cfg = PreprocessConfig()
    rh, rw = smart_resize(h, w, 28, cfg.min_pixels, cfg.max_pixels)
    assert rh % 28 == 0 and rw % 28 == 0
    assert rh * rw <= cfg.max_pixels
    assert rh * rw >= min(cfg.min_pixels, 28 * 28)
    assert abs(rw / rh - w / h) / (w / h) < 0.5  # aspect roughly kept (rounding to 28 px on small sides)


def test_encode_shapes_positions_and_determinism(encoder: BuiltinEncoder) -> None:
    data = [p.read_bytes() for p in sample_paths()]
    out = encoder.encode(data)
    assert len(out) == len(data)
    for item, raw in zip(out, data, strict=True):
        with Image.open(io.BytesIO(raw)) as im:
            w, h = im.size
        rows, cols = item.grid
        assert item.original_size == (h, w)
        assert item.embedding.shape == (rows * cols, encoder.hidden_size)
        assert item.embedding.dtype == encoder.dtype and item.embedding.is_contiguous()
        assert torch.isfinite(item.embedding).all()
        assert item.position_ids.dtype == torch.int64 and item.position_ids.shape == (rows * cols, 2)
        assert item.position_ids[-1].tolist() == [rows - 1, cols - 1]
        assert item.position_ids[cols].tolist() == [1, 0]  # row-major
    # Same weights in a second instance (seeded), and different images give different embeddings.
    again = BuiltinEncoder().encode(data[:1])[0]
    assert torch.equal(again.embedding, out[0].embedding)
    a, b = encoder.encode([_png(112, 112, (255, 0, 0)), _png(112, 112, (0, 0, 255))])
    assert not torch.allclose(a.embedding, b.embedding)


def test_position_ids_change_the_output(encoder: BuiltinEncoder) -> None:
    # A flat image: every patch has the same pixels, so only the 2-D position embedding tells tokens apart.
    [flat] = encoder.encode([_png(112, 56)])
    assert flat.grid == (2, 4)
    assert not torch.allclose(flat.embedding[0], flat.embedding[1])


@pytest.mark.parametrize(
    "payload,match",
    [
        (b"", "empty payload"),
        (b"not an image at all", "cannot decode"),
        (_png(64, 64)[:40], "cannot decode"),
    ],
)
def test_bad_images_are_invalid_payload(encoder: BuiltinEncoder, payload: bytes, match: str) -> None:
    with pytest.raises(InvalidPayload, match=match) as info:
        encoder.encode([payload])
    assert info.value.reason is Reason.INVALID_PAYLOAD
    assert encoder.encode([_png(56, 56)])[0].grid == (2, 2)  # still serving


def test_limits() -> None:
    e = BuiltinEncoder(preprocess=PreprocessConfig(max_images=2, max_image_bytes=50_000, max_image_pixels=100 * 100))
    with pytest.raises(InvalidPayload, match="empty request") as info:
        e.encode([])
    assert info.value.reason is Reason.INVALID_REQUEST
    with pytest.raises(InvalidPayload, match="too many images"):
        e.encode([_png(56, 56)] * 3)
    with pytest.raises(InvalidPayload, match="max_image_pixels"):
        e.encode([_png(101, 100)])
    with pytest.raises(InvalidPayload, match="max_image_bytes"):
        e.encode([b"\x89PNG" + b"\0" * 50_001])


def test_close_and_config_errors() -> None:
    e = load_encoder("builtin")
    e.close()
    e.close()
    with pytest.raises(ClosedError):
        e.encode([_png(56, 56)])
    with pytest.raises(ConfigError):
        PreprocessConfig(min_pixels=10, max_pixels=5)
    with pytest.raises(ConfigError, match="no config.json"):
        load_encoder("/nonexistent/model/dir")


def test_bfloat16_weights_give_bfloat16_embeddings() -> None:
    # The CUDA default; runs on CPU too. Catches a float32 position table promoting the activations.
    e = BuiltinEncoder(dtype=torch.bfloat16)
    [out] = e.encode([_png(112, 56)])
    assert out.embedding.dtype == torch.bfloat16 and torch.isfinite(out.embedding.float()).all()
