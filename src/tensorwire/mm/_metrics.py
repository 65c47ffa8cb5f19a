"""Prometheus metrics of the encoder-output transport, with bounded labels only.

Labels: ``side``, ``plane``, ``role``, ``reason`` (a :class:`~tensorwire.errors.Reason` or a fixed string),
``mode``, ``scope``, ``state``, ``path``, ``event``; never endpoints, lease ids, shapes or free text.
``TransportMetrics(registry)`` registers the family; ``metrics_for(None)`` returns the shared default instance.

``LLM_ONLY`` and ``ENCODER_ONLY`` name the families only one side updates (the others carry a ``side`` label); a
process that is only one side (``serve-encoder``) leaves the other side's families out of its ``/metrics``.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

from prometheus_client import REGISTRY, CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

_LATENCY_BUCKETS = (0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0, 5.0, 10.0)
# Encoder compute: a small image on a GPU takes milliseconds, a large batch on a CPU tens of seconds.
_COMPUTE_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)


# Families (as exposed) only the reading side updates: a worker process never touches them.
LLM_ONLY = frozenset(
    {
        "tensorwire_mm_read_seconds",
        "tensorwire_mm_fetch_seconds",
        "tensorwire_mm_release_seconds",
        "tensorwire_mm_release_leases_total",
        "tensorwire_mm_release_queue_dropped_leases_total",
        "tensorwire_mm_release_queue_pending_leases",
        "tensorwire_mm_open_breakers",
        "tensorwire_mm_breaker_transitions_total",
        "tensorwire_mm_rdma_staged_gpu_reads_total",
        "tensorwire_mm_control_rpcs_total",
    }
)
# Families only the encoder (the exporting side) updates.
ENCODER_ONLY = frozenset(
    {
        "tensorwire_mm_encoder_released_leases_total",
        "tensorwire_mm_encoder_gc_reclaimed_leases_total",
        "tensorwire_mm_encoder_compute_seconds",
        "tensorwire_mm_encoder_request_seconds",
        "tensorwire_mm_encoder_exporter_ready",
        "tensorwire_mm_encoder_control_streams",
        "tensorwire_mm_server_refused_calls_total",
        "tensorwire_mm_encoder_leases",
        "tensorwire_mm_encoder_leased_bytes",
        "tensorwire_mm_encoder_pool_bytes",
        "tensorwire_mm_encoder_pool_capacity_bytes",
    }
)


class _CountFromSource:
    """A Counter whose value is read from ``source()`` at scrape time (a count kept elsewhere, e.g. the
    exporter's GC reclaims): prometheus_client's Counter has no ``set_function``, and a cumulative count exported
    as a Gauge breaks ``rate()``."""

    def __init__(self, name: str, documentation: str, registry: CollectorRegistry) -> None:
        self.name, self.documentation = name, documentation
        self.source: Callable[[], float] = lambda: 0.0
        registry.register(self)

    def collect(self) -> Any:
        yield CounterMetricFamily(self.name, self.documentation, value=self.source())

    def describe(self) -> Any:
        yield CounterMetricFamily(self.name, self.documentation)


class _ExporterGauges:
    """The encoder's exporter, read at scrape time: live leases and the bytes of their slots, the slot pool's
    registered bytes and its cap (what docs/deployment.md asks operators to size). Zeros until the exporter is
    built (and without one: inline only)."""

    _FAMILIES = (
        ("tensorwire_mm_encoder_leases", "Exported leases not yet released or reclaimed"),
        ("tensorwire_mm_encoder_leased_bytes", "Bytes of the slots that live leases hold"),
        ("tensorwire_mm_encoder_pool_bytes", "Bytes the exporter's slot pool has registered (busy and idle slots)"),
        ("tensorwire_mm_encoder_pool_capacity_bytes", "Cap of the exporter's slot pool (--rdma-pool-cap-bytes)"),
    )

    def __init__(self, registry: CollectorRegistry) -> None:
        self.source: Callable[[], Any] | None = None
        registry.register(self)

    def _values(self) -> tuple[float, ...]:
        stats = None
        if self.source is not None:
            try:
                stats = self.source()
            except Exception:  # a scrape must not fail because of the exporter
                stats = None
        if stats is None:
            return (0.0, 0.0, 0.0, 0.0)
        pool = stats.pool
        return (float(stats.live_leases), float(pool.busy_bytes), float(pool.pool_bytes), float(pool.pool_cap_bytes))

    def collect(self) -> Any:
        for (name, doc), value in zip(self._FAMILIES, self._values(), strict=True):
            yield GaugeMetricFamily(name, doc, value=value)

    def describe(self) -> Any:
        for name, doc in self._FAMILIES:
            yield GaugeMetricFamily(name, doc)


class TransportMetrics:
    """The metric family; one instance per registry."""

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        reg = registry if registry is not None else REGISTRY
        self.registry = reg
        self.requests = Counter(
            "tensorwire_mm_requests_total",
            "Encoder outputs delivered, by side and plane",
            ["side", "plane"],
            registry=reg,
        )
        self.fallbacks = Counter(
            "tensorwire_mm_fallbacks_total",
            "Recoverable degrades from RDMA to inline, by side and reason (not errors)",
            ["side", "reason"],
            registry=reg,
        )
        self.errors = Counter(
            "tensorwire_mm_errors_total", "Requests that failed, by side and reason", ["side", "reason"], registry=reg
        )
        self.bytes = Counter(
            "tensorwire_mm_bytes_total",
            "Tensor payload bytes moved, by side, plane and role",
            ["side", "plane", "role"],
            registry=reg,
        )
        self.read_seconds = Histogram(
            "tensorwire_mm_read_seconds", "RDMA batched read latency (client)", buckets=_LATENCY_BUCKETS, registry=reg
        )
        self.fetch_seconds = Histogram(
            "tensorwire_mm_fetch_seconds",
            "fetch() latency by delivering plane",
            ["plane"],
            buckets=_LATENCY_BUCKETS,
            registry=reg,
        )
        self.release_seconds = Histogram(
            "tensorwire_mm_release_seconds",
            "ReleaseLeases RPC latency (client)",
            ["mode"],
            buckets=_LATENCY_BUCKETS,
            registry=reg,
        )
        self.releases = Counter(
            "tensorwire_mm_release_leases_total",
            "Lease ids by release mode and outcome",
            ["mode", "outcome"],
            registry=reg,
        )
        self.release_queue_dropped = Counter(
            "tensorwire_mm_release_queue_dropped_leases_total",
            "Lease ids dropped by the async release queue (the owner's GC reclaims)",
            ["reason"],
            registry=reg,
        )
        self.release_queue_pending = Gauge(
            "tensorwire_mm_release_queue_pending_leases", "Lease ids waiting in async release queues", registry=reg
        )
        self.exported_leases_released = Counter(
            "tensorwire_mm_encoder_released_leases_total",
            "Lease ids released on the encoder by ReleaseLeases",
            ["outcome"],
            registry=reg,
        )
        self.gc_reclaimed = _CountFromSource(
            "tensorwire_mm_encoder_gc_reclaimed_leases",
            "Leases the encoder's TTL GC reclaimed (never released by a reader)",
            reg,
        )  # exposed as ..._total
        self.encoder_compute_seconds = Histogram(
            "tensorwire_mm_encoder_compute_seconds",
            "The encoder's forward pass per Encode (encode_fn), on the encoder",
            buckets=_COMPUTE_BUCKETS,
            registry=reg,
        )
        self.encoder_request_seconds = Histogram(
            "tensorwire_mm_encoder_request_seconds",
            "Encode on the encoder from the parsed request to the receipt "
            "(compute + export or serialization), by the receipt's plane",
            ["plane"],
            buckets=_COMPUTE_BUCKETS,
            registry=reg,
        )
        self.exporter_ready = Gauge(
            "tensorwire_mm_encoder_exporter_ready", "1 when the encoder's RDMA exporter is built", registry=reg
        )
        self.breaker_open = Gauge(
            "tensorwire_mm_open_breakers", "Circuit breakers not closed, by scope", ["scope"], registry=reg
        )
        self.breaker_transitions = Counter(
            "tensorwire_mm_breaker_transitions_total",
            "Circuit breaker transitions, by scope and new state",
            ["scope", "state"],
            registry=reg,
        )
        self.staged_gpu_reads = Counter(
            "tensorwire_mm_rdma_staged_gpu_reads_total",
            "GPU RDMA reads that UCX staged through host memory or TCP instead of "
            "cuda_ipc / an RDMA NIC (expect ~1000x lower bandwidth)",
            registry=reg,
        )
        self.control_rpcs = Counter(
            "tensorwire_mm_control_rpcs_total",
            "Encode requests the client sent, by control path (stream: a message on a pooled "
            "EncodeStream; unary: one Encode RPC)",
            ["path"],
            registry=reg,
        )
        self.control_streams = Counter(
            "tensorwire_mm_control_stream_events_total",
            "EncodeStream lifecycle events by side: llm opened/closed/broken/deadline/"
            "refused/unimplemented/protocol_error; encoder opened/ended/refused",
            ["side", "event"],
            registry=reg,
        )
        self.encoder_streams_open = Gauge(
            "tensorwire_mm_encoder_control_streams",
            "EncodeStream calls open on the encoder (each holds a server thread)",
            registry=reg,
        )
        self.server_refused = Counter(
            "tensorwire_mm_server_refused_calls_total",
            "Calls an encoder server refused or ended before serving them, by reason: "
            "peer_limit, request_timeout, stream_idle, work_wait, untrusted_caller",
            ["reason"],
            registry=reg,
        )
        self.exporter_gauges = _ExporterGauges(reg)
        self._children: dict[tuple[int, tuple[str, ...]], Any] = {}

    def child(self, family: Any, *values: str) -> Any:
        """``family.labels(*values)``, remembered: the per-fetch counters skip prometheus_client's label
        validation and lock (~1 us each, several times that on a slow host). Families are never cleared here."""
        key = (id(family), values)
        found = self._children.get(key)
        if found is None:
            found = self._children[key] = family.labels(*values)
        return found

    def watch_gc(self, source: Callable[[], float]) -> None:
        """Reads the exporter's GC reclaim count at scrape time."""
        self.gc_reclaimed.source = source

    def watch_exporter(self, stats: Callable[[], Any]) -> None:
        """Reads the exporter's leases and pool (``ExporterStats``) at scrape time."""
        self.exporter_gauges.source = stats


_lock = threading.Lock()
_by_registry: dict[int, TransportMetrics] = {}


def metrics_for(registry: CollectorRegistry | None = None) -> TransportMetrics:
    """The TransportMetrics registered in ``registry`` (the default registry when None), built once."""
    reg = registry if registry is not None else REGISTRY
    with _lock:
        m = _by_registry.get(id(reg))
        if m is None or m.registry is not reg:
            m = TransportMetrics(reg)
            _by_registry[id(reg)] = m
        return m


__all__ = ["ENCODER_ONLY", "LLM_ONLY", "TransportMetrics", "metrics_for"]
