"""Two real OS processes: an owner (spawned, tensorwire.testing.OwnerProcess) and this process as the reader."""

from __future__ import annotations

import multiprocessing as mp
import os
import signal
import threading
import time

import pytest
from _nixl_stats import nixl_stats

from tensorwire.errors import ExportError, LeaseExpired, ReadError, Reason
from tensorwire.rdma import SUPPORTED_DTYPES, Descriptor, RdmaConfig, TensorReader
from tensorwire.rdma._dtypes import dtype_name
from tensorwire.testing import OwnerProcess, make_tensor, read_forever, same_bytes

pytestmark = [pytest.mark.usefixtures("require_nixl"), pytest.mark.timeout(180)]

CFG = RdmaConfig(provider="nixl", bind_ip="127.0.0.1", read_timeout_ms=10000)
ENV = {"UCX_NET_DEVICES": os.environ.get("UCX_NET_DEVICES", "lo")}
KIB, MIB = 1024, 1024 * 1024


@pytest.fixture(scope="module")
def owner() -> OwnerProcess:
    with OwnerProcess(CFG, env=ENV) as own:
        yield own


@pytest.fixture(scope="module", params=[0, 1], ids=["provider-read", "same-host-copy"])
def reader(request: pytest.FixtureRequest) -> TensorReader:
    """Each test twice: READs through NIXL, and the same-host copy (``rdma._local``) that a reader on the owner's
    host uses by default."""
    with TensorReader(CFG.replace(same_host_copy=request.param)) as rd:
        yield rd


@pytest.fixture(scope="module")
def nixl_reader() -> TensorReader:
    with TensorReader(CFG.replace(same_host_copy=0)) as rd:
        yield rd


@pytest.mark.parametrize(
    "nbytes", [1 * KIB, 64 * KIB, 1 * MIB, 16 * MIB, 256 * MIB], ids=["1KiB", "64KiB", "1MiB", "16MiB", "256MiB"]
)
def test_sizes_byte_for_byte(owner: OwnerProcess, reader: TensorReader, nbytes: int) -> None:
    seed = nbytes % 9973
    raw, _ = owner.export([((nbytes,), "uint8", seed)])
    d = Descriptor.from_bytes(raw)
    assert d.payload_bytes >= nbytes and d.owner.agent_name == owner.owner.agent_name
    copies = reader.stats().same_host_copies
    (out,) = reader.read([d])
    assert same_bytes(out, make_tensor((nbytes,), "uint8", seed))
    assert reader.stats().same_host_copies - copies == reader.config.same_host_copy  # the path the id names
    owner.release([d.lease_id])
    del out


def test_every_dtype_byte_for_byte(owner: OwnerProcess, reader: TensorReader) -> None:
    specs = [((5, 3), dtype_name(dt), i) for i, dt in enumerate(SUPPORTED_DTYPES)]
    raw, _ = owner.export(specs)
    out = reader.read([raw])
    assert [t.dtype for t in out] == list(SUPPORTED_DTYPES)
    for t, (shape, dt, seed) in zip(out, specs, strict=True):
        assert same_bytes(t, make_tensor(shape, dt, seed)), dt
    # Large multi-tensor payload (loaned-buffer path) keeps manifest order and offsets.
    big = [((3 * MIB + 17,), "uint8", 1), ((1000, 1000), "bfloat16", 2), ((5,), "int64", 3)]
    out = reader.read([owner.export(big)[0]])
    for t, (shape, dt, seed) in zip(out, big, strict=True):
        assert same_bytes(t, make_tensor(shape, dt, seed))


def test_concurrent_reads_from_threads(owner: OwnerProcess, reader: TensorReader) -> None:
    specs = [[((4096 + 512 * i,), "float32", 50 + i)] for i in range(6)]
    raws = owner.export_batch(specs)
    errors: list[BaseException] = []

    def worker(k: int) -> None:
        try:
            for r in range(15):
                i = (k * 7 + r) % len(raws)
                (t,) = reader.read([raws[i]])
                shape, dt, seed = specs[i][0]
                assert same_bytes(t, make_tensor(shape, dt, seed))
        except BaseException as exc:  # reported below
            errors.append(exc)

    threads = [threading.Thread(target=worker, args=(k,)) for k in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=90)
    assert not any(t.is_alive() for t in threads)
    assert not errors, errors
    owner.release([Descriptor.from_bytes(r).lease_id for r in raws])


def test_stale_generation_across_processes(owner: OwnerProcess, reader: TensorReader) -> None:
    old = Descriptor.from_bytes(owner.export([((1000,), "int32", 1)])[0])
    assert same_bytes(reader.read([old])[0], make_tensor((1000,), "int32", 1))
    owner.release([old.lease_id])
    new = Descriptor.from_bytes(owner.export([((1000,), "int32", 2)])[0])
    assert new.slot_addr == old.slot_addr  # the slot was reused by a new tenant
    with pytest.raises(LeaseExpired) as info:
        reader.read([old])
    assert info.value.reason is Reason.STALE_GENERATION
    assert same_bytes(reader.read([new])[0], make_tensor((1000,), "int32", 2))
    owner.release([new.lease_id])


def test_export_batch_rollback_in_the_owner(owner: OwnerProcess) -> None:
    before = owner.stats()
    with pytest.raises(ExportError) as info:
        owner.export_batch([[((8,), "float32", 1)], [((8,), "complex64", 2)], [((8,), "float32", 3)]])
    assert info.value.reason is Reason.UNSUPPORTED_DTYPE
    after = owner.stats()
    assert after.live_leases == before.live_leases
    assert after.batch_rollbacks == before.batch_rollbacks + 1


def test_owner_killed_before_first_contact(reader: TensorReader) -> None:
    own = OwnerProcess(CFG, env=ENV)
    try:
        raw, _ = own.export([((1024,), "uint8", 1)])
        own.kill()
        t0 = time.monotonic()
        with pytest.raises(ReadError) as info:
            reader.read([raw], timeout_ms=3000)
        assert time.monotonic() - t0 < 3.5
        assert info.value.reason in (Reason.METADATA_UNAVAILABLE, Reason.PEER_DISCONNECTED, Reason.READ_TIMEOUT)
    finally:
        own.close()


def test_owner_killed_after_reads_then_reader_recovers(owner: OwnerProcess, reader: TensorReader) -> None:
    own = OwnerProcess(CFG, env=ENV)
    try:
        raw, _ = own.export([((64 * KIB,), "uint8", 1)])
        reader.read([raw])  # metadata cached, connection up
        own.kill()
        t0 = time.monotonic()
        with pytest.raises(ReadError) as info:
            reader.read([raw], timeout_ms=3000)
        elapsed = time.monotonic() - t0
        assert elapsed < 3.5, elapsed
        assert info.value.reason in (Reason.PEER_DISCONNECTED, Reason.METADATA_UNAVAILABLE, Reason.READ_TIMEOUT)
    finally:
        own.close()
    # Other owners are unaffected.
    ok, _ = owner.export([((10,), "float32", 9)])
    assert same_bytes(reader.read([ok])[0], make_tensor((10,), "float32", 9))
    owner.release([Descriptor.from_bytes(ok).lease_id])


def test_reader_killed_mid_read_leaks_nothing_on_the_owner() -> None:
    cfg = CFG.replace(slot_gc_timeout_ms=1500)
    ctx = mp.get_context("spawn")
    with OwnerProcess(cfg, env=ENV) as own:
        parent, child = ctx.Pipe()
        proc = ctx.Process(target=read_forever, args=(child, cfg, ENV), daemon=True)
        proc.start()
        try:
            assert parent.poll(60) and parent.recv() == "ready", "reader child never started"
            # Export only now: the GC clock of the lease starts when the reader is up.
            raw, _ = own.export([((32 * MIB,), "uint8", 1)])
            parent.send(raw)
            assert parent.poll(20), "reader child never read"
            assert parent.recv() == "reading"
            time.sleep(0.2)  # inside its read loop
            os.kill(proc.pid, signal.SIGKILL)
            proc.join(timeout=10)
        finally:
            if proc.is_alive():
                proc.kill()
                proc.join(timeout=10)
        # The reader never released: only the GC can end the lease (gc_reclaims == 1 below proves it did).
        end = time.monotonic() + 20
        while own.stats().live_leases and time.monotonic() < end:
            time.sleep(0.1)
        st = own.stats()
        assert st.live_leases == 0 and st.pool.busy_slots == 0 and st.gc_reclaims == 1
        # The owner keeps serving other readers.
        raw2, _ = own.export([((1000,), "float64", 4)])
        with TensorReader(cfg) as rd:
            assert same_bytes(rd.read([raw2])[0], make_tensor((1000,), "float64", 4))


def test_idle_owner_uses_little_cpu(owner: OwnerProcess) -> None:
    # A correctness guard for the progress-thread fix (a spinning agent uses ~100% of a core), not a benchmark.
    assert owner.idle_cpu(1.0) < 0.5


def test_reposted_reads_see_each_new_tenant_of_a_slot(owner: OwnerProcess, nixl_reader: TensorReader) -> None:
    """Completed READ requests are posted again for recurring (slot, slot) pairs: each read must still fetch the
    slot's current bytes, and a stale descriptor must still fail its generation check."""
    reader = nixl_reader
    before = nixl_stats(reader)
    seen_slots = set()
    stale = None
    for seed in range(6):
        raw, _ = owner.export([((64 * KIB,), "uint8", 300 + seed)])
        d = Descriptor.from_bytes(raw)
        seen_slots.add(d.slot_addr)
        (out,) = reader.read([d])
        assert same_bytes(out, make_tensor((64 * KIB,), "uint8", 300 + seed)), seed
        owner.release([d.lease_id])
        stale = d
    assert len(seen_slots) < 6  # the owner's pool reused a slot, so some requests recurred
    after = nixl_stats(reader)
    assert after.xfer_reposts > before.xfer_reposts
    assert stale is not None
    with pytest.raises(LeaseExpired):
        reader.read([stale])


def test_batched_read_uses_one_payload_and_one_generation_transfer(
    owner: OwnerProcess, nixl_reader: TensorReader
) -> None:
    reader = nixl_reader
    specs = [[((4096 * (i + 1),), "float32", 400 + i)] for i in range(4)] + [[((5 * MIB,), "uint8", 409)]]
    raws = owner.export_batch(specs)

    def transfers() -> int:
        s = nixl_stats(reader)
        return s.xfer_reposts + s.xfer_preps

    before = transfers()
    out = reader.read(raws)
    assert transfers() - before == 2  # five descriptors, one owner: one payload READ, then one generation READ
    for t, [(shape, dt, seed)] in zip(out, specs, strict=True):
        assert same_bytes(t, make_tensor(shape, dt, seed))
    # One stale descriptor fails the whole batch, and nothing of the batch stays borrowed.
    owner.release([Descriptor.from_bytes(raws[2]).lease_id])
    del out, t  # the loop variable holds the loaned 5 MiB tensor too
    with pytest.raises(LeaseExpired):
        reader.read(raws)
    stats = reader.stats()
    assert stats.buffers.busy_slots == 0 and stats.loans.busy_slots == 0
    owner.release([Descriptor.from_bytes(r).lease_id for r in raws])
