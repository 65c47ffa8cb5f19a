"""The same-host copy (``tensorwire.rdma._local``): when a reader copies instead of READing, what it refuses, and
how it falls back to the provider. Real NIXL agents; the owner in another process where the test says so.
test_rdma_two_process.py runs its round trips and stale-generation checks through both paths."""

from __future__ import annotations

import dataclasses
import os
import subprocess
from collections.abc import Iterator

import pytest
import torch
from _nixl_stats import nixl_stats

from tensorwire.errors import InvalidDescriptor
from tensorwire.rdma import Descriptor, RdmaConfig, TensorExporter, TensorReader, _local
from tensorwire.testing import OwnerProcess, make_tensor, same_bytes

pytestmark = [
    pytest.mark.usefixtures("require_nixl"),
    pytest.mark.timeout(180),
    pytest.mark.skipif(not _local.available(), reason="needs process_vm_readv on x86-64 Linux"),
]

CFG = RdmaConfig(provider="nixl", bind_ip="127.0.0.1", read_timeout_ms=10000)
ENV = {"UCX_NET_DEVICES": os.environ.get("UCX_NET_DEVICES", "lo")}
MIB = 1024 * 1024


def _transfers(reader: TensorReader) -> int:
    s = nixl_stats(reader)
    return s.xfer_reposts + s.xfer_preps


def _dead_pid() -> int:
    proc = subprocess.Popen(["true"])
    proc.wait()
    return proc.pid


@pytest.fixture(scope="module")
def owner() -> Iterator[OwnerProcess]:
    with OwnerProcess(CFG, env=ENV) as own:
        yield own


@pytest.fixture
def reader() -> Iterator[TensorReader]:
    with TensorReader(CFG) as rd:
        yield rd


def test_an_owner_on_this_host_is_copied_without_a_transfer(owner: OwnerProcess, reader: TensorReader) -> None:
    raw, _ = owner.export([((3 * MIB + 5,), "uint8", 11), ((7, 9), "float32", 12)])
    d = Descriptor.from_bytes(raw)
    assert d.owner.pid == owner.pid and d.owner.host_id == _local.host_id() and d.binding
    before = _transfers(reader)
    out = reader.read([d])
    assert same_bytes(out[0], make_tensor((3 * MIB + 5,), "uint8", 11))
    assert same_bytes(out[1], make_tensor((7, 9), "float32", 12))
    assert reader.stats().same_host_copies == 1 and _transfers(reader) == before
    # Into a caller's buffer (the vLLM connector's segments): views of it, nothing registered.
    dest = torch.empty(d.payload_bytes, dtype=torch.uint8)
    (into, _) = reader.read([d], into=[dest])
    assert into.data_ptr() == dest.data_ptr() and same_bytes(into, out[0])
    assert reader.stats().same_host_copies == 2 and _transfers(reader) == before
    owner.release([d.lease_id])


def test_a_descriptor_edited_to_name_other_memory_is_refused() -> None:
    """The binding ties the generation to the slot's address and size: keeping a real (word, generation) pair
    and moving the address is refused before anything is read, on either path."""
    with TensorExporter(CFG) as exp, TensorReader(CFG) as rd:
        d = exp.export([make_tensor((64 * 1024,), "uint8", 3)])
        for forged in (
            dataclasses.replace(d, slot_addr=d.slot_addr - 4096),
            dataclasses.replace(d, payload_bytes=d.payload_bytes + 4096),
        ):
            with pytest.raises(InvalidDescriptor, match="binding"):
                rd.read([forged])
            with pytest.raises(InvalidDescriptor, match="binding"):
                Descriptor.from_bytes(forged.to_bytes())
        assert rd.stats().same_host_copies == 0 and rd.stats().reads == 0
        # Without a binding (an owner that predates it) the slot is READ through NIXL, never copied.
        (out,) = rd.read([dataclasses.replace(d, binding=0)])
        assert same_bytes(out, make_tensor((64 * 1024,), "uint8", 3)) and rd.stats().same_host_copies == 0


@pytest.mark.parametrize("change", ["dead pid", "other host"])
def test_an_owner_that_cannot_be_copied_from_is_read(owner: OwnerProcess, reader: TensorReader, change: str) -> None:
    """A pid that is gone (ESRCH) or a host id that is not ours: the reader READs through NIXL, in the same call
    as a descriptor it does copy."""
    good = Descriptor.from_bytes(owner.export([((MIB,), "uint8", 21)])[0])
    other = Descriptor.from_bytes(owner.export([((2 * MIB,), "uint8", 22)])[0])
    o = other.owner
    moved = (
        dataclasses.replace(o, pid=_dead_pid()) if change == "dead pid" else dataclasses.replace(o, host_id=b"x" * 16)
    )
    before = _transfers(reader)
    out = reader.read([good, dataclasses.replace(other, owner=moved)])
    assert same_bytes(out[0], make_tensor((MIB,), "uint8", 21))
    assert same_bytes(out[1], make_tensor((2 * MIB,), "uint8", 22))
    assert reader.stats().same_host_copies == 1 and _transfers(reader) > before
    owner.release([good.lease_id, other.lease_id])
