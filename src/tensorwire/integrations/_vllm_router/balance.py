"""Round-robin over instances, with a cooldown for the ones that just failed.

``order()`` gives every instance once, starting one further each call; instances that failed within the
cooldown come after the others (still tried, last: when every one failed, the least recent failure may be back).
Thread-safety: every method may run on many threads at once.
"""

from __future__ import annotations

import threading
import time


class RoundRobin:
    def __init__(self, urls: tuple[str, ...], cooldown_s: float) -> None:
        self.urls = urls
        self._cooldown_s = cooldown_s
        self._next = 0
        self._down_until = [0.0] * len(urls)
        self._lock = threading.Lock()

    def order(self) -> list[int]:
        now = time.monotonic()
        with self._lock:
            start = self._next
            self._next = (self._next + 1) % len(self.urls)
            down = list(self._down_until)
        ring = [(start + i) % len(self.urls) for i in range(len(self.urls))]
        return [i for i in ring if down[i] <= now] + sorted((i for i in ring if down[i] > now), key=lambda i: down[i])

    def failed(self, index: int) -> None:
        with self._lock:
            self._down_until[index] = time.monotonic() + self._cooldown_s

    def ok(self, index: int) -> None:
        with self._lock:
            self._down_until[index] = 0.0
