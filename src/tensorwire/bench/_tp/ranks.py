"""Run one benchmark function per rank in spawned processes and collect what each returns.

Ranks share two arrays for latency measurements (``times``: a float per rank, ``done``: a counter per rank) and a
scratch directory ``store`` (a file store for torch.distributed, socket paths). Every wait is bounded: a rank that
dies or raises ends the group with an error naming it, and stragglers are killed.
"""

from __future__ import annotations

import multiprocessing as mp
import queue as queue_mod
import tempfile
import time
from collections.abc import Callable
from typing import Any

RankFn = Callable[..., dict[str, Any]]  # fn(rank, world, *args, store, times, done) -> result dict


def _rank_main(
    fn: RankFn, rank: int, world: int, args: tuple[Any, ...], store: str, times: Any, done: Any, q: Any
) -> None:
    try:
        q.put((rank, fn(rank, world, *args, store, times, done)))
    except BaseException as exc:  # report, never leave the parent waiting
        q.put((rank, {"error": f"{type(exc).__name__}: {exc}"}))


def run_ranks(
    world: int,
    fn: RankFn,
    args: tuple[Any, ...],
    *,
    label: str,
    timeout_s: float,
    join_s: float = 10.0,
    tmp_prefix: str = "twbench.",
) -> list[dict[str, Any]]:
    """``fn``'s result for every rank, in rank order; RuntimeError/TimeoutError naming ``label`` otherwise."""
    ctx = mp.get_context("spawn")
    times = ctx.Array("d", world, lock=False)
    done = ctx.Array("q", world, lock=False)
    q = ctx.Queue()
    with tempfile.TemporaryDirectory(prefix=tmp_prefix) as tmp:
        store = f"{tmp}/store"
        procs = [
            ctx.Process(target=_rank_main, args=(fn, r, world, args, store, times, done, q), daemon=True)
            for r in range(world)
        ]
        for p in procs:
            p.start()
        results: dict[int, dict[str, Any]] = {}
        deadline = time.monotonic() + timeout_s
        try:
            while len(results) < world:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    raise TimeoutError(f"{label}: no result after {timeout_s:.0f} s")
                try:
                    r, res = q.get(timeout=min(remaining, 2.0))
                except queue_mod.Empty:
                    if any(p.exitcode not in (None, 0) for p in procs):
                        raise RuntimeError(f"{label}: a rank died: exit codes {[p.exitcode for p in procs]}") from None
                    continue
                results[r] = res
                if "error" in res:
                    break  # the other ranks will not finish; they are killed below
            for p in procs:
                p.join(timeout=join_s)
        finally:
            for p in procs:
                if p.is_alive():
                    p.kill()
                    p.join(timeout=5)
    errors = [f"rank {r}: {res['error']}" for r, res in sorted(results.items()) if "error" in res]
    if errors:
        raise RuntimeError(f"{label}: " + "; ".join(errors))
    return [results[r] for r in range(world)]
