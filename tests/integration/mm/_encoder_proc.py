"""Encoder worker run in a spawned child process by the NIXL tests: real gRPC server, real TensorExporter."""

from __future__ import annotations

import multiprocessing as mp
import os
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
        ids = [Descriptor.from_bytes(s.descriptor).lease_id for s in receipt.rdma_slots]
        if ids:
            self.release(ids)
        return receipt


def run(cfg: TransportConfig, seed: int, rows: list[int], cols: int, releasing: bool, q: Any, stop: Any) -> None:
    os.environ.setdefault("NIXL_LOG_LEVEL", "WARN")
    output = make_output(seed, rows, cols)

    def encode_fn(inputs: list[MultimodalInput]) -> EncoderOutput:
        return output

    transport = (ReleasingTransport if releasing else OutputTransport)(cfg)
    server = serve_encoder(encode_fn, cfg, "127.0.0.1:0", transport=transport)
    try:
        ready = transport.wait_ready(30)
        q.put(("port", server.port, ready))
        stop.wait(120)
        exporter = transport._holder.get()
        q.put(("stats", dict(exporter.stats()) if exporter is not None else {}))
    finally:
        server.stop(0)


def start(cfg: TransportConfig, *, seed: int = 0, rows: list[int] | None = None, cols: int = 64,
          releasing: bool = False) -> tuple[Any, Any, Any, int]:
    ctx = mp.get_context("spawn")
    q, stop = ctx.Queue(), ctx.Event()
    p = ctx.Process(target=run, args=(cfg, seed, rows or [3, 5], cols, releasing, q, stop), daemon=True)
    p.start()
    kind, port, ready = q.get(timeout=90)
    assert kind == "port" and ready, "encoder exporter did not become ready"
    return p, q, stop, port


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
