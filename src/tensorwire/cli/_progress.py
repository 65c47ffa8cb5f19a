"""One status line on stderr for long work (``fetch`` waiting for its answer, ``serve-proxy`` waiting for its
workers), shown only on a terminal: piped or with ``--json`` nothing is written.

``Ticker(enabled)`` is a context manager; ``phase(label)`` names what is being waited for now; a daemon thread
rewrites ``label ... N.N s`` in place every ``period_s``, and leaving the context erases it, so what the command
prints afterwards starts on a clean line.
"""

from __future__ import annotations

import sys
import threading
import time
from types import TracebackType
from typing import TextIO

_ERASE = "\r\x1b[K"


def on_terminal(stream: TextIO | None = None) -> bool:
    """True when ``stream`` (stderr by default) is a terminal a person watches."""
    stream = stream if stream is not None else sys.stderr
    try:
        return stream.isatty()
    except (AttributeError, ValueError):
        return False


class Ticker:
    def __init__(self, enabled: bool, *, period_s: float = 0.5, stream: TextIO | None = None) -> None:
        self.enabled = enabled
        self._period_s = period_s
        self._stream = stream if stream is not None else sys.stderr
        self._label = ""
        self._since = time.monotonic()
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None

    def phase(self, label: str) -> None:
        with self._lock:
            self._label, self._since = label, time.monotonic()
        self._draw()

    def say(self, message: str) -> None:
        """``message`` on a line of its own (on stderr, also when the status line is off)."""
        with self._lock:
            try:
                self._stream.write((_ERASE if self.enabled else "") + message + "\n")
                self._stream.flush()
            except (OSError, ValueError):
                pass

    def _draw(self) -> None:
        if not self.enabled:
            return
        with self._lock:
            text = f"{_ERASE}{self._label} ... {time.monotonic() - self._since:.1f} s"
            try:
                self._stream.write(text)
                self._stream.flush()
            except (OSError, ValueError):
                self.enabled = False

    def _loop(self) -> None:
        while not self._stop.wait(self._period_s):
            self._draw()

    def __enter__(self) -> Ticker:
        if self.enabled:
            self._thread = threading.Thread(target=self._loop, name="tensorwire-cli-progress", daemon=True)
            self._thread.start()
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(2.0)
        if self.enabled:
            with self._lock:
                try:
                    self._stream.write(_ERASE)
                    self._stream.flush()
                except (OSError, ValueError):
                    pass


__all__ = ["Ticker", "on_terminal"]
