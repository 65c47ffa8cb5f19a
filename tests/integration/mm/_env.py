"""The shared set-up of the fake-data-plane integration tests: a real gRPC encoder server on 127.0.0.1:0, clients
with the in-memory reader, one metrics registry, and the observer's event list (tests/unit/mm/fakes.py holds the
fakes; the ``env`` fixture lives in conftest.py).
"""

from __future__ import annotations

import dataclasses
import threading
import time
from typing import Any

import torch
from fakes import FakeExporter, FakeFabric, FakeReader
from prometheus_client import CollectorRegistry

from tensorwire.errors import (
    ControlPlaneError,
    DeadlineExceeded,
    InvalidPayload,
    PeerUnavailable,
    PoolExhausted,
    ProtocolError,
    Reason,
)
from tensorwire.mm import (
    EncoderOutput,
    MultimodalInput,
    OutputTransport,
    RemoteOutputTransport,
    TransportConfig,
    TransportMetrics,
    serve_encoder,
)
from tensorwire.mm.client._grpc import GrpcControlChannel

G = torch.Generator().manual_seed(1234)
EMB = torch.randn(9, 16, generator=G).to(torch.bfloat16)
POS = torch.arange(27, dtype=torch.int64).reshape(9, 3)
EXTRAS = [torch.randn(2, 2, generator=G), torch.randn(5, generator=G)]
INPUTS = [MultimodalInput(b"img-a"), MultimodalInput(b"img-b", params={"max_pixels": "1024"})]


def encode_fn(inputs: list[MultimodalInput]) -> EncoderOutput:
    assert len(inputs) == 2
    return EncoderOutput(embeddings=[EMB[:4], EMB[4:]], position_ids=POS, extra_inputs=EXTRAS)


class RogueTransport(OutputTransport):
    """An encoder that exports RDMA whether or not it was asked to (a protocol violation)."""

    def _rdma_choice(self, request, emb, pos, extras):  # type: ignore[no-untyped-def]
        return self._holder.get(), None


class Env:
    """``local``: the clients' ``local_channel`` ("off": the gRPC control plane these tests were written for;
    "auto": the same-host channel, test_local_channel.py); ``placed``: whether those clients lend receive buffers
    (test_placed.py). Servers keep the config they are given."""

    def __init__(
        self, fabric: FakeFabric, registry: CollectorRegistry, local: str = "off", placed: bool = False
    ) -> None:
        self.fabric = fabric
        self.local = local
        self.placed = placed  # clients lend receive buffers (placed outputs); off: the slots/inline planes
        self.registry = registry
        self.metrics = TransportMetrics(registry)
        self.events: list[tuple[str, dict[str, Any]]] = []
        self.servers: list[Any] = []
        self.clients: list[RemoteOutputTransport] = []

    def server(
        self,
        cfg: TransportConfig | None = None,
        rogue: bool = False,
        fn=encode_fn,
        factory=None,  # type: ignore[no-untyped-def]
        address: str = "127.0.0.1:0",
    ):
        cfg = cfg or TransportConfig(worker_id="worker-1")
        factory = factory or (lambda c: FakeExporter(self.fabric, c))
        transport = (RogueTransport if rogue else OutputTransport)(cfg, exporter_factory=factory, metrics=self.metrics)
        srv = serve_encoder(fn, cfg, address, transport=transport)
        self.servers.append(srv)
        if cfg.mode == "auto":
            srv.transport.wait_ready(5)
        return srv

    def client(self, address: str, cfg: TransportConfig | None = None, clock=time.monotonic, local=None, **kw):  # type: ignore[no-untyped-def]
        cfg = dataclasses.replace(cfg or TransportConfig(), local_channel=local or self.local)
        if not self.placed:
            cfg = dataclasses.replace(cfg, local_placement_bytes=0)
        c = RemoteOutputTransport(
            address,
            cfg,
            reader_factory=lambda rc: FakeReader(self.fabric, rc),
            metrics=self.metrics,
            clock=clock,
            observer=lambda e, d: self.events.append((e, d)),
            **kw,
        )
        self.clients.append(c)
        if cfg.mode == "auto":
            assert c.wait_ready(5)
        return c

    def client_with_channel(self, address: str, cfg: TransportConfig | None = None, **kw):  # type: ignore[no-untyped-def]
        """A client built on a control channel the test holds (to look at its streams and watchdog)."""
        cfg = dataclasses.replace(
            cfg or TransportConfig(),
            local_channel=self.local,
            local_placement_bytes=cfg.local_placement_bytes if cfg and self.placed else 0,
        )
        channel = GrpcControlChannel(address, cfg, self.metrics)
        return self.client(address, cfg, channel=channel, **kw), channel

    def names(self) -> list[str]:
        return [e for e, _ in self.events]

    def sample(self, name: str, labels: dict[str, str] | None = None) -> float:
        return self.registry.get_sample_value(name, labels or {}) or 0.0


def wait_for(pred, timeout_s: float = 5.0) -> None:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout_s
    while not pred():
        assert time.monotonic() < deadline, "condition not reached"
        time.sleep(0.005)


def check_output(out) -> None:  # type: ignore[no-untyped-def]
    assert out.split_sizes == [4, 5]
    assert torch.equal(torch.cat(out.embeddings).view(torch.int16), EMB.view(torch.int16))
    assert torch.equal(torch.cat(out.position_ids), POS)
    assert all(torch.equal(a, b) for a, b in zip(out.extra_inputs, EXTRAS, strict=True)) and len(out.extra_inputs) == 2


class Held:
    """An encode_fn that holds the requests whose first input is ``trigger`` (every request: None) until ``gate``
    is set; ``entered`` is set when one is held, ``calls`` counts every request."""

    def __init__(self, trigger: bytes | None = None) -> None:
        self.trigger = trigger
        self.gate, self.entered = threading.Event(), threading.Event()
        self.calls = 0

    def __call__(self, inputs: list[MultimodalInput]) -> EncoderOutput:
        self.calls += 1
        if self.trigger is None or inputs[0].data == self.trigger:
            self.entered.set()
            self.gate.wait(10)
        return encode_fn(inputs)


class Fails:
    """encode_fn raising ``exc`` for inputs whose data is b"bad"."""

    def __init__(self, exc: BaseException) -> None:
        self.exc = exc

    def __call__(self, inputs: list[MultimodalInput]) -> EncoderOutput:
        if inputs[0].data == b"bad":
            raise self.exc
        return encode_fn(inputs)


# The encode_fn errors both control paths must report alike: (raised, class the caller sees, its reason).
ERROR_CASES = [
    (ValueError("no such image"), InvalidPayload, Reason.INVALID_REQUEST),
    (NotImplementedError("video"), ControlPlaneError, Reason.UNIMPLEMENTED),
    (InvalidPayload("bad dims", reason=Reason.NEGATIVE_DIM), InvalidPayload, Reason.NEGATIVE_DIM),
    (PoolExhausted("no slot"), PeerUnavailable, Reason.POOL_EXHAUSTED),
    (TimeoutError("model stuck"), DeadlineExceeded, Reason.DEADLINE_EXCEEDED),
    (RuntimeError("CUDA error"), ProtocolError, Reason.UNKNOWN),
]
ERROR_IDS = ["value", "notimplemented", "invalid", "pool", "timeout", "runtime"]
