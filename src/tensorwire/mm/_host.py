"""GrpcHost: one gRPC server on one port, assembled, bound, started, health-marked and stopped in one order.

The encoder server (``serve_encoder``), the encoder worker and the proxy (``tensorwire.service``) all serve
through it, so the stop sequence and its waits are written once. The caller owns what its handlers use (an
OutputTransport, worker channels) and closes it after ``stop`` returns.

Lifecycle (``HostState``)::

    NEW --bind(address)--> BOUND --start()--> SERVING --stop(grace)--> STOPPED
    NEW / BOUND --stop()--> STOPPED (nothing was serving)

Health (``grpc.health.v1``, ``HealthService``) is separate from the lifecycle: ``start(serving=False)`` serves
with every name NOT_SERVING (a worker loading its model) until ``set_serving(True)``; ``stop`` turns it to
NOT_SERVING for good.

Stop sequence (``stop(grace_s, drain, drain_s=, quiesce=, settle=)``), each step after the one before:

1. health answers NOT_SERVING for every name; open Watch calls get it at once;
2. for ``drain_s`` seconds nothing else changes: calls are served as before, so health checkers (a proxy, a
   load balancer) see NOT_SERVING and move new work away before anything is refused;
3. ``quiesce()``: the caller stops taking new work (the encoder refuses Encode) while the server still accepts
   the calls that finish old work (ReleaseLeases, also on open EncodeStreams);
4. ``settle(deadline)``: the caller waits for its in-flight calls and outstanding leases, until ``deadline``
   (the grace, from the end of the drain period; readers of exported slots can still read and release);
5. ``grpc.Server.stop(what is left of the grace)``: no new calls; calls still running get the rest of the
   grace, then are cancelled; ``drain()``: the caller ends what would hold the stop for the rest of the grace
   (idle EncodeStreams); every Watch ends (OK);
6. wait for the server's termination, at most the rest of the grace + ``STOP_SLACK_S``.

So a stop takes at most ``drain_s + grace_s + STOP_SLACK_S``, and less when the work finishes early.

Port sharing: gRPC sets SO_REUSEPORT by default, so a second server on a port in use would bind it too and
take half its connections. ``GrpcHost`` turns it off unless ``reuse_port=True``; binding a port in use is then a
``ConfigError`` with reason ``BIND_FAILED``.

Places kept for what comes: server credentials (TLS / mTLS, issue 15) belong in ``_bind``.
"""

from __future__ import annotations

import enum
import errno
import logging
import socket
import threading
import time
from collections.abc import Callable, Sequence
from concurrent import futures
from typing import Any

import grpc

from tensorwire.errors import ClosedError, ConfigError, Reason
from tensorwire.mm import wire
from tensorwire.mm._health import NOT_SERVING, SERVING, HealthService

log = logging.getLogger(__name__)

# How long past its grace a stop waits for gRPC to report termination (cancelled calls unwinding).
STOP_SLACK_S = 5.0

Settle = Callable[[float], None]
"""settle(deadline): returns when the caller's in-flight work is done, or at ``deadline`` (time.monotonic)."""


class HostState(str, enum.Enum):
    NEW = "new"
    BOUND = "bound"
    SERVING = "serving"
    STOPPED = "stopped"


class GrpcHost:
    """``bind(address) -> port``, ``start(serving=True)``, ``set_serving(bool)``, ``stop(grace_s, ...)``, ``wait``.

    ``what`` names the server in errors and logs ("encoder", "proxy"). ``handlers`` are generic RPC handlers;
    ``serving`` the service names health reports (besides ``""``). Threads: ``threads`` server workers named
    ``thread_prefix``-N. Messages up to ``wire.MAX_MESSAGE_BYTES`` both ways, plus ``extra_options``.
    ``reuse_port``: let other processes bind the same port (SO_REUSEPORT); off by default.
    ``stop`` may be called from any thread, any number of times (the first one stops, later ones return at once).
    """

    def __init__(self, what: str, handlers: Sequence[grpc.GenericRpcHandler], *, threads: int, thread_prefix: str,
                 serving: Sequence[str] = (wire.SERVICE_NAME,), extra_options: Sequence[tuple[str, Any]] = (),
                 reuse_port: bool = False) -> None:
        self.what = what
        self.health = HealthService(("", *serving), NOT_SERVING)
        self._server = grpc.server(futures.ThreadPoolExecutor(max_workers=threads, thread_name_prefix=thread_prefix),
                                   options=self._options(extra_options, reuse_port))
        self._server.add_generic_rpc_handlers(tuple(handlers))
        self.health.add_to(self._server)
        self._lock = threading.Lock()
        self.state = HostState.NEW
        self._stopping = False
        self.host = ""
        self.port = 0

    @property
    def address(self) -> str:
        return f"{self.host}:{self.port}"

    @staticmethod
    def _options(extra: Sequence[tuple[str, Any]], reuse_port: bool) -> list[tuple[str, Any]]:
        return [*wire.channel_options(), ("grpc.so_reuseport", 1 if reuse_port else 0), *extra]

    def bind(self, address: str) -> int:
        """Binds ``address`` ("host:0" picks a port) and returns the port; ``ConfigError`` (reason
        ``BIND_FAILED``) when it cannot."""
        with self._lock:
            if self.state is not HostState.NEW:
                raise ClosedError(f"{self.what} server is {self.state.value}; bind() comes once, first")
            port = self._bind(address)
            self.host = address.rsplit(":", 1)[0] or "127.0.0.1"
            self.port = port
            self.state = HostState.BOUND
            return port

    def _bind(self, address: str) -> int:
        try:
            port = self._server.add_insecure_port(address)
        except RuntimeError:  # newer grpcio raises instead of returning 0
            port = 0
        if port == 0:
            raise ConfigError(f"cannot listen on {address} for the {self.what}: {_why_not(address)}",
                              reason=Reason.BIND_FAILED)
        return int(port)

    def start(self, serving: bool = True) -> None:
        """Starts serving on the bound port; health reports SERVING, or NOT_SERVING until ``set_serving(True)``."""
        with self._lock:
            if self.state is not HostState.BOUND:
                raise ClosedError(f"{self.what} server is {self.state.value}; start() needs a bound, unstarted server")
            self._server.start()
            self.state = HostState.SERVING
        if serving:
            self.set_serving(True)

    def set_serving(self, serving: bool) -> None:
        """What health answers for every name while the server runs; ignored once a stop began."""
        with self._lock:
            if self._stopping or self.state is not HostState.SERVING:
                return
            self.health.set_all(SERVING if serving else NOT_SERVING)

    def stop(self, grace_s: float | None, drain: Callable[[], None] | None = None, *, drain_s: float = 0.0,
             quiesce: Callable[[], None] | None = None, settle: Settle | None = None) -> None:
        """The stop sequence of the module docstring. Idempotent; the callbacks run only on the first call, and
        only when the server was serving. ``grace_s`` None: no limit for in-flight calls."""
        with self._lock:
            was, self.state, self._stopping = self.state, HostState.STOPPED, True
        if was is HostState.STOPPED:
            return
        self.health.set_all(NOT_SERVING)
        if was is HostState.SERVING:
            if drain_s > 0:
                log.info("%s on %s: NOT_SERVING for %.1f s before it stops taking work", self.what, self.address,
                         drain_s)
                time.sleep(drain_s)
            deadline = None if grace_s is None else time.monotonic() + grace_s
            if quiesce is not None:
                quiesce()
            if settle is not None:
                settle(float("inf") if deadline is None else deadline)
            grace_left = None if deadline is None else max(0.0, deadline - time.monotonic())
        else:
            grace_left = grace_s
        stopped = self._server.stop(grace_left)  # no new calls from here on
        if was is HostState.SERVING and drain is not None:
            drain()
        self.health.end_watches()
        if not stopped.wait(None if grace_left is None else grace_left + STOP_SLACK_S):
            log.warning("%s server on %s had not terminated %.1f s after its grace", self.what, self.address,
                        STOP_SLACK_S)

    def wait(self, timeout_s: float | None = None) -> bool:
        """Blocks until the server stops (True) or ``timeout_s`` passes (False)."""
        timed_out = self._server.wait_for_termination(timeout_s)  # grpc returns True when the timeout passed
        return not timed_out


class Admission:
    """Counts the calls a server is running and refuses new ones once closed: the ``quiesce``/``settle`` pair of
    the stop sequence for a servicer. ``enter()`` is False after ``close()``; every True ``enter`` needs one
    ``exit``; ``wait_idle(deadline)`` returns how many still run at ``deadline`` (time.monotonic). Thread-safe."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._running = 0
        self.closed = False

    def enter(self) -> bool:
        with self._cond:
            if self.closed:
                return False
            self._running += 1
            return True

    def exit(self) -> None:
        with self._cond:
            self._running -= 1
            if not self._running:
                self._cond.notify_all()

    def close(self) -> None:
        with self._cond:
            self.closed = True

    @property
    def running(self) -> int:
        with self._cond:
            return self._running

    def wait_idle(self, deadline: float) -> int:
        with self._cond:
            while self._running and time.monotonic() < deadline:
                self._cond.wait(min(1.0, deadline - time.monotonic()))
            return self._running


def _why_not(address: str) -> str:
    """Why gRPC could not bind ``address``, found out by binding a plain socket there (gRPC only says "failed")."""
    host, _, port_text = address.rpartition(":")
    host = host.strip("[]") or "0.0.0.0"
    try:
        port = int(port_text)
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        with socket.socket(family, socket.SOCK_STREAM) as probe:
            probe.bind((host, port))
    except ValueError:
        return "not a HOST:PORT address"
    except OSError as exc:
        if exc.errno == errno.EADDRINUSE:
            return f"port {port} is in use (another server listens there; pick another --port or stop that one)"
        if exc.errno == errno.EADDRNOTAVAIL:
            return f"{host} is not an address of this host"
        if exc.errno == errno.EACCES:
            return f"permission denied for port {port}"
        return exc.strerror or str(exc)
    return "gRPC refused the address (see its log line above)"


__all__ = ["Admission", "GrpcHost", "HostState", "STOP_SLACK_S", "Settle"]
