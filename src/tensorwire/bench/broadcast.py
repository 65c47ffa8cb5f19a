"""Benchmark: latency to the last reader of a rank-0 broadcast, tensorwire (shm, uds) against vLLM's MessageQueue.

``python -m tensorwire.bench broadcast [--quick] [--tp 2,4,8] [--backends shm,uds,gloo,gloo_obj,vllm]``.
For each TP size, each backend runs in its own group of spawned processes (``_bcast_backends``: ``shm``/``uds`` are
``CpuTpBroadcaster``, ``gloo`` is ``dist.broadcast``, ``gloo_obj`` is ``broadcast_object_list``, ``vllm`` is vLLM's
shared-memory ``MessageQueue`` run from its own file, see ``_vllm_loader``). Cases (``_payloads``): uint8 tensors
(``--sizes``, 1 KiB / 64 KiB / 1 MiB), a dict of tensors, a scheduler-output-like Python object, each back to back
and again with ``--gaps-ms`` (2 ms) between messages.

Latency to the last reader, measured the same way for every backend: rank 0 stamps the round number into the value,
takes ``t0 = perf_counter()`` (CLOCK_MONOTONIC, one clock for all processes) and calls its send (serialization
included: pickling for vLLM and for tensorwire's object path). Each reader takes ``t_r = perf_counter()`` as soon
as its receive call has returned the value (deserialized: a tensor, a dict of tensors or the object), stores it in
a shared array, then checks the whole value against the expected one and reports the round done. The round's
latency is ``max(t_r) - t0``. Rank 0 starts the next round only after every reader has reported (and, in the gap
cases, after sleeping the gap), so messages never overlap: the decode-step pattern of a TP group.

Reader CPU: each reader's process CPU time (``time.process_time``: all its threads) over each case's timed rounds,
as a fraction of one core; then rank 0 stays silent for ``--idle-s`` while the readers wait inside one receive,
and they report the fraction over the whole wait and over its part after the first second (vLLM's readers spin for
1 s after their last message before they sleep on a socket). Writes JSON and a PNG plot (needs matplotlib).
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import statistics
import sys
import threading
import time
from typing import Any

from tensorwire.bench._common import summarize, write_result
from tensorwire.bench._payloads import Case, build, mark, matches, payload_bytes
from tensorwire.bench._tp import backends
from tensorwire.bench._tp.ranks import run_ranks

BACKENDS = backends.NAMES
SIZES = (1024, 64 * 1024, 1024 * 1024)
OBJECTS = ("dict", "sched")
GAPS_MS = (0.0, 2.0)
TPS = (2, 4, 8)
IDLE_SETTLE_S = 1.0


def cases_for(sizes: list[int], objects: list[str], gaps_ms: list[float]) -> list[Case]:
    payloads = [Case("tensor", s) for s in sizes] + [Case(o) for o in objects]
    return [Case(c.kind, c.size_bytes, g) for g in gaps_ms for c in payloads]


def rounds_for(case: Case, base: int) -> int:
    # 1 MiB rounds are slower on the allocating transports and gap rounds take >= the gap: fewer of them.
    return max(20, base // 4) if case.size_bytes > 64 * 1024 or case.gap_ms else base


def _run(
    rank: int,
    world: int,
    backend: str,
    cases: list[Case],
    rounds: list[int],
    warmup: int,
    idle_s: float,
    opts: backends.Options,
    store: str,
    times: Any,
    done: Any,
) -> dict[str, Any]:
    import torch

    torch.set_num_threads(1)
    if opts.pin:
        os.sched_setaffinity(0, {opts.pin[rank]})
    ep = backends.make(backend, rank, world, store, opts)
    out: dict[str, Any] = {"lat": {}, "cpu": {}}
    counter = 0
    try:
        for case, n in zip(cases, rounds, strict=True):
            value = build(case)
            expected = build(case) if rank else None
            lat: list[float] = []
            c0 = w0 = 0.0
            for i in range(warmup + n):
                counter += 1
                if i == warmup:
                    c0, w0 = time.process_time(), time.perf_counter()
                if rank == 0:
                    if case.gap_ms:
                        time.sleep(case.gap_ms / 1e3)
                    mark(case, value, counter)
                    t0 = time.perf_counter()
                    ep.send(case.kind, value)
                    _wait_done(done, world, counter, yield_only=True)
                    if i >= warmup:
                        lat.append(max(times[r] for r in range(1, world)) - t0)
                else:
                    got = ep.send(case.kind, value)
                    times[rank] = time.perf_counter()
                    mark(case, expected, counter)
                    if not matches(case, got, expected):
                        raise RuntimeError(f"rank {rank}: wrong {case.name} payload in round {counter}")
                    done[rank] = counter
            if rank == 0:
                out["lat"][case.name] = lat
            else:
                out["cpu"][case.name] = (time.process_time() - c0) / (time.perf_counter() - w0)
        # Idle phase: readers wait inside one receive while rank 0 is silent.
        idle = Case("tensor", SIZES[0])
        value = build(idle)
        counter += 1
        if rank == 0:
            time.sleep(idle_s)
            mark(idle, value, counter)
            ep.send("tensor", value)
            _wait_done(done, world, counter, yield_only=False)
        else:
            settled: list[tuple[float, float]] = []
            timer = threading.Timer(IDLE_SETTLE_S, lambda: settled.append((time.process_time(), time.perf_counter())))
            c0, w0 = time.process_time(), time.perf_counter()
            timer.start()
            ep.send("tensor", value)
            c1, w1 = time.process_time(), time.perf_counter()
            timer.cancel()
            out["idle_cpu_frac"] = (c1 - c0) / (w1 - w0)
            if settled and w1 - settled[0][1] > 0.1:
                out["idle_cpu_frac_after_settle"] = (c1 - settled[0][0]) / (w1 - settled[0][1])
            done[rank] = counter
    finally:
        ep.close()
    return out


def pin_plan(world: int) -> tuple[int, ...] | None:
    """CPUs for ranks 0..world-1 (``--pin``): one hardware thread of each physical core first, then their
    siblings, so a spinning reader never shares a core with rank 0 while there are cores to spare; None when this
    process may use fewer CPUs than ``world``."""
    cpus = sorted(os.sched_getaffinity(0))
    if len(cpus) < world:
        return None

    def core(cpu: int) -> tuple[str, str]:
        topo = f"/sys/devices/system/cpu/cpu{cpu}/topology"
        try:
            with open(f"{topo}/physical_package_id") as pkg, open(f"{topo}/core_id") as cid:
                return pkg.read().strip(), cid.read().strip()
        except OSError:
            return "", str(cpu)  # no topology: every CPU its own core

    nth: dict[tuple[str, str], int] = {}  # hardware threads of each core seen so far
    order = []
    for cpu in cpus:
        k = core(cpu)
        order.append((nth.get(k, 0), cpu))  # (which thread of its core, cpu): first threads sort first
        nth[k] = nth.get(k, 0) + 1
    return tuple(cpu for _, cpu in sorted(order)[:world])


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


def run_group(
    world: int,
    backend: str,
    cases: list[Case],
    rounds: list[int],
    warmup: int,
    idle_s: float,
    timeout_s: float,
    opts: backends.Options | None = None,
) -> list[dict[str, Any]]:
    return run_ranks(
        world,
        _run,
        (backend, cases, rounds, warmup, idle_s, opts or backends.Options()),
        label=f"{backend} TP{world}",
        timeout_s=timeout_s,
        join_s=10.0,
        tmp_prefix="twb.",
    )


def rows_of(backend: str, tp: int, cases: list[Case], res: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One JSON row per case of one group: rank 0's latency summary and the readers' CPU."""
    rows = []
    for case in cases:
        if case.name not in res[0]["lat"]:
            continue
        cpu = [r["cpu"][case.name] for r in res[1:]]
        rows.append(
            {
                "backend": backend,
                "tp": tp,
                "case": case.name,
                "payload": case.payload,
                "kind": case.kind,
                "gap_ms": case.gap_ms,
                **({"size_bytes": case.size_bytes} if case.kind == "tensor" else {}),
                **summarize(res[0]["lat"][case.name]),
                "reader_cpu_frac_mean": sum(cpu) / len(cpu),
                "reader_cpu_frac_max": max(cpu),
            }
        )
    return rows


def combine_runs(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """``--repeat``: one row per backend, TP and case from its runs' rows (each a separate process group): the
    median of their medians and of their p99s, every run's median kept (``runs_median_ms``), rounds summed, the
    readers' CPU at its worst. Placement luck (which CPUs, and on a VM which host cores, a group gets) moves one
    group's median by tens of percent; the median over interleaved groups does not hang on one draw."""
    groups: dict[tuple[Any, Any, Any], list[dict[str, Any]]] = {}
    for r in rows:
        groups.setdefault((r["backend"], r["tp"], r.get("case")), []).append(r)
    out = []
    for runs in groups.values():
        ok = [r for r in runs if "median_ms" in r]
        if not ok:
            out.append(runs[0])
            continue
        row = {k: v for k, v in ok[0].items() if k not in ("rep", "mean_ms", "sd_ms")}
        row.update(
            n=sum(r["n"] for r in ok),
            median_ms=statistics.median(r["median_ms"] for r in ok),
            p99_ms=statistics.median(r["p99_ms"] for r in ok),
            min_ms=min(r["min_ms"] for r in ok),
            max_ms=max(r["max_ms"] for r in ok),
            runs=len(ok),
            runs_median_ms=[r["median_ms"] for r in ok],
            reader_cpu_frac_mean=statistics.fmean(r["reader_cpu_frac_mean"] for r in ok),
            reader_cpu_frac_max=max(r["reader_cpu_frac_max"] for r in ok),
        )
        out.append(row)
    return out


def ratios_of(rows: list[dict[str, Any]], cases: list[Case], tps: list[int]) -> list[dict[str, Any]]:
    """Per case and TP: tensorwire over vLLM (shm, uds) and gloo over tensorwire, median over median; None where
    a backend did not run."""
    med = {(r["backend"], r["tp"], r["case"]): r["median_ms"] for r in rows if "median_ms" in r}

    def ratio(a: str, b: str, tp: int, case: str) -> float | None:
        x, y = med.get((a, tp, case)), med.get((b, tp, case))
        return x / y if x is not None and y else None

    return [
        {
            "case": c.name,
            "tp": tp,
            "shm_over_vllm": ratio("shm", "vllm", tp, c.name),
            "uds_over_vllm": ratio("uds", "vllm", tp, c.name),
            "gloo_over_shm": ratio("gloo", "shm", tp, c.name),
            "gloo_over_uds": ratio("gloo", "uds", tp, c.name),
            "shm_pickle_over_vllm": ratio("shm_pickle", "vllm", tp, c.name),
        }
        for c in cases
        for tp in tps
    ]


def _csv(text: str, kind: type = str) -> list[Any]:
    return [kind(x) for x in text.split(",") if x]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m tensorwire.bench broadcast", description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="fewer rounds and a shorter idle phase")
    ap.add_argument("--tp", default=",".join(map(str, TPS)), help="comma-separated TP sizes")
    ap.add_argument("--sizes", default=",".join(map(str, SIZES)), help="tensor cases: comma-separated bytes")
    ap.add_argument("--objects", default=",".join(OBJECTS), help="other cases: dict, sched ('' for none)")
    ap.add_argument(
        "--gaps-ms",
        default=",".join(f"{g:g}" for g in GAPS_MS),
        help="message gaps to run every case at, ms (0: back to back)",
    )
    ap.add_argument(
        "--backends",
        default=None,
        help=f"subset of {','.join(BACKENDS)} (default all; vllm is skipped when it cannot be loaded)",
    )
    ap.add_argument(
        "--tensor-api",
        choices=("inplace", "fresh"),
        default="inplace",
        help="tensorwire's tensor cases: broadcast_ into the reader's tensor, or broadcast (new tensors)",
    )
    ap.add_argument(
        "--repeat",
        type=int,
        default=1,
        help="run every backend's group this many times, interleaved (A B A B ...), and report the "
        "median over the groups' medians (each run's median is kept in the JSON)",
    )
    ap.add_argument(
        "--pin",
        action="store_true",
        help="pin rank i of every group to the same CPU (one per physical core first), so the CPUs a "
        "backend's processes land on are not a variable between backends",
    )
    ap.add_argument(
        "--object-codec",
        choices=("typed", "pickle"),
        default="typed",
        help="tensorwire's sched case: broadcast_object(obj, schema=SchedulerStep) (msgspec) or without "
        "a schema (pickle); the shm_pickle backend always pickles",
    )
    ap.add_argument(
        "--vllm-shm-broadcast",
        default=os.environ.get("TENSORWIRE_BENCH_VLLM_SHM_BROADCAST"),
        metavar="PATH",
        help="vLLM's shm_broadcast.py or a vllm wheel holding it (default: an installed "
        "vllm, else .whl/*shm_broadcast*.py, else .whl/vllm*.whl; $TENSORWIRE_BENCH_VLLM_SHM_BROADCAST)",
    )
    ap.add_argument(
        "--rounds",
        type=int,
        default=None,
        help="rounds per case (default 1000, --quick 200; 1 MiB and gap cases a quarter)",
    )
    ap.add_argument("--warmup", type=int, default=20, help="untimed rounds before each case")
    ap.add_argument("--idle-s", type=float, default=None, help="idle phase length (default 3, --quick 2)")
    ap.add_argument("--out", default=None, help="JSON path (default benchmarks/results/broadcast-<machine>.json)")
    ap.add_argument("--plot", default=None, help="PNG path (default: the JSON path with .png)")
    ap.add_argument("--replot", default=None, metavar="JSON", help="only redraw the plot of an existing result")
    args = ap.parse_args(argv)
    if args.replot:
        from tensorwire.bench._plot import plot_broadcast_file

        return 0 if plot_broadcast_file(args.replot, args.plot) else 1
    tps = _csv(args.tp, int)
    cases = cases_for(_csv(args.sizes, int), _csv(args.objects), _csv(args.gaps_ms, float))
    for c in cases:
        if c.kind not in ("tensor", *OBJECTS):
            ap.error(f"unknown case {c.kind!r} in --objects; expected {','.join(OBJECTS)}")
    chosen = _csv(args.backends) if args.backends is not None else list(BACKENDS)
    for b in chosen:
        if b not in BACKENDS and b not in backends.SHM_VARIANTS:
            ap.error(f"unknown backend {b!r}; expected some of {','.join(BACKENDS + tuple(backends.SHM_VARIANTS))}")
    if args.object_codec == "typed" and "sched" in [c.kind for c in cases]:
        try:
            import msgspec  # noqa: F401 - only whether it is there
        except ImportError:
            ap.error(
                "the sched case's typed codec needs msgspec (pip install 'tensorwire[typed]'); or pass "
                "--object-codec pickle"
            )
    if args.repeat < 1:
        ap.error("--repeat must be at least 1")
    base_rounds = args.rounds or (200 if args.quick else 1000)
    idle_s = args.idle_s if args.idle_s is not None else (2.0 if args.quick else 3.0)
    from tensorwire.tp import BroadcastConfig, shm_available

    for b in [b for b in chosen if b == "shm" or b in backends.SHM_VARIANTS]:
        if not shm_available():
            print(f"{b} backend unavailable on this machine (no shm fence); skipping it", file=sys.stderr)
            chosen.remove(b)
    tp_config = dataclasses.asdict(BroadcastConfig.from_env())
    print(
        "tensorwire BroadcastConfig (from the environment): "
        + ", ".join(f"{k}={tp_config[k]}" for k in ("spin_s", "spin_max_s", "spin_gap_factor", "futex", "wait_poll_s")),
        file=sys.stderr,
    )
    vllm_info, opts = _vllm_setup(chosen, args)
    if vllm_info.get("reason") and args.backends is not None:
        print(f"vllm: {vllm_info['reason']}", file=sys.stderr)
        return 2  # asked for by name: not running it is an error, not a skip

    rows: list[dict[str, Any]] = []
    idle: list[dict[str, Any]] = []
    t_start = time.monotonic()
    load_start = os.getloadavg()  # other jobs on the machine skew latency; record them next to the numbers
    for rep, tp, backend in [(k, tp, b) for k in range(args.repeat) for tp in tps for b in chosen]:
        mine = [c for c in cases if c.kind in backends.kinds_of(backend)]
        t0 = time.monotonic()
        pin = pin_plan(tp) if args.pin else None
        if args.pin and pin is None:
            print(f"  --pin: fewer CPUs than TP{tp} ranks; not pinning", file=sys.stderr)
        try:
            res = run_group(
                tp,
                backend,
                mine,
                [rounds_for(c, base_rounds) for c in mine],
                args.warmup,
                idle_s,
                timeout_s=600,
                opts=dataclasses.replace(opts, pin=pin),
            )
        except (TimeoutError, RuntimeError) as exc:
            print(f"  {backend:8s} TP{tp}: FAILED {exc}", file=sys.stderr)
            rows.append({"backend": backend, "tp": tp, "rep": rep, "error": str(exc)})
            continue
        rows.extend({**r, "rep": rep} for r in rows_of(backend, tp, mine, res))
        fr = [r["idle_cpu_frac"] for r in res[1:]]
        settled = [r["idle_cpu_frac_after_settle"] for r in res[1:] if "idle_cpu_frac_after_settle" in r]
        idle.append(
            {
                "backend": backend,
                "tp": tp,
                "rep": rep,
                "idle_s": idle_s,
                "reader_cpu_frac_mean": sum(fr) / len(fr),
                "reader_cpu_frac_max": max(fr),
                "settle_s": IDLE_SETTLE_S,
                "after_settle_reader_cpu_frac_max": max(settled) if settled else None,
            }
        )
        print(
            f"  {backend:8s} TP{tp}: done in {time.monotonic() - t0:.1f} s"
            + (f" (run {rep + 1} of {args.repeat})" if args.repeat > 1 else ""),
            file=sys.stderr,
        )

    per_run = rows
    rows = combine_runs(per_run) if args.repeat > 1 else [{k: v for k, v in r.items() if k != "rep"} for r in rows]
    ratios = ratios_of(rows, cases, tps)
    _print_tables(rows, ratios, idle, cases, tps, chosen)
    targets = _targets(rows, ratios, idle)
    path = write_result(
        "broadcast",
        {
            "config": {
                "tp": tps,
                "cases": [c.name for c in cases],
                "backends": chosen,
                "rounds": base_rounds,
                "warmup": args.warmup,
                "idle_s": idle_s,
                "quick": args.quick,
                "tensor_api": args.tensor_api,
                "object_codec": args.object_codec,
                "pin": {tp: pin_plan(tp) for tp in tps} if args.pin else None,
                "api": "CpuTpBroadcaster.broadcast_ (in place)"
                if args.tensor_api == "inplace"
                else "CpuTpBroadcaster.broadcast (new tensors)",
                "tp_config": tp_config,
                "shm_variants": {b: backends.SHM_VARIANTS[b] for b in chosen if b in backends.SHM_VARIANTS},
                "vllm_mq": {"max_chunk_bytes": opts.vllm_chunk_bytes, "max_chunks": opts.vllm_chunks},
                "payload_bytes": {c.payload: payload_bytes(c) for c in cases},
                "latency": "max over readers of (perf_counter after the receive returned the value) - "
                "(perf_counter before rank 0's send); rounds never overlap",
                "wall_s": round(time.monotonic() - t_start, 1),
                "loadavg_start": load_start,
                "loadavg_end": os.getloadavg(),
            },
            "vllm": vllm_info,
            "results": rows,
            "ratios": ratios,
            "idle_cpu": idle,
            "targets": targets,
            **({"repeat": args.repeat, "results_per_run": per_run} if args.repeat > 1 else {}),
        },
        args.out,
    )
    print(f"\nwrote {path}")
    from tensorwire.bench._plot import plot_broadcast_file

    plot_broadcast_file(str(path), args.plot)
    return 0


def _vllm_setup(chosen: list[str], args: argparse.Namespace) -> tuple[dict[str, Any], backends.Options]:
    from tensorwire.bench._vllm import loader as _vllm_loader

    opts = backends.Options(tensor_api=args.tensor_api, object_codec=args.object_codec)
    if "vllm" not in chosen:
        return {"available": None, "reason": None, "note": "not requested"}, opts
    try:
        source = _vllm_loader.locate(args.vllm_shm_broadcast)
        _, info = _vllm_loader.load(source)  # here first: a broken file fails before any group starts
    except _vllm_loader.VllmUnavailable as exc:
        print(f"vllm backend skipped: {exc.reason}", file=sys.stderr)
        chosen.remove("vllm")
        return {"available": False, "reason": exc.reason}, opts
    print(
        f"vllm backend: {info['source']} (version {info['version']}, sha256 {info['sha256'][:12]}, "
        f"{'stand-ins for ' + str(len(info['shims'])) + ' vllm modules' if info['shims'] else 'real vllm'})",
        file=sys.stderr,
    )
    return {"available": True, "reason": None, **info}, dataclasses.replace(opts, vllm_source=source)


def _cell(rows: list[dict[str, Any]], backend: str, tp: int, case: str) -> str:
    for r in rows:
        if r["backend"] == backend and r["tp"] == tp and r.get("case") == case and "median_ms" in r:
            return f"{r['median_ms'] * 1e3:8.1f} /{r['p99_ms'] * 1e3:7.1f}"
    return f"{'-':>17s}"


def _x(v: float | None) -> str:
    return f"{v:8.2f}x" if v is not None else f"{'-':>9s}"


def _print_tables(
    rows: list[dict[str, Any]],
    ratios: list[dict[str, Any]],
    idle: list[dict[str, Any]],
    cases: list[Case],
    tps: list[int],
    chosen: list[str],
) -> None:
    print(f"\nlatency to the last reader, median / p99 in us ({os.cpu_count()} CPUs)")
    print(
        f"{'case':>12s} {'TP':>3s} "
        + " ".join(f"{b:>17s}" for b in chosen)
        + "   shm/vllm  uds/vllm  gloo/shm"
        + ("  shm_pickle/vllm" if "shm_pickle" in chosen else "")
    )
    by = {(r["case"], r["tp"]): r for r in ratios}
    for c in cases:
        for tp in tps:
            r = by[(c.name, tp)]
            print(
                f"{c.name:>12s} {tp:3d} "
                + " ".join(_cell(rows, b, tp, c.name) for b in chosen)
                + f"  {_x(r['shm_over_vllm'])} {_x(r['uds_over_vllm'])} {_x(r['gloo_over_shm'])}"
                + (f"  {_x(r['shm_pickle_over_vllm'])}" if "shm_pickle" in chosen else "")
            )
    print("\nreader CPU while the rounds ran (fraction of one core, max over readers)")
    print(f"{'case':>12s} {'TP':>3s} " + " ".join(f"{b:>9s}" for b in chosen))
    cpu = {(r["backend"], r["tp"], r["case"]): r["reader_cpu_frac_max"] for r in rows if "case" in r}
    for c in cases:
        for tp in tps:
            cells = [cpu.get((b, tp, c.name)) for b in chosen]
            print(f"{c.name:>12s} {tp:3d} " + " ".join(f"{v:9.3f}" if v is not None else f"{'-':>9s}" for v in cells))
    print("\nidle reader CPU (fraction of one core while waiting; after the first second in brackets)")
    for d in idle:
        after = d["after_settle_reader_cpu_frac_max"]
        print(
            f"  {d['backend']:8s} TP{d['tp']}: mean {d['reader_cpu_frac_mean']:.3f}  "
            f"max {d['reader_cpu_frac_max']:.3f}" + (f"  ({after:.3f})" if after is not None else "")
        )


def _targets(rows: list[dict[str, Any]], ratios: list[dict[str, Any]], idle: list[dict[str, Any]]) -> dict[str, Any]:
    def med_us(backend: str, tp: int, case: str) -> float | None:
        for r in rows:
            if r["backend"] == backend and r["tp"] == tp and r.get("case") == case and "median_ms" in r:
                return float(r["median_ms"]) * 1e3
        return None

    def ratio(key: str, tp: int, case: str) -> float | None:
        return next((r[key] for r in ratios if r["tp"] == tp and r["case"] == case), None)

    shm_vllm = [r["shm_over_vllm"] for r in ratios if r["shm_over_vllm"] is not None]
    pickled = [
        (r["shm_pickle_over_vllm"], r["case"], r["tp"])
        for r in ratios
        if r["shm_pickle_over_vllm"] is not None and r["case"].startswith("sched")
    ]
    return {
        "shm_1KiB_tp8_median_us<=10": med_us("shm", 8, "1KiB"),
        "uds_1KiB_tp8_median_us<=40": med_us("uds", 8, "1KiB"),
        "gloo_over_shm_1KiB_tp8>=5": ratio("gloo_over_shm", 8, "1KiB"),
        "gloo_over_uds_1KiB_tp8>=5": ratio("gloo_over_uds", 8, "1KiB"),
        "idle_reader_cpu_frac_max<0.05": {f"{d['backend']}_tp{d['tp']}": d["reader_cpu_frac_max"] for d in idle},
        # Target: every case at most 1.0x vLLM's MessageQueue, idle reader at most 10% of a core.
        "shm_over_vllm_max<=1.0": max(shm_vllm) if shm_vllm else None,
        "shm_over_vllm_worst_case": max(
            ((r["shm_over_vllm"], r["case"], r["tp"]) for r in ratios if r["shm_over_vllm"] is not None), default=None
        ),
        # The object case without a schema (pickle on both sides), reported next to it; not the default path.
        "shm_pickle_over_vllm_sched_worst_case": max(pickled, default=None),
        "idle_reader_cpu_frac_max<=0.10": {
            f"{d['backend']}_tp{d['tp']}": d["reader_cpu_frac_max"]
            for d in idle
            if d["backend"] in ("shm", "uds", "vllm")
        },
    }


if __name__ == "__main__":
    sys.exit(main())
