"""The engine benchmark's driver: instances, interleaved requests, the timestamps joined, stats, JSON."""

from __future__ import annotations

import argparse
import io
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import tensorwire
from tensorwire.bench._common import write_result
from tensorwire.bench.vllm_engine.procs import (
    Instance,
    logging_config,
    metric,
    same,
    schedstat_delta,
    session_schedstat,
    wait_ready,
)

SIZES_MB = {1: 64, 10: 625, 100: 6400}  # image tokens per item; x 4096 float32 = 1.05 / 10.2 / 105 MB
COLS = 4096
TOPOLOGIES = ("uniproc", "mp")
CONNECTORS = ("tensorwire", "file", "mooncake")
CLASSES = {"tensorwire": "TimedTensorwireEC", "file": "TimedExampleEC", "mooncake": "TimedMooncakeEC"}
METRICS = ("handoff", "fetch", "save", "llm_request", "e2e")
# The fetch in three stretches (the LLM instance's timeline): the connector's, vLLM's, the worker's.
FETCH_STAGES = ("until_ready", "to_worker", "worker_load")
# The hand-off less the connector's own time on both sides: what a connector that cost nothing would still take.
OUTSIDE = "outside"
# Generous on a busy 2-core box: a fetch that falls back would encode locally and be counted as failed.
# (A fetch that misses it is counted as failed, so a stuck read costs a round this long, not a whole run.)
CONSUMER_BUDGETS = {"fetch_timeout_ms": 15000, "lookup_timeout_ms": 10000, "release_timeout_ms": 10000}
MOONCAKE_NOT_RUN = (
    "vLLM's ECMooncakeConnector is not wired into this benchmark: it needs mooncake-transfer-engine-non-cuda "
    "(--no-deps) and Debian's libibverbs1/librdmacm1/libnl-3-200/libnl-route-3-200, and on vLLM's V1 runner a "
    "lone request hangs until push_wait_timeout_s (the pushed item is loaded only on a step with a forward pass), "
    "so it must be measured with a second request in flight, which changes the batch beside the measured one; "
    "not done for lack of time, and two more instances did not fit the shared 2-core, 23 GB box (the OOM killer "
    "fired during these runs)"
)
DEFINITIONS = {
    "handoff": "encoder instance's save_caches start -> the item in the LLM instance's encoder cache",
    "fetch": "LLM instance's scheduler first sees the item -> the item in its encoder cache",
    "save": "save_caches on the encoder instance (its duration)",
    "until_ready": "fetch, first stretch: the scheduler's first look -> the connector first answers the item "
    "available (ensure_cache_available True)",
    "to_worker": "fetch, second stretch: available -> the worker's start_load_caches call that loads it begins "
    "(vLLM's scheduling, the step's metadata, the hop to the worker process in the multiprocess topology)",
    "worker_load": "fetch, third stretch: that start_load_caches call -> the item in the encoder cache",
    "outside": "handoff - save - until_ready - worker_load: the hand-off's time outside the connector's code "
    "(the rest of the encoder request, the driver, the LLM instance's intake and scheduling, the hop to the worker)",
    "bound_vs_file": "the file connector's hand-off p50 over its own 'outside' p50: the best file/x hand-off ratio "
    "any connector could reach in this set (one that cost nothing)",
    "llm_request": "the LLM instance's LLM.generate call (the request with the params)",
    "e2e": "the encoder instance's request (max_tokens 1) + the LLM instance's, as the driver saw them",
    "ratios_vs_file": "the file connector's figure over the other's: above 1, that connector is faster",
}
# The multiprocess topology's "staged item could not be dropped" log line (see docs/vllm.md).
DROP_LOG = "dropping"


def _pct(xs: Sequence[float], q: float) -> float:
    s = sorted(xs)
    return s[min(len(s) - 1, int(round(q * (len(s) - 1))))] if s else float("nan")


def stats_of(samples: Sequence[float]) -> dict[str, float]:
    """n, p50, p90, p99, min, max of durations in ms (nearest rank)."""
    if not samples:
        return {"n": 0}
    return {
        "n": len(samples),
        "p50_ms": _pct(samples, 0.5),
        "p90_ms": _pct(samples, 0.9),
        "p99_ms": _pct(samples, 0.99),
        "min_ms": min(samples),
        "max_ms": max(samples),
    }


def load_class(loadavg: dict[str, float], cores: int) -> str:
    """``quiet`` when the 1-minute load average stayed below ``cores + 1`` during a set, else ``busy``."""
    return "quiet" if loadavg["max"] < cores + 1 else "busy"


def load_note(runs: Sequence[dict[str, Any]], cores: int, hog: bool) -> str:
    """The JSON's ``note``: what the box's load did during the sets (each set's ``loadavg_1m``) and the hog."""
    loads = [r["loadavg_1m"] for r in runs if "loadavg_1m" in r]
    if not loads:
        seen = "load not recorded (no set completed)"
    else:
        busy = sum(load_class(x, cores) == "busy" for x in loads)
        lo, hi = min(x["min"] for x in loads), max(x["max"] for x in loads)
        state = "quiet" if busy == 0 else "busy" if busy == len(loads) else f"busy in {busy} of {len(loads)} sets"
        seen = f"{state}: 1-minute load average {lo:.1f}-{hi:.1f} during the sets (quiet: below {cores + 1})"
    beside = "beside a CPU-bound process (--hog: one core spinning)" if hog else "no --hog process"
    return f"{cores}-core CPU, {seen}; {beside}"


def png(seed: int, side: int) -> bytes:
    """A seeded random RGB image, ``side`` pixels square (each seed a distinct image, so a distinct mm_hash)."""
    import numpy as np
    from PIL import Image

    arr = np.random.default_rng(seed).integers(0, 255, (side, side, 3), dtype=np.uint8)
    buf = io.BytesIO()
    Image.fromarray(arr).save(buf, format="PNG")
    return buf.getvalue()


class Events:
    """The timestamp records of one instance (``timed``'s JSON lines in its directory), read as they grow."""

    def __init__(self, directory: Path) -> None:
        self.dir = directory
        self._offsets: dict[Path, int] = {}

    def new(self) -> list[dict[str, Any]]:
        out: list[dict[str, Any]] = []
        for path in sorted(self.dir.glob("*.jsonl")):
            with open(path) as f:
                f.seek(self._offsets.get(path, 0))
                data = f.read()
            complete = data[: data.rfind("\n") + 1]
            self._offsets[path] = self._offsets.get(path, 0) + len(complete)
            out.extend(json.loads(line) for line in complete.splitlines() if line)
        return out


class BenchInstance(Instance):
    """An instance of the benchmark: its connector's timestamps recorded in ``<name>-times`` (``timed``)."""

    def __init__(
        self,
        name: str,
        role: str,
        work: Path,
        model: Path,
        env: dict[str, str],
        *,
        connector: str | None = None,
        extra: dict[str, Any] | None = None,
        max_model_len: int,
    ) -> None:
        self.times = work / f"{name}-times"
        self.times.mkdir()
        args = ["--max-model-len", str(max_model_len)]
        if connector:
            args += ["--connector", CLASSES[connector], "--extra", json.dumps(extra or {})]
        super().__init__(name, role, work, model, dict(env, TW_EC_TIMES_DIR=str(self.times)), args)
        self.events = Events(self.times)


class Pair:
    """A connector's encoder instance and LLM instance, and what one request through them measured."""

    def __init__(self, connector: str, producer: BenchInstance, consumer: BenchInstance, file_dir: Path | None) -> None:
        self.connector = connector
        self.producer = producer
        self.consumer = consumer
        self.file_dir = file_dir
        self.samples: list[dict[str, Any]] = []
        self.last_got: dict[str, Any] = {}
        # --sched: every instance whose processes' CPU time is taken around the LLM request (set by run_set)
        self.watch: list[Instance] = []

    def run(self, image: bytes, prompt: str, max_tokens: int, want: dict[str, Any] | None) -> dict[str, Any]:
        t0 = time.monotonic()
        (prod,) = self.producer.generate([{"images": [image], "prompt": prompt, "max_tokens": 1}])
        params = prod["ec_transfer_params"]
        before = {i.name: session_schedstat(i.proc.pid) for i in self.watch}
        (got,) = self.consumer.generate(
            [{"images": [image], "prompt": prompt, "params": params, "max_tokens": max_tokens}]
        )
        e2e_ms = (time.monotonic() - t0) * 1e3
        sched = {i.name: schedstat_delta(before[i.name], session_schedstat(i.proc.pid)) for i in self.watch}
        self.last_got = got
        saves = [e for e in self.producer.events.new() if e["ev"] == "save"]
        cons_events = self.consumer.events.new()
        sample: dict[str, Any] = {
            "e2e": e2e_ms,
            "llm_request": got["seconds"] * 1e3,
            "producer_request": prod["seconds"] * 1e3,
            "identical": None if want is None else same(got, want),
        }
        if sched:
            sample["sched_during_llm_request"] = sched
        if len(saves) == 1:
            save = saves[0]
            h = save["mm_hash"]
            sample["save"] = (save["t1"] - save["t0"]) / 1e6
            placed = [e for e in cons_events if e["ev"] == "placed" and e["mm_hash"] == h]
            seen = [e for e in cons_events if e["ev"] == "seen" and e["mm_hash"] == h]
            if placed:
                sample["handoff"] = (placed[0]["t"] - save["t0"]) / 1e6
                sample["nbytes"] = placed[0]["nbytes"]
                if seen:
                    sample["fetch"] = (placed[0]["t"] - seen[0]["t"]) / 1e6
                ready = [e for e in cons_events if e["ev"] == "ready" and e["mm_hash"] == h]
                if seen and ready and "t_load" in placed[0]:
                    sample["until_ready"] = (ready[0]["t"] - seen[0]["t"]) / 1e6
                    sample["to_worker"] = (placed[0]["t_load"] - ready[0]["t"]) / 1e6
                    sample["worker_load"] = (placed[0]["t"] - placed[0]["t_load"]) / 1e6
                    own = sample["save"] + sample["until_ready"] + sample["worker_load"]
                    sample[OUTSIDE] = sample["handoff"] - own
            else:
                sample["failed"] = "not placed in the LLM instance's encoder cache (encoded locally?)"
            if self.file_dir is not None:  # vLLM's example connector never deletes its files
                shutil.rmtree(self.file_dir / h, ignore_errors=True)
        else:
            sample["failed"] = f"{len(saves)} save_caches calls on the encoder instance (1 expected)"
        return sample


def _instance_env(topology: str) -> dict[str, str]:
    src = str(Path(tensorwire.__file__).resolve().parents[1])
    env = dict(os.environ)
    env["PYTHONPATH"] = src + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    # Unpinned, one OpenMP thread each: every instance runs the same kernels (bit-identical outputs), and the OS
    # spreads the load over the box's cores (docs/vllm.md "CPU notes").
    env.update(VLLM_CPU_OMP_THREADS_BIND="nobind", OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    env.pop("VLLM_CPU_KVCACHE_SPACE", None)  # the instance sizes its KV cache itself (kv_cache_memory_bytes)
    if topology == "uniproc":
        env["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    else:
        env.pop("VLLM_ENABLE_V1_MULTIPROCESSING", None)
    return env


def _summarize(samples: list[dict[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {m: stats_of([s[m] for s in samples if m in s]) for m in (*METRICS, *FETCH_STAGES, OUTSIDE)}
    out["producer_request"] = stats_of([s["producer_request"] for s in samples if "producer_request" in s])
    out["requests"] = len(samples)
    out["failed"] = sum("failed" in s for s in samples)
    out["mismatches"] = sum(s.get("identical") is False for s in samples)
    out["item_bytes"] = next((s["nbytes"] for s in samples if "nbytes" in s), None)
    return out


def run_set(
    topology: str,
    size_mb: int,
    connectors: Sequence[str],
    rounds: int,
    warmup: int,
    max_tokens: int,
    model: Path,
    work: Path,
    seed0: int,
    settle_s: float = 0.0,
    sched: bool = False,
) -> dict[str, Any]:
    """One topology and one item size: every instance alive at once, requests interleaved; ``settle_s`` is the
    pause before each request (so that other instances' workers, which busy-poll after a step, are idle again);
    ``sched``: each sample also says how long every instance's threads ran and waited for a CPU during the LLM
    request (``sched_during_llm_request``; the /proc walk before it adds 13-20 ms to the hand-off's ``outside``)."""
    from tensorwire.bench.vllm_engine.tiny_llava import PROMPT, side_for_tokens

    tokens = SIZES_MB[size_mb]
    side = side_for_tokens(tokens)
    max_model_len = max(512, tokens + 256)
    work.mkdir(parents=True)
    env = dict(_instance_env(topology), VLLM_LOGGING_CONFIG_PATH=str(logging_config(work)))
    shm = Path(tempfile.mkdtemp(prefix="tw-bench-engine-", dir="/dev/shm"))
    insts: dict[str, BenchInstance] = {}
    pairs: list[Pair] = []
    runtimes: list[Path] = []
    result: dict[str, Any] = {
        "topology": topology,
        "size_mb": size_mb,
        "image_tokens": tokens,
        "item_bytes": tokens * COLS * 4,
        "rounds": rounds,
        "warmup_rounds": warmup,
    }
    t_start = time.monotonic()
    try:
        insts["baseline"] = BenchInstance("baseline", "baseline", work, model, env, max_model_len=max_model_len)
        for c in connectors:
            if c == "tensorwire":
                # The connector's sockets: a 0700 directory of this user, short enough for a unix socket path.
                runtime = Path(tempfile.mkdtemp(prefix="twrt-"))
                runtimes.append(runtime)
                pe: dict[str, Any] = {"runtime_dir": str(runtime)}
                ce: dict[str, Any] = dict(pe, **CONSUMER_BUDGETS)
                file_dir = None
            elif c == "file":
                file_dir = shm / "file"
                pe = ce = {"shared_storage_path": str(file_dir)}
            else:
                raise ValueError(f"connector {c!r} is not supported by this benchmark")
            p = BenchInstance(
                f"{c}-producer", "producer", work, model, env, connector=c, extra=pe, max_model_len=max_model_len
            )
            q = BenchInstance(
                f"{c}-consumer", "consumer", work, model, env, connector=c, extra=ce, max_model_len=max_model_len
            )
            insts[p.name], insts[q.name] = p, q
            pairs.append(Pair(c, p, q, file_dir))
        wait_ready(list(insts.values()), lambda i: i.try_connect())
        for pair in pairs if sched else ():
            pair.watch = list(insts.values())
        result["startup_s"] = round(time.monotonic() - t_start, 1)
        print(f"[{topology} {size_mb} MB] {len(insts)} instances ready in {result['startup_s']} s", flush=True)
        base = insts["baseline"]
        base_samples: list[dict[str, Any]] = []
        order: list[Any] = ["baseline", *pairs]
        loads = []
        for r in range(warmup + rounds):
            measured = r >= warmup
            image = png(seed0 + r, side)
            want = None
            # Rotate who goes first; the baseline's answer is needed for the check, so it runs before the pairs
            # that follow it and the pairs before it are checked once it ran.
            rot = order[r % len(order) :] + order[: r % len(order)]
            pending: list[dict[str, Any]] = []
            for who in rot:
                if settle_s:
                    time.sleep(settle_s)
                if who == "baseline":
                    t0 = time.monotonic()
                    (want,) = base.generate([{"images": [image], "prompt": PROMPT, "max_tokens": max_tokens}])
                    if measured:
                        base_samples.append(
                            {"llm_request": want["seconds"] * 1e3, "e2e": (time.monotonic() - t0) * 1e3}
                        )
                    for s in pending:
                        s["identical"] = same(s.pop("_got"), want)
                    pending = []
                else:
                    s = who.run(image, PROMPT, max_tokens, want)
                    if want is None:
                        s["_got"] = who.last_got
                        pending.append(s)
                    if measured:
                        s["round"] = r - warmup
                        who.samples.append(s)
            loads.append(os.getloadavg()[0])
        result["loadavg_1m"] = {"min": min(loads), "max": max(loads)}
        result["load"] = load_class(result["loadavg_1m"], os.cpu_count() or 1)
        result["baseline"] = {m: stats_of([s[m] for s in base_samples]) for m in ("llm_request", "e2e")}
        result["connectors"] = {p.connector: _summarize(p.samples) for p in pairs}
        result["samples"] = {p.connector: p.samples for p in pairs}
        result["leftovers"] = _leftovers(pairs)
        result["ratios_vs_file"] = _ratios(result)
        result["bound_vs_file"] = _bound(result)
    finally:
        for inst in insts.values():
            inst.stop()
        shutil.rmtree(shm, ignore_errors=True)
        for d in runtimes:
            shutil.rmtree(d, ignore_errors=True)
    result["drop_log_lines"] = {n: i.log_count(DROP_LOG) for n, i in insts.items() if "consumer" in n}
    result["wall_s"] = round(time.monotonic() - t_start, 1)
    return result


def _leftovers(pairs: Sequence[Pair]) -> dict[str, Any]:
    """What is still held when the run is over: tensorwire's leases (its metrics), the file connector's files."""
    out: dict[str, Any] = {}
    for p in pairs:
        if p.connector == "tensorwire":
            deadline = time.monotonic() + 30
            while True:  # releases go out after the fetch answered: give them a moment
                m = p.producer.metrics()
                held = metric(m, "tensorwire_vllm_ec_held_items")
                if held == 0 or time.monotonic() > deadline:
                    break
                time.sleep(0.5)
            c = p.consumer.metrics()
            out["tensorwire"] = {
                "held_items": held,
                "held_bytes": metric(m, "tensorwire_vllm_ec_held_bytes"),
                "delivered": {  # by plane: map (the encoder instance's memfd, same host), rdma (a read), inline
                    k.split("plane=", 1)[1].rstrip("}"): v
                    for k, v in c.items()
                    if k.startswith("tensorwire_vllm_ec_delivered_items_total{")
                },
                "fallbacks": metric(c, "tensorwire_vllm_ec_fallbacks_total"),
                "placed": metric(c, "tensorwire_vllm_ec_placed_items_total"),
                "place_misses": metric(c, "tensorwire_vllm_ec_place_misses_total"),
                "releases": {
                    k.split("{", 1)[1].rstrip("}"): v
                    for k, v in c.items()
                    if k.startswith("tensorwire_vllm_ec_grant_releases_total")
                },
            }
        elif p.connector == "file" and p.file_dir is not None:
            out["file"] = {"files": sum(1 for f in p.file_dir.rglob("*") if f.is_file()) if p.file_dir.exists() else 0}
    return out


def _ratios(result: dict[str, Any]) -> dict[str, Any]:
    """file's figure over each connector's (above 1: that connector is faster), p50 and p99."""
    conns = result["connectors"]
    if "file" not in conns:
        return {}
    out: dict[str, Any] = {}
    for c, st in conns.items():
        if c == "file":
            continue
        r: dict[str, Any] = {}
        for m in METRICS:
            for q in ("p50_ms", "p99_ms"):
                a, b = st[m].get(q), conns["file"][m].get(q)
                if a and b:
                    r[f"{m}_{q[:3]}"] = round(b / a, 3)
        out[c] = r
    base = result["baseline"]["llm_request"].get("p50_ms")
    for c, st in conns.items():
        v = st["llm_request"].get("p50_ms")
        if base and v:
            out.setdefault(c, {})["llm_request_p50_vs_baseline"] = round(base / v, 3)
    return out


def _bound(result: dict[str, Any]) -> float | None:
    """The file connector's hand-off p50 over its time outside the connector (``bound_vs_file``), or None."""
    st = result["connectors"].get("file")
    if st is None:
        return None
    outside, handoff = st.get(OUTSIDE, {}).get("p50_ms"), st["handoff"].get("p50_ms")
    return round(handoff / outside, 3) if outside and handoff else None


def print_set(res: dict[str, Any]) -> None:
    conns = list(res["connectors"])
    print(
        f"\n== {res['topology']} topology, {res['item_bytes'] / 1e6:.2f} MB per item, {res['rounds']} rounds, "
        f"load {res['loadavg_1m']['min']:.1f}-{res['loadavg_1m']['max']:.1f} =="
    )
    head = f"{'metric':<13}" + "".join(f"{c + ' p50/p90/p99 ms':>34}" for c in conns)
    if "file" in conns:
        head += "".join(f"{'file/' + c + ' p50 (p99)':>26}" for c in conns if c != "file")
    print(head)
    for m in (*METRICS, *FETCH_STAGES, OUTSIDE):
        row = f"{(m if m in METRICS else '  ' + m):<13}"
        for c in conns:
            st = res["connectors"][c].get(m, {})
            row += f"{st['p50_ms']:>12.1f} /{st['p90_ms']:>8.1f} /{st['p99_ms']:>8.1f}" if st.get("n") else f"{'-':>34}"
        for c in conns:
            if c == "file":
                continue
            r = res["ratios_vs_file"].get(c, {})
            a, b = r.get(f"{m}_p50"), r.get(f"{m}_p99")
            row += f"{(f'{a:.2f}x ({b:.2f}x)' if a and b else '-'):>26}"
        print(row)
    bound = res.get("bound_vs_file")
    if bound:
        print(f"  best hand-off ratio to the file's any connector could reach here (bound_vs_file): {bound:.2f}x")
    b = res["baseline"]["llm_request"]
    print(
        f"{'baseline':<13}{b['p50_ms']:>12.1f} /{b['p90_ms']:>8.1f} /{b['p99_ms']:>8.1f}  (single instance, "
        f"encodes locally: LLM request)"
    )
    for c in conns:
        st = res["connectors"][c]
        print(f"  {c}: {st['requests']} requests, {st['failed']} failed, {st['mismatches']} not bit-identical")
    print(f"  leftovers: {json.dumps(res['leftovers'])}; '{DROP_LOG}' log lines: {res['drop_log_lines']}")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="python -m tensorwire.bench vllm_engine",
        description="The EC connectors in real vLLM engines (see the package docstring).",
    )
    ap.add_argument("--quick", action="store_true", help="one topology (uniproc), 1 MB, 5 rounds: a smoke run")
    ap.add_argument("--topology", choices=[*TOPOLOGIES, "both"], default="both")
    ap.add_argument(
        "--sizes", type=int, nargs="+", choices=sorted(SIZES_MB), default=sorted(SIZES_MB), help="MB per image item"
    )
    ap.add_argument("--connectors", nargs="+", choices=CONNECTORS, default=["tensorwire", "file"])
    ap.add_argument("--rounds", type=int, default=None, help="measured rounds per set (default 20; 6 at 100 MB)")
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--max-tokens", type=int, default=8, help="tokens the LLM instance generates per request")
    ap.add_argument("--hog", action="store_true", help="run beside a CPU-bound process (one core spinning)")
    ap.add_argument(
        "--settle-ms",
        type=float,
        default=None,
        help="pause before each request (default: 1200 in the mp topology, where vLLM's workers busy-poll for 1 s "
        "after each step, 0 in uniproc)",
    )
    ap.add_argument(
        "--sched",
        action="store_true",
        help="diagnosis: record every instance's CPU run and run-queue wait time during each LLM request "
        "(/proc schedstat, by process and thread name; adds 13-20 ms to each hand-off)",
    )
    ap.add_argument(
        "--model-dir",
        type=Path,
        default=Path("build/vllm-engine-models"),
        help="where the tiny models are built (reused when present)",
    )
    ap.add_argument("--workdir", type=Path, default=None, help="logs and timestamps (default: a temp dir, removed)")
    ap.add_argument("--out", default=None, help="the JSON (default benchmarks/results/vllm-engine-<machine>.json)")
    args = ap.parse_args(argv)
    if args.quick:
        args.topology, args.sizes = ("uniproc" if args.topology == "both" else args.topology), [1]
        args.rounds = args.rounds or 5
        args.warmup = min(args.warmup, 1)
    topologies = TOPOLOGIES if args.topology == "both" else (args.topology,)
    if "mooncake" in args.connectors:
        print(f"mooncake: {MOONCAKE_NOT_RUN}", file=sys.stderr)
        return 2

    if args.workdir is not None:  # every set's directory is new: refuse now rather than fail every set later
        taken = [
            _set_dir(t, size) for size in args.sizes for t in topologies if (args.workdir / _set_dir(t, size)).exists()
        ]
        if taken:
            print(
                f"error: --workdir {args.workdir} already holds {', '.join(taken)} from an earlier run; "
                "give a new or empty directory",
                file=sys.stderr,
            )
            return 2

    from tensorwire.bench.vllm_engine.tiny_llava import build_sized

    # SIGTERM ends the run as an exception would: every instance's process group is killed on the way out.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    work = (args.workdir or Path(tempfile.mkdtemp(prefix="tw-bench-engine-"))).resolve()
    hog = None
    if args.hog:
        hog = subprocess.Popen([sys.executable, "-c", "while True: pass"], start_new_session=True)
    started = time.monotonic()
    runs: list[dict[str, Any]] = []
    failed = False

    def write(runs: list[dict[str, Any]], partial: bool) -> Path:
        payload = {
            "note": load_note(runs, os.cpu_count() or 1, args.hog),
            "condition": "hog" if args.hog else "quiet",
            "vllm": _vllm_version(),
            "partial": partial,
            "config": {
                "topologies": list(topologies),
                "sizes_mb": args.sizes,
                "connectors": args.connectors,
                "warmup_rounds": args.warmup,
                "max_tokens": args.max_tokens,
                "settle_ms": {t: _settle_s(args.settle_ms, t) * 1000 for t in topologies},
                "hog": args.hog,
                "quick": args.quick,
                "sched": args.sched,
                "consumer_budgets": CONSUMER_BUDGETS,
            },
            "definitions": DEFINITIONS,
            "not_run": {"mooncake": MOONCAKE_NOT_RUN},
            "runs": runs,
            "wall_s": round(time.monotonic() - started, 1),
        }
        return write_result(f"vllm-engine{'-hog' if args.hog else ''}", payload, args.out)

    try:
        for size in args.sizes:
            model = args.model_dir.resolve() / f"llava-{SIZES_MB[size]}tok"
            if not (model / "model.safetensors").exists():
                build_sized(model, SIZES_MB[size])
            rounds = args.rounds or (6 if size >= 100 else 20)
            for topo in topologies:
                try:
                    res = run_set(
                        topo,
                        size,
                        args.connectors,
                        rounds,
                        args.warmup,
                        args.max_tokens,
                        model,
                        work / _set_dir(topo, size),
                        seed0=1000 * size,
                        settle_s=_settle_s(args.settle_ms, topo),
                        sched=args.sched,
                    )
                except Exception as exc:  # an instance died or hung: recorded, the other sets still run
                    print(f"[{topo} {size} MB] failed: {exc}", file=sys.stderr, flush=True)
                    runs.append({"topology": topo, "size_mb": size, "error": f"{type(exc).__name__}: {exc}"[:4000]})
                    failed = True
                    continue
                print_set(res)
                failed |= any(st["failed"] or st["mismatches"] for st in res["connectors"].values())
                runs.append(res)
                write(runs, partial=True)  # what is measured so far survives a later set's failure
    finally:
        if hog is not None:
            hog.kill()
            hog.wait()
        if args.workdir is None:
            shutil.rmtree(work, ignore_errors=True)
    out = write(runs, partial=False)
    print(f"\nwrote {out}")
    return 1 if failed else 0


def _set_dir(topology: str, size_mb: int) -> str:
    """The directory of one set's logs and timestamps under ``--workdir``."""
    return f"{topology}-{size_mb}mb"


def _settle_s(settle_ms: float | None, topology: str) -> float:
    """The pause before each request: given, else 1.2 s in the multiprocess topology (vLLM's workers busy-poll
    their queue for 1 s after each step, so every instance just used would compete with the next request for
    the cores: a co-location the benchmark makes, not the deployment) and none in the one-process one."""
    if settle_ms is not None:
        return max(0.0, settle_ms / 1000.0)
    return 1.2 if topology == "mp" else 0.0


def _vllm_version() -> str | None:
    from importlib import metadata

    for name in ("vllm-cpu", "vllm"):
        try:
            return f"{name} {metadata.version(name)}"
        except metadata.PackageNotFoundError:
            continue
    return None
