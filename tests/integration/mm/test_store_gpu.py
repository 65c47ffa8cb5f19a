"""Held outputs in VRAM: the path the vLLM connector takes on GPUs (``device: auto`` -> ``cuda:N``).

An owner process exports a CUDA tensor into a HeldStore (a registered VRAM slot); two reader ranks in their own
processes stage it into their own GPU (``cuda:0`` and ``cuda:1`` when there are two, else both ``cuda:0``) over
NIXL (``cuda_ipc`` inside a host), coordinated by the connector's Fetcher exactly as an LLM instance at TP=2.
Run with ``make test-gpu`` on a GPU machine.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import pytest
import torch
from _store_procs import StoreProcs
from test_store_processes import fetcher_for, wait_until

from tensorwire.integrations._vllm_ec.params import ItemGrant
from tensorwire.mm.held._staging import Expect
from tensorwire.mm.held._store import new_secret

pytestmark = [pytest.mark.gpu, pytest.mark.timeout(300)]
SHAPE = (2880, 4096)  # ~23.6 MB of bf16: a few large images' embeddings


@pytest.fixture
def procs(tmp_path: Path, require_nixl: None) -> Any:
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    devices = ["cuda:0", "cuda:1" if torch.cuda.device_count() > 1 else "cuda:0"]
    p = StoreProcs(tmp_path, "cuda:0", devices, SHAPE, torch.bfloat16)
    yield p
    p.close()


def test_vram_item_reaches_every_rank_gpu_and_the_lease_ends(procs: StoreProcs) -> None:
    fetcher = fetcher_for(procs)
    try:
        secret = new_secret()
        want = procs.ask(procs.owner, "hold", "vram-item", secret, 5)
        grant = ItemGrant(procs.endpoint, "vram-item", secret, SHAPE, "bfloat16")
        t0 = time.perf_counter()
        res = fetcher.start(grant, "k", Expect(SHAPE, torch.bfloat16)).result(timeout=120)
        elapsed = time.perf_counter() - t0
        assert res.ok and res.plane == "rdma", res
        for r, dev in zip(procs.ranks, procs.devices, strict=True):
            where, got = procs.ask(r, "get", "k")
            assert where == dev and torch.equal(got, want)
        wait_until(lambda: procs.ask(procs.owner, "stats") == (0, 0), "the owner still holds the item")
        print(f"lookup + {len(procs.ranks)} ranks staged {res.nbytes / 1e6:.1f} MB of VRAM in {elapsed * 1e3:.1f} ms")
    finally:
        fetcher.close()
