"""The plain-gRPC baseline of ``bench transfer``: a real server process, a real channel, the exact bytes back."""

from __future__ import annotations

import multiprocessing as mp
from collections.abc import Iterator
from typing import Any

import grpc
import pytest
import torch

from tensorwire.bench import _plain_grpc as plain_grpc

pytestmark = pytest.mark.timeout(180)

MAX_ROWS, COLS = 24, 64


@pytest.fixture(scope="module")
def endpoint() -> Iterator[str]:
    ctx = mp.get_context("spawn")
    q, stop = ctx.Queue(), ctx.Event()
    proc = ctx.Process(target=plain_grpc.serve, args=(MAX_ROWS, COLS, q, stop), daemon=True)
    proc.start()
    try:
        yield f"127.0.0.1:{q.get(timeout=120)}"
    finally:
        stop.set()
        proc.join(30)
        if proc.is_alive():
            proc.kill()
            proc.join(5)


@pytest.mark.parametrize("server_copy", [False, True], ids=["held-bytes", "copy-per-call"])
def test_round_trip_returns_the_encoders_bytes(endpoint: str, server_copy: bool) -> None:
    expected = plain_grpc.embedding(MAX_ROWS, COLS)
    with plain_grpc.PlainClient(endpoint, COLS) as client:
        for rows in (MAX_ROWS, 5):  # a prefix of the held output, as the encoder's emb[:n]
            assert client.prepare(rows) == rows * COLS * 2
            got, stages = client.fetch(rows, server_copy=server_copy)
            assert got.dtype == torch.bfloat16 and got.shape == (rows, COLS)
            assert got.view(torch.uint8).numpy().tobytes() == expected[:rows].view(torch.uint8).numpy().tobytes()
            assert stages["total"] >= stages["rpc"] > 0


def test_embedding_is_deterministic_and_not_trivial() -> None:
    a, b = plain_grpc.embedding(8, COLS), plain_grpc.embedding(8, COLS)
    assert torch.equal(a, b) and a.dtype == torch.bfloat16
    assert a.float().std() > 0.5  # seeded normal values, not zeros: a copy that dropped bytes would show


def test_fetch_of_a_size_not_prepared_is_refused(endpoint: str) -> None:
    with plain_grpc.PlainClient(endpoint, COLS) as client:
        client.prepare(4)
        for server_copy in (False, True):
            with pytest.raises(grpc.RpcError) as info:
                client.fetch(3, server_copy=server_copy)
            err: Any = info.value
            assert err.code() is grpc.StatusCode.FAILED_PRECONDITION and "rows=3 not prepared" in err.details()
