"""An inline encoder in a spawned child process whose encode_fn blocks on b"hold": a worker to kill mid-request."""

from __future__ import annotations

import multiprocessing as mp
import time
from typing import Any

import torch

from tensorwire.mm import EncoderOutput, MultimodalInput, TransportConfig, serve_encoder


def run(q: Any, entered: Any, mode: str = "grpc") -> None:
    out = EncoderOutput(embeddings=[torch.ones(4, 8)], position_ids=torch.zeros(4, 2, dtype=torch.int64))

    def encode_fn(inputs: list[MultimodalInput]) -> EncoderOutput:
        if inputs[0].data == b"hold":
            entered.set()
            time.sleep(120)
        return out

    server = serve_encoder(
        encode_fn,
        TransportConfig(mode=mode, worker_id="held"),  # type: ignore[arg-type]
        "127.0.0.1:0",
    )
    q.put((server.address, server.service.local.path if server.service.local is not None else None))
    time.sleep(120)  # killed by the test long before


def start(mode: str = "grpc") -> tuple[Any, Any, str, str | None]:
    """mode "auto": the worker also takes receive buffers (placed outputs)."""
    ctx = mp.get_context("spawn")
    q, entered = ctx.Queue(), ctx.Event()
    p = ctx.Process(target=run, args=(q, entered, mode), daemon=True)
    p.start()
    address, path = q.get(timeout=90)
    return p, entered, address, path
