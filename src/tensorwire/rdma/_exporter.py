"""``TensorExporter``: copies tensors into pooled registered slots and hands out descriptors + leases.

A lease id (128 bits from ``secrets``) is its release capability; no more of it than ``lease_ref`` is logged.
``release`` (idempotent) or the TTL GC (``slot_gc_timeout_ms``) ends a lease: the slot's generation is bumped
and it returns to its free list, registration kept. ``close`` voids every lease.
"""

from __future__ import annotations

import ctypes
import dataclasses
import logging
import secrets
import threading
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

import torch

from tensorwire.errors import ClosedError, ExportError, Reason
from tensorwire.rdma import _dtypes
from tensorwire.rdma._config import RdmaConfig
from tensorwire.rdma._descriptor import Descriptor, Owner, TensorMeta, layout, views
from tensorwire.rdma._pool import GenerationTable, Slot, SlotPool
from tensorwire.rdma._stats import ExporterStats, PoolStats, ProviderStats, Tally
from tensorwire.rdma.providers import create_provider
from tensorwire.rdma.providers.base import ROLE_EXPORTER, Provider

log = logging.getLogger(__name__)

LEASE_ID_BYTES = 16  # 128 random bits


def new_lease_id() -> str:
    """A fresh lease id: ``LEASE_ID_BYTES`` random bytes as hex."""
    return secrets.token_hex(LEASE_ID_BYTES)


def lease_ref(lease_id: str) -> str:
    """A short, non-secret reference to a lease for messages and logs (the first 32 of its 128 bits)."""
    return lease_id[:8] + "..." if len(lease_id) > 8 else lease_id


@dataclass(eq=False)
class Lease:
    """A leased slot. ``tensors`` are views into it (``allocate``); ``descriptor`` is set once exported."""

    lease_id: str
    slot: Slot = field(repr=False)
    manifest: tuple[TensorMeta, ...] = field(repr=False)
    payload_bytes: int
    created_s: float
    descriptor: Descriptor | None = field(default=None, repr=False)

    @property
    def exported(self) -> bool:
        return self.descriptor is not None


class TensorExporter:
    """Owner side of the rdma layer. Thread-safe; use as a context manager or call ``close()``.

    ``export(tensors)`` copies the tensors (they may be dropped as soon as it returns) and, on CUDA, synchronizes
    the caller's current stream of the configured device before the descriptor exists, so a reader never sees an
    unfinished tensor. Work producing the inputs on other streams must be ordered before the call by the caller
    (``torch.cuda.current_stream().wait_stream(s)``) or the call made under ``torch.cuda.stream(s)``.
    """

    def __init__(self, config: RdmaConfig | None = None) -> None:
        self._cfg = config or RdmaConfig()
        self._lock = threading.RLock()
        self._closed = False
        self._leases: dict[str, Lease] = {}
        self._tally = Tally(ExporterStats())  # counters only; stats() fills in the gauges
        self._gc_stop = threading.Event()
        self._gc_thread: threading.Thread | None = None
        self._provider: Provider | None = None
        self._pool: SlotPool | None = None
        self._gens: GenerationTable | None = None
        self._owner: Owner | None = None
        self._published_owner: Owner | None = None
        try:
            self._device = torch.device(self._cfg.device)
            if self._device.type == "cuda":
                _check_cuda_device(self._cfg.device_index)
                torch.empty(1, device=self._device)  # CUDA context before the NIXL agent (nixl-on-cpu.md §6)
            self._provider = create_provider(self._cfg, role=ROLE_EXPORTER)
            self._gens = GenerationTable(self._provider)
            self._pool = SlotPool(self._provider, self._cfg, generations=self._gens, numpy_backed=True)
            self._owner = self._provider.serve()
            self._gc_thread = threading.Thread(target=self._gc_loop, name="tensorwire-rdma-gc", daemon=True)
            self._gc_thread.start()
        except BaseException:
            self.close()
            raise
        log.info(
            "rdma exporter ready: provider=%s agent=%s endpoint=%s device=%s pool_cap=%d gc=%d ms",
            self._provider.name,
            self._owner.agent_name,
            self._owner.endpoint,
            self._cfg.device,
            self._cfg.pool_cap_bytes,
            self._cfg.slot_gc_timeout_ms,
        )

    # -- properties --

    @property
    def config(self) -> RdmaConfig:
        return self._cfg

    @property
    def ready(self) -> bool:
        return not self._closed and self._provider is not None

    @property
    def provider_name(self) -> str:
        return self._provider.name if self._provider is not None else "none"

    @property
    def owner(self) -> Owner:
        self._check_open()
        assert self._owner is not None
        return self._owner

    # -- export --

    def export(self, tensors: Sequence[torch.Tensor]) -> Descriptor:
        """Copy ``tensors`` into one slot and return its descriptor (one manifest entry per tensor, in order)."""
        self._check_open()
        inputs = self._check_inputs(tensors)
        manifest, payload = self._layout([(tuple(t.shape), t.dtype) for t in inputs])
        lease = self._new_lease(manifest, payload)
        try:
            self._copy_in(lease, inputs)
            return self._publish(lease)
        except BaseException:
            with self._tally.locked() as c:
                c.export_failures += 1
            self._end_lease(lease.lease_id)
            raise

    def export_batch(self, groups: Sequence[Sequence[torch.Tensor]]) -> list[Descriptor]:
        """One descriptor per group, in order. All or nothing: on any failure every lease made here is released."""
        done: list[Descriptor] = []
        try:
            for group in groups:
                done.append(self.export(group))
        except BaseException:
            if done:
                with self._tally.locked() as c:
                    c.batch_rollbacks += 1
                self.release([d.lease_id for d in done])
            raise
        return done

    def allocate(
        self,
        shapes_and_dtypes: Sequence[tuple[Sequence[int], torch.dtype]],
    ) -> tuple[Lease, list[torch.Tensor]]:
        """A lease on a slot plus tensors living inside it, to be written in place and ``export_allocated``.

        The tensors are views of pooled memory: valid until the lease is released or reclaimed (after that the slot
        may hold another export's bytes). Release it like any other lease, exported or not.
        """
        self._check_open()
        specs = []
        for i, item in enumerate(shapes_and_dtypes):
            try:
                shape, dtype = item
                shape = tuple(int(d) for d in shape)
            except (TypeError, ValueError) as exc:
                raise ExportError(f"allocate item {i}: expected (shape, dtype), got {item!r}") from exc
            if not isinstance(dtype, torch.dtype) or not _dtypes.is_supported(dtype):
                raise ExportError(f"allocate item {i}: unsupported dtype {dtype!r}", reason=Reason.UNSUPPORTED_DTYPE)
            if any(d < 0 for d in shape):
                raise ExportError(f"allocate item {i}: negative dim in {shape}", reason=Reason.NEGATIVE_DIM)
            specs.append((shape, dtype))
        if not specs:
            raise ExportError("allocate needs at least one tensor", reason=Reason.EMPTY_EXPORT)
        manifest, payload = self._layout(specs)
        lease = self._new_lease(manifest, payload)
        with self._tally.locked() as c:
            c.allocations += 1
        return lease, views(lease.slot.tensor, manifest, lease.slot.typed)

    def export_allocated(self, lease: Lease) -> Descriptor:
        """Publish an ``allocate``d lease (syncing the current CUDA stream first). Exporting twice raises."""
        self._check_open()
        with self._lock:
            current = self._leases.get(lease.lease_id)
        if current is not lease:
            raise ExportError(
                f"lease {lease_ref(lease.lease_id)} is released, reclaimed or not from this exporter",
                reason=Reason.LEASE_EXPIRED,
            )
        if lease.exported:
            raise ExportError(f"lease {lease_ref(lease.lease_id)} is already exported")
        self._sync_device()
        return self._publish(lease)

    # -- release / GC --

    def release(self, lease_ids: Iterable[str]) -> int:
        """End these leases (idempotent); returns how many named a live lease. The others (already released,
        reclaimed, or never minted here) are counted in ``stats().unknown_releases``."""
        if isinstance(lease_ids, str):
            lease_ids = [lease_ids]
        ended = unknown = 0
        try:
            for lease_id in lease_ids:
                if self._end_lease(lease_id):
                    ended += 1
                else:
                    unknown += 1
        finally:
            with self._tally.locked() as c:
                c.releases += ended
                c.unknown_releases += unknown
        return ended

    def collect_garbage(self, now: float | None = None) -> int:
        """Reclaim leases older than ``slot_gc_timeout_ms``; the GC thread calls this. Returns the count."""
        now = time.monotonic() if now is None else now
        ttl = self._cfg.slot_gc_timeout_ms / 1000.0
        with self._lock:
            expired = [lid for lid, lease in self._leases.items() if now - lease.created_s >= ttl]
        reclaimed = sum(1 for lid in expired if self._end_lease(lid))
        if reclaimed:
            with self._tally.locked() as c:
                c.gc_reclaims += reclaimed
            log.warning(
                "rdma GC reclaimed %d lease(s) older than %d ms; are readers releasing?",
                reclaimed,
                self._cfg.slot_gc_timeout_ms,
            )
        return reclaimed

    def _gc_loop(self) -> None:
        # Wake at most 4 times per TTL (at least every 10 ms, at most every 1 s): negligible CPU when idle.
        interval = min(1.0, max(0.01, self._cfg.slot_gc_timeout_ms / 4000.0))
        while not self._gc_stop.wait(interval):
            try:
                self.collect_garbage()
            except Exception:
                log.exception("rdma GC pass failed")

    # -- introspection / lifecycle --

    def stats(self) -> ExporterStats:
        """Counters since construction, leases and pool now, and the provider's stats; works after ``close``."""
        with self._lock:
            live = len(self._leases)
        return dataclasses.replace(
            self._tally.snapshot(),
            provider=self.provider_name,
            device=self._cfg.device,
            live_leases=live,
            pool=self._pool.stats() if self._pool is not None else PoolStats(),
            provider_stats=self._provider.stats() if self._provider is not None else ProviderStats(),
        )

    def close(self) -> None:
        """Stop GC and the metadata endpoint, void every lease, deregister everything. Idempotent."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            outstanding = len(self._leases)
            self._leases.clear()
        self._gc_stop.set()
        if self._gc_thread is not None and self._gc_thread is not threading.current_thread():
            self._gc_thread.join(timeout=5.0)
        if outstanding:
            log.info("rdma exporter closing with %d outstanding lease(s)", outstanding)
        if self._pool is not None:
            self._pool.force_close()
        if self._gens is not None and self._gens.reg is not None and self._provider is not None:
            try:
                self._provider.deregister(self._gens.reg)
            except Exception:
                log.warning("deregistering the generation table failed", exc_info=True)
            self._gens.reg = None
        if self._provider is not None:
            self._provider.close()

    def __enter__(self) -> TensorExporter:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- internals --

    def _check_open(self) -> None:
        if self._closed:
            raise ClosedError("TensorExporter is closed")

    def _check_inputs(self, tensors: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        if isinstance(tensors, torch.Tensor):
            raise ExportError("export takes a sequence of tensors, not one tensor", reason=Reason.EMPTY_EXPORT)
        tensors = list(tensors)
        if not tensors:
            raise ExportError("nothing to export: empty tensor list", reason=Reason.EMPTY_EXPORT)
        out = []
        for i, t in enumerate(tensors):
            if not isinstance(t, torch.Tensor):
                raise ExportError(f"input {i} is a {type(t).__name__}, not a torch.Tensor")
            if not _dtypes.is_supported(t.dtype):
                raise ExportError(f"input {i}: unsupported dtype {t.dtype}", reason=Reason.UNSUPPORTED_DTYPE)
            if t.device != tensors[0].device:
                raise ExportError(
                    f"input {i} is on {t.device}, input 0 on {tensors[0].device}", reason=Reason.MIXED_DEVICES
                )
            if not _same_device(t.device, self._device):
                raise ExportError(
                    f"input {i} is on {t.device}, the exporter is configured for {self._device}",
                    reason=Reason.WRONG_DEVICE,
                )
            if t.layout != torch.strided or t.is_sparse:
                raise ExportError(f"input {i} has layout {t.layout}; only dense tensors", reason=Reason.NOT_CONTIGUOUS)
            out.append(t if t.is_contiguous() else t.contiguous())
        return out

    def _layout(self, specs: list[tuple[tuple[int, ...], torch.dtype]]) -> tuple[tuple[TensorMeta, ...], int]:
        manifest, payload = layout(specs, self._cfg.slot_align)
        if payload > self._cfg.max_slot_bytes:
            raise ExportError(
                f"{len(specs)} tensor(s) need {payload} bytes (aligned to {self._cfg.slot_align}), over "
                f"max_slot_bytes {self._cfg.max_slot_bytes}; split the export",
                reason=Reason.SLOT_TOO_LARGE,
            )
        return tuple(manifest), payload

    def _new_lease(self, manifest: tuple[TensorMeta, ...], payload: int) -> Lease:
        assert self._pool is not None
        slot = self._pool.acquire(payload)
        with self._lock:
            if self._closed:
                self._pool.release(slot)
                raise ClosedError("TensorExporter is closed")
            lease_id = new_lease_id()
            while lease_id in self._leases:  # 2**-128 per live lease: never in practice, but never a shared id
                lease_id = new_lease_id()
            lease = Lease(
                lease_id=lease_id, slot=slot, manifest=manifest, payload_bytes=payload, created_s=time.monotonic()
            )
            self._leases[lease.lease_id] = lease
        return lease

    def _end_lease(self, lease_id: str) -> bool:
        with self._lock:
            lease = self._leases.pop(lease_id, None) if isinstance(lease_id, str) else None
        if lease is None:
            return False
        if self._pool is not None:
            self._pool.release(lease.slot)
        return True

    def _copy_in(self, lease: Lease, inputs: list[torch.Tensor]) -> None:
        dests = views(lease.slot.tensor, lease.manifest, lease.slot.typed)
        if self._device.type == "cuda":
            with torch.cuda.device(self._device):
                for v, t in zip(dests, inputs, strict=True):
                    v.copy_(t)
                # The copies run on the caller's current stream after the producer's work; waiting for them
                # here is the "visible before the descriptor exists" contract.
                torch.cuda.current_stream(self._device).synchronize()
        else:
            # Plain memcpy (inputs are contiguous host tensors): torch's parallel copy wakes an OpenMP pool,
            # which costs milliseconds on a small busy host.
            for v, t, m in zip(dests, inputs, lease.manifest, strict=True):
                if m.nbytes:
                    ctypes.memmove(v.data_ptr(), t.data_ptr(), m.nbytes)

    def _sync_device(self) -> None:
        if self._device.type == "cuda":
            # Stream.synchronize sets its own device (c10 DeviceGuard): no torch.cuda.device() switch around it.
            torch.cuda.current_stream(self._device).synchronize()

    def _publish(self, lease: Lease) -> Descriptor:
        assert self._owner is not None and self._provider is not None and self._gens is not None
        epoch = self._provider.registration_epoch
        owner = self._published_owner
        if owner is None or owner.registration_epoch != epoch:  # Owner is immutable: one per registration epoch
            owner = self._published_owner = dataclasses.replace(self._owner, registration_epoch=epoch)
        slot = lease.slot
        binding, generation = self._gens.bind(slot.gen_index, slot.addr, lease.payload_bytes)
        desc = Descriptor(
            owner=owner,
            mem_type=self._pool.mem_type if self._pool else "DRAM",
            device_id=self._cfg.device_index,
            slot_addr=slot.addr,
            payload_bytes=lease.payload_bytes,
            lease_id=lease.lease_id,
            generation=generation,
            generation_addr=self._gens.addr_of(slot.gen_index),
            manifest=lease.manifest,
            binding=binding,
        )
        lease.descriptor = desc
        with self._tally.locked() as c:
            c.exports += 1
            c.exported_bytes += desc.nbytes
        return desc


def _same_device(a: torch.device, b: torch.device) -> bool:
    return a.type == b.type and (a.type != "cuda" or (a.index or 0) == (b.index or 0))


def _check_cuda_device(index: int) -> None:
    if not torch.cuda.is_available() or index >= torch.cuda.device_count():
        raise ExportError(f"device cuda:{index} is not available in this process", reason=Reason.PROVIDER_UNAVAILABLE)
