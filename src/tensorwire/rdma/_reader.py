"""``TensorReader``: validates descriptors, READs the slots, checks generations, returns owned tensors.

Destinations: a payload below ``LOAN_READ_BYTES`` lands in a pooled registered buffer and is cloned out. A larger
payload is READ into a *loaned* registered buffer and the result tensors are views of it: no second copy (one more
GPU operation per fetch), no page faults and no registration per read. Below the threshold a clone is cheap and a
loan would pin a whole bucket for a few bytes. Host loans are numpy views (``torch.from_numpy``); device loans are
small objects exposing ``__cuda_array_interface__`` (``torch.as_tensor`` keeps them referenced from the tensor's
storage). The loan ends when the caller drops the last result tensor (``weakref.finalize`` on that object), and the
buffer goes back to its pool still registered. A device loan records a CUDA event on the dropping thread's current
stream when it comes back (as does a pooled device buffer once the clones out of it are queued), and the next READ
into that buffer waits for the event: like the caching allocator, work the caller queued on that stream before
dropping the tensor is safe; work on other streams needs ``record_stream``-style care (keep the tensor until it is
done). The tensors of one descriptor share that storage; they outlive the reader, later reads and the remote lease
(at ``close`` the loaned buffers are deregistered but stay allocated while referenced). When loans exceed their
share of the cap, host reads of ``LARGE_READ_BYTES`` or more fall back to fresh result tensors registered for the
one read, other reads to the pooled buffer and a clone. After a ``ReadTimeout`` the destinations are quarantined
until the provider reports the transfer finished; a quarantined pooled buffer is never handed out again before
that, and a fresh tensor is never returned."""

from __future__ import annotations

import ctypes
import dataclasses
import logging
import threading
import time
import weakref
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import torch

from tensorwire.errors import (
    ClosedError,
    InvalidDescriptor,
    InvalidPayload,
    LeaseExpired,
    PoolExhausted,
    ReadError,
    ReadTimeout,
    Reason,
)
from tensorwire.rdma import _local
from tensorwire.rdma._config import RdmaConfig
from tensorwire.rdma._descriptor import Descriptor, Owner, TensorMeta, views
from tensorwire.rdma._devmem import wrap_device
from tensorwire.rdma._pool import Slot, SlotPool
from tensorwire.rdma._stats import PoolStats, ProviderStats, ReaderStats, Tally
from tensorwire.rdma.providers import create_provider
from tensorwire.rdma.providers.base import ROLE_READER, PendingTransfer, Provider, Range, Registration

log = logging.getLogger(__name__)

LOAN_READ_BYTES = 256 << 10  # payloads from here on are READ into loaned buffers (no clone out)
# Host reads from here on fall back to fresh tensors registered for the one read when loans are exhausted; below
# it registering per read costs more than the pooled buffer's clone.
LARGE_READ_BYTES = 4 << 20
# Loaned host buffers: at most this share of pool_cap_bytes may be out with callers at once; beyond it large
# reads fall back to freshly allocated, registered-per-read tensors (slow: page faults + registration).
_LOAN_SHARE = 0.5
_GEN_CELLS = 4096


@dataclass(eq=False)
class _Quarantined:
    """A timed-out batch's destinations, held until ``pending.poll()``: the engine may still write into them."""

    pending: PendingTransfer
    slots: list[tuple[SlotPool, Slot]] = field(default_factory=list)  # pooled buffers: released when done
    regs: list[Registration] = field(default_factory=list)  # per-read registrations: deregistered when done
    cells: list[int] = field(default_factory=list)  # generation scratch cells: given back when done
    results: list[torch.Tensor] = field(default_factory=list)  # fresh result tensors: kept alive, never returned
    loans: list[Any] = field(default_factory=list)  # loan objects: kept, so their slots are not given back early


class _GenScratch:
    """Registered host cells the reader READs generation words into (8 bytes each)."""

    def __init__(self, provider: Provider) -> None:
        self.words = torch.zeros(_GEN_CELLS, dtype=torch.int64)
        self.values = self.words.numpy()  # element access through numpy: ~20x cheaper than torch indexing
        self._base = self.words.data_ptr()
        self.reg = provider.register(self._base, _GEN_CELLS * 8, "DRAM", 0)
        self._free = list(range(_GEN_CELLS))
        self._lock = threading.Lock()

    def take(self, n: int) -> list[int]:
        with self._lock:
            if len(self._free) < n:
                raise ReadError(
                    f"more than {_GEN_CELLS} descriptors in flight in one reader", reason=Reason.RDMA_READ_ERROR
                )
            # LIFO: the same few cells recur, so the provider can repost its prepared generation READs.
            cells = self._free[len(self._free) - n :]
            del self._free[len(self._free) - n :]
        for c in cells:
            self.values[c] = 0
        return cells

    def give_back(self, cells: list[int]) -> None:
        with self._lock:
            self._free.extend(cells)

    def addr(self, cell: int) -> int:
        return self._base + cell * 8


class TensorReader:
    """Reader side of the rdma layer. ``read`` is thread-safe; use as a context manager or call ``close()``."""

    def __init__(self, config: RdmaConfig | None = None) -> None:
        self._cfg = config or RdmaConfig()
        self._closed = False
        self._lock = threading.Lock()
        self._quarantine: list[_Quarantined] = []
        self._tally = Tally(ReaderStats())  # counters only; stats() fills in the gauges
        self._provider: Provider | None = None
        self._pool: SlotPool | None = None
        self._loans: SlotPool | None = None
        self._staging: SlotPool | None = None
        self._scratch: _GenScratch | None = None
        self._device_loans = True
        # Owners (pid) a same-host copy can never reach (EPERM, ESRCH): read through the provider from then on.
        self._no_copy: set[int] = set()
        self._copied_from: set[int] = set()  # owners (pid) whose first copy was logged
        self._copies = bool(self._cfg.same_host_copy) and self._cfg.device == "cpu" and _local.available()
        try:
            self._device = torch.device(self._cfg.device)
            self._mem_type = "VRAM" if self._device.type == "cuda" else "DRAM"
            if self._device.type == "cuda" and (
                not torch.cuda.is_available() or self._cfg.device_index >= torch.cuda.device_count()
            ):
                raise ReadError(f"device {self._cfg.device} is not available", reason=Reason.PROVIDER_UNAVAILABLE)
            if self._device.type == "cuda":
                torch.empty(1, device=self._device)  # CUDA context before the NIXL agent (nixl-on-cpu.md §6)
            self._provider = create_provider(self._cfg, role=ROLE_READER)
            self._pool = SlotPool(self._provider, self._cfg, generations=None)
            self._loans = SlotPool(
                self._provider,
                self._cfg,
                generations=None,
                numpy_backed=True,
                cap_bytes=max(int(self._cfg.pool_cap_bytes * _LOAN_SHARE), self._cfg.max_slot_bytes),
            )
            # A CUDA reader stages host-memory descriptors through registered host buffers (see _read_one).
            self._staging = (
                self._loans
                if self._device.type == "cpu"
                else SlotPool(
                    self._provider,
                    self._cfg.replace(device="cpu"),
                    generations=None,
                    numpy_backed=True,
                    cap_bytes=max(int(self._cfg.pool_cap_bytes * _LOAN_SHARE), self._cfg.max_slot_bytes),
                )
            )
            self._scratch = _GenScratch(self._provider)
        except BaseException:
            self.close()
            raise

    @property
    def config(self) -> RdmaConfig:
        return self._cfg

    @property
    def ready(self) -> bool:
        return not self._closed and self._provider is not None

    @property
    def provider_name(self) -> str:
        return self._provider.name if self._provider is not None else "none"

    def transport(self, descriptor: Descriptor | None = None) -> str:
        """The UCX transport the last READ (from ``descriptor``'s owner, when given) went over, or "unknown"."""
        if self._provider is None:
            return "unknown"
        remote = descriptor.mem_type if descriptor is not None else None
        local = "DRAM" if remote == "DRAM" else self._mem_type  # host descriptors are staged in host memory
        return self._provider.transport(local, remote)

    def read(
        self,
        descriptors: Sequence[Descriptor | bytes],
        timeout_ms: int | None = None,
        *,
        into: Sequence[torch.Tensor] | None = None,
    ) -> list[torch.Tensor]:
        """Fetch every descriptor's tensors: flattened in descriptor order x manifest order.

        The tensors are on the reader's device, own their storage and outlive the reader and the remote lease.
        ``timeout_ms`` (default ``read_timeout_ms``) bounds the whole call; <= 0 fails at once with ReadTimeout.
        ``into``: one caller-owned destination per descriptor (a contiguous uint8 host tensor of at least the
        descriptor's payload bytes, for example a shared-memory mapping), registered for this read only; the
        tensors returned are then views of it. Host readers only.
        Raises, before touching memory, InvalidDescriptor and InvalidPayload (reason INVALID_REQUEST: an ``into``
        of another length than ``descriptors``, on a GPU reader, or a destination that is not a contiguous uint8
        host tensor of at least its descriptor's payload bytes); then ReadTimeout, LeaseExpired (stale
        generation), ReadError.
        """
        if self._closed:
            raise ClosedError("TensorReader is closed")
        timeout = self._cfg.read_timeout_ms if timeout_ms is None else timeout_ms
        deadline = time.monotonic() + timeout / 1000.0
        descs = self._validate(descriptors)
        if into is not None:
            _check_into(into, descs, self._device)
        if timeout <= 0:
            raise ReadTimeout(f"read budget {timeout} ms is already exhausted", reason=Reason.READ_TIMEOUT)
        self._drain_quarantine()
        try:
            out = self._read_batch(descs, deadline, into)
        except ReadTimeout:
            with self._tally.locked() as c:
                c.read_timeouts += 1
            raise
        except LeaseExpired:
            with self._tally.locked() as c:
                c.stale_generations += 1
            raise
        except ReadError:
            with self._tally.locked() as c:
                c.read_errors += 1
            raise
        with self._tally.locked() as c:
            c.reads += 1
            c.read_descriptors += len(descs)
        return out

    def stats(self) -> ReaderStats:
        """Counters since construction, buffers and loans now, and the provider's stats; works after ``close``."""
        return dataclasses.replace(
            self._tally.snapshot(),
            provider=self.provider_name,
            device=self._cfg.device,
            quarantine_live=len(self._quarantine),
            buffers=self._pool.stats() if self._pool is not None else PoolStats(),
            loans=self._loans.stats() if self._loans is not None else PoolStats(),
            provider_stats=self._provider.stats() if self._provider is not None else ProviderStats(),
        )

    def close(self) -> None:
        """Release buffers and the provider; idempotent. Transfers still in flight are abandoned first."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
        self._drain_quarantine(wait_s=1.0)
        leftover = self._quarantine
        for q in leftover:
            q.pending.abandon()
        if self._pool is not None:
            self._pool.close()
        if self._loans is not None:
            self._loans.close()
        if self._staging is not None and self._staging is not self._loans:
            self._staging.close()
        if self._scratch is not None and self._provider is not None:
            try:
                self._provider.deregister(self._scratch.reg)
            except Exception:
                log.warning("deregistering the generation scratch failed", exc_info=True)
        if self._provider is not None:
            self._provider.close()
        if leftover:
            # The engine is gone now, so nothing can write into these buffers any more; drop them.
            log.warning("rdma reader closed with %d transfer(s) still in flight after their deadline", len(leftover))
            self._quarantine = []

    def __enter__(self) -> TensorReader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- internals --

    def _validate(self, descriptors: Sequence[Descriptor | bytes]) -> list[Descriptor]:
        if isinstance(descriptors, (Descriptor, bytes, bytearray)):
            descriptors = [descriptors]
        out = []
        try:
            for d in descriptors:
                if isinstance(d, (bytes, bytearray, memoryview)):
                    d = Descriptor.from_bytes(
                        d, max_slot_bytes=self._cfg.max_slot_bytes, slot_align=self._cfg.slot_align
                    )
                elif isinstance(d, Descriptor):
                    d.validate(max_slot_bytes=self._cfg.max_slot_bytes, slot_align=self._cfg.slot_align)
                else:
                    raise InvalidDescriptor(f"expected a Descriptor or bytes, got {type(d).__name__}")
                out.append(d)
        except InvalidDescriptor:
            with self._tally.locked() as c:
                c.invalid_descriptors += 1
            raise
        if not out:
            raise InvalidDescriptor("no descriptors to read", reason=Reason.EMPTY_MANIFEST)
        return out

    def _read_batch(
        self, descs: list[Descriptor], deadline: float, into: Sequence[torch.Tensor] | None = None
    ) -> list[torch.Tensor]:
        """All descriptors in as few transfers as possible: one payload READ per (owner, memory pair), then, once
        every payload READ completed, one generation READ per owner (see _pool's module docstring)."""
        assert self._provider is not None and self._scratch is not None
        cells = self._scratch.take(len(descs))
        dests: list[_Dest] = []
        out: list[torch.Tensor] = []
        finished = False
        try:
            for i, (d, cell) in enumerate(zip(descs, cells, strict=True)):
                by_copy = self._can_copy(d)
                x = self._destination(d, cell, by_copy) if into is None else self._given(d, cell, into[i], by_copy)
                dests.append(x)
            if any(x.by_copy for x in dests):
                self._copy(dests)
            for owner, local_mem, remote_mem, group in _groups([x for x in dests if not x.by_copy], by_memory=True):
                local = [r for x in group for r in x.local]
                if local:
                    self._provider.read(
                        owner, local_mem, local, remote_mem, [r for x in group for r in x.remote], deadline=deadline
                    )
            for owner, _, _, group in _groups([x for x in dests if not x.by_copy], by_memory=False):
                self._provider.read(
                    owner,
                    "DRAM",
                    [(self._scratch.addr(x.cell), 8, 0) for x in group],
                    "DRAM",
                    [(x.d.generation_addr, 8, 0) for x in group],
                    deadline=deadline,
                )
            for x in dests:
                current = int(self._scratch.values[x.cell])
                if current != x.d.generation:
                    raise LeaseExpired(
                        f"lease {x.d.lease_id}: slot generation is {current}, descriptor has {x.d.generation}; the "
                        "lease was released, reclaimed or the slot reused",
                        reason=Reason.STALE_GENERATION,
                    )
            for x in dests:
                if x.slot is not None:
                    srcs = views(x.slot.tensor, x.d.manifest, x.slot.typed)
                    x.results = [self._clone_out(src, m, x.staged) for src, m in zip(srcs, x.d.manifest, strict=True)]
                    if not x.staged and self._device.type == "cuda":
                        self._mark_ready(x.slot)  # the clones are queued, not done, when the slot goes back
                _check_results(x.d, x.results)
                out.extend(x.results)
                with self._tally.locked() as c:
                    c.read_bytes += x.d.nbytes
            finished = True
            return out
        except ReadTimeout as exc:
            pending = getattr(exc, "pending", None)
            if pending is not None:
                # Which transfer is still writing is not worth tracking: every destination of the batch waits.
                with self._tally.locked() as c:
                    c.quarantined += 1
                q = _Quarantined(
                    pending=pending,
                    slots=[(x.pool, x.slot) for x in dests if x.slot is not None and x.pool is not None],
                    regs=[r for x in dests for r in x.regs],
                    cells=list(cells),
                    results=[t for x in dests for t in x.results],
                    loans=[x.loan for x in dests],
                )
                with self._lock:
                    self._quarantine.append(q)
                for x in dests:
                    x.slot, x.regs = None, []
                cells = []
            raise
        finally:
            for x in dests:
                if x.slot is not None and x.pool is not None:
                    x.pool.release(x.slot)
                for r in x.regs:
                    self._provider.deregister(r)
            if cells:
                self._scratch.give_back(cells)
            if not finished:  # the traceback keeps this frame alive: drop what would keep loans out
                out = []
                for x in dests:
                    x.results.clear()
                    x.loan = None

    def _destination(self, d: Descriptor, cell: int, by_copy: bool = False) -> _Dest:
        """Where ``d``'s payload lands: a loaned buffer, fresh tensors (registered unless ``by_copy``), or a pooled
        buffer to clone from."""
        assert self._provider is not None and self._pool is not None
        host = self._device.type == "cpu"
        # Host-memory owner, GPU reader: UCX cannot READ host memory of another process straight into GPU memory
        # over CMA, so the bytes land in a registered host buffer and are copied to the device afterwards.
        staged = not host and d.mem_type == "DRAM"
        x = _Dest(d=d, cell=cell, staged=staged, local_mem="DRAM" if staged else self._mem_type, by_copy=by_copy)
        dev = self._cfg.device_index
        loaned = self._loan(d.payload_bytes) if not staged and d.payload_bytes >= LOAN_READ_BYTES else None
        wrapped = self._loan_tensor(loaned, d.payload_bytes) if loaned is not None else None
        if loaned is not None and wrapped is not None:
            base, x.loan = wrapped
            x.results = views(base, d.manifest)
            x.local.append((loaned.addr, d.payload_bytes, dev))
            x.remote.append((d.slot_addr, d.payload_bytes, d.device_id))
        elif host and d.payload_bytes >= LARGE_READ_BYTES:  # loans exhausted: fresh tensors, registered once
            for m in d.manifest:
                t = torch.empty(m.shape, dtype=m.dtype, device=self._device)
                x.results.append(t)
                if m.nbytes:
                    if by_copy:
                        x.unregistered.append((t.data_ptr(), m.nbytes, dev))
                    else:
                        x.regs.append(self._provider.register(t.data_ptr(), m.nbytes, self._mem_type, dev))
                    x.local.append((t.data_ptr(), m.nbytes, dev))
                    x.remote.append((d.slot_addr + m.offset, m.nbytes, d.device_id))
        else:
            x.pool = self._staging if staged else self._pool
            assert x.pool is not None
            x.slot = _ready(x.pool, x.pool.acquire(d.payload_bytes))
            x.local.append((x.slot.addr, d.payload_bytes, 0 if staged else dev))
            x.remote.append((d.slot_addr, d.payload_bytes, d.device_id))
        return x

    def _given(self, d: Descriptor, cell: int, dest: torch.Tensor, by_copy: bool = False) -> _Dest:
        """``d``'s payload lands in the caller's ``dest``, registered for this read (unless ``by_copy``)."""
        assert self._provider is not None
        x = _Dest(d=d, cell=cell, staged=False, local_mem=self._mem_type, by_copy=by_copy)
        x.results = views(dest[: d.payload_bytes], d.manifest)
        if d.payload_bytes:
            if by_copy:
                x.unregistered.append((dest.data_ptr(), d.payload_bytes, 0))
            else:
                x.regs.append(self._provider.register(dest.data_ptr(), d.payload_bytes, self._mem_type, 0))
            x.local.append((dest.data_ptr(), d.payload_bytes, 0))
            x.remote.append((d.slot_addr, d.payload_bytes, d.device_id))
        return x

    def _can_copy(self, d: Descriptor) -> bool:
        """Whether ``d`` is copied on this host rather than READ (``_local``'s contract)."""
        o = d.owner
        return (
            self._copies
            and d.mem_type == "DRAM"
            and d.binding != 0
            and o.pid != 0
            and o.host_id == _local.host_id()
            and o.pid not in self._no_copy
        )

    def _copy(self, dests: list[_Dest]) -> None:
        """Copies each ``by_copy`` destination's payload and then its generation word into its scratch cell, in
        one ``process_vm_readv`` (``_local.copy_from`` keeps the order the generation protocol needs); a
        destination whose copy fails goes back to the provider's READ (its ranges registered now)."""
        assert self._provider is not None and self._scratch is not None
        copies = 0
        for x in dests:
            if not x.by_copy:
                continue
            pid = x.d.owner.pid
            try:
                _local.copy_from(
                    pid,
                    [(a, n) for a, n, _ in x.local] + [(self._scratch.addr(x.cell), 8)],
                    [(a, n) for a, n, _ in x.remote] + [(x.d.generation_addr, 8)],
                )
            except _local.LocalCopyFailed as exc:
                self._copy_failed(x, exc)
                continue
            copies += 1
            if pid not in self._copied_from:
                if len(self._copied_from) >= 4096:
                    self._copied_from.clear()
                self._copied_from.add(pid)
                log.info("reading %s (pid %d) on this host with process_vm_readv", x.d.owner.agent_name, pid)
        if copies:
            with self._tally.locked() as c:
                c.same_host_copies += copies

    def _copy_failed(self, x: _Dest, exc: _local.LocalCopyFailed) -> None:
        assert self._provider is not None
        # Once per owner when it can never work (another user, a gone process); a bad address is per descriptor.
        log.log(
            logging.WARNING if exc.permanent else logging.DEBUG,
            "same-host copy from %s (pid %d) failed (%s); reading through %s",
            x.d.owner.agent_name,
            x.d.owner.pid,
            exc,
            self.provider_name,
        )
        if exc.permanent:
            if len(self._no_copy) >= 4096:  # pids of owners long gone; a live one is relearned with one failure
                self._no_copy.clear()
            self._no_copy.add(x.d.owner.pid)
        x.by_copy = False
        for a, n, dev in x.unregistered:
            x.regs.append(self._provider.register(a, n, self._mem_type, dev))
        x.unregistered = []

    def _loan(self, nbytes: int) -> Slot | None:
        """A loaned buffer for a large READ, or None when loans are at their share of the cap."""
        assert self._loans is not None
        if not self._device_loans:
            return None
        try:
            slot = self._loans.acquire(nbytes)
        except PoolExhausted:
            return None
        return _ready(self._loans, slot)  # the previous borrower's queued kernels may still read it

    def _loan_tensor(self, slot: Slot, nbytes: int) -> tuple[torch.Tensor, Any] | None:
        """(a uint8 tensor over the loaned bytes, the object whose finalizer gives the slot back); None (slot given
        back, device loans switched off) when torch cannot wrap device memory this way."""
        assert self._loans is not None
        if self._device.type == "cpu":
            loan = slot.array[:nbytes]
            weakref.finalize(loan, self._loans.release, slot)
            return torch.from_numpy(loan), loan
        try:
            base, loan = wrap_device(slot.addr, nbytes, self._device)
        except Exception as exc:
            self._loans.release(slot)
            self._device_loans = False
            log.warning("device loans off (reads clone out of pooled buffers instead): %r", exc)
            return None
        weakref.finalize(loan, self._end_device_loan, slot)
        return base, loan

    def _end_device_loan(self, slot: Slot) -> None:
        assert self._loans is not None
        self._mark_ready(slot)
        self._loans.release(slot)

    def _mark_ready(self, slot: Slot) -> None:
        """Work queued on the current stream still reads ``slot``: the next READ into it waits (``_ready``)."""
        try:
            # One event per buffer, recorded again at each return: creating and destroying a CUDA event per read
            # cost two more driver calls. Uses never overlap: the next READ into the slot waited for it (_ready).
            event = slot.event
            if event is None:
                event = slot.event = torch.cuda.Event()  # type: ignore[no-untyped-call]  # torch: unannotated
            event.record(torch.cuda.current_stream(self._device))
            slot.ready = event
        except Exception:  # no event, no ordering: wait for the device instead of risking an overwrite
            slot.ready = None
            try:
                torch.cuda.synchronize(self._device)
            except Exception:
                log.debug("device sync before reusing a buffer failed", exc_info=True)

    def _clone_out(self, src: torch.Tensor, m: TensorMeta, staged: bool = False) -> torch.Tensor:
        if staged:  # host staging buffer -> the reader's GPU; synchronous, so the buffer can be reused at once
            with torch.cuda.device(self._device):
                return src.to(self._device)
        if self._device.type == "cuda":
            # clone() allocates and runs on src's device (the reader's) and that device's current stream, the one
            # _mark_ready records on, whatever device is current: no torch.cuda.device() switch per tensor.
            return src.clone()
        # A plain single-threaded memcpy: torch's parallel copy wakes its OpenMP pool, which costs milliseconds
        # on a small, busy host (measured 2 ms for 1 MiB on 2 cores next to the NIXL progress thread).
        out = torch.empty(m.shape, dtype=m.dtype)
        if m.nbytes:
            ctypes.memmove(out.data_ptr(), src.data_ptr(), m.nbytes)
        return out

    def _drain_quarantine(self, wait_s: float = 0.0) -> None:
        if not self._quarantine:
            return
        end = time.monotonic() + wait_s
        while True:
            with self._lock:
                live = self._quarantine
                self._quarantine = []
            still = []
            for q in live:
                if q.pending.poll():
                    with self._tally.locked() as c:
                        c.quarantine_freed += 1
                    for owner_pool, s in q.slots:
                        owner_pool.release(s)
                    for r in q.regs:
                        assert self._provider is not None
                        self._provider.deregister(r)
                    if q.cells:
                        assert self._scratch is not None
                        self._scratch.give_back(q.cells)
                else:
                    still.append(q)
            with self._lock:
                self._quarantine.extend(still)
            if not still or time.monotonic() >= end:
                return
            time.sleep(0.005)


@dataclass(eq=False)
class _Dest:
    """One descriptor's destination within a batched read."""

    d: Descriptor
    cell: int  # generation scratch cell
    staged: bool
    local_mem: str
    pool: SlotPool | None = None  # with slot: a pooled buffer the results are cloned out of
    slot: Slot | None = None
    loan: Any = None  # the object whose finalizer returns a loaned slot (see _loan_tensor)
    regs: list[Registration] = field(default_factory=list)
    results: list[torch.Tensor] = field(default_factory=list)
    local: list[Range] = field(default_factory=list)
    remote: list[Range] = field(default_factory=list)
    # Same-host copy: the local ranges are copied with process_vm_readv; ``unregistered`` are those the provider
    # would need registered if the copy fails and the bytes are READ after all.
    by_copy: bool = False
    unregistered: list[Range] = field(default_factory=list)


class _GroupKey(NamedTuple):
    agent_name: str
    local_mem: str  # "" when grouping by owner only
    remote_mem: str


class _Group(NamedTuple):
    """Destinations READ in one transfer: one owner and one (local, remote) memory pair."""

    owner: Owner
    local_mem: str
    remote_mem: str
    dests: list[_Dest]


def _groups(dests: list[_Dest], *, by_memory: bool) -> list[_Group]:
    """Destinations grouped per owner agent (and memory pair), in first-seen order; each group's Owner is the one
    with the newest registration epoch, so the provider refreshes stale metadata once for the whole group."""
    groups: dict[_GroupKey, list[_Dest]] = {}
    for x in dests:
        key = (
            _GroupKey(x.d.owner.agent_name, x.local_mem, x.d.mem_type)
            if by_memory
            else _GroupKey(x.d.owner.agent_name, "", "")
        )
        groups.setdefault(key, []).append(x)
    return [
        _Group(max((x.d.owner for x in g), key=lambda o: o.registration_epoch), k.local_mem, k.remote_mem, g)
        for k, g in groups.items()
    ]


def _check_into(into: Sequence[torch.Tensor], descs: list[Descriptor], device: torch.device) -> None:
    """InvalidPayload (INVALID_REQUEST) unless ``into`` is one host destination per descriptor, each a contiguous
    uint8 CPU tensor of at least that descriptor's payload bytes, for a host reader."""
    if device.type != "cpu":
        raise InvalidPayload(f"into: host readers only, this one reads to {device}", reason=Reason.INVALID_REQUEST)
    if len(into) != len(descs):
        raise InvalidPayload(
            f"into: one destination per descriptor, got {len(into)} for {len(descs)}", reason=Reason.INVALID_REQUEST
        )
    for i, (d, t) in enumerate(zip(descs, into, strict=True)):
        if not isinstance(t, torch.Tensor):
            wrong = f"a {type(t).__name__}"
        elif t.device.type != "cpu":
            wrong = f"a tensor on {t.device}"
        elif t.dtype != torch.uint8:
            wrong = f"a {t.dtype} tensor"
        elif not t.is_contiguous():
            wrong = "a tensor that is not contiguous"
        elif t.numel() < d.payload_bytes:
            wrong = f"{t.numel()} bytes"
        else:
            continue
        raise InvalidPayload(
            f"into[{i}]: a contiguous uint8 host tensor of >= {d.payload_bytes} bytes expected, got {wrong}",
            reason=Reason.INVALID_REQUEST,
        )


def _ready(pool: SlotPool, slot: Slot) -> Slot:
    """``slot`` once the work that still read it when it was given back has run (``TensorReader._mark_ready``).
    If waiting fails (a CUDA error), the slot goes back to ``pool`` and the read fails with ReadError."""
    if slot.ready is not None:
        try:
            slot.ready.synchronize()
        except Exception as exc:
            pool.release(slot)
            raise ReadError(
                f"waiting for work queued on a receive buffer failed: {exc}", reason=Reason.RDMA_READ_ERROR
            ) from exc
        slot.ready = None
    return slot


def _check_results(d: Descriptor, results: list[torch.Tensor]) -> None:
    if len(results) != len(d.manifest):
        raise ReadError(
            f"lease {d.lease_id}: {len(results)} tensors for {len(d.manifest)} manifest entries",
            reason=Reason.RESULT_MISMATCH,
        )
    for i, (t, m) in enumerate(zip(results, d.manifest, strict=True)):
        if tuple(t.shape) != m.shape or t.dtype != m.dtype or t.numel() * t.element_size() != m.nbytes:
            raise ReadError(
                f"lease {d.lease_id}: tensor {i} is {tuple(t.shape)}/{t.dtype}, manifest says {m.shape}/{m.dtype}",
                reason=Reason.RESULT_MISMATCH,
            )
