"""``tensorwire rdma-demo``: two processes, export -> read -> release over NIXL, printing what moved and how."""

from __future__ import annotations

import argparse
import os
import statistics
import time

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
    import torch

    from tensorwire.rdma import Descriptor, RdmaConfig, TensorReader, has_rdma
    from tensorwire.testing import OwnerProcess, make_tensor, same_bytes

    cfg = RdmaConfig(provider="nixl", device=args.device, bind_ip="127.0.0.1")
    if not has_rdma(cfg):
        print("NIXL is not available in this environment: the rdma layer would fall back to inline bytes.")
        return 1
    if cfg.is_cuda:
        torch.empty(1, device=cfg.device)  # CUDA context before the NIXL agent
    specs = [((args.rows, args.hidden), "bfloat16", 1), ((args.rows,), "int64", 2), ((args.rows, 3), "float32", 3)]
    names = ["embedding", "position_ids", "extra"]
    env = {"UCX_NET_DEVICES": os.environ["UCX_NET_DEVICES"]}
    t_start = time.perf_counter()
    with OwnerProcess(cfg, env=env) as owner, TensorReader(cfg) as reader:
        print(f"owner  pid {owner.pid}: agent {owner.owner.agent_name} metadata at {owner.owner.endpoint}")
        print(f"reader pid {os.getpid()}: device {cfg.device}")
        raw, export_s = owner.export(specs)
        desc = Descriptor.from_bytes(raw)
        print(f"exported lease {desc.lease_id} ({len(raw)}-byte descriptor, payload {desc.payload_bytes} bytes) "
              f"in {export_s * 1e3:.2f} ms")
        t0 = time.perf_counter()
        out = reader.read([raw])
        first_s = time.perf_counter() - t0
        for name, t, (shape, dtype, seed) in zip(names, out, specs, strict=True):
            ok = same_bytes(t.cpu(), make_tensor(shape, dtype, seed))
            nbytes = t.numel() * t.element_size()
            print(f"  {name:13s} {str(tuple(t.shape)):16s} {str(t.dtype):15s} {nbytes:>11d} bytes "
                  f"{'bytes match' if ok else 'BYTES DIFFER'}")
            if not ok:
                return 1
        del out
        times = []
        for _ in range(args.iters):
            t0 = time.perf_counter()
            reader.read([desc])
            if cfg.is_cuda:
                torch.cuda.synchronize(cfg.device)
            times.append(time.perf_counter() - t0)
        owner.release([desc.lease_id])
        stats = owner.stats()
        med = statistics.median(times) if times else first_s
        print(f"read: first {first_s * 1e3:.2f} ms (includes metadata fetch and UCX wire-up), "
              f"median of {len(times)} {med * 1e3:.3f} ms = {desc.nbytes / med / 1e9:.2f} GB/s")
        print(f"UCX transport of the READs: {reader.transport(desc)}")
        print(f"released: owner has {stats.live_leases} live lease(s), {stats.pool.busy_slots} busy slot(s), "
              f"{stats.pool.idle_slots} idle slot(s) kept registered for reuse")
    print(f"done in {time.perf_counter() - t_start:.2f} s")
    return 0
