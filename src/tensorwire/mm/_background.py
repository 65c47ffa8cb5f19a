"""BackgroundInit: build a provider object (exporter or reader) off the request path, retrying transient
failures with bounded exponential backoff; ``get()`` never blocks. ``is_permanent`` is the one rule for which
start-up failures are not retried (both sides use it).

States: STARTING -> READY | DISABLED (permanent failure: one WARNING, inline for the process's life);
any -> CLOSED. A transient failure logs a WARNING per attempt and retries after ``backoff`` (doubling up to
``backoff_max``) until it succeeds or ``close()``.
"""

from __future__ import annotations

import enum
import logging
import threading
import time
from collections.abc import Callable
from typing import Generic, Protocol, TypeVar

from tensorwire.errors import ConfigError, Reason, TensorwireError

log = logging.getLogger(__name__)


class Closable(Protocol):
    def close(self) -> None: ...


T = TypeVar("T", bound=Closable)


def is_permanent(exc: BaseException) -> bool:
    """No provider or a bad config will not get better by retrying; anything else might."""
    if isinstance(exc, ConfigError):
        return True
    return isinstance(exc, TensorwireError) and exc.reason in (Reason.PROVIDER_UNAVAILABLE, Reason.INVALID_CONFIG)


class InitState(str, enum.Enum):
    OFF = "off"
    STARTING = "starting"
    READY = "ready"
    DISABLED = "disabled"
    CLOSED = "closed"


class BackgroundInit(Generic[T]):
    def __init__(
        self,
        what: str,
        factory: Callable[[], T],
        is_permanent: Callable[[BaseException], bool],
        *,
        backoff_s: float,
        backoff_max_s: float,
        on_ready: Callable[[T], None] | None = None,
        on_failure: Callable[[BaseException, bool], None] | None = None,
        close_obj: Callable[[T], None] | None = None,
    ) -> None:
        self._what = what
        self._factory = factory
        self._is_permanent = is_permanent
        self._backoff_s = backoff_s
        self._backoff_max_s = backoff_max_s
        self._on_ready = on_ready
        self._on_failure = on_failure
        self._close_obj = close_obj or _quiet_close
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._obj: T | None = None
        self._thread: threading.Thread | None = None
        self.state = InitState.OFF
        self.attempts = 0
        self.last_error: BaseException | None = None

    def start(self) -> None:
        with self._lock:
            if self.state is not InitState.OFF:
                return
            self.state = InitState.STARTING
            self._thread = threading.Thread(target=self._loop, name=f"tensorwire-mm-{self._what}-init", daemon=True)
            self._thread.start()

    def _closed(self) -> bool:
        # Called under the lock; close() may have run on another thread since the last look, so this reads the
        # state afresh where a comparison inline would be (wrongly) narrowed by the earlier one.
        return self.state is InitState.CLOSED

    def _loop(self) -> None:
        delay_s = self._backoff_s
        while True:
            with self._lock:
                if self._closed():
                    return
                self.attempts += 1
            try:
                obj = self._factory()
            except Exception as exc:
                self.last_error = exc
                permanent = self._is_permanent(exc)
                if self._on_failure is not None:
                    self._on_failure(exc, permanent)
                if permanent:
                    with self._lock:
                        if not self._closed():
                            self.state = InitState.DISABLED
                    log.warning(
                        "RDMA %s unavailable (%s); encoder output uses inline bytes for the lifetime of this process",
                        self._what,
                        exc,
                    )
                    return
                log.warning(
                    "RDMA %s start failed (attempt %d: %r); retrying in %.1f s", self._what, self.attempts, exc, delay_s
                )
                if self._wake.wait(delay_s):
                    return
                delay_s = min(delay_s * 2, self._backoff_max_s)
                continue
            with self._lock:
                closed = self._closed()
                if not closed:
                    self._obj = obj
                    self.state = InitState.READY
            if closed:
                self._close_obj(obj)
                return
            if self._on_ready is not None:
                self._on_ready(obj)
            log.info("RDMA %s ready after %d attempt(s)", self._what, self.attempts)
            return

    def get(self) -> T | None:
        return self._obj if self.state is InitState.READY else None

    def wait_ready(self, timeout_s: float) -> bool:
        """Waits until READY (True) or a terminal state / timeout (False). For start-up code and tests."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            state = self.state
            if state is InitState.READY:
                return True
            if state in (InitState.DISABLED, InitState.CLOSED, InitState.OFF):
                return False
            time.sleep(0.005)
        return self.state is InitState.READY

    def close(self) -> None:
        with self._lock:
            if self.state is InitState.CLOSED:
                return
            self.state = InitState.CLOSED
            obj, self._obj = self._obj, None
        self._wake.set()
        if obj is not None:
            self._close_obj(obj)
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(5.0)


def _quiet_close(obj: Closable) -> None:
    try:
        obj.close()
    except Exception as exc:  # close failures are isolated
        log.warning("closing %s failed: %r", type(obj).__name__, exc)
