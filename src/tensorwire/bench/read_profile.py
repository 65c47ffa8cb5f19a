"""Where a read's time goes: ``python -m tensorwire.bench read_profile [--device cuda:0]``.

An exporter in a spawned process exports one small (64 KiB) and one seed-sized (112.7 MB) bf16 tensor once; the
reader here reads each ``--iters`` times. Every provider READ is timed by wrapping ``Provider.read`` (payload READ
and generation READ apart), and one cProfile of the small reads lists the top functions by own time. This is a
diagnosis tool for the read path's fixed cost, not a benchmark with targets: it writes JSON under
``benchmarks/results/read_profile-<machine>.json``.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import time
from collections.abc import Sequence
from typing import Any

import torch

from tensorwire.bench._common import summarize, write_result
from tensorwire.rdma import Owner, RdmaConfig, TensorReader
from tensorwire.rdma.providers.base import Range
from tensorwire.testing.owner import OwnerProcess

SIZES = {"64KiB": (8, 4096), "112.7MB": (13760, 4096)}  # bf16 rows x cols


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tensorwire.bench read_profile", description=__doc__)
    parser.add_argument("--device", default="cpu", help="'cpu' or 'cuda:N' (exporter and reader)")
    parser.add_argument("--iters", type=int, default=40)
    parser.add_argument("--out", default=None)
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    if device.type == "cuda":
        torch.empty(1, device=device)  # CUDA context before the NIXL agent
    cfg = RdmaConfig(device=args.device, bind_ip="127.0.0.1")
    result: dict[str, Any] = {"device": args.device, "iters": args.iters, "sizes": {}}
    with OwnerProcess(cfg) as owner, TensorReader(cfg) as reader:
        provider = reader._provider  # diagnosis only: wrap the provider's READ with a timer
        assert provider is not None
        calls: list[tuple[str, float]] = []
        inner = provider.read

        def timed_read(
            owner: Owner,
            local_mem: str,
            local: Sequence[Range],
            remote_mem: str,
            remote: Sequence[Range],
            *,
            deadline: float,
        ) -> None:
            t0 = time.perf_counter()
            inner(owner, local_mem, local, remote_mem, remote, deadline=deadline)
            calls.append(("generation" if local[0][1] == 8 else "payload", time.perf_counter() - t0))

        provider.read = timed_read  # type: ignore[method-assign]  # on purpose: this instance only, for timing
        for name, (rows, cols) in SIZES.items():
            desc, _ = owner.export([((rows, cols), "bfloat16", 7)])
            for _ in range(3):
                reader.read([desc])
            _sync(device)
            calls.clear()
            total: list[float] = []
            for _ in range(args.iters):
                t0 = time.perf_counter()
                reader.read([desc])
                _sync(device)
                total.append(time.perf_counter() - t0)
            payload = [s for k, s in calls if k == "payload"]
            gen = [s for k, s in calls if k == "generation"]
            prof_text = ""
            if name == "64KiB":
                prof = cProfile.Profile()
                prof.enable()
                for _ in range(args.iters):
                    reader.read([desc])
                _sync(device)
                prof.disable()
                buf = io.StringIO()
                pstats.Stats(prof, stream=buf).sort_stats("tottime").print_stats(18)
                prof_text = buf.getvalue()
                print(prof_text)
            result["sizes"][name] = {
                "bytes": rows * cols * 2,
                "read_total": summarize(total),
                "provider_payload_read": summarize(payload),
                "provider_generation_read": summarize(gen),
                "profile_top": prof_text.splitlines()[:40],
            }
            med = result["sizes"][name]
            print(
                f"{name:>8}: read() {med['read_total'].get('median_ms', 0):.3f} ms  payload READ "
                f"{med['provider_payload_read'].get('median_ms', 0):.3f} ms  generation READ "
                f"{med['provider_generation_read'].get('median_ms', 0):.3f} ms  transport {reader.transport()}"
            )
        result["transport"] = reader.transport()
    path = write_result("read_profile", result, args.out)
    print(f"wrote {path}")
    return 0
