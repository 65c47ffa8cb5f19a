"""How fast this machine runs Python right after a pause (issue 18; docs/notes/pause-cost.md).

One process, no GPU, no socket, no tensorwire: a fixed pure-Python workload cut into ``--chunks`` equal pieces,
each piece timed on its own. ``compute``: integer arithmetic, a dict and a list, all in the first-level cache;
``walk``: a sum over a slice of a shuffled list of floats, each piece its own slice, together about 1 MiB
(printed as ``walk_bytes``), so a piece runs at the speed of whichever cache or memory its data comes from.
Before each round the process either goes on at once (``back to back``), sleeps (``sleep N ms``: the CPU may go
idle, and a virtual CPU halts to its hypervisor) or spins in a loop for the same time (``spin N ms``: the CPU
never idles, and the spin touches almost no memory). Per condition, the median time of each piece over
``--rounds`` rounds, microseconds.

What it tells apart: ``compute`` slower in every piece after a pause means the core itself runs slower (its
clock); ``walk`` slower and recovering piece by piece while ``compute`` is not means the data had left the
caches; either after a sleep but not after a spin means it comes from the CPU having idled. The placed fetch's
timeline shows the functions of both its processes 1.5-2.4x slower after a 5 ms pause (median over them).

    python scripts/probe_idle_warmup.py [--workload compute|walk] [--rounds 200] [--chunks 10] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "src"))

from tensorwire.bench._common import machine_info


def _piece(n: int) -> int:
    d = {i: i for i in range(16)}
    acc = 0
    xs = [0] * 16
    for i in range(n):
        k = i & 15
        acc += d[k] * 3 + (i ^ acc) % 7
        xs[k] = acc & 0xFFFF
    return acc + xs[3]


class _Walk:
    """Pieces of ``n`` floats each, every piece its own part of one shuffled list (built once)."""

    def __init__(self, n: int, chunks: int) -> None:
        import random

        rng = random.Random(7)
        self.objs = [rng.random() for _ in range(n * chunks)]
        rng.shuffle(self.objs)  # the floats' memory is in allocation order; the list's order is not
        self.n = n
        self.i = 0
        self.chunks = chunks

    def __call__(self, n: int) -> float:
        start = (self.i % self.chunks) * self.n
        self.i += 1
        return sum(self.objs[start : start + self.n])


def _calibrate(fn, target_us: float) -> int:
    """Iterations of ``fn`` that take about ``target_us`` when warm (best of a few, after a warm-up)."""
    n = 1000
    for _ in range(3):
        fn(n)
    best = min(_timed(fn, n) for _ in range(20))
    return max(50, int(n * target_us / (best / 1000.0)))


def _timed(fn, n: int) -> int:
    t = time.perf_counter_ns()
    fn(n)
    return time.perf_counter_ns() - t


def _pause(kind: str, ms: float) -> None:
    if kind == "sleep":
        time.sleep(ms / 1000.0)
    elif kind == "spin":
        end = time.perf_counter() + ms / 1000.0
        while time.perf_counter() < end:
            pass


def _round(fn, n: int, chunks: int) -> list[float]:
    return [_timed(fn, n) / 1000.0 for _ in range(chunks)]


def run(workload: str, rounds: int, chunks: int, piece_us: float, conditions: list[tuple[str, float]]) -> dict:
    if workload == "walk":
        walk = _Walk(_calibrate(lambda k: sum(float(i) for i in range(k)), piece_us) * 4, chunks)
        # A sum over a list takes a third to a quarter of the generator's time per item: pieces of 20-25 us.
        fn, n = walk, walk.n
    else:
        fn, n = _piece, _calibrate(_piece, piece_us)
    out: dict = {
        "workload": workload,
        "piece_iterations": n,
        "piece_target_us": piece_us,
        "chunks": chunks,
        "rounds": rounds,
        "conditions": {},
    }
    if workload == "walk":  # the floats (24 bytes each) and the list's pointers
        out["walk_bytes"] = n * chunks * (sys.getsizeof(0.5) + 8)
        print(f"walk over {out['walk_bytes'] / 2**20:.2f} MiB")
    named = [(f"{kind} {ms:g} ms" if kind else "back to back", kind, ms) for kind, ms in conditions]
    samples: dict[str, list[list[float]]] = {name: [] for name, _, _ in named}
    # Conditions interleaved round by round, so a change of the machine's speed over the run hits all alike.
    for _ in range(rounds):
        for name, kind, ms in named:
            _pause(kind, ms)
            samples[name].append(_round(fn, n, chunks))
    base = None
    for name, rs in samples.items():
        per_chunk = [statistics.median(r[i] for r in rs) for i in range(chunks)]
        total = statistics.median(sum(r) for r in rs)
        base = base if base is not None else total
        out["conditions"][name] = {
            "per_piece_median_us": per_chunk,
            "total_median_us": total,
            "vs_back_to_back": total / base,
        }
        print(
            f"{name:>16}: total {total:7.1f} us ({total / base:4.2f}x)  pieces "
            + " ".join(f"{x:5.1f}" for x in per_chunk)
        )
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--workload", choices=["compute", "walk"], default="compute")
    ap.add_argument("--rounds", type=int, default=200)
    ap.add_argument("--chunks", type=int, default=10)
    ap.add_argument("--piece-us", type=float, default=30.0, help="one piece's warm duration (default 30 us)")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    conditions = [
        ("", 0.0),
        ("sleep", 0.05),
        ("sleep", 0.2),
        ("sleep", 1.0),
        ("sleep", 5.0),
        ("sleep", 20.0),
        ("spin", 5.0),
    ]
    print(
        f"{args.workload}: {args.rounds} rounds of {args.chunks} pieces of ~{args.piece_us:g} us; medians per piece, us"
    )
    res = run(args.workload, args.rounds, args.chunks, args.piece_us, conditions)
    res["machine"] = machine_info()
    if args.json:
        with open(args.json, "w") as f:
            json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
