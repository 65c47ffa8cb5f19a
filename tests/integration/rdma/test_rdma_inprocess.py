"""Exporter/reader behaviour with real NIXL agents (owner and reader agents in one process, CMA loopback).

Cross-process claims live in test_rdma_two_process.py; these cover the exporter's rules quickly.
"""

from __future__ import annotations

import threading
import time

import pytest
import torch
from _nixl_stats import nixl_stats

from tensorwire.errors import ClosedError, ExportError, LeaseExpired, PoolExhausted, ReadError, ReadTimeout, Reason
from tensorwire.rdma import SUPPORTED_DTYPES, Descriptor, RdmaConfig, TensorExporter, TensorReader
from tensorwire.testing import make_tensor, same_bytes

pytestmark = [pytest.mark.usefixtures("require_nixl"), pytest.mark.timeout(120)]

# Every read here goes through NIXL (these tests are about its READ); test_rdma_same_host_copy.py covers the copy.
CFG = RdmaConfig(provider="nixl", bind_ip="127.0.0.1", read_timeout_ms=5000, same_host_copy=0)


@pytest.fixture(scope="module")
def reader() -> TensorReader:
    with TensorReader(CFG) as rd:
        yield rd


@pytest.fixture
def exporter() -> TensorExporter:
    with TensorExporter(CFG) as exp:
        yield exp


def test_every_dtype_round_trips_byte_for_byte(exporter: TensorExporter, reader: TensorReader) -> None:
    inputs = [make_tensor((3, 7), dt, seed=i) for i, dt in enumerate(SUPPORTED_DTYPES)]
    d = exporter.export(inputs)
    assert len(d.manifest) == len(inputs)
    assert all(m.offset % CFG.slot_align == 0 for m in d.manifest)
    out = reader.read([Descriptor.from_bytes(d.to_bytes())])
    assert len(out) == len(inputs)
    for a, b in zip(inputs, out, strict=True):
        assert same_bytes(a, b)


def test_inputs_may_be_dropped_or_mutated_after_export(exporter: TensorExporter, reader: TensorReader) -> None:
    t = make_tensor((1024,), "float32", seed=1)
    expected = t.clone()
    d = exporter.export([t])
    t.fill_(0)
    del t
    assert same_bytes(reader.read([d])[0], expected)


def test_non_contiguous_is_made_contiguous(exporter: TensorExporter, reader: TensorReader) -> None:
    t = make_tensor((16, 8), "int32", seed=2).t()
    assert not t.is_contiguous()
    out = reader.read([exporter.export([t])])[0]
    assert same_bytes(out, t.contiguous())


def test_flattened_in_descriptor_then_manifest_order(exporter: TensorExporter, reader: TensorReader) -> None:
    groups = [[make_tensor((i + 1, j + 2), "float16", seed=10 * i + j) for j in range(3)] for i in range(3)]
    descs = exporter.export_batch(groups)
    out = reader.read(descs)
    assert len(out) == 9
    for got, want in zip(out, [t for g in groups for t in g], strict=True):
        assert same_bytes(got, want)


def test_results_outlive_lease_and_reader(exporter: TensorExporter) -> None:
    big = make_tensor((8 << 20,), "uint8", seed=3)  # takes the loaned-buffer path
    small = make_tensor((100,), "float64", seed=4)
    rd = TensorReader(CFG)
    d1, d2 = exporter.export([big]), exporter.export([small])
    out = rd.read([d1, d2])
    exporter.release([d1.lease_id, d2.lease_id])
    rd.close()
    exporter.export([torch.zeros(8 << 20, dtype=torch.uint8)])  # reuse the slot with other bytes
    assert same_bytes(out[0], big) and same_bytes(out[1], small)


@pytest.mark.parametrize("nbytes", [6 << 20, 1 << 20, 256 << 10])
def test_loaned_buffers_return_when_results_die(exporter: TensorExporter, reader: TensorReader, nbytes: int) -> None:
    # 1 MiB and 256 KiB too: the fixed-cost fetch reads into a loan instead of cloning out of a pooled buffer.
    src = make_tensor((nbytes,), "uint8", seed=5)
    d = exporter.export([src])
    before = reader.stats().loans.busy_slots
    out = reader.read([d])
    assert reader.stats().loans.busy_slots == before + 1
    assert same_bytes(out[0], src)
    del out
    assert reader.stats().loans.busy_slots == before
    allocs = reader.stats().loans.pool_bytes
    reader.read([d])
    assert reader.stats().loans.pool_bytes == allocs  # reused, not reallocated


def test_small_reads_are_cloned_not_loaned(exporter: TensorExporter, reader: TensorReader) -> None:
    # Below LOAN_READ_BYTES a loan would pin a whole bucket for a few bytes: the result is a clone.
    src = make_tensor(((256 << 10) - 4096,), "uint8", seed=6)
    d = exporter.export([src])
    before = reader.stats().loans.busy_slots
    out = reader.read([d])
    assert reader.stats().loans.busy_slots == before
    exporter.release([d.lease_id])
    exporter.export([torch.zeros(256 << 10, dtype=torch.uint8)])  # the owner slot reused with other bytes
    reader.read([exporter.export([torch.ones(256 << 10, dtype=torch.uint8)])])  # and the reader's buffer
    assert same_bytes(out[0], src)


@pytest.mark.parametrize(
    "tensors,reason",
    [
        ([], Reason.EMPTY_EXPORT),
        ([torch.zeros(2, dtype=torch.complex64)], Reason.UNSUPPORTED_DTYPE),
        ([torch.zeros(2), "x"], Reason.EXPORT_FAILED),
        ([torch.zeros(2).to_sparse()], Reason.NOT_CONTIGUOUS),
        ([torch.zeros(2, device="meta")], Reason.MIXED_DEVICES),
    ],
    ids=["empty", "complex", "not-a-tensor", "sparse", "mixed-devices"],
)
def test_bad_inputs_are_rejected_with_a_reason(exporter: TensorExporter, tensors: list, reason: Reason) -> None:
    if reason is Reason.MIXED_DEVICES:
        tensors = [torch.zeros(2), *tensors]
    with pytest.raises(ExportError) as info:
        exporter.export(tensors)
    assert info.value.reason is reason
    assert exporter.stats().live_leases == 0


def test_wrong_device_rejected(exporter: TensorExporter) -> None:
    with pytest.raises(ExportError) as info:
        exporter.export([torch.zeros(2, device="meta")])
    assert info.value.reason is Reason.WRONG_DEVICE


def test_slot_too_large() -> None:
    with TensorExporter(CFG.replace(max_slot_bytes=64 << 10)) as exp:
        with pytest.raises(ExportError) as info:
            exp.export([torch.zeros(40 << 10, dtype=torch.uint8), torch.zeros(30 << 10, dtype=torch.uint8)])
        assert info.value.reason is Reason.SLOT_TOO_LARGE


def test_batch_rolls_back_when_the_middle_group_fails(exporter: TensorExporter) -> None:
    groups = [[torch.ones(4)], [torch.zeros(2, dtype=torch.complex64)], [torch.ones(4)]]
    with pytest.raises(ExportError):
        exporter.export_batch(groups)
    st = exporter.stats()
    assert st.live_leases == 0 and st.pool.busy_slots == 0 and st.batch_rollbacks == 1


def test_batch_rolls_back_when_the_middle_group_raises(
    exporter: TensorExporter, monkeypatch: pytest.MonkeyPatch
) -> None:
    calls = {"n": 0}
    original = exporter._copy_in

    def flaky(lease, inputs):  # type: ignore[no-untyped-def]
        calls["n"] += 1
        if calls["n"] == 2:
            raise KeyboardInterrupt("interrupted mid-batch")
        return original(lease, inputs)

    monkeypatch.setattr(exporter, "_copy_in", flaky)
    with pytest.raises(KeyboardInterrupt):
        exporter.export_batch([[torch.ones(4)], [torch.ones(4)], [torch.ones(4)]])
    st = exporter.stats()
    assert st.live_leases == 0 and st.pool.busy_slots == 0 and st.releases == 1


def test_release_is_idempotent_and_counts_unknown(exporter: TensorExporter) -> None:
    d = exporter.export([torch.ones(4)])
    exporter.release([d.lease_id])
    exporter.release([d.lease_id, "never-issued"])
    exporter.release(d.lease_id)  # a bare string is one id, not characters
    st = exporter.stats()
    assert st.releases == 1 and st.unknown_releases == 3 and st.live_leases == 0


def test_lease_ids_are_unique(exporter: TensorExporter) -> None:
    with TensorExporter(CFG) as other:
        ids = {exporter.export([torch.ones(1)]).lease_id for _ in range(50)}
        ids |= {other.export([torch.ones(1)]).lease_id for _ in range(50)}
    assert len(ids) == 100


def test_stale_generation_after_release_and_reuse(exporter: TensorExporter, reader: TensorReader) -> None:
    d_old = exporter.export([torch.full((256,), 1.0)])
    exporter.release([d_old.lease_id])
    d_new = exporter.export([torch.full((256,), 2.0)])
    assert d_new.slot_addr == d_old.slot_addr and d_new.generation != d_old.generation  # same slot, new tenant
    with pytest.raises(LeaseExpired) as info:
        reader.read([d_old])
    assert info.value.reason is Reason.STALE_GENERATION
    assert torch.equal(reader.read([d_new])[0], torch.full((256,), 2.0))


def test_gc_reclaims_unreleased_leases(reader: TensorReader) -> None:
    with TensorExporter(CFG.replace(slot_gc_timeout_ms=200)) as exp:
        d = exp.export([torch.ones(64)])
        end = time.monotonic() + 10
        while exp.stats().gc_reclaims == 0 and time.monotonic() < end:
            time.sleep(0.05)
        st = exp.stats()
        assert st.gc_reclaims == 1 and st.live_leases == 0 and st.pool.busy_slots == 0
        with pytest.raises(LeaseExpired):
            reader.read([d])
        exp.release([d.lease_id])
        assert exp.stats().unknown_releases == 1


def test_shrink_sequence_and_pool_exhausted_through_the_exporter() -> None:
    cfg = CFG.replace(pool_cap_bytes=256 << 10, max_slot_bytes=256 << 10)
    with TensorExporter(cfg) as exp:
        small = [exp.export([torch.zeros(16 << 10, dtype=torch.uint8)]) for _ in range(8)]  # 128 KiB
        exp.release([d.lease_id for d in small])
        held = exp.export([torch.zeros(128 << 10, dtype=torch.uint8)])  # fits beside the idle ones
        assert exp.stats().pool.shrinks == 0
        exp.release([held.lease_id])
        big = exp.export([torch.zeros(256 << 10, dtype=torch.uint8)])  # needs every idle slot gone
        st = exp.stats()
        assert st.pool.shrinks == 2 and st.pool.idle_slots == 0
        with pytest.raises(PoolExhausted):
            exp.export([torch.zeros(1, dtype=torch.uint8)])
        assert exp.stats().pool.pool_exhausted == 1
        with TensorReader(cfg) as rd:  # the busy slot was never touched
            assert rd.read([big])[0].shape == (256 << 10,)


def test_allocate_then_export_allocated(exporter: TensorExporter, reader: TensorReader) -> None:
    lease, (a, b) = exporter.allocate([((4, 4), torch.bfloat16), ((3,), torch.int64)])
    a.copy_(torch.arange(16).reshape(4, 4).to(torch.bfloat16))
    b.copy_(torch.tensor([7, 8, 9]))
    d = exporter.export_allocated(lease)
    assert d.lease_id == lease.lease_id
    out = reader.read([d])
    assert torch.equal(out[0], a) and torch.equal(out[1], b)
    with pytest.raises(ExportError):
        exporter.export_allocated(lease)
    exporter.release([lease.lease_id])
    with pytest.raises(ExportError):
        exporter.export_allocated(lease)


def test_concurrent_reads_from_threads(exporter: TensorExporter, reader: TensorReader) -> None:
    inputs = [make_tensor((2048 + i,), "float32", seed=100 + i) for i in range(8)]
    descs = [exporter.export([t]) for t in inputs]
    errors: list[BaseException] = []

    def worker(k: int) -> None:
        try:
            for r in range(20):
                i = (k + r) % len(descs)
                assert same_bytes(reader.read([descs[i]])[0], inputs[i])
        except BaseException as exc:  # reported below
            errors.append(exc)

    threads = [threading.Thread(target=worker, args=(k,)) for k in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert not any(t.is_alive() for t in threads)
    assert not errors, errors


def test_unknown_owner_endpoint_is_a_read_error(exporter: TensorExporter, reader: TensorReader) -> None:
    import dataclasses

    d = exporter.export([torch.ones(4)])
    bad = dataclasses.replace(d, owner=dataclasses.replace(d.owner, agent_name="tw-someone-else"))
    with pytest.raises(ReadError) as info:
        reader.read([bad])
    assert info.value.reason is Reason.METADATA_UNAVAILABLE


def test_bad_remote_address_is_a_read_error(exporter: TensorExporter, reader: TensorReader) -> None:
    import dataclasses

    d = exporter.export([torch.ones(4)])
    reader.read([d])
    # Unbound (as from an owner that predates bindings): with one, the edit is refused before any READ
    # (test_rdma_same_host_copy.py); here NIXL itself must refuse the unregistered address.
    bad = dataclasses.replace(d, slot_addr=d.slot_addr + (1 << 40), binding=0)
    with pytest.raises(ReadError):
        reader.read([bad])
    assert reader.read([d])[0].sum() == 4  # the reader still works for that owner


def test_closed_objects_raise_closed_error() -> None:
    exp = TensorExporter(CFG)
    rd = TensorReader(CFG)
    d = exp.export([torch.ones(1)])
    exp.close()
    exp.close()
    rd.close()
    rd.close()
    with pytest.raises(ClosedError):
        exp.export([torch.ones(1)])
    with pytest.raises(ClosedError):
        rd.read([d])


def test_read_timeout_zero(exporter: TensorExporter, reader: TensorReader) -> None:
    d = exporter.export([torch.ones(1)])
    with pytest.raises(ReadTimeout):
        reader.read([d], timeout_ms=0)


def test_transport_is_reported(exporter: TensorExporter, reader: TensorReader) -> None:
    d = exporter.export([torch.ones(1)])
    reader.read([d])
    assert reader.stats().provider_stats.transport != ""
    # On this CPU machine UCX reads host memory with CMA; elsewhere it may differ, but it must be detected.
    assert reader.transport(d) != "unknown"


def test_mutated_descriptor_bytes_never_crash_a_read(exporter: TensorExporter) -> None:
    """Property: whatever a mutated descriptor does, read() raises InvalidDescriptor/ReadError or returns
    tensors matching the (mutated) manifest; never another exception, never a crash."""
    from hypothesis import HealthCheck, given, settings
    from hypothesis import strategies as st

    from tensorwire.errors import InvalidDescriptor

    cfg = CFG.replace(connect_timeout_ms=100, read_timeout_ms=1000)
    good = exporter.export([make_tensor((300,), "float32", 1), make_tensor((7, 3), "bfloat16", 2)]).to_bytes()
    with TensorReader(cfg) as rd:
        rd.read([good])

        @settings(max_examples=120, deadline=None, suppress_health_check=list(HealthCheck))
        @given(data=st.data())
        def prop(data: st.DataObject) -> None:
            raw = bytearray(good)
            for _ in range(data.draw(st.integers(1, 4))):
                i = data.draw(st.integers(0, len(raw) - 1))
                op = data.draw(st.sampled_from(["flip", "set", "cut"]))
                if op == "flip":
                    raw[i] ^= 1 << data.draw(st.integers(0, 7))
                elif op == "set":
                    raw[i] = data.draw(st.integers(0, 255))
                else:
                    del raw[i : i + data.draw(st.integers(1, 4))]
                if not raw:
                    return
            try:
                out = rd.read([bytes(raw)])
            except (InvalidDescriptor, ReadError):
                return
            d = Descriptor.from_bytes(bytes(raw))
            assert [tuple(t.shape) for t in out] == [m.shape for m in d.manifest]

        prop()
        assert same_bytes(rd.read([good])[0], make_tensor((300,), "float32", 1))  # still healthy


def test_idle_owners_are_forgotten(exporter: TensorExporter) -> None:
    """A long-lived reader drops owners unused for 2 x slot_gc_timeout_ms (restarted encoders must not leak
    UCX endpoints), and reads from a forgotten owner that is still alive just fetch its metadata again."""
    with TensorExporter(CFG) as other, TensorReader(CFG.replace(slot_gc_timeout_ms=150)) as rd:
        da, db = exporter.export([torch.ones(4)]), other.export([torch.full((4,), 2.0)])
        rd.read([da])
        rd.read([db])
        assert nixl_stats(rd).known_owners == 2
        time.sleep(0.8)  # both idle past 2 x 150 ms; the next read sweeps (every <= 0.3 s)
        rd.read([db])
        st = nixl_stats(rd)
        assert st.known_owners == 1 and st.idle_owners_forgotten == 1
        fetches = st.metadata_fetches
        assert torch.equal(rd.read([da])[0], torch.ones(4))
        assert nixl_stats(rd).metadata_fetches == fetches + 1
