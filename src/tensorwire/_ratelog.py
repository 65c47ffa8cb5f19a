"""Rate-limited logging for hot paths: the first event of a key is logged, then at most once per interval."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import Any


class RateLimitedLog:
    def __init__(
        self, logger: logging.Logger, interval_s: float = 30.0, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self._log = logger
        self._interval_s = interval_s
        self._clock = clock
        self._lock = threading.Lock()
        self._next: dict[str, float] = {}
        self._suppressed: dict[str, int] = {}

    def log(self, level: int, key: str, msg: str, *args: Any) -> bool:
        """Logs unless ``key`` was logged within the interval; returns whether it logged."""
        now = self._clock()
        with self._lock:
            if now < self._next.get(key, float("-inf")):
                self._suppressed[key] = self._suppressed.get(key, 0) + 1
                return False
            self._next[key] = now + self._interval_s
            suppressed = self._suppressed.pop(key, 0)
        if suppressed:
            msg = msg + " (%d similar suppressed)"
            args = (*args, suppressed)
        self._log.log(level, msg, *args)
        return True
