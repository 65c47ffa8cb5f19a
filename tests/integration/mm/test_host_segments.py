"""Same-host hand-over by mapping (``same_host_map``): the owner's store keeps each host item in a memfd too, and
an LLM instance's stager on the same host maps that memfd instead of reading the slot. Real processes: the owner
(TensorExporter + HeldStore with host segments, gRPC) is a child of this test process, which plays the LLM
instance's scheduler (and, through ``map_segment``, its workers).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from _store_procs import StoreProcs
from prometheus_client import CollectorRegistry

from tensorwire.errors import Reason
from tensorwire.integrations._vllm_ec import fetch as fetch_module
from tensorwire.integrations._vllm_ec.config import ECConfig
from tensorwire.integrations._vllm_ec.fetch import Fetcher, LocalStager
from tensorwire.integrations._vllm_ec.metrics import ECMetrics
from tensorwire.integrations._vllm_ec.params import ItemGrant
from tensorwire.integrations._vllm_ec.receipts import parse_receipt
from tensorwire.integrations._vllm_ec.segments import SegmentRef, SegmentStager, map_segment
from tensorwire.mm._proto import encoder_pb2 as pb
from tensorwire.mm.held._staging import Expect, StagingArea
from tensorwire.mm.held._store import new_secret
from tensorwire.rdma import Descriptor, RdmaConfig, TensorReader

pytestmark = [pytest.mark.timeout(240)]
SHAPE = (256, 1024)  # 1 MiB of float32
EXPECT = Expect(SHAPE, torch.float32)


@pytest.fixture
def procs(tmp_path: Path, require_nixl: None) -> Any:
    p = StoreProcs(tmp_path, "cpu", [], SHAPE, torch.float32, segments=True)
    yield p
    p.close()


def _eventually(cond: Callable[[], bool], what: str, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not cond():
        assert time.monotonic() < deadline, what
        time.sleep(0.05)


def _fetcher(stager: Any) -> Fetcher:
    cfg = ECConfig(host="127.0.0.1", fetch_timeout_ms=60000, lookup_timeout_ms=10000)
    return Fetcher(cfg, [stager], ECMetrics(CollectorRegistry()))


def _grant(procs: StoreProcs, key: str, seed: int, *, receipt: bool = True) -> tuple[ItemGrant, torch.Tensor]:
    secret = new_secret()
    want = procs.ask(procs.owner, "hold", key, secret, seed)
    data = procs.ask(procs.owner, "receipt", key) if receipt else None
    return ItemGrant(procs.endpoint, key, secret, SHAPE, "float32", receipt=data), want


def _introduced(procs: StoreProcs, seed: int) -> tuple[SegmentStager, Fetcher]:
    """A mapping host stager and its fetcher, with the owner met through one looked-up item (mapped)."""
    stager = SegmentStager(lambda: TensorReader(RdmaConfig()), map_host=True)
    fetcher = _fetcher(stager)
    intro, _ = _grant(procs, "intro", seed)
    assert fetcher.start(intro, "k0", EXPECT).result(timeout=90).ok
    return stager, fetcher


def _with_segment(grant: ItemGrant, edit: Callable[[pb.HostSegment], None]) -> ItemGrant:
    assert grant.receipt is not None
    r = pb.EncodeResponse.FromString(grant.receipt)
    assert r.HasField("host_segment"), "the owner's receipt names its host segment"
    edit(r.host_segment)
    return ItemGrant(grant.endpoint, grant.key, grant.secret, SHAPE, "float32", receipt=r.SerializeToString())


def test_the_host_stager_maps_the_owners_segment_and_the_ranks_keep_it_after_the_owner_lets_go(
    procs: StoreProcs,
) -> None:
    stager = SegmentStager(lambda: TensorReader(RdmaConfig()), map_host=True)
    fetcher = _fetcher(stager)
    try:
        kept = []
        for i in range(3):  # the first is looked up (it introduces the owner), the others come from params
            grant, want = _grant(procs, f"item-{i}", 10 + i)
            res = fetcher.start(grant, f"k{i}", EXPECT).result(timeout=90)
            assert res.ok and res.nbytes == want.numel() * 4, res
            ref = fetcher.load_ref(f"k{i}")
            assert isinstance(ref, SegmentRef)
            kept.append((map_segment(ref), want))  # what a rank's encoder cache holds
        assert stager.mapped == 3 and stager.area.stats().rdma_stages == 0  # nothing was read
        # Every grant went back; the owner closed its segments (only its spares made ahead stay open) ...
        _eventually(lambda: procs.ask(procs.owner, "stats") == (0, 0), "the owner still holds an item")

        def items_segments_closed() -> bool:
            # Each open segment shows twice (its descriptor and the mapping's own); the spares made ahead stay
            # open, and so may the last item the harness peeked at (its mapping), nothing else.
            spares = procs.ask(procs.owner, "spare_bytes") // (SHAPE[0] * SHAPE[1] * 4)
            return bool(procs.ask(procs.owner, "segment_fds") <= 2 * spares + 1)

        _eventually(items_segments_closed, "the owner kept its items' segments open")
        fetcher.drop_async([f"k{i}" for i in range(3)])
        _eventually(lambda: stager.staged == 0, "the stager kept a dropped item")
        for got, want in kept:  # ... and the ranks' tensors keep their bytes
            assert torch.equal(got, want)
    finally:
        fetcher.close()


def test_the_uniproc_rank_maps_the_owners_segment(procs: StoreProcs) -> None:
    area = StagingArea(lambda: TensorReader(RdmaConfig()))
    stager = LocalStager(area, map_host=True)
    fetcher = _fetcher(stager)
    try:
        kept = []
        for i in range(2):
            grant, want = _grant(procs, f"u-{i}", 20 + i)
            res = fetcher.start(grant, f"u{i}", EXPECT).result(timeout=90)
            assert res.ok, res
            staged = area.get(f"u{i}")
            assert staged is not None
            kept.append((staged[0], want))
        assert stager.mapped == 2 and area.stats().put_items == 2 and area.stats().rdma_stages == 0
        _eventually(lambda: procs.ask(procs.owner, "stats") == (0, 0), "the owner still holds an item")
        fetcher.drop_async(["u0", "u1"])
        _eventually(lambda: not area.keys(), "the area kept a dropped item")
        for got, want in kept:
            assert torch.equal(got, want)
    finally:
        fetcher.close()
        area.close()


def test_an_edited_segment_in_the_params_is_read_instead_and_delivers_this_item(procs: StoreProcs) -> None:
    """The params are relayed by clients: a host segment renamed, pointed at another item's memfd, or at a file
    of the owner that is no memfd, is not mapped; the slot is read, and its generation check vouches for it."""
    stager, fetcher = _introduced(procs, 30)
    try:
        other, _ = _grant(procs, "other", 31)
        assert other.receipt is not None
        theirs = pb.EncodeResponse.FromString(other.receipt).host_segment

        def renamed(hs: pb.HostSegment) -> None:
            hs.name = hs.name[:-4] + "0000"

        def their_fd(hs: pb.HostSegment) -> None:
            hs.fd = theirs.fd  # another item's memfd under this item's name

        def their_segment(hs: pb.HostSegment) -> None:
            hs.fd, hs.name = theirs.fd, theirs.name  # another item's memfd, as the other receipt names it

        def not_a_memfd(hs: pb.HostSegment) -> None:
            hs.fd = 0

        edits = (renamed, their_fd, not_a_memfd)
        for i, edit in enumerate(edits):
            grant, want = _grant(procs, f"mine-{i}", 40 + i)
            res = fetcher.start(_with_segment(grant, edit), f"m{i}", EXPECT).result(timeout=90)
            ref = fetcher.load_ref(res.staging_key)
            assert res.ok and isinstance(ref, SegmentRef) and torch.equal(map_segment(ref), want), (edit, res)
        assert stager.mapped == 1 and stager.area.stats().rdma_stages == len(edits)  # the intro mapped, each edit read
        # Naming the other item's segment whole is mapping that item: what a holder of both receipts can do anyway
        # with the descriptors; its size and layout still have to fit this item's.
        grant, _ = _grant(procs, "mine-x", 49)
        res = fetcher.start(_with_segment(grant, their_segment), "mx", EXPECT).result(timeout=90)
        assert res.ok and stager.mapped == 2
    finally:
        fetcher.close()


def test_a_met_owners_item_is_mapped_from_the_segments_layout_without_parsing_its_descriptor(
    procs: StoreProcs, monkeypatch: pytest.MonkeyPatch
) -> None:
    area = StagingArea(lambda: TensorReader(RdmaConfig()))
    fetcher = _fetcher(LocalStager(area, map_host=True))
    try:
        intro, _ = _grant(procs, "intro", 70)
        assert fetcher.start(intro, "u0", EXPECT).result(timeout=90).ok  # looked up: the owner's pid is learned
        grant, want = _grant(procs, "fast", 71)
        assert grant.receipt is not None
        hs = pb.EncodeResponse.FromString(grant.receipt).host_segment
        assert list(hs.shape) == list(SHAPE) and hs.dtype == "float32" and hs.offset == 0
        parsed: list[bytes] = []
        real = Descriptor.from_bytes.__func__  # type: ignore[attr-defined]

        def counted(cls: type, data: bytes, **kw: Any) -> Descriptor:
            parsed.append(bytes(data))
            return real(cls, data, **kw)

        monkeypatch.setattr(Descriptor, "from_bytes", classmethod(counted))
        res = fetcher.start(grant, "u1", EXPECT).result(timeout=0)  # answered within start
        staged = area.get("u1")
        assert res.ok and res.plane == "map" and staged is not None and torch.equal(staged[0], want), res
        assert parsed == []
        _eventually(lambda: procs.ask(procs.owner, "stats") == (0, 0), "the grant did not go back")
    finally:
        fetcher.close()
        area.close()


def test_an_edited_layout_in_the_params_takes_the_descriptors_path(
    procs: StoreProcs, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A layout that does not fit the segment or what this instance expects is not mapped as announced: the
    descriptor's path decides (it maps the segment as the descriptor lays it out, or reads), with the receipt
    parsed once for both."""
    stager, fetcher = _introduced(procs, 80)
    parses: list[int] = []

    def counted(raw: bytes) -> Any:
        parses.append(len(raw))
        return parse_receipt(raw)

    monkeypatch.setattr(fetch_module, "parse_receipt", counted)
    try:

        def rows(hs: pb.HostSegment) -> None:
            hs.shape[0] = SHAPE[0] - 1

        def past_the_end(hs: pb.HostSegment) -> None:
            hs.offset = hs.nbytes

        def unaligned(hs: pb.HostSegment) -> None:
            hs.offset = 2

        def dtype(hs: pb.HostSegment) -> None:
            hs.dtype = "complex128"

        def no_layout(hs: pb.HostSegment) -> None:
            del hs.shape[:]

        edits = (rows, past_the_end, unaligned, dtype, no_layout)
        for i, edit in enumerate(edits):
            grant, want = _grant(procs, f"lay-{i}", 81 + i)
            res = fetcher.start(_with_segment(grant, edit), f"l{i}", EXPECT).result(timeout=90)
            ref = fetcher.load_ref(res.staging_key)
            assert res.ok and isinstance(ref, SegmentRef) and torch.equal(map_segment(ref), want), (edit, res)
            assert ref.offset == 0 and ref.shape == SHAPE, edit
        assert len(parses) == len(edits), parses
    finally:
        fetcher.close()


def test_a_segment_of_an_item_the_owner_let_go_is_never_mapped(procs: StoreProcs) -> None:
    stager, fetcher = _introduced(procs, 50)
    try:
        gone, _ = _grant(procs, "gone", 51)
        assert procs.ask(procs.owner, "drop", "gone")  # released early (TTL, say): its segment is closed
        for i in range(3):  # later items may get the closed descriptor number
            _grant(procs, f"later-{i}", 52 + i)
        res = fetcher.start(gone, "k1", EXPECT).result(timeout=90)
        assert not res.ok and res.reason is Reason.NOT_HELD, res
        assert stager.mapped == 1 and fetcher.load_ref("k1") is None and fetcher.load_ref("k1.l") is None
    finally:
        fetcher.close()


def test_without_map_host_the_stager_reads_the_slot(procs: StoreProcs) -> None:
    stager = SegmentStager(lambda: TensorReader(RdmaConfig()))
    fetcher = _fetcher(stager)
    try:
        for i in range(2):
            grant, want = _grant(procs, f"r-{i}", 60 + i, receipt=i > 0)
            res = fetcher.start(grant, f"r{i}", EXPECT).result(timeout=90)
            ref = fetcher.load_ref(f"r{i}")
            assert res.ok and isinstance(ref, SegmentRef) and torch.equal(map_segment(ref), want), res
        assert stager.mapped == 0 and stager.area.stats().rdma_stages == 2
    finally:
        fetcher.close()
