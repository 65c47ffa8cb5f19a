"""tensorwire.bench.tp_nccl: TP/size parsing, latency to the last rank, ratios, the <2-GPU exit, a gloo dry run."""

from __future__ import annotations

import itertools
import json
from pathlib import Path

import pytest

from tensorwire.bench import tp_nccl
from tensorwire.bench._common import summarize


@pytest.mark.parametrize(
    "available,expected", [(0, []), (1, []), (2, [2]), (3, [2, 3]), (4, [2, 4]), (6, [2, 4, 6]), (8, [2, 4, 8])]
)
def test_parse_tp_default_follows_the_gpu_count(available: int, expected: list[int]) -> None:
    assert tp_nccl.parse_tp(None, available) == (expected, [])


def test_parse_tp_explicit_drops_what_does_not_fit() -> None:
    assert tp_nccl.parse_tp("2,4,8", 2) == ([2], [4, 8])
    assert tp_nccl.parse_tp("8,2,2", 8) == ([8, 2], [])


@pytest.mark.parametrize("spec", ["1", "0", "x", "2,-4", ",", ""])
def test_parse_tp_rejects(spec: str) -> None:
    with pytest.raises(ValueError):
        tp_nccl.parse_tp(spec, 8)


def test_parse_sizes() -> None:
    assert tp_nccl.parse_sizes("1024,65536") == [1024, 65536]
    with pytest.raises(ValueError):
        tp_nccl.parse_sizes("0")


def test_latency_is_to_the_last_reader() -> None:
    assert tp_nccl.latency_to_last_rank(10.0, [10.5, 10.25, 12.0]) == pytest.approx(2.0)
    assert tp_nccl.latency_to_last_rank(1.0, [1.5]) == pytest.approx(0.5)
    with pytest.raises(ValueError):
        tp_nccl.latency_to_last_rank(1.0, [])


def test_round_marker_is_never_zero_and_changes_every_round() -> None:
    marks = [tp_nccl.round_marker(c) for c in range(1, 2000)]
    assert 0 not in marks and all(0 < m < 256 for m in marks)
    assert all(a != b for a, b in itertools.pairwise(marks))


def test_summarize_median_and_p99() -> None:
    s = summarize([i / 1000 for i in range(1, 101)])  # 1 .. 100 ms
    assert s["n"] == 100
    assert s["median_ms"] == pytest.approx(50.5)
    assert s["p99_ms"] == pytest.approx(99.0)
    assert s["max_ms"] == pytest.approx(100.0)


def test_ratio_rows_pairs_methods_per_load_tp_and_size() -> None:
    rows = [
        {"load": "busy", "tp": 2, "size_bytes": 1024, "method": "broadcast_cpu", "median_ms": 0.02, "p99_ms": 0.05},
        {"load": "busy", "tp": 2, "size_bytes": 1024, "method": "nccl", "median_ms": 0.2, "p99_ms": 1.0},
        {"load": "idle", "tp": 2, "size_bytes": 1024, "method": "broadcast_cpu", "median_ms": 0.01, "p99_ms": 0.02},
        {"tp": 4, "error": "boom"},
    ]
    (r,) = tp_nccl.ratio_rows(rows, ["broadcast_cpu", "nccl"])  # idle has no nccl row; the error row is ignored
    assert (r["load"], r["tp"], r["size_bytes"]) == ("busy", 2, 1024)
    assert r["median"] == pytest.approx(10.0) and r["p99"] == pytest.approx(20.0)


def test_fewer_than_two_gpus_exits_zero_without_writing(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    out = tmp_path / "r.json"
    assert tp_nccl.main(["--out", str(out)]) == 0
    assert "needs at least 2 CUDA devices" in capsys.readouterr().out
    assert not out.exists()


@pytest.mark.parametrize("argv", [["--loads", "warm"], ["--sizes", "0"], ["--rounds", "0"], ["--tp", "1"]])
def test_bad_arguments_exit_2(argv: list[str], monkeypatch: pytest.MonkeyPatch) -> None:
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(SystemExit) as exc:
        tp_nccl.main([*argv, "--dry-run"])
    assert exc.value.code == 2


@pytest.mark.timeout(180)
def test_dry_run_with_gloo(tmp_path: Path) -> None:
    out = tmp_path / "tp.json"
    rc = tp_nccl.main(
        [
            "--dry-run",
            "--tp",
            "2",
            "--sizes",
            "1024,65536",
            "--rounds",
            "10",
            "--warmup",
            "2",
            "--timeout-s",
            "150",
            "--out",
            str(out),
        ]
    )
    assert rc == 0
    doc = json.loads(out.read_text())
    got = {(r["method"], r["size_bytes"]): r for r in doc["results"]}
    assert set(got) == {(m, s) for m in ("broadcast_cpu", "gloo") for s in (1024, 65536)}
    assert all(
        r["n"] == 10 and r["load"] == "idle" and r["tp"] == 2 and 0 < r["median_ms"] <= r["p99_ms"]
        for r in got.values()
    )
    assert len(doc["ratios"]) == 2
