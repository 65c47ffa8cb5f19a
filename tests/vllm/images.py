"""Test images: a seeded random 64x64 RGB PNG per seed (each seed a distinct image, so a distinct mm_hash)."""

from __future__ import annotations

import io

import numpy as np


def png(seed: int) -> bytes:
    from PIL import Image

    arr = np.random.default_rng(seed).integers(0, 255, (64, 64, 3), dtype=np.uint8)
    buf = io.BytesIO()
    Image.fromarray(arr).save(buf, format="PNG")
    return buf.getvalue()
