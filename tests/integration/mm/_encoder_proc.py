"""Encoder worker run in a spawned child process by the NIXL tests: real gRPC server, real TensorExporter."""

from __future__ import annotations

import multiprocessing as mp
import os
import time
from typing import Any

import torch

from tensorwire.mm import EncoderOutput, MultimodalInput, OutputTransport, TransportConfig, serve_encoder
from tensorwire.rdma import Descriptor


def make_output(seed: int, rows: list[int], cols: int) -> EncoderOutput:
    """Deterministic output both processes can rebuild: bf16 embedding, int64 position ids, one extra per item."""
    g = torch.Generator().manual_seed(seed)
    total = sum(rows)
    emb = torch.randn(total, cols, generator=g).to(torch.bfloat16)
    pos = torch.arange(total * 3, dtype=torch.int64).reshape(total, 3)
    extras = [torch.randn(2, 4, generator=g) for _ in rows]
    return EncoderOutput(embeddings=emb, split_sizes=rows, position_ids=pos, extra_inputs=extras)


class ReleasingTransport(OutputTransport):
    """Releases its leases right after exporting, before the reader reads: a real stale-lease failure."""

    def transfer(self, request, output):  # type: ignore[no-untyped-def]
        receipt = super().transfer(request, output)
        ids = [Descriptor.from_bytes(s.descriptor).lease_id for s in receipt.message.rdma_slots]
        if ids:
            self.release(ids)
        return receipt


def run(
    cfg: TransportConfig,
    seed: int,
    rows: list[int],
    cols: int,
    releasing: bool,
    q: Any,
    stop: Any,
    zero_copy: bool = False,
    ask: Any = None,
) -> None:
    os.environ.setdefault("NIXL_LOG_LEVEL", "WARN")
    output = make_output(seed, rows, cols)
    transport = (ReleasingTransport if releasing else OutputTransport)(cfg)

    def encode_fn(inputs: list[MultimodalInput]) -> EncoderOutput:
        if not zero_copy:
            return output
        # The producer writes its result straight into slot memory (no extra inputs: they take the copy path).
        emb, pos = output.embeddings, output.position_ids
        assert isinstance(emb, torch.Tensor) and isinstance(pos, torch.Tensor)
        bufs = transport.allocate_output(emb.shape[0], emb.shape[1], emb.dtype, position_cols=pos.shape[1])
        if bufs is None:
            return EncoderOutput(embeddings=emb, split_sizes=rows, position_ids=pos)
        bufs.embedding.copy_(emb)
        assert bufs.position_ids is not None
        bufs.position_ids.copy_(pos)
        return EncoderOutput(embeddings=bufs.embedding, split_sizes=rows, position_ids=bufs.position_ids)

    server = serve_encoder(encode_fn, cfg, "127.0.0.1:0", transport=transport)
    try:
        ready = transport.wait_ready(30)
        q.put(("port", server.port, ready))

        def stats() -> dict[str, Any]:
            exporter = transport._holder.get()
            return exporter.stats().as_dict() if exporter is not None else {}

        deadline = time.monotonic() + 120
        while not stop.wait(0.01) and time.monotonic() < deadline:
            if ask is not None and ask.is_set():
                ask.clear()
                q.put(("live", stats()))
        q.put(("stats", stats()))
    finally:
        server.stop(0)


def start(
    cfg: TransportConfig,
    *,
    seed: int = 0,
    rows: list[int] | None = None,
    cols: int = 64,
    releasing: bool = False,
    zero_copy: bool = False,
) -> tuple[Any, Any, Any, int]:
    ctx = mp.get_context("spawn")
    q, stop, ask = ctx.Queue(), ctx.Event(), ctx.Event()
    p = ctx.Process(target=run, args=(cfg, seed, rows or [3, 5], cols, releasing, q, stop, zero_copy, ask), daemon=True)
    p._tw_ask = ask  # type: ignore[attr-defined]  # for live_stats
    p.start()
    kind, port, ready = q.get(timeout=90)
    assert kind == "port" and ready, "encoder exporter did not become ready"
    return p, q, stop, port


def live_stats(p: Any, q: Any) -> dict[str, Any]:
    """The running encoder's exporter stats (live_leases, releases, gc_reclaims, ...), asked for now."""
    p._tw_ask.set()
    kind, stats = q.get(timeout=10)
    assert kind == "live", kind
    return stats  # type: ignore[no-any-return]


def finish(p: Any, q: Any, stop: Any) -> dict[str, Any]:
    stop.set()
    try:
        kind, stats = q.get(timeout=30)
        return stats if kind == "stats" else {}
    finally:
        p.join(30)
        if p.is_alive():
            p.kill()
            p.join(5)
