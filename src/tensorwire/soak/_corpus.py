"""The soak's inputs and the outputs they must produce.

The expected output of every input is recomputed in the soak's own process by the same deterministic built-in
ViT the workers run; clients compare a SHA-256 of each fetched output (shapes, dtypes, raw bytes) with it. The
runner first checks that a plain fetch matches, so a non-reproducible torch build is reported as such.
"""

from __future__ import annotations

import hashlib
import io
import random
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

# (width, height) of the generated images: 4 to 192 output tokens (32 KiB to 1.5 MiB of float32 at 2048 wide),
# so requests span one small slot to a few hundred KiB per slot while staying cheap on a 2-core machine.
IMAGE_SIZES: tuple[tuple[int, int], ...] = ((56, 56), (84, 112), (140, 140), (224, 168), (280, 224), (448, 336))


@dataclass(frozen=True)
class Corpus:
    """Images (PNG/JPEG bytes) and, per request shape, the expected digest."""

    images: tuple[bytes, ...]
    digests: dict[tuple[int, ...], str]  # key: image indexes of one request, in order

    def expected(self, key: Sequence[int]) -> str | None:
        return self.digests.get(tuple(key))


def make_images(seed: int) -> list[bytes]:
    """Deterministic, varied images: noise blocks and gradients, alternately PNG and JPEG."""
    from PIL import Image

    rng = random.Random(seed)
    out = []
    for i, (w, h) in enumerate(IMAGE_SIZES):
        img = Image.new("RGB", (w, h))
        px = img.load()
        assert px is not None, "a new image is loaded"
        a, b, c = rng.randrange(256), rng.randrange(256), rng.randrange(256)
        for y in range(h):
            for x in range(w):
                px[x, y] = ((a + x * 3) % 256, (b + y * 5) % 256, (c + (x ^ y)) % 256)
        buf = io.BytesIO()
        img.save(buf, format="PNG" if i % 2 == 0 else "JPEG", quality=90)
        out.append(buf.getvalue())
    return out


def request_keys(n_images: int) -> list[tuple[int, ...]]:
    """Request shapes the soak sends: every single image, plus a few two-image requests."""
    keys: list[tuple[int, ...]] = [(i,) for i in range(n_images)]
    keys += [(0, n_images - 1), (1, 2), (n_images - 2, 0)]
    return keys


def output_digest(embeddings: Sequence[Any], position_ids: Sequence[Any] | None) -> str:
    """SHA-256 over (shape, dtype, bytes) of every embedding, then every position-id tensor."""
    import torch

    h = hashlib.sha256()
    for group_name, group in (("emb", embeddings), ("pos", position_ids or [])):
        h.update(group_name.encode())
        for t in group:
            t = t.detach().to("cpu").contiguous()
            h.update(repr((tuple(t.shape), str(t.dtype))).encode())
            h.update(t.view(torch.uint8).numpy().tobytes() if t.numel() else b"")
    return h.hexdigest()


def build_corpus(seed: int) -> Corpus:
    """Encodes every request shape locally with the built-in ViT (CPU, float32) and records the digests."""
    from tensorwire.encoder import load_encoder

    images = make_images(seed)
    encoder = load_encoder("builtin", device="cpu")
    try:
        singles = encoder.encode(images)
    finally:
        encoder.close()
    digests = {}
    for key in request_keys(len(images)):
        parts = [singles[i] for i in key]
        digests[key] = output_digest([p.embedding for p in parts], [p.position_ids for p in parts])
    return Corpus(images=tuple(images), digests=digests)


__all__ = ["Corpus", "IMAGE_SIZES", "build_corpus", "make_images", "output_digest", "request_keys"]
