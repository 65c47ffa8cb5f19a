"""EncoderService (the gRPC servicer) and serve_encoder (a server with it and the standard health service).

The servicer parses requests itself (raw bytes in, raw bytes out) so that a malformed message becomes
INVALID_ARGUMENT with a reason, and the server keeps serving. Errors map to status codes through
:mod:`tensorwire.mm.wire`.
"""

from __future__ import annotations

import logging
import time
from concurrent import futures
from typing import Any, Callable, Sequence

import grpc
from google.protobuf.message import DecodeError
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from tensorwire.errors import ConfigError, InvalidPayload, Reason
from tensorwire.mm import wire
from tensorwire.mm._proto import encoder_pb2 as pb
from tensorwire.mm.config import TransportConfig
from tensorwire.mm.encoder_side import ExporterFactory, OutputTransport
from tensorwire.mm.metrics import TransportMetrics
from tensorwire.mm.types import EncoderOutput, MultimodalInput

log = logging.getLogger(__name__)

EncodeFn = Callable[[list[MultimodalInput]], EncoderOutput]
MAX_RELEASE_IDS = 65_536


def inputs_from_pb(request: pb.EncodeRequest) -> list[MultimodalInput]:
    return [MultimodalInput(data=i.data, kind=i.kind or "image", params=dict(i.params), timeout_ms=int(i.timeout_ms))
            for i in request.inputs]


def inputs_to_pb(inputs: Sequence[MultimodalInput], request: pb.EncodeRequest | None = None) -> pb.EncodeRequest:
    req = request if request is not None else pb.EncodeRequest()
    for item in inputs:
        m = req.inputs.add()
        m.data = bytes(item.data)
        m.kind = item.kind
        for k, v in dict(item.params).items():
            m.params[str(k)] = str(v)
        m.timeout_ms = int(item.timeout_ms)
    return req


class EncoderService:
    """Answers Encode (run ``encode_fn``, then ``transport.transfer``) and ReleaseLeases.

    ``encode_fn(inputs) -> EncoderOutput`` runs on a gRPC worker thread; it may raise a TensorwireError (its
    reason picks the status code), NotImplementedError (UNIMPLEMENTED) or ValueError (INVALID_ARGUMENT).
    The service does not own the transport; ``serve_encoder`` closes it on stop.
    """

    def __init__(self, encode_fn: EncodeFn, transport: OutputTransport) -> None:
        self._encode_fn = encode_fn
        self.transport = transport

    def encode(self, raw: bytes, context: grpc.ServicerContext) -> bytes:
        try:
            request = pb.EncodeRequest.FromString(raw)
        except DecodeError as exc:
            wire.abort_with(context, InvalidPayload(f"EncodeRequest does not parse: {exc}",
                                                    reason=Reason.INVALID_REQUEST))
            raise  # unreachable: abort raises
        inputs = inputs_from_pb(request)
        t0 = time.perf_counter()
        error: BaseException | None = None
        try:
            output = self._encode_fn(inputs)
        except Exception as exc:
            error = exc
            self.transport.release_pending()  # output buffers the encoder allocated before failing
        if error is not None:
            self.transport.metrics.errors.labels("encoder", wire.status_for(error)[1].value).inc()
            log.warning("encode_fn failed on %d input(s): %r", len(inputs), error)
            wire.abort_with(context, error)
        encode_us = int((time.perf_counter() - t0) * 1e6)
        try:
            receipt = self.transport.transfer(request, output)
        except Exception as exc:
            error = exc
        if error is not None:
            self.transport.metrics.errors.labels("encoder", wire.status_for(error)[1].value).inc()
            log.warning("transfer failed: %r", error)
            wire.abort_with(context, error)
        receipt.encoder_stage_us["encode"] = encode_us
        if receipt.rdma_slots and not context.is_active():
            # The caller gave up (deadline, cancel) while we exported: nobody will read or release these.
            released = self.transport.discard(receipt)
            log.info("caller went away after export; released %d lease(s) at once", released)
        return receipt.SerializeToString()

    def release_leases(self, raw: bytes, context: grpc.ServicerContext) -> bytes:
        try:
            request = pb.ReleaseLeasesRequest.FromString(raw)
        except DecodeError as exc:
            wire.abort_with(context, InvalidPayload(f"ReleaseLeasesRequest does not parse: {exc}",
                                                    reason=Reason.INVALID_REQUEST))
            raise
        if len(request.lease_ids) > MAX_RELEASE_IDS:
            wire.abort_with(context, InvalidPayload(f"{len(request.lease_ids)} lease ids in one call exceed "
                                                    f"{MAX_RELEASE_IDS}", reason=Reason.INVALID_REQUEST))
        released = self.transport.release(list(request.lease_ids))
        return pb.ReleaseLeasesResponse(released=released).SerializeToString()

    def handler(self) -> grpc.GenericRpcHandler:
        return grpc.method_handlers_generic_handler(wire.SERVICE_NAME, {
            "Encode": grpc.unary_unary_rpc_method_handler(self.encode),
            "ReleaseLeases": grpc.unary_unary_rpc_method_handler(self.release_leases),
        })


class EncoderServer:
    """A running encoder: ``port``, ``address``, ``stop(grace)``, ``wait(timeout)``; a context manager.

    ``stop`` stops accepting, lets in-flight calls finish within ``grace`` seconds, then closes the transport
    (even when the server stop raises). Idempotent.
    """

    def __init__(self, server: grpc.Server, port: int, host: str, service: EncoderService,
                 health_servicer: health.HealthServicer) -> None:
        self._server = server
        self.port = port
        self.host = host
        self.service = service
        self.transport = service.transport
        self._health = health_servicer
        self._stopped = False

    @property
    def address(self) -> str:
        return f"{self.host}:{self.port}"

    def stop(self, grace: float | None = 1.0) -> None:
        if self._stopped:
            return
        self._stopped = True
        try:
            self._health.enter_graceful_shutdown()
            self._server.stop(grace).wait(None if grace is None else grace + 5.0)
        finally:
            self.transport.close()

    def wait(self, timeout: float | None = None) -> bool:
        """Blocks until the server stops (True) or ``timeout`` passes (False)."""
        return bool(self._server.wait_for_termination(timeout))

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
    ConfigError when the address cannot be bound.
    """
    cfg = config if config is not None else TransportConfig()
    transport = transport if transport is not None else OutputTransport(cfg, exporter_factory=exporter_factory,
                                                                        metrics=metrics)
    service = EncoderService(encode_fn, transport)
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=cfg.server_threads,
                                                    thread_name_prefix="tensorwire-mm-encoder"),
                         options=wire.channel_options() + list(extra_options))
    server.add_generic_rpc_handlers((service.handler(),))
    health_servicer = health.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    try:
        port = server.add_insecure_port(address)
    except RuntimeError as exc:
        transport.close()
        raise ConfigError(f"cannot bind encoder server to {address!r}: {exc}") from exc
    if port == 0:
        transport.close()
        raise ConfigError(f"cannot bind encoder server to {address!r}; is the port in use?")
    host = address.rsplit(":", 1)[0] or "127.0.0.1"
    transport.worker_address = f"{host}:{port}"
    transport.start()
    server.start()
    for name in ("", wire.SERVICE_NAME):
        health_servicer.set(name, health_pb2.HealthCheckResponse.SERVING)
    log.info("encoder service on %s:%d (worker %s, mode %s, rdma device %s)", host, port, transport.worker_id,
             cfg.mode, getattr(cfg.rdma, "device", "?"))
    return EncoderServer(server, port, host, service, health_servicer)


__all__ = ["EncoderService", "EncoderServer", "serve_encoder", "EncodeFn", "inputs_to_pb", "inputs_from_pb"]
