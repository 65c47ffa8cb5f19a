"""The encoder proxy: one ``EncoderService`` endpoint in front of several encoder workers.

Per ``Encode``: pick workers round-robin (those that can serve first, see ``_workers.WorkerHealth``; those the
request's ``rdma_excluded_workers`` names last), forward the request bytes unchanged, retry on the next worker
when the failure is about the worker (UNAVAILABLE, INTERNAL, ...) rather than about the request
(INVALID_ARGUMENT...), within the caller's deadline and ``max_attempts`` (by default three rounds over all). A
receipt that fails the checks a reader would make before reading (``_receipt.check_receipt``: descriptors, roles,
layout, inline sizes) is a worker failure too: its leases are released on that worker and the next one is asked;
only the last attempt's receipt is forwarded as it is. A successful receipt's lease ids are recorded in the
``RouteTable`` under the worker the proxy called (not the identity the receipt claims), and the response
bytes go back unchanged. Per ``ReleaseLeases``: group the ids by owner and forward one batch per worker,
concurrently; a route is dropped only after its worker confirmed the release.

Orphans: a failed attempt may still have exported slots on that worker (it finished the forward, then the
call timed out or the connection broke). Their lease ids never reach a reader; the worker's TTL GC reclaims
them after ``slot_gc_timeout_ms``. Each such attempt is logged with the worker and counted in
``tensorwire_proxy_possibly_orphaning_attempts_total``; size the workers' pool for it (docs/deployment.md).

Security and limits: the proxy's listener has the TLS and ``ServerLimits`` of its config, as a worker's
has (``GrpcHost``: per-peer call limits, a request deadline, a work lane for the Encode forwards so ReleaseLeases
never waits behind them); its channels to the workers use the same ``TlsConfig`` as a client (mTLS: its ``cert``
is its client certificate). A forwarded Encode names the caller in ``tensorwire-peer`` metadata, which a worker
believes when it lists the proxy in its ``trusted_forwarders`` (then per-peer limits and lease quotas apply per
caller, not to the proxy as a whole), and is cancelled on the worker when its caller cancels.

Health: the proxy probes every worker's ``grpc.health.v1`` (``HealthProber``) and answers SERVING itself only
while at least one worker is UP; ``tensorwire_proxy_worker_up{worker}`` shows each one.

Stop (``GrpcHost`` sequence): NOT_SERVING for ``drain_s``, then new Encodes are refused with UNAVAILABLE while
ReleaseLeases is still routed; in-flight Encodes finish and routed leases get released within the grace.

Metric labels are bounded: ``worker`` is the worker's address as ``--worker`` gives it (a fixed set), ``code`` a
gRPC status name (or ``BAD_RECEIPT``).
"""

from __future__ import annotations

import itertools
import logging
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from concurrent import futures
from dataclasses import dataclass
from functools import partial
from typing import Any

import grpc
from prometheus_client import REGISTRY, CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from tensorwire._grpc.host import Admission, GrpcHost, Lane, Method, Service
from tensorwire._grpc.scope import FORWARDED_PEER_METADATA, current_call
from tensorwire._grpc.tls import secure_or_insecure_channel
from tensorwire._ratelog import RateLimitedLog
from tensorwire.errors import Reason
from tensorwire.mm import wire
from tensorwire.mm.client import _rdma_receipt as _receipt
from tensorwire.service._info import WorkerInfo, check_workers, fetch_info
from tensorwire.service._proxy_config import ProxyConfig
from tensorwire.service._routes import RouteTable, route_ttl_s
from tensorwire.service._workers import HealthProber, WorkerHealth, health_check

log = logging.getLogger(__name__)

# Failures that say nothing about the request itself: another worker may well succeed.
RETRYABLE = frozenset(
    {
        grpc.StatusCode.UNAVAILABLE,
        grpc.StatusCode.RESOURCE_EXHAUSTED,
        grpc.StatusCode.INTERNAL,
        grpc.StatusCode.UNKNOWN,
        grpc.StatusCode.ABORTED,
        grpc.StatusCode.DEADLINE_EXCEEDED,
        grpc.StatusCode.CANCELLED,
    }
)
# Failures after which the worker may have finished the forward and exported slots that nobody will release.
MAY_HAVE_EXPORTED = frozenset(
    {
        grpc.StatusCode.DEADLINE_EXCEEDED,
        grpc.StatusCode.CANCELLED,
        grpc.StatusCode.UNKNOWN,
        grpc.StatusCode.INTERNAL,
        grpc.StatusCode.ABORTED,
    }
)


def may_have_orphaned(code: grpc.StatusCode, support_rdma: bool) -> bool:
    """True when a failed attempt with ``code`` may have left exported slots behind on its worker."""
    return support_rdma and code in MAY_HAVE_EXPORTED


ROUND_PAUSE_S = 0.05  # between rounds, so that nothing spins when every worker fails at once


# The proxy adds well under a millisecond to a call on a LAN; a worker's compute can take seconds.
_LATENCY_BUCKETS = (
    0.00025,
    0.0005,
    0.001,
    0.0025,
    0.005,
    0.01,
    0.025,
    0.05,
    0.1,
    0.25,
    0.5,
    1.0,
    2.5,
    5.0,
    10.0,
    30.0,
    60.0,
    120.0,
)


class _Metrics:
    def __init__(self, registry: CollectorRegistry, routes: RouteTable, workers: Sequence[str]) -> None:
        self.requests = Counter(
            "tensorwire_proxy_requests_total", "Encode requests by outcome", ["outcome"], registry=registry
        )
        self.seconds = Histogram(
            "tensorwire_proxy_request_seconds",
            "Encode latency through the proxy",
            buckets=_LATENCY_BUCKETS,
            registry=registry,
        )
        self.worker_up = Gauge(
            "tensorwire_proxy_worker_up",
            "1 while a worker is UP (probes and calls say it can serve), 0 while DOWN",
            ["worker"],
            registry=registry,
        )
        self.worker_downs = Counter(
            "tensorwire_proxy_worker_down_total",
            "Times a worker went from UP to DOWN (failed call, NOT_SERVING or unanswered probes)",
            ["worker"],
            registry=registry,
        )
        self.worker_errors = Counter(
            "tensorwire_proxy_worker_errors_total",
            "Failed worker calls by worker address and gRPC status",
            ["worker", "code"],
            registry=registry,
        )
        self.retries = Counter(
            "tensorwire_proxy_retries_total", "Encode attempts retried on another worker", registry=registry
        )
        self.orphaned = Counter(
            "tensorwire_proxy_possibly_orphaning_attempts_total",
            "Failed attempts that may have left exported slots on the worker (its GC reclaims)",
            ["worker"],
            registry=registry,
        )
        self.releases = Counter(
            "tensorwire_proxy_release_leases_total",
            "Leases (lease ids) in ReleaseLeases by outcome (released, failed, unknown, poisoned)",
            ["outcome"],
            registry=registry,
        )
        self.owner_conflicts = Counter(
            "tensorwire_proxy_rdma_owner_conflicts_total",
            "Receipts whose RDMA owner endpoint another worker also used",
            registry=registry,
        )
        self.bad_receipts = Counter(
            "tensorwire_proxy_bad_receipts_total",
            "Worker responses the proxy could not parse for lease ids",
            registry=registry,
        )
        self.refused = Counter(
            "tensorwire_proxy_refused_calls_total",
            "Calls the proxy refused or ended before serving them, by reason: peer_limit, "
            "request_timeout, work_wait, untrusted_caller",
            ["reason"],
            registry=registry,
        )
        for address in workers:  # the --worker address as given: what an operator finds in the logs
            self.orphaned.labels(address)
            self.worker_downs.labels(address)
            self.worker_up.labels(address).set(1)
        registry.register(_RouteCollector(routes))


class _RouteCollector:
    def __init__(self, routes: RouteTable) -> None:
        self._routes = routes

    def collect(self) -> Iterable[Any]:
        s = self._routes.stats()
        yield GaugeMetricFamily("tensorwire_proxy_routes", "Live lease -> worker routes", value=s.routes)
        for name, value, doc in (
            (
                "tensorwire_proxy_lease_collisions",
                s.collisions_total,
                "Lease ids claimed by two workers (poisoned; both released)",
            ),
            ("tensorwire_proxy_expired_routes", s.expired_total, "Routes dropped by TTL without a release"),
        ):
            yield CounterMetricFamily(name, doc, value=value)


def _cancel(call: grpc.Future[Any]) -> None:
    call.cancel()


def _remaining_s(context: grpc.ServicerContext) -> float | None:
    """Seconds left of the caller's deadline; None when it set none."""
    fn = getattr(context, "time_remaining", None)
    left = fn() if callable(fn) else None
    if left is None:
        return None
    if hasattr(left, "total_seconds"):  # some grpc versions hand back a timedelta (seed §7)
        left = left.total_seconds()
    return float(left)


@dataclass
class _Worker:
    index: int
    address: str
    channel: grpc.Channel
    encode: grpc.UnaryUnaryMultiCallable[bytes, bytes]
    release: grpc.UnaryUnaryMultiCallable[wire.ReleaseLeasesRequest, wire.ReleaseLeasesResponse]
    info: WorkerInfo | None = None
    worker_id: str | None = None  # from WorkerInfo, then from its latest receipt (a restarted worker has a new one)


class EncoderProxy:
    """The proxy server; ``start(address)`` binds and returns the port, ``stop(grace_s, drain_s)`` drains and closes.

    Lifecycle: ``start`` once (it first asks every worker for ``WorkerInfo`` unless ``check_workers`` is off,
    raising ``ConfigError`` or ``PeerUnavailable`` before binding anything), then probes the workers' health;
    ``stop`` is idempotent and closes the worker channels after in-flight calls finished or the grace ran out.
    """

    def __init__(
        self,
        config: ProxyConfig,
        *,
        registry: CollectorRegistry | None = None,
        clock: Callable[[], float] = time.monotonic,
        reuse_port: bool = False,
    ) -> None:
        self.config = config
        self._clock = clock
        opts = config.limits.client_options()
        self._workers = []
        for i, address in enumerate(config.workers):
            ch = secure_or_insecure_channel(address, config.tls, opts)
            self._workers.append(
                _Worker(
                    index=i,
                    address=address,
                    channel=ch,
                    encode=ch.unary_unary(wire.ENCODE_METHOD),  # bytes in, bytes out: forwarded unparsed
                    release=ch.unary_unary(
                        wire.RELEASE_METHOD,
                        request_serializer=wire.ReleaseLeasesRequest.SerializeToString,
                        response_deserializer=wire.ReleaseLeasesResponse.FromString,
                    ),
                )
            )
        self.routes = RouteTable(route_ttl_s(config.slot_gc_timeout_ms), clock=clock)
        self._registry = registry if registry is not None else REGISTRY
        self._metrics: _Metrics | None = None
        self._rr = itertools.count()
        self._owner_by_endpoint: dict[str, str] = {}
        self._lock = threading.Lock()
        self._pool = futures.ThreadPoolExecutor(
            max_workers=max(2, len(self._workers)), thread_name_prefix="proxy-release"
        )
        self._host: GrpcHost | None = None
        self._closed = False
        self._reuse_port = reuse_port
        self.health = WorkerHealth(
            len(self._workers), probe_failures=config.probe_failures, clock=clock, on_change=self._worker_changed
        )
        self._prober = HealthProber(
            [health_check(w.channel, wire.SERVICE_NAME) for w in self._workers],
            self.health,
            interval_s=config.probe_interval_s,
            timeout_s=config.probe_timeout_s,
        )
        self._rl = RateLimitedLog(log)
        self._encodes = Admission()
        self.port: int | None = None

    # ---- lifecycle
    def start(self, address: str = "127.0.0.1:0", *, insecure: bool = False) -> int:
        """Asks the workers (unless ``check_workers`` is off), then binds and serves. A plaintext proxy on a
        non-loopback address needs ``insecure`` (``--insecure``)."""
        if self._host is not None:
            raise RuntimeError("proxy already started")
        if self.config.check_workers:
            infos = self._ask_workers()
            check_workers(infos)
            ttl = route_ttl_s(max(i.slot_gc_timeout_ms for i in infos))
            self.routes = RouteTable(ttl, clock=self._clock)
        self._metrics = m = _Metrics(self._registry, self.routes, [w.address for w in self._workers])
        host = GrpcHost(
            "proxy",
            (
                Service(
                    wire.SERVICE_NAME,
                    (
                        Method("Encode", self._encode, lane=Lane.WORK),  # raw bytes both ways
                        Method(
                            "ReleaseLeases",
                            self._release,
                            request_deserializer=wire.ReleaseLeasesRequest.FromString,
                            response_serializer=wire.ReleaseLeasesResponse.SerializeToString,
                        ),
                    ),
                ),
            ),
            work_slots=self.config.server_threads,
            thread_prefix="proxy",
            limits=self.config.limits,
            tls=self.config.tls,
            serving=(wire.SERVICE_NAME,),
            on_refuse=lambda reason: m.refused.labels(reason).inc(),
            reuse_port=self._reuse_port,
        )
        port = host.bind(address, insecure=insecure)
        self._host, self.port = host, port
        host.start(serving=self.health.any_up())
        self._prober.start()
        log.info(
            "proxy serving on port %d for %d workers (route TTL %.1f s)", port, len(self._workers), self.routes.ttl_s
        )
        return port

    def _worker_changed(self, index: int, up: bool) -> None:
        w = self._workers[index]
        state = self.health.snapshot()[index]  # the state now: two changes racing must not leave a stale gauge
        if self._metrics is not None:
            self._metrics.worker_up.labels(w.address).set(1 if state.up else 0)
            if not up:
                self._metrics.worker_downs.labels(w.address).inc()
        if up:
            log.info("worker %s is UP again", w.address)
        else:
            log.warning("worker %s is DOWN (%s); requests go to the other workers", w.address, state.cause)
        if self._host is not None:
            any_up = self.health.any_up()
            self._host.set_serving(any_up)
            if not any_up:
                log.error("no worker can serve: the proxy reports NOT_SERVING")

    def _ask_workers(self) -> list[WorkerInfo]:
        pending = {
            self._pool.submit(
                fetch_info, w.channel, w.address, timeout_s=self.config.worker_wait_s, tls=self.config.tls
            ): w
            for w in self._workers
        }
        infos = []
        for fut, w in pending.items():
            w.info = fut.result()  # raises PeerUnavailable naming the worker
            w.worker_id = w.info.worker_id
            infos.append(w.info)
        return infos

    @property
    def worker_infos(self) -> list[WorkerInfo | None]:
        return [w.info for w in self._workers]

    def stop(self, grace_s: float = 5.0, drain_s: float = 0.0) -> None:
        if self._closed:
            return
        self._closed = True
        try:
            if self._host is not None:
                self._host.stop(grace_s, drain_s=drain_s, quiesce=self._quiesce, settle=self._settle)
        finally:
            self._prober.close()
            self._pool.shutdown(wait=True, cancel_futures=True)
            for w in self._workers:
                w.channel.close()

    def _quiesce(self) -> None:
        self._encodes.close()

    def _settle(self, deadline: float) -> None:
        """Waits for in-flight Encodes, then for the routed leases to be released (readers release through the
        proxy), until ``deadline``."""
        self._encodes.wait_idle(deadline)
        while len(self.routes) and time.monotonic() < deadline:
            time.sleep(min(0.05, max(0.0, deadline - time.monotonic())))
        if len(self.routes):
            log.info(
                "proxy stopping with %d lease route(s) not released; the workers' GC reclaims them", len(self.routes)
            )

    close = stop

    def __enter__(self) -> EncoderProxy:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def wait(self) -> None:
        if self._host is not None:
            self._host.wait()

    # ---- Encode
    def _attempt_budget_s(self, request: Any) -> float:
        budget_ms = wire.rpc_budget_ms(
            (i.timeout_ms for i in request.inputs),
            worker_timeout_ms=self.config.worker_timeout_ms,
            margin_ms=self.config.rpc_timeout_margin_ms,
        )
        return budget_ms / 1000.0

    def _encode(self, raw: bytes, context: grpc.ServicerContext) -> bytes:
        if not self._encodes.enter():
            context.set_trailing_metadata(((wire.REASON_METADATA_KEY, Reason.PEER_UNAVAILABLE.value),))
            context.abort(grpc.StatusCode.UNAVAILABLE, "proxy is draining (shutting down); use another proxy")
        try:
            return self._route(raw, context)
        finally:
            self._encodes.exit()

    def _route(self, raw: bytes, context: grpc.ServicerContext) -> bytes:
        assert self._metrics is not None
        m = self._metrics
        start = time.monotonic()
        try:
            request = wire.EncodeRequest.FromString(raw)
        except Exception:  # any parse failure is the caller's malformed request
            m.requests.labels("invalid").inc()
            context.set_trailing_metadata(((wire.REASON_METADATA_KEY, Reason.INVALID_REQUEST.value),))
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, "EncodeRequest does not parse")
        too_big = self._over_limits(request)
        if too_big:
            m.requests.labels("invalid").inc()
            context.set_trailing_metadata(((wire.REASON_METADATA_KEY, Reason.INVALID_REQUEST.value),))
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, too_big)
        forward = ((FORWARDED_PEER_METADATA, current_call().peer.key),)
        # Each attempt gets the worker budget (the budget formula), capped by what the caller has left overall.
        budget_s = self._attempt_budget_s(request)
        caller_left = _remaining_s(context)
        end = start + caller_left if caller_left is not None else None
        first = next(self._rr) % len(self._workers)
        avoid = set(request.rdma_excluded_workers)  # the caller's hint: ask these last (see encoder.proto)
        last_error: grpc.RpcError | None = None
        tried: list[str] = []  # "<worker index>:<outcome>" per attempt, for the error a failed request gets
        attempts = self.config.attempts
        order: list[_Worker] = []
        for attempt in range(attempts):
            if not order:  # a new round, in the order health says now
                if attempt:
                    time.sleep(min(ROUND_PAUSE_S, max(0.0, (end or float("inf")) - time.monotonic())))
                order = [self._workers[i] for i in self.health.order(first)]
                order = [w for w in order if w.worker_id not in avoid] + [w for w in order if w.worker_id in avoid]
            worker = order.pop(0)
            left = budget_s if end is None else min(budget_s, end - time.monotonic())
            if left <= 0 or not context.is_active():
                break
            if attempt:
                m.retries.inc()
            try:
                call = worker.encode.future(raw, timeout=left, metadata=forward)
                context.add_callback(partial(_cancel, call))  # the caller went: the worker stops too
                response = call.result()
            except grpc.RpcError as exc:
                code = exc.code() if hasattr(exc, "code") else grpc.StatusCode.UNKNOWN
                m.worker_errors.labels(worker.address, code.name).inc()
                self.health.call_failed(worker.index, code)
                last_error = exc
                tried.append(f"{worker.index}:{code.name}")
                if may_have_orphaned(code, request.support_rdma):
                    m.orphaned.labels(worker.address).inc()
                    log.warning(
                        "worker %s failed with %s after it may have exported RDMA slots; they are "
                        "reclaimed by its GC (slot_gc_timeout_ms)",
                        worker.address,
                        code.name,
                    )
                if code not in RETRYABLE:
                    break
                log.info("worker %s failed with %s; trying another worker", worker.address, code.name)
                continue
            self.health.call_ok(worker.index)
            if not self._accept(worker, response, last=attempt == attempts - 1):
                tried.append(f"{worker.index}:BAD_RECEIPT")
                continue
            m.requests.labels("ok").inc()
            m.seconds.observe(time.monotonic() - start)
            return response
        m.requests.labels("error").inc()
        m.seconds.observe(time.monotonic() - start)
        if last_error is None:
            context.set_trailing_metadata(((wire.REASON_METADATA_KEY, Reason.DEADLINE_EXCEEDED.value),))
            context.abort(grpc.StatusCode.DEADLINE_EXCEEDED, "no time left to call an encoder worker")
        self._forward_error(last_error, context, tried)
        raise AssertionError("unreachable")  # context.abort raises

    def _over_limits(self, request: Any) -> str:
        """Why ``request`` is over this proxy's item limits ('' when it is not)."""
        limits = self.config.limits
        if len(request.inputs) > limits.max_request_items:
            return f"{len(request.inputs)} items in one request exceed max_request_items={limits.max_request_items}"
        for i, item in enumerate(request.inputs):
            if len(item.data) > limits.max_item_bytes:
                return f"item {i} is {len(item.data)} bytes, over max_item_bytes={limits.max_item_bytes}"
        return ""

    @staticmethod
    def _forward_error(exc: grpc.RpcError, context: grpc.ServicerContext, tried: Sequence[str] = ()) -> None:
        code = exc.code() if hasattr(exc, "code") else grpc.StatusCode.UNKNOWN
        details = exc.details() if hasattr(exc, "details") else str(exc)
        try:
            md = [(k, v) for k, v in wire.trailing_pairs(exc) if k == wire.REASON_METADATA_KEY]
        except (TypeError, ValueError):
            md = []
        if md:
            context.set_trailing_metadata(tuple(md))
        attempts = f" after {len(tried)} attempt(s) [{' '.join(tried[:8])}]" if tried else ""
        context.abort(code, f"via proxy{attempts}: {details}")

    def _accept(self, worker: _Worker, response: bytes, *, last: bool) -> bool:
        """Records the receipt's routes and returns True, or (a broken receipt, another worker left to ask)
        releases what it leased on ``worker`` and returns False."""
        assert self._metrics is not None
        try:
            msg = wire.EncodeResponse.FromString(response)
        except Exception:  # the client would reject it too
            self._metrics.bad_receipts.inc()
            log.warning("worker %s sent a response that does not parse", worker.address)
            return last
        if msg.worker.worker_id:
            worker.worker_id = msg.worker.worker_id
        ids, problem = _receipt.check_receipt(msg, self._parse) if self.config.check_receipts else ([], None)
        if problem is not None and not last:
            self._metrics.bad_receipts.inc()
            self._metrics.worker_errors.labels(worker.address, "BAD_RECEIPT").inc()
            self._rl.log(
                logging.WARNING,
                f"bad-receipt-{worker.index}",
                "worker %s sent a receipt a reader would "
                "reject (%s); releasing its %d lease(s) there and asking another worker",
                worker.address,
                problem,
                len(ids),
            )
            if ids:
                self._pool.submit(self._release_on, worker, ids, self.config.release_timeout_ms / 1e3)
            return False
        self._record(worker, msg)
        return True

    def _record(self, worker: _Worker, msg: Any) -> None:
        assert self._metrics is not None
        if not msg.rdma_slots:
            return
        from tensorwire.errors import InvalidDescriptor

        lease_ids = []
        for slot in msg.rdma_slots:
            try:
                desc = self._parse(slot.descriptor)
            except InvalidDescriptor as exc:
                self._metrics.bad_receipts.inc()
                log.warning("worker %s sent an invalid descriptor (%s); its lease is not routed", worker.address, exc)
                continue
            lease_ids.append(desc.lease_id)
            self._check_owner(worker, desc.owner.endpoint)
        collided = self.routes.record(worker.address, lease_ids)
        if collided:
            log.error(
                "lease id collision between workers %s; the ids are poisoned and released on both",
                sorted({w for w, _ in collided}),
            )
            by_worker: dict[str, list[str]] = {}
            for w, lease in collided:
                by_worker.setdefault(w, []).append(lease)
            for w, ids in by_worker.items():
                self._pool.submit(self._release_on, self._by_address(w), ids, self.config.release_timeout_ms / 1e3)

    @staticmethod
    def _parse(data: bytes) -> Any:
        from tensorwire.rdma import Descriptor

        # The proxy reads no memory; it only needs the lease id, so the slot size cap is not its concern.
        return Descriptor.from_bytes(data, max_slot_bytes=1 << 48)

    def _check_owner(self, worker: _Worker, endpoint: str) -> None:
        with self._lock:
            owner = self._owner_by_endpoint.setdefault(endpoint, worker.address)
        if owner != worker.address:
            assert self._metrics is not None
            self._metrics.owner_conflicts.inc()
            log.error(
                "workers %s and %s both export from RDMA endpoint %s; give each worker its own --rdma-port",
                owner,
                worker.address,
                endpoint,
            )

    def _by_address(self, address: str) -> _Worker:
        return next(w for w in self._workers if w.address == address)

    # ---- ReleaseLeases
    def _release_on(self, worker: _Worker, lease_ids: Sequence[str], timeout_s: float) -> int:
        resp = worker.release(wire.ReleaseLeasesRequest(lease_ids=list(lease_ids)), timeout=timeout_s)
        return int(resp.released)  # the rest of the batch named no live lease there (answered as unknown below)

    def _release(self, request: Any, context: grpc.ServicerContext) -> Any:
        assert self._metrics is not None
        m = self._metrics
        plan = self.routes.plan_release(request.lease_ids)
        m.releases.labels("unknown").inc(len(plan.unknown))
        m.releases.labels("poisoned").inc(len(plan.poisoned))
        caller_left = _remaining_s(context)
        timeout_s = self.config.release_timeout_ms / 1000.0
        if caller_left is not None:
            timeout_s = min(timeout_s, caller_left)
        calls = {}
        for address, ids in plan.by_worker.items():
            if timeout_s <= 0:
                break
            calls[address] = self._pool.submit(self._release_on, self._by_address(address), ids, timeout_s)
        released, failed = 0, []
        for address, ids in plan.by_worker.items():
            fut = calls.get(address)
            try:
                if fut is None:
                    raise TimeoutError("no time left")
                released += fut.result()
            except (grpc.RpcError, TimeoutError, futures.CancelledError) as exc:
                failed.append(address)
                m.releases.labels("failed").inc(len(ids))
                code = exc.code().name if isinstance(exc, grpc.RpcError) and hasattr(exc, "code") else "DEADLINE"
                m.worker_errors.labels(address, code).inc()
                log.warning(
                    "release of %d lease(s) on %s failed (%s); routes kept for a retry", len(ids), address, code
                )
                continue
            self.routes.confirm_released(plan, address)
            m.releases.labels("released").inc(len(ids))
        if failed:
            context.set_trailing_metadata(((wire.REASON_METADATA_KEY, Reason.PEER_UNAVAILABLE.value),))
            context.abort(
                grpc.StatusCode.UNAVAILABLE,
                f"release failed on {len(failed)} of {len(plan.by_worker)} worker(s) {failed}; "
                "routes kept, retry the release",
            )
        asked = len(set(request.lease_ids))
        return wire.ReleaseLeasesResponse(released=released, unknown=asked - released)


__all__ = ["EncoderProxy", "MAY_HAVE_EXPORTED", "ProxyConfig", "RETRYABLE", "may_have_orphaned"]
