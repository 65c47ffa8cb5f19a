"""``python -m tensorwire.bench control`` end to end at a tiny size: every path really used, JSON complete."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tensorwire.bench import control

pytestmark = pytest.mark.timeout(180)


def test_control_bench_runs_both_paths_and_writes_every_cell(tmp_path: Path) -> None:
    out = tmp_path / "control.json"
    assert control.main(["--n", "5", "--gaps-ms", "0,1", "--out", str(out)]) == 0
    doc = json.loads(out.read_text())
    for table in ("echo", "fetch"):
        for path in ("unary", "stream", "local"):
            assert set(doc[table][path]) == {"0ms", "1ms"}
            assert all(cell["n"] == 5 and cell["median_ms"] > 0 for cell in doc[table][path].values())
    # The stream transport went over EncodeStream and the other over unary Encode (warm-up and probe included).
    rpcs = doc["fetch"]["control_rpcs_of_both_transports"]
    assert rpcs.get("path=stream", 0) >= 2 * 5 and rpcs.get("path=unary", 0) >= 2 * 5
    assert rpcs.get("path=local", 0) >= 2 * 5  # the same-host transport really used its channel
    assert set(doc["ratios"]) == {
        f"{t}_{r}_gap_{g}"
        for t in ("echo", "fetch")
        for g in ("0ms", "1ms")
        for r in ("unary_over_stream", "stream_over_local")
    }
