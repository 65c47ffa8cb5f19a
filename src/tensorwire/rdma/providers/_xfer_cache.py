"""Prepared NIXL READ requests kept for reposting.

Preparing a READ (two ``prep_xfer_dlist`` calls and ``make_prepped_xfer``) costs more than posting it. Slot
pools reuse the same few (local slot, remote slot) pairs, so the same request recurs; NIXL lets a request whose
last post has completed be posted again (``transfer(handle)``), so we keep the completed ones here.

Contract:
- ``take(key)`` hands an entry out exclusively (it leaves the cache while in use), or None.
- ``put(key, entry, token)`` gives a completed entry back; it is cached only if nothing was invalidated since the
  ``token`` (``token()`` before ``take``/preparing) was read, otherwise it is released: an entry prepared before a
  deregistration or an owner's reload must never be posted again.
- ``invalidate(pred)`` releases every cached entry whose key matches and bumps the token; entries in use at that
  moment are released when they come back. Callers invalidate *before* deregistering memory or forgetting an
  owner, because a request may not outlive the memory or the remote agent it names.
- Entries that failed or timed out are never given back (the caller releases them or hands them to a pending
  transfer).
- At most ``capacity`` entries; the least recently used is released first. Thread-safe.
- Keys are ``XferKey``s: the local ranges name the memory a deregistration invalidates, the owner and epoch the
  metadata a reload invalidates.
"""

from __future__ import annotations

import logging
import threading
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, NamedTuple

from tensorwire.rdma._stats import Tally
from tensorwire.rdma.providers.base import Range

log = logging.getLogger(__name__)


def release_quietly(*handles: Any) -> None:
    """Releases NIXL handles (transfer requests, prepared lists); None entries and failures are skipped."""
    for h in handles:
        if h is None:
            continue
        try:
            h.release()
        except Exception:  # already released or the agent is gone
            log.debug("releasing a NIXL handle failed", exc_info=True)


class XferKey(NamedTuple):
    """What makes two READ requests the same request."""

    owner: str  # the remote agent's name
    epoch: int  # the owner's registration epoch the request was prepared under
    local_mem: str
    local: tuple[Range, ...]
    remote_mem: str
    remote: tuple[Range, ...]


@dataclass
class XferStats:
    reposts: int = 0  # take() found a prepared request
    preps: int = 0  # take() found none: the caller prepares one


@dataclass(eq=False)
class XferEntry:
    xfer: Any
    handles: list[Any]

    def release(self) -> None:
        release_quietly(self.xfer, *self.handles)


class XferCache:
    def __init__(self, capacity: int = 256) -> None:
        self._capacity = capacity
        self._entries: OrderedDict[XferKey, XferEntry] = OrderedDict()
        self._lock = threading.Lock()
        self._token = 0
        self._tally = Tally(XferStats())

    def token(self) -> int:
        return self._token

    def take(self, key: XferKey) -> XferEntry | None:
        with self._lock:
            entry = self._entries.pop(key, None)
        with self._tally.locked() as c:
            if entry is None:
                c.preps += 1
            else:
                c.reposts += 1
        return entry

    def put(self, key: XferKey, entry: XferEntry, token: int) -> None:
        drop: list[XferEntry] = []
        with self._lock:
            if token != self._token or key in self._entries:
                drop.append(entry)
            else:
                self._entries[key] = entry
                while len(self._entries) > self._capacity:
                    drop.append(self._entries.popitem(last=False)[1])
        for e in drop:
            e.release()

    def invalidate(self, pred: Callable[[XferKey], bool]) -> int:
        with self._lock:
            self._token += 1
            keys = [k for k in self._entries if pred(k)]
            dropped = [self._entries.pop(k) for k in keys]
        for e in dropped:
            e.release()
        return len(dropped)

    def clear(self) -> None:
        self.invalidate(lambda _k: True)

    def stats(self) -> XferStats:
        return self._tally.snapshot()

    def __len__(self) -> int:
        return len(self._entries)
