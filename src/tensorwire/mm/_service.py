"""EncoderService (the gRPC servicer) and serve_encoder (a server with it and the standard health service).

The servicer parses requests itself (raw bytes in, raw bytes out) so that a malformed message becomes
INVALID_ARGUMENT with a reason, and the server keeps serving. Errors map to status codes through
:mod:`tensorwire.mm.wire`.

Two control paths reach the same ``run_encode``: the unary ``Encode`` RPC and the persistent ``EncodeStream``
(a bidi stream a client keeps open and sends its Encodes and success-path releases on; see encoder.proto for
the message contract). A failure ends a unary call with a status and is a ``StreamError`` on the stream, built
from the same table, so a caller sees the same exception on either path.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import grpc
from google.protobuf.message import DecodeError

from tensorwire.errors import ConfigError, InvalidPayload, Reason
from tensorwire.mm import _codec, wire
from tensorwire.mm._config import TransportConfig
from tensorwire.mm._encoder_side import ExporterFactory, OutputTransport
from tensorwire.mm._host import GrpcHost
from tensorwire.mm._metrics import TransportMetrics
from tensorwire.mm._proto import encoder_pb2 as pb
from tensorwire.mm._ratelog import RateLimitedLog
from tensorwire.mm._types import EncoderOutput, MultimodalInput
from tensorwire.mm._wire_receipt import WireReceipt

log = logging.getLogger(__name__)

EncodeFn = Callable[[list[MultimodalInput]], EncoderOutput]
MAX_RELEASE_IDS = 65_536


def _parse_or_abort(message: Any, raw: bytes, context: grpc.ServicerContext) -> Any:
    """``message.FromString(raw)``, or the call ends with INVALID_ARGUMENT / INVALID_REQUEST (abort raises)."""
    try:
        return message.FromString(raw)
    except DecodeError as exc:
        wire.abort_with(context, InvalidPayload(f"{message.__name__} does not parse: {exc}",
                                                reason=Reason.INVALID_REQUEST))
        raise  # unreachable: abort raises


class _OpenStream:
    """One EncodeStream on the server. ``busy`` while an Encode runs; ``unsent`` is the receipt being sent.

    A receipt with leases is ``unsent`` from the moment it is handed to gRPC until the generator resumes (gRPC
    resumes it only after the send completed). If the call ends in between, whoever takes it first (the
    generator's ``finally`` or the call's termination callback) discards its leases; ``take_unsent`` makes
    that happen once.
    """

    def __init__(self, context: grpc.ServicerContext) -> None:
        self.context = context
        self.lock = threading.Lock()
        self.busy = False
        self.unsent: WireReceipt | None = None

    def take_unsent(self) -> WireReceipt | None:
        with self.lock:
            receipt, self.unsent = self.unsent, None
            return receipt


class EncoderService:
    """Answers Encode (run ``encode_fn``, then ``transport.transfer``), ReleaseLeases and EncodeStream.

    ``encode_fn(inputs) -> EncoderOutput`` runs on a gRPC worker thread; it may raise a TensorwireError (its
    reason picks the status code), NotImplementedError (UNIMPLEMENTED) or ValueError (INVALID_ARGUMENT).
    The service does not own the transport; ``serve_encoder`` closes it on stop.

    Streams: every open EncodeStream holds a server worker thread for its whole life, so at most
    ``max_streams`` (default ``config.effective_server_stream_cap``) are open at once; one more is refused with
    RESOURCE_EXHAUSTED before any of its messages is read (its client then uses the unary Encode). A server
    that stops calls ``close_streams()`` after ``grpc.Server.stop`` so that idle streams end at once instead of
    holding the stop for its whole grace period; a stream in the middle of an Encode answers it first.
    """

    def __init__(self, encode_fn: EncodeFn, transport: OutputTransport, *, max_streams: int | None = None) -> None:
        self._encode_fn = encode_fn
        self.transport = transport
        self.max_streams = transport.config.effective_server_stream_cap if max_streams is None else max_streams
        self._streams: set[_OpenStream] = set()
        self._streams_lock = threading.Lock()
        self._stopping = False
        self._rl = RateLimitedLog(log)

    @property
    def open_streams(self) -> int:
        with self._streams_lock:
            return len(self._streams)

    def run_encode(self, request: pb.EncodeRequest, is_active: Callable[[], bool]) -> WireReceipt:
        """Runs ``encode_fn`` then ``transfer``: the receipt, or raises the error the caller should get.

        Both control paths call this. Failures are counted and logged here. When ``is_active()`` is False after
        the export (the caller gave up), the receipt's leases are released at once: nobody will read them. An
        inline receipt views the output's bytes: the caller serializes it before anything else runs.
        """
        inputs = _codec.inputs_from_pb(request)
        t0 = time.perf_counter()
        try:
            output = self._encode_fn(inputs)
        except Exception as exc:
            self.transport.release_pending()  # output buffers the encoder allocated before failing
            self._count_failure(exc, "encode_fn failed on %d input(s): %r", len(inputs), exc)
            raise
        encode_us = int((time.perf_counter() - t0) * 1e6)
        try:
            receipt = self.transport.transfer(request, output)
        except Exception as exc:
            self._count_failure(exc, "transfer failed: %r", exc)
            raise
        receipt.message.encoder_stage_us["encode"] = encode_us
        if receipt.message.rdma_slots and not is_active():
            # The caller gave up (deadline, cancel) while we exported: nobody will read or release these.
            released = self.transport.discard(receipt)
            log.info("caller went away after export; released %d lease(s) at once", released)
        return receipt

    def _count_failure(self, exc: BaseException, msg: str, *args: Any) -> None:
        self.transport.metrics.errors.labels("encoder", wire.status_for(exc)[1].value).inc()
        log.warning(msg, *args)

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
            wire.abort_with(context, InvalidPayload(f"{len(request.lease_ids)} lease ids in one call exceed "
                                                    f"{MAX_RELEASE_IDS}", reason=Reason.INVALID_REQUEST))
        released = self.transport.release(list(request.lease_ids))
        return pb.ReleaseLeasesResponse(released=released).SerializeToString()

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
            context.abort(grpc.StatusCode.UNAVAILABLE, "encoder is stopping")
        if full:
            metrics.control_streams.labels("encoder", "refused").inc()
            self._rl.log(logging.INFO, "stream-refused", "refused an EncodeStream: %d open (server_stream_cap); "
                         "the client uses the unary Encode", self.max_streams)
            context.set_trailing_metadata(((wire.REASON_METADATA_KEY, Reason.POOL_EXHAUSTED.value),
                                           wire.STREAM_REFUSED_METADATA))
            context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED,
                          f"{self.max_streams} EncodeStream call(s) already open (server_stream_cap); use Encode")
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

    def _serve_stream(self, stream: _OpenStream, requests: Iterator[bytes],
                      context: grpc.ServicerContext) -> Iterator[bytes]:
        try:
            for raw in requests:
                # A message that does not parse has no id an answer could name: it ends the stream.
                msg = _parse_or_abort(pb.StreamRequest, raw, context)
                kind = msg.WhichOneof("body")
                if kind == "release":
                    self._release_from_stream(msg.release)
                    continue
                if kind != "encode":
                    unknown = NotImplementedError(f"StreamRequest {msg.id} has no body this encoder knows")
                    yield pb.StreamResponse(id=msg.id, error=wire.stream_error_for(unknown)).SerializeToString()
                    continue
                with stream.lock:
                    stream.busy = True
                receipt: WireReceipt | None = None
                try:
                    encoded = self.run_encode(msg.encode, context.is_active)
                    data = encoded.to_stream_frame(msg.id)
                    receipt = encoded
                except Exception as exc:
                    data = wire.stream_frame(msg.id, wire.STREAM_ERROR_FIELD,
                                             wire.stream_error_for(exc).SerializeToString())
                if not context.is_active():
                    return  # the caller went away; run_encode already released what it exported
                if receipt is not None and receipt.message.rdma_slots:
                    with stream.lock:
                        stream.unsent = receipt
                yield data
                with stream.lock:  # resumed: gRPC sent it, the leases belong to the caller now
                    stream.unsent = None
                    stream.busy = False
                if self._stopping:
                    return
        except grpc.RpcError:
            return  # the client cancelled the call (deadline, close) or the server cancelled it on stop

    def _release_from_stream(self, request: pb.ReleaseLeasesRequest) -> None:
        # Never answered (fire and forget): a release that cannot be applied is counted and logged here, and the
        # TTL GC reclaims its leases.
        if len(request.lease_ids) > MAX_RELEASE_IDS:
            self.transport.metrics.errors.labels("encoder", Reason.INVALID_REQUEST.value).inc()
            self._rl.log(logging.WARNING, "stream-release-too-large", "ignored a stream release of %d lease ids "
                         "(over %d); the TTL GC reclaims them", len(request.lease_ids), MAX_RELEASE_IDS)
            return
        self.transport.release(list(request.lease_ids))

    def _discard_unsent(self, stream: _OpenStream) -> None:
        receipt = stream.take_unsent()
        if receipt is not None:
            released = self.transport.discard(receipt)
            log.info("EncodeStream ended while its receipt was being sent; released %d lease(s) at once", released)

    def close_streams(self) -> None:
        """Ends idle EncodeStreams now and busy ones after their current answer; refuses new ones. Idempotent."""
        with self._streams_lock:
            self._stopping = True
            streams = list(self._streams)
        for stream in streams:
            with stream.lock:
                if not stream.busy:
                    stream.context.cancel()  # wakes the handler blocked on the next request

    def handler(self) -> grpc.GenericRpcHandler:
        return grpc.method_handlers_generic_handler(wire.SERVICE_NAME, {
            "Encode": grpc.unary_unary_rpc_method_handler(self.encode),
            "ReleaseLeases": grpc.unary_unary_rpc_method_handler(self.release_leases),
            "EncodeStream": grpc.stream_stream_rpc_method_handler(self.encode_stream),
        })


class EncoderServer:
    """A running encoder: ``port``, ``address``, ``stop(grace)``, ``wait(timeout)``; a context manager.

    ``stop`` runs the ``GrpcHost`` stop sequence (stops accepting, ends idle EncodeStreams, lets in-flight calls
    finish within ``grace`` seconds), then closes the transport (even when the server stop raises). Idempotent.
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
        try:
            self._host.stop(grace, drain=self.service.close_streams)
        finally:
            self.transport.close()

    def wait(self, timeout: float | None = None) -> bool:
        """Blocks until the server stops (True) or ``timeout`` passes (False)."""
        return self._host.wait(timeout)

    def __enter__(self) -> EncoderServer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def serve_encoder(encode_fn: EncodeFn, config: TransportConfig | None = None, address: str = "127.0.0.1:0", *,
                  transport: OutputTransport | None = None, metrics: TransportMetrics | None = None,
                  exporter_factory: ExporterFactory | None = None,
                  extra_options: Sequence[tuple[str, Any]] = ()) -> EncoderServer:
    """Starts a gRPC server with EncoderService and grpc.health.v1 on ``address`` ("host:0" picks a port).

    The exporter starts building now, in the background (``transport.wait_ready`` waits for it). Raises
    ConfigError when the address cannot be bound (the transport is closed then).
    """
    cfg = config if config is not None else TransportConfig()
    transport = transport if transport is not None else OutputTransport(cfg, exporter_factory=exporter_factory,
                                                                        metrics=metrics)
    service = EncoderService(encode_fn, transport)
    host = GrpcHost("encoder server", (service.handler(),), threads=cfg.server_threads,
                    thread_prefix="tensorwire-mm-encoder", extra_options=extra_options)
    try:
        host.bind(address)
    except ConfigError:
        transport.close()
        raise
    transport.worker_address = host.address
    transport.start()
    host.start()
    log.info("encoder service on %s (worker %s, mode %s, rdma device %s)", host.address, transport.worker_id,
             cfg.mode, getattr(cfg.rdma, "device", "?"))
    return EncoderServer(host, service)


__all__ = ["EncoderService", "EncoderServer", "serve_encoder", "EncodeFn"]
