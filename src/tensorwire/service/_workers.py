"""Which of the proxy's workers can serve: ``WorkerHealth`` (pure state, an injected clock) and ``HealthProber``
(the thread that asks each worker's ``grpc.health.v1`` Check).

State of one worker::

    UP   --a call failed with UNAVAILABLE/UNKNOWN/INTERNAL (it is down, restarting or cut off)---> DOWN
    UP   --probe answered NOT_SERVING (loading, draining), or `probe_failures` probes unanswered-> DOWN
    DOWN --probe answered SERVING, or a call to it succeeded------------------------------------> UP

Routing (``order``): round-robin from the caller's start index over the UP workers, then the DOWN ones as a last
resort (a request is never refused only because every worker looked down: probes may be late, or all wrong on
an overloaded host). A DOWN worker gets no new work while another is UP, so a dead, restarting or cut-off worker
costs at most the requests already in flight on it, and those are retried elsewhere by the proxy.

Probes go every ``interval_s`` to every worker, UP or DOWN, each with ``timeout_s``; an unanswered probe counts
only after ``probe_failures`` in a row, so one slow answer on a busy host does not eject a worker.

Thread-safety: ``WorkerHealth`` takes its lock in every method; ``on_change(index, up)`` runs outside it.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import grpc
from grpc_health.v1 import health_pb2

log = logging.getLogger(__name__)

# A call that failed with one of these says the worker (or the path to it) is unwell, not the request.
EJECTING = frozenset({grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.UNKNOWN, grpc.StatusCode.INTERNAL})


@dataclass
class WorkerState:
    up: bool = True
    unanswered: int = 0  # probes in a row without an answer
    since: float = 0.0  # when ``up`` last changed
    cause: str = ""  # why it is down ("call UNAVAILABLE", "probe NOT_SERVING", "probe unanswered")
    downs: int = 0  # UP -> DOWN transitions


class WorkerHealth:
    """Per-worker UP/DOWN (module docstring). ``n`` workers, all UP at first (the proxy asked them at start-up)."""

    def __init__(
        self,
        n: int,
        *,
        probe_failures: int = 2,
        clock: Callable[[], float] = time.monotonic,
        on_change: Callable[[int, bool], None] | None = None,
    ) -> None:
        if n < 1 or probe_failures < 1:
            raise ValueError("WorkerHealth needs n >= 1 and probe_failures >= 1")
        self._clock = clock
        self._lock = threading.Lock()
        self._states = [WorkerState(since=clock()) for _ in range(n)]
        self._probe_failures = probe_failures
        self._on_change = on_change

    def __len__(self) -> int:
        return len(self._states)

    def is_up(self, index: int) -> bool:
        with self._lock:
            return self._states[index].up

    def any_up(self) -> bool:
        with self._lock:
            return any(s.up for s in self._states)

    def snapshot(self) -> list[WorkerState]:
        with self._lock:
            return [WorkerState(**s.__dict__) for s in self._states]

    def order(self, first: int) -> list[int]:
        """Every worker index once: UP ones round-robin from ``first``, then DOWN ones."""
        n = len(self._states)
        ring = [(first + k) % n for k in range(n)]
        with self._lock:
            up = [i for i in ring if self._states[i].up]
        return up + [i for i in ring if i not in up]

    def call_failed(self, index: int, code: grpc.StatusCode) -> None:
        if code in EJECTING:
            self._set(index, False, f"call {code.name}")

    def call_ok(self, index: int) -> None:
        self._set(index, True, "")

    def probed(self, index: int, status: int | None) -> None:
        """``status``: the worker's health answer (a HealthCheckResponse status), None when it did not answer."""
        if status == health_pb2.HealthCheckResponse.SERVING:
            self._set(index, True, "")
            return
        if status is not None:
            self._set(index, False, "probe NOT_SERVING")
            return
        with self._lock:
            st = self._states[index]
            st.unanswered += 1
            eject = st.unanswered >= self._probe_failures
        if eject:
            self._set(index, False, "probe unanswered")

    def _set(self, index: int, up: bool, cause: str) -> None:
        with self._lock:
            st = self._states[index]
            if up:
                st.unanswered = 0
            if st.up == up:
                return
            st.up, st.since, st.cause = up, self._clock(), cause
            if not up:
                st.downs += 1
        if self._on_change is not None:
            self._on_change(index, up)


Check = Callable[[float], int | None]
"""check(timeout_s) -> the worker's health status, or None when it did not answer in time."""


def health_check(channel: grpc.Channel, service: str) -> Check:
    """A ``Check`` over ``channel`` asking for ``service``'s status."""
    call = channel.unary_unary(
        "/grpc.health.v1.Health/Check",
        request_serializer=health_pb2.HealthCheckRequest.SerializeToString,
        response_deserializer=health_pb2.HealthCheckResponse.FromString,
    )
    request = health_pb2.HealthCheckRequest(service=service)

    def check(timeout_s: float) -> int | None:
        try:
            return int(call(request, timeout=timeout_s).status)
        except grpc.RpcError as exc:
            code = exc.code() if hasattr(exc, "code") else None
            if code == grpc.StatusCode.NOT_FOUND:  # it answered, but does not serve the EncoderService
                return int(health_pb2.HealthCheckResponse.SERVICE_UNKNOWN)
            return None

    return check


class HealthProber:
    """A daemon thread probing every worker each ``interval_s`` (``start``/``close``; close is idempotent and joins).

    Probes run one after the other, each bounded by ``timeout_s``, so one round takes at most
    ``len(checks) * timeout_s``; the next round starts ``interval_s`` after the last one began (or at once when
    a round ran longer).
    """

    def __init__(self, checks: Sequence[Check], health: WorkerHealth, *, interval_s: float, timeout_s: float) -> None:
        self._checks = list(checks)
        self._health = health
        self._interval_s = interval_s
        self._timeout_s = timeout_s
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="proxy-health-probe", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def probe_once(self) -> None:
        for i, check in enumerate(self._checks):
            if self._stop.is_set():
                return
            self._health.probed(i, check(self._timeout_s))

    def _run(self) -> None:
        while not self._stop.is_set():
            began = time.monotonic()
            try:
                self.probe_once()
            except Exception:  # a probe bug must not end probing; it is logged
                log.exception("health probe round failed")
            self._stop.wait(max(0.0, self._interval_s - (time.monotonic() - began)))

    def close(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(self._timeout_s * len(self._checks) + 5.0)


__all__ = ["EJECTING", "Check", "HealthProber", "WorkerHealth", "WorkerState", "health_check"]
