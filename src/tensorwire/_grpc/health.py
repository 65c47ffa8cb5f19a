"""HealthService: the standard ``grpc.health.v1.Health`` (Check and Watch) over one status per service name.

``end_watches()`` sends each watcher its last status and completes its call with OK, so a stopping server does
not wait out its grace for open Watches (grpc_health's servicer cannot). Watch holds no server thread.
Thread-safe: one lock guards the statuses and the watchers.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING
SERVICE_UNKNOWN = health_pb2.HealthCheckResponse.SERVICE_UNKNOWN

_Send = Callable[[Any], None]


class HealthService(health_pb2_grpc.HealthServicer):
    """``set(name, status)``, ``set_all(status)``, ``status(name)``, ``end_watches()``; ``add_to(server)``."""

    def __init__(self, names: tuple[str, ...], status: int = NOT_SERVING) -> None:
        self._lock = threading.Lock()
        self._status: dict[str, int] = {name: status for name in names}
        self._watchers: dict[str, set[_Send]] = {}
        self._ended = False

    def add_to(self, server: grpc.Server) -> None:
        health_pb2_grpc.add_HealthServicer_to_server(self, server)

    def status(self, name: str = "") -> int | None:
        with self._lock:
            return self._status.get(name)

    def set(self, name: str, status: int) -> None:
        with self._lock:
            self._status[name] = status
            watchers = list(self._watchers.get(name, ()))
        for send in watchers:
            send(health_pb2.HealthCheckResponse(status=status))

    def set_all(self, status: int) -> None:
        with self._lock:
            names = list(self._status)
        for name in names:
            self.set(name, status)

    def end_watches(self) -> int:
        """Completes every open Watch (OK) and every later one right after its first answer; returns how many."""
        with self._lock:
            self._ended = True
            watchers = [send for sends in self._watchers.values() for send in sends]
            self._watchers.clear()
        for send in watchers:
            send(None)
        return len(watchers)

    # -- grpc.health.v1.Health

    def Check(
        self,
        request: health_pb2.HealthCheckRequest,  # the proto's method name
        context: grpc.ServicerContext,
    ) -> health_pb2.HealthCheckResponse:
        status = self.status(request.service)
        if status is None:
            context.abort(grpc.StatusCode.NOT_FOUND, f"unknown service {request.service!r}")
        return health_pb2.HealthCheckResponse(status=status)

    def Watch(
        self,
        request: health_pb2.HealthCheckRequest,
        context: grpc.ServicerContext,
        send_response_callback: _Send | None = None,
    ) -> None:
        assert send_response_callback is not None  # experimental_non_blocking is set below
        send = send_response_callback
        name = request.service
        with self._lock:
            status = self._status.get(name, SERVICE_UNKNOWN)
            ended = self._ended
            if not ended:
                self._watchers.setdefault(name, set()).add(send)
        send(health_pb2.HealthCheckResponse(status=status))
        if ended:
            send(None)
            return
        context.add_callback(lambda: self._forget(name, send))

    def _forget(self, name: str, send: _Send) -> None:
        with self._lock:
            self._watchers.get(name, set()).discard(send)

    Watch.experimental_non_blocking = True  # type: ignore[attr-defined]
    Watch.experimental_thread_pool = None  # type: ignore[attr-defined]


__all__ = ["HealthService", "NOT_SERVING", "SERVICE_UNKNOWN", "SERVING"]
