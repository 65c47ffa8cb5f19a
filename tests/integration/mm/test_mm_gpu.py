"""The encoder service on cuda:0 and fetch() into cuda:0 (needs CUDA; ``pytest -m gpu`` on the GPU machine).

Two OS processes: a spawned encoder (real gRPC server, real TensorExporter on VRAM) and this process as the LLM
side (RemoteOutputTransport with a VRAM TensorReader). Both the copying export and the zero-copy output
(``allocate_output``) are checked byte for byte, with the inline plane as the reference.
"""

from __future__ import annotations

import multiprocessing as mp
import os
from typing import Any

import pytest
import torch

from tensorwire.mm import MultimodalInput, Plane, RemoteOutputTransport, TransportConfig
from tensorwire.rdma import RdmaConfig

pytestmark = [pytest.mark.gpu, pytest.mark.usefixtures("require_nixl"), pytest.mark.timeout(300)]

DEV = "cuda:0"
ROWS, COLS = 2000, 1024  # 4 MB of bf16: above the reader's loan threshold, so results are loaned device buffers


def _expected() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(5)
    emb = torch.randn(ROWS, COLS, generator=g).to(torch.bfloat16)
    pos = torch.arange(ROWS * 3, dtype=torch.int64).reshape(ROWS, 3)
    return emb, pos


def _encoder(q: Any, stop: Any) -> None:
    os.environ.setdefault("NIXL_LOG_LEVEL", "WARN")
    torch.empty(1, device=DEV)  # CUDA context before the NIXL agent
    from tensorwire.mm import EncoderOutput, OutputTransport, serve_encoder

    cfg = TransportConfig(worker_id="gpu-encoder", rdma=RdmaConfig(device=DEV, bind_ip="127.0.0.1"))
    emb, pos = (t.to(DEV) for t in _expected())
    transport = OutputTransport(cfg)

    def encode_fn(inputs: list[MultimodalInput]) -> Any:
        if inputs[0].params.get("zero_copy") == "1":
            bufs = transport.allocate_output(ROWS, COLS, torch.bfloat16, position_cols=3)
            assert bufs is not None and bufs.embedding.device == torch.device(DEV)
            bufs.embedding.copy_(emb)  # the "model" writes its last layer into slot memory
            assert bufs.position_ids is not None
            bufs.position_ids.copy_(pos)
            return EncoderOutput(embeddings=bufs.embedding, split_sizes=[ROWS], position_ids=bufs.position_ids)
        return EncoderOutput(embeddings=emb, split_sizes=[ROWS], position_ids=pos)

    server = serve_encoder(encode_fn, cfg, "127.0.0.1:0", transport=transport)
    try:
        q.put((server.port, transport.wait_ready(60)))
        stop.wait(240)
        exporter = transport._holder.get()
        q.put(exporter.stats().as_dict() if exporter is not None else {})
    finally:
        server.stop(0)


@pytest.fixture(scope="module")
def encoder() -> Any:
    ctx = mp.get_context("spawn")
    q, stop = ctx.Queue(), ctx.Event()
    proc = ctx.Process(target=_encoder, args=(q, stop), daemon=True)
    proc.start()
    port, ready = q.get(timeout=120)
    assert ready, "encoder exporter did not become ready"
    yield f"127.0.0.1:{port}", q, stop
    stop.set()
    proc.join(30)
    if proc.is_alive():
        proc.kill()


def test_placed_outputs_into_cuda0(encoder: Any) -> None:
    # Same-host channel with receive buffers: the encoder process writes into this process's device memory (CUDA
    # IPC), by copy or from allocate_output; every output held keeps its bytes while later fetches land elsewhere.
    endpoint, _, _ = encoder
    torch.empty(1, device=DEV)
    emb, pos = _expected()
    cfg = TransportConfig(rdma=RdmaConfig(device=DEV, bind_ip="127.0.0.1"))
    with RemoteOutputTransport(endpoint, cfg) as c:
        assert c.wait_ready(60)
        first = c.fetch([MultimodalInput(b"img")])  # 4 MB: over the first 1 MiB buffer, so by RDMA, and learnt
        assert first.plane is Plane.RDMA and torch.equal(first.embeddings[0].cpu(), emb)
        held = []
        for zero_copy in ("0", "1", "0", "1"):
            out = c.fetch([MultimodalInput(b"img", params={"zero_copy": zero_copy})])
            assert out.plane is Plane.PLACED, (zero_copy, out.fallback_reason)
            (got,) = out.embeddings
            assert got.device == torch.device(DEV) and got.dtype == torch.bfloat16
            assert torch.equal(got.cpu(), emb), f"zero_copy={zero_copy}"
            assert torch.equal(torch.cat(list(out.position_ids)).cpu().reshape(ROWS, 3), pos)
            got.add_(1)  # the caller owns these bytes: a later fetch must not touch them
            held.append(got)
        for got in held:
            assert torch.equal(got.cpu(), (emb.to(DEV) + 1).cpu())
        ptrs = {g.data_ptr() for g in held}
        assert len(ptrs) == 4  # four buffers, one per held output
        del held, got, out
        out = c.fetch([MultimodalInput(b"img", params={"zero_copy": "1"})])
        assert out.plane is Plane.PLACED and out.embeddings[0].data_ptr() in ptrs  # a buffer came back
        assert torch.equal(out.embeddings[0].cpu(), emb)


def test_encoder_on_cuda0_fetch_into_cuda0(encoder: Any) -> None:
    endpoint, q, stop = encoder
    torch.empty(1, device=DEV)
    emb, pos = _expected()
    # The RDMA plane (placed outputs, which a same-host client uses by default, are the test above)
    cfg = TransportConfig(rdma=RdmaConfig(device=DEV, bind_ip="127.0.0.1"), local_placement_bytes=0)
    with RemoteOutputTransport(endpoint, cfg) as rdma, RemoteOutputTransport(endpoint, cfg.with_mode("grpc")) as inline:
        assert rdma.wait_ready(60)
        for zero_copy in ("0", "1", "0", "1"):
            out = rdma.fetch([MultimodalInput(b"img", params={"zero_copy": zero_copy})])
            assert out.plane is Plane.RDMA, out.fallback_reason
            (got,) = out.embeddings
            assert got.device == torch.device(DEV) and got.dtype == torch.bfloat16
            assert torch.equal(got.cpu(), emb), f"zero_copy={zero_copy}"
            assert torch.equal(torch.cat(list(out.position_ids)).cpu().reshape(ROWS, 3), pos)
            del out, got
        ref = inline.fetch([MultimodalInput(b"img")])
        assert ref.plane is Plane.INLINE and torch.equal(ref.embeddings[0].cpu(), emb)
        reader = rdma._reader.get()
        assert reader is not None and "cuda_ipc" in reader.transport(), reader.transport()
    # Closing the transport flushed the async releases: the encoder holds no lease.
    stop.set()
    stats = q.get(timeout=60)
    assert stats["live_leases"] == 0 and stats["gc_reclaims"] == 0, stats
