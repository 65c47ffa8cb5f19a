"""Deterministic test tensors that are cheap to build at any size and compared byte for byte."""

from __future__ import annotations

from collections.abc import Sequence

import torch

_BLOCK = 1 << 16


def make_tensor(shape: Sequence[int], dtype: torch.dtype | str, seed: int, device: str = "cpu") -> torch.Tensor:
    """Pseudo-random bytes (every 64 KiB block salted by its index, so misplaced blocks are caught) as ``dtype``.

    Floats may hold NaN bit patterns: compare with :func:`same_bytes`, never ``torch.equal``. Bools are 0/1.
    """
    dt: torch.dtype = getattr(torch, dtype) if isinstance(dtype, str) else dtype
    shape = tuple(int(d) for d in shape)
    numel = 1
    for d in shape:
        numel *= d
    itemsize = torch.empty(0, dtype=dt).element_size()
    nbytes = numel * itemsize
    g = torch.Generator().manual_seed(seed)
    base = torch.randint(0, 256, (_BLOCK,), dtype=torch.uint8, generator=g)
    blocks = -(-nbytes // _BLOCK)
    raw = base.repeat(max(blocks, 1))
    if blocks > 1:
        salt = torch.arange(blocks, dtype=torch.int64).remainder(251).to(torch.uint8).repeat_interleave(_BLOCK)
        raw.add_(salt)
    raw = raw[:nbytes]
    if dt == torch.bool:
        raw = raw.bitwise_and(1)
    t = raw.view(dt).reshape(shape) if nbytes else torch.empty(shape, dtype=dt)
    return t.to(device) if device != "cpu" else t


def as_bytes(t: torch.Tensor) -> torch.Tensor:
    """The tensor's bytes as a 1-D uint8 CPU tensor."""
    t = t.detach().contiguous().reshape(-1)
    if t.numel() == 0:
        return torch.empty(0, dtype=torch.uint8)
    return t.view(torch.uint8).cpu()


def same_bytes(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Same shape, dtype and bytes."""
    return a.shape == b.shape and a.dtype == b.dtype and torch.equal(as_bytes(a), as_bytes(b))
