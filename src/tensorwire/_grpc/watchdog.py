"""DeadlineWatchdog: expires awaited answers whose deadline passed, for waits that have no timeout of their own
(``next()`` on a gRPC stream has none).

One thread per watchdog, started on first use, sleeping until the earliest deadline. Answered entries are
dropped lazily; ``target.expire`` re-checks under its own lock, so an answer racing the deadline is never
cancelled.
"""

from __future__ import annotations

import heapq
import itertools
import math
import threading
import time
from typing import NamedTuple, Protocol


class Expirable(Protocol):
    """What the watchdog needs from a waiting call."""

    def waiting_for(self, token: int) -> bool: ...
    def expire(self, token: int) -> None: ...


class _Watch(NamedTuple):
    deadline: float  # time.monotonic()
    seq: int  # unique: ties on the deadline never compare the targets
    target: Expirable
    token: int

    def answered(self) -> bool:
        return not self.target.waiting_for(self.token)


class DeadlineWatchdog:
    """``watch(deadline, target, token)``: calls ``target.expire(token)`` once the deadline passed, unless the
    target stopped waiting for ``token`` first. ``close`` stops the thread (joined, at most 5 s); idempotent."""

    def __init__(self, thread_name: str) -> None:
        self._thread_name = thread_name
        self._cv = threading.Condition()
        self._heap: list[_Watch] = []
        self._seq = itertools.count()
        self._thread: threading.Thread | None = None
        self._closed = False
        self._sleep_until = math.inf  # the deadline the thread sleeps toward
        self.wakeups = 0  # times the thread woke up (tests check that the steady state costs none)

    @property
    def pending(self) -> int:
        """Entries held: waits not yet answered, plus answered ones not yet dropped (those sit below the top)."""
        with self._cv:
            return len(self._heap)

    def watch(self, deadline: float, target: Expirable, token: int) -> None:
        with self._cv:
            if self._closed:
                return
            while self._heap and self._heap[0].answered():
                heapq.heappop(self._heap)
            heapq.heappush(self._heap, _Watch(deadline, next(self._seq), target, token))
            if self._thread is None:
                self._thread = threading.Thread(target=self._loop, name=self._thread_name, daemon=True)
                self._thread.start()
            elif deadline < self._sleep_until:
                self._cv.notify()  # a new earliest deadline; otherwise the thread sleeps on

    def _loop(self) -> None:
        while True:
            expired: list[_Watch] = []
            with self._cv:
                if self._closed:
                    return
                now = time.monotonic()
                while self._heap and (self._heap[0].deadline <= now or self._heap[0].answered()):
                    entry = heapq.heappop(self._heap)
                    if not entry.answered():
                        expired.append(entry)
                if not expired:
                    self._sleep_until = self._heap[0].deadline if self._heap else math.inf
                    self._cv.wait(self._sleep_until - now if self._heap else None)
                    self._sleep_until = -math.inf  # awake: watch() need not notify
                    self.wakeups += 1
                    continue
            for entry in expired:
                entry.target.expire(entry.token)

    def close(self) -> None:
        with self._cv:
            self._closed = True
            self._heap.clear()
            self._cv.notify_all()
            thread = self._thread
        if thread is not None and thread is not threading.current_thread():
            thread.join(5.0)


__all__ = ["DeadlineWatchdog", "Expirable"]
