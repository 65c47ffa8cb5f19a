"""Test images: a seeded random 64x64 RGB PNG per seed (each seed a distinct image, so a distinct mm_hash)."""

from __future__ import annotations

from tensorwire.bench.vllm_engine.driver import png as _png


def png(seed: int) -> bytes:
    return _png(seed, 64)
