"""ReleaseQueue: success-path lease release that never blocks the caller.

``submit(endpoint, lease_ids)`` returns at once; over ``max_pending`` or while stopping, the ids are dropped and
counted (the owner's TTL GC reclaims them). A thread sends one ReleaseLeases per endpoint per batch; failures are
counted, not retried. ``close()`` drops what is queued and joins for at most ``shutdown_ms``; idempotent.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence

from tensorwire._ratelog import RateLimitedLog
from tensorwire.errors import TensorwireError
from tensorwire.mm._metrics import TransportMetrics

log = logging.getLogger(__name__)

Sender = Callable[[str, list[str], float], None]
"""sender(endpoint, lease_ids, timeout_s): one ReleaseLeases RPC; raises TensorwireError on failure."""

DROP_QUEUE_FULL = "release_queue_full"
DROP_STOPPING = "release_client_stopping"


class ReleaseQueue:
    def __init__(
        self,
        sender: Sender,
        *,
        max_pending: int,
        release_timeout_ms: int,
        shutdown_ms: int = 1000,
        metrics: TransportMetrics | None = None,
        name: str = "tensorwire-mm-release",
    ) -> None:
        self._sender = sender
        self._max = max_pending
        self._timeout_s = release_timeout_ms / 1000.0
        self._shutdown_s = shutdown_ms / 1000.0
        self._metrics = metrics
        self._cv = threading.Condition()
        self._queue: deque[tuple[str, list[str]]] = deque()
        self._pending = 0
        self._stopping = False
        self._rl = RateLimitedLog(log)
        self.dropped = 0
        self.sent = 0
        self.failed = 0
        self._thread = threading.Thread(target=self._loop, name=name, daemon=True)
        self._thread.start()

    @property
    def pending(self) -> int:
        with self._cv:
            return self._pending

    def submit(self, endpoint: str, lease_ids: Sequence[str]) -> bool:
        """Queues ids for release; False when they were dropped (never blocks)."""
        ids = [i for i in lease_ids if i]
        if not ids:
            return True
        drop_reason = ""
        with self._cv:
            if self._stopping:
                drop_reason = DROP_STOPPING
            elif self._pending + len(ids) > self._max:
                drop_reason = DROP_QUEUE_FULL
            else:
                self._queue.append((endpoint, ids))
                self._pending += len(ids)
                self._cv.notify()
        if drop_reason:
            self.dropped += len(ids)
            if self._metrics is not None:
                self._metrics.release_queue_dropped.labels(drop_reason).inc(len(ids))
                self._metrics.releases.labels("async", drop_reason).inc(len(ids))
            self._rl.log(
                logging.WARNING,
                drop_reason,
                "async lease release dropped %d id(s) (%s, limit %d pending); the encoder's TTL GC will reclaim them",
                len(ids),
                drop_reason,
                self._max,
            )
            return False
        if self._metrics is not None:
            self._metrics.release_queue_pending.inc(len(ids))
        return True

    def _loop(self) -> None:
        while True:
            with self._cv:
                while not self._queue and not self._stopping:
                    self._cv.wait()
                if self._stopping:
                    return
                batch = list(self._queue)
                self._queue.clear()
            by_endpoint: dict[str, list[str]] = {}
            for endpoint, ids in batch:
                by_endpoint.setdefault(endpoint, []).extend(ids)
            for endpoint, ids in by_endpoint.items():
                with self._cv:
                    stopping = self._stopping
                if not stopping:
                    self._send(endpoint, ids)
                with self._cv:
                    self._pending -= len(ids)
                if self._metrics is not None:
                    self._metrics.release_queue_pending.dec(len(ids))
                if stopping:
                    self._abandoned(len(ids))

    def _send(self, endpoint: str, ids: list[str]) -> None:
        t0 = time.perf_counter()
        try:
            self._sender(endpoint, ids, self._timeout_s)
        except TensorwireError as exc:
            self.failed += len(ids)
            if self._metrics is not None:
                self._metrics.releases.labels("async", exc.reason.value).inc(len(ids))
            self._rl.log(
                logging.WARNING,
                "send-" + exc.reason.value,
                "async release of %d lease(s) to %s failed: %s; the encoder's TTL GC will reclaim them",
                len(ids),
                endpoint,
                exc,
            )
            return
        except Exception as exc:  # a sender bug must not kill the release thread
            self.failed += len(ids)
            if self._metrics is not None:
                self._metrics.releases.labels("async", "release_failed").inc(len(ids))
            self._rl.log(logging.WARNING, "send-unexpected", "async release to %s raised %r", endpoint, exc)
            return
        self.sent += len(ids)
        if self._metrics is not None:
            self._metrics.release_seconds.labels("async").observe(time.perf_counter() - t0)
            self._metrics.releases.labels("async", "ok").inc(len(ids))

    def _abandoned(self, n: int) -> None:
        self.dropped += n
        if self._metrics is not None:
            self._metrics.release_queue_dropped.labels(DROP_STOPPING).inc(n)

    def close(self) -> None:
        with self._cv:
            if self._stopping:
                already = True
            else:
                already = False
                self._stopping = True
                abandoned = sum(len(ids) for _, ids in self._queue)
                self._queue.clear()
                self._pending -= abandoned
                self._cv.notify_all()
        if already:
            return
        if abandoned:
            self._abandoned(abandoned)
            if self._metrics is not None:
                self._metrics.release_queue_pending.dec(abandoned)
            log.warning(
                "release queue closed with %d lease id(s) still queued; abandoned to the encoder's TTL GC", abandoned
            )
        self._thread.join(self._shutdown_s)
        if self._thread.is_alive():
            log.warning("release thread still in an RPC after %.1f s; leaving it (daemon)", self._shutdown_s)

    def __enter__(self) -> ReleaseQueue:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


__all__ = ["ReleaseQueue", "Sender", "DROP_QUEUE_FULL", "DROP_STOPPING"]
