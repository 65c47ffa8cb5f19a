"""``bench progress_delay``'s summary: medians over rounds per delay, and the longest delay's p50 over the
shortest's, whatever order the delays ran in."""

from __future__ import annotations

from typing import Any

from tensorwire.bench.progress_delay import _summary


def _run(delay: int, p50s: list[float], cpu: float) -> dict[str, Any]:
    reads = [
        {"bytes": b, "gap_s": 0.0, "n": 3, "p50_ms": p, "p90_ms": 2 * p, "max_ms": 3 * p}
        for b, p in zip((4096, 1 << 20), p50s, strict=True)
    ]
    return {
        "progress_delay_us": delay,
        "reads": reads,
        "owner_idle": {"cpu_core_fraction": cpu, "context_switches_per_s": 1e6 / delay},
    }


def test_the_summary_takes_medians_over_rounds_and_compares_the_longest_delay_with_the_shortest() -> None:
    runs = [
        _run(50_000, [2.0, 10.0], 0.002),  # the first round ran the longer delay first
        _run(1000, [1.0, 8.0], 0.03),
        _run(1000, [3.0, 12.0], 0.02),
        _run(50_000, [4.0, 11.0], 0.004),
        _run(1000, [2.0, 10.0], 0.025),
        _run(50_000, [3.0, 30.0], 0.003),
    ]
    got = _summary(runs, [1000, 50_000])
    small, big = got["reads"]
    assert small["1000"]["p50_ms"] == 2.0 and small["50000"]["p50_ms"] == 3.0
    assert small["p50_longest_over_shortest"] == 1.5
    assert big["1000"]["p90_ms"] == 20.0 and big["p50_longest_over_shortest"] == 11.0 / 10.0
    assert got["owner_idle"]["1000"]["cpu_core_fraction"] == 0.025
    assert got["owner_idle"]["50000"]["context_switches_per_s"] == 20.0
