"""Typed stats: updates from many threads are never lost, snapshots pickle, and the flat keys stay stable."""

from __future__ import annotations

import pickle
import threading
from collections.abc import Callable
from typing import Any

import pytest
import torch

from tensorwire.rdma import ExporterStats, PoolStats, RdmaConfig, ReaderStats, TensorExporter, TensorReader
from tensorwire.rdma._stats import BucketStats, Tally

WAIT_S = 60.0  # generous: every wait below ends on an event, this only bounds a broken run

# The keys stats() returned as a dict before it was typed (benchmark JSON and soak reports carry them), plus the
# ones added since (listed separately so a rename shows up here, not in a dashboard).
EXPORTER_KEYS = [
    "provider",
    "device",
    "live_leases",
    "exports",
    "export_failures",
    "batch_rollbacks",
    "releases",
    "unknown_releases",
    "gc_reclaims",
    "allocations",
    "exported_bytes",
    "pool_bytes",
    "pool_cap_bytes",
    "busy_bytes",
    "idle_slots",
    "busy_slots",
    "buckets",
    "slot_allocations",
    "slot_reuses",
    "shrinks",
    "shrunk_slots",
    "shrunk_bytes",
    "pool_exhausted",
    "alloc_failures",
    "metadata_fetches",
    "peer_disconnects",
    "nixl_read_errors",
    "idle_owners_forgotten",
    "transport",
    "known_owners",
    "xfer_reposts",
    "xfer_preps",
    "metadata_served",
]
READER_KEYS = [
    "provider",
    "device",
    "reads",
    "read_descriptors",
    "read_bytes",
    "read_errors",
    "read_timeouts",
    "stale_generations",
    "invalid_descriptors",
    "quarantined",
    "quarantine_freed",
    "quarantine_live",
    "transport",
    "buffer_pool_bytes",
    "buffer_pool_cap_bytes",
    "buffer_busy_bytes",
    "buffer_idle_slots",
    "buffer_busy_slots",
    "buffer_buckets",
    "buffer_slot_allocations",
    "buffer_slot_reuses",
    "buffer_shrinks",
    "buffer_shrunk_slots",
    "buffer_shrunk_bytes",
    "buffer_pool_exhausted",
    "buffer_alloc_failures",
    "loan_pool_bytes",
    "loaned_slots",
    "loan_idle_slots",
    "metadata_fetches",
    "peer_disconnects",
    "nixl_read_errors",
    "idle_owners_forgotten",
    "known_owners",
    "xfer_reposts",
    "xfer_preps",
]
ADDED_KEYS = {
    "exporter": ["metadata_rejected", "metadata_refused", "metadata_evicted"],
    "reader": ["metadata_served", "metadata_rejected", "metadata_refused", "metadata_evicted", "same_host_copies"],
}


class _GatedLock:
    """A lock that reports (``contended``, ``wake``) when a second thread has to wait for it."""

    def __init__(self, wake: threading.Event) -> None:
        self._lock = threading.Lock()
        self.contended = threading.Event()
        self._wake = wake

    def __enter__(self) -> None:
        if not self._lock.acquire(blocking=False):
            self.contended.set()
            self._wake.set()
            self._lock.acquire()

    def __exit__(self, *exc: object) -> None:
        self._lock.release()


class _GatedInt(int):
    """A counter value whose first ``+`` waits until a second update either runs beside it (the race a missing
    lock allows: both read the old value and one update is lost) or waits for the lock (no race)."""

    first_inside: threading.Event
    second_inside: threading.Event
    wake: threading.Event

    def __add__(self, other: Any) -> int:
        if self.first_inside.is_set():
            self.second_inside.set()
            self.wake.set()
        else:
            self.first_inside.set()
            self.wake.wait(WAIT_S)
        return int(self) + int(other)


def _race(tally: Tally[Any], field: str, bump: Callable[[], object]) -> _GatedLock:
    """Runs ``bump`` on two threads so that the second starts while the first is inside its update of ``field``.

    No timing is assumed: the first update waits, inside ``+``, until the second one is either inside ``+`` too or
    blocked on the tally's lock; whichever happens is what the code under test allows."""
    wake = threading.Event()
    lock = _GatedLock(wake)
    tally._lock = lock  # type: ignore[assignment]  # the test watches the lock
    with tally.locked() as live:
        gate = _GatedInt(getattr(live, field))
        gate.first_inside, gate.second_inside, gate.wake = threading.Event(), threading.Event(), wake
        setattr(live, field, gate)
    first = threading.Thread(target=bump, daemon=True)
    first.start()
    assert gate.first_inside.wait(WAIT_S)
    second = threading.Thread(target=bump, daemon=True)
    second.start()
    first.join(WAIT_S)
    second.join(WAIT_S)
    assert not first.is_alive() and not second.is_alive()
    assert wake.is_set()
    return lock


def test_the_gate_catches_an_unlocked_update() -> None:
    """The check below can fail: an update that skips the lock loses one of two concurrent increments."""
    tally = Tally(ExporterStats())

    def unlocked() -> None:
        live = tally._counts  # the bug this test is about
        live.releases += 1

    lock = _race(tally, "releases", unlocked)
    assert tally.snapshot().releases == 1  # lost update
    assert not lock.contended.is_set()


def test_tally_updates_from_two_threads_are_not_lost() -> None:
    tally = Tally(ExporterStats())

    def locked() -> None:
        with tally.locked() as c:
            c.releases += 1

    lock = _race(tally, "releases", locked)
    assert tally.snapshot().releases == 2
    assert lock.contended.is_set()  # the second update waited for the first


def test_nixl_counters_are_not_lost(require_nixl: None) -> None:
    """The nixl provider's counters are bumped by many reader threads (issue 13): same check on its real path."""
    from tensorwire.rdma import Owner
    from tensorwire.rdma.providers._nixl import NixlProvider, NixlStats, _Remote
    from tensorwire.rdma.providers.base import ROLE_READER

    provider = NixlProvider(RdmaConfig(bind_ip="127.0.0.1"), role=ROLE_READER)
    try:
        owner = Owner("tw-nobody", "127.0.0.1", 1)
        lock = _race(
            provider._tally,
            "nixl_read_errors",
            lambda: provider._translate(RuntimeError("injected"), _Remote(owner.agent_name), owner),
        )
        stats = provider.stats()
        assert isinstance(stats, NixlStats)
        assert stats.nixl_read_errors == 2
        assert lock.contended.is_set()
    finally:
        provider.close()


def test_snapshots_are_copies_and_pickle() -> None:
    tally = Tally(PoolStats(pool_cap_bytes=8))
    snap = tally.snapshot()
    with tally.locked() as c:
        c.shrinks += 1
    assert snap.shrinks == 0 and tally.snapshot().shrinks == 1
    stats = ExporterStats(live_leases=2, pool=PoolStats(buckets={4096: BucketStats(1, 2)}))
    assert pickle.loads(pickle.dumps(stats)) == stats  # OwnerProcess sends stats over a pipe


def test_pool_buckets_keep_their_json_form() -> None:
    pool = PoolStats(buckets={8192: BucketStats(idle=0, busy=1), 4096: BucketStats(idle=3, busy=0)})
    assert pool.as_dict()["buckets"] == {"4096": {"idle": 3, "busy": 0}, "8192": {"idle": 0, "busy": 1}}


def test_flat_keys_are_stable(require_nixl: None) -> None:
    cfg = RdmaConfig(bind_ip="127.0.0.1")
    with TensorExporter(cfg) as exp, TensorReader(cfg) as rd:
        rd.read([exp.export([torch.ones(4)])])
        est, rst = exp.stats(), rd.stats()
    assert isinstance(est, ExporterStats) and isinstance(rst, ReaderStats)
    assert sorted(est.as_dict()) == sorted(EXPORTER_KEYS + ADDED_KEYS["exporter"])
    assert sorted(rst.as_dict()) == sorted(READER_KEYS + ADDED_KEYS["reader"])
    flat = rst.as_dict()
    assert flat["reads"] == rst.reads == 1 and flat["buffer_busy_slots"] == rst.buffers.busy_slots
    assert flat["loaned_slots"] == rst.loans.busy_slots and flat["transport"] == rd.transport()
    assert est.as_dict()["exports"] == est.exports == 1 and est.as_dict()["busy_slots"] == est.pool.busy_slots


@pytest.mark.parametrize("cls", [ExporterStats, ReaderStats, PoolStats])
def test_defaults_build_an_empty_snapshot(cls: type) -> None:
    """Test doubles build stats with keywords only; every field has a default."""
    assert cls().as_dict()
