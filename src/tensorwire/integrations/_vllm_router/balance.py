"""Which instance a request goes to: round-robin over the ones that are up; a failed one is out until it answers.

An instance is down from a failed call or ``/health`` probe until a probe passes. ``order()`` gives the up ones,
one further each call; ``include_down=True`` appends the down ones. Not thread-safe: runs on the event loop.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

log = logging.getLogger("tensorwire.integrations.vllm_router")


class Instances:
    """The instances of one role (``encoder`` or ``llm``): names, URLs, up/down, and the round-robin cursor."""

    def __init__(self, role: str, urls: tuple[str, ...], on_change: Callable[[int, bool], None]) -> None:
        self.role = role
        self.urls = urls
        self.names = tuple(f"{role}-{i}" for i in range(len(urls)))
        self.up = [True] * len(urls)
        self._next = 0
        self._on_change = on_change

    def order(self, include_down: bool = False) -> list[int]:
        n = len(self.urls)
        start = self._next
        self._next = (self._next + 1) % n
        ring = [(start + i) % n for i in range(n)]
        live = [i for i in ring if self.up[i]]
        return live + [i for i in ring if not self.up[i]] if include_down else live

    def failed(self, index: int, why: str) -> None:
        """A call failed: out until a probe passes."""
        if self.up[index]:
            self.up[index] = False
            log.warning("%s (%s) is out until its /health probe passes: %s", self.names[index], self.urls[index], why)
            self._on_change(index, False)

    def probed(self, index: int, ok: bool, why: str = "") -> None:
        if ok and not self.up[index]:
            self.up[index] = True
            log.info("%s (%s) is back: its /health probe passed", self.names[index], self.urls[index])
            self._on_change(index, True)
        elif not ok and self.up[index]:
            self.up[index] = False
            log.warning("%s (%s) is out: /health probe failed: %s", self.names[index], self.urls[index], why)
            self._on_change(index, False)
