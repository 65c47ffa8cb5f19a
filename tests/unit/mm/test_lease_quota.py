"""PeerLeases: the per-peer account of leased bytes behind the lease quota (issue 15, finding 6)."""

from __future__ import annotations

from tensorwire.mm.server._quota import PeerLeases


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_a_peer_is_refused_over_its_cap_and_others_are_not() -> None:
    q = PeerLeases(cap_bytes=10, ttl_s=60, clock=Clock())
    assert q.reserve("a", 6)
    q.settle("a", 6, [("l1", 6)])
    assert not q.reserve("a", 5) and q.refusals == 1  # 6 + 5 > 10
    assert q.reserve("b", 10)  # another peer has its own 10
    q.settle("b", 10, [])  # its export failed: nothing held
    assert q.held("b") == 0 and q.held("a") == 6
    assert q.reserve("a", 4)  # exactly the cap
    q.settle("a", 4, [("l2", 4)])
    q.remove(["l1", "unknown-id"])
    assert q.held("a") == 4 and q.reserve("a", 6)


def test_unreleased_leases_leave_the_account_when_the_gc_would_reclaim_them() -> None:
    clock = Clock()
    q = PeerLeases(cap_bytes=10, ttl_s=60, clock=clock)
    assert q.reserve("a", 10)
    q.settle("a", 10, [("l1", 5), ("l2", 5)])
    assert not q.reserve("a", 1)
    clock.now += 59.9
    assert not q.reserve("a", 1)
    clock.now += 0.2
    assert q.held("a") == 0 and q.reserve("a", 10)
    q.remove(["l1", "l2"])  # a release after the expiry changes nothing
    assert q.held("a") == 10


def test_clear_forgets_everything() -> None:
    q = PeerLeases(cap_bytes=10, ttl_s=60, clock=Clock())
    assert q.reserve("a", 10)
    q.settle("a", 10, [("l1", 10)])
    q.clear()
    assert q.held("a") == 0 and q.reserve("a", 10)
