"""Prometheus metrics of the vLLM connector (``tensorwire_vllm_ec_*``), bounded labels only.

Labels: ``plane``, ``reason`` (a :class:`~tensorwire.errors.Reason`), ``outcome``; never mm_hashes, endpoints,
secrets or request ids. Each vLLM process registers its own; under ``vllm serve`` they go through multiprocess
mode to vLLM's ``/metrics`` (gauges ``livesum``), otherwise ``metrics_port`` serves them. A process exports the
families of its role only (``PRODUCER`` on the encoder instance, ``CONSUMER`` on the LLM instance): the other
role's are not even created (in multiprocess mode a family that exists is exported, registered or not), and
their attributes count nothing.
"""

from __future__ import annotations

import threading
from collections.abc import Iterable
from typing import Any

from prometheus_client import REGISTRY, CollectorRegistry, Counter, Gauge, Histogram

_BUCKETS = (0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0, 5.0, 10.0, 30.0)


PRODUCER = "producer"
CONSUMER = "consumer"
ROLES = (PRODUCER, CONSUMER)
_FAMILIES = {
    PRODUCER: ("saved", "save_failures", "grants", "held_items", "held_bytes"),
    CONSUMER: (
        "fetches",
        "delivered",
        "bytes",
        "read_bytes",
        "fetch_paths",
        "receipts",
        "fetch_seconds",
        "fallbacks",
        "refusals",
        "unavailable",
        "releases",
        "control_calls",
        "held_requests",
        "placed",
        "place_misses",
    ),
}


class _Unexported:
    """Stands in for a family of a role this process does not play: counts nothing, exports nothing (in
    multiprocess mode a family that exists is exported, registered or not)."""

    def labels(self, *args: object, **kwargs: object) -> _Unexported:
        return self

    def inc(self, amount: float = 1) -> None:
        pass

    def dec(self, amount: float = 1) -> None:
        pass

    def set(self, value: float) -> None:
        pass

    def observe(self, amount: float) -> None:
        pass


_UNEXPORTED: Any = _Unexported()


class ECMetrics:
    """The connector's metric family; one instance per registry (``metrics_for``). ``roles``: whose families are
    created and registered now (default both); ``export`` adds another role's later. Until then that role's
    attributes count nothing."""

    def __init__(self, registry: CollectorRegistry | None = None, roles: Iterable[str] = ROLES) -> None:
        self.registry = registry if registry is not None else REGISTRY
        self._exported: set[str] = set()
        self._lock = threading.Lock()
        self._series: dict[tuple[int, tuple[str, ...]], Any] = {}
        for name in _FAMILIES[PRODUCER] + _FAMILIES[CONSUMER]:
            setattr(self, name, _UNEXPORTED)
        for role in roles:
            self.export(role)

    def export(self, role: str) -> None:
        """Creates and registers ``role``'s families (once; idempotent)."""
        make = {PRODUCER: self._make_producer, CONSUMER: self._make_consumer}[role]  # KeyError: not a role
        with self._lock:
            if role in self._exported:
                return
            self._exported.add(role)
            make(self.registry)

    def _make_producer(self, reg: CollectorRegistry) -> None:
        self.saved = Counter(
            "tensorwire_vllm_ec_saved_items_total",
            "Encoder outputs exported into the held-outputs store, by plane",
            ["plane"],
            registry=reg,
        )
        self.save_failures = Counter(
            "tensorwire_vllm_ec_save_failures_total",
            "Encoder outputs that could not be exported (not announced), by reason",
            ["reason"],
            registry=reg,
        )
        self.grants = Counter(
            "tensorwire_vllm_ec_grants_total",
            "Grants by event: issued (scheduler), announced (in ec_transfer_params), revoked (request did not finish)",
            ["event"],
            registry=reg,
        )
        self.held_items = Gauge(
            "tensorwire_vllm_ec_held_items",
            "Items held for LLM instances right now",
            registry=reg,
            multiprocess_mode="livesum",
        )
        self.held_bytes = Gauge(
            "tensorwire_vllm_ec_held_bytes",
            "Bytes held for LLM instances right now",
            registry=reg,
            multiprocess_mode="livesum",
        )

    def _make_consumer(self, reg: CollectorRegistry) -> None:
        self.fetches = Counter(
            "tensorwire_vllm_ec_fetches_total",
            "Item fetches by outcome (delivered: every rank holds it; failed)",
            ["outcome"],
            registry=reg,
        )
        self.delivered = Counter(
            "tensorwire_vllm_ec_delivered_items_total",
            "Items every rank holds, by the plane that carried them (map: a producer's memfd on this host, "
            "mapped, nothing read)",
            ["plane"],
            registry=reg,
        )
        self.bytes = Counter(
            "tensorwire_vllm_ec_staged_bytes_total",
            "Payload bytes staged (all ranks), by plane",
            ["plane"],
            registry=reg,
        )
        self.read_bytes = Counter(
            "tensorwire_vllm_ec_read_bytes_total",
            "Payload bytes moved from encoder instances into this instance, each READ (or "
            "inline answer, or mapped producer memfd) once: one item per host when the host stages, one per rank "
            "otherwise",
            ["plane"],
            registry=reg,
        )
        self.fetch_paths = Counter(
            "tensorwire_vllm_ec_fetch_paths_total",
            "Item fetches by path (params: read at once from the receipt in the params, no Lookup; "
            "inline: advanced on the scheduler's thread; thread: a fetch thread)",
            ["path"],
            registry=reg,
        )
        self.receipts = Counter(
            "tensorwire_vllm_ec_receipts_total",
            "Receipts carried in params, by outcome: used (read with no Lookup), unknown_owner "
            "(an owner not met through a Lookup yet: looked up), invalid (malformed, or a descriptor without a "
            "binding: looked up), read_failed (the read failed, e.g. a released slot: looked up)",
            ["outcome"],
            registry=reg,
        )
        self.fetch_seconds = Histogram(
            "tensorwire_vllm_ec_fetch_seconds",
            "From the start of a fetch to every rank holding the item",
            buckets=_BUCKETS,
            registry=reg,
        )
        self.fallbacks = Counter(
            "tensorwire_vllm_ec_fallbacks_total",
            "Items encoded locally instead (the request carried the media), by reason",
            ["reason"],
            registry=reg,
        )
        self.refusals = Counter(
            "tensorwire_vllm_ec_refusals_total",
            "Items refused, by reason: untrusted_producer and incompatible (this instance, "
            "before any connection or read), not_held and not_ready (the encoder instance's "
            "answer; not_ready counts each retry)",
            ["reason"],
            registry=reg,
        )
        self.unavailable = Counter(
            "tensorwire_vllm_ec_unavailable_requests_total",
            "Requests failed through vLLM (an item could not be fetched and the request "
            "had no media to encode), by reason",
            ["reason"],
            registry=reg,
        )
        self.releases = Counter(
            "tensorwire_vllm_ec_grant_releases_total",
            "Grant releases sent to encoder instances, by outcome (ok, failed, unknown: the encoder no longer held it)",
            ["outcome"],
            registry=reg,
        )
        self.control_calls = Counter(
            "tensorwire_vllm_ec_control_calls_total",
            "Lookup/Release calls to encoder instances and Stage/Drop calls to the ranks, "
            "by channel (local: the same-host socket; grpc; local_fallback: the socket "
            "gave no answer, retried over gRPC)",
            ["method", "channel"],
            registry=reg,
        )
        self.held_requests = Gauge(
            "tensorwire_vllm_ec_waiting_requests",
            "Requests held back while their items are fetched",
            registry=reg,
            multiprocess_mode="livesum",
        )
        self.placed = Counter(
            "tensorwire_vllm_ec_placed_items_total", "Items a worker placed into vLLM's encoder cache", registry=reg
        )
        self.place_misses = Counter(
            "tensorwire_vllm_ec_place_misses_total",
            "Items announced to a worker that it did not hold (a bug: vLLM then fails with an encoder cache miss)",
            registry=reg,
        )

    def series(self, family: Any, *labels: str) -> Any:
        """``family.labels(*labels)``, looked up once per family and label values (labels are bounded, so is
        this): prometheus_client's ``labels`` takes a lock and checks its arguments on every call, six times per
        item delivered on the scheduler's thread."""
        key = (id(family), labels)
        child = self._series.get(key)
        if child is None:
            child = self._series[key] = family.labels(*labels)
        return child

    def count_control_call(self, method: str, channel: str) -> None:
        """The ``on_call`` hook of the store and staging clients."""
        self.series(self.control_calls, method, channel).inc()


_lock = threading.Lock()
_by_registry: dict[int, ECMetrics] = {}


def metrics_for(registry: CollectorRegistry | None, role: str | None = None) -> ECMetrics:
    """The shared ECMetrics of ``registry`` (None: prometheus_client's default registry), with ``role``'s families
    exported (None: both)."""
    reg = registry if registry is not None else REGISTRY
    with _lock:
        m = _by_registry.get(id(reg))
        if m is None:
            m = _by_registry[id(reg)] = ECMetrics(reg, roles=())
    for r in ROLES if role is None else (role,):
        m.export(r)
    return m


__all__ = ["ECMetrics", "metrics_for", "PRODUCER", "CONSUMER", "ROLES"]
