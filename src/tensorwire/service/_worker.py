"""A runnable encoder worker: a ``VisionEncoder`` behind ``tensorwire.mm``'s ``EncoderService``.

One gRPC server carries three services: ``tensorwire.mm.v1.EncoderService`` (Encode, ReleaseLeases), the
standard ``grpc.health.v1.Health``, and ``tensorwire.service.v1.WorkerInfo`` (what a proxy checks at start-up).
``mm.serve_encoder`` builds the first two on a server of its own; the worker needs the third on the same port,
so it assembles the server from mm's public ``EncoderService`` and ``OutputTransport`` on mm's ``GrpcHost``,
the one place that binds, starts and stops a gRPC server (with the config's TLS and limits).

Work per request: the pixel budget (``ImageLimits``) is checked from the headers before
anything is decoded, then the images are encoded one at a time, and between two of them the call is checked:
a caller that cancelled, or a worker budget that passed, stops the request there.

Health follows what the worker can do: NOT_SERVING while the model loads (``EncoderWorker.loading``: the port is
bound and answers health and WorkerInfo at once, Encode gets UNAVAILABLE), SERVING once it is loaded, NOT_SERVING
again from the first moment of a stop (the drain period, see ``GrpcHost``).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any

from tensorwire._grpc.host import GrpcHost
from tensorwire._grpc.scope import current_call
from tensorwire.encoder import VisionEncoder
from tensorwire.errors import ConfigError, InvalidPayload, PeerUnavailable, Reason
from tensorwire.mm import (
    EncoderOutput,
    EncoderService,
    MultimodalInput,
    OutputTransport,
    TransportConfig,
    TransportMetrics,
)
from tensorwire.mm.server._service import encoder_host
from tensorwire.service._images import ImageLimits, check_pixels
from tensorwire.service._info import info_service, make_info

log = logging.getLogger(__name__)


def make_encode_fn(encoder: VisionEncoder, limits: ImageLimits | None = None) -> Any:
    """The ``EncodeFn`` contract of ``tensorwire.mm``: ``encode_fn(inputs) -> EncoderOutput``.

    Only ``kind == "image"`` items are accepted (anything else is ``InvalidPayload``); each image gives one
    embedding [tokens, hidden] and its (row, col) position ids [tokens, 2]. Bad images, and images over the pixel
    budget (read from their headers before any decoding), raise ``InvalidPayload``, which the service answers
    with INVALID_ARGUMENT while it keeps serving. Images are encoded one per forward, and the call
    (``current_call()``) is checked before each: a cancelled or expired request stops between two images.
    """
    budget = limits if limits is not None else ImageLimits()

    def encode_fn(inputs: list[MultimodalInput]) -> EncoderOutput:
        for i, item in enumerate(inputs):
            if item.kind != "image":
                raise InvalidPayload(
                    f"input {i}: kind {item.kind!r} is not supported; this encoder takes 'image'",
                    reason=Reason.INVALID_REQUEST,
                )
        images = [item.data for item in inputs]
        if not images or len(images) > encoder.preprocess.max_images:
            encoder.encode(images)  # raises the encoder's own refusal (empty, too many) before any decoding
        check_pixels(images, budget)
        call = current_call()
        results = []
        for i, data in enumerate(images):
            call.check(f"image {i} of {len(images)}")
            results.extend(encoder.encode([data]))
        return EncoderOutput(embeddings=[r.embedding for r in results], position_ids=[r.position_ids for r in results])

    return encode_fn


class EncoderWorker:
    """``start(address) -> port``; ``stop(grace_s, drain_s)`` runs the ``GrpcHost`` stop sequence (NOT_SERVING for
    ``drain_s``, then refuses new Encodes, lets in-flight ones finish and their leases be released within the
    grace), then closes the transport (its exporter) and the encoder. ``stop`` is idempotent; a context manager.

    ``EncoderWorker(encoder, config)`` serves a loaded encoder. ``EncoderWorker.loading(load, config, device=)``
    binds and serves health before the model exists: ``start`` reports NOT_SERVING, ``load()`` (on the calling
    thread) builds the encoder and then reports SERVING.
    """

    def __init__(
        self,
        encoder: VisionEncoder | None,
        config: TransportConfig,
        *,
        model: str = "builtin",
        metrics: TransportMetrics | None = None,
        reuse_port: bool = False,
        load: Callable[[], VisionEncoder] | None = None,
        device: str = "cpu",
        image_limits: ImageLimits | None = None,
    ) -> None:
        if (encoder is None) == (load is None):
            raise ConfigError("EncoderWorker needs an encoder or a loader (EncoderWorker.loading), not both")
        self.encoder: VisionEncoder | None = encoder
        self._load = load
        self._device = str(encoder.device) if encoder is not None else device
        self.image_limits = image_limits if image_limits is not None else ImageLimits()
        self._encode_fn = make_encode_fn(encoder, self.image_limits) if encoder is not None else None
        self.config = config
        self.model = model
        self.reuse_port = reuse_port
        self.transport = OutputTransport(config, metrics=metrics)
        self.service = EncoderService(self._encode, self.transport)
        self._host: GrpcHost | None = None
        self._stopped = False
        self.port: int | None = None
        self.host = ""

    @classmethod
    def loading(
        cls, load: Callable[[], VisionEncoder], config: TransportConfig, *, device: str = "cpu", **kwargs: Any
    ) -> EncoderWorker:
        """A worker whose encoder ``load()`` builds after ``start``; health says NOT_SERVING until then."""
        return cls(None, config, load=load, device=device, **kwargs)

    @property
    def worker_id(self) -> str:
        return self.transport.worker_id

    @property
    def address(self) -> str:
        return f"{self.host}:{self.port}"

    @property
    def loaded(self) -> bool:
        return self._encode_fn is not None

    def _encode(self, inputs: list[MultimodalInput]) -> EncoderOutput:
        fn = self._encode_fn
        if fn is None:
            raise PeerUnavailable(
                f"encoder {self.worker_id} is still loading its model; retry shortly or send the "
                "request to another worker",
                reason=Reason.PEER_UNAVAILABLE,
            )
        return fn(inputs)  # type: ignore[no-any-return]

    def _info(self) -> Any:
        enc = self.encoder
        return make_info(
            worker_id=self.worker_id,
            mode=self.config.mode,
            rdma=self.config.rdma,
            model=self.model,
            device=str(enc.device) if enc is not None else self._device,
            hidden_size=enc.hidden_size if enc is not None else 0,
        )

    def start(self, address: str = "127.0.0.1:0", *, insecure: bool = False) -> int:
        """Binds ``address`` (``ConfigError`` with reason ``BIND_FAILED`` when it cannot) and serves; SERVING when
        the encoder is loaded, NOT_SERVING until ``load()`` otherwise. A plaintext worker on a non-loopback
        address needs ``insecure`` (``--insecure``)."""
        if self._host is not None:
            raise RuntimeError("worker already started")
        host = encoder_host(
            "encoder",
            (self.service.methods(), info_service(self._info)),
            self.config,
            self.transport.metrics,
            thread_prefix="tensorwire-encoder",
            reuse_port=self.reuse_port,
        )
        try:
            port = host.bind(address, insecure=insecure)
        except ConfigError:
            self.transport.close()
            raise
        self.host, self.port = host.host, port
        self.transport.worker_address = self.address
        self.transport.start()
        self.service.start_local()  # the same-host control channel, unless local_channel is off
        host.start(serving=self.loaded)
        self._host = host
        log.info(
            "encoder worker %s on %s: %s, mode %s, rdma port %d",
            self.worker_id,
            self.address,
            self.encoder.describe() if self.encoder is not None else f"loading model {self.model}",
            self.config.mode,
            self.config.rdma.port,
        )
        return port

    def load(self) -> VisionEncoder:
        """Builds the encoder with the loader (no-op when it is loaded) and reports SERVING."""
        if self.encoder is None:
            assert self._load is not None
            encoder = self._load()
            self.encoder = encoder
            self._encode_fn = make_encode_fn(encoder, self.image_limits)
            log.info("encoder worker %s loaded %s", self.worker_id, encoder.describe())
        if self._host is not None and not self._stopped:
            self._host.set_serving(True)
        return self.encoder

    def wait_ready(self, timeout_s: float) -> bool:
        """Waits for the RDMA exporter (False in mode grpc or when no provider can be built)."""
        return self.transport.wait_ready(timeout_s)

    def stop(self, grace_s: float = 5.0, drain_s: float = 0.0) -> None:
        if self._stopped:
            return
        self._stopped = True
        until = time.monotonic() + drain_s + grace_s  # the same-host channel gets what is left of the grace
        try:
            if self._host is not None:
                self._host.stop(
                    grace_s,
                    drain=self.service.close_streams,
                    drain_s=drain_s,
                    quiesce=self.service.quiesce,
                    settle=self.service.settle,
                )
        finally:
            try:
                self.service.close_local(max(0.0, until - time.monotonic()))
                self.transport.close()
            finally:
                if self.encoder is not None:
                    self.encoder.close()

    close = stop

    def __enter__(self) -> EncoderWorker:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


__all__ = ["EncoderWorker", "make_encode_fn"]
