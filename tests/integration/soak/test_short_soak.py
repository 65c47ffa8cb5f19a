"""The CI soak: about a minute of traffic with every fault kind, fixed seed, through the real CLI.

It asserts what the issue makes a target: 0 wrong outputs, 0 hung requests, 0 untyped errors, 0 leases or busy
slots after the GC window, threads back everywhere, fds back for the soak process and worker 0. Client 0's fds
may grow by sockets only, at most qp_count per worker restart after its baseline: if the baseline was taken while
worker 1 was down, reconnecting to the new worker opens its UCX endpoints afterwards (docs/reliability.md
"Findings" 1); anything else that grows fails the test. Judged are the processes that live through every fault:
the soak process, worker 0 and client 0 (the sentinels).
The long soak is ``make soak`` (10 minutes, concurrency 16).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys

import pytest

from tensorwire.soak._runner import server_fds_back

QP_COUNT = 8  # RdmaConfig().qp_count: at most one UCX endpoint per UCX worker and owner


@pytest.fixture(scope="module")
def report(nixl_available: bool) -> dict:
    if not nixl_available:
        pytest.skip("NIXL is not installed")
    env = dict(os.environ, UCX_NET_DEVICES="lo", NIXL_LOG_LEVEL="WARN")
    cmd = [
        sys.executable,
        "-m",
        "tensorwire.cli.main",
        "soak",
        "--duration",
        "45",
        "--concurrency",
        "6",
        "--faults",
        "all",
        "--seed",
        "7",
        "--json",
        "--progress-s",
        "15",
    ]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env, start_new_session=True)
    try:
        out, err = proc.communicate(timeout=360)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.communicate(timeout=10)
    assert out.strip(), f"soak printed no report (exit {proc.returncode}):\n{err.decode(errors='replace')[-3000:]}"
    return json.loads(out)


@pytest.mark.timeout(420)
def test_every_fault_kind_was_injected(report: dict) -> None:
    faults = report["faults_injected"]
    relay = report["relay_events"]
    assert faults.get("reader_kill", 0) >= 1 and report["aborted_by_reader_kill"] >= 0
    assert faults.get("worker_restart", 0) >= 1
    assert any(k.startswith("unavailable_") for k in faults)
    assert any(k.endswith("releases_dropped") for k in relay) and any(k.endswith("releases_delayed") for k in relay)
    assert any(".corrupted_" in k for k in relay)
    assert report["worker_exporter_end"]["1"]["pool_cap_bytes"] <= 4 * 2**20  # the tiny-pool worker
    assert report["successes"] > 100, "too little traffic for the checks below to mean anything"


@pytest.mark.timeout(420)
def test_no_wrong_hung_or_untyped(report: dict) -> None:
    assert report["wrong_outputs"] == 0, report["wrong_examples"]
    assert report["hung_requests"] == 0
    assert report["untyped_errors"] == 0, report["untyped_examples"]
    # Every failure is a typed error with a reason or a counted fallback.
    assert all(":" in k and not k.endswith(":unknown") for k in report["errors_by_reason"])
    counted = report["successes"] + sum(report["errors_by_reason"].values()) + report["aborted_by_reader_kill"]
    assert counted == report["requests"]


@pytest.mark.timeout(420)
def test_no_leases_or_slots_left_after_the_gc_window(report: dict) -> None:
    assert report["leases_outstanding_after_gc"] == 0
    assert report["busy_slots_after_gc"] == 0
    assert report["pool_busy_bytes_after_gc"] == 0
    assert sum(report["gc_reclaimed"].values()) > 0, "faults dropped releases, so the GC must have reclaimed some"


@pytest.mark.timeout(420)
def test_fds_and_threads_back(report: dict) -> None:
    procs = report["processes"]
    judged = {k: p for k, p in procs.items() if p["judged"]}
    # The soak process and both sentinels lived through the whole run and were judged.
    assert set(judged) == {"soak+proxy+relays", "worker0", "client0"}, (list(procs), report["processes_unchecked"])
    for name, p in judged.items():
        assert p["threads_leaked"] == 0, (name, p)
        if name == "client0":
            grown = p["fd_growth_by_kind"]
            allowed = QP_COUNT * p["worker_restarts_after_baseline"]
            assert set(k for k, v in grown.items() if v > 0) <= {"socket"}, (name, p)
            assert grown.get("socket", 0) <= allowed, (name, p)
        else:  # a server: live peers' connections and the owner-lookup pool are not leaks (server_fds_delta)
            assert server_fds_back(p), (
                f"{name}: fds {p['fds']}, by kind {p['fd_growth_by_kind']}, sockets {p.get('socket_growth_by_state')}, "
                f"new {p.get('new_sockets')}"
            )


@pytest.mark.timeout(420)
def test_a_faulted_worker_costs_no_request_a_healthy_one_could_serve(report: dict) -> None:
    """Issue 16 finding 8: with one worker faulted at a time, requests outside client-side cuts succeed (the
    3-minute soak's target is 99.9 %, benchmarks/results/soak-availability-cpu2.json; 45 s of traffic on a busy
    2-core host allow two failures or 0.5 % here). Every failure is listed with the windows it overlapped."""
    av = report["availability"]
    out = av["outside_client_cuts"]
    assert out["requests"] > 100, out
    assert out["failed"] <= max(2, int(0.005 * out["requests"])), av["failures_outside_client_cuts"]
    assert set(av["by_fault"]) == {"client_cut", "worker_restart", "worker_cut", "none"}
    assert (
        av["windows"].get("worker_restart", 0) >= 1
        and av["windows"].get("client_cut", 0) + av["windows"].get("worker_cut", 0) >= 1
    )
    # One worker at a time: no two worker-fault windows overlap.
    worker = sorted((w for w in av["window_list"] if w["kind"] != "client_cut"), key=lambda w: w["start_s"])
    assert all(a["end_s"] <= b["start_s"] for a, b in zip(worker, worker[1:], strict=False)), worker
