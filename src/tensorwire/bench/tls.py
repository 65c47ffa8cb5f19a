"""Benchmark: what mTLS on the control plane costs a fetch, plaintext and mTLS side by side in one run.

    python -m tensorwire.bench tls [--device cpu|cuda:N] [--rows 8 13760] [--rounds 5] [--iters 20]

Two encoder processes, one plaintext and one with mTLS (a throwaway CA made at run time), fetched in alternating
rounds on the RDMA and inline planes; ``tls_over_plaintext`` is the ratio of the medians. Writes
benchmarks/results/tls-<machine>.json.
"""

from __future__ import annotations

import argparse
import dataclasses
import multiprocessing as mp
import os
import statistics
import sys
import tempfile
from typing import Any

COLS = 4096
SEED_ROWS = 13760  # x 4096 x bf16 = 112.7 MB
INLINE_MAX_BYTES = 8 << 20  # the inline plane is timed up to this size (beyond it takes seconds per fetch)


def _start(ctx: Any, device: str, rows: int, tls: Any) -> tuple[Any, Any, int]:
    from tensorwire.bench.transfer import _encoder

    q, stop = ctx.Queue(), ctx.Event()
    proc = ctx.Process(target=_encoder, args=(device, rows, COLS, q, stop, tls), daemon=True)
    proc.start()
    port, ready = q.get(timeout=120)
    if not ready:
        raise SystemExit("encoder exporter did not become ready; is NIXL installed?")
    return proc, stop, int(port)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m tensorwire.bench tls", description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cpu", help="cpu or cuda:N (both processes use it)")
    ap.add_argument(
        "--rows",
        type=int,
        nargs="+",
        default=[8, 1024, SEED_ROWS],
        help=f"output rows (x {COLS} bf16) to time; {SEED_ROWS} is a 112.7 MB ViT output",
    )
    ap.add_argument("--rounds", type=int, default=5, help="alternating rounds")
    ap.add_argument("--iters", type=int, default=20, help="timed fetches per round, mode, size and plane")
    ap.add_argument("--out", default=None, help="JSON path (default benchmarks/results/tls-<machine>.json)")
    args = ap.parse_args(argv)
    os.environ.setdefault("NIXL_LOG_LEVEL", "WARN")

    from tensorwire.bench._common import bench_tls, write_result
    from tensorwire.bench.transfer import _run_plane
    from tensorwire.mm import RemoteOutputTransport, TransportConfig
    from tensorwire.rdma import RdmaConfig

    rows_list = sorted(set(args.rows))
    tmp = tempfile.TemporaryDirectory(prefix="tensorwire-bench-tls-")
    ctx = mp.get_context("spawn")
    procs: list[tuple[Any, Any]] = []
    samples: dict[str, dict[str, dict[int, list[float]]]] = {
        mode: {"rdma_zero_copy": {r: [] for r in rows_list}, "inline": {r: [] for r in rows_list}}
        for mode in ("plaintext", "mtls")
    }
    try:
        server_tls, client_tls = bench_tls(tmp.name)
        # Both on the gRPC control plane: a plaintext worker would also serve the same-host Unix socket,
        # which an mTLS worker keeps closed, and the ratio would then measure the channel, not TLS.
        base = TransportConfig(rdma=RdmaConfig(device=args.device), local_channel="off")
        clients: dict[str, tuple[Any, Any]] = {}
        for mode, s_tls, c_tls in (("plaintext", None, None), ("mtls", server_tls, client_tls)):
            proc, stop, port = _start(ctx, args.device, max(rows_list), s_tls)
            procs.append((proc, stop))
            cfg = base if c_tls is None else dataclasses.replace(base, tls=c_tls)
            rdma_t = RemoteOutputTransport(f"127.0.0.1:{port}", cfg)
            inline_t = RemoteOutputTransport(f"127.0.0.1:{port}", cfg.with_mode("grpc"))
            if not rdma_t.wait_ready(60):
                raise SystemExit("RDMA reader did not become ready")
            clients[mode] = (rdma_t, inline_t)
        for rnd in range(args.rounds):
            order = ("plaintext", "mtls") if rnd % 2 == 0 else ("mtls", "plaintext")
            for rows in rows_list:
                for mode in order:
                    rdma_t, inline_t = clients[mode]
                    z = _run_plane(rdma_t, rows, args.iters, 2, "rdma", args.device, zero_copy=True)
                    samples[mode]["rdma_zero_copy"][rows].append(z["transfer"]["median_ms"])
                    if rows * COLS * 2 <= INLINE_MAX_BYTES:
                        i = _run_plane(inline_t, rows, args.iters, 2, "inline", args.device)
                        samples[mode]["inline"][rows].append(i["transfer"]["median_ms"])
            print(f"round {rnd + 1}/{args.rounds} done", flush=True)
        for rdma_t, inline_t in clients.values():
            rdma_t.close()
            inline_t.close()
    finally:
        for proc, stop in procs:
            stop.set()
            proc.join(30)
            if proc.is_alive():
                proc.kill()
                proc.join(5)
        tmp.cleanup()

    sizes = []
    for rows in rows_list:
        row: dict[str, Any] = {"rows": rows, "bytes": rows * COLS * 2}
        for plane in ("rdma_zero_copy", "inline"):
            plain, mtls = samples["plaintext"][plane][rows], samples["mtls"][plane][rows]
            if not plain:
                continue
            p, m = statistics.median(plain), statistics.median(mtls)
            row[plane] = {
                "plaintext_ms": p,
                "mtls_ms": m,
                "tls_over_plaintext": m / p,
                "tls_cost_ms": m - p,
                "round_medians_ms": {"plaintext": plain, "mtls": mtls},
            }
            print(
                f"{rows * COLS * 2 / 1e6:9.3f} MB {plane:15} plaintext {p:8.3f} ms  mtls {m:8.3f} ms  "
                f"ratio {m / p:5.3f}  cost {m - p:+7.3f} ms",
                flush=True,
            )
        sizes.append(row)
    targets: dict[str, Any] = {"target_ratio_max": 1.10}
    seed = next((r for r in sizes if r["rows"] == SEED_ROWS), None)
    if seed is not None:
        ratio = seed["rdma_zero_copy"]["tls_over_plaintext"]
        targets.update(seed_rdma_tls_over_plaintext=ratio, meets_seed_within_10pct=ratio <= 1.10)
    print("targets:", targets)
    path = write_result(
        "tls",
        {
            "device": args.device,
            "cols": COLS,
            "rounds": args.rounds,
            "iters": args.iters,
            "what": "fetch transfer medians (fetch total - encoder compute), ms, plaintext vs "
            "mTLS control plane, alternating rounds in one run",
            "sizes": sizes,
            "targets": targets,
        },
        args.out,
    )
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
