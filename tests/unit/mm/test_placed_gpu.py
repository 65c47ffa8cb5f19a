"""A CUDA receive buffer's loans (``RecvBuffer.lend``, needs CUDA): each tensor wraps its own bytes in one torch op
(``wrap_device_as``), and the loan ends only when the last tensor built on any of them is gone. The whole path
between processes is tests/integration/mm/test_mm_gpu.py."""

from __future__ import annotations

import gc

import pytest
import torch

from tensorwire.mm.wire import _placed
from tensorwire.rdma._devmem import wrap_device, wrap_device_as
from tensorwire.rdma._dtypes import SUPPORTED_DTYPES

pytestmark = [pytest.mark.gpu, pytest.mark.timeout(120)]

DEV = torch.device("cuda:0")


def _pattern(nbytes: int) -> torch.Tensor:
    return (torch.arange(nbytes, device=DEV, dtype=torch.int64) * 7919 % 251).to(torch.uint8)


@pytest.mark.parametrize("dtype", SUPPORTED_DTYPES, ids=str)
def test_wrap_device_as_is_typed_view_of_the_same_bytes(dtype: torch.dtype) -> None:
    mem = torch.empty(1 << 16, dtype=torch.uint8, device=DEV)
    mem.copy_(_pattern(mem.numel()))
    off, shape = 1024, (5, 7, 3)
    got, holder = wrap_device_as(mem.data_ptr() + off, shape, dtype, DEV)
    assert got.dtype == dtype and got.shape == shape and got.is_contiguous() and got.data_ptr() == mem.data_ptr() + off
    want = _placed.typed_view(mem, off, shape, dtype)
    assert torch.equal(got.reshape(-1).view(torch.uint8), want.reshape(-1).view(torch.uint8))  # bitwise: NaNs too
    assert got.untyped_storage().data_ptr() == got.data_ptr()  # a wrap, not a copy
    base, _ = wrap_device(mem.data_ptr(), 64, DEV)
    assert base.dtype == torch.uint8 and base.shape == (64,)
    del holder


def test_a_loan_of_several_tensors_ends_with_the_last_one_built_on_any() -> None:
    buf = _placed.RecvBuffer(1, _placed.MIN_BUFFER_BYTES, DEV)
    try:
        raw, _ = wrap_device(buf._ptr, buf.nbytes, DEV)  # the test's own view of the whole buffer
        raw.copy_(_pattern(buf.nbytes))
        parts = [
            (0, (40, 16), torch.bfloat16),
            (2048, (40, 3), torch.int64),
            (4096, (0, 8), torch.float32),
            (8192, (9,), torch.bool),
        ]
        ended: list[_placed.RecvBuffer] = []
        buf.busy = True
        emb, pos, empty, flags = buf.lend(parts, ended.append)
        for t, (off, shape, dtype) in zip((emb, pos, empty, flags), parts, strict=True):
            assert t.device == DEV and t.dtype == dtype and t.shape == shape
            if t.numel():
                assert t.data_ptr() == buf._ptr + off
                assert torch.equal(
                    t.reshape(-1).view(torch.uint8),
                    _placed.typed_view(raw, off, shape, dtype).reshape(-1).view(torch.uint8),
                )
        row = emb[3]  # a view outlives its tensor and holds the loan
        del t, emb, pos, empty
        gc.collect()
        assert not ended
        del flags
        gc.collect()
        assert not ended
        row.fill_(2.5)  # queued on the current stream: the next lending waits for it (the loan's event)
        del row
        gc.collect()
        assert ended == [buf]
        buf.wait_ready()
        assert bool((_placed.typed_view(raw, 3 * 32, (16,), torch.bfloat16) == 2.5).all())
        # Only empty tensors: nothing of the buffer is held, so the loan ends at once.
        ended.clear()
        (nothing,) = buf.lend([(0, (0,), torch.float16)], ended.append)
        assert nothing.numel() == 0 and ended == [buf]
    finally:
        gc.collect()
        buf.close()
