"""The RDMA plane for real: encoder and LLM in separate OS processes, real gRPC, real NIXL (UCX over loopback).

Skipped only when NIXL cannot be imported (the none provider is all there is).
"""

from __future__ import annotations

import time
from typing import Any

import pytest
import torch
from _encoder_proc import finish, live_stats, make_output, start
from prometheus_client import CollectorRegistry

from tensorwire.errors import Reason
from tensorwire.mm import MultimodalInput, Plane, RemoteOutputTransport, TransportConfig, TransportMetrics
from tensorwire.rdma import RdmaConfig, has_rdma

pytestmark = [
    pytest.mark.timeout(180),
    pytest.mark.skipif(not has_rdma(), reason="NIXL provider not importable"),
]


def wait_for(pred, timeout_s: float = 10.0) -> None:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout_s
    while not pred():
        assert time.monotonic() < deadline, "condition not reached"
        time.sleep(0.01)


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return (
        a.dtype == b.dtype
        and a.shape == b.shape
        and torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8))
    )


def check(out: Any, seed: int, rows: list[int], cols: int) -> None:
    ref = make_output(seed, rows, cols)
    assert out.split_sizes == rows
    assert same_bits(torch.cat(out.embeddings), ref.embeddings)  # type: ignore[arg-type]
    assert same_bits(torch.cat(out.position_ids), ref.position_ids)  # type: ignore[arg-type]
    assert len(out.extra_inputs) == len(rows)
    assert all(same_bits(a, b) for a, b in zip(out.extra_inputs, ref.extra_inputs, strict=True))


def client(
    port: int,
    cfg: TransportConfig,
    events: list[str],
    reg: CollectorRegistry,
    details: list[dict[str, Any]] | None = None,
) -> RemoteOutputTransport:
    def observe(event: str, d: dict[str, Any]) -> None:
        events.append(event)
        if details is not None:
            details.append(d)

    c = RemoteOutputTransport(f"127.0.0.1:{port}", cfg, metrics=TransportMetrics(reg), observer=observe)
    assert c.wait_ready(30)
    return c


@pytest.mark.parametrize("path", ["stream", "unary", "local"])
def test_rdma_success_path_over_nixl(path: str) -> None:
    # Every control path gives the reference bits; the release (over the EncodeStream, the same-host socket, or
    # the unary ReleaseLeases RPC of the async queue) really frees every lease on the encoder while the client
    # is open.
    cfg = TransportConfig(
        worker_id="nixl-w0",
        control_stream=path != "unary",
        local_channel="auto" if path == "local" else "off",
        local_placement_bytes=0,
    )
    p, q, stop, port = start(cfg, seed=11)
    events: list[str] = []
    reg = CollectorRegistry()
    release = "release_async" if path == "unary" else "release_stream"
    try:
        with client(port, cfg, events, reg) as c:
            for _ in range(3):
                events.clear()
                out = c.fetch([MultimodalInput(b"a"), MultimodalInput(b"b")])
                assert out.plane is Plane.RDMA and out.worker_id == "nixl-w0"
                assert events == ["request", "read", release]
                check(out, 11, [3, 5], 64)
            assert reg.get_sample_value("tensorwire_mm_control_rpcs_total", {"path": path}) == 3
            if path == "local":
                assert (
                    reg.get_sample_value("tensorwire_mm_release_leases_total", {"mode": "local", "outcome": "sent"})
                    == 3
                )
            wait_for(lambda: live_stats(p, q).get("live_leases") == 0)
            live = live_stats(p, q)
            assert live.get("releases", 0) >= 3 and live.get("gc_reclaims", 0) == 0, live
    finally:
        stats = finish(p, q, stop)
    assert stats.get("live_leases") == 0 and stats.get("releases", 0) >= 3 and stats.get("gc_reclaims", 0) == 0


def test_placed_output_from_an_encoder_process() -> None:
    # Same-host channel with receive buffers (the default): the encoder process writes the output into this
    # process's memfd; no slot is leased and nothing is READ or released, and the bits are the reference's.
    cfg = TransportConfig(worker_id="nixl-w0")
    p, q, stop, port = start(cfg, seed=11)
    events: list[str] = []
    reg = CollectorRegistry()
    try:
        with client(port, cfg, events, reg) as c:
            outs = []
            for _ in range(3):
                events.clear()
                out = c.fetch([MultimodalInput(b"a"), MultimodalInput(b"b")])
                assert out.plane is Plane.PLACED and out.worker_id == "nixl-w0"
                assert events == ["request"]
                check(out, 11, [3, 5], 64)
                outs.append(out)  # held: each fetch needs a buffer of its own
            assert reg.get_sample_value("tensorwire_mm_control_rpcs_total", {"path": "local"}) == 3
            assert reg.get_sample_value("tensorwire_mm_requests_total", {"side": "llm", "plane": "placed"}) == 3
            del outs, out
            events.clear()
            check(c.fetch([MultimodalInput(b"a"), MultimodalInput(b"b")]), 11, [3, 5], 64)  # a buffer came back
        live = live_stats(p, q)
        assert live.get("live_leases", 0) == 0 and live.get("releases", 0) == 0, live
    finally:
        stats = finish(p, q, stop)
    assert stats.get("live_leases") == 0 and stats.get("gc_reclaims", 0) == 0


def test_zero_copy_output_over_nixl() -> None:
    # The encoder writes into allocate_output() buffers; transfer() publishes that slot without an export copy.
    cfg = TransportConfig(worker_id="nixl-zc", local_channel="off")
    p, q, stop, port = start(cfg, seed=5, zero_copy=True)
    events: list[str] = []
    reg = CollectorRegistry()
    ref = make_output(5, [3, 5], 64)
    try:
        with client(port, cfg, events, reg) as c:
            for _ in range(3):
                out = c.fetch([MultimodalInput(b"a"), MultimodalInput(b"b")])
                assert out.plane is Plane.RDMA and out.fallback_reason is None
                assert out.split_sizes == [3, 5] and out.extra_inputs == []
                assert same_bits(torch.cat(out.embeddings), ref.embeddings)  # type: ignore[arg-type]
                assert same_bits(torch.cat(out.position_ids), ref.position_ids)  # type: ignore[arg-type]
            wait_for(
                lambda: (
                    (
                        reg.get_sample_value(
                            "tensorwire_mm_release_leases_total", {"mode": "stream", "outcome": "sent"}
                        )
                        or 0
                    )
                    >= 3
                )
            )
        with RemoteOutputTransport(
            f"127.0.0.1:{port}", TransportConfig(mode="grpc"), metrics=TransportMetrics(CollectorRegistry())
        ) as g:
            out = g.fetch([MultimodalInput(b"a"), MultimodalInput(b"b")])  # allocated, then answered inline
            assert out.plane is Plane.INLINE and same_bits(torch.cat(out.embeddings), ref.embeddings)  # type: ignore[arg-type]
    finally:
        stats = finish(p, q, stop)
    # 4 allocations: 3 published in place (the only exports: no copy path ran) and 1 released after the inline
    # answer; none left for the GC.
    assert stats.get("allocations") == 4 and stats.get("exports") == 3, stats
    assert stats.get("live_leases") == 0 and stats.get("gc_reclaims", 0) == 0, stats


def test_failure_path_over_nixl_in_exact_order() -> None:
    cfg = TransportConfig(worker_id="nixl-w1", local_placement_bytes=0)  # the RDMA plane's failure path
    p, q, stop, port = start(cfg, seed=12, releasing=True)  # leases die before the read: a real stale read
    events: list[str] = []
    reg = CollectorRegistry()
    try:
        with client(port, cfg, events, reg) as c:
            out = c.fetch([MultimodalInput(b"a"), MultimodalInput(b"b")])
        assert events == ["request", "read", "release_sync", "request", "decode_inline"]
        assert out.plane is Plane.INLINE
        assert out.fallback_reason in (Reason.LEASE_EXPIRED, Reason.STALE_GENERATION)
        check(out, 12, [3, 5], 64)
    finally:
        finish(p, q, stop)


def test_large_multi_slot_embedding_bit_exact_over_nixl() -> None:
    rdma = RdmaConfig(max_slot_bytes=1 << 20, pool_cap_bytes=64 << 20)
    cfg = TransportConfig(worker_id="nixl-w2", rdma=rdma, local_placement_bytes=0)
    rows, cols = [1500, 2000, 596], 1024  # 4096 x 1024 bf16 = 8 MiB -> at least 8 slots of <= 1 MiB
    p, q, stop, port = start(cfg, seed=13, rows=rows, cols=cols)
    events: list[str] = []
    details: list[dict[str, Any]] = []
    reg = CollectorRegistry()
    try:
        with client(port, cfg, events, reg, details) as c:
            out = c.fetch([MultimodalInput(b"x")] * 3)
        assert out.plane is Plane.RDMA and events == ["request", "read", "release_stream"]
        assert details[1]["slots"] >= 8  # one batched read over every slot
        check(out, 13, rows, cols)
        assert (
            reg.get_sample_value("tensorwire_mm_bytes_total", {"side": "llm", "plane": "rdma", "role": "embedding"})
            == 4096 * 1024 * 2
        )
    finally:
        finish(p, q, stop)


def test_concurrent_fetches_over_nixl() -> None:
    from concurrent.futures import ThreadPoolExecutor

    cfg = TransportConfig(worker_id="nixl-w3", local_channel="off")
    p, q, stop, port = start(cfg, seed=14)
    events: list[str] = []
    reg = CollectorRegistry()
    try:
        with client(port, cfg, events, reg) as c, ThreadPoolExecutor(4) as pool:
            outs = list(pool.map(lambda _: c.fetch([MultimodalInput(b"a"), MultimodalInput(b"b")]), range(12)))
            for out in outs:
                assert out.plane is Plane.RDMA
                check(out, 14, [3, 5], 64)
            assert (reg.get_sample_value("tensorwire_mm_control_rpcs_total", {"path": "stream"}) or 0) >= 12
            wait_for(
                lambda: (
                    (
                        reg.get_sample_value(
                            "tensorwire_mm_release_leases_total", {"mode": "stream", "outcome": "sent"}
                        )
                        or 0
                    )
                    >= 12
                )
            )
            wait_for(lambda: live_stats(p, q).get("live_leases") == 0)
    finally:
        stats = finish(p, q, stop)
    assert stats.get("live_leases") == 0 and stats.get("gc_reclaims", 0) == 0
