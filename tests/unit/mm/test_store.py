"""HeldStore (grants, holds, lookups, releases, TTL) and StagingArea, over the in-memory rdma fakes.

The fakes mint real Descriptors (the wire form and validation run) but keep bytes in a table; NIXL reads across
processes are covered by tests/integration/mm/test_store_processes.py.
"""

from __future__ import annotations

import pytest
import torch
from fakes import FakeExporter, FakeFabric, FakeReader

from tensorwire.errors import ClosedError, InvalidPayload, LeaseExpired, ProtocolError, Reason
from tensorwire.mm._proto import encoder_pb2 as pb
from tensorwire.mm.held._rpc import receipt_for
from tensorwire.mm.held._staging import Expect, StagingArea
from tensorwire.mm.held._store import HeldStore, new_secret
from tensorwire.rdma import RdmaConfig


class Clock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


@pytest.fixture
def fabric() -> FakeFabric:
    return FakeFabric()


@pytest.fixture
def clock() -> Clock:
    return Clock()


@pytest.fixture
def store(fabric: FakeFabric, clock: Clock) -> HeldStore:
    return HeldStore(FakeExporter(fabric, RdmaConfig(provider="none")), ttl_s=60.0, clock=clock)  # type: ignore[arg-type]


def test_secrets_are_128_random_bits() -> None:
    a, b = new_secret(), new_secret()
    assert len(a) == 16 and a != b


def test_grant_before_hold_then_lookup_and_release_ends_the_lease(store: HeldStore, fabric: FakeFabric) -> None:
    s = new_secret()
    store.grant("h", s)
    assert store.stats().pending_grants == 1
    x = torch.arange(12.0).reshape(3, 4)
    assert store.hold("h", [x])
    assert store.stats().pending_grants == 0 and store.stats().grants == 1
    item = store.lookup("h", s)
    assert item.is_rdma and item.shapes == ((3, 4),) and item.dtypes == (torch.float32,)
    assert fabric.live() == {item.descriptor.lease_id}
    assert store.release("h", s) is True
    assert fabric.live() == set() and item.descriptor.lease_id in fabric.released
    assert store.release("h", s) is False  # idempotent
    with pytest.raises(LeaseExpired) as e:
        store.lookup("h", s)
    assert e.value.reason is Reason.NOT_HELD


def test_wrong_secret_and_unknown_key_look_the_same(store: HeldStore) -> None:
    s = new_secret()
    store.grant("h", s)
    store.hold("h", [torch.zeros(2)])
    errors = []
    for key, secret in (("h", new_secret()), ("nope", s)):
        with pytest.raises(LeaseExpired) as e:
            store.lookup(key, secret)
        errors.append(str(e.value).split("key")[0])
    assert errors[0] == errors[1]
    assert store.stats().lookup_misses == 2


def test_last_of_several_grants_releases(store: HeldStore, fabric: FakeFabric) -> None:
    s1, s2 = new_secret(), new_secret()
    store.grant("h", s1)
    store.hold("h", [torch.ones(4)])
    store.grant("h", s2)  # on the held item
    store.release("h", s1)
    assert store.holds("h") and len(fabric.live()) == 1
    store.lookup("h", s2)
    store.release("h", s2)
    assert not store.holds("h") and fabric.live() == set()


def test_hold_twice_keeps_the_first_export(store: HeldStore, fabric: FakeFabric) -> None:
    assert store.hold("h", [torch.ones(4)])
    assert not store.hold("h", [torch.zeros(4)])
    assert len(fabric.exported) == 1


def test_ttl_drops_items_and_pending_grants(store: HeldStore, fabric: FakeFabric, clock: Clock) -> None:
    s = new_secret()
    store.grant("h", s)
    store.grant("other", new_secret())
    store.hold("h", [torch.ones(4)])
    clock.t += 59.0
    assert store.holds("h") and store.stats().pending_grants == 1
    clock.t += 1.0
    assert store.expire() == 1
    st = store.stats()
    assert st.held_items == 0 and st.pending_grants == 0 and st.expired_items == 1 and st.expired_grants == 1
    assert fabric.live() == set()
    with pytest.raises(LeaseExpired):
        store.lookup("h", s)


def test_bad_grants_are_refused(store: HeldStore) -> None:
    with pytest.raises(InvalidPayload):
        store.grant("h", b"short")
    with pytest.raises(InvalidPayload):
        store.lookup("", new_secret())
    with pytest.raises(InvalidPayload):
        store.hold("h", [])


def test_close_releases_everything_and_refuses_more(store: HeldStore, fabric: FakeFabric) -> None:
    store.hold("a", [torch.ones(2)])
    store.hold("b", [torch.ones(2)])
    store.close()
    assert fabric.live() == set()
    store.close()
    with pytest.raises(ClosedError):
        store.hold("c", [torch.ones(2)])
    assert store.release("a", new_secret()) is False


def test_on_change_reports_items_and_bytes(fabric: FakeFabric, clock: Clock) -> None:
    seen: list[tuple[int, int]] = []
    st = HeldStore(
        FakeExporter(fabric, RdmaConfig(provider="none")),
        ttl_s=10,
        clock=clock,  # type: ignore[arg-type]
        on_change=lambda i, b: seen.append((i, b)),
    )
    s = new_secret()
    st.grant("h", s)
    st.hold("h", [torch.ones(4)])
    st.release("h", s)
    assert seen == [(1, 16), (0, 0)]


def test_inline_store_and_staging_round_trip(clock: Clock) -> None:
    st = HeldStore(None, clock=clock)
    s = new_secret()
    x = torch.randn(5, 3)
    st.grant("h", s)
    st.hold("h", [x, torch.arange(3)])
    item = st.lookup("h", s)
    assert not item.is_rdma
    receipt = receipt_for(item, rdma=True)  # asked for RDMA, but the store only has host copies
    assert not receipt.rdma_slots and list(receipt.split_sizes) == [5]
    area = StagingArea(None)
    assert area.stage("k", receipt, timeout_ms=100, expect=Expect((5, 3), torch.float32)) == 5 * 3 * 4 + 3 * 8
    got = area.get("k")
    assert got is not None and torch.equal(got[0], x) and torch.equal(got[1], torch.arange(3))
    with pytest.raises(ProtocolError) as e:
        area.stage("k2", receipt, timeout_ms=100, expect=Expect((4, 3), None))
    assert e.value.reason is Reason.RESULT_MISMATCH and area.get("k2") is None


def test_staging_reads_rdma_receipts_and_checks_them(store: HeldStore, fabric: FakeFabric) -> None:
    s = new_secret()
    x = torch.randn(4, 8)
    store.grant("h", s)
    store.hold("h", [x])
    receipt = receipt_for(store.lookup("h", s), rdma=True)
    assert list(receipt.rdma_slots[0].roles) == [pb.EMBEDDING]
    area = StagingArea(lambda: FakeReader(fabric, RdmaConfig(provider="none")))  # type: ignore[arg-type,return-value]
    with pytest.raises(ProtocolError):
        area.stage("k", receipt, timeout_ms=100, expect=Expect((4, 8), torch.bfloat16))
    assert fabric.reads == []  # checked before anything was read
    area.stage("k", receipt, timeout_ms=100, expect=Expect((4, 8), torch.float32))
    assert torch.equal(area.get("k")[0], x)  # type: ignore[index]
    bad = pb.EncodeResponse()
    bad.CopyFrom(receipt)
    bad.rdma_slots[0].roles[:] = [pb.POS_ID]
    with pytest.raises(ProtocolError):
        area.stage("k3", bad, timeout_ms=100)
    store.release("h", s)
    with pytest.raises(LeaseExpired):
        area.stage("k4", receipt, timeout_ms=100)
    assert area.drop(["k", "k4"]) == 1
    st = area.stats()
    assert st.stages == 1 and st.stage_failures == 3 and st.staged_items == 0


def test_staging_without_a_reader_refuses_rdma_receipts(store: HeldStore) -> None:
    s = new_secret()
    store.grant("h", s)
    store.hold("h", [torch.ones(2)])
    area = StagingArea(None)
    with pytest.raises(Exception) as e:
        area.stage("k", receipt_for(store.lookup("h", s), rdma=True), timeout_ms=100)
    assert getattr(e.value, "reason", None) is Reason.PROVIDER_UNAVAILABLE
