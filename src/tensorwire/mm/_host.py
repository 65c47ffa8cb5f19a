"""GrpcHost: one gRPC server on one port, assembled, bound, started, health-marked and stopped in one order.

The encoder server (``serve_encoder``), the encoder worker and the proxy (``tensorwire.service``) all serve
through it, so the stop sequence and its waits are written once. The caller owns what its handlers use (an
OutputTransport, worker channels) and closes it after ``stop`` returns.

Lifecycle (``HostState``)::

    NEW --bind(address)--> BOUND --start()--> SERVING --stop(grace)--> STOPPED
    NEW / BOUND --stop()--> STOPPED (nothing was serving)

Stop sequence: (1) health answers NOT_SERVING for every name, (2) ``grpc.Server.stop(grace)``: no new calls,
in-flight ones get ``grace`` seconds and are then cancelled, (3) ``drain()``: the caller ends what would hold
the stop for the whole grace (idle EncodeStreams), (4) wait for the server's termination, at most
``grace + STOP_SLACK_S`` (no limit when ``grace`` is None).

Places kept for what comes: server credentials (TLS / mTLS, issue 15) belong in ``_bind``; port-sharing options
(``grpc.so_reuseport`` off, issue 16) in ``_options``; drain phases (NOT_SERVING well before the stop, waiting for
in-flight work before the caller closes its exporter, issue 16) in ``stop``.
"""

from __future__ import annotations

import enum
import logging
import threading
from collections.abc import Callable, Sequence
from concurrent import futures
from typing import Any

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from tensorwire.errors import ClosedError, ConfigError
from tensorwire.mm import wire

log = logging.getLogger(__name__)

# How long past its grace a stop waits for gRPC to report termination (cancelled calls unwinding).
STOP_SLACK_S = 5.0


class HostState(str, enum.Enum):
    NEW = "new"
    BOUND = "bound"
    SERVING = "serving"
    STOPPED = "stopped"


class GrpcHost:
    """``bind(address) -> port``, ``start()``, ``stop(grace_s, drain=None)``, ``wait(timeout_s)``.

    ``what`` names the server in errors and logs ("encoder", "proxy"). ``handlers`` are generic RPC handlers;
    ``serving`` the service names health reports (besides ``""``). Threads: ``threads`` server workers named
    ``thread_prefix``-N. Messages up to ``wire.MAX_MESSAGE_BYTES`` both ways, plus ``extra_options``.
    ``stop`` may be called from any thread, any number of times (the first one stops).
    """

    def __init__(self, what: str, handlers: Sequence[grpc.GenericRpcHandler], *, threads: int, thread_prefix: str,
                 serving: Sequence[str] = (wire.SERVICE_NAME,), extra_options: Sequence[tuple[str, Any]] = ()) -> None:
        self.what = what
        self._serving = ("", *serving)
        self._server = grpc.server(futures.ThreadPoolExecutor(max_workers=threads, thread_name_prefix=thread_prefix),
                                   options=self._options(extra_options))
        self._server.add_generic_rpc_handlers(tuple(handlers))
        self._health = health.HealthServicer()
        health_pb2_grpc.add_HealthServicer_to_server(self._health, self._server)
        self._lock = threading.Lock()
        self.state = HostState.NEW
        self.host = ""
        self.port = 0

    @property
    def address(self) -> str:
        return f"{self.host}:{self.port}"

    @staticmethod
    def _options(extra: Sequence[tuple[str, Any]]) -> list[tuple[str, Any]]:
        return wire.channel_options() + list(extra)

    def bind(self, address: str) -> int:
        """Binds ``address`` ("host:0" picks a port) and returns the port; ``ConfigError`` when it cannot."""
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
        except RuntimeError as exc:  # newer grpcio raises instead of returning 0
            raise ConfigError(f"cannot bind the {self.what} to {address!r}: {exc}; is the port in use?") from exc
        if port == 0:
            raise ConfigError(f"cannot bind the {self.what} to {address!r}; is the port in use?")
        return int(port)

    def start(self) -> None:
        """Starts serving on the bound port and reports SERVING."""
        with self._lock:
            if self.state is not HostState.BOUND:
                raise ClosedError(f"{self.what} server is {self.state.value}; start() needs a bound, unstarted server")
            self._server.start()
            for name in self._serving:
                self._health.set(name, health_pb2.HealthCheckResponse.SERVING)
            self.state = HostState.SERVING

    def stop(self, grace_s: float | None, drain: Callable[[], None] | None = None) -> None:
        """The stop sequence of the module docstring. Idempotent; ``drain`` runs only on the first call, and
        only when the server was serving."""
        with self._lock:
            was, self.state = self.state, HostState.STOPPED
        if was is HostState.STOPPED:
            return
        self._health.enter_graceful_shutdown()
        stopped = self._server.stop(grace_s)  # no new calls from here on
        if was is HostState.SERVING and drain is not None:
            drain()
        if not stopped.wait(None if grace_s is None else grace_s + STOP_SLACK_S):
            log.warning("%s server on %s had not terminated %.1f s after its grace", self.what, self.address,
                        STOP_SLACK_S)

    def wait(self, timeout_s: float | None = None) -> bool:
        """Blocks until the server stops (True) or ``timeout_s`` passes (False)."""
        timed_out = self._server.wait_for_termination(timeout_s)  # grpc returns True when the timeout passed
        return not timed_out


__all__ = ["GrpcHost", "HostState", "STOP_SLACK_S"]
