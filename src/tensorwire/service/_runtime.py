"""Process plumbing shared by the CLI commands: the /metrics endpoint, the READY line, signal-driven shutdown,
stdout kept for results, waiting out a client's release queue before it closes, the stop settings and the exit
codes.

Exit codes of every ``tensorwire`` command: ``EXIT_OK`` 0; ``EXIT_FAILED`` 1 (it ran and failed: a fetch, a
worker that did not answer); ``EXIT_USAGE`` 2 (bad arguments or configuration, unreadable files);
``EXIT_BIND`` 3 (a server could not listen: port in use, address not on this host); 130 after Ctrl-C.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
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

from tensorwire.errors import ConfigError, Reason
from tensorwire.service._flags import StopConfig  # defined beside its flags; the stop sequence reads it here

EXIT_OK, EXIT_FAILED, EXIT_USAGE, EXIT_BIND = 0, 1, 2, 3


log = logging.getLogger(__name__)


class ServedMetrics:
    """What ``/metrics`` of a serve command shows: ``registry``'s families without the ``*_created`` series
    prometheus_client adds to every counter and histogram (a timestamp per series that doubles the scrape and that
    no tensorwire alert reads), without the families named in ``exclude`` (as exposed, counters with ``_total``:
    another role's families this process never updates), plus ``tensorwire_build_info{version, python} 1``. A view:
    the registry itself, and prometheus_client's process-wide settings, are left as they are (the library may share
    them with vLLM)."""

    def __init__(self, registry: Any, exclude: frozenset[str] = frozenset()) -> None:
        self._registry = registry
        self._exclude = exclude

    def collect(self) -> Iterator[Any]:
        import platform

        from prometheus_client.core import GaugeMetricFamily

        from tensorwire import __version__

        info = GaugeMetricFamily(
            "tensorwire_build_info", "The tensorwire version this process runs (always 1)", labels=["version", "python"]
        )
        info.add_metric([__version__, platform.python_version()], 1)
        yield info
        for family in self._registry.collect():
            exposed = family.name + "_total" if family.type == "counter" else family.name
            if exposed in self._exclude:
                continue
            family.samples = [s for s in family.samples if not s.name.endswith("_created")]
            yield family

    def restricted_registry(self, names: Any) -> Any:
        """The ``?name[]=...`` query of the exposition handler: the same view, those families only."""
        return ServedMetrics(self._registry.restricted_registry(names), self._exclude)


class MetricsServer:
    """Prometheus ``/metrics`` over HTTP (prometheus_client's server); ``port`` is the bound one. Idempotent close.
    What it serves is ``ServedMetrics`` of ``registry`` (no ``*_created`` series, no family in ``exclude``, a
    build-info gauge).

    ``tls`` (a ``TlsConfig`` with a certificate): HTTPS with that certificate, and client certificates signed by
    its CA required when it asks for client authentication (the gRPC listener's rules)."""

    def __init__(
        self,
        port: int,
        host: str = "127.0.0.1",
        registry: Any = None,
        *,
        tls: Any = None,
        exclude: frozenset[str] = frozenset(),
    ) -> None:
        from prometheus_client import REGISTRY, start_http_server

        kwargs: dict[str, Any] = {}
        if tls is not None and tls.server_enabled:
            kwargs = {"certfile": tls.cert, "keyfile": tls.key}
            if tls.mutual:
                kwargs.update(client_cafile=tls.ca, client_auth_required=True)
        try:
            served = ServedMetrics(registry or REGISTRY, exclude)
            self._server, self._thread = start_http_server(port, addr=host, registry=served, **kwargs)
        except OSError as exc:
            why = "the port is in use" if exc.errno == errno.EADDRINUSE else (exc.strerror or str(exc))
            raise ConfigError(
                f"cannot listen on {host}:{port} for /metrics: {why} (pick another --metrics-port, or -1 for none)",
                reason=Reason.BIND_FAILED,
            ) from exc
        self.scheme = "https" if kwargs else "http"
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


def serve_metrics(
    port: int, host: str, *, tls: Any, insecure: bool, exclude: frozenset[str] = frozenset()
) -> MetricsServer:
    """The /metrics server of a serve command: plaintext on loopback (or anywhere with ``insecure``), HTTPS with the
    gRPC certificate elsewhere (client certificates required under mTLS); ConfigError for a plaintext non-loopback
    address (/metrics stays on loopback unless it is protected or the operator says otherwise). ``exclude``: the
    families of other roles left out (``ServedMetrics``)."""
    from tensorwire._grpc.scope import is_loopback_host
    from tensorwire.errors import ConfigError

    if is_loopback_host(host) or insecure:
        return MetricsServer(port, host, exclude=exclude)
    if tls is None or not tls.server_enabled:
        raise ConfigError(
            f"refusing plaintext /metrics on {host!r} (not loopback): give the server a certificate "
            "(--tls-cert, --tls-key) or pass --insecure"
        )
    return MetricsServer(port, host, tls=tls, exclude=exclude)


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


def fail(message: str, code: int = EXIT_FAILED) -> int:
    print(f"error: {message}", file=sys.stderr, flush=True)
    return code


def exit_now(code: int) -> None:
    """Flush logs and stdio, then ``os._exit(code)``: skip the interpreter's finalization.

    A server that has stopped has closed everything it owns; what is left at interpreter exit is native teardown
    (UCX, NIXL, torch's thread pools) that took 2-7 s on a 2-core host, which only delays a restart or a
    rollout (measured: SIGTERM to exit 2.3 s -> 0.2 s for an idle ``serve-encoder`` with ``--drain-s 0``).
    """
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
    os._exit(code)


def exit_code_for(exc: BaseException) -> int:
    """``EXIT_BIND`` for a listen failure, ``EXIT_USAGE`` for other configuration errors, else ``EXIT_FAILED``."""
    if isinstance(exc, ConfigError):
        return EXIT_BIND if exc.reason is Reason.BIND_FAILED else EXIT_USAGE
    return EXIT_FAILED


__all__ = [
    "EXIT_BIND",
    "EXIT_FAILED",
    "EXIT_OK",
    "EXIT_USAGE",
    "MetricsServer",
    "ServedMetrics",
    "StopConfig",
    "drain_releases",
    "exit_code_for",
    "exit_now",
    "fail",
    "parse_ready",
    "print_ready",
    "serve_metrics",
    "stdout_to_stderr",
    "wait_for_signal",
]
