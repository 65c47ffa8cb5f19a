"""The connector's runtime as a guest inside the engine: an LLM instance's host-memory reader (a real NIXL agent)
does not wake up every millisecond while it has nothing to read."""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest

from tensorwire.integrations._vllm_ec import runtime
from tensorwire.integrations._vllm_ec.config import ECConfig


def _tids() -> set[int]:
    return {int(t) for t in os.listdir("/proc/self/task")}


def _switches(tids: set[int]) -> int:
    """Context switches so far of the threads ``tids`` still alive (each one a wake-up of a sleeping thread, or a
    preemption of a running one)."""
    total = 0
    for tid in tids:
        try:
            text = Path(f"/proc/self/task/{tid}/status").read_text()
        except OSError:
            continue
        total += sum(int(line.split()[1]) for line in text.splitlines() if "ctxt_switches:" in line)
    return total


def test_the_llm_instances_host_reader_sleeps_while_idle(tmp_path: Path) -> None:
    """At NIXL's usual 1 ms its progress thread woke ~930 times a second beside vLLM's threads; the reader drives
    its own READs, so the idle thread may sleep far longer."""
    before = _tids()
    stager = runtime.segment_stager(ECConfig(runtime_dir=str(tmp_path / "rt")))
    try:
        if not stager.warm_up():
            pytest.skip("no RDMA provider in this environment")
        time.sleep(0.5)  # the agent's start-up is over
        ours = _tids() - before
        assert ours, "building the reader started no thread"
        s0, t0 = _switches(ours), time.monotonic()
        time.sleep(2.0)
        rate = (_switches(ours) - s0) / (time.monotonic() - t0)
        assert rate < 250, f"the idle reader's threads switched {rate:.0f} times a second"
    finally:
        stager.close()
