"""CLI smoke tests with real subprocesses: serve-encoder + fetch (+ /metrics, SIGTERM), serve-proxy, demo --json."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import urllib.request
from pathlib import Path

import pytest

from tensorwire.encoder import sample_paths
from tensorwire.mm._metrics import LLM_ONLY
from tensorwire.rdma import has_rdma
from tensorwire.service._child import Child


def _cli(*argv: str, timeout: float = 300) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "tensorwire.cli.main", *argv],
        capture_output=True,
        text=True,
        timeout=timeout,
        stdin=subprocess.DEVNULL,
    )


@pytest.mark.timeout(900)
def test_serve_fetch_metrics_and_sigterm(tmp_path: Path) -> None:
    enc = Child("encoder", ["serve-encoder", "--port", "0", "--metrics-port", "0", "--wait-exporter-s", "20"], tmp_path)
    try:
        ready = enc.ready(400)
        assert ready["mode"] == "auto" and ready["model"] == "builtin" and ready["worker_id"]
        images = [str(p) for p in sample_paths()[:2]]
        r = _cli("fetch", "--endpoint", ready["grpc"], "--json", *images)
        assert r.returncode == 0, r.stderr
        doc = json.loads(r.stdout)
        assert doc["plane"] == ("rdma" if has_rdma() else "inline")
        assert [len(i["shape"]) for i in doc["items"]] == [2, 2] and doc["items"][0]["shape"][1] == 2048
        assert doc["items"][0]["position_ids_shape"] == [doc["items"][0]["shape"][0], 2]
        assert doc["total_ms"] >= doc["transfer_ms"] > 0 and doc["encoder_ms"] > 0
        # The command's wall time, split: start-up + the fetch whose stages these are + releases and close.
        wall = doc["wall_ms"]
        assert wall["total"] >= wall["start_up"] + wall["fetch"] and wall["fetch"] >= doc["total_ms"] * 0.5
        # Text output, inline plane.
        r = _cli("fetch", "--endpoint", ready["grpc"], "--mode", "grpc", images[0])
        assert r.returncode == 0, r.stderr
        assert "plane: inline" in r.stdout and "2048] float32" in r.stdout
        assert "stages (ms): " in r.stdout and "wall time " in r.stdout and "start-up " in r.stdout
        # A file that is not an image: INVALID_ARGUMENT, exit 1, and the server keeps serving.
        bad = tmp_path / "bad.jpg"
        bad.write_bytes(b"\xff\xd8 not really a jpeg")
        r = _cli("fetch", "--endpoint", ready["grpc"], str(bad))
        assert r.returncode == 1 and "INVALID_ARGUMENT" in r.stderr and "cannot decode" in r.stderr
        assert _cli("fetch", "--endpoint", ready["grpc"], "--json", images[1]).returncode == 0
        with urllib.request.urlopen(f"http://{ready['metrics']}/metrics", timeout=10) as resp:
            text = resp.read().decode()
        assert 'tensorwire_mm_requests_total{plane="inline",side="encoder"}' in text
        assert 'tensorwire_mm_errors_total{reason="invalid_payload",side="encoder"} 1.0' in text
        # Only the worker's own families: none of the LLM side's, which a worker never updates.
        families = {line.split()[2] for line in text.splitlines() if line.startswith("# TYPE ")}
        assert "tensorwire_mm_encoder_compute_seconds" in families and "tensorwire_build_info" in families
        llm_side = {f for f in families if f in LLM_ONLY or f + "_total" in LLM_ONLY}
        assert not llm_side, f"the worker exports LLM-side families: {sorted(llm_side)}"
        assert "_created{" not in text and "_created " not in text
        # Graceful shutdown on SIGTERM: exit 0, promptly.
        enc.proc.send_signal(signal.SIGTERM)
        assert enc.proc.wait(120) == 0
    finally:
        enc.terminate(grace_s=5)


@pytest.mark.timeout(600)
def test_serve_proxy_refuses_unreachable_worker_and_bad_flags() -> None:
    r = _cli("serve-proxy", "--worker", "127.0.0.1:1", "--worker-wait-s", "1", "--metrics-port", "-1")
    assert r.returncode == 1 and "did not answer WorkerInfo" in r.stderr
    r = _cli("serve-proxy", "--worker", "127.0.0.1:5", "--worker", "127.0.0.1:5")
    assert r.returncode == 2 and "twice" in r.stderr
    r = _cli("serve-encoder", "--model", "/nonexistent-model-dir")
    assert r.returncode == 2 and "config.json" in r.stderr


@pytest.mark.timeout(900)
def test_demo_json_runs_both_planes_and_leaves_nothing_behind() -> None:
    r = _cli("demo", "--json", "--rounds", "2", "--warmup", "1", timeout=800)
    if r.returncode == 1 and r.stdout.strip():  # the planes disagreed: say how (which image, worker, bytes)
        doc = json.loads(r.stdout)
        pytest.fail(f"demo outputs differ between planes: {json.dumps(doc.get('mismatch_details'))[:4000]}")
    assert r.returncode == 0, r.stderr[-3000:]
    doc = json.loads(r.stdout)
    assert doc["outputs_match"] is True and doc["mismatch_details"] == []
    assert doc["delivered_by"]["inline"] == {"inline": 2 * len(sample_paths())}
    if has_rdma():
        assert doc["delivered_by"]["rdma"] == {"rdma": 2 * len(sample_paths())}
    seed = doc["images"]["scene_2048x1365.jpg"]
    assert seed["payload_bytes"] > 1_000_000
    for plane in ("rdma", "inline"):
        for stage in ("encoder", "transfer", "total"):
            assert seed["planes"][plane][stage]["n"] == 2 and seed["planes"][plane][stage]["mean_ms"] > 0
    assert set(doc["child_exit_codes"].values()) == {0}
    # The demo's children ran in their own process groups; none may survive it.
    assert len(doc["child_pids"]) == 3
    assert not _still_running(list(doc["child_pids"].values()))


def _still_running(pids: list[int]) -> list[tuple[int, bytes]]:
    """Those of ``pids`` that are still tensorwire processes (other test runs may have demos of their own)."""
    alive = []
    for pid in pids:
        try:
            cmd = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ")
        except OSError:
            continue
        if b"tensorwire" in cmd:
            alive.append((pid, cmd[:120]))
    return alive


# Ctrl-C of the demo (on a busy host), SIGKILL of the demo and the soak: tests/integration/cli/test_cli_ops.py.
