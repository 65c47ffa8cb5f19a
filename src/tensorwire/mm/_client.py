"""LLM side: RemoteOutputTransport.fetch(inputs) -> MultimodalOutput.

One fetch, one budget (never reset), shared by every step::

    budget = timeout_ms or max_i(item.timeout_ms > 0 ? item.timeout_ms : worker_timeout_ms) + margin
    advertise RDMA  iff  mode auto, the reader is built, and the endpoint breaker allows it
    Encode(request, deadline = remaining)
    receipt has slots, RDMA was advertised  -> consume:
        validate every descriptor and role list; read all slots in ONE batch with
        read_ms = min(remaining - fallback_reserve_ms, read_timeout_ms); check every tensor against its
        manifest; reassemble by role and split sizes
        ok   -> release async (a message on the fetch's stream, else the queue; never blocks), breaker success,
                return (plane rdma)
        fail -> sync release within min(release_timeout_ms, remaining); breaker failure unless the cause was the
                budget; the request is withdrawn to an _InlineAttempt and sent ONCE more if at least
                min_fallback_ms remain, else the original error is raised
    receipt has slots, RDMA not advertised -> sync release, ProtocolError(UNREQUESTED_RDMA), no fallback
    receipt inline -> decode (validated), return (plane inline)

Control path: a fetch checks out one of the transport's open EncodeStreams (or opens one, up to
``control_stream_pool``) and sends its Encode(s) there, then its success-path release as a fire-and-forget
message on the same stream before giving it back; with no stream to use (pool full, ``control_stream`` off, an
encoder that refused a stream or has no EncodeStream) it uses the unary Encode RPC and the async release queue.
Both paths raise the same exceptions; a request is sent over unary after a stream attempt only when the encoder
cannot have run it. Failure-path releases are synchronous unary ReleaseLeases RPCs on either path.

"At most one fallback" is a property of the types: the retry is an ``_InlineAttempt``, which has no RDMA
capability to advertise, and the terminal decoder it goes to returns an output or raises; nothing in it can
ask for another round.

Errors: the caller sees tensorwire exceptions only (PeerUnavailable, DeadlineExceeded, InvalidPayload,
ProtocolError, ReadError, ...). ``DeadlineExceeded`` with reason BUDGET_EXHAUSTED means the caller's own
budget ran out; it is never counted against an endpoint's breaker.

Thread-safety: ``fetch`` may be called from many threads at once (each uses its own checked-out stream);
``close`` is idempotent, flushes and ends the streams, and leaves no thread behind.
"""

from __future__ import annotations

import heapq
import itertools
import logging
import math
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Callable, Protocol, Sequence

import grpc
import torch

from tensorwire.errors import (
    ClosedError,
    ConfigError,
    DeadlineExceeded,
    InvalidPayload,
    ProtocolError,
    ReadError,
    ReadTimeout,
    Reason,
    TensorwireError,
)
from tensorwire.mm import _codec, wire
from tensorwire.mm._init import BackgroundInit, InitState, is_permanent
from tensorwire.mm._proto import encoder_pb2 as pb
from tensorwire.mm._ratelog import RateLimitedLog
from tensorwire.mm._breaker import BreakerBoard, BreakerState
from tensorwire.mm._config import MODE_AUTO, TransportConfig
from tensorwire.mm._metrics import TransportMetrics, metrics_for
from tensorwire.mm._release import ReleaseQueue
from tensorwire.mm._types import MultimodalInput, MultimodalOutput, Plane
from tensorwire.rdma import is_staged_gpu_transport

log = logging.getLogger(__name__)

MAX_SLOTS_PER_RECEIPT = 4096


class Reader(Protocol):
    """What the transport needs from ``tensorwire.rdma.TensorReader``."""

    def read(self, descriptors: Sequence[Any], timeout_ms: int | None = None) -> list[torch.Tensor]: ...
    def close(self) -> None: ...


ReaderFactory = Callable[[Any], Reader]
DescriptorParser = Callable[[bytes], Any]
Observer = Callable[[str, dict[str, Any]], None]
"""observer(event, details): "request" (details include ``path``: stream/unary), "read", "release_sync",
"release_stream", "release_async", "decode_inline"; for tests."""


def _default_reader_factory(rdma_config: Any) -> Reader:
    from tensorwire.rdma import TensorReader

    return TensorReader(rdma_config)  # type: ignore[no-any-return]


def _default_parser(config: TransportConfig) -> DescriptorParser:
    from tensorwire.rdma import Descriptor

    max_slot = int(config.rdma.max_slot_bytes)
    align = int(config.rdma.slot_align)
    return lambda data: Descriptor.from_bytes(data, max_slot_bytes=max_slot, slot_align=align)


def resolve_rpc_timeout_ms(inputs: Sequence[MultimodalInput], config: TransportConfig) -> int:
    """max over items of (item timeout if > 0 else worker_timeout_ms) + margin; the default with no items."""
    return wire.rpc_budget_ms((i.timeout_ms for i in inputs), worker_timeout_ms=config.worker_timeout_ms,
                              margin_ms=config.rpc_timeout_margin_ms)


class Budget:
    """The one deadline of a fetch."""

    def __init__(self, total_ms: float, clock: Callable[[], float] = time.monotonic) -> None:
        self.total_ms = float(total_ms)
        self._clock = clock
        self._deadline = clock() + self.total_ms / 1000.0

    def remaining_ms(self) -> float:
        return (self._deadline - self._clock()) * 1000.0


@dataclass(frozen=True)
class _RdmaAttempt:
    """A request that advertises RDMA. ``withdraw`` is the only way to the inline plane."""

    inputs: tuple[MultimodalInput, ...]
    excluded_workers: tuple[str, ...] = ()

    def to_pb(self, budget: Budget) -> pb.EncodeRequest:
        req = _codec.inputs_to_pb(self.inputs)
        req.support_rdma = True
        req.rdma_excluded_workers.extend(self.excluded_workers)
        req.deadline_ms = max(0, int(budget.remaining_ms()))
        return req

    def withdraw(self) -> _InlineAttempt:
        return _InlineAttempt(self.inputs)


@dataclass(frozen=True)
class _InlineAttempt:
    """A request that cannot advertise RDMA (it has no such field); its answer goes to the terminal decoder."""

    inputs: tuple[MultimodalInput, ...]

    def to_pb(self, budget: Budget) -> pb.EncodeRequest:
        req = _codec.inputs_to_pb(self.inputs)
        req.deadline_ms = max(0, int(budget.remaining_ms()))
        return req


@dataclass(frozen=True)
class _Retry:
    """An RDMA consume that did not deliver; the caller withdraws to the inline plane (once)."""

    error: TensorwireError
    endpoint_fault: bool  # False: the cause was the caller's budget; the breaker does not count it


@dataclass
class _Stages:
    ms: dict[str, float] = field(default_factory=dict)

    def add(self, name: str, seconds: float) -> None:
        self.ms[name] = self.ms.get(name, 0.0) + seconds * 1e3


class _Control:
    """The gRPC client of one endpoint: unary Encode/ReleaseLeases, and the pool of EncodeStreams on the same
    channel (``streams``; closing the control closes it). RpcError is translated once, here and in
    :class:`_StreamCall`.
    """

    def __init__(self, endpoint: str, options: list[tuple[str, Any]], config: TransportConfig,
                 metrics: TransportMetrics, requeue: Callable[[list[str]], None]) -> None:
        self.endpoint = endpoint
        self._channel = grpc.insecure_channel(endpoint, options=options)
        self._encode = self._channel.unary_unary(wire.ENCODE_METHOD, request_serializer=pb.EncodeRequest.SerializeToString,
                                                 response_deserializer=None)
        self._release = self._channel.unary_unary(wire.RELEASE_METHOD,
                                                  request_serializer=pb.ReleaseLeasesRequest.SerializeToString,
                                                  response_deserializer=pb.ReleaseLeasesResponse.FromString)
        self.streams = _StreamPool(self._channel, endpoint, config, metrics, requeue)

    def encode(self, request: pb.EncodeRequest, timeout_s: float) -> pb.EncodeResponse:
        if timeout_s <= 0:
            raise DeadlineExceeded("fetch budget exhausted before the Encode call", reason=Reason.BUDGET_EXHAUSTED)
        try:
            raw = self._encode(request, timeout=timeout_s)
        except grpc.RpcError as exc:
            raise wire.error_from_rpc(exc, f"Encode on {self.endpoint}") from exc
        try:
            return pb.EncodeResponse.FromString(raw)
        except Exception as exc:
            raise ProtocolError(f"receipt from {self.endpoint} does not parse: {exc}") from exc

    def release(self, lease_ids: list[str], timeout_s: float) -> int:
        try:
            resp = self._release(pb.ReleaseLeasesRequest(lease_ids=lease_ids), timeout=timeout_s)
        except grpc.RpcError as exc:
            raise wire.error_from_rpc(exc, f"ReleaseLeases on {self.endpoint}") from exc
        return int(resp.released)

    def close(self) -> None:
        try:
            self.streams.close(0.0)
        finally:
            self._channel.close()


class _Session:
    """One fetch's control path: the stream it checked out (or None: unary), given back by ``close``.

    ``encode`` sends over the stream when there is one. When the encoder refused the stream or has no
    EncodeStream, nothing was executed, so the same request goes over unary within the same budget; when the
    stream broke after the request may have been sent, the error is raised as the unary path would raise it
    (never sent twice). After a broken stream the rest of the fetch (its inline fallback) uses unary.
    ``release_after_read`` puts the success-path release on the stream (False: no stream; use the queue).
    """

    def __init__(self, control: _Control, pool: _StreamPool, metrics: TransportMetrics) -> None:
        self._control = control
        self._pool = pool
        self._metrics = metrics
        self._stream = pool.checkout()

    @property
    def path(self) -> str:
        return "stream" if self._stream is not None else "unary"

    def encode(self, request: pb.EncodeRequest, budget: Budget) -> pb.EncodeResponse:
        stream = self._stream
        if stream is not None:
            timeout_s = budget.remaining_ms() / 1000.0
            if timeout_s <= 0:
                raise DeadlineExceeded("fetch budget exhausted before the Encode call", reason=Reason.BUDGET_EXHAUSTED)
            try:
                return stream.encode(request, timeout_s)
            except _NotExecuted as exc:
                self._pool.not_usable(exc.kind)
                self._give_back()
            finally:
                if stream.broken:
                    self._give_back()
        timeout_s = budget.remaining_ms() / 1000.0
        if timeout_s > 0:
            self._metrics.control_rpcs.labels("unary").inc()
        return self._control.encode(request, timeout_s)

    def release_after_read(self, lease_ids: list[str]) -> bool:
        return self._stream is not None and self._stream.send_release(lease_ids)

    def _give_back(self) -> None:
        stream, self._stream = self._stream, None
        if stream is not None:
            self._pool.checkin(stream)

    def close(self) -> None:
        self._give_back()


class _NotExecuted(Exception):
    """The stream ended before the encoder handled this request (refused, no such method, or never sent)."""

    def __init__(self, kind: str) -> None:
        super().__init__(kind)
        self.kind = kind  # "refused", "unimplemented" or "not_sent"


_STREAM_THREAD = "tensorwire-mm-control"


class _StreamPool:
    """The open EncodeStreams of one transport: at most ``control_stream_pool``; one fetch uses one at a time.

    ``checkout`` returns an idle stream, opens one below the cap, or returns None (use unary): beyond the cap,
    after the encoder answered UNIMPLEMENTED (remembered for the transport's life), for ``open_seconds`` after
    it refused a stream, with ``control_stream`` off, and after ``close``. ``checkin`` keeps a healthy stream
    and ends a broken one (a broken stream is never reused). One watchdog thread enforces every waiting
    request's deadline.
    """

    def __init__(self, channel: grpc.Channel, endpoint: str, config: TransportConfig, metrics: TransportMetrics,
                 requeue: Callable[[list[str]], None]) -> None:
        self._method = channel.stream_stream(wire.ENCODE_STREAM_METHOD, request_serializer=None,
                                             response_deserializer=None)
        self.endpoint = endpoint
        self.metrics = metrics
        self.requeue = requeue
        self._cap = config.control_stream_pool
        self._enabled = config.control_stream
        self._refusal_s = float(config.open_seconds)
        self._lock = threading.Lock()
        self._idle: list[_StreamCall] = []
        self._open = 0
        self._unimplemented = False
        self._refused_until = 0.0
        self._closed = False
        self.watchdog = _Watchdog()
        self._rl = RateLimitedLog(log)

    @property
    def open_streams(self) -> int:
        with self._lock:
            return self._open

    def checkout(self) -> _StreamCall | None:
        if not self._enabled:
            return None
        stale: list[_StreamCall] = []
        try:
            with self._lock:
                if self._closed or self._unimplemented:
                    return None
                while self._idle:
                    stream = self._idle.pop()  # LIFO: the most recently used stream is the warmest
                    if stream.usable():
                        return stream
                    stale.append(stream)
                    self._open -= 1
                if self._open >= self._cap or time.monotonic() < self._refused_until:
                    return None
                self._open += 1
        finally:
            for stream in stale:
                stream.end()
        try:
            stream = _StreamCall(self._method, self)
        except Exception:
            with self._lock:
                self._open -= 1
            raise
        self.metrics.control_streams.labels("llm", "opened").inc()
        return stream

    def checkin(self, stream: _StreamCall) -> None:
        with self._lock:
            keep = not self._closed and stream.usable()
            if keep:
                self._idle.append(stream)
            else:
                self._open -= 1
        if not keep:
            stream.end()

    def not_usable(self, kind: str) -> None:
        self.metrics.control_streams.labels("llm", kind).inc()
        with self._lock:
            if kind == "unimplemented":
                self._unimplemented = True
            elif kind == "refused":
                self._refused_until = time.monotonic() + self._refusal_s
        if kind == "unimplemented":
            self._rl.log(logging.INFO, "unimplemented", "%s has no EncodeStream (an older encoder or a proxy); "
                         "using the unary Encode for this transport", self.endpoint)
        elif kind == "refused":
            self._rl.log(logging.INFO, "refused", "%s refused another EncodeStream (its server_stream_cap); using "
                         "the unary Encode beyond the streams already open for %.0f s", self.endpoint,
                         self._refusal_s)

    def close(self, timeout_s: float) -> None:
        """Half-closes the idle streams (queued releases still go out) and waits up to ``timeout_s`` for them to
        end, then cancels what is left. Streams still checked out end at their checkin. Idempotent."""
        with self._lock:
            self._closed = True
            idle, self._idle = self._idle, []
            self._open -= len(idle)
        for stream in idle:
            stream.half_close()
        deadline = time.monotonic() + timeout_s
        for stream in idle:
            stream.end(max(0.0, deadline - time.monotonic()))
        self.watchdog.close()


class _StreamCall:
    """One open EncodeStream. Used by one fetch at a time; answers are read on that fetch's thread.

    Requests wait in ``_outbox`` until gRPC's sender thread takes them through ``_requests()``; that thread
    blocks there while the stream is idle and leaves when the stream is half-closed or the call ends (the done
    callback wakes it). Releases still in the outbox when the call ends were never sent: they go to the
    transport's unary release queue. ``broken`` (the call ended, was cancelled or misbehaved) is final.
    """

    def __init__(self, method: Any, pool: _StreamPool) -> None:
        self._pool = pool
        self._cv = threading.Condition()
        self._outbox: deque[tuple[bytes, int, list[str] | None]] = deque()  # (message, encode id or 0, release ids)
        self._half_closed = False
        self._done = False
        self.broken = False
        self._next_id = 0
        self._waiting_id = 0  # the request whose answer is awaited (0: none); the watchdog reads it
        self._sent_id = 0     # the last Encode handed to gRPC
        self._deadline_hit = False
        self._ended = threading.Event()
        self._call = method(self._requests())
        self._call.add_done_callback(self._on_done)

    def usable(self) -> bool:
        return not self.broken and not self._done and not self._call.done()

    def encode(self, request: pb.EncodeRequest, timeout_s: float) -> pb.EncodeResponse:
        endpoint = self._pool.endpoint
        self._next_id += 1
        rid = self._next_id
        data = wire.stream_frame(rid, wire.STREAM_ENCODE_FIELD, request.SerializeToString())
        deadline = time.monotonic() + timeout_s
        with self._cv:
            if self._done or self._call.done():
                self.broken = True
                raise _NotExecuted(self._why_ended(self._call))
            self._outbox.append((data, rid, None))
            self._waiting_id = rid
            self._cv.notify()
        self._pool.watchdog.watch(deadline, self, rid)
        raw: bytes | None = None
        failure: grpc.RpcError | None = None
        try:
            raw = next(self._call)
        except StopIteration:
            pass
        except grpc.RpcError as exc:
            failure = exc
        with self._cv:
            self._waiting_id = 0
            deadline_hit = self._deadline_hit
            sent = self._sent_id >= rid
            if raw is None and not sent:
                self._outbox = deque(item for item in self._outbox if item[1] != rid)
        metrics = self._pool.metrics
        if raw is None:
            self.broken = True
            if deadline_hit:
                if sent:
                    metrics.child(metrics.control_rpcs, "stream").inc()
                raise DeadlineExceeded(f"Encode on {endpoint} failed with DEADLINE_EXCEEDED: no answer on the "
                                       f"EncodeStream within {timeout_s:.3f} s", reason=Reason.DEADLINE_EXCEEDED)
            why = self._why_ended(failure)
            if why != "not_sent" or not sent or failure is None:
                # failure None: the encoder ended the stream cleanly without answering, and it answers every
                # Encode it takes before it ends a stream (it does so when it stops): this one never ran.
                raise _NotExecuted(why)
            # It may have run on the encoder: raised as the unary path would raise it, never sent again.
            metrics.child(metrics.control_rpcs, "stream").inc()
            metrics.control_streams.labels("llm", "broken").inc()
            raise wire.error_from_rpc(failure, f"Encode on {endpoint}") from failure
        metrics.child(metrics.control_rpcs, "stream").inc()
        if deadline_hit:
            self.broken = True  # answered, but the watchdog cancelled the call as the answer came in
        try:
            response = pb.StreamResponse.FromString(raw)
        except Exception as exc:
            self._fail(f"an EncodeStream answer from {endpoint} does not parse: {exc}")
            raise ProtocolError(f"receipt from {endpoint} does not parse: {exc}") from exc
        if response.id != rid:
            self._fail(f"answer {response.id} on the EncodeStream of {endpoint} for request {rid}")
            raise ProtocolError(f"{endpoint} answered request {response.id} on an EncodeStream awaiting {rid}")
        body = response.WhichOneof("body")
        if body == "receipt":
            return response.receipt
        if body == "error":
            raise wire.error_from_stream(response.error, f"Encode on {endpoint}")
        self._fail(f"an EncodeStream answer from {endpoint} has no body")
        raise ProtocolError(f"{endpoint} answered request {rid} with neither a receipt nor an error")

    @staticmethod
    def _why_ended(failure: Any) -> str:
        """How an ended call (an RpcError, or the done call itself) ended, when that means nothing ran."""
        if failure is None:
            return "not_sent"
        if failure.code() == grpc.StatusCode.UNIMPLEMENTED:
            return "unimplemented"  # no such method: the encoder never looked at a message
        if wire.is_stream_refusal(failure):
            return "refused"  # refused before any message was read
        return "not_sent"

    def send_release(self, lease_ids: list[str]) -> bool:
        """Queues a Release (never answered). False when the stream cannot take it (the caller uses unary)."""
        if not lease_ids:
            return True
        data = wire.stream_frame(0, wire.STREAM_RELEASE_FIELD,
                                 pb.ReleaseLeasesRequest(lease_ids=lease_ids).SerializeToString())
        with self._cv:
            if self.broken or self._done or self._half_closed:
                return False
            self._outbox.append((data, 0, lease_ids))
            self._cv.notify()
        return True

    def expire(self, rid: int) -> None:
        """The watchdog's cancel: only if ``rid`` is still awaited (an answered request is left alone)."""
        with self._cv:
            if self._waiting_id != rid:
                return
            self._deadline_hit = True
            self.broken = True
            self._pool.metrics.control_streams.labels("llm", "deadline").inc()
            self._call.cancel()

    def waiting_for(self, rid: int) -> bool:
        return self._waiting_id == rid

    def half_close(self) -> None:
        with self._cv:
            self._half_closed = True
            self._cv.notify_all()

    def end(self, timeout_s: float = 0.0) -> None:
        """Half-closes, waits up to ``timeout_s`` for the call to end, then cancels it (its threads then leave)."""
        self.half_close()
        if timeout_s > 0:
            self._ended.wait(timeout_s)
        if not self._ended.is_set():
            self._call.cancel()

    def _fail(self, why: str) -> None:
        self.broken = True
        self._pool.metrics.control_streams.labels("llm", "protocol_error").inc()
        log.warning("%s; dropping the stream", why)
        self._call.cancel()

    def _requests(self) -> Any:
        metrics = self._pool.metrics
        while True:
            with self._cv:
                while not self._outbox and not self._half_closed and not self._done:
                    self._cv.wait()
                if self._done or not self._outbox:
                    return
                data, rid, release_ids = self._outbox.popleft()
                if rid:
                    self._sent_id = rid
            if release_ids is not None:
                metrics.child(metrics.releases, "stream", "sent").inc(len(release_ids))
            yield data

    def _on_done(self, call: Any) -> None:
        with self._cv:
            self._done = True
            self.broken = True
            orphans = [ids for _, _, ids in self._outbox if ids is not None]
            self._outbox.clear()
            self._cv.notify_all()
        metrics = self._pool.metrics
        metrics.control_streams.labels("llm", "closed").inc()
        for ids in orphans:
            # Never handed to gRPC, so never seen by the encoder: the unary queue sends them instead.
            metrics.releases.labels("stream", "requeued").inc(len(ids))
            self._pool.requeue(ids)
        self._ended.set()


class _Watchdog:
    """Cancels a stream whose awaited answer passed its deadline (``next()`` on a stream has no timeout).

    One thread per transport, started on first use, holding a heap of (deadline, seq, stream, request id). It
    sleeps until the earliest deadline and is woken only when a new earliest deadline arrives or on close, so
    a steady state of multi-second budgets costs no wake-ups. Answered entries are dropped lazily (from the
    top, on ``watch`` and when the thread wakes); ``_StreamCall.expire`` re-checks under the stream's lock.
    """

    def __init__(self) -> None:
        self._cv = threading.Condition()
        self._heap: list[tuple[float, int, _StreamCall, int]] = []
        self._seq = itertools.count()
        self._thread: threading.Thread | None = None
        self._closed = False
        self._sleep_until = math.inf  # the deadline the thread sleeps toward
        self.wakeups = 0  # times the thread woke up (tests check the steady state costs none)

    def watch(self, deadline: float, stream: _StreamCall, rid: int) -> None:
        with self._cv:
            if self._closed:
                return
            while self._heap and not self._heap[0][2].waiting_for(self._heap[0][3]):
                heapq.heappop(self._heap)
            heapq.heappush(self._heap, (deadline, next(self._seq), stream, rid))
            if self._thread is None:
                self._thread = threading.Thread(target=self._loop, name=_STREAM_THREAD + "-watchdog", daemon=True)
                self._thread.start()
            elif deadline < self._sleep_until:
                self._cv.notify()  # a new earliest deadline; otherwise the thread sleeps on

    def _loop(self) -> None:
        while True:
            expired: list[tuple[_StreamCall, int]] = []
            with self._cv:
                if self._closed:
                    return
                now = time.monotonic()
                while self._heap and (self._heap[0][0] <= now or not self._heap[0][2].waiting_for(self._heap[0][3])):
                    _, _, stream, rid = heapq.heappop(self._heap)
                    if stream.waiting_for(rid):
                        expired.append((stream, rid))
                if not expired:
                    self._sleep_until = self._heap[0][0] if self._heap else math.inf
                    self._cv.wait(self._sleep_until - now if self._heap else None)
                    self._sleep_until = -math.inf  # awake: watch() need not notify
                    self.wakeups += 1
                    continue
            for stream, rid in expired:
                stream.expire(rid)

    def close(self) -> None:
        with self._cv:
            self._closed = True
            self._heap.clear()
            self._cv.notify_all()
            thread = self._thread
        if thread is not None and thread is not threading.current_thread():
            thread.join(5.0)


class RemoteOutputTransport:
    """The LLM-side transport for one encoder endpoint (a worker or a proxy in front of workers).

    Keyword-only test seams: ``reader_factory`` / ``descriptor_parser`` (default tensorwire.rdma),
    ``clock`` (the breaker's and the budget's), ``metrics`` (a TransportMetrics on your registry),
    ``release_queue`` (its sender must reach this endpoint; default: one queue per transport), ``observer``.
    """

    def __init__(self, endpoint: str, config: TransportConfig | None = None, *,
                 reader_factory: ReaderFactory | None = None, descriptor_parser: DescriptorParser | None = None,
                 clock: Callable[[], float] = time.monotonic, metrics: TransportMetrics | None = None,
                 release_queue: ReleaseQueue | None = None, observer: Observer | None = None) -> None:
        if not endpoint:
            raise ConfigError("endpoint must be 'host:port'")
        self.endpoint = endpoint
        self.config = config if config is not None else TransportConfig()
        self.metrics = metrics if metrics is not None else metrics_for(None)
        self._clock = clock
        self._observer = observer
        self._control = _Control(endpoint, wire.channel_options(), self.config, self.metrics,
                                 requeue=lambda ids: self._queue.submit(self.endpoint, ids))
        self._streams = self._control.streams
        self._owns_queue = release_queue is None
        self._queue = release_queue if release_queue is not None else ReleaseQueue(
            self._send_release, max_pending=self.config.release_queue_max,
            release_timeout_ms=self.config.release_timeout_ms, shutdown_ms=self.config.release_shutdown_ms,
            metrics=self.metrics)
        self.endpoint_breakers = BreakerBoard("endpoint", self.config.failures_to_open, self.config.open_seconds,
                                              clock, self.metrics)
        self.worker_breakers = BreakerBoard("worker", self.config.failures_to_open, self.config.open_seconds,
                                            clock, self.metrics)
        self._rl = RateLimitedLog(log)
        self._closed = False
        rfactory = reader_factory or _default_reader_factory
        cfg = self.config
        self._parse: DescriptorParser | None = descriptor_parser
        self._reader: BackgroundInit[Reader] = BackgroundInit(
            "reader", lambda: rfactory(cfg.rdma), is_permanent, backoff_s=cfg.init_backoff_ms / 1000.0,
            backoff_max_s=cfg.init_backoff_max_ms / 1000.0,
            on_failure=lambda exc, permanent: self.metrics.fallbacks.labels("llm", "rdma_init_failed").inc())
        if self.config.mode == MODE_AUTO:
            # Warm up now, off the request path; until it is ready, fetch does not advertise RDMA.
            self._reader.start()

    # -- public -------------------------------------------------------------------------------------------

    @property
    def reader_state(self) -> InitState:
        return self._reader.state

    def wait_ready(self, timeout_s: float) -> bool:
        """Waits for the RDMA reader to be built (False in mode grpc or when it cannot be)."""
        return self._reader.wait_ready(timeout_s)

    @property
    def release_queue(self) -> ReleaseQueue:
        return self._queue

    def fetch(self, inputs: Sequence[MultimodalInput], timeout_ms: int | None = None) -> MultimodalOutput:
        """Asks the encoder for ``inputs``' output and returns it as owning tensors (see the module docstring)."""
        if self._closed:
            raise ClosedError("RemoteOutputTransport is closed")
        items = tuple(inputs)
        total_ms = resolve_rpc_timeout_ms(items, self.config) if timeout_ms is None else timeout_ms
        budget = Budget(total_ms, self._clock)
        stages = _Stages()
        t0 = time.perf_counter()
        session = _Session(self._control, self._streams, self.metrics)
        try:
            excluded = self._advertise()
            if excluded is not None:
                out = self._fetch_rdma(_RdmaAttempt(items, excluded), budget, stages, session)
            else:
                out = self._fetch_inline(_InlineAttempt(items), budget, stages, session, fallback_from=None)
        except TensorwireError as exc:
            self.metrics.errors.labels("llm", exc.reason.value).inc()
            raise
        finally:
            session.close()
        elapsed = time.perf_counter() - t0
        stages.add("total", elapsed)
        out.stage_ms = stages.ms
        self.metrics.child(self.metrics.fetch_seconds, out.plane.value).observe(elapsed)
        self.metrics.child(self.metrics.requests, "llm", out.plane.value).inc()
        return out

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        try:
            # Streams first: their queued releases still reach the encoder (and any they could not send go to
            # the queue, which is closed next).
            self._streams.close(self.config.release_shutdown_ms / 1000.0)
            if self._owns_queue:
                self._queue.close()
        finally:
            try:
                self._reader.close()
            finally:
                self._control.close()

    def __enter__(self) -> RemoteOutputTransport:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- planes -------------------------------------------------------------------------------------------

    def _advertise(self) -> tuple[str, ...] | None:
        """None: do not advertise. Otherwise the workers to exclude (their breakers are open)."""
        if self.config.mode != MODE_AUTO or self._reader.get() is None:
            return None
        if not self.endpoint_breakers.allow(self.endpoint):
            return None
        return tuple(w for w in self.worker_breakers.keys_not_closed() if not self.worker_breakers.allow(w))

    def _emit(self, event: str, **details: Any) -> None:
        if self._observer is not None:
            self._observer(event, details)

    def _request(self, attempt: _RdmaAttempt | _InlineAttempt, budget: Budget, stages: _Stages, session: _Session,
                 stage: str) -> pb.EncodeResponse:
        req = attempt.to_pb(budget)
        self._emit("request", support_rdma=req.support_rdma, excluded=list(req.rdma_excluded_workers),
                   path=session.path)
        t = time.perf_counter()
        try:
            return session.encode(req, budget)
        finally:
            stages.add(stage, time.perf_counter() - t)

    def _fetch_rdma(self, attempt: _RdmaAttempt, budget: Budget, stages: _Stages,
                    session: _Session) -> MultimodalOutput:
        try:
            receipt = self._request(attempt, budget, stages, session, "request")
        except TensorwireError:
            self._neutral(None)
            raise
        worker = receipt.worker.worker_id
        self._neutral_probes_except(worker)
        if not receipt.rdma_slots:
            # The encoder chose inline (exporter not ready, this worker excluded, ...): nothing learned about RDMA.
            self._neutral(worker)
            return self._decode_terminal(receipt, budget, stages, fallback_from=None)
        result = self._consume_rdma(receipt, budget, stages, session)
        if isinstance(result, MultimodalOutput):
            return result
        if result.endpoint_fault:
            self.endpoint_breakers.record_failure(self.endpoint)
            if worker:
                self.worker_breakers.record_failure(worker)
        else:
            self._neutral(worker)
        reason = result.error.reason
        self.metrics.fallbacks.labels("llm", reason.value).inc()
        if budget.remaining_ms() < self.config.min_fallback_ms:
            self._rl.log(logging.WARNING, "nofallback-" + reason.value,
                         "RDMA consume failed (%s) and %.0f ms of budget remain (< min_fallback_ms=%d); no fallback",
                         result.error, budget.remaining_ms(), self.config.min_fallback_ms)
            if result.endpoint_fault:
                raise result.error
            raise DeadlineExceeded(f"data-plane fallback exhausted request deadline ({result.error})",
                                   reason=Reason.BUDGET_EXHAUSTED) from result.error
        self._rl.log(logging.WARNING, "fallback-" + reason.value,
                     "RDMA consume from %s failed (%s); falling back to inline once", self.endpoint, result.error)
        return self._fetch_inline(attempt.withdraw(), budget, stages, session, fallback_from=reason)

    def _fetch_inline(self, attempt: _InlineAttempt, budget: Budget, stages: _Stages, session: _Session,
                      fallback_from: Reason | None) -> MultimodalOutput:
        stage = "request" if fallback_from is None else "fallback_request"
        receipt = self._request(attempt, budget, stages, session, stage)
        return self._decode_terminal(receipt, budget, stages, fallback_from)

    def _decode_terminal(self, receipt: pb.EncodeResponse, budget: Budget, stages: _Stages,
                         fallback_from: Reason | None) -> MultimodalOutput:
        """The terminal plane: decodes inline bytes or raises. It cannot ask for another round."""
        if receipt.rdma_slots:
            ids = self._lease_ids_best_effort(receipt)
            self._release_sync(ids, budget, stages)
            self._rl.log(logging.WARNING, "unrequested", "encoder %s sent an RDMA receipt (%d slot(s)) that was "
                         "not asked for; released and failing the request", self.endpoint, len(receipt.rdma_slots))
            raise ProtocolError(f"{self.endpoint} answered with {len(receipt.rdma_slots)} RDMA slot(s) to a request "
                                "that did not advertise RDMA", reason=Reason.UNREQUESTED_RDMA)
        t = time.perf_counter()
        embs, splits, pos, extras, nbytes = _codec.decode_inline_receipt(receipt)
        stages.add("decode", time.perf_counter() - t)
        self._emit("decode_inline", items=len(splits))
        self.metrics.bytes.labels("llm", "inline", "embedding").inc(len(receipt.embedding.data))
        self.metrics.bytes.labels("llm", "inline", "pos_id").inc(len(receipt.position_ids.data))
        self.metrics.bytes.labels("llm", "inline", "extra_input").inc(sum(len(t.data) for t in receipt.extra_inputs))
        _add_encoder_stages(stages, receipt)
        return MultimodalOutput(embeddings=embs, split_sizes=splits, position_ids=pos, extra_inputs=extras,
                                plane=Plane.INLINE, fallback_reason=fallback_from, worker_id=receipt.worker.worker_id,
                                payload_bytes=nbytes)

    def _consume_rdma(self, receipt: pb.EncodeResponse, budget: Budget, stages: _Stages,
                      session: _Session) -> MultimodalOutput | _Retry:
        parsed = self._parse_slots(receipt)
        ids = _lease_ids(parsed)
        try:
            descs, roles = self._validate_slots(receipt, parsed)
        except TensorwireError as exc:
            self._release_sync(ids, budget, stages)
            return _Retry(exc, endpoint_fault=True)
        remaining = budget.remaining_ms() - self.config.fallback_reserve_ms
        cap = int(self.config.rdma.read_timeout_ms)
        budget_limited = cap <= 0 or remaining < cap
        read_ms = int(math.floor(remaining if budget_limited else cap))
        if read_ms <= 0:
            self._release_sync(ids, budget, stages)
            return _Retry(DeadlineExceeded(f"no budget left for the RDMA read ({budget.remaining_ms():.0f} ms remain, "
                                           f"{self.config.fallback_reserve_ms} ms reserved for the fallback)",
                                           reason=Reason.BUDGET_EXHAUSTED), endpoint_fault=False)
        reader = self._reader.get()
        if reader is None:  # closed under us
            self._release_sync(ids, budget, stages)
            return _Retry(ReadError("RDMA reader is not available", reason=Reason.PROVIDER_UNAVAILABLE), False)
        self._emit("read", slots=len(descs), timeout_ms=read_ms)
        t = time.perf_counter()
        try:
            tensors = reader.read(descs, timeout_ms=read_ms)
        except ReadTimeout as exc:
            stages.add("read", time.perf_counter() - t)
            self._release_sync(ids, budget, stages)
            if budget_limited:
                return _Retry(DeadlineExceeded(f"RDMA read ran out of the request budget ({read_ms} ms): {exc}",
                                               reason=Reason.BUDGET_EXHAUSTED), endpoint_fault=False)
            return _Retry(exc, endpoint_fault=True)
        except TensorwireError as exc:
            stages.add("read", time.perf_counter() - t)
            self._release_sync(ids, budget, stages)
            return _Retry(exc, endpoint_fault=True)
        except Exception as exc:  # a provider bug: same treatment as a read error, keep the cause
            stages.add("read", time.perf_counter() - t)
            self._release_sync(ids, budget, stages)
            err = ReadError(f"RDMA read raised {exc!r}", reason=Reason.RDMA_READ_ERROR)
            err.__cause__ = exc
            return _Retry(err, endpoint_fault=True)
        read_s = time.perf_counter() - t
        stages.add("read", read_s)
        self.metrics.read_seconds.observe(read_s)
        try:
            output = self._assemble(descs, roles, tensors, receipt)
        except TensorwireError as exc:
            self._release_sync(ids, budget, stages)
            return _Retry(exc, endpoint_fault=True)
        t = time.perf_counter()
        if session.release_after_read(ids):
            released_by = "release_stream"
        else:
            self._queue.submit(self.endpoint, ids)
            released_by = "release_async"
        stages.add("release", time.perf_counter() - t)
        self._emit(released_by, lease_ids=list(ids))
        self.endpoint_breakers.record_success(self.endpoint)
        if output.worker_id:
            self.worker_breakers.record_success(output.worker_id)
        self._log_hit(len(descs), output.payload_bytes, read_s)
        self._note_transport(reader)
        _add_encoder_stages(stages, receipt)
        return output

    # -- helpers ------------------------------------------------------------------------------------------

    def _parser(self) -> DescriptorParser:
        if self._parse is None:
            self._parse = _default_parser(self.config)
        return self._parse

    def _parse_slots(self, receipt: pb.EncodeResponse) -> list[Any]:
        """Each slot's descriptor, or the exception parsing it raised; parsed once per receipt (on a slow host a
        parse with its validation costs tens of microseconds)."""
        parse = self._parser()
        out: list[Any] = []
        for slot in receipt.rdma_slots[:MAX_SLOTS_PER_RECEIPT]:
            try:
                out.append(parse(slot.descriptor))
            except Exception as exc:  # kept for _validate_slots, which raises it
                out.append(exc)
        return out

    def _lease_ids_best_effort(self, receipt: pb.EncodeResponse) -> list[str]:
        """Every lease id that can be read out of the receipt (unparsable slots are left to the owner's GC)."""
        return _lease_ids(self._parse_slots(receipt))

    def _validate_slots(self, receipt: pb.EncodeResponse, parsed: list[Any]) -> tuple[list[Any], list[int]]:
        if len(receipt.rdma_slots) > MAX_SLOTS_PER_RECEIPT:
            raise ProtocolError(f"receipt has {len(receipt.rdma_slots)} slots, over {MAX_SLOTS_PER_RECEIPT}")
        if receipt.HasField("embedding") or receipt.HasField("position_ids") or len(receipt.extra_inputs):
            raise ProtocolError("RDMA receipt also carries inline tensors")
        descs, roles = [], []
        for i, (slot, desc) in enumerate(zip(receipt.rdma_slots, parsed)):
            if isinstance(desc, BaseException):
                raise desc  # InvalidDescriptor with a reason
            if len(slot.roles) != len(desc.manifest):
                raise InvalidPayload(f"slot {i}: {len(slot.roles)} roles for {len(desc.manifest)} tensors",
                                     reason=Reason.ASSEMBLY_MISMATCH)
            for r in slot.roles:
                if r not in _codec.ROLE_LABELS:
                    raise InvalidPayload(f"slot {i}: role {r} is unspecified or unknown", reason=Reason.ASSEMBLY_MISMATCH)
            descs.append(desc)
            roles.extend(slot.roles)
        return descs, roles

    def _assemble(self, descs: list[Any], roles: list[int], tensors: list[torch.Tensor],
                  receipt: pb.EncodeResponse) -> MultimodalOutput:
        metas = [m for d in descs for m in d.manifest]
        if len(tensors) != len(roles) or len(metas) != len(roles):
            raise ReadError(f"read returned {len(tensors)} tensors for {len(roles)} manifest entries",
                            reason=Reason.RESULT_MISMATCH)
        for i, (t, m) in enumerate(zip(tensors, metas)):
            if tuple(t.shape) != tuple(m.shape) or t.dtype != m.dtype:
                raise ReadError(f"tensor {i}: read {tuple(t.shape)} {t.dtype}, manifest says {tuple(m.shape)} "
                                f"{m.dtype}", reason=Reason.RESULT_MISMATCH)
        chunks: list[torch.Tensor] = []
        pos: torch.Tensor | None = None
        extras: list[torch.Tensor] = []
        nbytes = 0
        for t, role in zip(tensors, roles):
            nbytes += t.numel() * t.element_size()
            self.metrics.child(self.metrics.bytes, "llm", "rdma", _codec.ROLE_LABELS[role]).inc(t.numel() * t.element_size())
            if role == pb.EMBEDDING:
                chunks.append(t)
            elif role == pb.POS_ID:
                if pos is not None:
                    raise InvalidPayload("receipt has more than one POS_ID tensor", reason=Reason.ASSEMBLY_MISMATCH)
                pos = t.cpu()  # position ids are consumed on the host (documented on MultimodalOutput)
            else:
                extras.append(t)
        if not chunks:
            raise InvalidPayload("RDMA receipt has no EMBEDDING tensor", reason=Reason.ASSEMBLY_MISMATCH)
        if len({(c.shape[1:], c.dtype) for c in chunks}) != 1:
            raise InvalidPayload("embedding chunks disagree in row shape or dtype", reason=Reason.ASSEMBLY_MISMATCH)
        embedding = chunks[0] if len(chunks) == 1 else torch.cat(chunks, 0)
        splits = [int(s) for s in receipt.split_sizes]
        embs, pos_parts, extra_list = _codec.assemble(embedding, splits, pos, extras)
        return MultimodalOutput(embeddings=embs, split_sizes=splits, position_ids=pos_parts, extra_inputs=extra_list,
                                plane=Plane.RDMA, worker_id=receipt.worker.worker_id, payload_bytes=nbytes)

    def _release_sync(self, lease_ids: list[str], budget: Budget, stages: _Stages) -> None:
        """Best effort within min(release_timeout_ms, remaining); the owner's GC is the backstop."""
        if not lease_ids:
            return
        timeout_ms = min(float(self.config.release_timeout_ms), budget.remaining_ms())
        self._emit("release_sync", lease_ids=list(lease_ids), timeout_ms=timeout_ms)
        if timeout_ms <= 0:
            self.metrics.releases.labels("sync", "release_budget_exhausted").inc(len(lease_ids))
            return
        t = time.perf_counter()
        try:
            self._control.release(lease_ids, timeout_ms / 1000.0)
        except TensorwireError as exc:
            self.metrics.releases.labels("sync", exc.reason.value).inc(len(lease_ids))
            self._rl.log(logging.WARNING, "sync-release", "sync release of %d lease(s) on %s failed: %s; the "
                         "encoder's TTL GC will reclaim them", len(lease_ids), self.endpoint, exc)
            return
        finally:
            stages.add("release", time.perf_counter() - t)
        self.metrics.release_seconds.labels("sync").observe(time.perf_counter() - t)
        self.metrics.releases.labels("sync", "ok").inc(len(lease_ids))

    def _send_release(self, endpoint: str, lease_ids: list[str], timeout_s: float) -> None:
        if endpoint != self.endpoint:  # a shared queue routes each batch to its own transport's channel
            raise ProtocolError(f"release batch for {endpoint} reached the transport of {self.endpoint}")
        self._control.release(lease_ids, timeout_s)

    def _neutral(self, worker: str | None) -> None:
        self.endpoint_breakers.record_neutral(self.endpoint)
        if worker:
            self.worker_breakers.record_neutral(worker)

    def _neutral_probes_except(self, worker: str) -> None:
        for w in self.worker_breakers.keys_not_closed():
            if w != worker and self.worker_breakers.state(w) is BreakerState.HALF_OPEN:
                self.worker_breakers.record_neutral(w)

    def _note_transport(self, reader: Reader) -> None:
        # Never silently slow: a GPU read UCX staged through TCP/host memory is counted (the rdma layer also logs
        # a WARNING once per peer). transport() is a cached lookup, not a probe.
        if not self.config.rdma.device.startswith("cuda"):
            return
        transport = getattr(reader, "transport", None)
        if callable(transport) and is_staged_gpu_transport(str(transport())):
            self.metrics.staged_gpu_reads.inc()

    def _log_hit(self, slots: int, nbytes: int, read_s: float) -> None:
        # First hit at INFO (smoke tests grep it), then at most once per interval: never per request.
        self._rl.log(logging.INFO, "hit", "[MM-RDMA-HIT] multimodal embedding read over rdma, %d slot(s)", slots)
        gbps = nbytes / read_s / 1e9 if read_s > 0 else float("inf")
        self._rl.log(logging.INFO, "bw", "[RDMA-BW] read %d bytes in %.3f ms: %.2f GB/s", nbytes, read_s * 1e3, gbps)


def _lease_ids(parsed: list[Any]) -> list[str]:
    return [d.lease_id for d in parsed if not isinstance(d, BaseException) and d.lease_id]


def _add_encoder_stages(stages: _Stages, receipt: pb.EncodeResponse) -> None:
    for k, v in receipt.encoder_stage_us.items():
        stages.ms[f"encoder.{k}"] = v / 1000.0


__all__ = ["RemoteOutputTransport", "Budget", "resolve_rpc_timeout_ms"]
