"""``_ready``: a receive buffer whose queued work cannot be waited for goes back to its pool, with a typed error."""

from __future__ import annotations

from typing import Any

import pytest

from tensorwire.errors import ReadError, Reason
from tensorwire.rdma._reader import _ready


class _Pool:
    def __init__(self) -> None:
        self.released: list[Any] = []

    def release(self, slot: Any) -> None:
        self.released.append(slot)


class _Slot:
    def __init__(self, ready: Any) -> None:
        self.ready = ready


class _Event:
    def __init__(self, fail: bool) -> None:
        self.fail, self.waited = fail, False

    def synchronize(self) -> None:
        self.waited = True
        if self.fail:
            raise RuntimeError("CUDA error: an illegal memory access was encountered")


def test_waits_once_and_clears_the_event() -> None:
    pool, event = _Pool(), _Event(fail=False)
    slot = _Slot(event)
    assert _ready(pool, slot) is slot  # type: ignore[arg-type]
    assert event.waited and slot.ready is None and pool.released == []


def test_a_failed_wait_returns_the_slot_and_raises_read_error() -> None:
    pool, slot = _Pool(), _Slot(_Event(fail=True))
    with pytest.raises(ReadError) as info:
        _ready(pool, slot)  # type: ignore[arg-type]
    assert info.value.reason is Reason.RDMA_READ_ERROR
    assert pool.released == [slot]
