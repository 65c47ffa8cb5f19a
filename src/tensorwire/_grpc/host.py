"""GrpcHost: one gRPC server on one port, assembled, bound, started, health-marked and stopped in one order, with
its transport security and its limits.

The encoder server (``serve_encoder``), the encoder worker and the proxy (``tensorwire.service``) all serve
through it, so the stop sequence, TLS and the limits of ``ServerLimits`` are written once. The caller owns what
its handlers use (an OutputTransport, worker channels) and closes it after ``stop`` returns.

Lifecycle (``HostState``)::

    NEW --bind(address)--> BOUND --start()--> SERVING --stop(grace)--> STOPPED
    NEW / BOUND --stop()--> STOPPED (nothing was serving)

Health (``grpc.health.v1``) is separate from the lifecycle: ``start(serving=False)`` serves NOT_SERVING until
``set_serving(True)``; ``stop`` turns it to NOT_SERVING for good.

Stop sequence (``stop(grace_s, drain, drain_s=, quiesce=, settle=)``), each step after the one before:

1. health answers NOT_SERVING (open Watches get it at once), then ``drain_s`` seconds pass with calls served
   as before, so health checkers move new work away before anything is refused;
2. ``quiesce()``: the caller stops taking new work; calls that finish old work (ReleaseLeases) still run;
3. ``settle(deadline)``: the caller waits for its in-flight calls and leases until the grace ends;
4. ``grpc.Server.stop(rest of the grace)``, ``drain()`` ends idle EncodeStreams, every Watch ends (OK);
5. wait for termination, at most the rest of the grace + ``STOP_SLACK_S``.

So a stop takes at most ``drain_s + grace_s + STOP_SLACK_S``.

Port sharing: SO_REUSEPORT is off unless ``reuse_port=True``; binding a port in use is a ``ConfigError``
(``BIND_FAILED``).

Calls: every ``Service``/``Method`` spec, health included, runs behind one guard:

1. admission: at most ``max_inflight_per_peer`` calls (``max_streams_per_peer`` streams) per ``Peer``, else
   RESOURCE_EXHAUSTED (``peer_limit``; a refused stream's client falls back to unary); at most
   ``max_inflight_calls`` in all;
2. the request must arrive within ``request_timeout_ms``, each later stream message within
   ``stream_idle_timeout_ms``, else the call is cancelled;
3. lanes: ``Lane.WORK`` (Encode) runs only holding one of ``work_slots``; ``Lane.CONTROL`` (releases,
   WorkerInfo, health) never waits for one, nor behind an Encode;
4. the handler runs inside a ``CallScope`` (``current_call()``).

Transport security: ``tls`` with a certificate makes the listener TLS (mTLS unless ``client_auth`` is off),
reloading changed certificate files. Without TLS, ``bind`` refuses a non-loopback address unless
``insecure=True``.
"""

from __future__ import annotations

import enum
import errno
import logging
import math
import queue
import socket
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from concurrent import futures
from contextlib import AbstractContextManager, contextmanager
from dataclasses import dataclass
from typing import Any, Literal

import grpc
from grpc_health.v1 import health_pb2

from tensorwire._grpc import status
from tensorwire._grpc.health import NOT_SERVING, SERVING, HealthService
from tensorwire._grpc.limits import ServerLimits
from tensorwire._grpc.owner import CallerCheck
from tensorwire._grpc.scope import CallScope, Peer, call_scope, forwarded_peer, is_loopback_host, peer_of
from tensorwire._grpc.tls import TlsConfig, server_credentials
from tensorwire._grpc.watchdog import DeadlineWatchdog
from tensorwire._ratelog import RateLimitedLog
from tensorwire.errors import ClosedError, ConfigError, Reason, TensorwireError

log = logging.getLogger(__name__)

# How long past its grace a stop waits for gRPC to report termination (cancelled calls unwinding).
STOP_SLACK_S = 5.0
HEALTH_SERVICE = "grpc.health.v1.Health"
# How often a call waiting for a work slot looks at its caller (gone: it stops waiting).
WORK_WAIT_POLL_S = 0.05

Settle = Callable[[float], None]
"""settle(deadline): returns when the caller's in-flight work is done, or at ``deadline`` (time.monotonic)."""


class HostState(str, enum.Enum):
    NEW = "new"
    BOUND = "bound"
    SERVING = "serving"
    STOPPED = "stopped"


class Lane(str, enum.Enum):
    WORK = "work"  # needs a work slot (Encode)
    CONTROL = "control"  # never waits for one (ReleaseLeases, WorkerInfo, health)


MethodKind = Literal["unary", "unary_stream", "stream"]


@dataclass(frozen=True)
class Method:
    """One RPC method. ``handler(request, context)`` for ``unary`` (returns the response) and ``unary_stream``
    (returns an iterator of responses); ``handler(requests, context)`` for ``stream`` (an iterator of raw request
    messages in, one of responses out). ``context`` is gRPC's server context; ``current_call()`` is the scope."""

    name: str
    handler: Callable[..., Any]
    kind: MethodKind = "unary"
    lane: Lane = Lane.CONTROL
    request_deserializer: Callable[[bytes], Any] | None = None
    response_serializer: Callable[[Any], bytes] | None = None


@dataclass(frozen=True)
class Service:
    name: str
    methods: tuple[Method, ...]


@dataclass
class HostStats:
    """What the guard refused or ended, since start (``GrpcHost.stats()``)."""

    peer_limit_refusals: int = 0
    stream_peer_limit_refusals: int = 0
    request_timeouts: int = 0
    stream_idle_ends: int = 0
    work_wait_timeouts: int = 0
    untrusted_callers: int = 0
    inflight: int = 0
    peers: int = 0


class _Wait:
    """One call waiting for its next request message; the watchdog cancels it unless the message came first."""

    __slots__ = ("context", "on_expire", "lock", "token", "waiting", "expired")

    def __init__(self, context: grpc.ServicerContext, on_expire: Callable[[], None]) -> None:
        self.context = context
        self.on_expire = on_expire
        self.lock = threading.Lock()
        self.token = 0
        self.waiting = 0
        self.expired = False

    def arm(self) -> int:
        with self.lock:
            self.token += 1
            self.waiting = self.token
            return self.token

    def disarm(self) -> None:
        with self.lock:
            self.waiting = 0

    def waiting_for(self, token: int) -> bool:
        return self.waiting == token

    def expire(self, token: int) -> None:
        with self.lock:
            if self.waiting != token:
                return
            self.expired = True
        self.on_expire()  # counted before the caller can see the cancellation
        self.context.cancel()  # wakes the handler blocked on the request iterator (it raises RpcError)


class _Admission:
    """In-flight calls and streams per peer key, under one lock."""

    def __init__(self, limits: ServerLimits) -> None:
        self._limits = limits
        self._lock = threading.Lock()
        self._calls: dict[str, int] = {}
        self._streams: dict[str, int] = {}
        self.total = 0

    def enter(self, key: str, stream: bool) -> Reason | None:
        """Counts the call in, or returns why not (nothing counted then)."""
        with self._lock:
            calls = self._calls.get(key, 0)
            if calls >= self._limits.max_inflight_per_peer:
                return Reason.PEER_LIMIT
            if stream:
                streams = self._streams.get(key, 0)
                if streams >= self._limits.max_streams_per_peer:
                    return Reason.PEER_LIMIT
                self._streams[key] = streams + 1
            self._calls[key] = calls + 1
            self.total += 1
            return None

    def leave(self, key: str, stream: bool) -> None:
        with self._lock:
            self.total -= 1
            left = self._calls.get(key, 1) - 1
            if left:
                self._calls[key] = left
            else:
                self._calls.pop(key, None)
            if stream:
                left = self._streams.get(key, 1) - 1
                if left:
                    self._streams[key] = left
                else:
                    self._streams.pop(key, None)

    def peers(self) -> int:
        with self._lock:
            return len(self._calls)


def health_service(servicer: HealthService) -> Service:
    """The standard grpc.health.v1 service as a ``Service``, so health calls pass the same guard. Watch runs on a
    thread of its own here (the guard's calls are generators), ending when the service ends its watches or the
    caller goes."""

    def watch(request: health_pb2.HealthCheckRequest, context: grpc.ServicerContext) -> Iterator[Any]:
        sent: queue.SimpleQueue[Any] = queue.SimpleQueue()
        context.add_callback(lambda: sent.put(None))  # the caller went: end the generator, free the thread
        servicer.Watch(request, context, sent.put)
        while (response := sent.get()) is not None:
            yield response

    return Service(
        HEALTH_SERVICE,
        (
            Method(
                "Check",
                servicer.Check,
                request_deserializer=health_pb2.HealthCheckRequest.FromString,
                response_serializer=health_pb2.HealthCheckResponse.SerializeToString,
            ),
            Method(
                "Watch",
                watch,
                kind="unary_stream",
                request_deserializer=health_pb2.HealthCheckRequest.FromString,
                response_serializer=health_pb2.HealthCheckResponse.SerializeToString,
            ),
        ),
    )


class GrpcHost:
    """``bind(address, insecure=False) -> port``, ``start(serving=True)``, ``set_serving(bool)``,
    ``stop(grace_s, ...)``, ``wait(timeout_s)``.

    ``what`` names the server in errors and logs ("encoder", "proxy"). ``services``: the methods to serve (see
    ``Method``); ``serving`` the service names health reports (besides ``""``). ``work_slots``: how many
    ``Lane.WORK`` calls run at once (the encoder's ``server_threads``). ``limits``: ``ServerLimits``; ``tls``:
    a ``TlsConfig`` (None or one without a certificate: plaintext). ``on_refuse(reason)`` is called for every
    call the guard refuses or ends (a bounded label: ``peer_limit``, ``request_timeout``, ``stream_idle``,
    ``work_wait``, ``untrusted_caller``), for metrics. ``reuse_port``: let other processes bind the same port
    (SO_REUSEPORT); off by default. ``stop`` may be called from any thread, any number of times (the first stops).
    """

    def __init__(
        self,
        what: str,
        services: Sequence[Service],
        *,
        work_slots: int,
        thread_prefix: str,
        limits: ServerLimits | None = None,
        tls: TlsConfig | None = None,
        serving: Sequence[str] = (),
        extra_options: Sequence[tuple[str, Any]] = (),
        on_refuse: Callable[[str], None] | None = None,
        reuse_port: bool = False,
    ) -> None:
        if work_slots <= 0:
            raise ConfigError(f"{what}: work_slots={work_slots} must be > 0")
        self.what = what
        self.limits = limits if limits is not None else ServerLimits()
        self.tls = tls if tls is not None and tls.server_enabled else None
        self.health = HealthService(("", *serving), NOT_SERVING)
        self._forwarders = self.limits.forwarders
        self._on_refuse = on_refuse
        self._work = threading.BoundedSemaphore(work_slots)
        self._admission = _Admission(self.limits)
        self._stats = HostStats()
        self._stats_lock = threading.Lock()
        self._watchdog = DeadlineWatchdog(f"{thread_prefix}-guard")
        n = self.limits.max_inflight_calls
        # One thread per admissible call: a call waiting for its request or a slot never delays another's start.
        self._server = grpc.server(
            futures.ThreadPoolExecutor(max_workers=n, thread_name_prefix=thread_prefix),
            options=[*self.limits.server_options(), ("grpc.so_reuseport", 1 if reuse_port else 0), *extra_options],
            maximum_concurrent_rpcs=n,
        )
        self._server.add_generic_rpc_handlers(tuple(self._handler(s) for s in (*services, health_service(self.health))))
        self._lock = threading.Lock()
        self.state = HostState.NEW
        self._stopping = False
        self.host = ""
        self.port = 0
        self.certificates: Any = None  # the TLS certificate source (reload counter), when TLS is on
        self._callers: CallerCheck | None = None  # a plaintext TCP listener's same-user rule (bind sets it)
        self._rl = RateLimitedLog(log)

    @property
    def address(self) -> str:
        return f"{self.host}:{self.port}"

    def bind(self, address: str, *, insecure: bool = False) -> int:
        """Binds ``address`` ("host:0" picks a port) and returns the port; ``ConfigError`` when it cannot, or when
        a plaintext listener would face a non-loopback address without ``insecure``."""
        with self._lock:
            if self.state is not HostState.NEW:
                raise ClosedError(f"{self.what} server is {self.state.value}; bind() comes once, first")
            host = address.rsplit(":", 1)[0]
            if self.tls is None and not insecure and not is_loopback_host(host):
                raise ConfigError(
                    f"refusing a plaintext {self.what} listener on {address!r}, which is not a loopback address: "
                    "anyone who can reach it could call it and read its answers. Give it a certificate "
                    "(--tls-cert, --tls-key, --tls-ca; see docs/security.md) or pass --insecure on a network you "
                    "trust"
                )
            port = self._bind(address)
            self.host = host or "127.0.0.1"
            self.port = port
            if self.tls is None and not address.startswith("unix:"):
                self._callers = CallerCheck(self.host, port)
            self.state = HostState.BOUND
            return port

    def _bind(self, address: str) -> int:
        try:
            if self.tls is not None:
                creds, self.certificates = server_credentials(self.tls)
                port = self._server.add_secure_port(address, creds)
            else:
                port = self._server.add_insecure_port(address)
        except RuntimeError:  # newer grpcio raises instead of returning 0
            port = 0
        if port == 0:
            raise ConfigError(
                f"cannot listen on {address} for the {self.what}: {_why_not(address)}", reason=Reason.BIND_FAILED
            )
        return int(port)

    def start(self, serving: bool = True) -> None:
        """Starts serving on the bound port; health reports SERVING, or NOT_SERVING until ``set_serving(True)``."""
        with self._lock:
            if self.state is not HostState.BOUND:
                raise ClosedError(f"{self.what} server is {self.state.value}; start() needs a bound, unstarted server")
            self._server.start()
            self.state = HostState.SERVING
        log.info(
            "%s on %s: %s, limits %s",
            self.what,
            self.address,
            self.tls.describe() if self.tls else "plaintext",
            self.limits,
        )
        if serving:
            self.set_serving(True)

    def set_serving(self, serving: bool) -> None:
        """What health answers for every name while the server runs; ignored once a stop began."""
        with self._lock:
            if self._stopping or self.state is not HostState.SERVING:
                return
            self.health.set_all(SERVING if serving else NOT_SERVING)

    def stop(
        self,
        grace_s: float | None,
        drain: Callable[[], None] | None = None,
        *,
        drain_s: float = 0.0,
        quiesce: Callable[[], None] | None = None,
        settle: Settle | None = None,
    ) -> None:
        """The stop sequence of the module docstring. Idempotent; the callbacks run only on the first call, and
        only when the server was serving. ``grace_s`` None: no limit for in-flight calls."""
        with self._lock:
            was, self.state, self._stopping = self.state, HostState.STOPPED, True
        if was is HostState.STOPPED:
            return
        try:
            self.health.set_all(NOT_SERVING)
            if was is HostState.SERVING:
                if drain_s > 0:
                    log.info(
                        "%s on %s: NOT_SERVING for %.1f s before it stops taking work", self.what, self.address, drain_s
                    )
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
                log.warning(
                    "%s server on %s had not terminated %.1f s after its grace", self.what, self.address, STOP_SLACK_S
                )
        finally:
            self._watchdog.close()

    def wait(self, timeout_s: float | None = None) -> bool:
        """Blocks until the server stops (True) or ``timeout_s`` passes (False)."""
        timed_out = self._server.wait_for_termination(timeout_s)  # grpc returns True when the timeout passed
        return not timed_out

    def stats(self) -> HostStats:
        with self._stats_lock:
            out = HostStats(**self._stats.__dict__)
        out.inflight = self._admission.total
        out.peers = self._admission.peers()
        return out

    # -- the guard ----------------------------------------------------------------------------------------

    def _count(self, what: str, label: str) -> None:
        with self._stats_lock:
            setattr(self._stats, what, getattr(self._stats, what) + 1)
        if self._on_refuse is not None:
            self._on_refuse(label)

    def _handler(self, service: Service) -> grpc.GenericRpcHandler:
        handlers: dict[str, grpc.RpcMethodHandler[Any, Any]] = {}
        check = service.name != HEALTH_SERVICE  # health answers everyone: it says SERVING or not, nothing else
        for m in service.methods:
            if m.kind == "unary":
                handlers[m.name] = grpc.stream_unary_rpc_method_handler(
                    self._guard_unary(m, check), response_serializer=m.response_serializer
                )
            else:
                handlers[m.name] = grpc.stream_stream_rpc_method_handler(
                    self._guard_streaming(m, check), response_serializer=m.response_serializer
                )
        return grpc.method_handlers_generic_handler(service.name, handlers)

    def _peer(self, context: grpc.ServicerContext) -> Peer:
        peer = peer_of(context, tls=self.tls is not None)
        if peer.key in self._forwarders:
            return forwarded_peer(context, peer)
        return peer

    def _scope(self, context: grpc.ServicerContext, peer: Peer) -> CallScope:
        left = context.time_remaining()
        deadline = math.inf if left is None else time.monotonic() + float(left)
        return _HostScope(peer, deadline=deadline, is_active=context.is_active, host=self)

    def _admit(self, context: grpc.ServicerContext, stream: bool, check_owner: bool = True) -> Peer:
        if check_owner and self._callers is not None:
            why = self._callers.allowed(str(context.peer() or ""))
            if why is not None:
                self._count("untrusted_callers", "untrusted_caller")
                self._rl.log(logging.WARNING, "untrusted", "%s on %s refused a call: %s", self.what, self.address, why)
                context.set_trailing_metadata(((status.REASON_METADATA_KEY, Reason.PERMISSION_DENIED.value),))
                context.abort(
                    grpc.StatusCode.PERMISSION_DENIED,
                    f"this plaintext {self.what} listener answers only its own user's processes on this host",
                )
        peer = self._peer(context)
        why = self._admission.enter(peer.key, stream)
        if why is not None:
            self._count("stream_peer_limit_refusals" if stream else "peer_limit_refusals", why.value)
            limit = self.limits.max_streams_per_peer if stream else self.limits.max_inflight_per_peer
            metadata: tuple[tuple[str, str], ...] = ((status.REASON_METADATA_KEY, why.value),)
            if stream:
                metadata += (status.STREAM_REFUSED_METADATA,)  # the client sends that request over unary instead
            context.set_trailing_metadata(metadata)
            context.abort(
                grpc.StatusCode.RESOURCE_EXHAUSTED,
                f"{self.what}: this peer already has {limit} {'stream' if stream else 'call'}(s) in "
                f"flight ({'max_streams_per_peer' if stream else 'max_inflight_per_peer'})",
            )
        return peer

    def _next_message(
        self, requests: Iterator[bytes], context: grpc.ServicerContext, timeout_s: float, label: str
    ) -> bytes | None:
        """The next request message within ``timeout_s``; None when the client half-closed. A message that does not
        come in time cancels the call (the RpcError the iterator raises then propagates)."""
        what = "request_timeouts" if label == "request_timeout" else "stream_idle_ends"
        wait = _Wait(context, lambda: self._count(what, label))
        token = wait.arm()
        self._watchdog.watch(time.monotonic() + timeout_s, wait, token)
        try:
            return next(requests)
        except StopIteration:
            return None
        finally:
            wait.disarm()

    def _first_request(self, requests: Iterator[bytes], context: grpc.ServicerContext, method: Method) -> Any:
        raw = self._next_message(requests, context, self.limits.request_timeout_ms / 1000.0, "request_timeout")
        if raw is None:
            context.set_trailing_metadata(((status.REASON_METADATA_KEY, Reason.INVALID_REQUEST.value),))
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"{method.name} needs one request message; none came")
        if method.request_deserializer is None:
            return raw
        try:
            return method.request_deserializer(raw)
        except Exception as exc:
            context.set_trailing_metadata(((status.REASON_METADATA_KEY, Reason.INVALID_REQUEST.value),))
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"{method.name} request does not parse: {exc}")

    def _guard_unary(self, method: Method, check_owner: bool) -> Callable[..., Any]:
        def guarded(requests: Iterator[bytes], context: grpc.ServicerContext) -> Any:
            peer = self._admit(context, stream=False, check_owner=check_owner)
            try:
                request = self._first_request(requests, context, method)
                scope = self._scope(context, peer)
                with call_scope(scope):
                    if method.lane is not Lane.WORK:
                        return method.handler(request, context)
                    try:
                        self._acquire_work(scope)
                    except TensorwireError as exc:  # the caller went, or its deadline passed while it waited
                        status.abort_with(context, exc)
                        raise
                    try:
                        return method.handler(request, context)
                    finally:
                        self._work.release()
            finally:
                self._admission.leave(peer.key, False)

        return guarded

    def _guard_streaming(self, method: Method, check_owner: bool) -> Callable[..., Any]:
        def guarded(requests: Iterator[bytes], context: grpc.ServicerContext) -> Iterator[Any]:
            stream = method.kind == "stream"
            peer = self._admit(context, stream=stream, check_owner=check_owner)
            try:
                scope = self._scope(context, peer)
                if stream:
                    with call_scope(scope):
                        yield from method.handler(self._messages(requests, context), context)
                    return
                request = self._first_request(requests, context, method)
                with call_scope(scope):
                    yield from method.handler(request, context)
            finally:
                self._admission.leave(peer.key, stream)

        return guarded

    def _messages(self, requests: Iterator[bytes], context: grpc.ServicerContext) -> Iterator[bytes]:
        """A stream's request messages: the first within ``request_timeout_ms``, each next one within
        ``stream_idle_timeout_ms`` of the handler asking for it (the handler asks only when idle)."""
        timeout_s, label = self.limits.request_timeout_ms / 1000.0, "request_timeout"
        while True:
            raw = self._next_message(requests, context, timeout_s, label)
            if raw is None:
                return
            yield raw
            timeout_s, label = self.limits.stream_idle_timeout_ms / 1000.0, "stream_idle"

    def _acquire_work(self, scope: CallScope) -> None:
        """Takes one work slot, waiting within the call's deadline; raises (``scope.check``) when the caller goes
        or the deadline passes first."""
        if self._work.acquire(blocking=False):
            return
        while True:
            left = scope.remaining_s()
            if left <= 0 or not scope.active():
                self._count("work_wait_timeouts", "work_wait")
                scope.check("waiting for a work slot")
                raise AssertionError("unreachable: check() raises for an expired or inactive call")
            if self._work.acquire(timeout=min(WORK_WAIT_POLL_S, left)):
                return

    @contextmanager
    def _work_slot(self, scope: CallScope) -> Iterator[None]:
        self._acquire_work(scope)
        try:
            yield
        finally:
            self._work.release()


class _HostScope(CallScope):
    """A CallScope whose ``work_slot()`` takes one of its host's work slots (for work a stream runs per message)."""

    def __init__(self, peer: Peer, *, deadline: float, is_active: Callable[[], bool], host: GrpcHost) -> None:
        super().__init__(peer, deadline=deadline, is_active=is_active)
        self._host = host

    def narrowed(self, budget_s: float) -> CallScope:
        return _HostScope(
            self.peer,
            deadline=min(self.deadline, time.monotonic() + budget_s),
            is_active=self._is_active or (lambda: True),
            host=self._host,
        )

    def work_slot(self) -> AbstractContextManager[None]:
        return self._host._work_slot(self)


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


__all__ = [
    "Admission",
    "GrpcHost",
    "HostState",
    "HostStats",
    "Lane",
    "Method",
    "STOP_SLACK_S",
    "Service",
    "Settle",
    "health_service",
]
