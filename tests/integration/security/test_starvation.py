"""Issue 15, deliverable 4 and finding 4: calls that never send their request, idle EncodeStreams and a busy
encoder starve nobody: health, Encode and ReleaseLeases keep answering, on a worker and on the proxy.

Real ``serve-encoder`` / ``serve-proxy`` processes (and, for the lanes, a real in-process gRPC server). Before
issue 15, 24 such calls held all 8 server threads of a worker (16 of the proxy's) and every other call timed out
until the hostile ones ended; ReleaseLeases queued behind running Encodes.
"""

from __future__ import annotations

import threading
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path

import grpc
import pytest
import torch
from _sec import pki_or_skip, serve, tls_flags, tls_of
from grpc_health.v1 import health_pb2, health_pb2_grpc
from prometheus_client import CollectorRegistry

from tensorwire.encoder import sample_paths
from tensorwire.mm import (
    EncoderOutput,
    MultimodalInput,
    RemoteOutputTransport,
    TransportConfig,
    metrics_for,
    serve_encoder,
    wire,
)
from tensorwire.rdma import RdmaConfig
from tensorwire.testing import hostile

IMAGE = sample_paths()[1]
ANSWER_S = 10.0  # what "keeps answering" means here; the hostile calls would hold for 60 s


class Attackers:
    """``n`` threads, each keeping one hostile call (``call(channel)``) in flight on a channel of its own."""

    def __init__(self, target: str, n: int, call: Callable[[grpc.Channel], str], tls: object = None) -> None:
        self.stop = threading.Event()
        self.outcomes: Counter[str] = Counter()
        self._lock = threading.Lock()
        self._threads = [
            threading.Thread(target=self._run, args=(hostile.channel(target, tls), call), daemon=True) for _ in range(n)
        ]

    def _run(self, ch: grpc.Channel, call: Callable[[grpc.Channel], str]) -> None:
        with ch:
            while not self.stop.is_set():
                outcome = call(ch)
                with self._lock:
                    self.outcomes[outcome] += 1
                self.stop.wait(0.02)  # a refused call comes back at once: bound the retries

    def __enter__(self) -> Attackers:
        for t in self._threads:
            t.start()
        time.sleep(1.0)  # every hostile call is in flight before the victim calls (not a synchronisation)
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop.set()
        for t in self._threads:
            t.join(90)


def _hold(ch: grpc.Channel) -> str:
    return hostile.unsent_body(ch, hold_s=60)


def _idle(ch: grpc.Channel) -> str:
    return hostile.idle_stream(ch, hold_s=60)


def _answers(target: str, tls: object = None) -> None:
    """Health, a fetch (Encode + read + release) and a ReleaseLeases, each within ANSWER_S."""
    with hostile.channel(target, tls) as ch:
        t0 = time.monotonic()
        status = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=ANSWER_S).status
        assert status == health_pb2.HealthCheckResponse.SERVING
        assert hostile.guessed_release(ch, ["no-such-lease"], timeout_s=ANSWER_S)[0] == "ok"
    cfg = TransportConfig() if tls is None else TransportConfig(tls=tls)  # type: ignore[arg-type]
    with RemoteOutputTransport(target, cfg, metrics=metrics_for(CollectorRegistry())) as c:
        out = c.fetch([MultimodalInput(IMAGE.read_bytes())], timeout_ms=int(ANSWER_S * 1000))
        assert out.embeddings[0].shape[1] == 2048
    assert time.monotonic() - t0 < 3 * ANSWER_S


@pytest.mark.timeout(300)
def test_unsent_requests_and_idle_streams_do_not_starve_a_worker_or_the_proxy(tmp_path: Path) -> None:
    worker, w = serve(tmp_path, "worker", "--port", "0", "--metrics-port", "-1")
    proxy = None
    try:
        with Attackers(w["grpc"], 12, _hold), Attackers(w["grpc"], 12, _idle) as idle:
            _answers(w["grpc"])
        assert idle.outcomes["CANCELLED"] >= 12  # the server dropped them (request deadline), they did not end
        proxy, p = serve(tmp_path, "proxy", "serve-proxy", "--worker", w["grpc"], "--metrics-port", "-1")
        with Attackers(p["grpc"], 24, _hold) as held:
            _answers(p["grpc"])
        assert held.outcomes["CANCELLED"] >= 24
    finally:
        for child in (proxy, worker):
            if child is not None:
                child.terminate(grace_s=5)


@pytest.mark.timeout(120)
def test_release_and_health_never_wait_behind_encode() -> None:
    gate, running = threading.Event(), threading.Semaphore(0)
    emb = torch.ones(4, 8)

    def slow(inputs: list[MultimodalInput]) -> EncoderOutput:
        running.release()
        gate.wait(30)
        return EncoderOutput(embeddings=[emb], split_sizes=[4])

    cfg = TransportConfig(server_threads=2, rdma=RdmaConfig(provider="none"), mode="grpc")
    server = serve_encoder(slow, cfg, "127.0.0.1:0")
    try:
        with grpc.insecure_channel(server.address) as ch:
            encodes = [
                ch.unary_unary(wire.ENCODE_METHOD).future(hostile.encode_request([b"x"]), timeout=60) for _ in range(4)
            ]
            for _ in range(2):
                assert running.acquire(timeout=20)  # both work slots run an Encode; two more wait for one
            t0 = time.monotonic()
            for _ in range(20):
                assert hostile.guessed_release(ch, ["no-such-lease"], timeout_s=5)[0] == "ok"
            check = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=5)
            assert check.status == health_pb2.HealthCheckResponse.SERVING
            assert time.monotonic() - t0 < 5.0
            gate.set()
            assert all(f.result(timeout=30) for f in encodes)
    finally:
        gate.set()
        server.stop(0)


@pytest.mark.timeout(300)
def test_one_identity_over_its_share_does_not_cost_another_its_calls(tmp_path: Path) -> None:
    pki = pki_or_skip(tmp_path / "pki")
    # A long request deadline: the attacker's 8 admitted calls stay in flight for the whole test.
    worker, w = serve(
        tmp_path,
        "worker",
        "--port",
        "0",
        "--metrics-port",
        "-1",
        "--max-inflight-per-peer",
        "8",
        "--max-streams-per-peer",
        "2",
        "--request-timeout-ms",
        "120000",
        *tls_flags(pki, "worker"),
    )
    try:
        attacker = tls_of(pki, "attacker")
        with Attackers(w["grpc"], 20, _hold, tls=attacker) as held:
            _answers(w["grpc"], tls_of(pki, "llm"))  # another identity is not counted against the attacker's 8
            # The attacker's own calls beyond 8 are refused at once, with the reason.
            with hostile.channel(w["grpc"], attacker) as ch:
                with pytest.raises(grpc.RpcError) as info:
                    health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=ANSWER_S)
                assert info.value.code() is grpc.StatusCode.RESOURCE_EXHAUSTED
                assert wire.reason_from_rpc(info.value).value == "peer_limit"  # type: ignore[union-attr]
        assert held.outcomes["RESOURCE_EXHAUSTED"] > 0
    finally:
        worker.terminate(grace_s=5)
