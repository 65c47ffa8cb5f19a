"""EncoderService (the gRPC servicer) and serve_encoder (a server with it and the standard health service).

The servicer parses requests itself (raw bytes in, raw bytes out) so that a malformed message becomes
INVALID_ARGUMENT with a reason, and the server keeps serving. Errors map to status codes through
:mod:`tensorwire.mm.wire`.

Two control paths reach the same ``run_encode``: the unary ``Encode`` RPC and the persistent ``EncodeStream``
(a bidi stream a client keeps open and sends its Encodes and success-path releases on; see encoder.proto for
the message contract). A failure ends a unary call with a status and is a ``StreamError`` on the stream, built
from the same table, so a caller sees the same exception on either path.

Limits: the service is served through ``GrpcHost`` (``methods()``), which admits, times and lanes
every call; ``run_encode`` refuses more than ``max_request_items`` items or an item over ``max_item_bytes``
(INVALID_ARGUMENT) and runs the encode function inside the call's scope narrowed to the request's worker budget,
so an encode function that checks ``current_call()`` between items stops when the caller cancels or the budget
passes; nothing is exported for a caller that is gone.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import grpc
from google.protobuf.message import DecodeError

from tensorwire._grpc.host import Admission, GrpcHost, Lane, Method, Service
from tensorwire._grpc.scope import CallScope, call_scope, current_call
from tensorwire._ratelog import RateLimitedLog
from tensorwire.errors import ConfigError, InvalidPayload, PeerUnavailable, Reason
from tensorwire.mm import wire
from tensorwire.mm._config import TransportConfig
from tensorwire.mm._metrics import TransportMetrics
from tensorwire.mm._proto import encoder_pb2 as pb
from tensorwire.mm._types import EncoderOutput, MultimodalInput
from tensorwire.mm.server._local import LocalControlServer, start_local_server
from tensorwire.mm.server._output import ExporterFactory, OutputTransport
from tensorwire.mm.wire import _codec
from tensorwire.mm.wire._local import channel_info
from tensorwire.mm.wire._placed import Placement
from tensorwire.mm.wire._receipt import WireReceipt

log = logging.getLogger(__name__)

EncodeFn = Callable[[list[MultimodalInput]], EncoderOutput]
MAX_RELEASE_IDS = 65_536


def _parse_or_abort(message: Any, raw: bytes, context: grpc.ServicerContext) -> Any:
    """``message.FromString(raw)``, or the call ends with INVALID_ARGUMENT / INVALID_REQUEST (abort raises)."""
    try:
        return message.FromString(raw)
    except DecodeError as exc:
        wire.abort_with(
            context, InvalidPayload(f"{message.__name__} does not parse: {exc}", reason=Reason.INVALID_REQUEST)
        )
        raise  # unreachable: abort raises


def _draining() -> PeerUnavailable:
    return PeerUnavailable(
        "encoder is draining (shutting down); send the request to another worker", reason=Reason.PEER_UNAVAILABLE
    )


class _OpenStream:
    """One EncodeStream on the server. ``busy`` while an Encode runs; ``unsent`` is the receipt being sent;
    ``unacked`` the last receipt sent that the client has not shown it received.

    A receipt with leases is ``unsent`` from the moment it is handed to gRPC until the generator resumes (gRPC
    resumes it only after the send completed). If the call ends in between, whoever takes it first (the
    generator's ``finally`` or the call's termination callback) discards its leases; ``take_unsent`` makes
    that happen once.

    A completed send is not a delivery: a client that cancels at its deadline drops an answer still on the
    wire, and its cancel can reach the server after the send completed. So the sent receipt stays ``unacked``
    (with ``sent_at``) until the next message on the stream: the client sends one (its release, its next
    Encode) only after it read the answer, and one caller at a time uses a stream, in order. The stream ending
    by cancellation while an answer is unacked means the caller never had it: its leases are released at once.
    """

    def __init__(self, context: grpc.ServicerContext) -> None:
        self.context = context
        self.lock = threading.Lock()
        self.busy = False
        self.unsent: WireReceipt | None = None
        self.unacked: WireReceipt | None = None
        self.sent_at = 0.0

    def take_unsent(self) -> WireReceipt | None:
        with self.lock:
            receipt, self.unsent = self.unsent, None
            return receipt


class EncoderService:
    """Answers Encode (run ``encode_fn``, then ``transport.transfer``), ReleaseLeases and EncodeStream.

    ``encode_fn(inputs) -> EncoderOutput`` runs on a gRPC worker thread; it may raise a TensorwireError (its
    reason picks the status code), NotImplementedError (UNIMPLEMENTED) or ValueError (INVALID_ARGUMENT).
    The service does not own the transport; ``serve_encoder`` closes it on stop.

    Streams: every open EncodeStream holds a server thread for its whole life (not a work slot: it takes one per
    Encode it runs), so at most ``max_streams`` (default ``config.effective_server_stream_cap``) are open at
    once, and ``GrpcHost`` allows a peer ``max_streams_per_peer`` and ends a stream idle for
    ``stream_idle_timeout_ms``; one more is refused with RESOURCE_EXHAUSTED before any of its messages is read
    (its client then uses the unary Encode).

    Stopping (the ``GrpcHost`` stop sequence): ``quiesce()`` refuses every later Encode and EncodeStream with
    UNAVAILABLE (reason ``peer_unavailable``: a proxy retries it on another worker); ReleaseLeases keeps working,
    on open streams too. ``settle(deadline)`` then waits for the Encodes in flight and for every exported lease
    to be released (readers still read them), at most until ``deadline``. Last, after ``grpc.Server.stop``,
    ``close_streams()`` ends idle streams at once instead of letting them hold the stop for the rest of the
    grace; a stream in the middle of an Encode answers it first.
    """

    def __init__(self, encode_fn: EncodeFn, transport: OutputTransport, *, max_streams: int | None = None) -> None:
        self._encode_fn = encode_fn
        self.transport = transport
        self.max_streams = transport.config.effective_server_stream_cap if max_streams is None else max_streams
        self._streams: set[_OpenStream] = set()
        self._streams_lock = threading.Lock()
        self._stopping = False  # quiesced: no new Encode or EncodeStream
        self._closing = False  # streams end after their current answer
        self._encodes = Admission()
        self._rl = RateLimitedLog(log)
        self.local: LocalControlServer | None = None

    def start_local(self) -> None:
        """Starts the same-host control channel (``server._local``) unless ``local_channel`` is off; a server calls
        it before it starts serving gRPC, and ``close_streams`` ends it. Best effort: without it, gRPC only."""
        cfg = self.transport.config
        if self.local is not None or cfg.local_channel == "off":
            return
        if cfg.local_channel == "auto" and cfg.tls.mutual:
            # The socket authenticates by uid, not by certificate: with mTLS asked for, only an explicit "on" opens it.
            log.info(
                "same-host control channel off: the gRPC listener requires client certificates (mTLS); "
                "local_channel='on' serves it anyway, trusting processes of this uid"
            )
            return
        self.local = start_local_server(
            self, cfg.local_channel_dir, cfg.local_channel_conns, cfg.local_channel_idle_ms / 1000.0
        )

    def local_channel(self, raw: bytes, context: grpc.ServicerContext) -> bytes:
        request = _parse_or_abort(pb.LocalChannelRequest, raw, context)
        local = self.local
        return channel_info(local, request).SerializeToString()

    @property
    def open_streams(self) -> int:
        with self._streams_lock:
            return len(self._streams)

    def run_encode(
        self, request: pb.EncodeRequest, is_active: Callable[[], bool], *, placement: Placement | None = None
    ) -> WireReceipt:
        """Runs ``encode_fn`` then ``transfer``: the receipt, or raises the error the caller should get.

        Both control paths call this. Failures are counted and logged here. ``encode_fn`` runs inside the call's
        scope (``current_call()``) narrowed to the request's worker budget. When ``is_active()`` is False once it
        returned (the caller gave up), nothing is exported: the work is dropped and ``PeerUnavailable(CANCELLED)``
        raised; when the caller goes while the export runs, the receipt's leases are released at once. An inline
        receipt views the output's bytes: the caller serializes it before anything else runs.
        """
        inputs = self._checked_inputs(request)
        if not self._encodes.enter():
            raise _draining()
        try:
            return self._run_encode(request, inputs, is_active, placement)
        finally:
            self._encodes.exit()

    def _run_encode(
        self,
        request: pb.EncodeRequest,
        inputs: list[MultimodalInput],
        is_active: Callable[[], bool],
        placement: Placement | None,
    ) -> WireReceipt:
        metrics = self.transport.metrics
        cfg = self.transport.config
        budget_ms = wire.rpc_budget_ms(
            (i.timeout_ms for i in inputs), worker_timeout_ms=cfg.worker_timeout_ms, margin_ms=0
        )
        outer = current_call()
        scope = CallScope(
            outer.peer,
            deadline=min(outer.deadline, time.monotonic() + budget_ms / 1000.0),
            is_active=is_active,
            placement=placement,
        )
        with call_scope(scope):
            t0 = time.perf_counter()
            try:
                output = self._encode_fn(inputs)
                scope.check("the request")  # stopped or expired while encoding: export nothing
            except Exception as exc:
                self.transport.release_pending()  # output buffers the encoder allocated before failing
                self._count_failure(exc, "encode_fn failed on %d input(s): %r", len(inputs), exc)
                raise
            compute_s = time.perf_counter() - t0
            metrics.encoder_compute_seconds.observe(compute_s)
            try:
                receipt = self.transport.transfer(request, output)
            except Exception as exc:
                self._count_failure(exc, "transfer failed: %r", exc)
                raise
        receipt.message.encoder_stage_us["encode"] = int(compute_s * 1e6)
        plane = "rdma" if receipt.message.rdma_slots else "placed" if receipt.message.placed.tensors else "inline"
        metrics.child(metrics.encoder_request_seconds, plane).observe(time.perf_counter() - t0)
        if receipt.message.rdma_slots and not is_active():
            # The caller gave up (deadline, cancel) while we exported: nobody will read or release these.
            self.discard_for_gone_caller(receipt, "after export")
        return receipt

    def discard_for_gone_caller(self, receipt: WireReceipt, when: str) -> None:
        """Releases the leases of a receipt its caller will never read (it went away ``when``: after the export,
        while the answer was being sent) and counts the dropped work as the check before the export counts it
        (``errors{encoder,cancelled}``): the caller may close its stream only after that check."""
        released = self.transport.discard(receipt)
        self.transport.metrics.errors.labels("encoder", Reason.CANCELLED.value).inc()
        log.info("caller went away %s; released %d lease(s) at once", when, released)

    def _checked_inputs(self, request: pb.EncodeRequest) -> list[MultimodalInput]:
        """The request's inputs, within the limits (InvalidPayload otherwise). The item count is checked before
        anything is converted; the sizes on the converted items, because protobuf copies a bytes field on every
        read (reading ``data`` once for the check and once for the input was two copies of the media)."""
        limits = self.transport.config.limits
        if len(request.inputs) > limits.max_request_items:
            raise InvalidPayload(
                f"{len(request.inputs)} items in one request exceed max_request_items="
                f"{limits.max_request_items}; split the request",
                reason=Reason.INVALID_REQUEST,
            )
        inputs = _codec.inputs_from_pb(request)
        for i, item in enumerate(inputs):
            if len(item.data) > limits.max_item_bytes:
                raise InvalidPayload(
                    f"item {i} is {len(item.data)} bytes, over max_item_bytes={limits.max_item_bytes}",
                    reason=Reason.INVALID_REQUEST,
                )
        return inputs

    def _count_failure(self, exc: BaseException, msg: str, *args: Any) -> None:
        reason = wire.status_for(exc)[1].value
        self.transport.metrics.errors.labels("encoder", reason).inc()
        # Rate-limited per reason: a caller sending bad requests must not flood the log (counted above anyway).
        # A caller's mistake (an image that does not decode, too many items) is INFO: the server is fine, the
        # caller got INVALID_ARGUMENT with the reason; a failure of the server's own is a WARNING.
        level = logging.INFO if isinstance(exc, InvalidPayload) else logging.WARNING
        self._rl.log(level, "failure-" + reason, msg, *args)

    def encode(self, raw: bytes, context: grpc.ServicerContext) -> bytes:
        request = _parse_or_abort(pb.EncodeRequest, raw, context)
        try:
            return self.run_encode(request, context.is_active).to_bytes()
        except Exception as exc:
            wire.abort_with(context, exc)
            raise  # unreachable: abort raises

    def release_leases(self, raw: bytes, context: grpc.ServicerContext) -> bytes:
        request = _parse_or_abort(pb.ReleaseLeasesRequest, raw, context)
        if len(request.lease_ids) > MAX_RELEASE_IDS:
            wire.abort_with(
                context,
                InvalidPayload(
                    f"{len(request.lease_ids)} lease ids in one call exceed {MAX_RELEASE_IDS}",
                    reason=Reason.INVALID_REQUEST,
                ),
            )
        ids = list(request.lease_ids)
        released = self.transport.release(ids)
        return pb.ReleaseLeasesResponse(released=released, unknown=len(ids) - released).SerializeToString()

    # -- EncodeStream -------------------------------------------------------------------------------------

    def encode_stream(self, requests: Iterator[bytes], context: grpc.ServicerContext) -> Iterator[bytes]:
        """The EncodeStream handler: a generator on one server worker thread, one message at a time, in order."""
        stream = _OpenStream(context)
        with self._streams_lock:
            stopping, full = self._stopping, len(self._streams) >= self.max_streams
            if not (stopping or full):
                self._streams.add(stream)
        metrics = self.transport.metrics
        if stopping:
            wire.abort_with(context, _draining())
        if full:
            metrics.control_streams.labels("encoder", "refused").inc()
            self._rl.log(
                logging.INFO,
                "stream-refused",
                "refused an EncodeStream: %d open (server_stream_cap); the client uses the unary Encode",
                self.max_streams,
            )
            context.set_trailing_metadata(
                ((wire.REASON_METADATA_KEY, Reason.POOL_EXHAUSTED.value), wire.STREAM_REFUSED_METADATA)
            )
            context.abort(
                grpc.StatusCode.RESOURCE_EXHAUSTED,
                f"{self.max_streams} EncodeStream call(s) already open (server_stream_cap); use Encode",
            )
        metrics.control_streams.labels("encoder", "opened").inc()
        metrics.encoder_streams_open.inc()
        context.add_callback(lambda: self._discard_unsent(stream))
        try:
            yield from self._serve_stream(stream, requests, context)
        finally:
            self._discard_unsent(stream)
            with self._streams_lock:
                self._streams.discard(stream)
            metrics.encoder_streams_open.dec()
            metrics.control_streams.labels("encoder", "ended").inc()

    def _serve_stream(
        self, stream: _OpenStream, requests: Iterator[bytes], context: grpc.ServicerContext
    ) -> Iterator[bytes]:
        try:
            for raw in requests:
                stream.unacked = None  # sent after the client read the last answer: those leases are its own
                # A message that does not parse has no id an answer could name: it ends the stream.
                msg = _parse_or_abort(pb.StreamRequest, raw, context)
                kind = msg.WhichOneof("body")
                if kind == "release":
                    self.release_unanswered(msg.release)
                    continue
                if kind != "encode":
                    unknown = NotImplementedError(f"StreamRequest {msg.id} has no body this encoder knows")
                    yield pb.StreamResponse(id=msg.id, error=wire.stream_error_for(unknown)).SerializeToString()
                    continue
                with stream.lock:
                    stream.busy = True
                receipt: WireReceipt | None = None
                try:
                    with current_call().work_slot():  # one Encode at a time per slot, as on the unary path
                        encoded = self.run_encode(msg.encode, context.is_active)
                    data = encoded.to_stream_frame(msg.id)
                    receipt = encoded
                except Exception as exc:
                    data = wire.stream_frame(
                        msg.id, wire.STREAM_ERROR_FIELD, wire.stream_error_for(exc).SerializeToString()
                    )
                if not context.is_active():
                    return  # the caller went away; run_encode already released what it exported
                if receipt is not None and receipt.message.rdma_slots:
                    with stream.lock:
                        stream.unsent = receipt
                yield data
                with stream.lock:  # resumed: gRPC sent it; the leases are the caller's once it shows it read it
                    stream.unacked, stream.unsent = stream.unsent, None
                    stream.sent_at = time.monotonic()
                    stream.busy = False
                if self._closing:
                    return
        except grpc.RpcError:
            # The client cancelled the call (deadline, close) or the server cancelled it (idle, stop).
            self._discard_unacked(stream)

    def release_unanswered(self, request: pb.ReleaseLeasesRequest) -> None:
        # Never answered (fire and forget): a release that cannot be applied is counted and logged here, and the
        # TTL GC reclaims its leases.
        if len(request.lease_ids) > MAX_RELEASE_IDS:
            self.transport.metrics.errors.labels("encoder", Reason.INVALID_REQUEST.value).inc()
            self._rl.log(
                logging.WARNING,
                "stream-release-too-large",
                "ignored a stream release of %d lease ids (over %d); the TTL GC reclaims them",
                len(request.lease_ids),
                MAX_RELEASE_IDS,
            )
            return
        self.transport.release(list(request.lease_ids))

    def _discard_unacked(self, stream: _OpenStream) -> None:
        """The stream was cancelled with an answer sent but not acknowledged: the caller cancelled before that
        answer reached it (its deadline, its close, its process gone), so nobody will read or release the
        leases. A server-side idle end comes ``stream_idle_timeout_ms`` after the answer at the earliest, while
        the client may still hold it: that one is left to the client and the TTL GC. Counted (and logged) as
        ``discard_for_gone_caller`` counts, only when a lease was still live (the client may have released it
        on another path)."""
        receipt, stream.unacked = stream.unacked, None
        if receipt is None:
            return
        idle_s = self.transport.config.limits.stream_idle_timeout_ms / 1000.0
        if time.monotonic() - stream.sent_at >= idle_s:
            return
        released = self.transport.discard(receipt)
        if released:
            self.transport.metrics.errors.labels("encoder", Reason.CANCELLED.value).inc()
            log.info(
                "caller cancelled its EncodeStream before its answer reached it; released %d lease(s) at once",
                released,
            )

    def _discard_unsent(self, stream: _OpenStream) -> None:
        receipt = stream.take_unsent()
        if receipt is not None:
            self.discard_for_gone_caller(receipt, "while its EncodeStream answer was being sent")

    def quiesce(self) -> None:
        """Refuses every later Encode and EncodeStream (UNAVAILABLE); open streams still carry releases."""
        self._encodes.close()
        with self._streams_lock:
            self._stopping = True

    def close_streams(self) -> None:
        """Refuses new Encodes and EncodeStreams; ends idle streams now and busy ones after their current answer.
        Idempotent."""
        self._encodes.close()
        with self._streams_lock:
            self._stopping = self._closing = True
            streams = list(self._streams)
        if self.local is not None:
            self.local.stop_accepting()
        for stream in streams:
            with stream.lock:
                if not stream.busy:
                    stream.context.cancel()  # wakes the handler blocked on the next request

    @property
    def in_flight(self) -> int:
        """Encodes running now (both control paths)."""
        return self._encodes.running

    def settle(self, deadline: float) -> None:
        """After ``quiesce()``: waits until no Encode runs and every exported lease is released, or ``deadline``
        (time.monotonic) passes."""
        running = self._encodes.wait_idle(deadline)
        if running:
            log.warning("%d Encode call(s) still running at the end of the grace; they are cancelled", running)
            return
        left = self.transport.wait_released(deadline)
        if left:
            log.warning(
                "%d exported lease(s) still unreleased at the end of the grace; readers of them will fail", left
            )

    def close_local(self, grace_s: float | None = 0.0) -> None:
        """Ends the same-host control channel: its busy connections get up to ``grace_s`` (None: no limit) to
        send their answer, then it is cut (``LocalControlServer.close``). A server calls it after its gRPC stop,
        with what is left of the grace. Idempotent."""
        local = self.local
        if local is not None:
            local.close(grace_s)

    def methods(self) -> Service:
        """The EncoderService methods for ``GrpcHost``: Encode needs a work slot; ReleaseLeases and LocalChannel
        never wait for one."""
        return Service(
            wire.SERVICE_NAME,
            (
                Method("Encode", self.encode, lane=Lane.WORK),
                Method("ReleaseLeases", self.release_leases),
                Method("EncodeStream", self.encode_stream, kind="stream"),
                Method("LocalChannel", self.local_channel),
            ),
        )


class EncoderServer:
    """A running encoder: ``port``, ``address``, ``stop(grace)``, ``wait(timeout)``; a context manager.

    ``stop`` runs the ``GrpcHost`` stop sequence (NOT_SERVING, refuses new Encodes, ends idle EncodeStreams, lets
    in-flight calls finish and exported leases be released within ``grace`` seconds), then closes the transport
    (even when the server stop raises). Idempotent.
    """

    def __init__(self, host: GrpcHost, service: EncoderService) -> None:
        self._host = host
        self.port = host.port
        self.host = host.host
        self.service = service
        self.transport = service.transport
        self._stopped = False

    @property
    def address(self) -> str:
        return f"{self.host}:{self.port}"

    def stop(self, grace: float | None = 1.0) -> None:
        if self._stopped:
            return
        self._stopped = True
        until = None if grace is None else time.monotonic() + grace
        try:
            self._host.stop(
                grace, drain=self.service.close_streams, quiesce=self.service.quiesce, settle=self.service.settle
            )
        finally:
            try:
                self.service.close_local(None if until is None else max(0.0, until - time.monotonic()))
            finally:
                self.transport.close()

    def wait(self, timeout: float | None = None) -> bool:
        """Blocks until the server stops (True) or ``timeout`` passes (False)."""
        return self._host.wait(timeout)

    def __enter__(self) -> EncoderServer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def encoder_host(
    what: str,
    services: Sequence[Service],
    cfg: TransportConfig,
    metrics: TransportMetrics,
    *,
    thread_prefix: str,
    extra_options: Sequence[tuple[str, Any]] = (),
    reuse_port: bool = False,
) -> GrpcHost:
    """The ``GrpcHost`` of an encoder: ``server_threads`` work slots, the config's limits and TLS, refusals
    counted on ``tensorwire_mm_server_refused_calls_total``."""
    return GrpcHost(
        what,
        services,
        work_slots=cfg.server_threads,
        thread_prefix=thread_prefix,
        limits=cfg.limits,
        tls=cfg.tls,
        serving=(wire.SERVICE_NAME,),
        extra_options=extra_options,
        reuse_port=reuse_port,
        on_refuse=lambda reason: metrics.server_refused.labels(reason).inc(),
    )


def serve_encoder(
    encode_fn: EncodeFn,
    config: TransportConfig | None = None,
    address: str = "127.0.0.1:0",
    *,
    transport: OutputTransport | None = None,
    metrics: TransportMetrics | None = None,
    exporter_factory: ExporterFactory | None = None,
    extra_options: Sequence[tuple[str, Any]] = (),
    insecure: bool = False,
) -> EncoderServer:
    """Starts a gRPC server with EncoderService and grpc.health.v1 on ``address`` ("host:0" picks a port).

    TLS and limits come from ``config.tls`` and ``config.limits``; a plaintext server on a non-loopback address
    needs ``insecure=True``. The exporter starts building now, in the background (``transport.wait_ready``
    waits for it). Raises ConfigError when the address cannot (or may not) be bound (the transport is closed).
    """
    cfg = config if config is not None else TransportConfig()
    transport = (
        transport if transport is not None else OutputTransport(cfg, exporter_factory=exporter_factory, metrics=metrics)
    )
    service = EncoderService(encode_fn, transport)
    host = encoder_host(
        "encoder server",
        (service.methods(),),
        cfg,
        transport.metrics,
        thread_prefix="tensorwire-mm-encoder",
        extra_options=extra_options,
    )
    try:
        host.bind(address, insecure=insecure)
    except ConfigError:
        transport.close()
        raise
    transport.worker_address = host.address
    transport.start()
    service.start_local()
    host.start()
    log.info(
        "encoder service on %s (worker %s, mode %s, rdma device %s)",
        host.address,
        transport.worker_id,
        cfg.mode,
        getattr(cfg.rdma, "device", "?"),
    )
    return EncoderServer(host, service)


__all__ = ["EncoderService", "EncoderServer", "serve_encoder", "encoder_host", "EncodeFn"]
