"""Consecutive-failure circuit breakers for the RDMA plane, keyed per endpoint and per worker. State machine::

    CLOSED --failures_to_open failures--> OPEN --allow() after open_seconds--> HALF_OPEN (one probe)
    HALF_OPEN --success--> CLOSED; --failure--> OPEN; --neutral--> OPEN, expired (next allow() probes)

A success resets the failure count. Budget exhaustion is ``neutral``, never a failure. Injectable clock. Thread-safe.
"""

from __future__ import annotations

import enum
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

from tensorwire.mm._metrics import TransportMetrics

log = logging.getLogger(__name__)


class BreakerState(str, enum.Enum):
    CLOSED = "closed"
    OPEN = "open"
    HALF_OPEN = "half_open"


@dataclass
class _Entry:
    state: BreakerState = BreakerState.CLOSED
    failures: int = 0
    open_until: float = 0.0


class BreakerBoard:
    """Breakers of one scope ("endpoint" or "worker"), created on first use per key."""

    def __init__(
        self,
        scope: str,
        failures_to_open: int,
        open_seconds: float,
        clock: Callable[[], float] = time.monotonic,
        metrics: TransportMetrics | None = None,
    ) -> None:
        self.scope = scope
        self._threshold = failures_to_open
        self._open_s = open_seconds
        self._clock = clock
        self._metrics = metrics
        self._lock = threading.Lock()
        self._entries: dict[str, _Entry] = {}

    def state(self, key: str) -> BreakerState:
        with self._lock:
            e = self._entries.get(key)
            return e.state if e is not None else BreakerState.CLOSED

    def keys_not_closed(self) -> list[str]:
        with self._lock:
            return [k for k, e in self._entries.items() if e.state is not BreakerState.CLOSED]

    def is_blocked(self, key: str) -> bool:
        """True while the breaker is open and its window has not passed (does not take the probe)."""
        with self._lock:
            e = self._entries.get(key)
            if e is None:
                return False
            if e.state is BreakerState.OPEN:
                return self._clock() < e.open_until
            return e.state is BreakerState.HALF_OPEN

    def allow(self, key: str) -> bool:
        """May this request use RDMA? In an expired OPEN state the first caller becomes the half-open probe."""
        with self._lock:
            e = self._entries.get(key)
            if e is None or e.state is BreakerState.CLOSED:
                return True
            if e.state is BreakerState.HALF_OPEN:
                return False
            if self._clock() < e.open_until:
                return False
            self._move(key, e, BreakerState.HALF_OPEN)
            return True

    def record_success(self, key: str) -> None:
        with self._lock:
            e = self._entries.get(key)
            if e is None:
                return
            e.failures = 0
            if e.state is not BreakerState.CLOSED:
                self._move(key, e, BreakerState.CLOSED)

    def record_failure(self, key: str) -> None:
        with self._lock:
            e = self._entries.setdefault(key, _Entry())
            e.failures += 1
            if e.state is BreakerState.HALF_OPEN or (e.state is BreakerState.CLOSED and e.failures >= self._threshold):
                e.open_until = self._clock() + self._open_s
                self._move(key, e, BreakerState.OPEN)

    def record_neutral(self, key: str) -> None:
        """The attempt ended without saying anything about the endpoint; a taken probe is handed back."""
        with self._lock:
            e = self._entries.get(key)
            if e is not None and e.state is BreakerState.HALF_OPEN:
                e.open_until = self._clock()
                self._move(key, e, BreakerState.OPEN, quiet=True)

    def reset(self, key: str | None = None) -> None:
        """Forgets one key (or all); for operators and tests."""
        with self._lock:
            keys = [key] if key is not None else list(self._entries)
            for k in keys:
                e = self._entries.pop(k, None)
                if e is not None and e.state is not BreakerState.CLOSED and self._metrics is not None:
                    self._metrics.breaker_open.labels(self.scope).dec()

    def _move(self, key: str, e: _Entry, new: BreakerState, quiet: bool = False) -> None:
        old = e.state
        e.state = new
        if self._metrics is not None:
            if old is BreakerState.CLOSED and new is not BreakerState.CLOSED:
                self._metrics.breaker_open.labels(self.scope).inc()
            elif old is not BreakerState.CLOSED and new is BreakerState.CLOSED:
                self._metrics.breaker_open.labels(self.scope).dec()
            if not quiet:
                self._metrics.breaker_transitions.labels(self.scope, new.value).inc()
        if not quiet:
            if new is BreakerState.OPEN:
                log.info(
                    "rdma circuit breaker for %s %s opened after %d consecutive read failures; inline for %.0f s",
                    self.scope,
                    key,
                    e.failures,
                    self._open_s,
                )
            elif new is BreakerState.CLOSED and old is not BreakerState.CLOSED:
                log.info("rdma circuit breaker for %s %s closed", self.scope, key)


__all__ = ["BreakerBoard", "BreakerState"]
