"""tensorwire.bench.multigpu: argument parsing, device bookkeeping, judging, the <2-GPU exit, a cpu dry run."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from tensorwire.bench import multigpu
from tensorwire.bench.__main__ import _names


def test_dispatcher_lists_the_benchmarks() -> None:
    assert {"multigpu", "tp_nccl"} <= set(_names())


def test_parse_pairs() -> None:
    assert multigpu.parse_pairs("0:1,1:0", 2) == [("cuda:0", "cuda:1"), ("cuda:1", "cuda:0")]
    assert multigpu.parse_pairs(" 3:5 ,", 8) == [("cuda:3", "cuda:5")]


@pytest.mark.parametrize("spec", ["0:2", "0-1", "a:b", "0:1:2", "", ","])
def test_parse_pairs_rejects(spec: str) -> None:
    with pytest.raises(ValueError):
        multigpu.parse_pairs(spec, 2)


def test_parse_rows() -> None:
    assert multigpu.parse_rows("13760") == [13760]
    assert multigpu.parse_rows("8,1024,") == [8, 1024]
    for bad in ("", "0", "-5,8"):
        with pytest.raises(ValueError):
            multigpu.parse_rows(bad)


def test_foreign_allocations_flags_only_other_devices() -> None:
    mem = {
        "cuda:0": {"allocated": 100, "max_allocated": 200},
        "cuda:1": {"allocated": 0, "max_allocated": 4096},
        "cuda:2": {"allocated": 0, "max_allocated": 0},
    }
    assert multigpu.foreign_allocations("cuda:0", mem) == {"cuda:1": 4096}
    assert multigpu.foreign_allocations("cuda:1", mem) == {"cuda:0": 200}
    assert multigpu.foreign_allocations("cpu", {}) == {}


def test_gbps() -> None:
    assert multigpu.gbps(2_000_000_000, 1000.0) == pytest.approx(2.0)
    assert multigpu.gbps(1, 0.0) == float("inf")


def _plane(median_ms: float, **flags: bool) -> dict[str, Any]:
    ok = {"bytes_ok": True, "device_ok": True, "plane_ok": True}
    ok.update(flags)
    stages = {k: {"median_ms": median_ms} for k in ("transfer", "read", "delivered")}
    return {**ok, "stages": stages}


def _pair(rdma: dict[str, Any], inline: dict[str, Any], llm_foreign: bool = False) -> dict[str, Any]:
    nbytes = 1_000_000
    return {
        "llm": {
            "sizes": [{"rows": 10, "bytes": nbytes, "rdma": rdma, "inline": inline}],
            "no_foreign_allocations": not llm_foreign,
        },
        "encoder": {"output_on_device": True, "no_foreign_allocations": True},
        "baseline": {"bytes": nbytes, "p2p_copy": {"median_ms": 0.5, "gbps": multigpu.gbps(nbytes, 0.5)}},
    }


def test_judge_ratios_and_checks() -> None:
    out = multigpu._judge(_pair(_plane(1.0), _plane(100.0)))
    (size,) = out["sizes"]
    assert size["inline_over_rdma_transfer"] == pytest.approx(100.0)
    assert size["rdma_transfer_over_p2p_copy"] == pytest.approx(2.0)
    assert size["rdma_read_gbps_over_p2p_gbps"] == pytest.approx(0.5)
    assert out["checks"]["all_ok"] is True


@pytest.mark.parametrize("flag", ["bytes_ok", "device_ok", "plane_ok"])
def test_judge_fails_on_any_bad_plane(flag: str) -> None:
    out = multigpu._judge(_pair(_plane(1.0), _plane(100.0, **{flag: False})))
    assert out["checks"]["all_ok"] is False


def test_judge_fails_on_foreign_allocation_and_on_missing_rdma() -> None:
    assert multigpu._judge(_pair(_plane(1.0), _plane(9.0), llm_foreign=True))["checks"]["all_ok"] is False
    out = multigpu._judge(_pair({"error": "no NIXL"}, _plane(9.0)))
    assert out["checks"]["rdma_ran"] is False and out["checks"]["all_ok"] is False


def test_fewer_than_two_gpus_exits_zero_without_writing(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    out = tmp_path / "r.json"
    assert multigpu.main(["--out", str(out)]) == 0
    assert "needs at least 2 CUDA devices" in capsys.readouterr().out
    assert not out.exists()


@pytest.mark.parametrize("argv", [["--rows", "0"], ["--iters", "0"], ["--bogus"]])
def test_bad_arguments_exit_2(argv: list[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        multigpu.main(argv)
    assert exc.value.code == 2


@pytest.mark.timeout(180)
@pytest.mark.usefixtures("require_nixl")
def test_dry_run_on_cpu_checks_bytes_devices_and_planes(tmp_path: Path) -> None:
    out = tmp_path / "mg.json"
    rc = multigpu.main(
        [
            "--dry-run",
            "--rows",
            "64,256",
            "--iters",
            "2",
            "--inline-iters",
            "1",
            "--p2p-iters",
            "2",
            "--timeout-s",
            "120",
            "--out",
            str(out),
        ]
    )
    doc = json.loads(out.read_text())
    (pair,) = doc["pairs"]
    assert rc == 0, pair.get("error") or pair["summary"]["checks"]
    assert pair["summary"]["checks"]["all_ok"] is True
    assert [s["bytes"] for s in pair["llm"]["sizes"]] == [64 * 4096 * 2, 256 * 4096 * 2]
    for s in pair["llm"]["sizes"]:
        assert s["rdma"]["planes_seen"] == ["rdma"] and s["inline"]["planes_seen"] == ["inline"]
        assert s["rdma"]["stages"]["read"]["n"] == 2
    assert pair["llm"]["ucx_transport"] != "n/a"
    assert doc["config"]["dry_run"] is True
