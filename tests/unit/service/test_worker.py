"""EncoderWorker in-process over real gRPC: the EncodeFn contract, bad input, WorkerInfo, graceful shutdown."""

from __future__ import annotations

import dataclasses
import io
import threading
import time
from collections.abc import Sequence

import grpc
import pytest
import torch
from grpc_health.v1 import health_pb2
from PIL import Image
from prometheus_client import CollectorRegistry

from tensorwire.encoder import BuiltinEncoder, ImageEmbedding, PreprocessConfig, sample_paths
from tensorwire.errors import InvalidPayload, PeerUnavailable, Reason
from tensorwire.mm import MultimodalInput, RemoteOutputTransport, TransportConfig, metrics_for
from tensorwire.service._info import fetch_info
from tensorwire.service._worker import EncoderWorker

pytestmark = pytest.mark.timeout(60)

SMALL = PreprocessConfig(max_pixels=224 * 224)
INLINE = TransportConfig(mode="grpc")


def _png(w: int, h: int) -> bytes:
    buf = io.BytesIO()
    Image.new("RGB", (w, h), (10, 200, 30)).save(buf, format="PNG")
    return buf.getvalue()


class SlowEncoder(BuiltinEncoder):
    """Holds every forward for ``delay_s`` and notes when one started (for the drain test)."""

    def __init__(self, delay_s: float) -> None:
        super().__init__(preprocess=SMALL)
        self.delay_s = delay_s
        self.started = threading.Event()

    def _encode(self, images: Sequence[bytes]) -> list[ImageEmbedding]:
        self.started.set()
        time.sleep(self.delay_s)
        return super()._encode(images)


@pytest.fixture
def worker():
    w = EncoderWorker(BuiltinEncoder(preprocess=SMALL), INLINE, metrics=metrics_for(CollectorRegistry()))
    w.start("127.0.0.1:0")
    yield w
    w.stop(1.0)


def _client(w: EncoderWorker) -> RemoteOutputTransport:
    return RemoteOutputTransport(w.address, INLINE, metrics=metrics_for(CollectorRegistry()))


def _fetch_in_background(w: EncoderWorker) -> tuple[threading.Thread, dict]:
    """One fetch on a thread of its own; the dict gets "out" or "error"."""
    result: dict = {}

    def call() -> None:
        with _client(w) as client:
            try:
                result["out"] = client.fetch([MultimodalInput(_png(56, 56))])
            except Exception as exc:  # recorded for the assertion
                result["error"] = exc

    t = threading.Thread(target=call)
    t.start()
    return t, result


def test_fetch_matches_local_encoder(worker: EncoderWorker) -> None:
    images = [p.read_bytes() for p in sample_paths()[:2]]
    with _client(worker) as client:
        out = client.fetch([MultimodalInput(b) for b in images])
    local = BuiltinEncoder(preprocess=SMALL).encode(images)
    assert out.worker_id == worker.worker_id and out.split_sizes == [r.embedding.shape[0] for r in local]
    for got, ref in zip(out.embeddings, local, strict=True):
        torch.testing.assert_close(got, ref.embedding)
    assert out.position_ids is not None
    for got, ref in zip(out.position_ids, local, strict=True):
        assert torch.equal(got, ref.position_ids)
    assert out.stage_ms["encoder.encode"] > 0


@pytest.mark.parametrize(
    "inputs,match",
    [
        ([MultimodalInput(b"definitely not a png")], "cannot decode"),
        ([], "empty request"),
        ([MultimodalInput(b"x", kind="video")], "kind 'video'"),
    ],
)
def test_bad_input_is_invalid_argument_and_server_keeps_serving(
    worker: EncoderWorker, inputs: list, match: str
) -> None:
    with _client(worker) as client:
        with pytest.raises(InvalidPayload, match=match) as info:
            client.fetch(inputs)
        assert "INVALID_ARGUMENT" in str(info.value)
        assert info.value.reason in (Reason.INVALID_PAYLOAD, Reason.INVALID_REQUEST)
        assert client.fetch([MultimodalInput(_png(56, 56))]).embeddings[0].shape == (4, 2048)


def test_oversized_image_is_refused(worker: EncoderWorker) -> None:
    small_limits = EncoderWorker(
        BuiltinEncoder(preprocess=PreprocessConfig(max_image_pixels=64 * 64)),
        INLINE,
        metrics=metrics_for(CollectorRegistry()),
    )
    small_limits.start("127.0.0.1:0")
    try:
        with _client(small_limits) as client, pytest.raises(InvalidPayload, match="max_image_pixels"):
            client.fetch([MultimodalInput(_png(65, 64))])
    finally:
        small_limits.stop(1.0)


def test_worker_info_and_health(worker: EncoderWorker) -> None:
    with grpc.insecure_channel(worker.address) as ch:
        info = fetch_info(ch, worker.address, timeout_s=5)
        check = ch.unary_unary(
            "/grpc.health.v1.Health/Check",
            request_serializer=health_pb2.HealthCheckRequest.SerializeToString,
            response_deserializer=health_pb2.HealthCheckResponse.FromString,
        )
        status = check(health_pb2.HealthCheckRequest(service="tensorwire.mm.v1.EncoderService"), timeout=5)
    assert info.worker_id == worker.worker_id and info.mode == "grpc" and info.model == "builtin"
    assert info.rdma_port == INLINE.rdma.port and info.slot_gc_timeout_ms == INLINE.rdma.slot_gc_timeout_ms
    assert info.hidden_size == 2048 and info.device == "cpu"
    assert status.status == health_pb2.HealthCheckResponse.SERVING


def test_stop_finishes_in_flight_then_refuses() -> None:
    enc = SlowEncoder(delay_s=1.0)
    w = EncoderWorker(enc, INLINE, metrics=metrics_for(CollectorRegistry()))
    w.start("127.0.0.1:0")
    t, result = _fetch_in_background(w)
    try:
        assert enc.started.wait(10), "the request never reached the encoder"
        t0 = time.monotonic()
        w.stop(grace_s=5.0)
        stopped_after = time.monotonic() - t0
    finally:
        t.join(15)
    assert not t.is_alive()
    assert "error" not in result, result.get("error")
    assert result["out"].embeddings[0].shape == (4, 2048)
    assert stopped_after < 5.0  # drained when the call finished, not at the grace deadline
    assert enc._closed  # the encoder (and the transport) were closed after the drain
    with _client(w) as client, pytest.raises(PeerUnavailable):
        client.fetch([MultimodalInput(_png(56, 56))], timeout_ms=2000)
    w.stop()  # idempotent


@pytest.mark.parametrize("local", ["off", "auto"], ids=["stream", "local"])
def test_stop_does_not_wait_out_the_grace_for_idle_control_streams(local: str) -> None:
    # A long-lived LLM client keeps an EncodeStream (or a same-host connection) open between requests; stop ends
    # it instead of waiting.
    w = EncoderWorker(BuiltinEncoder(preprocess=SMALL), INLINE, metrics=metrics_for(CollectorRegistry()))
    w.start("127.0.0.1:0")
    client = RemoteOutputTransport(
        w.address,
        dataclasses.replace(INLINE, local_channel=local),  # type: ignore[arg-type]
        metrics=metrics_for(CollectorRegistry()),
    )

    def open_paths() -> int:
        return w.service.open_streams if local == "off" else w.service.local.open_connections  # type: ignore[union-attr]

    try:
        client.fetch([MultimodalInput(_png(56, 56))])
        assert open_paths() == 1
        t0 = time.monotonic()
        w.stop(grace_s=5.0)
        assert time.monotonic() - t0 < 1.0
        deadline = time.monotonic() + 5
        while open_paths() and time.monotonic() < deadline:  # the handler thread unwinds after
            time.sleep(0.01)
        assert open_paths() == 0
    finally:
        client.close()
        w.stop()


def test_a_loading_worker_is_not_serving_and_refuses_encode_until_loaded() -> None:
    from tensorwire.errors import PeerUnavailable

    gate = threading.Event()

    def load() -> BuiltinEncoder:
        gate.wait(20)
        return BuiltinEncoder(preprocess=SMALL)

    w = EncoderWorker.loading(load, INLINE, metrics=metrics_for(CollectorRegistry()))
    w.start("127.0.0.1:0")  # bound before the model exists (the old worker loaded first: connection refused)
    loader = threading.Thread(target=w.load)
    loader.start()
    try:
        with grpc.insecure_channel(w.address) as ch:
            check = ch.unary_unary(
                "/grpc.health.v1.Health/Check",
                request_serializer=health_pb2.HealthCheckRequest.SerializeToString,
                response_deserializer=health_pb2.HealthCheckResponse.FromString,
            )
            req = health_pb2.HealthCheckRequest(service="tensorwire.mm.v1.EncoderService")
            assert check(req, timeout=5).status == health_pb2.HealthCheckResponse.NOT_SERVING
            info = fetch_info(ch, w.address, timeout_s=5)  # a proxy can ask while it loads
            assert info.worker_id == w.worker_id and info.hidden_size == 0
            with _client(w) as client, pytest.raises(PeerUnavailable, match="still loading"):
                client.fetch([MultimodalInput(_png(56, 56))], timeout_ms=5000)
            gate.set()
            loader.join(30)
            assert check(req, timeout=5).status == health_pb2.HealthCheckResponse.SERVING
            assert fetch_info(ch, w.address, timeout_s=5).hidden_size == 2048
        with _client(w) as client:
            assert client.fetch([MultimodalInput(_png(56, 56))]).embeddings[0].shape == (4, 2048)
    finally:
        gate.set()
        loader.join(30)
        w.stop(1.0)


def test_stop_refuses_new_encodes_after_the_drain_period_and_lets_the_running_one_finish() -> None:
    from tensorwire.errors import PeerUnavailable

    enc = SlowEncoder(delay_s=2.0)
    w = EncoderWorker(enc, INLINE, metrics=metrics_for(CollectorRegistry()))
    w.start("127.0.0.1:0")
    t, result = _fetch_in_background(w)
    stopper = threading.Thread(target=w.stop, kwargs={"grace_s": 10.0, "drain_s": 0.2})
    try:
        assert enc.started.wait(10), "the request never reached the encoder"
        stopper.start()
        deadline = time.monotonic() + 10
        while not w.service._stopping and time.monotonic() < deadline:  # the drain period is over
            time.sleep(0.01)
        with _client(w) as client, pytest.raises(PeerUnavailable, match="draining"):
            client.fetch([MultimodalInput(_png(56, 56))], timeout_ms=5000)
    finally:
        t.join(15)
        stopper.join(15)
    assert "error" not in result, result.get("error")
    assert result["out"].embeddings[0].shape == (4, 2048)
