"""``python -m tensorwire.bench router`` at a tiny size: the stand-in instance answers plain and streamed requests
completely, the client counts them, the scenarios run end to end and write every cell. FastAPI, uvicorn
and an old tree are optional: the tensorwire and direct columns alone here."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tensorwire.bench import router
from tensorwire.bench._router import client

pytestmark = pytest.mark.timeout(240)


def test_the_client_reads_whole_answers_from_the_stand_in() -> None:
    upstream = router._upstream()
    try:
        for stream in (False, True):
            row = client.run(client.closed_loop(upstream.port, client.chat(stream), 2, 0.3, warmup_s=0.1))
            assert row["n"] > 0 and row["errors"] == 0, row
    finally:
        upstream.stop()


def test_router_bench_runs_and_writes_every_cell(tmp_path: Path) -> None:
    out = tmp_path / "router.json"
    assert (
        router.main(
            [
                "--seconds",
                "0.3",
                "--warmup",
                "0.2",
                "--repeats",
                "2",
                "--concurrency",
                "1",
                "2",
                "--proxies",
                "direct",
                "tensorwire",
                "--sigterms",
                "1",
                "--hung-seconds",
                "1",
                "--skip",
                "idle_loris",
                "--out",
                str(out),
            ]
        )
        == 0
    )
    doc = json.loads(out.read_text())
    cells = {(r["proxy"], r["mode"], r["c"]) for r in doc["closed_loop"]}
    assert cells == {(p, m, c) for p in ("direct", "tensorwire") for m in ("plain", "stream") for c in (1, 2)}
    assert all(r["errors"] == 0 and r["n"] > 0 and r["repeats"] == 2 for r in doc["closed_loop"]), doc["closed_loop"]
    slices = {(r["proxy"], r["mode"], r["c"], r["repeat"]) for r in doc["closed_loop_slices"]}
    assert slices == {(p, m, c, i) for p, m, c in cells for i in (0, 1)}
    assert all(r["client_cpu_s"] > 0 for r in doc["closed_loop_slices"])  # measured in the client's own process
    assert doc["sigterm"]["streams_cut"] == 0 and doc["sigterm"]["exit_codes"] == [0]
    assert "idle_loris" not in doc  # its waits are idle timeouts: the router's own tests cover the closing
    assert doc["hung_encoder"]["tensorwire"]["n"] > 0
