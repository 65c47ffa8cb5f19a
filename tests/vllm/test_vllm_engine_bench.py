"""The engine benchmark (``python -m tensorwire.bench vllm_engine``) in its quickest mode, as a process.

Real vLLM engines: a baseline, tensorwire's and vLLM's file connector's encoder and LLM instances (one-process
topology, 1 MB items, two measured rounds). Checked: the JSON's shape (every metric with p50/p90/p99 per
connector, ratios against the file connector), every request checked bit for bit against the baseline and equal,
nothing failed, nothing left held (tensorwire's leases, the file connector's files). Timings are reported by the
benchmark, never asserted here.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[2] / "src"

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(1200)]


def test_quick_run_writes_a_complete_json(tmp_path: Path) -> None:
    out = tmp_path / "engine.json"
    env = dict(
        os.environ,
        PYTHONPATH=str(SRC) + (os.pathsep + os.environ["PYTHONPATH"] if os.environ.get("PYTHONPATH") else ""),
    )
    cmd = [
        sys.executable,
        "-m",
        "tensorwire.bench",
        "vllm_engine",
        "--quick",
        "--rounds",
        "2",
        "--warmup",
        "1",
        "--model-dir",
        str(tmp_path / "models"),
        "--workdir",
        str(tmp_path / "work"),
        "--out",
        str(out),
    ]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=1100)
    logs = "\n".join(p.read_text(errors="replace")[-3000:] for p in (tmp_path / "work").rglob("*.log"))
    assert proc.returncode == 0, f"rc {proc.returncode}\n{proc.stdout[-4000:]}\n{proc.stderr[-4000:]}\n{logs}"
    doc = json.loads(out.read_text())
    assert doc["benchmark"] == "vllm-engine" and doc["condition"] == "quiet" and doc["machine"]["cpu_count"]
    (run,) = doc["runs"]
    assert run["topology"] == "uniproc" and run["size_mb"] == 1 and run["item_bytes"] == 64 * 4096 * 4
    assert set(run["connectors"]) == {"tensorwire", "file"}
    for name, st in run["connectors"].items():
        assert st["requests"] == 2 and st["failed"] == 0 and st["mismatches"] == 0, (name, st)
        assert st["item_bytes"] == run["item_bytes"], (name, st)
        for m in ("handoff", "fetch", "save", "llm_request", "e2e"):
            assert st[m]["n"] == 2 and 0 < st[m]["p50_ms"] <= st[m]["p90_ms"] <= st[m]["p99_ms"], (name, m, st[m])
        # The fetch's three stretches happen in that order (the scheduler's and the worker's clocks agree) and
        # add up to it.
        for sample in run["samples"][name]:
            stages = [sample[m] for m in ("until_ready", "to_worker", "worker_load")]
            assert min(stages) >= 0 and abs(sum(stages) - sample["fetch"]) < 1e-6, (name, sample)
            # What is left of the hand-off without the connector's own time (save, until_ready, worker_load).
            own = sample["save"] + sample["until_ready"] + sample["worker_load"]
            assert 0 < sample["outside"] and abs(sample["outside"] + own - sample["handoff"]) < 1e-6, (name, sample)
        # The bit-identical check ran for every measured request (True: equal to the baseline's output).
        assert [s["identical"] for s in run["samples"][name]] == [True, True], run["samples"][name]
    assert run["baseline"]["llm_request"]["n"] == 2
    assert set(run["ratios_vs_file"]["tensorwire"]) >= {"handoff_p50", "handoff_p99", "fetch_p50", "llm_request_p50"}
    file_st = run["connectors"]["file"]
    assert run["bound_vs_file"] == round(file_st["handoff"]["p50_ms"] / file_st["outside"]["p50_ms"], 3) > 1
    tw = run["leftovers"]["tensorwire"]
    assert tw["held_items"] == 0 and tw["held_bytes"] == 0 and tw["fallbacks"] == 0 and tw["place_misses"] == 0, tw
    # The warm-up round's item and two measured ones, mapped from the encoder instance's memfds (same host).
    assert tw["delivered"] == {"map": 3} and tw["placed"] == 3, tw
    assert run["leftovers"]["file"]["files"] == 0
