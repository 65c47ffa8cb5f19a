"""The connector's metrics per role: an encoder instance exports the encoder's families only, an LLM instance
the LLM side's, in a registry and in prometheus_client's multiprocess mode (how ``vllm serve`` exports them)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from prometheus_client import CollectorRegistry
from prometheus_client.metrics import MetricWrapperBase

from tensorwire.integrations._vllm_ec import metrics as ec_metrics
from tensorwire.integrations._vllm_ec.metrics import CONSUMER, PRODUCER, ECMetrics, metrics_for

PRODUCER_NAMES = {
    "tensorwire_vllm_ec_saved_items",
    "tensorwire_vllm_ec_save_failures",
    "tensorwire_vllm_ec_grants",
    "tensorwire_vllm_ec_held_items",
    "tensorwire_vllm_ec_held_bytes",
}


def _names(reg: CollectorRegistry) -> set[str]:
    return {m.name for m in reg.collect()}


def test_one_role_exports_its_own_families_and_the_others_count_nothing() -> None:
    reg = CollectorRegistry()
    m = ECMetrics(reg, roles=(PRODUCER,))
    assert _names(reg) == PRODUCER_NAMES
    m.saved.labels("rdma").inc()
    m.fetches.labels("delivered").inc()  # the LLM side's: a no-op here
    m.fetch_seconds.observe(0.1)
    m.held_requests.inc()
    m.count_control_call("lookup", "local")
    assert _names(reg) == PRODUCER_NAMES
    assert reg.get_sample_value("tensorwire_vllm_ec_saved_items_total", {"plane": "rdma"}) == 1.0


def test_each_role_lists_exactly_the_families_it_creates() -> None:
    """The stand-ins cover every family of a role not exported, and exporting replaces exactly those."""
    for role in (PRODUCER, CONSUMER):
        m = ECMetrics(CollectorRegistry(), roles=())
        before = {k for k, v in vars(m).items() if v is ec_metrics._UNEXPORTED}
        assert before == set(ec_metrics._FAMILIES[PRODUCER] + ec_metrics._FAMILIES[CONSUMER])
        m.export(role)
        made = {k for k, v in vars(m).items() if isinstance(v, MetricWrapperBase)}
        assert made == set(ec_metrics._FAMILIES[role])
        assert {k for k, v in vars(m).items() if v is ec_metrics._UNEXPORTED} == before - made


def test_a_series_looked_up_once_counts_as_labels_does_and_follows_a_later_export() -> None:
    reg = CollectorRegistry()
    m = ECMetrics(reg, roles=())
    m.series(m.delivered, "map").inc()  # not exported yet: counts nothing
    m.export(CONSUMER)
    for _ in range(3):
        m.series(m.delivered, "map").inc()
    m.series(m.bytes, "map").inc(10)
    m.delivered.labels("map").inc()
    assert m.series(m.delivered, "map") is m.delivered.labels("map")
    assert reg.get_sample_value("tensorwire_vllm_ec_delivered_items_total", {"plane": "map"}) == 4.0
    assert reg.get_sample_value("tensorwire_vllm_ec_staged_bytes_total", {"plane": "map"}) == 10.0


def test_metrics_for_exports_each_role_asked_for_once() -> None:
    reg = CollectorRegistry()
    consumer = metrics_for(reg, CONSUMER)
    names = _names(reg)
    assert names and not names & PRODUCER_NAMES and "tensorwire_vllm_ec_fetches" in names
    assert metrics_for(reg, CONSUMER) is consumer and _names(reg) == names
    assert metrics_for(reg, PRODUCER) is consumer
    assert _names(reg) == names | PRODUCER_NAMES
    assert _names(reg) == _names(ECMetrics(CollectorRegistry()).registry)  # both roles: every family


def test_in_multiprocess_mode_an_encoder_instance_writes_no_llm_side_family(tmp_path: Path) -> None:
    """In multiprocess mode every family that exists is written to the shared files, registered or not, so the
    other role's must not exist at all."""
    code = f"""
import os
os.environ["PROMETHEUS_MULTIPROC_DIR"] = {str(tmp_path)!r}
from prometheus_client import CollectorRegistry
from prometheus_client.metrics import MetricWrapperBase
from tensorwire.integrations._vllm_ec.metrics import PRODUCER, metrics_for
m = metrics_for(CollectorRegistry(), PRODUCER)
m.saved.labels("rdma").inc()
m.held_items.inc()
m.fetches.labels("delivered").inc()
m.placed.inc()
"""
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)
    from prometheus_client import multiprocess

    reg = CollectorRegistry()
    multiprocess.MultiProcessCollector(reg, path=str(tmp_path))
    # The encoder's unlabelled gauges exist from the start; none of the LLM side's (placed_items, waiting_requests,
    # fetch_seconds, ... would have been written at creation).
    assert _names(reg) == {
        "tensorwire_vllm_ec_saved_items",
        "tensorwire_vllm_ec_held_items",
        "tensorwire_vllm_ec_held_bytes",
    }
