"""Segments (``_vllm_ec.segments``): every page allocated before a READ lands in it, without holding the GIL where
the kernel allows, and a clear error where it cannot allocate them."""

from __future__ import annotations

import ctypes
import errno
import mmap
import os
import threading
import time
from typing import Any

import pytest
import torch

from tensorwire.errors import ReadError, Reason
from tensorwire.integrations._vllm_ec import segments
from tensorwire.integrations._vllm_ec.segments import SegmentSpares

_PAGE = mmap.PAGESIZE


def _resident_pages(t: torch.Tensor) -> int:
    """Pages of ``t``'s mapping that exist (mincore), without touching them."""
    libc = ctypes.CDLL(None, use_errno=True)
    n = (t.numel() + _PAGE - 1) // _PAGE
    vec = (ctypes.c_ubyte * n)()
    libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
    assert libc.mincore(ctypes.c_void_p(t.data_ptr()), ctypes.c_size_t(t.numel()), vec) == 0, ctypes.get_errno()
    return sum(1 for b in vec if b & 1)


def test_a_segment_has_every_page_before_anything_is_written() -> None:
    seg = segments._Segment(64 * _PAGE + 10)
    try:
        assert _resident_pages(seg.tensor) == 65
        assert int(seg.tensor.sum()) == 0
    finally:
        seg.close()


def test_an_old_kernel_falls_back_to_map_populate_once(monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[int] = []

    def einval(addr: int, length: int, advice: int) -> int:
        calls.append(advice)
        ctypes.set_errno(errno.EINVAL)
        return -1

    monkeypatch.setattr(segments, "_populate_write", einval)
    seg = segments._Segment(16 * _PAGE)
    try:
        assert calls == [segments._MADV_POPULATE_WRITE]
        assert segments._populate_write is None  # not asked again in this process
        assert _resident_pages(seg.tensor) == 16
    finally:
        seg.close()
    seg = segments._Segment(8 * _PAGE)  # straight to MAP_POPULATE
    try:
        assert calls == [segments._MADV_POPULATE_WRITE] and _resident_pages(seg.tensor) == 8
    finally:
        seg.close()


def test_no_memory_for_a_segment_is_an_error_and_no_spare(monkeypatch: pytest.MonkeyPatch) -> None:
    def enomem(addr: int, length: int, advice: int) -> int:
        ctypes.set_errno(errno.ENOMEM)
        return -1

    monkeypatch.setattr(segments, "_populate_write", enomem)
    before = set(os.listdir("/proc/self/fd"))
    with pytest.raises(OSError, match="MADV_POPULATE_WRITE") as info:
        segments._Segment(4 * _PAGE)
    assert info.value.errno == errno.ENOMEM
    assert set(os.listdir("/proc/self/fd")) <= before  # the memfd was closed
    spares = SegmentSpares()
    try:
        spares.refill(4 * _PAGE)
        done = threading.Event()
        spares._maker.submit(done.set)  # type: ignore[union-attr]  # runs after the refill
        assert done.wait(30)
        assert spares.spare_bytes == 0
        # Taken with no spare ready: a typed ReadError the fetch reports as pool_exhausted, not "unknown".
        with pytest.raises(ReadError, match="no memory") as taken:
            spares.take(4 * _PAGE)
        assert taken.value.reason is Reason.POOL_EXHAUSTED and isinstance(taken.value.__cause__, OSError)
    finally:
        spares.close()


def test_a_spare_is_made_a_delay_after_the_refill_even_while_reads_go_on() -> None:
    """Not beside the rest of the hand-off that took the last segment; and takes that keep coming (a steady
    stream of items, of any size) do not hold it back."""
    delay_s = 0.3
    spares = SegmentSpares(delay_s=delay_s)
    try:
        spares.take(4 * _PAGE).close()
        asked = time.monotonic()
        spares.refill(4 * _PAGE)
        deadline = asked + 60
        while spares.spare_bytes == 0 and time.monotonic() < deadline:
            spares.take(8 * _PAGE).close()  # none spare of that size: made now, and no refill asked
            time.sleep(0.02)
        seen = time.monotonic()
        assert spares.spare_bytes == 4 * _PAGE
        assert seen - asked >= delay_s, f"the spare was made {seen - asked:.3f} s after the refill"
    finally:
        spares.close()


def test_close_does_not_wait_for_a_pending_spare() -> None:
    spares = SegmentSpares(delay_s=600.0)
    spares.take(4 * _PAGE).close()
    spares.refill(4 * _PAGE)
    t0 = time.monotonic()
    spares.close()
    assert time.monotonic() - t0 < 60 and spares.spare_bytes == 0


def test_the_pages_are_allocated_by_a_call_that_releases_the_gil() -> None:
    """CPython's mmap() holds the GIL; the maker thread must not stall the engine's threads while pages are
    allocated (~0.4 ms per MB), so the allocation goes through a ctypes foreign call, which releases it."""
    if segments._populate_write is None:
        pytest.skip("this kernel has no MADV_POPULATE_WRITE: MAP_POPULATE is the fallback")
    fn: Any = segments._populate_write
    assert isinstance(fn, ctypes._CFuncPtr) and not (fn._flags_ & ctypes._FUNCFLAG_PYTHONAPI)  # type: ignore[attr-defined]
