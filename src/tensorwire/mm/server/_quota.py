"""PeerLeases: the bytes each peer holds leased on one encoder, so that one client cannot pin the slot pool.

Without a quota, a client that never releases would hold every slot until the GC window passed, and
everyone else would fall back to inline. With a quota of ``cap_bytes`` per peer (``TransportConfig.peer_leased_bytes``),
an output that would take a peer over it is answered inline instead (``tensorwire_mm_fallbacks_total{reason=
"peer_quota"}``), and only that peer's outputs are.

Accounting: ``reserve(peer, n)`` before the export (refused when it would go over), ``settle`` after it with the
leases it made (or none), ``remove`` when leases are released. A lease nobody releases leaves the account when
the exporter's GC would have reclaimed it (``ttl_s`` after it was recorded, which is never before the GC), so
the account never needs the exporter to report back. Bytes are what the leases pin: the size of the pool slot
each payload lands in (a power of two, so up to twice its payload).

Thread-safety: every method takes the one lock; calls are O(1) amortized (expiry pops from the front of each
peer's insertion-ordered leases).
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Iterable, Sequence


class PeerLeases:
    def __init__(self, cap_bytes: int, ttl_s: float, *, clock: Callable[[], float] = time.monotonic) -> None:
        self.cap_bytes = int(cap_bytes)
        self.ttl_s = float(ttl_s)
        self._clock = clock
        self._lock = threading.Lock()
        self._held: dict[str, int] = {}  # peer -> bytes (leases + reservations)
        self._leases: dict[str, OrderedDict[str, tuple[int, float]]] = {}  # peer -> lease id -> (bytes, expiry)
        self._owner: dict[str, str] = {}  # lease id -> peer
        self.refusals = 0

    def held(self, peer: str) -> int:
        with self._lock:
            self._expire_locked(peer, self._clock())
            return self._held.get(peer, 0)

    def reserve(self, peer: str, nbytes: int) -> bool:
        """Counts ``nbytes`` against ``peer`` if that stays within the cap; False (nothing counted) otherwise."""
        with self._lock:
            self._expire_locked(peer, self._clock())
            held = self._held.get(peer, 0)
            if held + nbytes > self.cap_bytes:
                self.refusals += 1
                return False
            self._held[peer] = held + nbytes
            return True

    def settle(self, peer: str, reserved: int, leases: Sequence[tuple[str, int]]) -> None:
        """Replaces a reservation by the leases the export made (none when it failed or answered inline)."""
        expiry = self._clock() + self.ttl_s
        with self._lock:
            held = self._held.get(peer, 0) - reserved
            book = self._leases.setdefault(peer, OrderedDict())
            for lease_id, nbytes in leases:
                book[lease_id] = (nbytes, expiry)
                self._owner[lease_id] = peer
                held += nbytes
            self._set_locked(peer, held)

    def remove(self, lease_ids: Iterable[str]) -> None:
        with self._lock:
            for lease_id in lease_ids:
                peer = self._owner.pop(lease_id, None)
                if peer is None:
                    continue
                nbytes, _ = self._leases[peer].pop(lease_id)
                self._set_locked(peer, self._held.get(peer, 0) - nbytes)

    def clear(self) -> None:
        with self._lock:
            self._held.clear()
            self._leases.clear()
            self._owner.clear()

    def _set_locked(self, peer: str, held: int) -> None:
        if held > 0 or self._leases.get(peer):
            self._held[peer] = max(0, held)
            return
        self._held.pop(peer, None)
        self._leases.pop(peer, None)

    def _expire_locked(self, peer: str, now: float) -> None:
        book = self._leases.get(peer)
        if not book:
            return
        dropped = 0
        while book:
            lease_id, (nbytes, expiry) = next(iter(book.items()))
            if expiry > now:
                break
            del book[lease_id]
            self._owner.pop(lease_id, None)
            dropped += nbytes
        if dropped:
            self._set_locked(peer, self._held.get(peer, 0) - dropped)


__all__ = ["PeerLeases"]
