"""Held outputs across real processes: an owner and two reader ranks (``_store_procs``), NIXL over loopback.

The coordinator is this test process, using the vLLM connector's Fetcher (lookup once, every rank reads, one
release when the last rank has answered), exactly as an LLM instance's scheduler does with TP=2.
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from _store_procs import StoreProcs
from prometheus_client import CollectorRegistry

from tensorwire.integrations._vllm_ec.config import ECConfig
from tensorwire.integrations._vllm_ec.fetch import Fetcher, RemoteStager
from tensorwire.integrations._vllm_ec.metrics import ECMetrics
from tensorwire.integrations._vllm_ec.params import ItemGrant
from tensorwire.mm.held._staging import Expect
from tensorwire.mm.held._store import new_secret

pytestmark = [pytest.mark.timeout(240)]
SHAPE = (64, 1024)  # 256 KiB of float32


@pytest.fixture
def procs(tmp_path: Path, require_nixl: None) -> Any:
    p = StoreProcs(tmp_path, "cpu", ["cpu", "cpu"], SHAPE, torch.float32)
    yield p
    p.close()


def fetcher_for(procs: StoreProcs) -> Fetcher:
    cfg = ECConfig(host="127.0.0.1", fetch_timeout_ms=60000, lookup_timeout_ms=10000)
    stagers = [RemoteStager(f"unix:{s}", f"tp{i}") for i, s in enumerate(procs.socks)]
    return Fetcher(cfg, stagers, ECMetrics(CollectorRegistry()))


def wait_until(cond: Any, what: str, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not cond():
        assert time.monotonic() < deadline, what
        time.sleep(0.05)


def test_both_ranks_read_over_nixl_and_the_lease_ends_after_the_last(procs: StoreProcs) -> None:
    fetcher = fetcher_for(procs)
    try:
        secret = new_secret()
        want = procs.ask(procs.owner, "hold", "item-1", secret, 7)
        grant = ItemGrant(procs.endpoint, "item-1", secret, SHAPE, "float32")
        res = fetcher.start(grant, "k1", Expect(SHAPE, torch.float32)).result(timeout=90)
        assert res.ok and res.plane == "rdma" and res.nbytes == 2 * want.numel() * 4, res
        for r in procs.ranks:
            where, got = procs.ask(r, "get", "k1")
            assert where == "cpu" and torch.equal(got, want)
        wait_until(
            lambda: procs.ask(procs.owner, "stats") == (0, 0), "the owner still holds the item after every rank read it"
        )
        fetcher.drop_async(["k1"])
        wait_until(lambda: not any(procs.ask(r, "keys") for r in procs.ranks), "a rank kept a dropped item")
    finally:
        fetcher.close()


def test_a_dead_rank_fails_the_item_and_nothing_stays_held_or_staged(procs: StoreProcs) -> None:
    fetcher = fetcher_for(procs)
    try:
        procs.ranks[1].send(("quit",))
        procs.procs[2].join(30)
        if os.path.exists(procs.socks[1]):
            os.unlink(procs.socks[1])
        secret = new_secret()
        procs.ask(procs.owner, "hold", "item-2", secret, 8)
        grant = ItemGrant(procs.endpoint, "item-2", secret, SHAPE, "float32")
        res = fetcher.start(grant, "k2", Expect(SHAPE, torch.float32)).result(timeout=90)
        assert not res.ok and "tp1" in res.error, res
        wait_until(
            lambda: procs.ask(procs.owner, "stats") == (0, 0) and not procs.ask(procs.ranks[0], "keys"),
            "a lease or a staged copy was left behind",
        )
    finally:
        fetcher.close()


def test_the_host_reads_once_over_nixl_into_a_segment_and_the_lease_ends_at_once(procs: StoreProcs) -> None:
    """The LLM instance's host stager (CPU ranks in other processes): one READ into a memfd segment, which the
    ranks then map (``map_segment``, here in this process); the grant goes back after that one READ."""
    from tensorwire.integrations._vllm_ec.segments import SegmentRef, SegmentStager, map_segment
    from tensorwire.rdma import RdmaConfig, TensorReader

    stager = SegmentStager(lambda: TensorReader(RdmaConfig()))
    metrics = ECMetrics(CollectorRegistry())
    fetcher = Fetcher(ECConfig(host="127.0.0.1", fetch_timeout_ms=60000, lookup_timeout_ms=10000), [stager], metrics)
    try:
        secret = new_secret()
        want = procs.ask(procs.owner, "hold", "item-3", secret, 9)
        grant = ItemGrant(procs.endpoint, "item-3", secret, SHAPE, "float32")
        res = fetcher.start(grant, "k3", Expect(SHAPE, torch.float32)).result(timeout=90)
        assert res.ok and res.plane == "rdma" and res.nbytes == want.numel() * 4, res  # one READ, not one per rank
        ref = fetcher.load_ref("k3")
        assert isinstance(ref, SegmentRef)
        assert torch.equal(map_segment(ref), want)
        wait_until(lambda: procs.ask(procs.owner, "stats") == (0, 0), "the owner still holds the item after the read")
        fetcher.drop_async(["k3"])
        wait_until(lambda: stager.staged == 0, "the segment was not dropped")
    finally:
        fetcher.close()
