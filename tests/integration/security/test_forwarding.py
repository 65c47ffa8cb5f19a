"""Who a worker counts a call against: the caller's certificate, a trusted proxy's word for its caller, nobody
else's word (issue 15: per-peer limits and quotas behind a proxy). Real gRPC servers over mTLS in this process."""

from __future__ import annotations

from pathlib import Path

import grpc
import pytest
import torch
from _sec import pki_or_skip, tls_of
from prometheus_client import CollectorRegistry

from tensorwire._grpc.limits import ServerLimits
from tensorwire._grpc.scope import FORWARDED_PEER_METADATA, current_call
from tensorwire._grpc.tls import channel_credentials
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
from tensorwire.service._proxy import EncoderProxy, ProxyConfig
from tensorwire.testing import hostile


@pytest.mark.timeout(120)
@pytest.mark.parametrize("trusted", [True, False])
def test_a_worker_believes_only_its_trusted_forwarders(tmp_path: Path, trusted: bool) -> None:
    pki = pki_or_skip(tmp_path / "pki")
    seen: list[str] = []
    emb = torch.ones(2, 4)

    def encode_fn(inputs: list[MultimodalInput]) -> EncoderOutput:
        seen.append(current_call().peer.key)
        return EncoderOutput(embeddings=[emb], split_sizes=[2])

    limits = ServerLimits(trusted_forwarders="cn:proxy" if trusted else "")
    worker = serve_encoder(
        encode_fn,
        TransportConfig(tls=tls_of(pki, "worker"), limits=limits, mode="grpc", rdma=RdmaConfig(provider="none")),
        "127.0.0.1:0",
    )
    proxy = EncoderProxy(
        ProxyConfig(workers=(worker.address,), check_workers=False, tls=tls_of(pki, "proxy")),
        registry=CollectorRegistry(),
    )
    try:
        proxy.start("127.0.0.1:0")
        cfg = TransportConfig(tls=tls_of(pki, "llm"), mode="grpc")
        with RemoteOutputTransport(f"127.0.0.1:{proxy.port}", cfg, metrics=metrics_for(CollectorRegistry())) as c:
            c.fetch([MultimodalInput(b"x")], timeout_ms=10_000)
        assert seen == (["cn:llm"] if trusted else ["cn:proxy"])
        # A caller that is not a listed forwarder cannot name someone else.
        with grpc.secure_channel(worker.address, channel_credentials(tls_of(pki, "attacker"))) as ch:
            encode: grpc.UnaryUnaryMultiCallable[bytes, bytes] = ch.unary_unary(wire.ENCODE_METHOD)
            encode(hostile.encode_request([b"x"]), timeout=10, metadata=((FORWARDED_PEER_METADATA, "cn:llm"),))
        assert seen[-1] == "cn:attacker"
    finally:
        proxy.stop(0)
        worker.stop(0)
