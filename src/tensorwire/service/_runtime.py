"""Process plumbing shared by the CLI commands: the /metrics endpoint, the READY line, signal-driven shutdown,
stdout kept for results, and waiting out a client's release queue before it closes."""

from __future__ import annotations

import contextlib
import ctypes
import logging
import os
import signal
import sys
import threading
import time
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from tensorwire.mm import RemoteOutputTransport

log = logging.getLogger(__name__)


class MetricsServer:
    """Prometheus ``/metrics`` over HTTP (prometheus_client's server); ``port`` is the bound one. Idempotent close."""

    def __init__(self, port: int, host: str = "127.0.0.1", registry: Any = None) -> None:
        from prometheus_client import REGISTRY, start_http_server

        self._server, self._thread = start_http_server(port, addr=host, registry=registry or REGISTRY)
        self.host = host
        self.port = int(self._server.server_address[1])
        self._closed = False

    @property
    def address(self) -> str:
        return f"{self.host}:{self.port}"

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._server.shutdown()
        self._server.server_close()


def print_ready(**fields: object) -> None:
    """One parseable line on stdout, e.g. ``READY grpc=127.0.0.1:50051 metrics=127.0.0.1:9100``; flushed."""
    print("READY " + " ".join(f"{k}={v}" for k, v in fields.items()), flush=True)


def parse_ready(line: str) -> dict[str, str] | None:
    """The fields of a READY line, or None for any other line."""
    if not line.startswith("READY "):
        return None
    return dict(part.split("=", 1) for part in line.split()[1:] if "=" in part)


def wait_for_signal(extra_check: Callable[[], bool] | None = None) -> str:
    """Blocks the main thread until SIGTERM or SIGINT (or ``extra_check()`` turns true); returns the signal name.

    Handlers only set an event: the shutdown itself runs on the main thread afterwards, never in a handler.
    """
    stop = threading.Event()
    got: list[str] = []

    def handler(signum: int, _frame: object) -> None:
        got.append(signal.Signals(signum).name)
        stop.set()

    old = {s: signal.signal(s, handler) for s in (signal.SIGTERM, signal.SIGINT)}
    try:
        while not stop.wait(0.5):
            if extra_check is not None and extra_check():
                return "stopped"
    finally:
        for s, h in old.items():
            signal.signal(s, h)
    return got[0] if got else "stopped"


@contextlib.contextmanager
def stdout_to_stderr() -> Iterator[None]:
    """Send whatever native libraries write to fd 1 (UCX protocol tables, for one) to stderr meanwhile.

    The CLI's own stdout is a result (a READY line, JSON) that scripts parse; nothing else may land there.
    """
    sys.stdout.flush()
    saved = os.dup(1)
    os.dup2(2, 1)
    try:
        yield
    finally:
        sys.stdout.flush()
        with contextlib.suppress(OSError, AttributeError):
            ctypes.CDLL(None).fflush(None)  # C stdio buffers of native code, before fd 1 points back
        os.dup2(saved, 1)
        os.close(saved)


def drain_releases(transport: RemoteOutputTransport, timeout_s: float) -> bool:
    """Waits until the async release queue has sent everything (close() would abandon queued ids to the GC)."""
    deadline = time.monotonic() + timeout_s
    while transport.release_queue.pending and time.monotonic() < deadline:
        time.sleep(0.005)
    return not transport.release_queue.pending


def fail(message: str, code: int = 1) -> int:
    print(f"error: {message}", file=sys.stderr, flush=True)
    return code


__all__ = ["MetricsServer", "drain_releases", "fail", "parse_ready", "print_ready", "stdout_to_stderr",
           "wait_for_signal"]
