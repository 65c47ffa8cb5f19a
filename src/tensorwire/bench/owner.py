"""Benchmark: what the same-user checks of plaintext gRPC on loopback cost a same-user fetch, with and without them
side by side in one run.

    python -m tensorwire.bench owner [--rows 8 1024] [--rounds 5] [--iters 40]

Two encoder processes (``bench transfer``'s encoder) run at once on 127.0.0.1: one as shipped (its listener looks
up every caller's uid, ``tensorwire._grpc.owner.CallerCheck``) and one with that check replaced by a no-op, the code
before the check existed. Two clients fetch from them, as shipped (the listener's owner looked up before every
call) and without the client check, in alternating rounds (the order flips every round), so both see one machine
state. All on the gRPC control plane (the same-host Unix channel off: it never runs these checks): the RDMA plane
with a zero-copy output and the inline plane on the client's EncodeStream (checked when a stream opens, not per
fetch), and the inline plane over unary calls (``inline_unary``: an Encode and a ReleaseLeases call per fetch, each
checked on both sides: the per-call cost). Fetch totals (``total``, ms), p50 and p99 over all rounds;
``checked_over_unchecked`` is the ratio of the p50s. Writes benchmarks/results/owner-<machine>.json.
"""

from __future__ import annotations

import argparse
import dataclasses
import multiprocessing as mp
import os
import statistics
import sys
from typing import Any

COLS = 4096


def _unchecked_encoder(device: str, rows: int, cols: int, q: Any, stop: Any) -> None:
    """``bench transfer``'s encoder with the listener's caller check off (as before it existed)."""
    from tensorwire._grpc import host as _host
    from tensorwire.bench.transfer import _encoder

    class NoCheck:
        def __init__(self, host: str, port: int) -> None:
            pass

        def allowed(self, peer: str) -> None:
            return None

    setattr(_host, "CallerCheck", NoCheck)  # noqa: B010 (a module attribute the host reads at bind)
    _encoder(device, rows, cols, q, stop)


def _start(ctx: Any, target: Any, device: str, rows: int) -> tuple[Any, Any, int]:
    q, stop = ctx.Queue(), ctx.Event()
    proc = ctx.Process(target=target, args=(device, rows, COLS, q, stop), daemon=True)
    proc.start()
    port, ready = q.get(timeout=120)
    if not ready:
        raise SystemExit("encoder exporter did not become ready; is NIXL installed?")
    return proc, stop, int(port)


def _quantile(xs: list[float], q: float) -> float:
    ordered = sorted(xs)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m tensorwire.bench owner", description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--rows", type=int, nargs="+", default=[8, 1024], help=f"output rows (x {COLS} bf16)")
    ap.add_argument("--rounds", type=int, default=5, help="alternating rounds")
    ap.add_argument("--iters", type=int, default=40, help="timed fetches per round, variant, size and plane")
    ap.add_argument("--out", default=None, help="JSON path (default benchmarks/results/owner-<machine>.json)")
    args = ap.parse_args(argv)
    os.environ.setdefault("NIXL_LOG_LEVEL", "WARN")

    from tensorwire._grpc import owner as _owner
    from tensorwire.bench._common import write_result
    from tensorwire.bench.transfer import _encoder, _fetch_once, _inputs
    from tensorwire.mm import RemoteOutputTransport, TransportConfig
    from tensorwire.rdma import RdmaConfig

    rows_list = sorted(set(args.rows))
    ctx = mp.get_context("spawn")
    procs: list[tuple[Any, Any]] = []
    variants = ("checked", "unchecked")
    planes = ("rdma", "inline", "inline_unary")
    samples: dict[str, dict[str, dict[int, list[float]]]] = {
        v: {p: {r: [] for r in rows_list} for p in planes} for v in variants
    }
    clients: dict[str, dict[str, Any]] = {}
    try:
        base = TransportConfig(rdma=RdmaConfig(device=args.device), local_channel="off")
        guard = _owner.guard_channel
        for variant, target in (("checked", _encoder), ("unchecked", _unchecked_encoder)):
            proc, stop, port = _start(ctx, target, args.device, max(rows_list))
            procs.append((proc, stop))
            if variant == "unchecked":
                _owner.guard_channel = lambda channel, target: channel
            try:
                rdma_t = RemoteOutputTransport(f"127.0.0.1:{port}", base)
                inline_t = RemoteOutputTransport(f"127.0.0.1:{port}", base.with_mode("grpc"))
                unary_t = RemoteOutputTransport(
                    f"127.0.0.1:{port}", dataclasses.replace(base.with_mode("grpc"), control_stream=False)
                )
            finally:
                _owner.guard_channel = guard
            if not rdma_t.wait_ready(60):
                raise SystemExit("RDMA reader did not become ready")
            clients[variant] = {"rdma": rdma_t, "inline": inline_t, "inline_unary": unary_t}
        for rnd in range(args.rounds):
            order = variants if rnd % 2 == 0 else variants[::-1]
            for rows in rows_list:
                for plane in planes:
                    inputs = _inputs(rows, zero_copy=plane == "rdma")
                    for variant in order:
                        t = clients[variant][plane]
                        for i in range(args.iters + 2):
                            fetched = _fetch_once(t, inputs, plane.split("_")[0], args.device)
                            if i >= 2:
                                samples[variant][plane][rows].append(fetched["total"])
            print(f"round {rnd + 1}/{args.rounds} done", flush=True)
        for pair in clients.values():
            for t in pair.values():
                t.close()
    finally:
        for proc, stop in procs:
            stop.set()
            proc.join(30)
            if proc.is_alive():
                proc.kill()
                proc.join(5)

    sizes = []
    for rows in rows_list:
        row: dict[str, Any] = {"rows": rows, "bytes": rows * COLS * 2}
        for plane in planes:
            c, u = samples["checked"][plane][rows], samples["unchecked"][plane][rows]
            pc, pu = statistics.median(c), statistics.median(u)
            row[plane] = {
                "checked_p50_ms": pc,
                "unchecked_p50_ms": pu,
                "checked_p99_ms": _quantile(c, 0.99),
                "unchecked_p99_ms": _quantile(u, 0.99),
                "checked_over_unchecked": pc / pu,
                "cost_ms": pc - pu,
                "n": len(c),
            }
            print(
                f"{rows * COLS * 2 / 1e6:9.3f} MB {plane:7} checked p50 {pc:7.3f} ms p99 {_quantile(c, 0.99):7.3f}"
                f" | unchecked p50 {pu:7.3f} ms p99 {_quantile(u, 0.99):7.3f} | ratio {pc / pu:5.3f}",
                flush=True,
            )
        sizes.append(row)
    path = write_result(
        "owner",
        {
            "device": args.device,
            "cols": COLS,
            "rounds": args.rounds,
            "iters": args.iters,
            "what": "same-user fetch totals, ms, over the gRPC control plane on 127.0.0.1: caller and listener owner "
            "checks on (as shipped) vs off (the code before them), alternating rounds in one run",
            "sizes": sizes,
        },
        args.out,
    )
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
