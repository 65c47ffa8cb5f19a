"""The generation binding (``Descriptor.binding``) and the same-host copy primitive (``rdma._local``)."""

from __future__ import annotations

import dataclasses
import os
import shutil
import subprocess
import sys

import pytest
import torch

from tensorwire.errors import InvalidDescriptor
from tensorwire.rdma import Descriptor, Owner, TensorMeta, _local
from tensorwire.rdma._descriptor import bound_generation

ALIGN = 4096


def bound(**changes: object) -> Descriptor:
    binding, addr, size = 0x1234_5678_9ABC_DEF0, 0x7F0000000000, 2 * ALIGN
    d = Descriptor(
        owner=Owner("tw-exporter-a", "127.0.0.1", 4242, 3, b"t" * 32, 4321, b"h" * 16),
        mem_type="DRAM",
        device_id=0,
        slot_addr=addr,
        payload_bytes=size,
        lease_id="abc-1",
        generation=bound_generation(binding, addr, size),
        generation_addr=0x7E0000000008,
        manifest=(TensorMeta((2, 3), torch.float32, 0, 24),),
        binding=binding,
    )
    return dataclasses.replace(d, **changes)  # type: ignore[arg-type]


def test_a_bound_descriptor_round_trips_with_its_owner_pid_and_host() -> None:
    d = bound()
    back = Descriptor.from_bytes(d.to_bytes())
    assert back == d and back.owner.pid == 4321 and back.owner.host_id == b"h" * 16 and back.binding == d.binding


@pytest.mark.parametrize(
    "change",
    [
        {"slot_addr": 0x7F0000000000 + ALIGN},
        {"slot_addr": 0x7F0000000000 - ALIGN},
        {"payload_bytes": 3 * ALIGN},
        {"generation": 7},
        {"binding": 0x1234_5678_9ABC_DEF1},
    ],
    ids=["addr+", "addr-", "size", "generation", "binding"],
)
def test_an_edited_bound_descriptor_is_refused(change: dict[str, int]) -> None:
    d = bound(**change)
    with pytest.raises(InvalidDescriptor, match="binding"):
        d.validate()
    with pytest.raises(InvalidDescriptor, match="binding"):
        Descriptor.from_bytes(d.to_bytes())


def test_unbound_descriptors_of_older_owners_still_validate() -> None:
    d = bound(binding=0, generation=7)
    assert Descriptor.from_bytes(d.to_bytes()).binding == 0


def test_the_bound_generation_is_63_bits_and_depends_on_every_input() -> None:
    values = {bound_generation(b, a, n) for b in (1, 2) for a in (4096, 8192) for n in (4096, 8192)}
    assert len(values) == 8 and all(0 < v < 1 << 63 for v in values)


def test_owner_pid_and_host_id_are_bounded() -> None:
    with pytest.raises(InvalidDescriptor, match="pid"):
        bound(owner=dataclasses.replace(bound().owner, pid=1 << 32)).validate()
    with pytest.raises(InvalidDescriptor, match="host id"):
        bound(owner=dataclasses.replace(bound().owner, host_id=b"x" * 65)).validate()


needs_copy = pytest.mark.skipif(not _local.available(), reason="needs process_vm_readv on x86-64 Linux")


def test_the_host_id_is_stable_and_names_the_pid_namespace() -> None:
    assert _local.host_id() == _local.host_id()
    if _local.host_id():
        assert len(_local.host_id()) == _local.HOST_ID_BYTES


@needs_copy
def test_copy_from_a_process_copies_every_range_in_order() -> None:
    src = torch.arange(3 * 4096, dtype=torch.int32)
    dst = torch.zeros_like(src)
    step = 4096 * 4
    ranges = [(src.data_ptr() + i * step, step) for i in range(3)]
    _local.copy_from(os.getpid(), [(dst.data_ptr() + i * step, step) for i in range(3)], ranges)
    assert torch.equal(src, dst)


@needs_copy
def test_copy_failures_are_typed_and_say_whether_to_try_again() -> None:
    dst = torch.zeros(16, dtype=torch.uint8)
    gone = subprocess.Popen(["true"])
    gone.wait()
    with pytest.raises(_local.LocalCopyFailed) as info:
        _local.copy_from(gone.pid, [(dst.data_ptr(), 16)], [(dst.data_ptr(), 16)])
    assert info.value.permanent  # ESRCH: that owner is gone
    with pytest.raises(_local.LocalCopyFailed) as info:
        _local.copy_from(os.getpid(), [(dst.data_ptr(), 16)], [(4096, 16)])  # nothing is mapped at page 1
    assert not info.value.permanent  # EFAULT: this descriptor only


@pytest.mark.skipif(
    os.geteuid() != 0 or shutil.which("unshare") is None, reason="needs root and unshare(1) for a network namespace"
)
def test_another_network_namespace_is_another_host() -> None:
    """The cross-host harness's simulated hosts (and containers) share this kernel: they must READ over the
    network they were configured with, not copy."""
    code = "from tensorwire.rdma import _local; print(_local.host_id().hex())"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    same = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=60)
    other = subprocess.run(
        ["unshare", "--net", sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=60
    )
    assert same.returncode == 0 and other.returncode == 0, (same.stderr, other.stderr)
    assert same.stdout.strip() == _local.host_id().hex() != other.stdout.strip()
