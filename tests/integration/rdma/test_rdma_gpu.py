"""VRAM path (needs CUDA; skipped elsewhere): two processes on one GPU or on two GPUs of one host.

Run on a GPU machine with ``make test-gpu`` (``pytest -m gpu``). Each process creates its CUDA context before its
NIXL agent (nixl-on-cpu.md §6); the library sets UCX_CUDA_IPC_ENABLE_GET_ZCOPY=y so a same-host READ uses cuda_ipc.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import time

import pytest
import torch

from tensorwire.errors import LeaseExpired, PoolExhausted, Reason
from tensorwire.rdma import Descriptor, RdmaConfig, TensorExporter, TensorReader
from tensorwire.testing import OwnerProcess, make_tensor, same_bytes

pytestmark = [pytest.mark.gpu, pytest.mark.usefixtures("require_nixl"), pytest.mark.timeout(300)]

ENV = {k: v for k, v in os.environ.items() if k.startswith(("UCX_", "NIXL_", "CUDA_"))}
MIB = 1 << 20


def _devices() -> tuple[str, str]:
    n = torch.cuda.device_count()
    return "cuda:0", ("cuda:1" if n > 1 else "cuda:0")


@pytest.fixture(scope="module")
def gpu_cfgs() -> tuple[RdmaConfig, RdmaConfig]:
    owner_dev, reader_dev = _devices()
    torch.empty(1, device=reader_dev)  # CUDA context before the reader's NIXL agent
    base = RdmaConfig(provider="nixl", bind_ip="127.0.0.1", read_timeout_ms=30000)
    return base.replace(device=owner_dev), base.replace(device=reader_dev)


@pytest.fixture(scope="module")
def owner(gpu_cfgs: tuple[RdmaConfig, RdmaConfig]) -> OwnerProcess:
    with OwnerProcess(gpu_cfgs[0], env=ENV) as own:
        yield own


@pytest.fixture(scope="module")
def reader(gpu_cfgs: tuple[RdmaConfig, RdmaConfig]) -> TensorReader:
    with TensorReader(gpu_cfgs[1]) as rd:
        yield rd


@pytest.mark.parametrize("dtype", ["bfloat16", "float16", "float32"])
@pytest.mark.parametrize("rows", [1, 1000, 64 * 1024])
def test_vram_export_read_release_bytes(owner: OwnerProcess, reader: TensorReader, dtype: str, rows: int) -> None:
    specs = [((rows, 1024), dtype, rows), ((rows,), "int64", 7)]
    raw, _ = owner.export(specs)
    d = Descriptor.from_bytes(raw)
    assert d.mem_type == "VRAM"
    out = reader.read([d])
    for t, (shape, dt, seed) in zip(out, specs, strict=True):
        assert t.device == torch.device(reader.config.device)
        assert same_bytes(t.cpu(), make_tensor(shape, dt, seed))
    owner.release([d.lease_id])
    assert owner.stats().live_leases == 0


def test_transport_is_cuda_ipc_not_tcp(owner: OwnerProcess, reader: TensorReader) -> None:
    raw, _ = owner.export([((4 * MIB,), "uint8", 1)])
    d = Descriptor.from_bytes(raw)
    reader.read([d])
    transport = reader.transport(d)
    assert "cuda_ipc" in transport, transport
    owner.release([d.lease_id])


def test_vram_read_bandwidth_is_not_a_tcp_fallback(owner: OwnerProcess, reader: TensorReader) -> None:
    # A guard against the silent TCP path (~0.1 GB/s), not a benchmark: cuda_ipc does hundreds of GB/s.
    raw, _ = owner.export([((256 * MIB,), "uint8", 2)])
    reader.read([raw])
    t0 = time.perf_counter()
    reader.read([raw])
    torch.cuda.synchronize()
    assert 256 * MIB / (time.perf_counter() - t0) > 5e9
    owner.release([Descriptor.from_bytes(raw).lease_id])


def _export_during_side_stream_matmul(conn, cfg: RdmaConfig) -> None:  # type: ignore[no-untyped-def]
    torch.empty(1, device=cfg.device)
    with TensorExporter(cfg) as exp:
        dev = torch.device(cfg.device)
        side = torch.cuda.Stream(dev)
        a = torch.randn(8192, 8192, device=dev)
        with torch.cuda.stream(side):
            out = a
            for _ in range(20):  # hundreds of ms of work still queued when export() is called
                out = out @ a
                out = out / out.norm()
            result = out[:256].contiguous()
            desc = exp.export([result])  # export on the producing stream: must wait for the matmuls
        expected = result.cpu()  # synchronizes; what the reader must see
        conn.send((desc.to_bytes(), expected))
        conn.recv()


def test_export_waits_for_the_producing_stream(gpu_cfgs: tuple[RdmaConfig, RdmaConfig], reader: TensorReader) -> None:
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=_export_during_side_stream_matmul, args=(child, gpu_cfgs[0]), daemon=True)
    proc.start()
    try:
        assert parent.poll(120)
        raw, expected = parent.recv()
        (got,) = reader.read([raw])
        assert torch.equal(got.cpu(), expected)
        parent.send("done")
        proc.join(timeout=60)
    finally:
        if proc.is_alive():
            proc.kill()
            proc.join(timeout=10)


def test_vram_stale_generation_and_gc(gpu_cfgs: tuple[RdmaConfig, RdmaConfig], reader: TensorReader) -> None:
    cfg = gpu_cfgs[0].replace(slot_gc_timeout_ms=500)
    with OwnerProcess(cfg, env=ENV) as own:
        old = Descriptor.from_bytes(own.export([((1000,), "bfloat16", 1)])[0])
        reader.read([old])
        own.release([old.lease_id])
        new = Descriptor.from_bytes(own.export([((1000,), "bfloat16", 2)])[0])
        assert new.slot_addr == old.slot_addr
        with pytest.raises(LeaseExpired) as info:
            reader.read([old])
        assert info.value.reason is Reason.STALE_GENERATION
        end = time.monotonic() + 20
        while own.stats().live_leases and time.monotonic() < end:
            time.sleep(0.1)
        assert own.stats().gc_reclaims >= 1
        with pytest.raises(LeaseExpired):
            reader.read([new])


def test_vram_pool_shrink_and_exhaustion(gpu_cfgs: tuple[RdmaConfig, RdmaConfig]) -> None:
    cfg = gpu_cfgs[0].replace(pool_cap_bytes=64 * MIB, max_slot_bytes=64 * MIB)
    dev = torch.device(cfg.device)
    with TensorExporter(cfg) as exp:
        small = [exp.export([torch.ones(4 * MIB, dtype=torch.uint8, device=dev)]) for _ in range(8)]
        exp.release([d.lease_id for d in small])
        big = exp.export([torch.ones(64 * MIB, dtype=torch.uint8, device=dev)])
        st = exp.stats()
        assert st.pool.shrinks >= 1 and st.pool.idle_slots == 0 and st.pool.busy_slots == 1
        with pytest.raises(PoolExhausted):
            exp.export([torch.ones(1, dtype=torch.uint8, device=dev)])
        exp.release([big.lease_id])


def test_host_owner_gpu_reader(reader: TensorReader) -> None:
    """A CPU exporter and a GPU reader: the bytes are staged through registered host memory."""
    host_cfg = RdmaConfig(provider="nixl", bind_ip="127.0.0.1")
    with OwnerProcess(host_cfg, env=ENV) as own:
        specs = [((1000, 33), "bfloat16", 3), ((5 * MIB,), "uint8", 4)]
        out = reader.read([own.export(specs)[0]])
        for t, (shape, dt, seed) in zip(out, specs, strict=True):
            assert t.device == torch.device(reader.config.device)
            assert same_bytes(t.cpu(), make_tensor(shape, dt, seed))


def test_gpu_owner_host_reader(owner: OwnerProcess) -> None:
    """A GPU exporter and a CPU reader: host memory READs device memory of the owner."""
    with TensorReader(RdmaConfig(provider="nixl", bind_ip="127.0.0.1")) as rd:
        specs = [((1000, 33), "float16", 5), ((5 * MIB,), "uint8", 6)]
        raw, _ = owner.export(specs)
        out = rd.read([raw])
        for t, (shape, dt, seed) in zip(out, specs, strict=True):
            assert t.device.type == "cpu"
            assert same_bytes(t, make_tensor(shape, dt, seed))
        owner.release([Descriptor.from_bytes(raw).lease_id])


def test_large_vram_reads_are_loaned_and_come_back(owner: OwnerProcess, reader: TensorReader) -> None:
    """A large read returns views of a registered device buffer (no clone); dropping them gives the buffer back,
    and the next read into it sees its own bytes."""
    import gc

    specs = [((8 * MIB,), "uint8", 11)]
    raw, _ = owner.export(specs)
    d = Descriptor.from_bytes(raw)
    before = reader.stats().loans.busy_slots
    (t,) = reader.read([d])
    assert reader.stats().loans.busy_slots == before + 1
    assert t.device == torch.device(reader.config.device)
    assert same_bytes(t.cpu(), make_tensor((8 * MIB,), "uint8", 11))
    owner.release([d.lease_id])
    del t
    gc.collect()
    assert reader.stats().loans.busy_slots == before
    raw2, _ = owner.export([((8 * MIB,), "uint8", 12)])
    (t2,) = reader.read([raw2])
    assert same_bytes(t2.cpu(), make_tensor((8 * MIB,), "uint8", 12))
    owner.release([Descriptor.from_bytes(raw2).lease_id])


def test_loan_returned_with_queued_kernels_is_not_overwritten(owner: OwnerProcess, reader: TensorReader) -> None:
    """The caller queues work that reads a loaned tensor, then drops the tensor at once: the next READ into that
    buffer must wait for the queued work (event recorded at return), so the work sees the old bytes."""
    dev = torch.device(reader.config.device)
    raw_a, _ = owner.export([((64 * MIB,), "uint8", 21)])
    raw_b, _ = owner.export([((64 * MIB,), "uint8", 22)])
    (t,) = reader.read([raw_a])
    with torch.cuda.device(dev):
        torch.cuda._sleep(200_000_000)  # ~100 ms of GPU time queued on the current stream before the copy
        copy = t.clone()
    del t  # the loan comes back while the clone is still queued
    (t2,) = reader.read([raw_b])
    torch.cuda.synchronize(dev)
    assert same_bytes(copy.cpu(), make_tensor((64 * MIB,), "uint8", 21))
    assert same_bytes(t2.cpu(), make_tensor((64 * MIB,), "uint8", 22))
    owner.release([Descriptor.from_bytes(raw_a).lease_id, Descriptor.from_bytes(raw_b).lease_id])


def test_pooled_buffer_is_not_reused_before_the_queued_clone_ran(owner: OwnerProcess, reader: TensorReader) -> None:
    """A small read clones out of a pooled device buffer on the caller's stream; when that stream is busy the clone
    is still queued as the buffer goes back, and the next READ into it must wait for the clone."""
    dev = torch.device(reader.config.device)
    raw_a, _ = owner.export([((1 * MIB,), "uint8", 31)])
    raw_b, _ = owner.export([((1 * MIB,), "uint8", 32)])
    reader.read([raw_a])  # the pool has a buffer of this size from here on
    with torch.cuda.device(dev):
        torch.cuda._sleep(200_000_000)  # ~100 ms of GPU time queued before the clone
        (a,) = reader.read([raw_a])
    (b,) = reader.read([raw_b])  # same pooled buffer
    torch.cuda.synchronize(dev)
    assert same_bytes(a.cpu(), make_tensor((1 * MIB,), "uint8", 31))
    assert same_bytes(b.cpu(), make_tensor((1 * MIB,), "uint8", 32))
    owner.release([Descriptor.from_bytes(raw_a).lease_id, Descriptor.from_bytes(raw_b).lease_id])
