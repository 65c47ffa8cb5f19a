"""A spawned encoder process whose output covers every wire dtype (the foreign-client test's server).

An item of ``n`` bytes gets ``n`` embedding rows. ``output(rows)`` is deterministic, so the test rebuilds what
the server sends: a bfloat16 embedding made of random 16-bit patterns (NaNs with payloads, infinities,
subnormals, -0 included), int64 position ids, and one extra input per item, item ``i`` in ``DTYPES[i % 10]``.
"""

from __future__ import annotations

from typing import Any

import torch

DTYPES = [
    torch.float32,
    torch.float16,
    torch.bfloat16,
    torch.float64,
    torch.int64,
    torch.int32,
    torch.int16,
    torch.int8,
    torch.uint8,
    torch.bool,
]
COLS = 96


def output(rows: list[int]) -> tuple[torch.Tensor, torch.Tensor, list[torch.Tensor]]:
    g = torch.Generator().manual_seed(20261202 + sum(rows) * 31 + len(rows))
    total = sum(rows)
    emb = torch.randint(-(1 << 15), 1 << 15, (total, COLS), generator=g, dtype=torch.int16).view(torch.bfloat16)
    pos = torch.randint(-(1 << 62), 1 << 62, (total, 3), generator=g, dtype=torch.int64)
    extras = []
    for i in range(len(rows)):
        dt = DTYPES[i % len(DTYPES)]
        raw = torch.randint(0, 256, (2 * 3 * dt.itemsize,), generator=g, dtype=torch.uint8)
        extras.append((raw % 2).view(torch.bool).reshape(2, 3) if dt == torch.bool else raw.view(dt).reshape(2, 3))
    return emb, pos, extras


def serve(q: Any, stop: Any) -> None:
    from tensorwire.mm import EncoderOutput, MultimodalInput, TransportConfig, serve_encoder

    def encode_fn(inputs: list[MultimodalInput]) -> EncoderOutput:
        rows = [len(i.data) for i in inputs]
        emb, pos, extras = output(rows)
        return EncoderOutput(embeddings=emb, split_sizes=rows, position_ids=pos, extra_inputs=extras)

    server = serve_encoder(encode_fn, TransportConfig(mode="grpc", worker_id="all-dtypes"), "127.0.0.1:0")
    try:
        q.put(server.port)
        stop.wait(300)
    finally:
        server.stop(0)
