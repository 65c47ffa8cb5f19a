"""``bench broadcast``: cases, payload checks, ratio tables, and real groups of spawned ranks at a tiny size."""

from __future__ import annotations

import pickle
from typing import Any

import pytest
import torch

from tensorwire.bench import broadcast
from tensorwire.bench._payloads import Case, build, mark, matches, payload_bytes
from tensorwire.bench._tp import backends
from tensorwire.tp import shm_available

pytestmark = pytest.mark.timeout(240)


def test_every_payload_runs_at_every_gap_and_slow_cases_get_fewer_rounds() -> None:
    cases = broadcast.cases_for([1024, 1 << 20], ["dict", "sched"], [0.0, 2.0])
    assert [c.name for c in cases] == ["1KiB", "1MiB", "dict", "sched", "1KiB@2ms", "1MiB@2ms", "dict@2ms", "sched@2ms"]
    assert [broadcast.rounds_for(c, 1000) for c in cases] == [1000, 250, 1000, 1000, 250, 250, 250, 250]
    assert broadcast.rounds_for(Case("tensor", 1024, 2.0), 40) == 20  # never fewer than 20


@pytest.mark.parametrize("case", [Case("tensor", 1024), Case("dict"), Case("sched")], ids=lambda c: c.name)
def test_a_reader_accepts_only_this_rounds_value(case: Case) -> None:
    sent, expected = build(case), build(case)
    mark(case, sent, 7)
    mark(case, expected, 7)
    assert matches(case, pickle.loads(pickle.dumps(sent)), expected)
    stale = build(case)
    mark(case, stale, 6)
    assert not matches(case, stale, expected)  # a replayed message from the previous round fails


def test_a_changed_tensor_in_the_dict_fails_the_check() -> None:
    case = Case("dict")
    got, expected = build(case), build(case)
    got["block_table"][63, 127] += 1
    assert not matches(case, got, expected)
    got = build(case)
    got["seq_lens"] = got["seq_lens"].to(torch.int64)  # same values, other dtype
    assert not matches(case, got, expected)


def test_payload_sizes_are_what_the_docs_say() -> None:
    assert payload_bytes(Case("tensor", 65536)) == 65536
    assert payload_bytes(Case("dict")) == 39428
    assert 8000 < payload_bytes(Case("sched")) < 10000


def test_ratios_are_tensorwire_over_vllm_and_none_where_a_backend_is_missing() -> None:
    rows = [
        {"backend": "shm", "tp": 2, "case": "1KiB", "median_ms": 0.010},
        {"backend": "vllm", "tp": 2, "case": "1KiB", "median_ms": 0.040},
        {"backend": "uds", "tp": 2, "case": "1KiB", "median_ms": 0.020},
        {"backend": "gloo", "tp": 2, "case": "1KiB", "median_ms": 0.100},
        {"backend": "shm", "tp": 4, "case": "1KiB", "median_ms": 0.012},
        {"backend": "vllm", "tp": 4, "error": "boom"},
    ]
    r2, r4 = broadcast.ratios_of(rows, [Case("tensor", 1024)], [2, 4])
    assert (r2["shm_over_vllm"], r2["uds_over_vllm"], r2["gloo_over_shm"]) == pytest.approx((0.25, 0.5, 10.0))
    assert r4["shm_over_vllm"] is None and r4["uds_over_vllm"] is None


def test_gloo_carries_tensors_only() -> None:
    assert backends.kinds_of("gloo") == {"tensor"}
    assert backends.kinds_of("vllm") == backends.kinds_of("shm") == {"tensor", "dict", "sched"}


def test_asking_for_vllm_by_name_when_it_cannot_load_is_an_error(capsys: pytest.CaptureFixture[str]) -> None:
    assert broadcast.main(["--backends", "vllm", "--vllm-shm-broadcast", "/nonexistent/shm_broadcast.py"]) == 2
    assert "/nonexistent/shm_broadcast.py: no such file" in capsys.readouterr().err


CASES = [Case("tensor", 1024), Case("dict"), Case("sched"), Case("tensor", 65536, 1.0)]


def _check_group(res: list[dict[str, Any]], cases: list[Case], n: int) -> None:
    assert len(res) == 2
    for c in cases:
        lat = res[0]["lat"][c.name]
        assert len(lat) == n and all(0 < x < 10 for x in lat)
        assert 0 <= res[1]["cpu"][c.name] <= 1.5
    assert 0 <= res[1]["idle_cpu_frac"] <= 1.5


@pytest.mark.parametrize(
    ("backend", "api", "codec"),
    [("shm", "inplace", "typed"), ("uds", "fresh", "pickle"), ("shm_pickle", "inplace", "typed")],
)
def test_a_tensorwire_group_delivers_every_case(backend: str, api: str, codec: str) -> None:
    if backend.startswith("shm") and not shm_available():
        pytest.skip("no shared-memory ring on this machine")
    res = broadcast.run_group(
        2,
        backend,
        CASES,
        [3] * len(CASES),
        1,
        0.2,
        timeout_s=180,
        opts=backends.Options(tensor_api=api, object_codec=codec),
    )
    _check_group(res, CASES, 3)
    rows = broadcast.rows_of(backend, 2, CASES, res)
    assert [r["case"] for r in rows] == [c.name for c in CASES] and all(r["n"] == 3 for r in rows)


def test_repeated_groups_combine_into_the_median_of_their_medians() -> None:
    def row(backend: str, rep: int, med: float, p99: float, cpu: float) -> dict[str, Any]:
        return {
            "backend": backend,
            "tp": 2,
            "case": "sched",
            "rep": rep,
            "n": 10,
            "median_ms": med,
            "p99_ms": p99,
            "mean_ms": med,
            "sd_ms": 0.0,
            "min_ms": med / 2,
            "max_ms": p99 * 2,
            "reader_cpu_frac_mean": cpu,
            "reader_cpu_frac_max": cpu,
        }

    rows = [
        row("shm", 0, 0.05, 0.09, 0.9),
        row("vllm", 0, 0.30, 0.5, 1.0),
        row("shm", 1, 0.20, 0.3, 1.0),
        row("vllm", 1, 0.10, 0.2, 1.0),
        row("shm", 2, 0.07, 0.1, 0.95),
        row("vllm", 2, 0.12, 0.2, 1.0),
        {"backend": "uds", "tp": 2, "rep": 0, "error": "boom"},
    ]
    out = {r["backend"]: r for r in broadcast.combine_runs(rows)}
    shm = out["shm"]
    assert (shm["median_ms"], shm["p99_ms"], shm["n"], shm["runs"]) == (0.07, 0.1, 30, 3)
    assert shm["runs_median_ms"] == [0.05, 0.20, 0.07] and shm["min_ms"] == 0.025 and shm["max_ms"] == 0.6
    assert shm["reader_cpu_frac_max"] == 1.0 and "rep" not in shm and "sd_ms" not in shm
    assert out["vllm"]["median_ms"] == 0.12 and out["uds"]["error"] == "boom"  # a failed group stays visible
    ratios = broadcast.ratios_of(list(out.values()), [Case("sched")], [2])
    assert ratios[0]["shm_over_vllm"] == pytest.approx(0.07 / 0.12)


def test_pin_plan_gives_each_rank_its_own_cpu_or_declines() -> None:
    import os

    n = len(os.sched_getaffinity(0))
    plan = broadcast.pin_plan(min(n, 2))
    assert plan is not None and len(set(plan)) == len(plan) == min(n, 2) and set(plan) <= os.sched_getaffinity(0)
    assert broadcast.pin_plan(n + 1) is None
