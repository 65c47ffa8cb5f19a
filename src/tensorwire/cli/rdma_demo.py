"""``tensorwire rdma-demo``: two processes, export -> read -> release over NIXL, printing what moved and how.

The demo itself is ``tensorwire.cli._rdma_demo``. Exit codes: 0 every byte matched, 1 NIXL is unavailable or
the bytes differ.
"""

from __future__ import annotations

import argparse
import os

HELP = "two-process export -> read -> release demo of the rdma layer (NIXL/UCX)"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--rows", type=int, default=4096, help="rows of the embedding tensor (default 4096)")
    parser.add_argument("--hidden", type=int, default=4096, help="hidden size (default 4096: 32 MiB of bf16)")
    parser.add_argument("--iters", type=int, default=5, help="timed reads after the first (default 5)")
    parser.add_argument("--device", default="cpu", help="'cpu' or 'cuda:N' (default cpu)")
    parser.add_argument("--ucx-net-devices", default="lo",
                        help="UCX_NET_DEVICES for both processes unless already set (default lo: keep UCX on loopback)")


def run(args: argparse.Namespace) -> int:
    os.environ.setdefault("UCX_NET_DEVICES", args.ucx_net_devices)
    from tensorwire.cli._rdma_demo import rdma_demo
    from tensorwire.rdma import RdmaConfig, has_rdma

    cfg = RdmaConfig(provider="nixl", device=args.device, bind_ip="127.0.0.1")
    if not has_rdma(cfg):
        print("NIXL is not available in this environment: the rdma layer would fall back to inline bytes.")
        return 1
    return 0 if rdma_demo(cfg, args.rows, args.hidden, args.iters) else 1
