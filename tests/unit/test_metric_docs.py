"""The metric names the docs give are the names the code exports (issue 16 finding 9), and the Prometheus
conventions hold: counters end in ``_total``, a cumulative count is a counter, histograms are ``_seconds``."""

from __future__ import annotations

import re
from pathlib import Path

from prometheus_client import CollectorRegistry

from tensorwire.integrations._vllm_ec.metrics import ECMetrics
from tensorwire.integrations._vllm_router.metrics import RouterMetrics
from tensorwire.mm import TransportMetrics
from tensorwire.service._proxy import _Metrics
from tensorwire.service._routes import RouteTable
from tensorwire.service._runtime import ServedMetrics

DOCS = Path(__file__).resolve().parents[2] / "docs"
# Names that said what happened but not what they count, and what they are now (CHANGELOG, Unreleased).
RENAMED = {
    "tensorwire_vllm_ec_saved_total": "tensorwire_vllm_ec_saved_items_total",
    "tensorwire_vllm_ec_delivered_total": "tensorwire_vllm_ec_delivered_items_total",
    "tensorwire_vllm_ec_bytes_total": "tensorwire_vllm_ec_staged_bytes_total",
    "tensorwire_vllm_ec_releases_total": "tensorwire_vllm_ec_grant_releases_total",
    "tensorwire_vllm_ec_placed_total": "tensorwire_vllm_ec_placed_items_total",
    "tensorwire_vllm_router_client_params_dropped_total": "tensorwire_vllm_router_requests_with_client_params_total",
    "tensorwire_vllm_router_connections_refused_total": "tensorwire_vllm_router_refused_connections_total",
    "tensorwire_mm_releases_total": "tensorwire_mm_release_leases_total",
    "tensorwire_mm_release_queue_dropped_total": "tensorwire_mm_release_queue_dropped_leases_total",
    "tensorwire_mm_release_queue_pending": "tensorwire_mm_release_queue_pending_leases",
    "tensorwire_mm_encoder_released_total": "tensorwire_mm_encoder_released_leases_total",
    "tensorwire_mm_control_streams_total": "tensorwire_mm_control_stream_events_total",
    "tensorwire_mm_server_refused_total": "tensorwire_mm_server_refused_calls_total",
    "tensorwire_mm_breaker_open": "tensorwire_mm_open_breakers",
    "tensorwire_proxy_refused_total": "tensorwire_proxy_refused_calls_total",
    "tensorwire_proxy_slots_possibly_orphaned_total": "tensorwire_proxy_possibly_orphaning_attempts_total",
    "tensorwire_proxy_routes_expired_total": "tensorwire_proxy_expired_routes_total",
}
NAME = re.compile(r"`(tensorwire_[a-z0-9_]+)(?![a-z0-9_*])")  # not a glob like tensorwire_mm_*


def _exported(registry: CollectorRegistry) -> dict[str, str]:
    """Exposed name -> type (counters with their ``_total``, as a scrape shows them)."""
    out = {}
    for family in registry.collect():
        name = family.name + "_total" if family.type == "counter" else family.name
        out[name] = family.type
    return out


def _mm() -> dict[str, str]:
    return _exported(TransportMetrics(CollectorRegistry()).registry)


def _proxy() -> dict[str, str]:
    reg = CollectorRegistry()
    _Metrics(reg, RouteTable(1.0), ["127.0.0.1:7001", "127.0.0.1:7002"])
    return _exported(reg)


def _served() -> dict[str, str]:
    """What a serve command's /metrics adds to its registry's families (the build-info gauge)."""
    return _exported(ServedMetrics(CollectorRegistry()))  # type: ignore[arg-type]


def _vllm() -> dict[str, str]:
    """The vLLM connector's and the EPD router's metrics (neither imports vLLM); the router's registry also holds
    prometheus_client's standard ``process_*`` metrics, which are not ours to document name by name."""
    router = {k: v for k, v in _exported(RouterMetrics().registry).items() if not k.startswith("process_")}
    return {**_exported(ECMetrics(CollectorRegistry()).registry), **router}


def _documented(*files: str) -> set[str]:
    return {m for f in files for m in NAME.findall((DOCS / f).read_text())}


def test_transport_md_lists_exactly_the_mm_metrics() -> None:
    documented = {n for n in _documented("transport.md") if n.startswith("tensorwire_mm_")}
    assert documented == set(_mm())


def test_deployment_md_lists_exactly_the_proxy_metrics() -> None:
    documented = {n for n in _documented("deployment.md") if n.startswith("tensorwire_proxy_")}
    assert documented == set(_proxy())


def test_vllm_md_lists_exactly_the_connector_and_router_metrics() -> None:
    documented = {n for n in _documented("vllm.md") if n.startswith("tensorwire_vllm_")}
    assert documented == set(_vllm())


def test_deployment_md_lists_what_a_serve_command_adds() -> None:
    assert set(_served()) <= _documented("deployment.md")


def test_every_metric_any_doc_names_exists() -> None:
    exported = set(_mm()) | set(_proxy()) | set(_vllm()) | set(_served())
    named = _documented(*(p.name for p in DOCS.glob("*.md")))
    named |= set(NAME.findall((DOCS.parent / "README.md").read_text()))
    assert named <= exported, sorted(named - exported)


def test_names_follow_the_prometheus_conventions() -> None:
    for name, kind in {**_mm(), **_proxy(), **_vllm(), **_served()}.items():
        if kind == "counter":
            assert name.endswith("_total"), name
        else:
            assert not name.endswith("_total"), f"{name} is a {kind} named like a counter"
        if kind == "histogram":
            assert name.endswith("_seconds"), name


def test_names_say_what_they_count() -> None:
    """A counter or gauge ends in the thing it counts or its unit (``_refused_calls_total``, ``_pending_leases``,
    ``_bytes``), never in what happened to it (``_refused_total``, ``_pending``); 0/1 gauges end in the state."""
    for name, kind in {**_mm(), **_proxy(), **_vllm(), **_served()}.items():
        if kind == "histogram":
            continue
        last = name.removesuffix("_total").rsplit("_", 1)[1]
        assert not last.endswith("ed") and last not in ("pending", "open"), (
            f"{name} ({kind}) names what happened, not what it counts: add the thing (calls, leases, items) or unit"
        )


def test_renamed_metrics_are_gone_from_code_and_docs() -> None:
    exported = set(_mm()) | set(_proxy()) | set(_vllm()) | set(_served())
    assert set(RENAMED.values()) <= exported, sorted(set(RENAMED.values()) - exported)
    assert not set(RENAMED) & exported
    named = _documented(*(p.name for p in DOCS.glob("*.md"))) | set(
        NAME.findall((DOCS.parent / "README.md").read_text())
    )
    assert not set(RENAMED) & named, sorted(set(RENAMED) & named)


def test_each_mm_family_belongs_to_one_side_or_says_its_side() -> None:
    """``LLM_ONLY`` and ``ENCODER_ONLY`` (what ``serve-encoder`` leaves out; what only a worker updates) name real
    families; every other family carries the ``side`` label."""
    from prometheus_client.metrics import MetricWrapperBase

    from tensorwire.mm._metrics import ENCODER_ONLY, LLM_ONLY

    m = TransportMetrics(CollectorRegistry())
    assert LLM_ONLY | ENCODER_ONLY <= set(_mm()) and not LLM_ONLY & ENCODER_ONLY
    for metric in vars(m).values():
        if isinstance(metric, MetricWrapperBase):
            (family,) = metric.describe()
            exposed = family.name + "_total" if family.type == "counter" else family.name
            if exposed not in LLM_ONLY | ENCODER_ONLY:
                assert "side" in metric._labelnames, f"{exposed}: shared by both sides but has no side label"


def test_latency_histograms_resolve_sub_millisecond_calls() -> None:
    reg = CollectorRegistry()
    m = _Metrics(reg, RouteTable(1.0), ["127.0.0.1:7001"])
    m.seconds.observe(0.0003)  # a proxy hop on a LAN
    assert reg.get_sample_value("tensorwire_proxy_request_seconds_bucket", {"le": "0.0005"}) == 1.0
    assert reg.get_sample_value("tensorwire_proxy_request_seconds_bucket", {"le": "0.00025"}) == 0.0


def test_the_encoder_exports_its_leases_and_pool_as_gauges() -> None:
    """What an operator sizes the pool with: live leases and their bytes, the pool against its cap (read from the
    exporter at scrape; zeros before it is built)."""
    from tensorwire.rdma import ExporterStats, PoolStats

    m = TransportMetrics(CollectorRegistry())
    names = (
        "tensorwire_mm_encoder_leases",
        "tensorwire_mm_encoder_leased_bytes",
        "tensorwire_mm_encoder_pool_bytes",
        "tensorwire_mm_encoder_pool_capacity_bytes",
    )
    assert [m.registry.get_sample_value(n) for n in names] == [0.0] * 4
    m.watch_exporter(
        lambda: ExporterStats(
            live_leases=3, pool=PoolStats(pool_bytes=8 << 20, pool_cap_bytes=1 << 30, busy_bytes=6 << 20)
        )
    )
    assert [m.registry.get_sample_value(n) for n in names] == [3.0, float(6 << 20), float(8 << 20), float(1 << 30)]

    def broken() -> ExporterStats:
        raise RuntimeError("exporter closed")

    m.watch_exporter(broken)  # a scrape never fails because of the exporter
    assert m.registry.get_sample_value("tensorwire_mm_encoder_leases") == 0.0
