from __future__ import annotations

import threading
import time

import pytest
from prometheus_client import CollectorRegistry

from tensorwire.errors import PeerUnavailable
from tensorwire.mm import TransportMetrics
from tensorwire.mm.client._release import ReleaseQueue


class Sender:
    """Records calls; can be held so that the queue backs up."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, list[str], float]] = []
        self.gate = threading.Event()
        self.gate.set()
        self.entered = threading.Event()
        self.fail = False

    def __call__(self, endpoint: str, ids: list[str], timeout_s: float) -> None:
        self.entered.set()
        assert self.gate.wait(10)
        self.calls.append((endpoint, list(ids), timeout_s))
        if self.fail:
            raise PeerUnavailable("down")


def wait_for(pred, timeout_s: float = 5.0) -> None:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout_s
    while not pred():
        assert time.monotonic() < deadline, "condition not reached"
        time.sleep(0.005)


def ids(prefix: str, n: int) -> list[str]:
    return [f"{prefix}{i}" for i in range(n)]


@pytest.mark.timeout(30)
def test_batches_one_rpc_per_endpoint() -> None:
    s = Sender()
    s.gate.clear()
    with ReleaseQueue(s, max_pending=100, release_timeout_ms=700) as q:
        q.submit("e1", ["warm"])
        assert s.entered.wait(5)  # the thread is inside an RPC; everything below queues up
        q.submit("e1", ["a", "b"])
        q.submit("e2", ["c"])
        q.submit("e1", ["d"])
        q.submit("e2", [])  # empty: nothing queued
        s.gate.set()
        wait_for(lambda: q.pending == 0)
    assert s.calls[0] == ("e1", ["warm"], 0.7)
    assert sorted((e, sorted(i)) for e, i, _ in s.calls[1:]) == [("e1", ["a", "b", "d"]), ("e2", ["c"])]


@pytest.mark.timeout(30)
@pytest.mark.parametrize("extra,accepted", [(1022, True), (1023, True), (1024, False)])
def test_saturation_boundary_drops_and_counts_without_blocking(extra: int, accepted: bool) -> None:
    reg = CollectorRegistry()
    s = Sender()
    s.gate.clear()
    q = ReleaseQueue(s, max_pending=1024, release_timeout_ms=1000, metrics=TransportMetrics(reg))
    try:
        q.submit("e", ["first"])  # in flight, still counted as pending
        assert s.entered.wait(5)
        t0 = time.perf_counter()
        ok = q.submit("e", ids("x", extra))
        assert time.perf_counter() - t0 < 0.05  # never blocks the caller
        assert ok is accepted
        assert q.pending == (1 + extra if accepted else 1)
        dropped = reg.get_sample_value(
            "tensorwire_mm_release_queue_dropped_leases_total", {"reason": "release_queue_full"}
        )
        assert (dropped or 0) == (0 if accepted else extra)
        s.gate.set()
        wait_for(lambda: q.pending == 0)
    finally:
        s.gate.set()
        q.close()
    assert q.pending == 0
    assert reg.get_sample_value("tensorwire_mm_release_queue_pending_leases") == 0


@pytest.mark.timeout(30)
def test_one_call_larger_than_the_bound_is_dropped_whole() -> None:
    s = Sender()
    with ReleaseQueue(s, max_pending=1024, release_timeout_ms=1000) as q:
        assert not q.submit("e", ids("y", 1025))
        assert q.dropped == 1025 and q.pending == 0
    assert s.calls == []


@pytest.mark.timeout(30)
def test_close_abandons_queue_within_bound_and_later_submits_drop() -> None:
    reg = CollectorRegistry()
    s = Sender()
    s.gate.clear()
    q = ReleaseQueue(s, max_pending=100, release_timeout_ms=1000, shutdown_ms=200, metrics=TransportMetrics(reg))
    q.submit("e", ["inflight"])
    assert s.entered.wait(5)
    q.submit("e", ids("q", 10))
    t0 = time.perf_counter()
    q.close()  # the RPC in flight is stuck (until the gate opens below); close still returns after shutdown_ms
    assert time.perf_counter() - t0 < 5.0  # bounded with a busy box's slack; the stuck RPC would hold it 10 s
    q.close()  # idempotent
    assert not q.submit("e", ["late"])
    assert (
        reg.get_sample_value("tensorwire_mm_release_queue_dropped_leases_total", {"reason": "release_client_stopping"})
        == 11
    )
    s.gate.set()
    wait_for(lambda: q.pending == 0)


@pytest.mark.timeout(30)
def test_sender_failure_is_counted_and_the_thread_survives() -> None:
    reg = CollectorRegistry()
    s = Sender()
    s.fail = True
    with ReleaseQueue(s, max_pending=100, release_timeout_ms=100, metrics=TransportMetrics(reg)) as q:
        q.submit("e", ["a"])
        wait_for(lambda: q.failed == 1)
        s.fail = False
        q.submit("e", ["b"])
        wait_for(lambda: q.sent == 1)
    assert (
        reg.get_sample_value("tensorwire_mm_release_leases_total", {"mode": "async", "outcome": "peer_unavailable"})
        == 1
    )
    assert reg.get_sample_value("tensorwire_mm_release_leases_total", {"mode": "async", "outcome": "ok"}) == 1
