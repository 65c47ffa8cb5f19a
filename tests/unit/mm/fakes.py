"""An in-memory stand-in for tensorwire.rdma's exporter and reader, for orchestration-policy tests only.

It mints real ``tensorwire.rdma.Descriptor`` objects (so the real wire form and validation run) but keeps the
bytes in a process-local table instead of registered memory; it claims nothing about NIXL. Failure knobs let a
test make export or read fail in a chosen way. Both implement the whole ``tensorwire.rdma.Exporter`` /
``Reader`` protocol; the exporter has no registered slots to write into, so ``allocate`` raises as a real
exporter does when it cannot allocate (callers then take the copy path).
"""

from __future__ import annotations

import itertools
import threading
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from tensorwire.errors import ExportError, LeaseExpired, ReadError, Reason
from tensorwire.rdma import Descriptor, ExporterStats, Lease, Owner, RdmaConfig, ReaderStats
from tensorwire.rdma._descriptor import layout


@dataclass
class FakeFabric:
    """The shared 'memory' both fakes see, and a log of what happened."""

    slots: dict[str, list[torch.Tensor]] = field(default_factory=dict)
    released: list[str] = field(default_factory=list)
    exported: list[str] = field(default_factory=list)
    reads: list[tuple[int, int | None]] = field(default_factory=list)  # (descriptor count, timeout_ms)
    fail_export_at: int | None = None  # export_batch raises when it reaches this group index
    read_error: Callable[[], Exception] | None = None
    read_hook: Callable[[list[torch.Tensor]], list[torch.Tensor]] | None = None
    lock: threading.Lock = field(default_factory=threading.Lock)
    _addr: Any = field(default_factory=lambda: itertools.count(1))

    def live(self) -> set[str]:
        with self.lock:
            return set(self.slots)


class FakeExporter:
    def __init__(self, fabric: FakeFabric, config: RdmaConfig) -> None:
        self.fabric = fabric
        self.config = config
        self.closed = False

    def export_batch(self, groups: Sequence[Sequence[torch.Tensor]]) -> list[Descriptor]:
        out: list[Descriptor] = []
        try:
            for i, group in enumerate(groups):
                if self.fabric.fail_export_at is not None and i == self.fabric.fail_export_at:
                    raise ExportError(f"fake export failure at group {i}", reason=Reason.REGISTRATION_FAILED)
                manifest, payload = layout([(t.shape, t.dtype) for t in group], self.config.slot_align)
                if payload > self.config.max_slot_bytes:
                    raise ExportError("slot too large", reason=Reason.SLOT_TOO_LARGE)
                lease = uuid.uuid4().hex
                n = next(self.fabric._addr)
                desc = Descriptor(
                    owner=Owner("fake-owner", "127.0.0.1", 1),
                    mem_type="DRAM",
                    device_id=0,
                    slot_addr=n << 32,
                    payload_bytes=payload,
                    lease_id=lease,
                    generation=1,
                    generation_addr=(n << 32) - 8,
                    manifest=tuple(manifest),
                )
                with self.fabric.lock:
                    self.fabric.slots[lease] = [t.detach().clone() for t in group]
                    self.fabric.exported.append(lease)
                out.append(desc)
        except Exception:
            self.release([d.lease_id for d in out])
            raise
        return out

    def release(self, lease_ids: Sequence[str]) -> int:
        ended = 0
        with self.fabric.lock:
            for lid in lease_ids:
                if self.fabric.slots.pop(lid, None) is not None:
                    self.fabric.released.append(lid)
                    ended += 1
        return ended

    def allocate(
        self, shapes_and_dtypes: Sequence[tuple[Sequence[int], torch.dtype]]
    ) -> tuple[Lease, list[torch.Tensor]]:
        raise ExportError("the fake exporter has no registered slots to allocate", reason=Reason.PROVIDER_UNAVAILABLE)

    def export_allocated(self, lease: Lease) -> Descriptor:
        raise ExportError(f"lease {lease.lease_id} is not from this exporter", reason=Reason.LEASE_EXPIRED)

    def stats(self) -> ExporterStats:
        with self.fabric.lock:
            return ExporterStats(provider="fake", live_leases=len(self.fabric.slots))

    def close(self) -> None:
        self.closed = True


class FakeReader:
    def __init__(self, fabric: FakeFabric, config: RdmaConfig) -> None:
        self.fabric = fabric
        self.config = config

    def read(
        self, descriptors: Sequence[Descriptor], timeout_ms: int | None = None, *, into: Any = None
    ) -> list[torch.Tensor]:
        assert into is None, "the fake fabric reads into memory of its own"
        self.fabric.reads.append((len(descriptors), timeout_ms))
        if self.fabric.read_error is not None:
            raise self.fabric.read_error()
        out: list[torch.Tensor] = []
        with self.fabric.lock:
            for d in descriptors:
                tensors = self.fabric.slots.get(d.lease_id)
                if tensors is None:
                    raise LeaseExpired(f"lease {d.lease_id} is gone")
                out.extend(t.clone() for t in tensors)
        if self.fabric.read_hook is not None:
            out = self.fabric.read_hook(out)
        return out

    def transport(self, descriptor: Descriptor | None = None) -> str:
        return "unknown"

    def stats(self) -> ReaderStats:
        return ReaderStats(provider="fake", reads=len(self.fabric.reads))

    def close(self) -> None:
        pass


def make_read_error() -> Exception:
    return ReadError("fake NIC fault", reason=Reason.RDMA_READ_ERROR)


def rdma_receipt(lease_id: str = "abc-1") -> Any:
    """An ``EncodeResponse`` naming one host slot (a 4x4 float32 embedding) under ``lease_id``; the slot is never
    read (the tests that use it stop before, or only look at the lease id)."""
    from tensorwire.mm._proto import encoder_pb2 as pb
    from tensorwire.rdma import TensorMeta

    d = Descriptor(
        owner=Owner("tw-exporter-a", "127.0.0.1", 4242),
        mem_type="DRAM",
        device_id=0,
        slot_addr=0x7F0000000000,
        payload_bytes=4096,
        lease_id=lease_id,
        generation=7,
        generation_addr=0x7E0000000008,
        manifest=(TensorMeta((4, 4), torch.float32, 0, 64),),
    )
    msg = pb.EncodeResponse()
    msg.rdma_slots.add(descriptor=d.to_bytes(), roles=[pb.EMBEDDING])
    return msg
