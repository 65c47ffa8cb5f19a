"""The ``Provider`` seam: what a data-plane engine (NIXL today; Mooncake or others later) must do.

A provider moves bytes; it knows nothing of tensors, slots, leases or generations (those live in the exporter,
the reader and the pool above it). Methods per side:

- both sides: ``register`` / ``deregister`` memory, ``close``;
- owner side: ``serve`` (publish the metadata a reader needs; returns the ``Owner`` identity), plus the
  ``registration_epoch`` counter;
- reader side: ``read`` (one-sided READ of remote ranges into registered local ranges), ``transport``;
- optional, with defaults: ``supports_device_memory``, ``transport``, ``stats`` (a ``ProviderStats``).

Contract every provider honours (``tensorwire.testing.conformance`` checks it):

Ownership: ``register`` borrows ``[addr, addr+nbytes)``; the caller keeps that memory alive and unmodified in
  layout until ``deregister`` returns. After a ``read`` that raised ``ReadTimeout`` the destination ranges stay
  borrowed by the provider until the ``PendingTransfer`` attached to the exception (``exc.pending``) reports
  ``poll() is True``; the caller must neither free nor reuse them before that (quarantine).
Ordering: bytes written into registered owner memory before ``serve``/descriptor publication are visible to any
  ``read`` that starts later (on CUDA the exporter synchronizes the producer stream first). ``read`` returns only
  after every destination byte has landed (for VRAM: visible to later work on any stream). Two ``read`` calls
  issued one after the other by the same thread complete in that order.
Epochs: ``registration_epoch`` increases on every ``register``; metadata obtained by a reader at epoch E covers
  every region registered at epoch <= E that is still registered.
Thread-safety: ``read`` may run on many threads at once; ``register``/``deregister``/``serve`` may overlap
  ``read`` calls; ``close`` must not overlap anything else.
Errors: only ``tensorwire.errors`` exceptions leave a provider: ``ReadTimeout`` (deadline passed; ``.pending``
  set), ``ReadError`` with reasons PEER_DISCONNECTED / METADATA_UNAVAILABLE / RDMA_READ_ERROR, ``ExportError``
  with REGISTRATION_FAILED, ``ClosedError`` after ``close``. Construction of an unavailable provider raises
  ``ExportError``/``ReadError`` with PROVIDER_UNAVAILABLE (by role). Never status strings, never None.
"""

from __future__ import annotations

import abc
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

from tensorwire.rdma._config import RdmaConfig
from tensorwire.rdma._descriptor import Owner
from tensorwire.rdma._stats import ProviderStats

#: (address, length in bytes, device id), the plain form of one memory range (never NIXL's pickled lists).
Range = tuple[int, int, int]

ROLE_EXPORTER = "exporter"
ROLE_READER = "reader"


@dataclass(frozen=True)
class Registration:
    """One registered range; ``handle`` is provider-private."""

    addr: int
    nbytes: int
    mem_type: str
    device_id: int
    handle: Any = None


class PendingTransfer(abc.ABC):
    """A transfer that outlived its deadline. The destination stays quarantined until ``poll()`` is True."""

    @abc.abstractmethod
    def poll(self) -> bool:
        """True once the engine will never write the destination again (finished, failed or cancelled)."""

    def abandon(self) -> None:  # noqa: B027 - an optional hook: a documented no-op unless the engine can cancel
        """Called at close when ``poll()`` stayed False: cancel what can be cancelled. Default: nothing."""


class Provider(abc.ABC):
    """A data-plane engine behind tensorwire.rdma; see the module docstring for the contract."""

    name: ClassVar[str] = ""

    def __init__(self, config: RdmaConfig, *, role: str) -> None:
        self.config = config
        self.role = role

    @classmethod
    @abc.abstractmethod
    def available(cls) -> bool:
        """Whether this provider can work in this process (library importable, engine loadable)."""

    @property
    def supports_device_memory(self) -> bool:
        """Whether ``VRAM`` ranges can be registered and read. Default: False."""
        return False

    @property
    @abc.abstractmethod
    def agent_name(self) -> str:
        """This process's data-plane identity (unique per provider instance)."""

    @property
    @abc.abstractmethod
    def registration_epoch(self) -> int:
        """Number of ``register`` calls so far (see Epochs in the module docstring)."""

    @abc.abstractmethod
    def register(self, addr: int, nbytes: int, mem_type: str, device_id: int) -> Registration:
        """Register ``[addr, addr+nbytes)`` of ``mem_type`` ("DRAM"/"VRAM") for remote and local transfers."""

    @abc.abstractmethod
    def deregister(self, reg: Registration) -> None:
        """Undo ``register``; idempotent per registration is not required (the pool calls it once)."""

    @abc.abstractmethod
    def serve(self) -> Owner:
        """Owner side: start (once) publishing metadata; returns the identity descriptors carry (epoch 0)."""

    @abc.abstractmethod
    def read(
        self,
        owner: Owner,
        local_mem: str,
        local: Sequence[Range],
        remote_mem: str,
        remote: Sequence[Range],
        *,
        deadline: float,
    ) -> None:
        """READ ``remote[i]`` of ``owner`` into ``local[i]`` (same lengths) before ``deadline`` (time.monotonic)."""

    def transport(self, local_mem: str | None = None, remote_mem: str | None = None) -> str:
        """Transport of READs into ``local_mem`` from ``remote_mem`` (default: the configured device's memory),
        or "unknown" when not detectable."""
        return "unknown"

    def stats(self) -> ProviderStats:
        """This provider's statistics, nested in the exporter's and reader's ``stats()`` as ``provider_stats``.

        May run on any thread, concurrently with everything but ``close``, and after ``close``. A provider with
        counters of its own returns a ``ProviderStats`` subclass and changes them under one lock (a ``Tally``,
        as the nixl provider does). Default: the transport only."""
        return ProviderStats(transport=self.transport())

    @abc.abstractmethod
    def close(self) -> None:
        """Release the engine; idempotent. Registered memory must have been deregistered or is abandoned."""


__all__ = ["ROLE_EXPORTER", "ROLE_READER", "PendingTransfer", "Provider", "ProviderStats", "Range", "Registration"]
