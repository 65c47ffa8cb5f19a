"""``tensorwire rdma-demo``: two processes, export -> read -> release over NIXL, printing what moved and how.

The demo itself is ``tensorwire.cli._rdma_demo``. Exit codes: 0 every byte matched, 1 NIXL is unavailable or
the bytes differ, 2 bad arguments or a device this process lacks, 130 interrupted.
"""

from __future__ import annotations

import argparse
import os
import sys

HELP = "two-process export -> read -> release demo of the rdma layer (NIXL/UCX)"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from tensorwire.cli._args import device

    parser.add_argument("--rows", type=int, default=4096, help="rows of the embedding tensor (default 4096)")
    parser.add_argument("--hidden", type=int, default=4096, help="hidden size (default 4096: 32 MiB of bf16)")
    parser.add_argument("--iters", type=int, default=5, help="timed reads after the first (default 5)")
    parser.add_argument(
        "--device",
        type=device,
        default="cpu",
        help="where both processes keep the tensors: cpu or cuda:N (default: cpu)",
    )
    parser.add_argument(
        "--ucx-net-devices",
        default="lo",
        help="UCX_NET_DEVICES for both processes unless already set (default lo: keep UCX on loopback)",
    )


def run(args: argparse.Namespace) -> int:
    os.environ.setdefault("UCX_NET_DEVICES", args.ucx_net_devices)
    from tensorwire.cli._args import device_problem
    from tensorwire.cli._rdma_demo import rdma_demo
    from tensorwire.rdma import RdmaConfig, has_rdma

    problem = device_problem(args.device)
    if problem:
        print(f"error: --device: {problem}", file=sys.stderr)
        return 2
    if args.rows < 1 or args.hidden < 1 or args.iters < 0:
        print("error: --rows >= 1, --hidden >= 1, --iters >= 0", file=sys.stderr)
        return 2
    cfg = RdmaConfig(provider="nixl", device=args.device, bind_ip="127.0.0.1")
    if not has_rdma(cfg):
        print("NIXL is not available in this environment: the rdma layer would fall back to inline bytes.")
        return 1
    return 0 if rdma_demo(cfg, args.rows, args.hidden, args.iters) else 1
