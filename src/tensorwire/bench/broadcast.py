"""Benchmark: latency to the last reader of a rank-0 broadcast (uds, shm, gloo broadcast, broadcast_object_list).

``python -m tensorwire.bench broadcast [--quick]``. For each TP size, each transport runs in its own group of spawned
processes. Rank 0 takes ``t0 = perf_counter()`` (CLOCK_MONOTONIC, comparable across processes), broadcasts a uint8
tensor, and waits until every reader has stored its own return time in a shared array; the latency of that round is
``max(reader times) - t0``. Rounds are back to back (the next one starts once every reader has reported), which is
the decode-step pattern of a TP group. After the rounds, rank 0 stays silent for ``--idle-s`` and the readers
measure their process CPU time while waiting (idle CPU of a waiting reader, in fractions of one core).
Our broadcaster runs ``broadcast_`` (the in-place hot-loop form). Needs only torch and numpy; no network.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from typing import Any

from tensorwire.bench._common import summarize, write_result
from tensorwire.bench._ranks import run_ranks

BACKENDS = ("shm", "uds", "gloo", "gloo_obj")
SIZES = (1024, 64 * 1024, 1024 * 1024)
TPS = (2, 4, 8)


def _run(rank: int, world: int, backend: str, sizes: list[int], rounds: list[int], warmup: int, idle_s: float,
         store: str, times: Any, done: Any) -> dict[str, Any]:
    import torch

    torch.set_num_threads(1)
    close = None
    if backend in ("shm", "uds"):
        from tensorwire.tp import CpuTpBroadcaster

        b = CpuTpBroadcaster(rank, world, f"bench-{os.getppid()}-{world}", backend=backend, init_timeout_s=60)
        close = b.close

        def send(t: torch.Tensor) -> None:
            b.broadcast_(t)
    else:
        import torch.distributed as dist

        dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
        close = dist.destroy_process_group
        if backend == "gloo":
            def send(t: torch.Tensor) -> None:
                dist.broadcast(t, src=0)
        else:
            def send(t: torch.Tensor) -> None:
                obj: list[bytes | None] = [t.numpy().tobytes()] if rank == 0 else [None]
                dist.broadcast_object_list(obj, src=0)
                if rank != 0:
                    received = obj[0]
                    assert received is not None, "broadcast_object_list filled every rank's list"
                    t.copy_(torch.frombuffer(bytearray(received), dtype=torch.uint8))
    out: dict[str, Any] = {}
    counter = 0
    try:
        for size, n in zip(sizes, rounds, strict=True):
            t = torch.zeros(size, dtype=torch.uint8)
            lat: list[float] = []
            for i in range(warmup + n):
                counter += 1
                if rank == 0:
                    t[0] = counter % 251
                    t0 = time.perf_counter()
                    send(t)
                    _wait_done(done, world, counter, yield_only=True)
                    if i >= warmup:
                        lat.append(max(times[r] for r in range(1, world)) - t0)
                else:
                    send(t)
                    times[rank] = time.perf_counter()
                    if t[0] != counter % 251:
                        raise RuntimeError(f"rank {rank}: wrong payload in round {counter}")
                    done[rank] = counter
            if rank == 0:
                out[str(size)] = lat
        # Idle phase: readers wait inside one broadcast while rank 0 is silent.
        t = torch.zeros(SIZES[0], dtype=torch.uint8)
        counter += 1
        if rank == 0:
            time.sleep(idle_s)
            send(t)
            _wait_done(done, world, counter, yield_only=False)
        else:
            c0, w0 = time.process_time(), time.perf_counter()
            send(t)
            c1, w1 = time.process_time(), time.perf_counter()
            out["idle_cpu_frac"] = (c1 - c0) / (w1 - w0)
            done[rank] = counter
    finally:
        if close is not None:
            close()
    return out


def _wait_done(done: Any, world: int, counter: int, yield_only: bool, limit_s: float = 60.0) -> None:
    deadline = time.monotonic() + limit_s
    for r in range(1, world):
        while done[r] != counter:
            if yield_only:
                os.sched_yield()
            else:
                time.sleep(0.001)
            if time.monotonic() > deadline:
                raise TimeoutError(f"rank {r} did not report round {counter} within {limit_s:.0f} s")


def run_group(world: int, backend: str, sizes: list[int], rounds: list[int], warmup: int, idle_s: float,
              timeout_s: float) -> list[dict[str, Any]]:
    return run_ranks(world, _run, (backend, sizes, rounds, warmup, idle_s), label=f"{backend} TP{world}",
                     timeout_s=timeout_s, join_s=10.0, tmp_prefix="twb.")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m tensorwire.bench broadcast", description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="fewer rounds and a shorter idle phase")
    ap.add_argument("--tp", default=",".join(map(str, TPS)), help="comma-separated TP sizes")
    ap.add_argument("--sizes", default=",".join(map(str, SIZES)), help="comma-separated payload sizes in bytes")
    ap.add_argument("--backends", default=",".join(BACKENDS), help=f"subset of {','.join(BACKENDS)}")
    ap.add_argument("--rounds", type=int, default=None, help="rounds per size (default 1000, --quick 200)")
    ap.add_argument("--idle-s", type=float, default=None, help="idle phase length (default 3, --quick 1)")
    ap.add_argument("--out", default=None, help="JSON path (default benchmarks/results/broadcast-<machine>.json)")
    args = ap.parse_args(argv)
    tps = [int(x) for x in args.tp.split(",") if x]
    sizes = [int(x) for x in args.sizes.split(",") if x]
    backends = [x for x in args.backends.split(",") if x]
    for b in backends:
        if b not in BACKENDS:
            ap.error(f"unknown backend {b!r}")
    base_rounds = args.rounds or (200 if args.quick else 1000)
    idle_s = args.idle_s if args.idle_s is not None else (1.0 if args.quick else 3.0)
    warmup = 20
    from tensorwire.tp import shm_available

    if "shm" in backends and not shm_available():
        print("shm backend unavailable on this machine; skipping it", file=sys.stderr)
        backends.remove("shm")

    rows: list[dict[str, Any]] = []
    idle: list[dict[str, Any]] = []
    t_start = time.monotonic()
    load_start = os.getloadavg()  # other jobs on the machine skew latency; record them next to the numbers
    for tp in tps:
        for backend in backends:
            # 1 MiB rounds are slower on the allocating transports; cap them to keep the run short.
            rounds = [base_rounds if s <= 64 * 1024 else max(20, base_rounds // 4) for s in sizes]
            t0 = time.monotonic()
            try:
                res = run_group(tp, backend, sizes, rounds, warmup, idle_s, timeout_s=600)
            except (TimeoutError, RuntimeError) as exc:
                print(f"  {backend:8s} TP{tp}: FAILED {exc}", file=sys.stderr)
                rows.append({"backend": backend, "tp": tp, "error": str(exc)})
                continue
            errors = [r["error"] for r in res if "error" in r]
            if errors:
                print(f"  {backend:8s} TP{tp}: FAILED {errors}", file=sys.stderr)
                rows.append({"backend": backend, "tp": tp, "error": "; ".join(errors)})
                continue
            for s in sizes:
                rows.append({"backend": backend, "tp": tp, "size_bytes": s, **summarize(res[0][str(s)])})
            fr = [r["idle_cpu_frac"] for r in res[1:]]
            idle.append({"backend": backend, "tp": tp, "idle_s": idle_s, "reader_cpu_frac_mean": sum(fr) / len(fr),
                         "reader_cpu_frac_max": max(fr)})
            print(f"  {backend:8s} TP{tp}: done in {time.monotonic() - t0:.1f} s", file=sys.stderr)

    def med_us(backend: str, tp: int, s: int) -> float | None:
        for r in rows:
            if r["backend"] == backend and r["tp"] == tp and r.get("size_bytes") == s and "median_ms" in r:
                return float(r["median_ms"]) * 1e3
        return None

    def p99_us(backend: str, tp: int, s: int) -> float | None:
        for r in rows:
            if r["backend"] == backend and r["tp"] == tp and r.get("size_bytes") == s and "p99_ms" in r:
                return float(r["p99_ms"]) * 1e3
        return None

    print(f"\nlatency to the last reader, median / p99 in us ({os.cpu_count()} CPUs)")
    print(f"{'size':>8s} {'TP':>3s} " + " ".join(f"{b:>17s}" for b in backends) + "   gloo/shm  gloo/uds")
    ratios: list[dict[str, Any]] = []
    for s in sizes:
        for tp in tps:
            cells = []
            for b in backends:
                m, p = med_us(b, tp, s), p99_us(b, tp, s)
                cells.append(f"{m:8.1f} /{p:7.1f}" if m is not None and p is not None else f"{'-':>17s}")
            g, sh, ud = med_us("gloo", tp, s), med_us("shm", tp, s), med_us("uds", tp, s)
            r1 = g / sh if g and sh else None
            r2 = g / ud if g and ud else None
            ratios.append({"tp": tp, "size_bytes": s, "gloo_over_shm": r1, "gloo_over_uds": r2})
            print(f"{s:8d} {tp:3d} " + " ".join(cells) + f"   {r1 or 0:8.1f}x {r2 or 0:8.1f}x")

    def ratio_at(key: str, tp: int, s: int) -> float | None:
        return next((r[key] for r in ratios if r["tp"] == tp and r["size_bytes"] == s), None)

    print("\nidle reader CPU (fraction of one core while waiting)")
    for d in idle:
        print(f"  {d['backend']:8s} TP{d['tp']}: mean {d['reader_cpu_frac_mean']:.3f}  "
              f"max {d['reader_cpu_frac_max']:.3f}")
    targets = {
        "shm_1KiB_tp8_median_us<=10": med_us("shm", 8, 1024),
        "uds_1KiB_tp8_median_us<=40": med_us("uds", 8, 1024),
        "gloo_over_shm_1KiB_tp8>=5": ratio_at("gloo_over_shm", 8, 1024),
        "gloo_over_uds_1KiB_tp8>=5": ratio_at("gloo_over_uds", 8, 1024),
        "idle_reader_cpu_frac_max<0.05": {f"{d['backend']}_tp{d['tp']}": d["reader_cpu_frac_max"] for d in idle},
    }
    path = write_result("broadcast", {
        "config": {"tp": tps, "sizes": sizes, "backends": backends, "rounds": base_rounds, "warmup": warmup,
                   "idle_s": idle_s, "quick": args.quick, "api": "CpuTpBroadcaster.broadcast_ (in place)",
                   "wall_s": round(time.monotonic() - t_start, 1), "loadavg_start": load_start,
                   "loadavg_end": os.getloadavg()},
        "results": rows, "ratios": ratios, "idle_cpu": idle, "targets": targets,
    }, args.out)
    print(f"\nwrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
