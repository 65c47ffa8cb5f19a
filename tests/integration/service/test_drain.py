"""SIGTERM to a real ``serve-encoder`` while RDMA fetches are in flight (issue 16 finding 2): the short version of
``python -m tensorwire.bench drain`` (20 runs, benchmarks/results/drain-cpu2.json).

One fetch holds its RDMA read until after the server's drain period, so it reads an exported slot while the
server already refuses new work: the old stop closed the exporter together with the gRPC server, and that read
failed (``remote agent ... was disconnected`` / ``slot generation``), then its inline fallback hit a closed server.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tensorwire.bench.drain import run_once


@pytest.mark.timeout(240)
def test_sigterm_during_rdma_fetches_fails_none_of_them(tmp_path: Path, nixl_available: bool) -> None:
    if not nixl_available:
        pytest.skip("NIXL is not installed: no RDMA plane to drain")
    r = run_once(threads=2, drain_s=1.5, grace_s=10.0, log_dir=tmp_path)
    assert r["rdma_ready"], r
    assert r["in_flight"] >= 2 and r["in_flight_failed"] == 0, r["in_flight_failures"]
    assert r["held_ok"] and r["held_plane"] == "rdma", r  # the lease outlived the end of new work
    # Check answered NOT_SERVING during the drain period (the old server flipped it only as it stopped).
    assert r["not_serving_seen_s"] is not None and r["not_serving_seen_s"] < 1.5, r["check_answers"]
    # The open Watch saw NOT_SERVING and ended before the grace did (it used to hold the stop for all of it).
    assert "NOT_SERVING" in r["watch"] and r["watch_ended_s"] is not None and r["watch_ended_s"] < 1.5 + 10.0
    assert r["exit_code"] == 0
    # Every lease came back, so the stop ended well before drain + grace (+ the exit itself).
    assert r["stop_s"] < 1.5 + 10.0, r
    # What came after the drain period was refused with a typed, retryable error (or, in the moment before the
    # server quiesced, still served).
    assert set(r["refused"]) <= {"PeerUnavailable:peer_unavailable", "ok"}, r["refused"]
