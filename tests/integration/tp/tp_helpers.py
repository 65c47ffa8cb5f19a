"""Multi-process harness for the broadcaster tests: spawned ranks, bounded waits, stragglers killed.

Each rank runs ``target(rank, world, *args)`` in a spawned process and reports ("ok", value) or
("err", (type name, message, reason)) through a queue. ``run_ranks`` returns the reports indexed by rank, or
raises AssertionError when a rank neither reported nor exited within the deadline.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import queue
import shutil
import tempfile
import time
import traceback
from collections.abc import Callable
from typing import Any

Report = tuple[str, Any]


def _entry(target: Callable[..., Any], rank: int, world: int, args: tuple[Any, ...], q: Any) -> None:
    try:
        q.put((rank, ("ok", target(rank, world, *args))))
    except BaseException as exc:  # report everything, including test assertion failures
        reason = getattr(getattr(exc, "reason", None), "value", None)
        q.put((rank, ("err", (type(exc).__name__, str(exc), reason, traceback.format_exc()))))


def start(target: Callable[..., Any], ranks: list[int], world: int, args: tuple[Any, ...], q: Any) -> list[Any]:
    ctx = mp.get_context("spawn")
    procs = []
    for r in ranks:
        p = ctx.Process(target=_entry, args=(target, r, world, args, q), daemon=True)
        p.start()
        procs.append(p)
    return procs


def collect(q: Any, procs: list[Any], n: int, timeout_s: float) -> dict[int, Report]:
    out: dict[int, Report] = {}
    deadline = time.monotonic() + timeout_s
    try:
        while len(out) < n:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise AssertionError(f"only ranks {sorted(out)} reported within {timeout_s} s: {out}")
            try:
                r, rep = q.get(timeout=min(remaining, 1.0))
            except queue.Empty:
                continue
            out[r] = rep
        for p in procs:
            p.join(timeout=max(0.1, deadline - time.monotonic()))
    finally:
        kill(procs)
    return out


def kill(procs: list[Any]) -> None:
    for p in procs:
        if p.is_alive():
            p.kill()
            p.join(timeout=5)


def run_ranks(
    target: Callable[..., Any], world: int, *args: Any, timeout_s: float = 60.0, ranks: list[int] | None = None
) -> dict[int, Report]:
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    rs = list(range(world)) if ranks is None else ranks
    procs = start(target, rs, world, args, q)
    return collect(q, procs, len(rs), timeout_s)


def ok(reports: dict[int, Report]) -> dict[int, Any]:
    bad = {r: rep[1] for r, rep in reports.items() if rep[0] != "ok"}
    assert not bad, "\n".join(f"rank {r}: {e[0]}: {e[1]}\n{e[3]}" for r, e in sorted(bad.items()))
    return {r: rep[1] for r, rep in reports.items()}


def short_dir() -> str:
    """A short private base directory (sun_path is only 108 bytes; pytest's tmp_path can exceed it)."""
    return tempfile.mkdtemp(prefix="twtp.", dir="/tmp")


def rmtree(path: str) -> None:
    shutil.rmtree(path, ignore_errors=True)


def seed() -> int:
    s = int(os.environ.get("TENSORWIRE_TEST_SEED", "0")) or int(time.time()) % 100000
    print(f"seed={s}")
    return s
