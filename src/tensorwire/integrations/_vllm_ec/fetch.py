"""The LLM side's fetch of one item: (lookup ->) every reader stages it -> the grant is released.

Who reads: one *stager* per reader. GPU ranks in other processes each read the item into their own device
(one :class:`RemoteStager` per rank); CPU ranks in other processes share one READ made by the scheduler's
process into a shared-memory segment they map (``segments.SegmentStager``, the host's one stager); a rank in
the scheduler's own process is read into directly (:class:`LocalStager`; on host memory into a segment made
ahead, whose view vLLM's encoder cache keeps). The scheduler side looks the item up
once (one control RPC to the encoder instance), then hands the receipt to every stager; each answers only when
the tensors are where its rank loads them. The grant goes back to the encoder instance when the last stager has
answered, success or not (:class:`RankCountdown`, one reference per stager); the encoder's TTL GC is the
backstop for a release that is lost. Only when every stager succeeded is the item delivered; the scheduler then
announces it to vLLM, so a failed read never reaches a worker.

No lookup at all when the params carry the item's receipt (``receipts``) and its owner is one this fetcher met
through a Lookup answer (which brings the owner's metadata token and pid; params never carry them). An owner on
this host whose receipt's host segment says where the item's tensor sits is mapped from that segment with nothing
else parsed (``Fetcher._map_from_params``, the host's one stager's ``map_announced``); otherwise the item is read at
once, on the caller's thread when the one stager needs no RPC (vLLM's scheduler thread, so the item is ready in
the same scheduling pass), else on a fetch thread. Nothing of the encoder instance has to run for that: the
read is one-sided. A receipt that fails (a released or reused slot fails the generation check) falls back to the
lookup within the budget.

Two ways to run a fetch with a lookup (:class:`Fetcher`): *inline*, when the one stager needs no RPC and the encoder
instance's store answers on a same-host socket: the Lookup is written and collected without blocking by
``advance`` (vLLM's scheduler thread, every step) and the item staged on that thread, so no thread of ours must
wake up (inside a one-process engine each such wake-up can wait a GIL switch interval behind the engine loop);
otherwise a fetch thread runs the Lookup and the stages.

The Release RPC is off the critical path. A fetch that ran on the caller's thread leaves it for
``flush_releases``, which the scheduler calls after the step's forward pass, and which writes it to the same-host
socket from that thread; ``advance`` collects the answer later (no thread of ours is woken: inside the engine
every wake-up takes the GIL from the engine loop); otherwise the last rank's countdown queues it on the release
threads. Either way the fetch answers at once (the tensors are local by then, so nothing the item's consumer
does depends on it). A release that fails is counted (``releases{outcome="failed"}``) and left to the encoder's
TTL GC; ``close()`` still sends every queued one.

Stagers: :class:`LocalStager` (the rank's StagingArea is in this process: vLLM's uniproc executor),
``segments.SegmentStager`` (CPU ranks of the multiprocess executor, vLLM's default on CPU even at TP=1) and
:class:`RemoteStager` (a GPU worker process's Staging service, on its same-host socket, gRPC over a unix socket
as the fallback).

Budget: ``fetch_timeout_ms`` from the start of the fetch covers the lookup (at most ``lookup_timeout_ms``) and
every rank's read; the release has its own ``release_timeout_ms``. A breaker per endpoint
(``tensorwire.mm.BreakerBoard``) stops trying an encoder instance after ``failures_to_open`` consecutive faults;
a missing item (released early, expired: reason ``not_held``) and budget exhaustion do not count as faults.
A lookup answered ``not_ready`` (the encoder instance granted the item and has not held it yet) is asked again
after short pauses while the budget lasts.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Protocol

import torch

from tensorwire.errors import DeadlineExceeded, ReadTimeout, Reason, TensorwireError
from tensorwire.integrations._vllm_ec.config import ECConfig
from tensorwire.integrations._vllm_ec.metrics import ECMetrics
from tensorwire.integrations._vllm_ec.params import ItemGrant
from tensorwire.integrations._vllm_ec.receipts import parse_receipt
from tensorwire.integrations._vllm_ec.segments import (
    HostSegment,
    SegmentSpares,
    SegmentStager,
    open_announced_segment,
    open_host_segment,
)
from tensorwire.mm._proto import encoder_pb2 as pb
from tensorwire.mm.client._breaker import BreakerBoard
from tensorwire.mm.held._local import LocalUnavailable
from tensorwire.mm.held._rpc import HeldStoreClient, PendingLookup, PendingRelease, StagingClient
from tensorwire.mm.held._staging import Expect, StagingArea
from tensorwire.rdma import Descriptor, Owner
from tensorwire.rdma._local import host_id

log = logging.getLogger(__name__)

# Failures that say nothing about the encoder instance's health.
# (A lookup that times out at lookup_timeout_ms is DEADLINE_EXCEEDED, a fault; one cut short by the item's
# budget is BUDGET_EXHAUSTED.)
_NEUTRAL = frozenset(
    {
        Reason.NOT_HELD,
        Reason.NOT_READY,
        Reason.BUDGET_EXHAUSTED,
        Reason.CLOSED,
        Reason.RESULT_MISMATCH,
        Reason.INVALID_REQUEST,
        Reason.INCOMPATIBLE,
    }
)
# A lookup answered not_ready (granted, still being encoded) is asked again after these pauses (the last one
# repeats) while the item's budget lasts.
# TENSORWIRE_VLLM_EC_TRACE=1: one INFO line per inline fetch with where its time went.
_TRACE = os.environ.get("TENSORWIRE_VLLM_EC_TRACE", "") == "1"
_NOT_READY_BACKOFF_S = (0.002, 0.005, 0.01, 0.02, 0.05)
# Owners (store endpoint, agent, metadata endpoint) whose metadata token a Lookup answer of that store brought
# (the token is per owner process; a new registration epoch of the same owner needs none), at most.
_MAX_OWNERS = 4096
# The consumer drops an item it no longer needs when it next looks at its requests, which is when the next request
# arrives: the drop (a mapping's last reference: its munmap, ~0.6 ms per used 10 MB, holds the process's mapping
# lock) then ran beside that request's fetch, whose own mmap waited for it (a real engine's 10 MB map: 0.1 ms
# alone, 0.9-1.3 ms beside a drop). Drops wait this long, as spare segments do (segments.REFILL_DELAY_S).
DROP_DELAY_S = 0.1
# A release of an item staged on the scheduler's thread waits for flush_releases (after the step that loads the
# item: writing it before cost that step ~0.05-0.08 ms) at most this long.
RELEASE_DEFER_S = 0.05


class Stager(Protocol):
    """One rank's staging area, local or behind a socket. ``stage`` raises on failure. A host's only stager may
    also have ``plane_of(key)``: ``"map"`` for an item it mapped from its producer instead of reading."""

    name: str

    def stage(self, key: str, receipt: pb.EncodeResponse, *, timeout_ms: int, expect: Expect) -> int: ...

    def drop(self, keys: Sequence[str]) -> None: ...

    def close(self) -> None: ...


class LocalStager:
    """A StagingArea in this process (vLLM's uniproc executor: the worker shares the scheduler's process).

    With ``spares`` (host memory) an RDMA item is READ straight into a segment taken from them, used once: the
    staged tensors are views of it, so vLLM's encoder cache may keep them after ``drop``. Without, the reader's
    own destinations are used (whose loans the encoder cache would keep, leaving later reads to allocate and
    register fresh tensors); inline items are always decoded by the area. With ``map_host`` an item whose receipt
    names its producer's host segment on this host is mapped instead (``segments.open_host_segment``) and kept with
    ``StagingArea.put``: nothing is read."""

    inline = True  # no RPC: the fetch may run it on the scheduler's thread

    def __init__(
        self, area: StagingArea, name: str = "rank0", *, spares: SegmentSpares | None = None, map_host: bool = False
    ) -> None:
        self.area = area
        self.name = name
        self._spares = spares
        self.map_host = map_host

    @property
    def mapped(self) -> int:
        """Items handed over as a producer's host segment (no read): the area's puts, which only this makes."""
        return self.area.stats().put_items

    def stage(self, key: str, receipt: pb.EncodeResponse, *, timeout_ms: int, expect: Expect) -> int:
        host = open_host_segment(receipt, expect, key) if self.map_host else None
        if host is not None:
            return self._put(key, host)
        spares = self._spares
        if spares is None or not receipt.rdma_slots:
            return self.area.stage(key, receipt, timeout_ms=timeout_ms, expect=expect)
        made: list[int] = []

        def alloc(nbytes: int) -> torch.Tensor:
            seg = spares.take(nbytes)
            seg.close()  # the mapping stays while the staged tensors (views of it) do; the descriptor is not needed
            made.append(seg.size)
            return seg.tensor

        try:
            return self.area.stage(key, receipt, timeout_ms=timeout_ms, expect=expect, into=alloc)
        finally:
            for size in made:
                spares.refill(size)

    def map_announced(self, key: str, hs: pb.HostSegment, pid: int, expect: Expect) -> int | None:
        """Stages the item ``hs`` announces in process ``pid`` (``segments.open_announced_segment``) by mapping
        it; its bytes, or None when it cannot be (nothing staged: take ``stage``). Raises on ``Expect`` failures."""
        host = open_announced_segment(hs, pid, expect, key) if self.map_host else None
        return self._put(key, host) if host is not None else None

    def _put(self, key: str, host: HostSegment) -> int:
        """The producer's own segment, mapped and kept under ``key``: nothing is read."""
        try:
            tensors = host.tensors()
        finally:
            host.close()
        return self.area.put(key, tensors)

    def plane_of(self, key: str) -> str | None:
        """``"map"`` when the item under ``key`` is a producer's host segment (nothing was read), else None."""
        return "map" if self.area.was_put(key) else None

    def drop(self, keys: Sequence[str]) -> None:
        self.area.drop(keys)

    def close(self) -> None:
        if self._spares is not None:  # only the spares: the area belongs to the worker side
            self._spares.close()


class RemoteStager:
    """A worker process's Staging service: its same-host socket (``tensorwire.mm.held._local``), with the
    ``unix:`` gRPC service at ``address`` as the fallback."""

    inline = False

    def __init__(
        self,
        address: str,
        name: str,
        drop_timeout_s: float = 2.0,
        local_path: str = "",
        metrics: ECMetrics | None = None,
    ) -> None:
        self.client = StagingClient(
            address, local_path=local_path, on_call=None if metrics is None else metrics.count_control_call
        )
        self.name = name
        self._drop_timeout_s = drop_timeout_s

    def stage(self, key: str, receipt: pb.EncodeResponse, *, timeout_ms: int, expect: Expect) -> int:
        return self.client.stage(key, receipt, timeout_ms=timeout_ms, expect=expect)

    def drop(self, keys: Sequence[str]) -> None:
        self.client.drop(keys, timeout_s=self._drop_timeout_s)

    def close(self) -> None:
        self.client.close()


class RankCountdown:
    """Calls ``release`` once, when every one of ``ranks`` has reported ``done`` (success or failure).

    ``done(rank)`` is idempotent per rank, so a retried or duplicated report cannot release early; ``force()``
    releases now (the fetch gave up on a rank that never answers). Thread-safe.
    """

    def __init__(self, ranks: int, release: Callable[[], None]) -> None:
        if ranks < 1:
            raise ValueError("RankCountdown needs at least one rank")
        self._ranks = ranks
        self._left = set(range(ranks))
        self._release = release
        self._lock = threading.Lock()
        self._fired = False

    @property
    def outstanding(self) -> int:
        with self._lock:
            return len(self._left)

    @property
    def released(self) -> bool:
        with self._lock:
            return self._fired

    def done(self, rank: int) -> bool:
        """Marks ``rank`` done; True when this call released."""
        with self._lock:
            if not 0 <= rank < self._ranks:
                raise ValueError(f"rank {rank} is not in [0, {self._ranks})")
            self._left.discard(rank)
            fire = not self._left and not self._fired
            self._fired = self._fired or fire
        if fire:
            self._release()
        return fire

    def force(self) -> bool:
        with self._lock:
            fire = not self._fired
            self._fired = True
            self._left.clear()
        if fire:
            self._release()
        return fire


@dataclass(frozen=True)
class FetchResult:
    """``ok``: every rank holds the item under ``staging_key``. Else ``reason``/``error`` say why."""

    ok: bool
    staging_key: str
    plane: str = ""
    nbytes: int = 0  # bytes staged, all stagers
    seconds: float = 0.0
    reason: Reason | None = None
    error: str = ""


@dataclass(eq=False)
class _Inline:
    """A fetch driven by ``Fetcher.advance`` on the scheduler's thread: its Lookup is in flight on a same-host
    socket; when the answer is there the item is staged on that thread (the host's one READ)."""

    future: Future[FetchResult]
    grant: ItemGrant
    key: str
    expect: Expect
    deadline: float
    pending: PendingLookup | None  # None: waiting until retry_at to ask again (not_ready)
    t0: float
    attempt: int = 0
    retry_at: float = 0.0
    looks: int = 0  # advance() calls that found no answer yet (the trace's count)


class Fetcher:
    """Runs item fetches; the scheduler polls the futures (it never blocks on a peer).

    Two paths. Inline (one stager that needs no RPC, and a same-host socket to the encoder instance's store):
    ``start`` writes the Lookup and returns; ``advance``, called by the scheduler every step, collects the answer
    and stages the item on the scheduler's thread, so no thread of ours has to be woken (on a one-process engine
    each wake-up of a Python thread can wait a GIL switch interval behind the engine loop). Otherwise a fetch
    thread runs the Lookup (gRPC or the socket) and every rank's stage."""

    def __init__(
        self,
        cfg: ECConfig,
        stagers: Sequence[Stager],
        metrics: ECMetrics,
        *,
        breakers: BreakerBoard | None = None,
        support_rdma: bool = True,
        clock: Callable[[], float] = time.monotonic,
        compat: str = "",
    ) -> None:
        if not stagers:
            raise ValueError("Fetcher needs at least one stager (one per rank)")
        self._cfg = cfg
        self._stagers = list(stagers)
        self._metrics = metrics
        self._support_rdma = support_rdma
        self._clock = clock
        self._compat = compat  # sent with every Lookup: the encoder instance refuses another of its own
        self.breakers = breakers or BreakerBoard("endpoint", cfg.failures_to_open, cfg.open_seconds)
        self._pool = ThreadPoolExecutor(max_workers=cfg.fetch_threads, thread_name_prefix="tensorwire-ec-fetch")
        # Ranks other than the first stage in parallel on their own threads (the fetch thread takes rank 0).
        self._rank_pool = (
            ThreadPoolExecutor(
                max_workers=max(1, cfg.fetch_threads * (len(self._stagers) - 1)),
                thread_name_prefix="tensorwire-ec-rank",
            )
            if len(self._stagers) > 1
            else None
        )
        self._side_pool = ThreadPoolExecutor(max_workers=2, thread_name_prefix="tensorwire-ec-release")
        self._dropper = ThreadPoolExecutor(max_workers=1, thread_name_prefix="tensorwire-ec-drop")
        self._drops_now = threading.Event()  # set by close(): pending drops run at once
        self._releases_queued = 0  # releases submitted and not finished (wait_released)
        self._releases_cv = threading.Condition()
        self._clients: dict[str, HeldStoreClient] = {}
        self._clients_lock = threading.Lock()
        self._closed = False
        # One stager that needs no RPC (the host's, or the uniproc rank's): fetches whose Lookup can go over a
        # same-host socket run on the caller's thread, advanced by advance() (see _Inline).
        self._inline_ok = len(self._stagers) == 1 and bool(getattr(self._stagers[0], "inline", False))
        self._inline: list[_Inline] = []
        self._releasing: list[tuple[ItemGrant, PendingRelease]] = []  # written here, answers collected by advance
        # Releases of items staged on the caller's thread, written by flush_releases (after the step that needs the
        # item has run) or by advance once the oldest waited RELEASE_DEFER_S.
        self._deferred: list[ItemGrant] = []
        self._deferred_since = 0.0
        # Owners met through a Lookup answer (what lets a receipt from params be read): their metadata token, pid
        # and host id are taken from that answer, never from params.
        self._owners: dict[tuple[str, str, str, int], Owner] = {}
        # The pid of each endpoint's store when it runs on this host (from those answers too): a receipt in params
        # whose host segment says where its tensor sits is mapped from that process with no descriptor parsed.
        self._host_pids: dict[str, int] = {}
        first = self._stagers[0]
        self._mapper: LocalStager | SegmentStager | None = None
        if self._inline_ok and isinstance(first, (LocalStager, SegmentStager)) and first.map_host:
            self._mapper = first

    @property
    def ranks(self) -> int:
        return len(self._stagers)

    def start(self, grant: ItemGrant, staging_key: str, expect: Expect) -> Future[FetchResult]:
        """Starts a fetch; its future is answered by a fetch thread, or by ``advance`` (the inline path)."""
        deadline = self._clock() + self._cfg.fetch_timeout_ms / 1000.0
        fut: Future[FetchResult] = Future()
        fut.set_running_or_notify_cancel()
        parsed = None  # the params' receipt, parsed once for both paths below
        if grant.receipt is not None and (self._mapper is not None or self._support_rdma):
            parsed = parse_receipt(grant.receipt)
        if parsed is not None and self._mapper is not None and not self._closed:
            res = self._map_from_params(grant, parsed, staging_key, expect)
            if res is not None:
                fut.set_result(res)
                return fut
        receipt = self._receipt_from_params(grant, parsed)
        if receipt is not None and not self._closed and self.breakers.allow(grant.endpoint):
            self._metrics.series(self._metrics.fetch_paths, "params").inc()
            if self._inline_ok:
                res = self._stage_from_params(grant, staging_key, receipt, expect, deadline, here=True)
                if res is not None:
                    fut.set_result(res)
                    return fut
                staging_key += ".l"  # looked up below: a fresh key (a failed read leaves nothing staged)
            else:
                self._pool.submit(self._answer_then_release, fut, grant, staging_key, expect, deadline, receipt)
                return fut
        if self._inline_ok and not self._closed and self._start_inline(fut, grant, staging_key, expect, deadline):
            self._metrics.fetch_paths.labels("inline").inc()
            return fut
        self._metrics.fetch_paths.labels("thread").inc()
        self._pool.submit(self._answer_then_release, fut, grant, staging_key, expect, deadline)
        return fut

    def advance(self) -> None:
        """Advances the inline fetches without blocking on a peer: collects Lookup answers that have arrived and
        stages those items (a same-host READ, bounded by the item's budget). Call it from the thread that called
        ``start`` (vLLM's scheduler thread, every step). Also collects the answers of releases written here."""
        if self._deferred and self._clock() - self._deferred_since >= RELEASE_DEFER_S:
            self.flush_releases()
        if self._releasing:
            self._collect_releases()
        if not self._inline:
            return
        still: list[_Inline] = []
        for f in self._inline:
            if not self._step_inline(f):
                still.append(f)
        self._inline = still

    def flush_releases(self) -> None:
        """Writes the releases of items staged on this thread since the last call (``advance`` collects the
        answers). Call it from that thread once the step that needed those items has run (the connector: when vLLM
        asks for the unavailable requests, after the forward pass), so the writes are off the item's path;
        ``advance`` writes them anyway ``RELEASE_DEFER_S`` after the first."""
        deferred, self._deferred = self._deferred, []
        for g in deferred:
            self._release_here(g)

    @property
    def inline_pending(self) -> int:
        return len(self._inline)

    def load_ref(self, staging_key: str) -> object | None:
        """What a worker needs to map a staged item (the host stager's segment), or None (a rank's own area)."""
        ref = getattr(self._stagers[0], "ref", None)
        return ref(staging_key) if ref is not None else None

    def release_async(self, grants: Sequence[ItemGrant]) -> None:
        """Gives grants back without reading them (the item came another way, or is no longer needed)."""
        for g in grants:
            if not self._closed:
                self._submit_release(g)

    def wait_released(self, timeout_s: float) -> bool:
        """Waits until no queued release is left (True), or ``timeout_s`` passed (False). For callers that
        must see the grants back (a benchmark's final count, a test), never needed for correctness; call it from
        the thread that calls ``advance`` (it collects the answers of releases written on that thread)."""
        deadline = time.monotonic() + timeout_s
        self.flush_releases()
        while self._releasing:
            self._collect_releases()
            if time.monotonic() >= deadline:
                return False
            time.sleep(0.002)
        with self._releases_cv:
            return self._releases_cv.wait_for(
                lambda: self._releases_queued == 0, timeout=max(0.0, deadline - time.monotonic())
            )

    def drop_async(self, staging_keys: Sequence[str]) -> None:
        """Forgets staged items on every rank, ``DROP_DELAY_S`` from now (in the order asked)."""
        keys = list(staging_keys)
        if keys and not self._closed:
            self._dropper.submit(self._drop_later, keys, time.monotonic() + DROP_DELAY_S)

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        for f in self._inline:  # never answered: the grant goes back, the caller sees the fetch fail
            if f.pending is not None:
                f.pending.cancel()
            self._release_even_closed(f.grant)
            f.future.set_result(self._failed(f.key, f.t0, Reason.CLOSED, "the fetcher closed"))
        self._inline = []
        for grant in self._deferred:  # never written: the release threads send them
            self._release_even_closed(grant)
        self._deferred = []
        for grant, pending in self._releasing:  # unanswered: sent again (Release is idempotent)
            pending.cancel()
            self._release_even_closed(grant)
            self._release_done()
        self._releasing = []
        # Queued releases still go out (they end leases on encoder instances); running fetches finish.
        self._drops_now.set()
        for pool in (self._pool, self._rank_pool, self._side_pool, self._dropper):
            if pool is not None:
                pool.shutdown(wait=True, cancel_futures=False)
        with self._clients_lock:
            clients, self._clients = list(self._clients.values()), {}
        for c in clients:
            c.close()
        for s in self._stagers:
            s.close()

    # -- internals --

    def _client(self, endpoint: str) -> HeldStoreClient:
        with self._clients_lock:
            c = self._clients.get(endpoint)
            if c is None:
                c = self._clients[endpoint] = HeldStoreClient(
                    endpoint,
                    tls=self._cfg.tls,
                    local_channel=self._cfg.local_channel != "off",
                    on_call=self._metrics.count_control_call,
                )
            return c

    def _remaining_ms(self, deadline: float) -> int:
        return int((deadline - self._clock()) * 1000)

    def _answer_then_release(
        self,
        fut: Future[FetchResult],
        grant: ItemGrant,
        key: str,
        expect: Expect,
        deadline: float,
        receipt: pb.EncodeResponse | None = None,
    ) -> None:
        """Runs the fetch, answers ``fut``, and only then queues the release, so that the caller wakes before the
        release thread does (on a loaded machine each wake-up can cost a scheduler slice). With ``receipt`` (from
        the params) the item is read first without a lookup; a failed read is looked up under a fresh key."""
        later: list[ItemGrant] = []
        try:
            if receipt is not None:
                res = self._stage_from_params(grant, key, receipt, expect, deadline)
                if res is not None:
                    fut.set_result(res)
                    return
                key += ".l"
            fut.set_result(self._run(grant, key, expect, deadline, later))
        except BaseException as exc:
            fut.set_exception(exc)
        finally:
            for g in later:
                self._release_later(g)

    def _run(self, grant: ItemGrant, key: str, expect: Expect, deadline: float, later: list[ItemGrant]) -> FetchResult:
        """One fetch; the grant's release is appended to ``later`` (the countdown fires before this returns:
        every rank answered, or ``force``)."""
        t0 = self._clock()
        endpoint = grant.endpoint
        if not self.breakers.allow(endpoint):
            self.release_async([grant])  # best effort: the endpoint is failing, the TTL GC is the backstop
            return self._failed(key, t0, Reason.BREAKER_OPEN, f"breaker open for {endpoint}")
        try:
            receipt = self._lookup(grant, deadline)
        except TensorwireError as exc:
            self._judge(endpoint, exc.reason)
            if exc.reason is not Reason.NOT_HELD:
                self.release_async([grant])  # the owner may still hold it (lookup timed out, say)
            return self._failed(key, t0, exc.reason, str(exc))
        self._learn_owners(grant.endpoint, receipt)
        return self._stage_and_judge(grant, key, receipt, expect, deadline, later)

    def _learn_owners(self, endpoint: str, receipt: pb.EncodeResponse) -> None:
        """Remembers the owners (metadata token, pid, host id) a Lookup answer of ``endpoint`` names: receipts in
        params that name the same endpoint and owner may be read without a lookup."""
        for slot in receipt.rdma_slots:
            try:
                owner = Descriptor.from_bytes(bytes(slot.descriptor)).owner
            except TensorwireError:
                return  # the stage that follows reports it
            k = (endpoint, owner.agent_name, owner.host, owner.port)
            if k not in self._owners:
                if len(self._owners) >= _MAX_OWNERS:
                    self._owners.clear()  # owners come and go with encoder instances: relearn the live ones
                self._owners[k] = owner
            if owner.pid > 0 and owner.host_id and owner.host_id == host_id():
                if len(self._host_pids) >= _MAX_OWNERS and endpoint not in self._host_pids:
                    self._host_pids.clear()
                self._host_pids[endpoint] = owner.pid

    def _map_from_params(
        self, grant: ItemGrant, receipt: pb.EncodeResponse, key: str, expect: Expect
    ) -> FetchResult | None:
        """The item mapped from the host segment its params' receipt announces, on this thread, with nothing
        parsed but the receipt: only when the grant's endpoint runs on this host (its pid learned from a Lookup
        answer, never from params) and the segment says where its one tensor sits. The result (the grant's release
        queued for ``flush_releases``), or None when the item must take the descriptor's path (nothing staged; a
        layout that does not match what this instance expects is left to that path, which reports it).
        ``receipt``: the grant's, parsed (not edited here)."""
        pid = self._host_pids.get(grant.endpoint)
        if pid is None or self._mapper is None or not self.breakers.allow(grant.endpoint):
            return None
        if not receipt.HasField("host_segment") or len(receipt.rdma_slots) != 1:
            return None
        t0 = self._clock()
        try:
            nbytes = self._mapper.map_announced(key, receipt.host_segment, pid, expect)
        except TensorwireError:
            return None
        if nbytes is None:
            return None
        m = self._metrics
        m.series(m.fetch_paths, "params").inc()
        m.series(m.receipts, "used").inc()
        self.breakers.record_success(grant.endpoint)
        self._release_soon(grant)
        if _TRACE:
            log.info("params map %s: staged in %.2f ms, %d bytes", key, (self._clock() - t0) * 1e3, nbytes)
        return FetchResult(True, key, plane="map", nbytes=nbytes, seconds=self._clock() - t0)

    def _receipt_from_params(self, grant: ItemGrant, receipt: pb.EncodeResponse | None) -> pb.EncodeResponse | None:
        """The receipt the params carry, with what its owners were met with (metadata token, pid, host id)
        filled in, when every owner it names was met through a Lookup answer of the grant's endpoint and every
        descriptor's generation is bound to its slot (``Descriptor.binding``: params are edited by whoever relays
        them, and an unbound descriptor could be pointed at another item's slot); else None (looked up).
        ``receipt``: ``parse_receipt(grant.receipt)`` (None: it did not parse), edited in place."""
        if grant.receipt is None or not self._support_rdma:
            return None
        m = self._metrics
        if receipt is None:
            m.series(m.receipts, "invalid").inc()
            return None
        for slot in receipt.rdma_slots:
            try:
                d = Descriptor.from_bytes(bytes(slot.descriptor))
            except TensorwireError:
                m.series(m.receipts, "invalid").inc()
                return None
            if not d.binding:
                m.series(m.receipts, "invalid").inc()
                return None
            o = d.owner
            met = self._owners.get((grant.endpoint, o.agent_name, o.host, o.port))
            if met is None:
                m.series(m.receipts, "unknown_owner").inc()
                return None
            if (met.metadata_token, met.pid, met.host_id) != (o.metadata_token, o.pid, o.host_id):
                owner = dataclasses.replace(o, metadata_token=met.metadata_token, pid=met.pid, host_id=met.host_id)
                # with_owner keeps the validation, so the stager's parse of these bytes is a lookup
                slot.descriptor = d.with_owner(owner).to_bytes()
        return receipt

    def _stage_from_params(
        self,
        grant: ItemGrant,
        key: str,
        receipt: pb.EncodeResponse,
        expect: Expect,
        deadline: float,
        *,
        here: bool = False,
    ) -> FetchResult | None:
        """Stages the item from the params' receipt on this thread; the result when it worked (the grant's release
        queued), None when the item must be looked up instead (nothing staged, the grant kept, no breaker fault:
        a released or reused slot says nothing about the encoder instance's health)."""
        m, t0 = self._metrics, self._clock()
        if len(self._stagers) == 1:
            # Bounded like the inline READ: a stuck same-host READ stalls the caller's thread at most this long.
            stage_deadline = min(deadline, t0 + self._cfg.lookup_timeout_ms / 1000.0)
        else:
            stage_deadline = deadline
        later: list[ItemGrant] = []
        countdown = RankCountdown(len(self._stagers), lambda: later.append(grant))
        try:
            res = self._stage_everywhere(grant, key, receipt, expect, stage_deadline, countdown)
        except Exception as exc:  # a stager that raised past its own handling
            res = self._failed(key, t0, getattr(exc, "reason", Reason.UNKNOWN), repr(exc))
        if not res.ok:
            m.series(m.receipts, "read_failed").inc()
            log.info(
                "item %.16s: the read from the receipt in its params failed (%s: %s); looking it up",
                grant.key,
                (res.reason or Reason.UNKNOWN).value,
                res.error,
            )
            return None
        m.series(m.receipts, "used").inc()
        self.breakers.record_success(grant.endpoint)
        for g in later:
            self._release_soon(g) if here else self._release_later(g)
        if _TRACE:
            log.info("params fetch %s: staged in %.2f ms, %d bytes", key, (self._clock() - t0) * 1e3, res.nbytes)
        return FetchResult(True, key, plane=res.plane, nbytes=res.nbytes, seconds=self._clock() - t0)

    def _stage_and_judge(
        self,
        grant: ItemGrant,
        key: str,
        receipt: pb.EncodeResponse,
        expect: Expect,
        deadline: float,
        later: list[ItemGrant],
    ) -> FetchResult:
        countdown = RankCountdown(len(self._stagers), lambda: later.append(grant))
        try:
            result = self._stage_everywhere(grant, key, receipt, expect, deadline, countdown)
        finally:
            countdown.force()  # no-op when every rank reported; otherwise a rank never answered
        if result.ok:
            self.breakers.record_success(grant.endpoint)
        else:
            self._judge(grant.endpoint, result.reason or Reason.UNKNOWN)
        return result

    def _start_inline(
        self, fut: Future[FetchResult], grant: ItemGrant, key: str, expect: Expect, deadline: float
    ) -> bool:
        """Sends the Lookup over the same-host socket; False when there is none (the fetch thread takes it)."""
        if not self.breakers.allow(grant.endpoint):
            return False  # the thread path answers breaker_open
        f = _Inline(fut, grant, key, expect, deadline, None, self._clock())
        if not self._begin_inline_lookup(f):
            return False
        self._inline.append(f)
        return True

    def _begin_inline_lookup(self, f: _Inline) -> bool:
        budget_s = min(self._cfg.lookup_timeout_ms, self._remaining_ms(f.deadline)) / 1000.0
        if budget_s <= 0:
            return False
        try:
            f.pending = self._client(f.grant.endpoint).begin_lookup(
                [(f.grant.key, f.grant.secret)], timeout_s=budget_s, support_rdma=self._support_rdma
            )
        except (LocalUnavailable, TensorwireError):
            return False
        return f.pending is not None

    def _step_inline(self, f: _Inline) -> bool:
        """One non-blocking look at an inline fetch; True when it is finished (answered or handed over)."""
        if f.pending is None:  # waiting to ask again after not_ready
            if self._clock() < f.retry_at:
                return False
            if not self._begin_inline_lookup(f):
                self._pool.submit(self._answer_then_release, f.future, f.grant, f.key, f.expect, f.deadline)
                return True
            return False
        try:
            outcomes = f.pending.poll()
        except LocalUnavailable:
            # No answer over the socket: the fetch thread makes the (idempotent) Lookup again over gRPC.
            self._pool.submit(self._answer_then_release, f.future, f.grant, f.key, f.expect, f.deadline)
            return True
        except TensorwireError as exc:
            reason = exc.reason
            if reason is Reason.DEADLINE_EXCEEDED and self._remaining_ms(f.deadline) <= 0:
                reason = Reason.BUDGET_EXHAUSTED
            self._judge(f.grant.endpoint, reason)
            self.release_async([f.grant])
            f.future.set_result(self._failed(f.key, f.t0, reason, str(exc)))
            return True
        if outcomes is None:
            f.looks += 1
            return False
        answered = self._clock()
        later: list[ItemGrant] = []
        try:
            (outcome,) = outcomes
            if outcome.error is not None and outcome.error.reason is Reason.NOT_READY:
                # Granted, not held yet: ask again after a pause (_NOT_READY_BACKOFF_S) while the budget lasts.
                self._metrics.refusals.labels(Reason.NOT_READY.value).inc()
                pause = _NOT_READY_BACKOFF_S[min(f.attempt, len(_NOT_READY_BACKOFF_S) - 1)]
                if self._clock() + pause < f.deadline:
                    f.attempt += 1
                    f.pending = None
                    f.retry_at = self._clock() + pause
                    return False
            if outcome.error is not None:
                err = outcome.error
                self._judge(f.grant.endpoint, err.reason)
                if err.reason is not Reason.NOT_HELD:
                    self.release_async([f.grant])
                f.future.set_result(self._failed(f.key, f.t0, err.reason, str(err)))
                return True
            assert outcome.receipt is not None
            self._learn_owners(f.grant.endpoint, outcome.receipt)
            # The READ runs on the scheduler's thread: bounded by lookup_timeout_ms as well as by the item's budget,
            # so a stuck same-host READ stalls the engine for at most that long (then the item is encoded locally).
            stage_deadline = min(f.deadline, self._clock() + self._cfg.lookup_timeout_ms / 1000.0)
            res = self._stage_and_judge(f.grant, f.key, outcome.receipt, f.expect, stage_deadline, later)
            if _TRACE:
                done = self._clock()
                log.info(
                    "inline fetch %s: lookup answered after %.2f ms (%d empty looks), staged in %.2f ms, %d bytes",
                    f.key,
                    (answered - f.t0) * 1e3,
                    f.looks,
                    (done - answered) * 1e3,
                    res.nbytes,
                )
            f.future.set_result(
                FetchResult(
                    res.ok,
                    res.staging_key,
                    plane=res.plane,
                    nbytes=res.nbytes,
                    seconds=self._clock() - f.t0,
                    reason=res.reason,
                    error=res.error,
                )
            )
        except BaseException as exc:
            if not f.future.done():
                f.future.set_exception(exc)
        finally:
            for g in later:
                self._release_soon(g)
        return True

    def _release_soon(self, grant: ItemGrant) -> None:
        """Queues the release for ``flush_releases`` (this thread, after the step)."""
        if self._closed:  # nothing flushes any more
            self._release_even_closed(grant)
            return
        if not self._deferred:
            self._deferred_since = self._clock()
        self._deferred.append(grant)

    def _release_here(self, grant: ItemGrant) -> None:
        """Writes the release to the same-host socket from this thread (``advance`` collects the answer); the
        release threads send it when there is no socket."""
        pending = None
        if not self._closed:
            try:
                pending = self._client(grant.endpoint).begin_release(
                    [(grant.key, grant.secret)], timeout_s=self._cfg.release_timeout_ms / 1000.0
                )
            except (LocalUnavailable, TensorwireError):
                pending = None
        if pending is None:
            self._release_later(grant)
            return
        with self._releases_cv:
            self._releases_queued += 1
        self._releasing.append((grant, pending))

    def _collect_releases(self) -> None:
        still: list[tuple[ItemGrant, PendingRelease]] = []
        for grant, pending in self._releasing:
            try:
                n = pending.poll()
            except LocalUnavailable:  # no answer on the socket: the release threads send it again
                self._release_later(grant)
                self._release_done()
                continue
            except Exception as exc:
                self._metrics.releases.labels("failed").inc()
                log.info("release of an item grant on %s failed (%s); its TTL GC reclaims it", grant.endpoint, exc)
                self._release_done()
                continue
            if n is None:
                still.append((grant, pending))
                continue
            self._metrics.series(self._metrics.releases, "ok" if n else "unknown").inc()
            self._release_done()
        self._releasing = still

    def _release_even_closed(self, grant: ItemGrant) -> None:
        """Queues the release, or sends it here once the release threads are shut down."""
        try:
            self._submit_release(grant)
        except RuntimeError:
            self._release(grant)

    def _lookup(self, grant: ItemGrant, deadline: float) -> pb.EncodeResponse:
        """The item's receipt; an answer of not_ready is asked again (``_NOT_READY_BACKOFF_S``) within the
        budget, and the fetch fails as not_ready when the budget ends first (also in the middle of a retry)."""
        attempt = 0
        not_ready: TensorwireError | None = None
        while True:
            try:
                return self._lookup_once(grant, deadline)
            except TensorwireError as exc:
                if exc.reason is Reason.BUDGET_EXHAUSTED and not_ready is not None:
                    raise not_ready from exc  # the budget ran out while the item was still being encoded
                if exc.reason is not Reason.NOT_READY:
                    raise
                not_ready = exc
                self._metrics.refusals.labels(Reason.NOT_READY.value).inc()
                pause = _NOT_READY_BACKOFF_S[min(attempt, len(_NOT_READY_BACKOFF_S) - 1)]
                if self._clock() + pause >= deadline or self._closed:
                    raise
                attempt += 1
                time.sleep(pause)

    def _lookup_once(self, grant: ItemGrant, deadline: float) -> pb.EncodeResponse:
        remaining = self._remaining_ms(deadline)
        budget_s = min(self._cfg.lookup_timeout_ms, remaining) / 1000.0
        if budget_s <= 0:
            raise DeadlineExceeded("no budget left for the lookup", reason=Reason.BUDGET_EXHAUSTED)
        try:
            (outcome,) = self._client(grant.endpoint).lookup(
                [(grant.key, grant.secret)], timeout_s=budget_s, support_rdma=self._support_rdma, compat=self._compat
            )
        except DeadlineExceeded as exc:
            if remaining < self._cfg.lookup_timeout_ms:
                raise DeadlineExceeded(str(exc), reason=Reason.BUDGET_EXHAUSTED) from exc
            raise
        if outcome.error is not None:
            raise outcome.error
        assert outcome.receipt is not None
        return outcome.receipt

    def _stage_everywhere(
        self,
        grant: ItemGrant,
        key: str,
        receipt: pb.EncodeResponse,
        expect: Expect,
        deadline: float,
        countdown: RankCountdown,
    ) -> FetchResult:
        t0 = self._clock()
        plane = "rdma" if receipt.rdma_slots else "inline"

        def one(rank: int) -> int:
            try:
                timeout_ms = self._remaining_ms(deadline)
                if timeout_ms <= 0:
                    raise ReadTimeout("no budget left for the read", reason=Reason.BUDGET_EXHAUSTED)
                return self._stagers[rank].stage(key, receipt, timeout_ms=timeout_ms, expect=expect)
            finally:
                countdown.done(rank)

        others: list[Future[int]] = []
        if self._rank_pool is not None:
            others = [self._rank_pool.submit(one, r) for r in range(1, len(self._stagers))]
        errors: list[tuple[int, BaseException]] = []
        staged: list[int] = []
        nbytes = 0
        try:
            nbytes += one(0)
            staged.append(0)
        except Exception as exc:
            errors.append((0, exc))
        for r, fut in enumerate(others, start=1):
            wait_s = max(0.0, deadline - self._clock()) + 2.0  # a stager answers within its read budget
            try:
                nbytes += fut.result(timeout=wait_s)
                staged.append(r)
            except Exception as exc:
                errors.append((r, exc))
        if not errors:
            plane_of = getattr(self._stagers[0], "plane_of", None) if len(self._stagers) == 1 else None
            if plane_of is not None:
                plane = plane_of(key) or plane
            return FetchResult(True, key, plane=plane, nbytes=nbytes, seconds=self._clock() - t0)
        if staged:
            self.drop_async([key])  # the ranks that have it must not keep it
        rank, first = errors[0]
        reason = first.reason if isinstance(first, TensorwireError) else Reason.UNKNOWN
        if isinstance(first, TimeoutError) and not isinstance(first, TensorwireError):
            reason = Reason.READ_TIMEOUT
        return self._failed(key, t0, reason, f"rank {self._stagers[rank].name}: {first}", plane=plane)

    def _judge(self, endpoint: str, reason: Reason) -> None:
        if reason in _NEUTRAL:
            self.breakers.record_neutral(endpoint)
        else:
            self.breakers.record_failure(endpoint)

    def _failed(self, key: str, t0: float, reason: Reason, error: str, plane: str = "") -> FetchResult:
        return FetchResult(False, key, plane=plane, seconds=self._clock() - t0, reason=reason, error=error)

    def _release_later(self, grant: ItemGrant) -> None:
        """Queues the grant's release on the release threads (the fetch does not wait for it). Before close()
        has shut them down a submit always succeeds; after (a fetch that outlived close), the release runs here."""
        try:
            self._submit_release(grant)
        except RuntimeError:  # the pool is shut down
            self._release(grant)

    def _submit_release(self, grant: ItemGrant) -> None:
        with self._releases_cv:
            self._releases_queued += 1
        try:
            self._side_pool.submit(self._release_queued, grant)
        except BaseException:
            self._release_done()
            raise

    def _release_queued(self, grant: ItemGrant) -> None:
        try:
            self._release(grant)
        finally:
            self._release_done()

    def _release_done(self) -> None:
        with self._releases_cv:
            self._releases_queued -= 1
            if self._releases_queued == 0:
                self._releases_cv.notify_all()

    def _release(self, grant: ItemGrant) -> None:
        try:
            n = self._client(grant.endpoint).release(
                [(grant.key, grant.secret)], timeout_s=self._cfg.release_timeout_ms / 1000.0
            )
            self._metrics.releases.labels("ok" if n else "unknown").inc()
        except Exception as exc:
            self._metrics.releases.labels("failed").inc()
            log.info("release of an item grant on %s failed (%s); its TTL GC reclaims it", grant.endpoint, exc)

    def _drop_later(self, keys: list[str], due: float) -> None:
        self._drops_now.wait(max(0.0, due - time.monotonic()))
        self._drop_all(keys)

    def _drop_all(self, keys: list[str]) -> None:
        for s in self._stagers:
            try:
                s.drop(keys)
            except Exception as exc:
                log.warning("dropping %d staged item(s) on %s failed: %s", len(keys), s.name, exc)


__all__ = ["Stager", "LocalStager", "RemoteStager", "RankCountdown", "FetchResult", "Fetcher"]
