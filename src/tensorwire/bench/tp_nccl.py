"""Benchmark: ``broadcast_cpu`` inside the node against an NCCL broadcast of the same CPU payload, GPUs busy.

    python -m tensorwire.bench tp_nccl [--tp 2,4,8] [--sizes 1024,65536,1048576] [--rounds 500] [--loads busy,idle]
    python -m tensorwire.bench tp_nccl --dry-run      # gloo + cpu, no busy workload: plumbing check without GPUs

One spawned process per GPU (rank r uses ``cuda:r``; TP sizes above the number of visible GPUs are dropped). The
default process group is NCCL; a gloo group over the same ranks carries ``broadcast_cpu`` (which picks its
node-local CpuTpBroadcaster, shm or uds, for a one-host group). Two methods move the same CPU uint8 payload from
rank 0 to every rank:

* ``broadcast_cpu``: rank 0 calls ``broadcast_cpu(t, group=gloo)``; the others call ``broadcast_cpu(None, ...)``
  and get a fresh CPU tensor.
* ``nccl``: rank 0 stages its pinned CPU tensor with ``t.cuda(non_blocking=True)``, records an event, runs
  ``dist.broadcast`` and waits for that event only (the earliest point at which it may reuse ``t``); the others
  broadcast into ``torch.empty(n, device=cuda:r)`` and copy back with ``.cpu()``, which returns once the NCCL
  kernel and the copy are done (ProcessGroupNCCL makes the current stream wait for the collective).

Method (same as ``tensorwire.bench.broadcast``): rank 0 takes ``t0 = time.perf_counter()`` (CLOCK_MONOTONIC, one
clock for all processes of the host) just before its call; every other rank stores ``perf_counter()`` in a shared
array right after its payload is on the host and checked, then bumps its round counter. Rank 0 waits until every
rank has reported the round; the round's latency is ``max(reader times) - t0``, the latency to the LAST rank. Rounds
run back to back (the next one starts when all have reported), like decode steps; no barrier sits on the timed
path. Per (load, size, method): median and p99 over ``--rounds`` rounds after ``--warmup``.

Load ``busy``: each rank runs a background thread that loops bf16 matmuls (``--busy-dim``) on its own CUDA stream
(batches of 4, then a stream synchronize, which releases the GIL), so NCCL's kernels compete for SMs as they would
beside a model's forward pass; the achieved TFLOP/s per rank is reported to show the GPU was busy. Load ``idle``:
no background work. NVLink multicast settings (NCCL_NVLS_ENABLE and related variables) are left as the machine sets
them. Writes ``benchmarks/results/tp_nccl-<machine>x<gpus>.json``.
"""

from __future__ import annotations

import argparse
import os
import sys
import threading
import time
from collections.abc import Sequence
from typing import Any

from tensorwire.bench._common import RESULTS_DIR, machine_tag, summarize, write_result
from tensorwire.bench._tp.ranks import run_ranks

SIZES = (1024, 64 * 1024, 1024 * 1024)
TPS = (2, 4, 8)
LOADS = ("busy", "idle")
BUSY_BATCH = 4


# -- pure helpers (unit-tested) ---------------------------------------------------------------------------------


def parse_tp(spec: str | None, available: int) -> tuple[list[int], list[int]]:
    """TP sizes to run and the requested ones dropped because fewer than that many GPUs (or cores) are visible.

    Default (``spec`` None): 2, 4, 8 up to ``available``, plus ``available`` itself when it is not one of them.
    """
    if spec is None:
        wanted = [t for t in TPS if t <= available]
        if available >= 2 and available not in wanted:
            wanted.append(available)
        return wanted, []
    wanted = []
    for item in (s.strip() for s in spec.split(",")):
        if not item:
            continue
        if not item.isdigit() or int(item) < 2:
            raise ValueError(f"--tp {spec!r}: each TP size must be an integer >= 2")
        if int(item) not in wanted:
            wanted.append(int(item))
    if not wanted:
        raise ValueError("--tp: no TP sizes given")
    return [t for t in wanted if t <= available], [t for t in wanted if t > available]


def parse_sizes(spec: str) -> list[int]:
    sizes = [int(s) for s in spec.split(",") if s.strip()]
    if not sizes or any(s <= 0 for s in sizes):
        raise ValueError(f"--sizes {spec!r}: expected positive byte counts")
    return sizes


def latency_to_last_rank(t0: float, reader_times: Sequence[float]) -> float:
    """Seconds from rank 0's start to the moment the last reader had the payload."""
    if not reader_times:
        raise ValueError("no reader times (TP size 1 has no readers)")
    return max(reader_times) - t0


def round_marker(counter: int) -> int:
    """The byte rank 0 writes at offset 0 in round ``counter`` (readers check it; never 0 twice in a row)."""
    return counter % 251 + 1


def ratio_rows(rows: list[dict[str, Any]], methods: Sequence[str]) -> list[dict[str, Any]]:
    """For each (load, tp, size): median and p99 of ``methods[1]`` over ``methods[0]`` (e.g. nccl / broadcast_cpu)."""
    base, other = methods[0], methods[1]
    index = {(r["load"], r["tp"], r["size_bytes"], r["method"]): r for r in rows if "median_ms" in r}
    out = []
    for (load, tp, size, method), r in index.items():
        if method != base or (load, tp, size, other) not in index:
            continue
        o = index[(load, tp, size, other)]
        out.append(
            {
                "load": load,
                "tp": tp,
                "size_bytes": size,
                "ratio": f"{other}/{base}",
                "median": o["median_ms"] / r["median_ms"] if r["median_ms"] > 0 else None,
                "p99": o["p99_ms"] / r["p99_ms"] if r["p99_ms"] > 0 else None,
            }
        )
    return sorted(out, key=lambda x: (x["load"], x["size_bytes"], x["tp"]))


# -- ranks ------------------------------------------------------------------------------------------------------


class _Busy:
    """Background matmuls on a side stream of one GPU; start()/stop() may be called once each per phase."""

    def __init__(self, device: Any, dim: int) -> None:
        import torch

        self.device = device
        self.dim = dim
        self.a = torch.randn(dim, dim, device=device, dtype=torch.bfloat16)
        self.b = torch.randn(dim, dim, device=device, dtype=torch.bfloat16)
        self.c = torch.empty(dim, dim, device=device, dtype=torch.bfloat16)
        self.stream = torch.cuda.Stream(device)  # type: ignore[no-untyped-call]  # torch: unannotated
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.count = 0
        self.elapsed_s = 0.0
        self.error: str | None = None

    def _loop(self) -> None:
        import torch

        try:
            # Current device and stream are per thread in torch: set both here.
            with torch.cuda.device(self.device), torch.cuda.stream(self.stream):
                t0 = time.perf_counter()
                while not self._stop.is_set():
                    for _ in range(BUSY_BATCH):
                        torch.mm(self.a, self.b, out=self.c)
                    self.stream.synchronize()  # bounded launch queue; the wait releases the GIL
                    self.count += BUSY_BATCH
                self.elapsed_s += time.perf_counter() - t0
        except BaseException as exc:
            self.error = f"{type(exc).__name__}: {exc}"

    def start(self) -> None:
        self._stop.clear()
        self._thread = threading.Thread(target=self._loop, name="tp-nccl-busy", daemon=True)
        self._thread.start()
        time.sleep(0.2)  # let the stream fill before the first timed round

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=30)
            self._thread = None

    def stats(self) -> dict[str, Any]:
        flops = 2.0 * self.dim**3 * self.count
        return {
            "matmuls": self.count,
            "busy_s": self.elapsed_s,
            "dim": self.dim,
            "tflops": flops / self.elapsed_s / 1e12 if self.elapsed_s > 0 else 0.0,
            "error": self.error,
        }


def _wait_all(done: Any, world: int, counter: int, limit_s: float) -> None:
    deadline = time.monotonic() + limit_s
    for r in range(1, world):
        while done[r] != counter:
            os.sched_yield()
            if time.monotonic() > deadline:
                raise TimeoutError(f"rank {r} did not report round {counter} within {limit_s:.0f} s")


def _run(rank: int, world: int, cfg: dict[str, Any], store: str, times: Any, done: Any) -> dict[str, Any]:
    import torch
    import torch.distributed as dist

    from tensorwire.tp import broadcast_cpu, shutdown_broadcast_cpu

    torch.set_num_threads(1)
    dry = bool(cfg["dry_run"])
    device = None if dry else torch.device("cuda", rank)
    if device is not None:
        torch.cuda.set_device(device)  # one process per GPU: NCCL needs the rank's device current
    dist.init_process_group("gloo" if dry else "nccl", init_method=f"file://{store}", rank=rank, world_size=world)
    cpu_group = dist.new_group(backend="gloo")
    busy = _Busy(device, cfg["busy_dim"]) if device is not None and "busy" in cfg["loads"] else None
    staged = cfg["methods"][1]

    def bc_cpu(t: torch.Tensor | None) -> torch.Tensor:
        out: torch.Tensor = broadcast_cpu(t, group=cpu_group)  # a tensor in, a tensor out
        return out

    def bc_staged(t: torch.Tensor | None, n: int) -> torch.Tensor:
        if device is None:  # dry run: gloo broadcast of the CPU tensor itself
            buf = t if t is not None else torch.empty(n, dtype=torch.uint8)
            dist.broadcast(buf, src=0)
            return buf
        if t is not None:
            g = t.cuda(non_blocking=True)
            copied = torch.cuda.Event()  # type: ignore[no-untyped-call]  # torch: unannotated
            copied.record()
            dist.broadcast(g, src=0)
            copied.synchronize()  # t may be reused once the staging copy has read it
            return t
        g = torch.empty(n, dtype=torch.uint8, device=device)
        dist.broadcast(g, src=0)
        return g.cpu()  # synchronous: waits for the collective (stream dependency) and the copy

    methods = {cfg["methods"][0]: lambda t, n: bc_cpu(t), staged: bc_staged}
    out: dict[str, Any] = {"rows": {}, "busy": {}}
    counter = 0
    try:
        for load in cfg["loads"]:
            if load == "busy" and busy is not None:
                busy.start()
            try:
                for size in cfg["sizes"]:
                    t = torch.zeros(size, dtype=torch.uint8)
                    if device is not None:
                        t = t.pin_memory()
                    for name, fn in methods.items():
                        lat: list[float] = []
                        for i in range(cfg["warmup"] + cfg["rounds"]):
                            counter += 1
                            mark = round_marker(counter)
                            if rank == 0:
                                t[0] = mark
                                t0 = time.perf_counter()
                                fn(t, size)
                                _wait_all(done, world, counter, cfg["round_limit_s"])
                                if i >= cfg["warmup"]:
                                    lat.append(latency_to_last_rank(t0, [times[r] for r in range(1, world)]))
                            else:
                                got = fn(None, size)
                                times[rank] = time.perf_counter()
                                if got.numel() != size or int(got[0]) != mark:
                                    raise RuntimeError(f"rank {rank}: wrong payload in round {counter} ({name})")
                                done[rank] = counter
                        if rank == 0:
                            out["rows"][f"{load}|{size}|{name}"] = lat
            finally:
                if load == "busy" and busy is not None:
                    busy.stop()
                    out["busy"] = busy.stats()
    finally:
        shutdown_broadcast_cpu()
        dist.destroy_process_group()
    return out


def run_group(world: int, cfg: dict[str, Any], timeout_s: float) -> list[dict[str, Any]]:
    return run_ranks(world, _run, (cfg,), label=f"TP{world}", timeout_s=timeout_s, join_s=15.0, tmp_prefix="twnccl.")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m tensorwire.bench tp_nccl", description=__doc__.split("\n\n")[0])
    ap.add_argument("--tp", default=None, help="comma-separated TP sizes (default 2,4,8 up to the GPU count)")
    ap.add_argument("--sizes", default=",".join(map(str, SIZES)), help="payload sizes in bytes")
    ap.add_argument(
        "--rounds", type=int, default=None, help="timed rounds per load/size/method (default 500; --dry-run 30)"
    )
    ap.add_argument("--warmup", type=int, default=20)
    ap.add_argument("--loads", default=",".join(LOADS), help="busy and/or idle (--dry-run: idle only)")
    ap.add_argument("--busy-dim", type=int, default=8192, help="square bf16 matmul size of the busy workload")
    ap.add_argument("--timeout-s", type=float, default=300.0, help="limit per TP group")
    ap.add_argument("--dry-run", action="store_true", help="gloo + cpu for both methods, no busy workload")
    ap.add_argument("--out", default=None, help="JSON path (default benchmarks/results/tp_nccl-<machine>x<N>.json)")
    args = ap.parse_args(argv)
    try:
        sizes = parse_sizes(args.sizes)
    except ValueError as exc:
        ap.error(str(exc))
    loads = [x for x in args.loads.split(",") if x]
    if not loads or any(x not in LOADS for x in loads):
        ap.error(f"--loads must be a subset of {','.join(LOADS)}")
    if args.dry_run:
        loads = ["idle"]
    rounds = args.rounds if args.rounds is not None else (30 if args.dry_run else 500)
    if rounds < 1 or args.warmup < 0:
        ap.error("--rounds must be >= 1 and --warmup >= 0")

    import torch

    n_gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    available = min(os.cpu_count() or 2, 8) if args.dry_run else n_gpus
    if not args.dry_run and n_gpus < 2:
        print(
            f"tp_nccl: needs at least 2 CUDA devices, found {n_gpus}; nothing measured "
            f"(use --dry-run to check the plumbing with gloo on cpu)"
        )
        return 0
    try:
        tps, dropped = parse_tp(args.tp if args.tp is not None or not args.dry_run else "2", max(available, 2))
    except ValueError as exc:
        ap.error(str(exc))
    if dropped:
        print(f"tp_nccl: skipping TP {dropped}: only {available} {'cores' if args.dry_run else 'GPUs'} visible")
    methods = ["broadcast_cpu", "gloo" if args.dry_run else "nccl"]
    cfg = {
        "dry_run": args.dry_run,
        "sizes": sizes,
        "rounds": rounds,
        "warmup": args.warmup,
        "loads": loads,
        "busy_dim": args.busy_dim,
        "methods": methods,
        "round_limit_s": 60.0,
    }
    rows: list[dict[str, Any]] = []
    busy: list[dict[str, Any]] = []
    failed = False
    t_start = time.monotonic()
    tag = f"cpu{os.cpu_count()}-dryrun" if args.dry_run else f"{machine_tag()}x{n_gpus}"
    out_path = args.out or RESULTS_DIR / f"tp_nccl-{tag}.json"

    def save() -> Any:  # after every TP group, so a run cut short still leaves what it measured
        return write_result(
            "tp_nccl",
            {
                "config": {
                    "tp": tps,
                    "tp_dropped": dropped,
                    "sizes": sizes,
                    "rounds": rounds,
                    "warmup": args.warmup,
                    "loads": loads,
                    "busy_dim": args.busy_dim,
                    "busy_batch": BUSY_BATCH,
                    "methods": methods,
                    "dry_run": args.dry_run,
                    "n_gpus": n_gpus,
                    "wall_s": round(time.monotonic() - t_start, 1),
                    "env": {k: v for k, v in os.environ.items() if k.startswith(("NCCL_", "TENSORWIRE_", "CUDA_VIS"))},
                },
                "method": "rank 0 perf_counter before its call; each reader's perf_counter after its payload is on the "
                "host and checked, in a shared array; latency = max(reader times) - t0 (to the last rank); "
                "rounds back to back, rank 0 waits for every reader's round counter; no barrier on the timed "
                "path",
                "results": rows,
                "ratios": ratio_rows(rows, methods),
                "busy": busy,
            },
            out_path,
        )

    for tp in tps:
        t0 = time.monotonic()
        try:
            res = run_group(tp, cfg, args.timeout_s)
        except (RuntimeError, TimeoutError) as exc:
            print(f"TP{tp}: FAILED {exc}", file=sys.stderr)
            rows.append({"tp": tp, "error": str(exc)})
            failed = True
            save()
            continue
        for key, lat in res[0]["rows"].items():
            load, size, method = key.split("|")
            rows.append({"load": load, "tp": tp, "size_bytes": int(size), "method": method, **summarize(lat)})
        busy.extend({"tp": tp, "rank": r, **x["busy"]} for r, x in enumerate(res) if x.get("busy"))
        print(f"TP{tp}: done in {time.monotonic() - t0:.1f} s", file=sys.stderr, flush=True)
        save()
    ratios = ratio_rows(rows, methods)
    print(f"\nlatency to the last rank, median / p99 in us ({n_gpus} GPUs, {os.cpu_count()} CPUs)")
    print(
        f"{'load':>5s} {'size':>8s} {'TP':>3s} "
        + " ".join(f"{m:>19s}" for m in methods)
        + f"   {methods[1]}/{methods[0]} median  p99"
    )
    for rt in ratios:
        cells = []
        for m in methods:
            r = next(
                x
                for x in rows
                if x.get("method") == m
                and x["tp"] == rt["tp"]
                and x["size_bytes"] == rt["size_bytes"]
                and x["load"] == rt["load"]
            )
            cells.append(f"{r['median_ms'] * 1e3:9.1f} /{r['p99_ms'] * 1e3:8.1f}")
        print(
            f"{rt['load']:>5s} {rt['size_bytes']:8d} {rt['tp']:3d} "
            + " ".join(cells)
            + f"   {rt['median'] or 0:12.2f}x {rt['p99'] or 0:5.2f}x"
        )
    for b in busy:
        print(
            f"busy workload TP{b['tp']} rank {b['rank']}: {b['tflops']:.0f} TFLOP/s bf16 over {b['busy_s']:.1f} s"
            + (f"  ERROR {b['error']}" if b.get("error") else "")
        )
    path = save()
    print(f"wrote {path}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
