"""A runnable encoder worker: a ``VisionEncoder`` behind ``tensorwire.mm``'s ``EncoderService``.

One gRPC server carries three services: ``tensorwire.mm.v1.EncoderService`` (Encode, ReleaseLeases), the
standard ``grpc.health.v1.Health``, and ``tensorwire.service.v1.WorkerInfo`` (what a proxy checks at start-up).
``mm.serve_encoder`` builds the first two on a server of its own; the worker needs the third on the same port,
so it assembles the server from mm's public ``EncoderService`` and ``OutputTransport`` on mm's ``GrpcHost``,
the one place that binds, starts and stops a gRPC server.
"""

from __future__ import annotations

import logging
from typing import Any

from tensorwire.encoder import VisionEncoder
from tensorwire.errors import ConfigError, InvalidPayload, Reason
from tensorwire.mm import (
    EncoderOutput,
    EncoderService,
    MultimodalInput,
    OutputTransport,
    TransportConfig,
    TransportMetrics,
)
from tensorwire.mm._host import GrpcHost
from tensorwire.service._info import info_handler, make_info

log = logging.getLogger(__name__)


def make_encode_fn(encoder: VisionEncoder) -> Any:
    """The ``EncodeFn`` contract of ``tensorwire.mm``: ``encode_fn(inputs) -> EncoderOutput``.

    Only ``kind == "image"`` items are accepted (anything else is ``InvalidPayload``); each image gives one
    embedding [tokens, hidden] and its (row, col) position ids [tokens, 2]. Bad images raise ``InvalidPayload``,
    which the service answers with INVALID_ARGUMENT while it keeps serving.
    """

    def encode_fn(inputs: list[MultimodalInput]) -> EncoderOutput:
        for i, item in enumerate(inputs):
            if item.kind != "image":
                raise InvalidPayload(f"input {i}: kind {item.kind!r} is not supported; this encoder takes 'image'",
                                     reason=Reason.INVALID_REQUEST)
        results = encoder.encode([item.data for item in inputs])
        return EncoderOutput(embeddings=[r.embedding for r in results],
                             position_ids=[r.position_ids for r in results])

    return encode_fn


class EncoderWorker:
    """``start(address) -> port``; ``stop(grace_s)`` stops accepting, lets in-flight calls finish within the grace,
    then closes the transport (its exporter) and the encoder. ``stop`` is idempotent; a context manager.
    """

    def __init__(self, encoder: VisionEncoder, config: TransportConfig, *, model: str = "builtin",
                 metrics: TransportMetrics | None = None) -> None:
        self.encoder = encoder
        self.config = config
        self.model = model
        self.transport = OutputTransport(config, metrics=metrics)
        self.service = EncoderService(make_encode_fn(encoder), self.transport)
        self._host: GrpcHost | None = None
        self._stopped = False
        self.port: int | None = None
        self.host = ""

    @property
    def worker_id(self) -> str:
        return self.transport.worker_id

    @property
    def address(self) -> str:
        return f"{self.host}:{self.port}"

    def start(self, address: str = "127.0.0.1:0") -> int:
        if self._host is not None:
            raise RuntimeError("worker already started")
        info = make_info(worker_id=self.worker_id, mode=self.config.mode, rdma=self.config.rdma, model=self.model,
                         device=str(self.encoder.device), hidden_size=self.encoder.hidden_size)
        host = GrpcHost("encoder", (self.service.handler(), info_handler(lambda: info)),
                        threads=self.config.server_threads, thread_prefix="tensorwire-encoder")
        try:
            port = host.bind(address)
        except ConfigError:
            self.transport.close()
            raise
        self.host, self.port = host.host, port
        self.transport.worker_address = self.address
        self.transport.start()
        host.start()
        self._host = host
        log.info("encoder worker %s on %s: model %s, mode %s, rdma port %d", self.worker_id, self.address,
                 self.encoder.describe(), self.config.mode, self.config.rdma.port)
        return port

    def wait_ready(self, timeout_s: float) -> bool:
        """Waits for the RDMA exporter (False in mode grpc or when no provider can be built)."""
        return self.transport.wait_ready(timeout_s)

    def stop(self, grace_s: float = 5.0) -> None:
        if self._stopped:
            return
        self._stopped = True
        try:
            if self._host is not None:
                self._host.stop(grace_s, drain=self.service.close_streams)
        finally:
            try:
                self.transport.close()
            finally:
                self.encoder.close()

    close = stop

    def __enter__(self) -> EncoderWorker:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


__all__ = ["EncoderWorker", "make_encode_fn"]
