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

from tensorwire.errors import Reason
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


def test_the_uniproc_rank_reads_over_nixl_into_spare_segments_and_keeps_every_item(procs: StoreProcs) -> None:
    """vLLM's uniproc executor (the rank's StagingArea in the scheduler's process): each item is READ straight into
    a segment made ahead, never into the reader's pool (whose loans vLLM's encoder cache would keep), and an item
    staged earlier keeps its bytes while later ones land."""
    from tensorwire.integrations._vllm_ec.fetch import LocalStager
    from tensorwire.integrations._vllm_ec.segments import SegmentSpares
    from tensorwire.mm.held._staging import StagingArea
    from tensorwire.rdma import RdmaConfig, TensorReader

    area = StagingArea(lambda: TensorReader(RdmaConfig()))
    spares = SegmentSpares()
    taken: list[tuple[int, int]] = []
    take = spares.take

    def recording_take(nbytes: int) -> Any:
        seg = take(nbytes)
        taken.append((seg.tensor.data_ptr(), seg.size))
        return seg

    spares.take = recording_take  # type: ignore[method-assign]
    cfg = ECConfig(host="127.0.0.1", fetch_timeout_ms=60000, lookup_timeout_ms=10000)
    fetcher = Fetcher(cfg, [LocalStager(area, spares=spares)], ECMetrics(CollectorRegistry()))
    try:
        wants, kept = [], []
        for i in range(3):
            secret = new_secret()
            wants.append(procs.ask(procs.owner, "hold", f"item-u{i}", secret, 20 + i))
            grant = ItemGrant(procs.endpoint, f"item-u{i}", secret, SHAPE, "float32")
            res = fetcher.start(grant, f"u{i}", Expect(SHAPE, torch.float32)).result(timeout=90)
            assert res.ok and res.plane == "rdma", res
            staged = area.get(f"u{i}")
            assert staged is not None
            kept.append(staged[0])  # what vLLM's encoder cache would hold
            if i == 0:
                wait_until(lambda: spares.spare_bytes > 0, "no segment was made ahead after the first READ")
        assert len(taken) == 3 and len({ptr for ptr, _ in taken}) == 3
        for t, (ptr, size) in zip(kept, taken, strict=True):
            assert ptr <= t.data_ptr() < ptr + size  # a view of its own segment
        fetcher.drop_async([f"u{i}" for i in range(3)])
        wait_until(lambda: not area.keys(), "the area kept a dropped item")
        for t, want in zip(kept, wants, strict=True):
            assert torch.equal(t, want)  # dropped from the area, the encoder cache's tensors keep their bytes
        wait_until(lambda: procs.ask(procs.owner, "stats") == (0, 0), "the owner still holds an item after the reads")
    finally:
        fetcher.close()
        area.close()
    assert spares.spare_bytes == 0  # closed with the fetcher


# -- receipts in the params: read with no lookup --------------------------------------------------------------------


def _host_fetcher() -> tuple[Fetcher, ECMetrics, Any]:
    from tensorwire.integrations._vllm_ec.segments import SegmentStager
    from tensorwire.rdma import RdmaConfig, TensorReader

    stager = SegmentStager(lambda: TensorReader(RdmaConfig()))
    metrics = ECMetrics(CollectorRegistry())
    cfg = ECConfig(host="127.0.0.1", fetch_timeout_ms=60000, lookup_timeout_ms=10000)
    return Fetcher(cfg, [stager], metrics), metrics, stager


def _counted(counter: Any, label: str) -> float:
    return float(counter.labels(label)._value.get())


def _staged(fetcher: Fetcher, key: str) -> torch.Tensor:
    from tensorwire.integrations._vllm_ec.segments import SegmentRef, map_segment

    ref = fetcher.load_ref(key)
    assert isinstance(ref, SegmentRef)
    return map_segment(ref)


def _grant_with_receipt(procs: StoreProcs, key: str, seed: int) -> tuple[ItemGrant, torch.Tensor]:
    secret = new_secret()
    want = procs.ask(procs.owner, "hold", key, secret, seed)
    receipt = procs.ask(procs.owner, "receipt", key)
    assert receipt, "an RDMA-held item has a receipt to announce"
    return ItemGrant(procs.endpoint, key, secret, SHAPE, "float32", receipt=receipt), want


def test_a_receipt_in_the_params_is_read_with_no_lookup_once_the_owner_is_known(procs: StoreProcs) -> None:
    fetcher, metrics, _ = _host_fetcher()
    try:
        # First item of this owner: its receipt names an owner not met yet (params never carry the metadata
        # token), so it is looked up, which introduces the owner.
        first, want1 = _grant_with_receipt(procs, "r-1", 11)
        res = fetcher.start(first, "k1", Expect(SHAPE, torch.float32)).result(timeout=90)
        assert res.ok and torch.equal(_staged(fetcher, res.staging_key), want1), res
        assert _counted(metrics.receipts, "unknown_owner") == 1
        lookups = procs.ask(procs.owner, "lookups")
        assert lookups == 1
        # Every later item is read straight from its receipt, on this thread, with no call to the owner.
        for i, seed in enumerate((12, 13, 14), start=2):
            grant, want = _grant_with_receipt(procs, f"r-{i}", seed)
            fut = fetcher.start(grant, f"k{i}", Expect(SHAPE, torch.float32))
            assert fut.done(), "a receipt read is done when start returns"
            res = fut.result()
            assert res.ok and res.nbytes == want.numel() * 4 and torch.equal(_staged(fetcher, f"k{i}"), want), res
        assert procs.ask(procs.owner, "lookups") == lookups
        assert _counted(metrics.receipts, "used") == 3 and _counted(metrics.fetch_paths, "params") == 3
        # ... and each grant still goes back to the owner after its read, once the caller says the step is over.
        assert procs.ask(procs.owner, "stats")[0] == 3
        fetcher.flush_releases()
        wait_until(lambda: procs.ask(procs.owner, "stats") == (0, 0), "the owner still holds items after the reads")
    finally:
        fetcher.close()


def test_a_receipt_of_a_released_item_never_delivers_the_slots_new_bytes(procs: StoreProcs) -> None:
    fetcher, metrics, _ = _host_fetcher()
    try:
        intro, _ = _grant_with_receipt(procs, "intro", 20)
        assert fetcher.start(intro, "k0", Expect(SHAPE, torch.float32)).result(timeout=90).ok
        old, _ = _grant_with_receipt(procs, "old", 21)
        assert procs.ask(procs.owner, "drop", "old")  # released early (TTL, say): the slot goes back to the pool
        _, newer = _grant_with_receipt(procs, "new", 22)  # another item takes the freed slot
        res = fetcher.start(old, "k1", Expect(SHAPE, torch.float32)).result(timeout=90)
        # The read from the stale receipt fails its generation check; the lookup then says the item is gone.
        assert not res.ok and res.reason is Reason.NOT_HELD, res
        assert _counted(metrics.receipts, "read_failed") == 1
        assert fetcher.load_ref("k1") is None and fetcher.load_ref("k1.l") is None
    finally:
        fetcher.close()


def test_a_receipt_pointing_at_another_items_slot_is_not_read_as_this_item(procs: StoreProcs) -> None:
    """A forged receipt: this item's grant, another item's slot address, with a guessed generation, with this
    item's own (real) generation word and value, or with the binding removed. The binding ties a generation to
    its slot's address, so each is refused before anything is read (``invalid``); the lookup then delivers this
    item's own bytes."""
    import dataclasses

    from tensorwire.mm._proto import encoder_pb2 as epb
    from tensorwire.rdma import Descriptor

    fetcher, metrics, _ = _host_fetcher()
    try:
        intro, _ = _grant_with_receipt(procs, "intro", 30)
        assert fetcher.start(intro, "k0", Expect(SHAPE, torch.float32)).result(timeout=90).ok
        theirs, other = _grant_with_receipt(procs, "theirs", 32)
        assert theirs.receipt is not None
        d_theirs = Descriptor.from_bytes(epb.EncodeResponse.FromString(theirs.receipt).rdma_slots[0].descriptor)
        forgeries = ("guess+0", "guess+1", "guess^1", "own word", "unbound")
        for i, how in enumerate(forgeries):
            mine, want = _grant_with_receipt(procs, f"mine-{i}", 40 + i)
            assert mine.receipt is not None
            r_mine = epb.EncodeResponse.FromString(mine.receipt)
            d_mine = Descriptor.from_bytes(r_mine.rdma_slots[0].descriptor)
            if how.startswith("guess"):
                guess = {"guess+0": d_mine.generation, "guess+1": d_mine.generation + 1}.get(how)
                forged = dataclasses.replace(
                    d_mine,
                    slot_addr=d_theirs.slot_addr,
                    generation_addr=d_theirs.generation_addr,
                    generation=d_theirs.generation ^ 1 if guess is None else guess,
                )
            else:  # this item's generation word and value, pointed at their slot
                forged = dataclasses.replace(
                    d_mine, slot_addr=d_theirs.slot_addr, binding=d_mine.binding if how == "own word" else 0
                )
            r_mine.rdma_slots[0].descriptor = forged.to_bytes()
            grant = dataclasses.replace(mine, receipt=r_mine.SerializeToString())
            res = fetcher.start(grant, f"k-{i}", Expect(SHAPE, torch.float32)).result(timeout=90)
            assert res.ok, res
            got = _staged(fetcher, res.staging_key)
            assert torch.equal(got, want) and not torch.equal(got, other)
        assert _counted(metrics.receipts, "invalid") == len(forgeries)
        assert _counted(metrics.receipts, "read_failed") == 0 and _counted(metrics.receipts, "used") == 0
    finally:
        fetcher.close()


def test_every_rank_reads_from_the_receipt_with_no_lookup(procs: StoreProcs) -> None:
    """Ranks in other processes (GPU workers' layout): a fetch thread hands the params' receipt to every rank."""
    metrics = ECMetrics(CollectorRegistry())
    stagers = [RemoteStager(f"unix:{s}", f"tp{i}") for i, s in enumerate(procs.socks)]
    fetcher = Fetcher(ECConfig(host="127.0.0.1", fetch_timeout_ms=60000, lookup_timeout_ms=10000), stagers, metrics)
    try:
        intro, _ = _grant_with_receipt(procs, "intro", 50)
        assert fetcher.start(intro, "k0", Expect(SHAPE, torch.float32)).result(timeout=90).ok
        lookups = procs.ask(procs.owner, "lookups")
        grant, want = _grant_with_receipt(procs, "item", 51)
        res = fetcher.start(grant, "k1", Expect(SHAPE, torch.float32)).result(timeout=90)
        assert res.ok and res.nbytes == 2 * want.numel() * 4, res
        for r in procs.ranks:
            _, got = procs.ask(r, "get", "k1")
            assert torch.equal(got, want)
        assert procs.ask(procs.owner, "lookups") == lookups and _counted(metrics.receipts, "used") == 1
        wait_until(lambda: procs.ask(procs.owner, "stats") == (0, 0), "the grant did not go back after both ranks")
    finally:
        fetcher.close()
