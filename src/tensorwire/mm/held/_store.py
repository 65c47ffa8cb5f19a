"""HeldStore: tensors exported under a key and handed to whoever presents a grant (owner side, no gRPC).

An LLM engine that runs its encoder elsewhere needs the encoder's outputs to outlive the request that made
them: the encoder instance finishes its request, and the LLM instance reads the embedding later, maybe much
later, maybe twice. The store keeps such outputs exported (``tensorwire.rdma``: registered slots, one lease per
item) under a string key until every grant on the item has been released, or until the TTL.

Grants are capabilities: ``(key, secret)``, the secret at least 16 random bytes (:func:`new_secret`) chosen by
whoever issues the grant (for vLLM: the encoder instance's scheduler, which never sees the tensors). The store
keeps only a digest of each secret; a lookup or release with an unknown key or a wrong secret fails the same
way (``LeaseExpired`` with reason ``not_held``), so grants cannot be probed for.

Lifecycle of one key::

    grant(key, s1)          pending grant (the item is not held yet), or a new grant on the held item
    hold(key, tensors)      exported now (copy into a slot); pending grants attach; a second hold is a no-op
    lookup(key, s1)         -> HeldItem (descriptor or inline copies), any number of times while s1 is live
    peek(key)               -> HeldItem for the owner itself (it announces the descriptor to whoever it grants)
    release(key, s1)        s1 ends; the item's lease is released when its last grant ends
    (TTL)                   items and pending grants older than ttl_s are dropped; the exporter's own GC
                            (slot_gc_timeout_ms) reclaims a slot whose lease was never released

An item that is held with no grant (nobody asked for it yet) stays until a grant arrives, or the TTL.

Ownership: ``hold`` copies (``TensorExporter.export``); the caller may drop or modify its tensors when it
returns. With ``segments`` (a :class:`SegmentSource`) a host-memory item is also copied from its slot into a
segment taken from it (a memfd, used once): receipts name it, so a reader on this host may map it instead of
reading the slot; the store closes its descriptor when the item ends and never writes it after ``hold``.
Without an exporter (``exporter=None``: no RDMA provider) the store keeps host copies and hands them out inline.
Thread safety: every method may be called from many threads. Errors: ``ExportError`` /
``PoolExhausted`` from ``hold`` (nothing is held then), ``ReadError(NOT_READY)`` (a pending grant: the item is
not held yet) or ``LeaseExpired(NOT_HELD)`` from ``lookup``,
``InvalidPayload`` for a secret that is too short, ``ClosedError`` after ``close``.
"""

from __future__ import annotations

import ctypes
import enum
import hashlib
import logging
import secrets
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Protocol

import torch

from tensorwire.errors import ClosedError, InvalidPayload, LeaseExpired, ReadError, Reason, TensorwireError
from tensorwire.rdma import Descriptor, Exporter

log = logging.getLogger(__name__)

MIN_SECRET_BYTES = 16
MAX_SECRET_BYTES = 256
MAX_KEY_CHARS = 1024


def new_secret() -> bytes:
    """A fresh grant secret: 128 random bits from the OS CSPRNG."""
    return secrets.token_bytes(MIN_SECRET_BYTES)


def check_grant(key: str, secret: bytes) -> None:
    """InvalidPayload unless ``key`` is a non-empty string and ``secret`` 16..256 bytes (untrusted input)."""
    if not isinstance(key, str) or not key or len(key) > MAX_KEY_CHARS:
        raise InvalidPayload(f"grant key must be 1..{MAX_KEY_CHARS} characters", reason=Reason.INVALID_REQUEST)
    if not isinstance(secret, (bytes, bytearray)) or not MIN_SECRET_BYTES <= len(secret) <= MAX_SECRET_BYTES:
        n = len(secret) if isinstance(secret, (bytes, bytearray)) else -1
        raise InvalidPayload(
            f"grant secret must be {MIN_SECRET_BYTES}..{MAX_SECRET_BYTES} bytes, got {n}", reason=Reason.INVALID_REQUEST
        )


def _digest(key: str, secret: bytes) -> bytes:
    """The grant's dict key (after check_grant). Dict keys are digests, never secrets: a lookup compares digests
    of attacker-chosen input, which says nothing about a stored secret."""
    check_grant(key, secret)
    return hashlib.sha256(key.encode() + b"\0" + bytes(secret)).digest()


class StoreState(enum.Enum):
    OPEN = "open"
    CLOSED = "closed"


class Segment(Protocol):
    """A memfd mapped in this process: ``tensor`` is a uint8 view of its ``size`` bytes, ``fd`` its descriptor,
    ``name`` its memfd name; ``close`` closes the descriptor (the mapping goes with the last view)."""

    fd: int
    name: str
    size: int
    tensor: torch.Tensor

    def close(self) -> None: ...


class SegmentSource(Protocol):
    """Where a store gets host segments: ``take(nbytes)`` one used once (raises ``TensorwireError`` or ``OSError``
    when none can be had), ``refill(size)`` after taking one (the source may make the next one ahead)."""

    def take(self, nbytes: int) -> Segment: ...

    def refill(self, size: int) -> None: ...


@dataclass(frozen=True)
class HeldItem:
    """What a lookup returns: the descriptor of the item's slot (RDMA) or its host copies (inline); ``segment``:
    the slot's payload also in a host segment of this process (``HeldStore(segments=...)``), or None."""

    key: str
    shapes: tuple[tuple[int, ...], ...]
    dtypes: tuple[torch.dtype, ...]
    nbytes: int
    descriptor: Descriptor | None = None
    tensors: tuple[torch.Tensor, ...] | None = None
    segment: Segment | None = field(default=None, repr=False, compare=False)

    @property
    def is_rdma(self) -> bool:
        return self.descriptor is not None


@dataclass
class _Held:
    item: HeldItem
    created_s: float
    grants: set[bytes] = field(default_factory=set)


@dataclass(frozen=True)
class StoreStats:
    """Counters since construction and the current sizes (``held_*``, ``*_grants``)."""

    held_items: int
    held_bytes: int
    grants: int
    pending_grants: int
    holds: int
    hold_failures: int
    lookups: int
    lookup_misses: int
    releases: int
    release_misses: int
    released_items: int
    expired_items: int
    expired_grants: int


class HeldStore:
    """Keyed held outputs over one ``Exporter`` (or inline host copies when ``exporter`` is None).

    ``ttl_s``: items and pending grants older than this are dropped; give it the exporter's
    ``slot_gc_timeout_ms`` (which reclaims the slots at that age anyway). The store does not own
    the exporter: ``close()`` releases the leases it holds but leaves the exporter open. ``on_change(items,
    bytes)`` is called (outside the lock) after the held set grew or shrank, for gauges.
    """

    def __init__(
        self,
        exporter: Exporter | None,
        *,
        ttl_s: float = 60.0,
        clock: Callable[[], float] = time.monotonic,
        on_change: Callable[[int, int], None] | None = None,
        compat: str = "",
        segments: SegmentSource | None = None,
    ) -> None:
        self._exporter = exporter
        self._segments = segments
        # The owner's compatibility hash: a Lookup that carries another is refused (incompatible). "": unchecked.
        self.compat = compat
        self._on_change = on_change
        if not ttl_s > 0:
            raise InvalidPayload(f"HeldStore ttl_s={ttl_s!r}: must be > 0", reason=Reason.INVALID_CONFIG)
        self._ttl_s = float(ttl_s)
        self._clock = clock
        self._lock = threading.Lock()
        self._state = StoreState.OPEN
        self._held: OrderedDict[str, _Held] = OrderedDict()  # insertion order == creation order (TTL sweep)
        self._pending: OrderedDict[tuple[str, bytes], float] = OrderedDict()  # (key, digest) -> created
        self._pending_by_key: dict[str, set[bytes]] = {}
        self._n = dict.fromkeys(
            (
                "holds",
                "hold_failures",
                "lookups",
                "lookup_misses",
                "releases",
                "release_misses",
                "released_items",
                "expired_items",
                "expired_grants",
            ),
            0,
        )

    @property
    def ttl_s(self) -> float:
        return self._ttl_s

    @property
    def is_rdma(self) -> bool:
        return self._exporter is not None

    def grant(self, key: str, secret: bytes) -> None:
        """Adds a grant: on the held item, or pending until ``hold(key, ...)`` (dropped after ``ttl_s``)."""
        d = _digest(key, secret)
        with self._lock:
            self._check_open()
            self._sweep_locked()
            held = self._held.get(key)
            if held is not None:
                held.grants.add(d)
            elif (key, d) not in self._pending:
                self._pending[(key, d)] = self._clock()
                self._pending_by_key.setdefault(key, set()).add(d)

    def holds(self, key: str) -> bool:
        with self._lock:
            self._sweep_locked()
            return key in self._held

    def hold(self, key: str, tensors: Sequence[torch.Tensor]) -> bool:
        """Exports ``tensors`` under ``key`` (one slot, manifest in order). False when ``key`` is already held.

        Pending grants for ``key`` attach to the new item. Raises what the export raises (nothing is held then).
        """
        if not isinstance(key, str) or not key or len(key) > MAX_KEY_CHARS:
            raise InvalidPayload(f"key must be 1..{MAX_KEY_CHARS} characters", reason=Reason.INVALID_REQUEST)
        with self._lock:
            self._check_open()
            self._sweep_locked()
            if key in self._held:
                return False
        try:
            item = self._make_item(key, tensors)
        except Exception:
            with self._lock:
                self._n["hold_failures"] += 1
            raise
        with self._lock:
            if self._state is StoreState.CLOSED or key in self._held:
                lost_race = True
            else:
                lost_race = False
                held = _Held(item, self._clock(), self._pending_by_key.pop(key, set()))
                for d in held.grants:
                    del self._pending[(key, d)]
                self._held[key] = held
                self._n["holds"] += 1
        if lost_race:  # another thread held the same key meanwhile, or close() ran: ours is not needed
            self._end_item(item)
            if self._state is StoreState.CLOSED:
                raise ClosedError("HeldStore is closed")
            return False
        self._notify()
        return True

    def lookup(self, key: str, secret: bytes) -> HeldItem:
        """The held item, if ``(key, secret)`` is a live grant on it; ``ReadError(NOT_READY)`` when the grant is
        pending (granted, the item not held yet); else ``LeaseExpired(NOT_HELD)``."""
        d = _digest(key, secret)
        with self._lock:
            self._check_open()
            self._sweep_locked()
            held = self._held.get(key)
            self._n["lookups"] += 1
            if held is None and (key, d) in self._pending:
                self._n["lookup_misses"] += 1
                raise ReadError(
                    f"the item under this grant for key {key[:64]!r} is not held yet (granted, "
                    "still being encoded): retry",
                    reason=Reason.NOT_READY,
                )
            if held is None or d not in held.grants:
                self._n["lookup_misses"] += 1
                raise LeaseExpired(
                    f"no held item under this grant for key {key[:64]!r} (never held, released, "
                    f"or older than {self._ttl_s:.0f} s)",
                    reason=Reason.NOT_HELD,
                )
            return held.item

    def peek(self, key: str) -> HeldItem | None:
        """The held item under ``key`` without a grant, for the owner itself (to announce it): never expose this
        to a peer, which must present a grant (``lookup``)."""
        with self._lock:
            held = self._held.get(key)
            return None if held is None else held.item

    def release(self, key: str, secret: bytes) -> bool:
        """Ends the grant (idempotent: False when it did not exist). The last grant of an item releases it."""
        d = _digest(key, secret)
        ended: HeldItem | None = None
        with self._lock:
            if self._state is StoreState.CLOSED:
                return False
            held = self._held.get(key)
            if held is not None and d in held.grants:
                held.grants.discard(d)
                found = True
                if not held.grants:
                    del self._held[key]
                    ended = held.item
                    self._n["released_items"] += 1
            else:
                found = self._forget_pending_locked(key, d)
            self._n["releases" if found else "release_misses"] += 1
        if ended is not None:
            self._end_item(ended)
            self._notify()
        return found

    def drop(self, key: str) -> bool:
        """Forgets ``key`` and every grant on it (its lease is released). For owners that know it is stale."""
        with self._lock:
            held = self._held.pop(key, None)
            for d in self._pending_by_key.pop(key, set()):
                del self._pending[(key, d)]
        if held is not None:
            self._end_item(held.item)
            self._notify()
        return held is not None

    def expire(self) -> int:
        """Drops what is older than ``ttl_s`` now (every other call does this too). Returns the items dropped."""
        with self._lock:
            n = self._sweep_locked()
        if n:
            self._notify()
        return n

    def stats(self) -> StoreStats:
        with self._lock:
            self._sweep_locked()
            return StoreStats(
                held_items=len(self._held),
                held_bytes=sum(h.item.nbytes for h in self._held.values()),
                grants=sum(len(h.grants) for h in self._held.values()),
                pending_grants=len(self._pending),
                **self._n,
            )

    def close(self) -> None:
        """Releases every held item and forgets every grant; later calls raise ClosedError. Idempotent."""
        with self._lock:
            if self._state is StoreState.CLOSED:
                return
            self._state = StoreState.CLOSED
            items = [h.item for h in self._held.values()]
            self._held.clear()
            self._pending.clear()
            self._pending_by_key.clear()
        for item in items:
            self._end_item(item)
        if items:
            log.info("held store closed with %d item(s) still held; released them", len(items))

    def __enter__(self) -> HeldStore:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- internals --

    def _notify(self) -> None:
        if self._on_change is None:
            return
        with self._lock:
            items, nbytes = len(self._held), sum(h.item.nbytes for h in self._held.values())
        try:
            self._on_change(items, nbytes)
        except Exception:
            log.debug("held store on_change hook failed", exc_info=True)

    def _check_open(self) -> None:
        if self._state is StoreState.CLOSED:
            raise ClosedError("HeldStore is closed")

    def _make_item(self, key: str, tensors: Sequence[torch.Tensor]) -> HeldItem:
        tensors = list(tensors)
        if not tensors:
            raise InvalidPayload("hold() needs at least one tensor", reason=Reason.EMPTY_EXPORT)
        shapes = tuple(tuple(int(d) for d in t.shape) for t in tensors)
        dtypes = tuple(t.dtype for t in tensors)
        nbytes = sum(t.numel() * t.element_size() for t in tensors)
        if self._exporter is not None:
            (desc,) = self._exporter.export_batch([tensors])
            return HeldItem(key, shapes, dtypes, nbytes, descriptor=desc, segment=self._segment_of(desc))
        copies = tuple(t.detach().to("cpu", copy=True).contiguous() for t in tensors)
        return HeldItem(key, shapes, dtypes, nbytes, tensors=copies)

    def _segment_of(self, desc: Descriptor) -> Segment | None:
        """A host segment holding a copy of ``desc``'s host slot (same offsets), or None (no source, device memory,
        none to be had: readers then read the slot)."""
        if self._segments is None or desc.mem_type != "DRAM":
            return None
        try:
            seg = self._segments.take(desc.payload_bytes)
        except (TensorwireError, OSError) as exc:
            log.debug("no host segment for a %d-byte item: %s", desc.payload_bytes, exc)
            return None
        # The slot is this process's memory, leased to the item: one plain copy of its payload as laid out.
        ctypes.memmove(seg.tensor.data_ptr(), desc.slot_addr, desc.payload_bytes)
        self._segments.refill(seg.size)
        return seg

    def _end_item(self, item: HeldItem) -> None:
        if item.segment is not None:
            item.segment.close()
        if item.descriptor is not None and self._exporter is not None:
            try:
                self._exporter.release([item.descriptor.lease_id])
            except ClosedError:
                pass  # the exporter closed first: its leases are void already

    def _forget_pending_locked(self, key: str, d: bytes) -> bool:
        if self._pending.pop((key, d), None) is None:
            return False
        left = self._pending_by_key.get(key)
        if left is not None:
            left.discard(d)
            if not left:
                del self._pending_by_key[key]
        return True

    def _sweep_locked(self) -> int:
        now = self._clock()
        horizon = now - self._ttl_s
        expired: list[HeldItem] = []
        while self._held:
            key, held = next(iter(self._held.items()))
            if held.created_s > horizon:
                break
            del self._held[key]
            expired.append(held.item)
        while self._pending:
            (key, d), created = next(iter(self._pending.items()))
            if created > horizon:
                break
            self._forget_pending_locked(key, d)
            self._n["expired_grants"] += 1
        if expired:
            self._n["expired_items"] += len(expired)
            log.warning(
                "held store dropped %d item(s) older than %.0f s; are readers releasing?", len(expired), self._ttl_s
            )
            # Under this store's lock: the exporter takes only its own lock and never calls back into the store.
            for item in expired:
                self._end_item(item)
        return len(expired)


__all__ = ["HeldStore", "HeldItem", "StoreStats", "StoreState", "new_secret", "check_grant", "MIN_SECRET_BYTES"]
