"""``python -m tensorwire.bench progress_delay``: what an owner's idle NIXL progress thread costs, and what sleeping
longer would cost a reader on another host.

An owner process (a ``TensorExporter`` whose ``RdmaConfig.progress_delay_us`` is each of ``--delays-us`` in turn)
runs in one network namespace and a reader in another (``tensorwire.testing.netns``: UCX over TCP on a veth, as
between two hosts; needs root). Per delay: the reader's READ wall time per size and per idle gap before each READ
(p50 / p90 / max: with a gap the owner's progress thread is asleep when the READ arrives), and the owner's idle
cost over ``--idle-s`` (fraction of a core, context switches a second, both from /proc).

Why: the idle progress thread of every exporter wakes once per delay (the 1 ms default: ~1,000 wake-ups a
second), a cost an encoder instance pays beside vLLM's threads. A host-memory reader sleeps 50 ms
(``integrations._vllm_ec.runtime``) because its reading thread drives its own READs; an owner's progress thread
serves the TCP READs of other hosts, so its delay is set by what this benchmark shows. Writes
benchmarks/results/progress-delay-<machine>.json.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

DEFAULT_DELAYS_US = (1000, 50_000)
DEFAULT_SIZES = (4096, 1 << 20, 10 << 20)
DEFAULT_GAPS_S = (0.0, 0.02, 0.2)
_WAIT_S = 120.0


def _idle_cost(pid: int, seconds: float) -> dict[str, float]:
    """A process's CPU (fraction of one core) and context switches a second over ``seconds`` of idling."""
    from tensorwire.testing import cpu_seconds

    def switches() -> int:
        n = 0
        for tid in os.listdir(f"/proc/{pid}/task"):
            try:
                with open(f"/proc/{pid}/task/{tid}/status") as f:
                    n += sum(int(line.split()[1]) for line in f if "ctxt_switches:" in line)
            except OSError:
                continue
        return n

    c0, s0, t0 = cpu_seconds(pid), switches(), time.monotonic()
    time.sleep(seconds)
    dt = time.monotonic() - t0
    return {"cpu_core_fraction": (cpu_seconds(pid) - c0) / dt, "context_switches_per_s": (switches() - s0) / dt}


def _owner(delay_us: int, ip: str, sizes: list[int], out: Path, idle_s: float) -> None:
    """Exports one tensor per size, writes their descriptors to ``out``, waits for ``out``.done, then measures its
    own idle cost into ``out``.idle."""
    from tensorwire.rdma import RdmaConfig, TensorExporter
    from tensorwire.testing import make_tensor

    cfg = RdmaConfig(device="cpu", progress_delay_us=delay_us, control_host=ip, advertise_host=ip)
    with TensorExporter(cfg) as exp:
        descs = [exp.export([make_tensor((n,), "uint8", 7)]).to_bytes().hex() for n in sizes]
        tmp = out.with_suffix(".tmp")
        tmp.write_text(json.dumps(descs))
        tmp.rename(out)
        deadline = time.monotonic() + _WAIT_S * 4
        while not out.with_suffix(".done").exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        out.with_suffix(".idle").write_text(json.dumps(_idle_cost(os.getpid(), idle_s)))


def _reader(descs_path: Path, sizes: list[int], gaps: list[float], iters: int, out: Path) -> None:
    from tensorwire.rdma import Descriptor, RdmaConfig, TensorReader
    from tensorwire.testing import make_tensor, same_bytes

    descs = [Descriptor.from_bytes(bytes.fromhex(h)) for h in json.loads(descs_path.read_text())]
    result: dict[str, Any] = {}
    # same_host_copy off: these "hosts" share a kernel, which process_vm_readv would see through (as real hosts
    # do not); every READ goes over the veth
    with TensorReader(RdmaConfig(device="cpu", same_host_copy=0)) as reader:
        for n, d in zip(sizes, descs, strict=True):
            (first,) = reader.read([d])  # connects and loads the owner's metadata: not timed
            if not same_bytes(first, make_tensor((n,), "uint8", 7)):
                raise SystemExit(f"byte mismatch in a READ of {n} bytes")
            del first
            for gap in gaps:
                ms = []
                for _ in range(iters):
                    time.sleep(gap)
                    t0 = time.perf_counter()
                    got = reader.read([d])
                    ms.append((time.perf_counter() - t0) * 1e3)
                    del got
                ms.sort()
                result[f"{n}:{gap}"] = {
                    "bytes": n,
                    "gap_s": gap,
                    "n": iters,
                    "p50_ms": statistics.median(ms),
                    "p90_ms": ms[min(iters - 1, int(0.9 * iters))],
                    "max_ms": ms[-1],
                }
        result["transport"] = reader.transport(descs[0])
        result["same_host_copies"] = reader.stats().same_host_copies
    out.write_text(json.dumps(result))


def _wait_for(path: Path, proc: Any, what: str) -> None:
    deadline = time.monotonic() + _WAIT_S
    while not path.exists():
        if proc.poll() is not None:
            raise SystemExit(f"the {what} exited with {proc.returncode} before writing {path.name}")
        if time.monotonic() > deadline:
            raise SystemExit(f"the {what} did not write {path.name} within {_WAIT_S:.0f} s")
        time.sleep(0.05)


def _one_delay(net: Any, delay_us: int, args: argparse.Namespace, work: Path) -> dict[str, Any]:
    own, rd = net["owner"], net["reader"]
    work.mkdir(exist_ok=True)
    base = work / f"d{delay_us}"
    descs = base.with_suffix(".json")
    me = [sys.executable, "-m", "tensorwire.bench.progress_delay"]
    sizes = ",".join(map(str, args.sizes))
    owner = own.spawn(
        [
            *me,
            "--role",
            "owner",
            "--delay",
            str(delay_us),
            "--ip",
            own.ip,
            "--sizes",
            sizes,
            "--file",
            str(descs),
            "--idle-s",
            str(args.idle_s),
        ],
        env=own.env(),
        stdout=None,
    )
    _wait_for(descs, owner, "owner")
    reads = base.with_suffix(".reads")
    reader = rd.spawn(
        [
            *me,
            "--role",
            "reader",
            "--sizes",
            sizes,
            "--gaps",
            ",".join(map(str, args.gaps)),
            "--iters",
            str(args.iters),
            "--file",
            str(descs),
            "--out",
            str(reads),
        ],
        env=rd.env(),
        stdout=None,
    )
    if reader.wait(timeout=_WAIT_S * 4) != 0:
        raise SystemExit(f"the reader exited with {reader.returncode}")
    descs.with_suffix(".done").touch()
    if owner.wait(timeout=args.idle_s + _WAIT_S) != 0:
        raise SystemExit(f"the owner exited with {owner.returncode}")
    got = json.loads(reads.read_text())
    return {
        "progress_delay_us": delay_us,
        "transport": got.pop("transport"),
        "same_host_copies": got.pop("same_host_copies"),
        "reads": list(got.values()),
        "owner_idle": json.loads(descs.with_suffix(".idle").read_text()),
    }


def _summary(runs: list[dict[str, Any]], delays: list[int]) -> dict[str, Any]:
    """Per READ size and gap: each delay's p50 and p90 (medians over its rounds) and the longest delay's p50 over
    the shortest's (above 1: the longer delay slowed READs); per delay the owner's idle cost (medians)."""
    by = {d: [r for r in runs if r["progress_delay_us"] == d] for d in delays}
    rows = []
    for i, row in enumerate(runs[0]["reads"]):
        cell = {
            str(d): {q: statistics.median(r["reads"][i][q] for r in rs) for q in ("p50_ms", "p90_ms")}
            for d, rs in by.items()
        }
        lo, hi = str(min(delays)), str(max(delays))
        rows.append(
            {
                "bytes": row["bytes"],
                "gap_s": row["gap_s"],
                **cell,
                "p50_longest_over_shortest": cell[hi]["p50_ms"] / cell[lo]["p50_ms"],
            }
        )
    idle = {
        str(d): {
            k: statistics.median(r["owner_idle"][k] for r in rs)
            for k in ("cpu_core_fraction", "context_switches_per_s")
        }
        for d, rs in by.items()
    }
    return {"reads": rows, "owner_idle": idle}


def _print(summary: dict[str, Any], delays: list[int]) -> None:
    print(
        f"{'bytes':>10} {'gap s':>6}"
        + "".join(f"{f'{d} us p50/p90 ms':>22}" for d in delays)
        + f"{'longest/shortest':>18}"
    )
    for row in summary["reads"]:
        cells = "".join(f"{row[str(d)]['p50_ms']:>13.2f} /{row[str(d)]['p90_ms']:>6.2f}" for d in delays)
        print(f"{row['bytes']:>10} {row['gap_s']:>6}{cells}{row['p50_longest_over_shortest']:>17.2f}x")
    for d in delays:
        idle = summary["owner_idle"][str(d)]
        print(
            f"owner idle at {d} us: {100 * idle['cpu_core_fraction']:.2f}% of a core, "
            f"{idle['context_switches_per_s']:.0f} context switches/s"
        )


def _floats(text: str) -> list[float]:
    return [float(x) for x in text.split(",") if x]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="python -m tensorwire.bench progress_delay",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    ap.add_argument("--delays-us", default=",".join(map(str, DEFAULT_DELAYS_US)), help="owner progress delays")
    ap.add_argument("--sizes", default=",".join(map(str, DEFAULT_SIZES)), help="bytes per READ, comma-separated")
    ap.add_argument("--gaps", default=",".join(map(str, DEFAULT_GAPS_S)), help="idle seconds before each READ")
    ap.add_argument("--iters", type=int, default=25, help="READs per size and gap")
    ap.add_argument("--rounds", type=int, default=2, help="passes over the delays, in alternating order")
    ap.add_argument("--idle-s", type=float, default=5.0, help="window of the owner's idle measurement")
    ap.add_argument("--out", default=None, help="JSON path (default benchmarks/results/progress-delay-<machine>.json)")
    # the two child roles (run inside the namespaces)
    ap.add_argument("--role", choices=("owner", "reader"), help=argparse.SUPPRESS)
    ap.add_argument("--delay", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--ip", help=argparse.SUPPRESS)
    ap.add_argument("--file", type=Path, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    args.sizes = [int(x) for x in _floats(args.sizes)]
    args.gaps = _floats(args.gaps)
    if args.role == "owner":
        _owner(args.delay, args.ip, args.sizes, args.file, args.idle_s)
        return 0
    if args.role == "reader":
        _reader(args.file, args.sizes, args.gaps, args.iters, Path(args.out))
        return 0

    from tensorwire.bench._common import write_result
    from tensorwire.testing import netns

    why = netns.unavailable_reason()
    if why:
        print(f"progress_delay needs network namespaces: {why}", file=sys.stderr)
        return 2
    delays = [int(x) for x in _floats(args.delays_us)]
    runs = []
    with tempfile.TemporaryDirectory(prefix="tw-bench-delay-") as tmp, netns.Fabric(["owner", "reader"]) as net:
        for r in range(args.rounds):  # the order alternates: neither delay always runs on a warmer box
            for delay in delays if r % 2 == 0 else delays[::-1]:
                print(f"[round {r + 1}/{args.rounds}, delay {delay} us] ...", flush=True)
                runs.append(dict(_one_delay(net, delay, args, Path(tmp) / f"r{r}"), round=r))
    summary = _summary(runs, delays)
    _print(summary, delays)
    path = write_result(
        "progress-delay",
        {
            "setup": "owner and reader in two network namespaces of this host, UCX_TLS=tcp over a veth "
            "(tensorwire.testing.netns), same_host_copy off; the reader's own progress delay is RdmaConfig's default",
            "config": {
                "delays_us": delays,
                "sizes": args.sizes,
                "gaps_s": args.gaps,
                "iters": args.iters,
                "rounds": args.rounds,
                "idle_s": args.idle_s,
            },
            "load_avg_1m": os.getloadavg()[0],
            "summary": summary,
            "runs": runs,
        },
        args.out,
    )
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
