"""LLM-instance (consumer) logic: hold a request until its items are on every rank, then announce them.

Scheduler side (:class:`ConsumerScheduler`, one per engine, called on vLLM's scheduler thread only):

- ``ensure_cache_available(request, n)`` is vLLM's first look at a waiting request: the items of its
  ``ec_transfer_params`` start fetching there (``fetch.Fetcher``), and it answers False (vLLM keeps the request
  waiting) until each item is *ready* (every rank staged it), *local* (the fetch failed and the request carries
  the media: vLLM encodes it) or *failed* (no media: the request is listed for ``take_unavailable_requests``,
  which vLLM fails with FINISHED_ERROR). The budget is ``fetch_timeout_ms`` per item.
- ``has_cache_item(mm_hash)`` is True only for ready items, so vLLM never schedules a load of something a
  worker does not hold; ``update_state_after_alloc`` turns a ready item vLLM decided to load into a *load*
  (mm_hash, staging key) for this step's metadata, and workers place it (:class:`ConsumerWorker`).
- A ready item is kept on the ranks while any request that counted on it (its *holders*) is unfinished
  (vLLM may need it again after a preemption) and for ``retire_grace_s`` after its last load, then dropped.
- Grants go back to the encoder instance when every rank has read (``Fetcher``), or at once when the item
  is not needed (it arrived through another grant, or the request finished first).

Worker side (:class:`ConsumerWorker`): ``start_load_caches`` puts the staged tensors of this step's loads into
vLLM's encoder cache. It never reads anything, so a failed read cannot reach it.
"""

from __future__ import annotations

import enum
import itertools
import logging
import math
import time
from collections.abc import Callable, Iterable, MutableMapping
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

import torch

from tensorwire.errors import Reason, TensorwireError
from tensorwire.integrations._vllm_ec.config import ECConfig
from tensorwire.integrations._vllm_ec.fetch import Fetcher, FetchResult
from tensorwire.integrations._vllm_ec.metrics import ECMetrics
from tensorwire.integrations._vllm_ec.params import ItemGrant, parse_params
from tensorwire.integrations._vllm_ec.segments import SegmentRef, map_segment
from tensorwire.integrations._vllm_ec.trust import ProducerGate
from tensorwire.mm.held._staging import Expect, StagingArea

log = logging.getLogger(__name__)

_DTYPES = {
    name: getattr(torch, name)
    for name in ("float32", "float16", "bfloat16", "float64", "int64", "int32", "int16", "int8", "uint8", "bool")
}
# A fetch still running this long after its budget is treated as failed (its thread may be stuck in a call
# that ignores deadlines); its result, if it ever comes, is dropped.
_STUCK_GRACE_S = 2.0


class FetchState(enum.Enum):
    FETCHING = "fetching"
    READY = "ready"
    FAILED = "failed"


class ItemStatus(enum.Enum):
    WAIT = "wait"  # fetching (or not started)
    READY = "ready"  # a ready fetch of this mm_hash exists; vLLM may load it
    LOCAL = "local"  # the fetch failed; vLLM encodes it from the request's media
    SKIP = "skip"  # vLLM does not need it (prefix cache covers it)
    FAILED = "failed"  # the fetch failed and there is no media: the request fails


@dataclass(eq=False)
class _Fetch:
    staging_key: str
    mm_hash: str
    grant: ItemGrant
    future: Future[FetchResult]
    deadline: float
    state: FetchState = FetchState.FETCHING
    reason: Reason | None = None
    holders: set[str] = field(default_factory=set)
    abandoned: bool = False
    last_load_s: float = 0.0
    dropped: bool = False
    idle_listed: bool = False  # in ConsumerScheduler._idle_ready


@dataclass(eq=False)
class _Item:
    mm_hash: str
    grant: ItemGrant | None
    error: TensorwireError | None  # malformed params, or refused before anything was dialed
    status: ItemStatus = ItemStatus.WAIT
    fetch: _Fetch | None = None
    grant_spent: bool = False  # released or handed to a fetch (which releases it)


@dataclass(eq=False)
class _Req:
    request_id: str
    items: dict[str, _Item]
    waiting: bool = False

    @property
    def resolved(self) -> bool:
        return all(i.status not in (ItemStatus.WAIT,) for i in self.items.values())


def _features(request: Any, mm_hash: str) -> list[Any]:
    return [f for f in (getattr(request, "mm_features", None) or []) if f.identifier == mm_hash]


def _covered(features: list[Any], num_computed_tokens: int) -> bool:
    return bool(features) and all(f.mm_position.offset + f.mm_position.length <= num_computed_tokens for f in features)


class ConsumerScheduler:
    """The scheduler half of the consumer. Single-threaded (vLLM's scheduler thread); see the module doc."""

    def __init__(
        self,
        cfg: ECConfig,
        fetcher: Fetcher,
        metrics: ECMetrics,
        *,
        has_media: Callable[[Any], bool],
        clock: Callable[[], float] = time.monotonic,
        retire_grace_s: float = 10.0,
        gate: ProducerGate | None = None,
    ) -> None:
        self._cfg = cfg
        self._gate = gate
        self._parse = gate.parse if gate is not None else parse_params
        self._fetcher = fetcher
        self._metrics = metrics
        self._has_media = has_media
        self._clock = clock
        self._retire_grace_s = retire_grace_s
        self._reqs: dict[str, _Req] = {}
        self._fetches: dict[tuple[str, str, bytes], _Fetch] = {}
        self._inflight: list[_Fetch] = []
        self._ready: dict[str, _Fetch] = {}
        self._idle_ready: list[_Fetch] = []
        self._next_retire = math.inf  # no idle ready item is due before this (poll scans them only then)
        self._abandoned: list[_Fetch] = []
        self._unavailable: set[str] = set()
        self._loads: list[tuple[str, str, Any]] = []
        self._ids = itertools.count(1)

    # -- vLLM hooks --

    def ensure_cache_available(self, request: Any, num_computed_tokens: int) -> bool:
        rid = request.request_id
        st = self._reqs.get(rid)
        if st is None:
            st = self._admit(request)
            if st is None:
                return True
        if st.resolved:
            # A failed item keeps the request back until vLLM fails it (take_unavailable_requests, this step).
            return not any(i.status is ItemStatus.FAILED for i in st.items.values())
        self.poll()
        pending = False
        for item in st.items.values():
            if item.status is not ItemStatus.WAIT:
                continue
            feats = _features(request, item.mm_hash)
            if not feats or _covered(feats, num_computed_tokens):
                item.status = ItemStatus.SKIP
                self._give_back(item)
                continue
            ready = self._ready.get(item.mm_hash)
            if ready is not None:
                self._use_ready(st, item, ready)
                continue
            if item.fetch is None:
                self._begin(st, item, request, feats)
            fetch = item.fetch
            if fetch is None:  # could not start (bad params, mismatch): decided in _begin
                continue
            if fetch.state is FetchState.FETCHING and fetch.future.done():
                self._harvest(fetch)  # read at once (a receipt in the params): ready in this pass
            if fetch.state is FetchState.FETCHING:
                pending = True
            elif fetch.state is FetchState.FAILED:
                self._fallback(st, item, request, fetch.reason or Reason.UNKNOWN)
            else:  # READY but another fetch of the hash was ready first and is the one vLLM loads
                ready = self._ready.get(item.mm_hash)
                if ready is not None:
                    self._use_ready(st, item, ready)
                else:
                    pending = True
        failed = any(i.status is ItemStatus.FAILED for i in st.items.values())
        self._set_waiting(st, pending and not failed)
        return not pending and not failed

    def has_cache_item(self, mm_hash: str) -> bool:
        return mm_hash in self._ready

    def update_state_after_alloc(self, request: Any, index: int) -> None:
        mm_hash = request.mm_features[index].identifier
        fetch = self._ready.get(mm_hash)
        if fetch is None:
            return
        fetch.last_load_s = self._clock()
        self._loads.append((mm_hash, fetch.staging_key, self._fetcher.load_ref(fetch.staging_key)))

    def take_loads(self) -> list[tuple[str, str, Any]]:
        """This step's loads (for the worker metadata): (mm_hash, staging key, the host segment or None); clears
        them. Also advances the fetches."""
        self.poll()
        loads, self._loads = self._loads, []
        return loads

    def take_unavailable_requests(self) -> set[str]:
        """The requests vLLM must fail (an item could not be had, no media to encode it); clears them. vLLM asks
        after every step's forward pass, so the releases of the items staged for that step are written now."""
        self._fetcher.flush_releases()
        out, self._unavailable = self._unavailable, set()
        return out

    def request_finished(self, request: Any) -> None:
        rid = request.request_id
        st = self._reqs.pop(rid, None)
        self._unavailable.discard(rid)
        if st is None:
            # Never looked at (finished or aborted while waiting elsewhere): its grants were never used.
            self._fetcher.release_async(
                [
                    g
                    for g in self._parse(getattr(request, "ec_transfer_params", None)).values()
                    if isinstance(g, ItemGrant)
                ]
            )
            return
        self._set_waiting(st, False)
        for item in st.items.values():
            self._give_back(item)
            fetch = item.fetch
            if fetch is not None:
                fetch.holders.discard(rid)
                if not fetch.holders:
                    self._forget_grant(fetch)
                    if fetch.state is FetchState.FETCHING:
                        fetch.abandoned = True
                        self._abandoned.append(fetch)
            ready = self._ready.get(item.mm_hash)
            if ready is not None:
                ready.holders.discard(rid)
                if not ready.holders:
                    self._idle(ready)
        self._fetcher.flush_releases()  # the request's steps are over (an aborted one may have had none)
        self.poll()

    def poll(self) -> None:
        """Advances the inline fetches, harvests finished ones, fails stuck ones, drops what nobody needs. Cheap
        when idle."""
        self._fetcher.advance()
        now = self._clock()
        if self._inflight:
            still: list[_Fetch] = []
            for f in self._inflight:
                if f.future.done():
                    self._finish(f, _result(f))
                elif now > f.deadline + _STUCK_GRACE_S:
                    f.abandoned = True
                    self._abandoned.append(f)
                    self._fail(f, Reason.BUDGET_EXHAUSTED, "the fetch did not finish within its budget")
                else:
                    still.append(f)
            self._inflight = still
        if self._abandoned:
            keep = []
            for f in self._abandoned:
                if f.future.done():
                    res = _result(f)
                    if res.ok:
                        f.staging_key = res.staging_key
                        self._drop(f)
                else:
                    keep.append(f)
            self._abandoned = keep
        if now >= self._next_retire:  # a scan per due item, not per step: a busy instance has many idle ones
            keep = []
            self._next_retire = math.inf
            for f in self._idle_ready:
                f.idle_listed = False
                if f.holders or f.dropped:
                    continue
                due = f.last_load_s + self._retire_grace_s
                if now >= due:
                    if self._ready.get(f.mm_hash) is f:
                        del self._ready[f.mm_hash]
                    self._forget_grant(f)
                    self._drop(f)
                else:
                    keep.append(f)
                    f.idle_listed = True
                    self._next_retire = min(self._next_retire, due)
            self._idle_ready = keep

    def close(self) -> None:
        """Stops fetching; queued releases still go out. Ready items are forgotten, not dropped one by one:
        every staging area frees its items when it closes (this process's stagers in ``Fetcher.close()``, the
        workers' areas when their workers shut down, which vLLM does before it closes the scheduler, so a drop
        sent to a worker now would dial a socket that is gone), and their grants went back when every rank had
        read them."""
        self._ready.clear()
        self._idle_ready = []
        self._next_retire = math.inf
        self._fetcher.close()

    # -- introspection (tests, stats) --

    @property
    def ready_items(self) -> int:
        return len(self._ready)

    @property
    def inflight(self) -> int:
        return len(self._inflight)

    # -- internals --

    def _admit(self, request: Any) -> _Req | None:
        grants = self._parse(getattr(request, "ec_transfer_params", None))
        if not grants:
            return None
        wanted = {f.identifier for f in (getattr(request, "mm_features", None) or [])}
        items: dict[str, _Item] = {}
        unused: list[ItemGrant] = []
        for mm_hash, g in grants.items():
            if mm_hash not in wanted:
                if isinstance(g, ItemGrant):
                    unused.append(g)
                continue
            if isinstance(g, ItemGrant):
                items[mm_hash] = _Item(mm_hash, g, None)
            else:
                items[mm_hash] = _Item(mm_hash, None, g)
        self._fetcher.release_async(unused)
        if not items:
            return None
        st = _Req(request.request_id, items)
        self._reqs[st.request_id] = st
        return st

    def _begin(self, st: _Req, item: _Item, request: Any, feats: list[Any]) -> None:
        if item.grant is None:
            reason = item.error.reason if item.error is not None else Reason.INVALID_REQUEST
            if reason is Reason.UNTRUSTED_PRODUCER:
                self._metrics.refusals.labels(reason.value).inc()
            log.warning("request %s: %s", st.request_id, item.error)
            self._fallback(st, item, request, reason)
            return
        grant = item.grant
        refused = self._gate.compat_refusal(grant) if self._gate is not None else None
        if refused is not None:
            self._metrics.refusals.labels(refused.reason.value).inc()
            log.warning("request %s item %.16s: %s", st.request_id, item.mm_hash, refused)
            self._give_back(item)
            self._fallback(st, item, request, refused.reason)
            return
        rows = feats[0].mm_position.get_num_embeds()
        if grant.shape is not None and (not grant.shape or grant.shape[0] != rows):
            log.warning(
                "request %s item %.16s: the encoder announced shape %s, this instance expects %d rows",
                st.request_id,
                item.mm_hash,
                list(grant.shape),
                rows,
            )
            self._give_back(item)
            self._fallback(st, item, request, Reason.RESULT_MISMATCH)
            return
        existing = self._fetches.get(grant.grant_id)
        if existing is not None and existing.state is not FetchState.FAILED:
            existing.holders.add(st.request_id)
            item.fetch = existing
            item.grant_spent = True
            return
        expect = Expect(shape=grant.shape, dtype=_DTYPES.get(grant.dtype) if grant.dtype else None)
        key = f"{next(self._ids)}-{item.mm_hash[:32]}"
        fut = self._fetcher.start(grant, key, expect)
        fetch = _Fetch(
            key, item.mm_hash, grant, fut, self._clock() + self._cfg.fetch_timeout_ms / 1000.0, holders={st.request_id}
        )
        self._fetches[grant.grant_id] = fetch
        self._inflight.append(fetch)
        item.fetch = fetch
        item.grant_spent = True

    def _use_ready(self, st: _Req, item: _Item, ready: _Fetch) -> None:
        ready.holders.add(st.request_id)
        own = item.fetch
        if own is not None and own is not ready:
            own.holders.discard(st.request_id)
            if not own.holders and own.state is FetchState.FETCHING:
                own.abandoned = True  # its result is dropped when it comes; it releases its grant itself
                self._abandoned.append(own)
                self._forget_grant(own)
        item.fetch = ready
        item.status = ItemStatus.READY
        self._give_back(item)  # this request's own grant is not needed: the item came through another

    def _harvest(self, f: _Fetch) -> None:
        """Takes a finished fetch out of the in-flight list and records its result now."""
        try:
            self._inflight.remove(f)
        except ValueError:
            return
        self._finish(f, _result(f))

    def _finish(self, f: _Fetch, res: FetchResult) -> None:
        if not res.ok:
            self._fail(f, res.reason or Reason.UNKNOWN, res.error)
            return
        f.staging_key = res.staging_key  # the fetcher may have staged under another key (a lookup after a receipt)
        f.state = FetchState.READY
        m, plane = self._metrics, res.plane or "rdma"
        m.series(m.fetches, "delivered").inc()
        m.series(m.delivered, plane).inc()
        m.series(m.bytes, plane).inc(res.nbytes)
        m.series(m.read_bytes, plane).inc(res.nbytes)
        m.fetch_seconds.observe(res.seconds)
        if f.abandoned or f.mm_hash in self._ready:
            self._forget_grant(f)
            self._drop(f)
            return
        self._ready[f.mm_hash] = f
        if not f.holders:
            self._idle(f)

    def _fail(self, f: _Fetch, reason: Reason, error: str) -> None:
        f.state = FetchState.FAILED
        f.reason = reason
        if reason in (Reason.NOT_HELD, Reason.INCOMPATIBLE):  # the encoder instance's answer to the Lookup
            self._metrics.refusals.labels(reason.value).inc()
        self._forget_grant(f)
        self._metrics.fetches.labels("failed").inc()
        log.warning("fetch of item %.16s from %s failed (%s): %s", f.mm_hash, f.grant.endpoint, reason.value, error)

    def _fallback(self, st: _Req, item: _Item, request: Any, reason: Reason) -> None:
        feats = _features(request, item.mm_hash)
        if self._cfg.fallback == "local" and feats and all(self._has_media(f) for f in feats):
            item.status = ItemStatus.LOCAL
            self._metrics.fallbacks.labels(reason.value).inc()
            log.info("request %s: item %.16s will be encoded locally (%s)", st.request_id, item.mm_hash, reason.value)
            return
        item.status = ItemStatus.FAILED
        if st.request_id not in self._unavailable:
            self._unavailable.add(st.request_id)
            self._metrics.unavailable.labels(reason.value).inc()
            log.warning(
                "request %s: item %.16s could not be fetched (%s) and the request has no media to "
                "encode; vLLM fails the request",
                st.request_id,
                item.mm_hash,
                reason.value,
            )

    def _give_back(self, item: _Item) -> None:
        if item.grant is not None and not item.grant_spent:
            item.grant_spent = True
            self._fetcher.release_async([item.grant])

    def _forget_grant(self, f: _Fetch) -> None:
        if self._fetches.get(f.grant.grant_id) is f:
            del self._fetches[f.grant.grant_id]

    def _drop(self, f: _Fetch) -> None:
        if not f.dropped:
            f.dropped = True
            self._fetcher.drop_async([f.staging_key])

    def _idle(self, f: _Fetch) -> None:
        """A ready item nobody holds now: retired ``retire_grace_s`` after its last load unless held again."""
        if not f.idle_listed:  # an item used and let go again before the next scan is listed once
            f.idle_listed = True
            self._idle_ready.append(f)
        self._next_retire = min(self._next_retire, f.last_load_s + self._retire_grace_s)

    def _set_waiting(self, st: _Req, waiting: bool) -> None:
        if waiting != st.waiting:
            st.waiting = waiting
            self._metrics.held_requests.inc() if waiting else self._metrics.held_requests.dec()


def _result(f: _Fetch) -> FetchResult:
    exc = f.future.exception()
    if exc is not None:
        return FetchResult(False, f.staging_key, reason=getattr(exc, "reason", Reason.UNKNOWN), error=repr(exc))
    return f.future.result()


class ConsumerWorker:
    """The worker half: places staged tensors into vLLM's encoder cache: from the host's segment when the load
    names one (``segments.map_segment``), else from this rank's StagingArea (``area``; None when the host stages)."""

    def __init__(self, area: StagingArea | None, metrics: ECMetrics) -> None:
        self.area = area
        self._metrics = metrics

    def start_load_caches(
        self, encoder_cache: MutableMapping[str, torch.Tensor], loads: Iterable[tuple[str, str, Any]]
    ) -> None:
        for mm_hash, key, ref in loads:
            if mm_hash in encoder_cache:
                continue
            tensor = self._staged(mm_hash, key, ref)
            if tensor is None:
                self._metrics.place_misses.inc()
                log.error(
                    "item %.16s was announced but is not staged here (key %s); vLLM will fail with an "
                    "encoder cache miss",
                    mm_hash,
                    key,
                )
                continue
            encoder_cache[mm_hash] = tensor
            self._metrics.placed.inc()

    def _staged(self, mm_hash: str, key: str, ref: Any) -> torch.Tensor | None:
        if isinstance(ref, SegmentRef):
            try:
                return map_segment(ref)
            except Exception as exc:
                log.error("item %.16s: the host's segment %s cannot be mapped: %s", mm_hash, ref.name, exc)
                return None
        staged = self.area.get(key) if self.area is not None else None
        return staged[0] if staged is not None else None


__all__ = ["ConsumerScheduler", "ConsumerWorker", "ItemStatus", "FetchState"]
