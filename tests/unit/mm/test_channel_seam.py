"""The fetch policy's two seams, without gRPC: the ControlChannel contract (a second implementation drives the same
policy) and the one classifier of RDMA consume failures.

The in-process channel below hands requests straight to an EncoderService on the same thread, with errors
through the wire status table, as a same-host channel would; the data plane is the in-memory fake. These tests
claim the policy's behaviour over any channel; the gRPC channel has its own integration tests.
"""

from __future__ import annotations

import pytest
import torch
from fakes import FakeExporter, FakeFabric, FakeReader
from prometheus_client import CollectorRegistry

from tensorwire.errors import (
    ConfigError,
    DeadlineExceeded,
    InvalidDescriptor,
    InvalidPayload,
    LeaseExpired,
    ReadError,
    ReadTimeout,
    Reason,
    TensorwireError,
)
from tensorwire.mm import (
    EncoderOutput,
    EncoderService,
    MultimodalInput,
    OutputTransport,
    Plane,
    RemoteOutputTransport,
    TransportConfig,
    TransportMetrics,
    wire,
)
from tensorwire.mm._proto import encoder_pb2 as pb
from tensorwire.mm.client._channel import Budget, ControlChannel, ControlSession, Requeue
from tensorwire.mm.client._transport import Blame, ReadPlan, classify_consume_error
from tensorwire.mm.wire._receipt import parse_receipt

EMB = torch.arange(24, dtype=torch.float32).reshape(6, 4)


class InProcessChannel(ControlChannel):
    """A ControlChannel that calls an EncoderService in this process; records what the policy asked of it."""

    def __init__(self, endpoint: str, service: EncoderService) -> None:
        self.endpoint = endpoint
        self.service = service
        self.calls: list[str] = []
        self.requeue: Requeue | None = None

    def bind_requeue(self, requeue: Requeue) -> None:
        self.calls.append("bind_requeue")
        self.requeue = requeue

    def session(self) -> ControlSession:
        self.calls.append("session")
        return _InProcessSession(self)

    def release(self, lease_ids: list[str], timeout_s: float) -> int:
        self.calls.append("release")
        return self.service.transport.release(lease_ids)

    def drain(self, timeout_s: float) -> None:
        self.calls.append("drain")

    def close(self) -> None:
        self.calls.append("close")


class _InProcessSession(ControlSession):
    def __init__(self, channel: InProcessChannel) -> None:
        self._channel = channel

    @property
    def path(self) -> str:
        return "inproc"

    def encode(self, request: pb.EncodeRequest, budget: Budget) -> pb.EncodeResponse:
        if budget.remaining_ms() <= 0:
            raise DeadlineExceeded("no budget", reason=Reason.BUDGET_EXHAUSTED)
        try:
            # Serialized and parsed as on the wire: a receipt must not view the encoder's own tensors.
            return parse_receipt(self._channel.service.run_encode(request, lambda: True).to_bytes())
        except Exception as exc:  # the encoder's error, as every channel reports it: through the status table
            raise wire.error_from_stream(wire.stream_error_for(exc), "Encode in process") from exc

    def release_after_read(self, lease_ids: list[str]) -> bool:
        self._channel.calls.append("release_after_read")
        self._channel.service.transport.release(lease_ids)
        return True

    def close(self) -> None:
        self._channel.calls.append("session_close")


def encode_fn(inputs: list[MultimodalInput]) -> EncoderOutput:
    if inputs[0].data == b"bad":
        raise ValueError("no such image")
    return EncoderOutput(embeddings=[EMB[:2], EMB[2:]])


@pytest.fixture
def parts():  # type: ignore[no-untyped-def]
    fabric = FakeFabric()
    metrics = TransportMetrics(CollectorRegistry())
    cfg = TransportConfig(worker_id="w1")
    encoder = OutputTransport(cfg, exporter_factory=lambda c: FakeExporter(fabric, c), metrics=metrics)
    encoder.start()
    assert encoder.wait_ready(5)
    channel = InProcessChannel("inproc:1", EncoderService(encode_fn, encoder))
    events: list[tuple[str, dict]] = []  # type: ignore[type-arg]
    client = RemoteOutputTransport(
        "inproc:1",
        cfg,
        channel=channel,
        metrics=metrics,
        reader_factory=lambda rc: FakeReader(fabric, rc),
        observer=lambda e, d: events.append((e, d)),
    )
    assert client.wait_ready(5)
    try:
        yield fabric, channel, client, events
    finally:
        client.close()
        encoder.close()


def test_a_second_channel_drives_the_same_policy(parts) -> None:  # type: ignore[no-untyped-def]
    fabric, channel, client, events = parts
    out = client.fetch([MultimodalInput(b"a"), MultimodalInput(b"b")])
    assert out.plane is Plane.RDMA and out.split_sizes == [2, 4]
    assert torch.equal(torch.cat(out.embeddings), EMB)
    assert [d["path"] for e, d in events if e == "request"] == ["inproc"]
    assert not fabric.live()  # the success-path release went through the session
    with pytest.raises(InvalidPayload) as info:  # the encoder's error, the class and reason of the table
        client.fetch([MultimodalInput(b"bad")])
    assert info.value.reason is Reason.INVALID_REQUEST
    client.close()
    assert channel.calls == [
        "bind_requeue",
        "session",
        "release_after_read",
        "session_close",
        "session",
        "session_close",
        "drain",
        "close",
    ]


def test_a_failed_read_releases_over_the_channel_and_falls_back_once(parts) -> None:  # type: ignore[no-untyped-def]
    fabric, channel, client, events = parts
    fabric.read_error = lambda: LeaseExpired("stale generation")
    out = client.fetch([MultimodalInput(b"a"), MultimodalInput(b"b")])
    assert out.plane is Plane.INLINE and out.fallback_reason is Reason.LEASE_EXPIRED
    assert torch.equal(torch.cat(out.embeddings), EMB)
    assert "release" in channel.calls and not fabric.live()  # the failure path's answered release
    assert [e for e, _ in events if e in ("request", "read", "release_sync", "decode_inline")] == [
        "request",
        "read",
        "release_sync",
        "request",
        "decode_inline",
    ]


def test_a_channel_to_another_endpoint_is_refused(parts) -> None:  # type: ignore[no-untyped-def]
    _, channel, _, _ = parts
    with pytest.raises(ConfigError, match="inproc:1"):
        RemoteOutputTransport("elsewhere:2", TransportConfig(mode="grpc"), channel=channel)


CAPPED = ReadPlan.within(remaining_ms=10_000, cap_ms=3_000)  # read_timeout_ms set the deadline
BY_BUDGET = ReadPlan.within(remaining_ms=1_200.7, cap_ms=3_000)  # the budget set it


def test_read_plan_takes_the_smaller_of_budget_and_cap() -> None:
    assert (CAPPED.timeout_ms, CAPPED.budget_limited) == (3_000, False)
    assert (BY_BUDGET.timeout_ms, BY_BUDGET.budget_limited) == (1_200, True)
    assert ReadPlan.within(remaining_ms=5_000, cap_ms=0) == ReadPlan(5_000, True)  # no cap: the budget
    assert ReadPlan.within(remaining_ms=-3, cap_ms=3_000).timeout_ms <= 0  # no read at all


@pytest.mark.parametrize(
    "exc,plan,blame,cls,reason",
    [
        (
            InvalidDescriptor("bad bytes", reason=Reason.SIZE_OVERFLOW),
            None,
            Blame.ENDPOINT,
            InvalidDescriptor,
            Reason.SIZE_OVERFLOW,
        ),
        (ReadTimeout("slow peer"), CAPPED, Blame.ENDPOINT, ReadTimeout, Reason.READ_TIMEOUT),
        (ReadTimeout("slow peer"), BY_BUDGET, Blame.CALLER, DeadlineExceeded, Reason.BUDGET_EXHAUSTED),
        (LeaseExpired("stale"), CAPPED, Blame.ENDPOINT, LeaseExpired, Reason.LEASE_EXPIRED),
        (
            ReadError("short read", reason=Reason.RESULT_MISMATCH),
            CAPPED,
            Blame.ENDPOINT,
            ReadError,
            Reason.RESULT_MISMATCH,
        ),
        (RuntimeError("provider bug"), CAPPED, Blame.ENDPOINT, ReadError, Reason.RDMA_READ_ERROR),
    ],
    ids=["descriptor", "timeout-at-cap", "timeout-at-budget", "lease", "result", "foreign"],
)
def test_one_classifier_for_every_consume_failure(
    exc: BaseException, plan: ReadPlan | None, blame: Blame, cls: type[TensorwireError], reason: Reason
) -> None:
    failure = classify_consume_error(exc, plan)
    assert failure.blame is blame and type(failure.error) is cls and failure.error.reason is reason
    if failure.error is not exc:
        assert failure.error.__cause__ is exc  # translated, cause kept
