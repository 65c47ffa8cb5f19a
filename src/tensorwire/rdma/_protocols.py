"""``Exporter`` and ``Reader``: the parts of ``TensorExporter`` / ``TensorReader`` that callers build on.

Callers above the rdma layer type with these, so a test double stands in without subclassing. A double
implements every method and raises what the real class raises; contracts are those of the real classes and
``docs/rdma.md``.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Protocol

import torch

from tensorwire.rdma._descriptor import Descriptor
from tensorwire.rdma._exporter import Lease
from tensorwire.rdma._stats import ExporterStats, ReaderStats


class Exporter(Protocol):
    """The owner side as ``tensorwire.mm`` uses it (``TensorExporter`` implements it). Thread-safe."""

    def export_batch(self, groups: Sequence[Sequence[torch.Tensor]]) -> list[Descriptor]:
        """One descriptor per group, in order; all or nothing (ExportError, PoolExhausted)."""
        ...

    def allocate(
        self, shapes_and_dtypes: Sequence[tuple[Sequence[int], torch.dtype]]
    ) -> tuple[Lease, list[torch.Tensor]]:
        """A lease plus tensors inside its slot, to be written in place and then ``export_allocated``."""
        ...

    def export_allocated(self, lease: Lease) -> Descriptor:
        """Publish an allocated lease (ExportError if it was released, reclaimed or already exported)."""
        ...

    def release(self, lease_ids: Iterable[str]) -> int:
        """End these leases; idempotent. Returns how many named a live lease; unknown ids are counted, never
        raised."""
        ...

    def stats(self) -> ExporterStats:
        """A consistent copy of the counters; never raises, also after ``close``."""
        ...

    def close(self) -> None:
        """Void every lease and release the provider; idempotent."""
        ...


class Reader(Protocol):
    """The reader side as ``tensorwire.mm`` uses it (``TensorReader`` implements it). Thread-safe."""

    def read(
        self,
        descriptors: Sequence[Descriptor],
        timeout_ms: int | None = None,
        *,
        into: Sequence[torch.Tensor] | None = None,
    ) -> list[torch.Tensor]:
        """Every descriptor's tensors, in descriptor x manifest order (InvalidDescriptor, ReadTimeout,
        LeaseExpired, ReadError); with ``into``, views of those caller-owned host buffers, one per descriptor
        (InvalidPayload, reason INVALID_REQUEST, for a wrong one: nothing read).
        ``TensorReader.read`` also takes descriptor bytes."""
        ...

    def transport(self, descriptor: Descriptor | None = None) -> str:
        """The transport the last READ (from ``descriptor``'s owner) used, or "unknown"; a cached lookup."""
        ...

    def stats(self) -> ReaderStats:
        """A consistent copy of the counters; never raises, also after ``close``."""
        ...

    def close(self) -> None:
        """Release buffers and the provider; idempotent."""
        ...
