"""The proxy's lease -> worker route table: pure logic, an injected clock, no I/O.

State machine of one lease id (seed §10.8, with the issue's collision rule)::

    (absent)  --record from W-------------------------> ROUTED(W, t)
    ROUTED(W) --record from W' != W-------------------> POISONED (counted; both (W, id) and (W', id) are handed
                                                        back for release; later releases of the id are refused)
    ROUTED    --now - t > ttl------------------------> dropped (counted as expired; the worker's GC reclaims it)
    ROUTED    --plan_release, then confirm(success)---> dropped
    ROUTED    --plan_release, then no confirm (failed)-> stays ROUTED, so a retried release still finds it

``ttl_s`` is the worker's ``slot_gc_timeout_ms`` + 5 s (``route_ttl_s``): a route outlives the lease it names, so
a release arriving late is still forwarded rather than dropped while the worker might still hold the slot.

Thread-safety: every public method takes the table's lock; the caller does the RPCs outside it.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

ROUTE_GC_SAFETY_S = 5.0


def route_ttl_s(slot_gc_timeout_ms: int) -> float:
    """Route lifetime for a worker whose leases are reclaimed after ``slot_gc_timeout_ms``."""
    return slot_gc_timeout_ms / 1000.0 + ROUTE_GC_SAFETY_S


@dataclass(frozen=True)
class Route:
    worker: str
    recorded_at: float


@dataclass
class ReleasePlan:
    """What ``plan_release`` decided: per-worker batches to forward, and the ids it will not forward."""

    by_worker: dict[str, list[str]] = field(default_factory=dict)
    routes: dict[str, Route] = field(default_factory=dict)  # lease id -> the route read (for confirm)
    unknown: list[str] = field(default_factory=list)  # never routed, expired or already released
    poisoned: list[str] = field(default_factory=list)


@dataclass
class RouteStats:
    routes: int = 0
    recorded_total: int = 0
    collisions_total: int = 0
    expired_total: int = 0
    released_total: int = 0
    unknown_total: int = 0


class RouteTable:
    """Lease id -> owning worker, learnt from receipts only (``record``); see the module docstring."""

    def __init__(self, ttl_s: float, *, clock: Callable[[], float] = time.monotonic) -> None:
        if ttl_s <= 0:
            raise ValueError(f"ttl_s must be > 0, got {ttl_s}")
        self.ttl_s = float(ttl_s)
        self._clock = clock
        self._lock = threading.Lock()
        self._routes: dict[str, Route] = {}  # insertion order == record order, so expiry pops from the front
        self._poisoned: dict[str, float] = {}  # lease id -> when; kept for ttl_s so late releases are refused
        self._stats = RouteStats()

    def record(self, worker: str, lease_ids: Iterable[str]) -> list[tuple[str, str]]:
        """Record that ``worker`` exported ``lease_ids``; returns (worker, lease id) pairs that collided.

        The caller releases every returned pair on its worker: a collided id cannot be routed safely, so both
        slots go back now instead of waiting for the workers' GC.
        """
        now = self._clock()
        collided: list[tuple[str, str]] = []
        with self._lock:
            self._expire_locked(now)
            for lease_id in lease_ids:
                if lease_id in self._poisoned:
                    collided.append((worker, lease_id))
                    self._stats.collisions_total += 1
                    continue
                old = self._routes.get(lease_id)
                if old is not None and old.worker != worker:
                    del self._routes[lease_id]
                    self._poisoned[lease_id] = now
                    self._stats.collisions_total += 1
                    collided += [(old.worker, lease_id), (worker, lease_id)]
                    continue
                if old is not None:  # the same worker again: refresh, keeping insertion order == time order
                    del self._routes[lease_id]
                self._routes[lease_id] = Route(worker, now)
                self._stats.recorded_total += 1
        return collided

    def plan_release(self, lease_ids: Iterable[str]) -> ReleasePlan:
        """Group ``lease_ids`` by owner without removing anything (a failed release must leave the route)."""
        now = self._clock()
        plan = ReleasePlan()
        with self._lock:
            self._expire_locked(now)
            for lease_id in dict.fromkeys(lease_ids):  # de-duplicate, keep order
                if lease_id in self._poisoned:
                    plan.poisoned.append(lease_id)
                    continue
                route = self._routes.get(lease_id)
                if route is None:
                    plan.unknown.append(lease_id)
                    self._stats.unknown_total += 1
                    continue
                plan.by_worker.setdefault(route.worker, []).append(lease_id)
                plan.routes[lease_id] = route
        return plan

    def confirm_released(self, plan: ReleasePlan, worker: str) -> int:
        """The release of ``plan.by_worker[worker]`` succeeded: drop those routes if they are still the ones read.

        A route re-recorded in between (same id from a new receipt) is a different route and stays.
        """
        dropped = 0
        with self._lock:
            for lease_id in plan.by_worker.get(worker, ()):
                if self._routes.get(lease_id) == plan.routes.get(lease_id):
                    del self._routes[lease_id]
                    dropped += 1
            self._stats.released_total += dropped
        return dropped

    def lookup(self, lease_id: str) -> str | None:
        """The owning worker of a live route, or None."""
        with self._lock:
            self._expire_locked(self._clock())
            route = self._routes.get(lease_id)
            return route.worker if route else None

    def is_poisoned(self, lease_id: str) -> bool:
        with self._lock:
            return lease_id in self._poisoned

    def expire(self) -> int:
        """Drop routes older than the TTL now; returns how many went."""
        with self._lock:
            return self._expire_locked(self._clock())

    def stats(self) -> RouteStats:
        with self._lock:
            self._stats.routes = len(self._routes)
            return RouteStats(**self._stats.__dict__)

    def __len__(self) -> int:
        with self._lock:
            return len(self._routes)

    def _expire_locked(self, now: float) -> int:
        n = 0
        while self._routes:
            lease_id, route = next(iter(self._routes.items()))
            if now - route.recorded_at <= self.ttl_s:
                break
            del self._routes[lease_id]
            n += 1
        self._stats.expired_total += n
        while self._poisoned:
            lease_id, at = next(iter(self._poisoned.items()))
            if now - at <= self.ttl_s:
                break
            del self._poisoned[lease_id]
        return n


__all__ = ["ROUTE_GC_SAFETY_S", "ReleasePlan", "Route", "RouteStats", "RouteTable", "route_ttl_s"]
