"""Through a real proxy to two real `serve-encoder` processes: spreading, RDMA, release routing, failover."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
import torch
from prometheus_client import CollectorRegistry

from tensorwire.encoder import BuiltinEncoder, sample_paths
from tensorwire.mm import MultimodalInput, RemoteOutputTransport, TransportConfig, metrics_for
from tensorwire.rdma import has_rdma
from tensorwire.service._child import Child
from tensorwire.service._proxy import EncoderProxy, ProxyConfig


@pytest.mark.timeout(180)
def test_proxy_spreads_routes_releases_and_fails_over(tmp_path: Path) -> None:
    workers = [
        Child(
            f"w{i}",
            [
                "serve-encoder",
                "--port",
                "0",
                "--metrics-port",
                "-1",
                "--worker-id",
                f"it-w{i}",
                "--wait-exporter-s",
                "20",
            ],
            tmp_path,
        )
        for i in range(2)
    ]
    proxy = client = None
    try:
        addresses = [w.ready(90)["grpc"] for w in workers]
        registry = CollectorRegistry()
        proxy = EncoderProxy(ProxyConfig(workers=tuple(addresses), worker_wait_s=20), registry=registry)
        proxy.start("127.0.0.1:0")
        assert [i.worker_id for i in proxy.worker_infos] == ["it-w0", "it-w1"]
        client = RemoteOutputTransport(
            f"127.0.0.1:{proxy.port}", TransportConfig(), metrics=metrics_for(CollectorRegistry())
        )
        rdma = has_rdma() and client.wait_ready(20)
        image = sample_paths()[0].read_bytes()
        reference = BuiltinEncoder().encode([image])[0]  # same seeded weights as the workers
        outs = [client.fetch([MultimodalInput(image)]) for _ in range(4)]
        assert sorted(o.worker_id for o in outs) == ["it-w0", "it-w0", "it-w1", "it-w1"]
        for out in outs:
            assert out.plane.value == ("rdma" if rdma else "inline"), out.fallback_reason
            torch.testing.assert_close(out.embeddings[0].cpu(), reference.embedding)
            assert torch.equal(out.position_ids[0], reference.position_ids)
        if rdma:
            # Every lease was routed to its owner and released there (async queue -> proxy -> worker).
            deadline = time.monotonic() + 10
            while time.monotonic() < deadline and len(proxy.routes):
                time.sleep(0.05)
            assert len(proxy.routes) == 0
            assert registry.get_sample_value("tensorwire_proxy_release_leases_total", {"outcome": "released"}) == 4
        # Kill one worker outright: every request still succeeds through the other.
        workers[0].terminate(grace_s=0)
        for _ in range(3):
            out = client.fetch([MultimodalInput(image)], timeout_ms=30_000)
            assert out.worker_id == "it-w1"
        assert (registry.get_sample_value("tensorwire_proxy_retries_total") or 0) >= 1
    finally:
        if client is not None:
            client.close()
        if proxy is not None:
            proxy.stop(1.0)
        for w in workers:
            w.terminate(grace_s=5)
