"""Held outputs across real processes: an owner (TensorExporter + HeldStore + HeldOutputs over gRPC) and two
reader ranks (StagingArea with a real TensorReader, Staging over unix sockets), NIXL over loopback.

The coordinator is this test process, using the vLLM connector's Fetcher (lookup once, every rank reads, one
release when the last rank has answered), exactly as an LLM instance's scheduler does with TP=2.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from prometheus_client import CollectorRegistry

from tensorwire.integrations._vllm_ec.config import ECConfig
from tensorwire.integrations._vllm_ec.fetch import Fetcher, RemoteStager
from tensorwire.integrations._vllm_ec.metrics import ECMetrics
from tensorwire.integrations._vllm_ec.params import ItemGrant
from tensorwire.mm import Expect, new_secret

pytestmark = [pytest.mark.timeout(240)]


def _owner(conn: Any) -> None:
    from tensorwire.mm import HeldStore, serve_store
    from tensorwire.rdma import RdmaConfig, TensorExporter

    exporter = TensorExporter(RdmaConfig(slot_gc_timeout_ms=30000))
    store = HeldStore(exporter)
    server = serve_store("127.0.0.1:0", store=store)
    conn.send(server.address)
    while True:
        msg = conn.recv()
        if msg[0] == "hold":
            _, key, secret, seed = msg
            g = torch.Generator().manual_seed(seed)
            t = torch.randn(64, 1024, generator=g)  # 256 KiB
            store.grant(key, secret)
            store.hold(key, [t])
            conn.send(t)
        elif msg[0] == "stats":
            st = store.stats()
            conn.send((st.held_items, exporter.stats()["live_leases"]))
        else:
            break
    server.stop(0)
    store.close()
    exporter.close()


def _rank(conn: Any, sock: str) -> None:
    from tensorwire.mm import StagingArea, serve_store
    from tensorwire.rdma import RdmaConfig, TensorReader

    area = StagingArea(lambda: TensorReader(RdmaConfig()))
    area.warm_up()
    server = serve_store(f"unix:{sock}", staging=area)
    conn.send("ready")
    while True:
        msg = conn.recv()
        if msg[0] == "get":
            got = area.get(msg[1])
            conn.send(None if got is None else got[0].clone())
        elif msg[0] == "keys":
            conn.send(area.keys())
        else:
            break
    server.stop(0)
    area.close()


class Procs:
    def __init__(self, tmp: Path) -> None:
        ctx = mp.get_context("spawn")
        self.procs: list[Any] = []
        self.owner, child = ctx.Pipe()
        self.procs.append(ctx.Process(target=_owner, args=(child,), daemon=True))
        self.ranks = []
        self.socks = [str(tmp / f"r{i}.sock") for i in range(2)]
        for s in self.socks:
            parent, child = ctx.Pipe()
            self.ranks.append(parent)
            self.procs.append(ctx.Process(target=_rank, args=(child, s), daemon=True))
        for p in self.procs:
            p.start()
        assert self.owner.poll(120), "owner did not start"
        self.endpoint = self.owner.recv()
        for r in self.ranks:
            assert r.poll(120) and r.recv() == "ready"

    def ask(self, conn: Any, *msg: Any) -> Any:
        conn.send(msg)
        assert conn.poll(60), f"no answer to {msg[0]}"
        return conn.recv()

    def close(self) -> None:
        for conn in [self.owner, *self.ranks]:
            try:
                conn.send(("quit",))
            except (OSError, BrokenPipeError):
                pass
        for p in self.procs:
            p.join(20)
            if p.is_alive():
                p.kill()
                p.join(5)


@pytest.fixture
def procs(tmp_path: Path, require_nixl: None) -> Any:
    p = Procs(tmp_path)
    yield p
    p.close()


def _fetcher(procs: Procs) -> Fetcher:
    cfg = ECConfig(host="127.0.0.1", fetch_timeout_ms=20000, lookup_timeout_ms=5000)
    stagers = [RemoteStager(f"unix:{s}", f"tp{i}") for i, s in enumerate(procs.socks)]
    return Fetcher(cfg, stagers, ECMetrics(CollectorRegistry()))


def test_both_ranks_read_over_nixl_and_the_lease_ends_after_the_last(procs: Procs) -> None:
    fetcher = _fetcher(procs)
    try:
        secret = new_secret()
        want = procs.ask(procs.owner, "hold", "item-1", secret, 7)
        grant = ItemGrant(procs.endpoint, "item-1", secret, (64, 1024), "float32")
        res = fetcher.start(grant, "k1", Expect((64, 1024), torch.float32)).result(timeout=60)
        assert res.ok and res.plane == "rdma" and res.nbytes == 2 * want.numel() * 4, res
        for r in procs.ranks:
            assert torch.equal(procs.ask(r, "get", "k1"), want)
        deadline = time.monotonic() + 10
        while procs.ask(procs.owner, "stats") != (0, 0):
            assert time.monotonic() < deadline, "the owner still holds the item after every rank read it"
            time.sleep(0.05)
        fetcher.drop_async(["k1"])
        deadline = time.monotonic() + 10
        while any(procs.ask(r, "keys") for r in procs.ranks):
            assert time.monotonic() < deadline
            time.sleep(0.05)
    finally:
        fetcher.close()


def test_a_dead_rank_fails_the_item_and_nothing_stays_held_or_staged(procs: Procs) -> None:
    fetcher = _fetcher(procs)
    try:
        procs.ranks[1].send(("quit",))
        procs.procs[2].join(20)
        os.path.exists(procs.socks[1]) and os.unlink(procs.socks[1])
        secret = new_secret()
        procs.ask(procs.owner, "hold", "item-2", secret, 8)
        grant = ItemGrant(procs.endpoint, "item-2", secret, (64, 1024), "float32")
        res = fetcher.start(grant, "k2", Expect((64, 1024), torch.float32)).result(timeout=60)
        assert not res.ok and "tp1" in res.error, res
        deadline = time.monotonic() + 10
        while procs.ask(procs.owner, "stats") != (0, 0) or procs.ask(procs.ranks[0], "keys"):
            assert time.monotonic() < deadline, "a lease or a staged copy was left behind"
            time.sleep(0.05)
    finally:
        fetcher.close()
