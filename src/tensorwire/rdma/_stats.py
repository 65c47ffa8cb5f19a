"""Statistics of the rdma layer: one dataclass per component, changed only under one lock, read as a copy.

Style (the same for the exporter, the reader, the slot pool and every provider):

- A component's statistics are one dataclass (``ExporterStats``, ``ReaderStats``, ``PoolStats``, a
  ``ProviderStats`` subclass). Counters only grow; gauges (``live_leases``, ``busy_slots``, ...) and nested stats
  are filled in on the copy that ``stats()`` returns.
- The component keeps one instance as its live counters inside a ``Tally``: every change runs under the tally's
  lock (``with self._tally.locked() as c: c.exports += 1``), so updates from many threads are never lost, and
  ``snapshot()`` copies under the same lock, so one ``stats()`` never shows half an update.
- ``as_dict()`` is the flat JSON form (benchmarks, soak reports, pipes to other processes). Its keys are those
  ``stats()`` returned as a dict before it was typed, and they stay stable: benchmark files and dashboards read
  them. Nested stats are merged in: the pool's keys as they are on the exporter, with ``buffer_`` and ``loan_``
  names on the reader, the provider's last.
"""

from __future__ import annotations

import copy
import dataclasses
import threading
from dataclasses import dataclass, field
from typing import Any, Generic, NamedTuple, TypeVar

T = TypeVar("T")


class _Locked(Generic[T]):
    """``with``: the tally's lock held, its live instance bound. Stateless, so one serves every thread."""

    __slots__ = ("_tally",)

    def __init__(self, tally: Tally[T]) -> None:
        self._tally = tally

    def __enter__(self) -> T:
        self._tally._lock.__enter__()
        return self._tally._counts

    def __exit__(self, *exc: object) -> None:
        self._tally._lock.__exit__(None, None, None)


class Tally(Generic[T]):
    """The live counters of one component (a stats dataclass), changed and copied only under one lock."""

    def __init__(self, counts: T) -> None:
        self._counts = counts
        self._lock = threading.Lock()
        # One reusable context manager instead of a @contextmanager generator per update: a fetch bumps about ten
        # counters, and a generator costs about three times as much per update.
        self._locked = _Locked(self)

    def locked(self) -> _Locked[T]:
        """The live instance, with the lock held for the block: change fields only inside it."""
        return self._locked

    def snapshot(self) -> T:
        """A copy of the live instance taken under the lock (nested stats objects are shared, not copied)."""
        with self._lock:
            return copy.copy(self._counts)


def scalar_fields(stats: Any) -> dict[str, Any]:
    """The fields of a stats dataclass that are not themselves stats objects, in declaration order."""
    return {
        f.name: getattr(stats, f.name)
        for f in dataclasses.fields(stats)
        if not dataclasses.is_dataclass(getattr(stats, f.name))
    }


@dataclass
class ProviderStats:
    """What a provider reports (``Provider.stats()``). A provider with its own counters returns a subclass with
    more fields (ints, floats or strings only, so ``as_dict`` stays flat); names must not collide with the
    exporter's or the reader's own keys."""

    transport: str = "unknown"  # what ``Provider.transport()`` says for the configured device's memory

    def as_dict(self) -> dict[str, Any]:
        return scalar_fields(self)


class BucketStats(NamedTuple):
    """Slots of one bucket size."""

    idle: int
    busy: int


@dataclass
class PoolStats:
    """One slot pool (``tensorwire.rdma._pool``): bytes and slots now, and what the pool did so far."""

    pool_bytes: int = 0  # idle + busy slot bytes owned by the pool
    pool_cap_bytes: int = 0
    busy_bytes: int = 0
    idle_slots: int = 0
    busy_slots: int = 0
    buckets: dict[int, BucketStats] = field(default_factory=dict)  # bucket size in bytes -> slots
    slot_allocations: int = 0  # new slots allocated and registered
    slot_reuses: int = 0  # acquisitions served from a free list
    shrinks: int = 0
    shrunk_slots: int = 0
    shrunk_bytes: int = 0
    pool_exhausted: int = 0  # PoolExhausted raised
    alloc_failures: int = 0  # slot allocations that failed (cap reached or out of memory)

    def as_dict(self) -> dict[str, Any]:
        out = scalar_fields(self)
        out["buckets"] = {str(size): b._asdict() for size, b in sorted(self.buckets.items())}
        return out


@dataclass
class ExporterStats:
    """``TensorExporter.stats()``. Counters count since the exporter was built."""

    provider: str = "none"
    device: str = "cpu"
    live_leases: int = 0
    exports: int = 0  # descriptors published (export and export_allocated)
    export_failures: int = 0
    batch_rollbacks: int = 0  # export_batch calls that released what they had exported
    releases: int = 0
    unknown_releases: int = 0  # release() of ids that were unknown, already released or reclaimed
    gc_reclaims: int = 0  # leases the TTL GC reclaimed
    allocations: int = 0  # allocate() calls that returned a lease
    exported_bytes: int = 0  # manifest bytes of the published descriptors
    pool: PoolStats = field(default_factory=PoolStats)
    provider_stats: ProviderStats = field(default_factory=ProviderStats)

    def as_dict(self) -> dict[str, Any]:
        return {**scalar_fields(self), **self.pool.as_dict(), **self.provider_stats.as_dict()}


@dataclass
class ReaderStats:
    """``TensorReader.stats()``. ``buffers`` holds small reads (cloned out); ``loans`` the large ones lent out."""

    provider: str = "none"
    device: str = "cpu"
    reads: int = 0  # read() calls that returned tensors
    read_descriptors: int = 0
    read_bytes: int = 0
    read_errors: int = 0  # read() calls that raised ReadError (other than the two below)
    read_timeouts: int = 0
    stale_generations: int = 0  # read() calls that raised LeaseExpired
    invalid_descriptors: int = 0
    quarantined: int = 0  # timed-out transfers whose destinations were quarantined
    quarantine_freed: int = 0
    quarantine_live: int = 0
    same_host_copies: int = 0  # descriptors copied with process_vm_readv instead of READ (rdma._local)
    buffers: PoolStats = field(default_factory=PoolStats)
    loans: PoolStats = field(default_factory=PoolStats)
    provider_stats: ProviderStats = field(default_factory=ProviderStats)

    def as_dict(self) -> dict[str, Any]:
        return {
            **scalar_fields(self),
            **{f"buffer_{k}": v for k, v in self.buffers.as_dict().items()},
            "loan_pool_bytes": self.loans.pool_bytes,
            "loaned_slots": self.loans.busy_slots,
            "loan_idle_slots": self.loans.idle_slots,
            **self.provider_stats.as_dict(),
        }
