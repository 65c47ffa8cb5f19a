"""What ``tensorwire rdma-demo`` does and prints: an owner process exports three tensors, this process reads them
over NIXL, checks every byte, times a few more reads and releases the lease."""

from __future__ import annotations

import os
import statistics
import time
from collections.abc import Callable

from tensorwire.rdma import RdmaConfig


def rdma_demo(cfg: RdmaConfig, rows: int, hidden: int, iters: int, say: Callable[[str], None] = print) -> bool:
    """Runs the demo, reporting each step through ``say``; False when the bytes read differ from those exported."""
    import torch

    from tensorwire.rdma import Descriptor, TensorReader
    from tensorwire.testing import OwnerProcess, make_tensor, same_bytes

    if cfg.is_cuda:
        torch.empty(1, device=cfg.device)  # CUDA context before the NIXL agent
    specs = [((rows, hidden), "bfloat16", 1), ((rows,), "int64", 2), ((rows, 3), "float32", 3)]
    names = ["embedding", "position_ids", "extra"]
    env = {"UCX_NET_DEVICES": os.environ["UCX_NET_DEVICES"]}
    t_start = time.perf_counter()
    with OwnerProcess(cfg, env=env) as owner, TensorReader(cfg) as reader:
        say(f"owner  pid {owner.pid}: agent {owner.owner.agent_name} metadata at {owner.owner.endpoint}")
        say(f"reader pid {os.getpid()}: device {cfg.device}")
        raw, export_s = owner.export(specs)
        desc = Descriptor.from_bytes(raw)
        say(
            f"exported lease {desc.lease_id} ({len(raw)}-byte descriptor, payload {desc.payload_bytes} bytes) "
            f"in {export_s * 1e3:.2f} ms"
        )
        t0 = time.perf_counter()
        out = reader.read([raw])
        first_s = time.perf_counter() - t0
        for name, t, (shape, dtype, seed) in zip(names, out, specs, strict=True):
            ok = same_bytes(t.cpu(), make_tensor(shape, dtype, seed))
            nbytes = t.numel() * t.element_size()
            say(
                f"  {name:13s} {str(tuple(t.shape)):16s} {str(t.dtype):15s} {nbytes:>11d} bytes "
                f"{'match' if ok else 'DIFFER'}"
            )
            if not ok:
                return False
        del out
        times = []
        for _ in range(iters):
            t0 = time.perf_counter()
            reader.read([desc])
            if cfg.is_cuda:
                torch.cuda.synchronize(cfg.device)
            times.append(time.perf_counter() - t0)
        owner.release([desc.lease_id])
        stats = owner.stats()
        med = statistics.median(times) if times else first_s
        say(
            f"read: first {first_s * 1e3:.2f} ms (includes metadata fetch and UCX wire-up), "
            f"median of {len(times)} {med * 1e3:.3f} ms = {desc.nbytes / med / 1e9:.2f} GB/s"
        )
        say(f"UCX transport of the READs: {reader.transport(desc)}")
        say(
            f"released: owner has {stats.live_leases} live lease(s), {stats.pool.busy_slots} busy slot(s), "
            f"{stats.pool.idle_slots} idle slot(s) kept registered for reuse"
        )
    say(f"done in {time.perf_counter() - t_start:.2f} s")
    return True
