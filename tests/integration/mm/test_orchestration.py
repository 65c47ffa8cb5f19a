"""Fallback policy, breaker, deadlines and protocol errors against a real gRPC encoder server on 127.0.0.1:0.

The data plane here is the in-memory fake (tests/unit/mm/fakes.py): these tests claim the orchestration, not
NIXL. test_nixl_transport.py covers the real data plane in separate processes. Every test runs twice: with the
clients on the gRPC control plane and on the same-host channel (the ``env`` fixture below, issue 18).
"""

from __future__ import annotations

import dataclasses
import time

import grpc
import pytest
import torch
from _env import INPUTS, Env, check_output, encode_fn, wait_for
from fakes import FakeExporter, FakeReader, make_read_error
from grpc_health.v1 import health_pb2, health_pb2_grpc

from tensorwire.errors import (
    DeadlineExceeded,
    ExportError,
    InvalidPayload,
    PeerUnavailable,
    ProtocolError,
    ReadError,
    ReadTimeout,
    Reason,
)
from tensorwire.mm import (
    EncoderOutput,
    MultimodalInput,
    OutputTransport,
    Plane,
    RemoteOutputTransport,
    TransportConfig,
    serve_encoder,
    wire,
)
from tensorwire.mm._background import InitState
from tensorwire.mm.client._breaker import BreakerState
from tensorwire.rdma import ExporterStats, RdmaConfig

pytestmark = pytest.mark.timeout(60)


@pytest.fixture
def env(any_env: Env) -> Env:
    return any_env


class Clock:
    def __init__(self) -> None:
        self.t = 10_000.0

    def __call__(self) -> float:
        return self.t + time.monotonic()  # real time passes too: budgets stay meaningful


@pytest.mark.parametrize("stream", [True, False], ids=["stream", "unary"])
def test_rdma_success_path_reads_then_releases_async(env: Env, stream: bool) -> None:
    # Both control paths: the release rides the EncodeStream, or the async queue's ReleaseLeases RPC.
    srv = env.server()
    c = env.client(srv.address, TransportConfig(control_stream=stream))
    out = c.fetch(INPUTS)
    check_output(out)
    assert out.plane is Plane.RDMA and out.fallback_reason is None and out.worker_id == "worker-1"
    path, release, mode, outcome = (
        ("stream", "release_stream", "stream", "sent") if stream else ("unary", "release_async", "async", "ok")
    )
    if env.local == "auto":  # the same-host channel carries both, whatever control_stream says
        path, release, mode, outcome = "local", "release_stream", "local", "sent"
    assert env.names() == ["request", "read", release]
    assert env.events[0][1]["support_rdma"] is True and env.events[0][1]["path"] == path
    assert len(env.fabric.reads) == 1  # one batched read for every slot
    wait_for(lambda: not env.fabric.live())  # the background release reached the encoder
    assert env.sample("tensorwire_mm_requests_total", {"side": "llm", "plane": "rdma"}) == 1
    assert env.sample("tensorwire_mm_control_rpcs_total", {"path": path}) == 1
    wait_for(lambda: env.sample("tensorwire_mm_release_leases_total", {"mode": mode, "outcome": outcome}) == 1)
    assert env.sample("tensorwire_mm_release_leases_total", {"mode": "sync", "outcome": "ok"}) == 0
    assert {"request", "read", "total", "encoder.export", "encoder.encode"} <= set(out.stage_ms)


@pytest.mark.parametrize(
    "transport, device, staged", [("tcp/lo", "cuda:0", 1), ("cuda_ipc/cuda", "cuda:0", 0), ("tcp/lo", "cpu", 0)]
)
def test_gpu_reads_staged_over_tcp_are_counted(env: Env, transport: str, device: str, staged: int) -> None:
    # Issue 6: a GPU read that UCX staged through TCP must never be silent. The fake reader stands in for the
    # data plane; what is claimed is the client's accounting of the transport the reader reports.
    class Reporting(FakeReader):
        def transport(self) -> str:
            return transport

    srv = env.server()
    cfg = TransportConfig(rdma=RdmaConfig(device=device), local_placement_bytes=0)  # the RDMA plane's accounting
    c = RemoteOutputTransport(
        srv.address, cfg, reader_factory=lambda rc: Reporting(env.fabric, RdmaConfig()), metrics=env.metrics
    )
    env.clients.append(c)
    assert c.wait_ready(5)
    for _ in range(2):
        assert c.fetch(INPUTS).plane is Plane.RDMA
    assert env.sample("tensorwire_mm_rdma_staged_gpu_reads_total") == 2 * staged


def test_read_failure_path_in_exact_order(env: Env) -> None:
    srv = env.server()
    c = env.client(srv.address)
    env.fabric.read_error = make_read_error
    live_at_second_request: list[set[str]] = []
    c._observer = lambda e, d: (
        env.events.append((e, d)),  # type: ignore[assignment]
        live_at_second_request.append(env.fabric.live()) if e == "request" else None,
    )
    out = c.fetch(INPUTS)
    check_output(out)
    assert env.names() == ["request", "read", "release_sync", "request", "decode_inline"]
    assert [d["support_rdma"] for e, d in env.events if e == "request"] == [True, False]
    # The retry names the worker whose receipt failed, so a proxy in between asks another one (issue 16).
    assert [d["excluded"] for e, d in env.events if e == "request"] == [[], [out.worker_id]] and out.worker_id
    assert live_at_second_request[1] == set()  # released before the retry went out
    assert out.plane is Plane.INLINE and out.fallback_reason is Reason.RDMA_READ_ERROR
    assert env.sample("tensorwire_mm_fallbacks_total", {"side": "llm", "reason": "rdma_read_error"}) == 1
    assert env.sample("tensorwire_mm_errors_total", {"side": "llm", "reason": "rdma_read_error"}) == 0


def test_at_most_one_fallback_even_if_the_encoder_keeps_sending_rdma(env: Env) -> None:
    srv = env.server(rogue=True)
    c = env.client(srv.address)
    env.fabric.read_error = make_read_error
    with pytest.raises(ProtocolError) as ei:
        c.fetch(INPUTS)
    assert ei.value.reason is Reason.UNREQUESTED_RDMA
    assert env.names() == ["request", "read", "release_sync", "request", "release_sync"]
    assert not env.fabric.live() and len(env.fabric.exported) == 2  # both batches' leases went back


def test_unrequested_rdma_receipt_is_a_protocol_error_without_fallback(env: Env) -> None:
    srv = env.server(rogue=True)
    c = env.client(srv.address, TransportConfig(mode="grpc"))
    with pytest.raises(ProtocolError) as ei:
        c.fetch(INPUTS)
    assert ei.value.reason is Reason.UNREQUESTED_RDMA
    assert env.names() == ["request", "release_sync"]
    assert env.fabric.reads == [] and not env.fabric.live()


def test_grpc_mode_never_advertises_and_encoder_grpc_mode_never_exports(env: Env) -> None:
    srv = env.server()
    c = env.client(srv.address, TransportConfig(mode="grpc"))
    out = c.fetch(INPUTS)
    check_output(out)
    assert out.plane is Plane.INLINE and env.events[0][1]["support_rdma"] is False
    assert c.reader_state is InitState.OFF and env.fabric.exported == []
    srv2 = env.server(TransportConfig(mode="grpc"))
    c2 = env.client(srv2.address)
    out2 = c2.fetch(INPUTS)
    check_output(out2)
    assert out2.plane is Plane.INLINE and env.fabric.exported == [] and srv2.transport.exporter_state is InitState.OFF


def test_breaker_opens_half_opens_and_closes(env: Env) -> None:
    clock = Clock()
    srv = env.server()
    c = env.client(srv.address, TransportConfig(failures_to_open=3, open_seconds=30), clock=clock)
    env.fabric.read_error = make_read_error
    for _ in range(3):
        assert c.fetch(INPUTS).plane is Plane.INLINE
    assert c.endpoint_breakers.state(srv.address) is BreakerState.OPEN
    assert c.worker_breakers.state("worker-1") is BreakerState.OPEN
    env.events.clear()
    assert c.fetch(INPUTS).plane is Plane.INLINE
    assert env.names() == ["request", "decode_inline"]  # open: no advertisement, no wasted forward
    assert env.events[0][1]["support_rdma"] is False
    clock.t += 31
    env.fabric.read_error = None
    env.events.clear()
    out = c.fetch(INPUTS)  # the half-open probe
    assert out.plane is Plane.RDMA and env.names() == ["request", "read", "release_stream"]
    assert c.endpoint_breakers.state(srv.address) is BreakerState.CLOSED
    assert c.worker_breakers.state("worker-1") is BreakerState.CLOSED


def test_open_worker_breaker_asks_that_worker_for_inline(env: Env) -> None:
    srv = env.server()
    c = env.client(srv.address)
    env.fabric.read_error = make_read_error
    for _ in range(3):
        c.fetch(INPUTS)
    c.endpoint_breakers.reset()  # a proxy endpoint stays healthy while one worker behind it is not
    env.fabric.read_error = None
    exported = len(env.fabric.exported)
    env.events.clear()
    out = c.fetch(INPUTS)
    assert out.plane is Plane.INLINE and env.events[0][1]["excluded"] == ["worker-1"]
    assert len(env.fabric.exported) == exported  # the worker did not export
    assert env.sample("tensorwire_mm_fallbacks_total", {"side": "encoder", "reason": "breaker_open"}) == 1


def test_read_deadline_is_clamped_to_budget_minus_reserve(env: Env) -> None:
    srv = env.server()
    cfg = TransportConfig(fallback_reserve_ms=1000, rdma=RdmaConfig(read_timeout_ms=3000))
    c = env.client(srv.address, cfg)
    c.fetch(INPUTS, timeout_ms=60_000)
    assert env.fabric.reads[-1][1] == 3000  # read_timeout_ms caps it
    c.fetch(INPUTS, timeout_ms=2500)
    assert 1000 < env.fabric.reads[-1][1] <= 1500  # remaining - reserve


def test_budget_limited_read_timeout_is_not_an_endpoint_fault(env: Env) -> None:
    srv = env.server()
    cfg = TransportConfig(fallback_reserve_ms=1000, failures_to_open=2, rdma=RdmaConfig(read_timeout_ms=3000))
    c = env.client(srv.address, cfg)
    env.fabric.read_error = lambda: ReadTimeout("slow")
    for _ in range(3):
        out = c.fetch(INPUTS, timeout_ms=2500)  # the budget, not read_timeout_ms, bounded the read
        assert out.plane is Plane.INLINE and out.fallback_reason is Reason.BUDGET_EXHAUSTED
    assert c.endpoint_breakers.state(srv.address) is BreakerState.CLOSED
    for _ in range(2):
        out = c.fetch(INPUTS, timeout_ms=60_000)  # read_timeout_ms bounded it: the endpoint is slow
        assert out.fallback_reason is Reason.READ_TIMEOUT
    assert c.endpoint_breakers.state(srv.address) is BreakerState.OPEN


def test_no_budget_for_the_read_falls_back_without_reading(env: Env) -> None:
    srv = env.server()
    c = env.client(srv.address, TransportConfig(fallback_reserve_ms=5000, min_fallback_ms=100))
    out = c.fetch(INPUTS, timeout_ms=3000)
    assert out.plane is Plane.INLINE and out.fallback_reason is Reason.BUDGET_EXHAUSTED
    assert env.fabric.reads == [] and env.names() == ["request", "release_sync", "request", "decode_inline"]
    assert c.endpoint_breakers.state(srv.address) is BreakerState.CLOSED


def test_too_little_budget_for_a_fallback_returns_the_original_error(env: Env) -> None:
    srv = env.server()
    c = env.client(srv.address, TransportConfig(fallback_reserve_ms=0, min_fallback_ms=100_000))
    env.fabric.read_error = make_read_error
    with pytest.raises(ReadError) as ei:
        c.fetch(INPUTS, timeout_ms=10_000)
    assert ei.value.reason is Reason.RDMA_READ_ERROR
    assert env.names() == ["request", "read", "release_sync"]
    env.fabric.read_error = lambda: ReadTimeout("slow")
    with pytest.raises(DeadlineExceeded) as ei2:
        c.fetch(INPUTS, timeout_ms=2_000)  # budget-limited timeout without fallback budget: the caller's budget
    assert ei2.value.reason is Reason.BUDGET_EXHAUSTED


def test_result_and_assembly_mismatches_degrade_once(env: Env) -> None:
    srv = env.server()
    c = env.client(srv.address)
    env.fabric.read_hook = lambda ts: [ts[0][:-1], *ts[1:]]  # one row short: does not match its manifest
    out = c.fetch(INPUTS)
    assert out.plane is Plane.INLINE and out.fallback_reason is Reason.RESULT_MISMATCH
    check_output(out)


def test_export_failure_rolls_back_every_lease_and_answers_inline(env: Env) -> None:
    class BadManifestExporter(FakeExporter):
        def export_batch(self, groups):  # type: ignore[no-untyped-def]
            descs = super().export_batch(groups)
            last = descs[-1]
            return [*descs[:-1], dataclasses.replace(last, manifest=last.manifest[:-1])]

    big = torch.randn(300, 40, generator=torch.Generator().manual_seed(3)).to(torch.bfloat16)  # 24000 B
    pos = torch.arange(300).reshape(300, 1)

    def fn(inputs):  # type: ignore[no-untyped-def]
        return EncoderOutput(embeddings=big, split_sizes=[300], position_ids=pos, extra_inputs=[torch.ones(3)])

    cfg = TransportConfig(worker_id="w", rdma=RdmaConfig(max_slot_bytes=8192, pool_cap_bytes=1 << 20))
    srv = env.server(cfg, fn=fn, factory=lambda rc: BadManifestExporter(env.fabric, rc))
    c = env.client(srv.address)
    out = c.fetch([MultimodalInput(b"x")])
    assert out.plane is Plane.INLINE and torch.equal(out.embeddings[0].view(torch.int16), big.view(torch.int16))
    assert len(env.fabric.exported) >= 3 and not env.fabric.live()  # every lease of the request rolled back
    assert env.sample("tensorwire_mm_fallbacks_total", {"side": "encoder", "reason": "result_mismatch"}) == 1
    env.fabric.fail_export_at = 1
    srv2 = env.server(cfg, fn=fn)
    assert env.client(srv2.address).fetch([MultimodalInput(b"x")]).plane is Plane.INLINE and not env.fabric.live()
    assert env.sample("tensorwire_mm_fallbacks_total", {"side": "encoder", "reason": "registration_failed"}) == 1


def test_multi_slot_embedding_is_reassembled_bit_exactly(env: Env) -> None:
    big = torch.randn(300, 40, generator=torch.Generator().manual_seed(7)).to(torch.bfloat16)  # 24000 B
    cfg = TransportConfig(worker_id="w", rdma=RdmaConfig(max_slot_bytes=8192, pool_cap_bytes=1 << 20))
    srv = env.server(cfg, fn=lambda inputs: EncoderOutput(embeddings=big, split_sizes=[100, 150, 50]))
    c = env.client(srv.address, TransportConfig(rdma=RdmaConfig(max_slot_bytes=8192, pool_cap_bytes=1 << 20)))
    out = c.fetch([MultimodalInput(b"x")] * 3)
    assert out.plane is Plane.RDMA and env.fabric.reads[-1][0] >= 3  # several slots, one read call
    assert torch.equal(torch.cat(out.embeddings).view(torch.int16), big.view(torch.int16))
    assert [e.shape[0] for e in out.embeddings] == [100, 150, 50]


def test_exporter_start_retries_transient_failures_and_latches_permanent_ones(env: Env) -> None:
    attempts = []

    def flaky(rc: RdmaConfig) -> FakeExporter:
        attempts.append(1)
        if len(attempts) < 3:
            raise ExportError("port busy", reason=Reason.REGISTRATION_FAILED)
        return FakeExporter(env.fabric, rc)

    cfg = TransportConfig(worker_id="w", init_backoff_ms=10, init_backoff_max_ms=20)
    srv = env.server(cfg, factory=flaky)
    assert srv.transport.wait_ready(5) and len(attempts) == 3
    assert env.client(srv.address).fetch(INPUTS).plane is Plane.RDMA

    def none(rc: RdmaConfig) -> FakeExporter:
        attempts.append(1)
        raise ExportError("no provider", reason=Reason.PROVIDER_UNAVAILABLE)

    n = len(attempts)
    srv2 = env.server(cfg, factory=none)
    wait_for(lambda: srv2.transport.exporter_state is InitState.DISABLED)
    time.sleep(0.1)
    assert len(attempts) == n + 1  # not retried
    assert env.client(srv2.address).fetch(INPUTS).plane is Plane.INLINE
    assert env.sample("tensorwire_mm_fallbacks_total", {"side": "encoder", "reason": "provider_unavailable"}) == 1


def test_reader_without_provider_never_advertises(env: Env) -> None:
    srv = env.server()

    def no_reader(rc: RdmaConfig) -> FakeReader:
        raise ReadError("no provider", reason=Reason.PROVIDER_UNAVAILABLE)

    c = RemoteOutputTransport(
        srv.address,
        TransportConfig(local_placement_bytes=0),
        reader_factory=no_reader,
        metrics=env.metrics,
        observer=lambda e, d: env.events.append((e, d)),
    )
    env.clients.append(c)
    wait_for(lambda: c.reader_state is InitState.DISABLED)
    assert c.fetch(INPUTS).plane is Plane.INLINE and env.events[0][1]["support_rdma"] is False


def test_malformed_requests_and_outputs_get_invalid_argument_and_server_keeps_serving(env: Env) -> None:
    srv = env.server(
        fn=lambda inputs: (
            encode_fn(inputs)
            if inputs[0].data != b"bad"
            else EncoderOutput(embeddings=[torch.zeros(1, 2, dtype=torch.complex64)])
        )
    )
    with grpc.insecure_channel(srv.address) as ch:
        raw = ch.unary_unary(wire.ENCODE_METHOD)
        with pytest.raises(grpc.RpcError) as ei:
            raw(b"\xff\xff\xff\xff", timeout=5)
        assert ei.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        health = health_pb2_grpc.HealthStub(ch)
        resp = health.Check(health_pb2.HealthCheckRequest(service=wire.SERVICE_NAME), timeout=5)
        assert resp.status == health_pb2.HealthCheckResponse.SERVING
    c = env.client(srv.address, TransportConfig(mode="grpc"))
    with pytest.raises(InvalidPayload) as ei2:
        c.fetch([MultimodalInput(b"bad"), MultimodalInput(b"x")])
    assert ei2.value.reason is Reason.UNSUPPORTED_DTYPE
    check_output(c.fetch(INPUTS))  # still serving


def test_malformed_inline_receipt_fails_the_request_cleanly(env: Env) -> None:
    class Truncating(OutputTransport):
        def transfer(self, request, output):  # type: ignore[no-untyped-def]
            r = super().transfer(request, output)
            r.embedding = r.embedding[:-2]  # the payload, which the receipt holds next to its message
            return r

    cfg = TransportConfig(mode="grpc", worker_id="w")
    srv = serve_encoder(encode_fn, cfg, "127.0.0.1:0", transport=Truncating(cfg, metrics=env.metrics))
    env.servers.append(srv)
    c = env.client(srv.address, cfg)
    with pytest.raises(InvalidPayload) as ei:
        c.fetch(INPUTS)
    assert ei.value.reason is Reason.NBYTES_MISMATCH


def test_empty_output_and_unreachable_endpoint(env: Env) -> None:
    srv = env.server(fn=lambda inputs: EncoderOutput(embeddings=[]))
    out = env.client(srv.address).fetch([])
    assert out.embeddings == [] and out.split_sizes == [] and out.position_ids is None
    dead = env.client("127.0.0.1:1", TransportConfig(mode="grpc"))
    with pytest.raises(PeerUnavailable):
        dead.fetch(INPUTS, timeout_ms=2000)


def test_encoder_releases_at_once_when_the_caller_left_during_export(env: Env) -> None:
    import threading

    gate, entered = threading.Event(), threading.Event()

    class SlowExporter(FakeExporter):
        def export_batch(self, groups):  # type: ignore[no-untyped-def]
            entered.set()
            gate.wait(60)
            return super().export_batch(groups)

    srv = env.server(factory=lambda cfg: SlowExporter(env.fabric, cfg))
    c = env.client(srv.address)
    with pytest.raises(DeadlineExceeded):
        # Gives up while the encoder is exporting. The budget is long enough for the request to reach the export
        # on a loaded machine (300 ms might not be), and the export waits at the gate until after it.
        c.fetch(INPUTS, timeout_ms=2000)
    assert entered.is_set()
    gate.set()
    wait_for(lambda: len(env.fabric.exported) == 1)
    wait_for(lambda: not env.fabric.live())  # released by the encoder itself, long before any TTL GC


def test_encoder_exports_nothing_when_the_caller_left_during_encode(env: Env) -> None:
    import threading

    from tensorwire._grpc.scope import current_call

    gate = threading.Event()

    def slow(inputs):  # type: ignore[no-untyped-def]
        gate.wait(60)
        # Returns once the server knows the caller left: the client's cancel reaches the server some time after
        # the client gave up (on a loaded machine, after an export that started at once; that case, released at
        # once, is the test above). What is tested here is what the encoder does with work nobody waits for.
        call = current_call()
        wait_for(lambda: not call.active(), timeout_s=60.0)
        return encode_fn(inputs)

    env.server(fn=slow)
    c = env.client(env.servers[-1].address)
    with pytest.raises(DeadlineExceeded):
        c.fetch(INPUTS, timeout_ms=1000)  # gives up while the encoder is still working (at the gate)
    gate.set()
    wait_for(
        lambda: env.sample("tensorwire_mm_errors_total", {"side": "encoder", "reason": "cancelled"}) == 1,
        timeout_s=60.0,
    )
    assert env.fabric.exported == [] and not env.fabric.live()


def test_hit_marker_logged_once_then_rate_limited_and_gc_gauge_reads_the_exporter(
    env: Env, caplog: pytest.LogCaptureFixture
) -> None:
    import logging

    class GcExporter(FakeExporter):
        def stats(self) -> ExporterStats:
            return ExporterStats(provider="fake", gc_reclaims=7)

    srv = env.server(factory=lambda rc: GcExporter(env.fabric, rc))
    c = env.client(srv.address)
    with caplog.at_level(logging.INFO, logger="tensorwire.mm.client._transport"):
        for _ in range(3):
            assert c.fetch(INPUTS).plane is Plane.RDMA
    hits = [r for r in caplog.records if "[MM-RDMA-HIT]" in r.getMessage()]
    bw = [r for r in caplog.records if "[RDMA-BW]" in r.getMessage()]
    assert len(hits) == 1 and "1 slot(s)" in hits[0].getMessage()
    assert len(bw) == 1 and "GB/s" in bw[0].getMessage()
    assert env.sample("tensorwire_mm_encoder_gc_reclaimed_leases_total") == 7
    assert env.sample("tensorwire_mm_encoder_exporter_ready") == 1
