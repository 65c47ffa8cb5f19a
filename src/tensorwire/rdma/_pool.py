"""Registered slot pool (size buckets, cap, shrink) and the generation table that makes stale reads detectable.

Slot pool
---------
Slots are 1-D ``uint8`` tensors on the configured device, registered with the provider once and kept registered
while they sit on their bucket's free list. Buckets are powers of two from ``MIN_BUCKET_BYTES`` up to
``max_slot_bytes`` (the top bucket is ``max_slot_bytes`` itself). Pool-owned bytes (idle + busy) never exceed
``pool_cap_bytes``. When a new slot cannot be had (cap reached or out of memory) the pool runs, in order:
shrink 50% of the idle slots -> retry -> shrink every idle slot -> retry -> ``PoolExhausted``. Shrinking only
deregisters and frees idle slots; a busy (leased) slot is never touched.

Generation protocol (why a stale descriptor never returns a new tenant's bytes)
-------------------------------------------------------------------------------
Deregistration is not enforced by every transport (CMA reads deregistered memory happily), so staleness is
detected by the protocol, not by the transport:

1. The exporter keeps a *generation table*: one 8-byte word per slot in host memory that stays registered for the
   exporter's lifetime. Values are fresh random 63-bit numbers (never the word's previous value), so a (word,
   value) pair repeats with probability 2**-63, even when the word is later given to another slot, and a
   descriptor is unguessable: one built from a guessed slot address fails the check below, so holding a
   descriptor is what lets a reader use a slot's bytes.
2. A descriptor carries the slot's value at export time (``generation``) and the word's address.
3. Before a slot is reused, freed by shrink or reclaimed by GC, the exporter stores a fresh value into its word.
   That store completes (program order; a plain aligned 8-byte store on the CPU) before any byte of a new tenant
   is written into the slot, because the new tenant's copy is issued by the same code path afterwards.
4. The reader READs the payload, waits for that READ to complete, and only then READs the generation word. If the
   word still equals the descriptor's value the bytes are returned, else ``LeaseExpired(STALE_GENERATION)``.
5. Binding: at export the word is set to ``_descriptor.bound_generation`` of a fresh random ``binding`` and the slot's
   address and payload size, and the descriptor carries both. A reader checks the descriptor's generation against
   its binding before reading (``Descriptor.validate``), so a descriptor edited to point at other memory (keeping a
   real word's address and value) names no generation word: finding a word that matches would take a preimage of
   the hash. Without it, whoever holds one descriptor could READ any other slot of the owner through params it
   edits (and, with the same-host copy of ``_local``, any memory of the owner process).

Soundness: suppose the payload READ observed a byte of a new tenant. That byte was written after the bump (3),
and it was observed before the payload READ completed, which is before the generation READ started (4). So the
bump completed before the generation READ started, and the reader sees a value different from the descriptor's
(1: values do not repeat), and rejects. A torn 8-byte read cannot defeat this: the bump had completed before the
generation READ began. Release without reuse also bumps, so any read after ``release`` fails even if the old
bytes are still there. The argument does not depend on the slot memory still being mapped: only the table must
be, and it is registered until ``close``.
"""

from __future__ import annotations

import collections
import dataclasses
import logging
import mmap
import secrets
import threading
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from tensorwire.errors import ClosedError, ExportError, PoolExhausted, Reason, TensorwireError
from tensorwire.rdma._config import RdmaConfig
from tensorwire.rdma._descriptor import bound_generation
from tensorwire.rdma._stats import BucketStats, PoolStats, Tally
from tensorwire.rdma.providers.base import Provider, Registration

log = logging.getLogger(__name__)

MIN_BUCKET_BYTES = 4096
HUGE_PAGE_BYTES = 2 << 20
GENERATION_WORDS = 65536  # 512 KiB of host memory; bounds the number of live slots of one exporter


def host_buffer(nbytes: int) -> np.ndarray:
    """Anonymous mmap'd host memory as a numpy array; >= 2 MiB asks for transparent huge pages.

    Huge pages cut the per-page cost of CMA (``process_vm_readv`` pins and maps every page of both sides) and TLB
    misses of copies; with THP in "madvise" mode (common) plain allocations never get them.
    """
    buf = mmap.mmap(-1, max(nbytes, 1), flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    if nbytes >= HUGE_PAGE_BYTES and hasattr(mmap, "MADV_HUGEPAGE"):
        try:
            buf.madvise(mmap.MADV_HUGEPAGE)
        except OSError:  # THP disabled: plain pages still work
            pass
    return np.frombuffer(buf, dtype=np.uint8, count=nbytes)


def bucket_bytes(nbytes: int, max_slot_bytes: int) -> int:
    """The slot size used for a request of ``nbytes`` (a power of two, or ``max_slot_bytes`` at the top)."""
    size = MIN_BUCKET_BYTES
    while size < nbytes:
        size <<= 1
    return min(size, max(max_slot_bytes, nbytes))


class GenerationTable:
    """Registered host words holding the current generation of each slot (see the module docstring)."""

    def __init__(self, provider: Provider, words: int = GENERATION_WORDS) -> None:
        self._words = torch.zeros(words, dtype=torch.int64)
        self._view = self._words.numpy()
        self._free = collections.deque(range(words))
        self._lock = threading.Lock()
        self.reg: Registration | None = provider.register(self._words.data_ptr(), words * 8, "DRAM", 0)

    def addr_of(self, index: int) -> int:
        return self._words.data_ptr() + index * 8

    def take(self) -> int | None:
        """A free word index, freshly bumped; None when all words are in use."""
        with self._lock:
            if not self._free:
                return None
            index = self._free.popleft()
        self.bump(index)
        return index

    def give_back(self, index: int) -> None:
        self.bump(index)
        with self._lock:
            self._free.append(index)

    def bump(self, index: int) -> int:
        """Stores a fresh random value (1 .. 2**63-1, not the current one) in word ``index``; returns it."""
        with self._lock:
            value = secrets.randbits(63) or 1
            while value == self._view[index]:
                value = secrets.randbits(63) or 1
            self._view[index] = value
        return value

    def current(self, index: int) -> int:
        return int(self._view[index])

    def bind(self, index: int, slot_addr: int, payload_bytes: int) -> tuple[int, int]:
        """Stores the bound value of a fresh binding in word ``index`` (step 5); returns (binding, value)."""
        with self._lock:
            binding = secrets.randbits(64) or 1
            value = bound_generation(binding, slot_addr, payload_bytes)
            while value == self._view[index]:
                binding = secrets.randbits(64) or 1
                value = bound_generation(binding, slot_addr, payload_bytes)
            self._view[index] = value
        return binding, value


@dataclass(eq=False)
class Slot:
    """One registered buffer of ``nbytes`` (its bucket size)."""

    nbytes: int
    tensor: torch.Tensor
    reg: Registration
    gen_index: int = -1
    busy: bool = False
    array: Any = field(default=None, repr=False)  # the numpy owner of host memory (numpy_backed pools)
    # A CUDA event recorded when a reader's device slot came back (a loan dropped, or the clones out of a pooled
    # buffer queued): kernels reading it may still be queued, so the next READ into the slot waits for it first.
    ready: Any = field(default=None, repr=False)
    event: Any = field(default=None, repr=False)  # the CUDA event ``ready`` reuses (one per device slot)
    # ``tensor`` reinterpreted per dtype (_descriptor.views)
    typed: dict[torch.dtype, torch.Tensor] = field(default_factory=dict, repr=False)

    @property
    def addr(self) -> int:
        return int(self.tensor.data_ptr())


class SlotPool:
    """Size-bucketed registered slots; thread-safe. See the module docstring for the shrink sequence."""

    def __init__(
        self,
        provider: Provider,
        config: RdmaConfig,
        *,
        generations: GenerationTable | None,
        numpy_backed: bool = False,
        cap_bytes: int | None = None,
    ) -> None:
        self._provider = provider
        self._cfg = config
        self._gens = generations
        self._mem_type = "VRAM" if config.is_cuda else "DRAM"
        self._device = torch.device(config.device)
        # numpy_backed: host slots owned by a numpy array, so a torch tensor built with torch.from_numpy on a view
        # can report (weakref.finalize on that view) when the last tensor using the memory is gone.
        self._numpy_backed = numpy_backed and self._device.type == "cpu"
        self._cap = config.pool_cap_bytes if cap_bytes is None else cap_bytes
        self._free: dict[int, list[Slot]] = collections.defaultdict(list)
        self._busy: set[Slot] = set()
        self._total_bytes = 0
        self._lock = threading.RLock()
        self._closed = False
        self._tally = Tally(PoolStats(pool_cap_bytes=self._cap))

    @property
    def mem_type(self) -> str:
        return self._mem_type

    @property
    def total_bytes(self) -> int:
        return self._total_bytes

    def acquire(self, nbytes: int) -> Slot:
        """A busy slot of at least ``nbytes``; ``PoolExhausted`` after the shrink sequence."""
        size = bucket_bytes(nbytes, self._cfg.max_slot_bytes)
        with self._lock:
            if self._closed:
                raise ClosedError("slot pool is closed")
            free = self._free.get(size)
            if free:
                slot = self._pick(free)
                with self._tally.locked() as c:
                    c.slot_reuses += 1
                return self._mark_busy(slot)
            errors: list[str] = []
            for step in (None, 0.5, 1.0):
                if step is not None:
                    self._shrink_locked(step)
                new = self._try_new(size, errors)
                if new is not None:
                    return self._mark_busy(new)
            with self._tally.locked() as c:
                c.pool_exhausted += 1
            busy_bytes = sum(s.nbytes for s in self._busy)
            raise PoolExhausted(
                f"no slot of {size} bytes after shrinking every idle slot ({busy_bytes}/{self._cap} "
                f"bytes leased in {len(self._busy)} slots; last error: {errors[-1] if errors else 'none'}); "
                "raise pool_cap_bytes or check that readers release their leases"
            )

    def release(self, slot: Slot) -> None:
        """Bump the slot's generation, then put it back on its free list (registration kept)."""
        with self._lock:
            if slot not in self._busy:
                return
            if self._gens is not None:
                self._gens.bump(slot.gen_index)
            self._busy.discard(slot)
            slot.busy = False
            if self._closed:
                self._destroy(slot)
            else:
                self._free[slot.nbytes].append(slot)

    def shrink(self, fraction: float) -> int:
        """Free ``fraction`` of the idle slots (largest first); returns the bytes freed."""
        with self._lock:
            return self._shrink_locked(fraction)

    def stats(self) -> PoolStats:
        with self._lock:
            buckets: dict[int, BucketStats] = {}
            for size, slots in self._free.items():
                buckets[size] = BucketStats(idle=len(slots), busy=0)
            for s in self._busy:
                idle, busy = buckets.get(s.nbytes, BucketStats(0, 0))
                buckets[s.nbytes] = BucketStats(idle, busy + 1)
            return dataclasses.replace(
                self._tally.snapshot(),
                pool_bytes=self._total_bytes,
                busy_bytes=sum(s.nbytes for s in self._busy),
                idle_slots=sum(len(v) for v in self._free.values()),
                busy_slots=len(self._busy),
                buckets=dict(sorted(buckets.items())),
            )

    def close(self) -> int:
        """Deregister and free idle slots; busy ones are freed when released. Returns the busy count."""
        with self._lock:
            if self._closed:
                return len(self._busy)
            self._closed = True
            for slots in self._free.values():
                for slot in slots:
                    self._destroy(slot)
            self._free.clear()
            return len(self._busy)

    def force_close(self) -> None:
        """Free busy slots too (exporter close: every lease is void)."""
        with self._lock:
            self.close()
            for slot in list(self._busy):
                if self._gens is not None:
                    self._gens.bump(slot.gen_index)
                self._busy.discard(slot)
                self._destroy(slot)

    # -- internals (lock held) --

    def _pick(self, free: list[Slot]) -> Slot:
        """A free slot: the exporter's at random, so a peer cannot tell which slot the next export lands in (with
        LIFO it was the one released last); a reader's buffers LIFO, so prepared READs recur (``_xfer_cache``).
        The randomness is a speed bump, not a defence: a peer holding the owner's metadata can write every
        registered region (docs/security.md "Data plane")."""
        if self._gens is not None and len(free) > 1:
            i = secrets.randbelow(len(free))
            free[i], free[-1] = free[-1], free[i]
        return free.pop()

    def _mark_busy(self, slot: Slot) -> Slot:
        slot.busy = True
        self._busy.add(slot)
        return slot

    def _try_new(self, size: int, errors: list[str]) -> Slot | None:
        if self._total_bytes + size > self._cap:
            errors.append(f"cap: {self._total_bytes} + {size} > {self._cap}")
            return None
        gen_index = -1
        if self._gens is not None:
            taken = self._gens.take()
            if taken is None:
                errors.append(f"all {GENERATION_WORDS} generation words in use")
                return None
            gen_index = taken
        array = None
        try:
            if self._numpy_backed:
                array = host_buffer(size)
                tensor = torch.from_numpy(array)
            else:
                tensor = self._allocate(size)
        except (RuntimeError, MemoryError) as exc:  # torch.OutOfMemoryError is a RuntimeError
            with self._tally.locked() as c:
                c.alloc_failures += 1
            errors.append(f"allocation failed: {exc}")
            if self._gens is not None:
                self._gens.give_back(gen_index)
            return None
        try:
            reg = self._provider.register(int(tensor.data_ptr()), size, self._mem_type, self._cfg.device_index)
        except TensorwireError:
            if self._gens is not None:
                self._gens.give_back(gen_index)
            raise
        except Exception as exc:
            if self._gens is not None:
                self._gens.give_back(gen_index)
            raise ExportError(
                f"registering a {size}-byte slot failed: {exc}", reason=Reason.REGISTRATION_FAILED
            ) from exc
        self._total_bytes += size
        with self._tally.locked() as c:
            c.slot_allocations += 1
        return Slot(nbytes=size, tensor=tensor, reg=reg, gen_index=gen_index, array=array)

    def _allocate(self, size: int) -> torch.Tensor:
        if self._device.type == "cuda":
            with torch.cuda.device(self._device):
                return torch.empty(size, dtype=torch.uint8, device=self._device)
        return torch.empty(size, dtype=torch.uint8)

    def _shrink_locked(self, fraction: float) -> int:
        idle = sorted((s for slots in self._free.values() for s in slots), key=lambda s: s.nbytes, reverse=True)
        if not idle:
            return 0
        count = len(idle) if fraction >= 1.0 else max(1, int(len(idle) * fraction + 0.5))
        victims = idle[:count]
        freed = 0
        for slot in victims:
            self._free[slot.nbytes].remove(slot)
            freed += slot.nbytes
            self._destroy(slot)
        with self._tally.locked() as c:
            c.shrinks += 1
            c.shrunk_slots += len(victims)
            c.shrunk_bytes += freed
        log.info("slot pool shrank %d idle slots (%d bytes) of %d idle", len(victims), freed, len(idle))
        return freed

    def _destroy(self, slot: Slot) -> None:
        try:
            self._provider.deregister(slot.reg)
        except Exception:  # the memory is dropped either way; a failed deregistration only leaks the handle
            log.warning("deregistering a %d-byte slot failed", slot.nbytes, exc_info=True)
        if self._gens is not None and slot.gen_index >= 0:
            self._gens.give_back(slot.gen_index)
            slot.gen_index = -1
        self._total_bytes -= slot.nbytes
        slot.tensor = torch.empty(0, dtype=torch.uint8)
        slot.typed = {}  # its reinterpretations would keep the memory alive too
        slot.array = None
