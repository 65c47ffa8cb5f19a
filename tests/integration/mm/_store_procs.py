"""Processes for the held-outputs tests: one owner (TensorExporter + HeldStore + HeldOutputs over gRPC) and
reader ranks (StagingArea with a real TensorReader, Staging on a unix socket), each driven over a pipe.

Spawned (never forked): each builds its own NIXL agent. ``StoreProcs.close`` asks every child to quit, joins
with a timeout and kills stragglers.
"""

from __future__ import annotations

import multiprocessing as mp
from pathlib import Path
from typing import Any

import torch


def owner_main(conn: Any, device: str, shape: tuple[int, ...], dtype: torch.dtype, segments: bool = False) -> None:
    import os

    from tensorwire.integrations._vllm_ec.receipts import announceable
    from tensorwire.integrations._vllm_ec.segments import SegmentSpares
    from tensorwire.mm.held._rpc import serve_store
    from tensorwire.mm.held._store import HeldStore
    from tensorwire.rdma import RdmaConfig, TensorExporter

    exporter = TensorExporter(RdmaConfig(device=device, slot_gc_timeout_ms=30000))
    spares = SegmentSpares() if segments else None
    store = HeldStore(exporter, ttl_s=30, segments=spares)
    server = serve_store("127.0.0.1:0", store=store)
    conn.send(server.address)
    while True:
        msg = conn.recv()
        if msg[0] == "hold":
            _, key, secret, seed = msg
            g = torch.Generator(device=device).manual_seed(seed)
            t = torch.randn(*shape, generator=g, device=device).to(dtype)
            store.grant(key, secret)
            store.hold(key, [t])
            conn.send(t.cpu())
        elif msg[0] == "stats":
            conn.send((store.stats().held_items, exporter.stats().live_leases))
        elif msg[0] == "lookups":
            conn.send(store.stats().lookups)
        elif msg[0] == "receipt":  # what the vLLM producer puts in the params
            item = store.peek(msg[1])
            conn.send(None if item is None else announceable(item))
        elif msg[0] == "drop":
            conn.send(store.drop(msg[1]))
        elif msg[0] == "segment_fds":  # this process's open host segments (spares made ahead included)
            links = []
            for fd in os.listdir("/proc/self/fd"):
                try:
                    links.append(os.readlink(f"/proc/self/fd/{fd}"))
                except OSError:
                    pass
            conn.send(sum(1 for link in links if link.startswith("/memfd:tw-ec-")))
        elif msg[0] == "spare_bytes":
            conn.send(0 if spares is None else spares.spare_bytes)
        else:
            break
    server.stop(0)
    store.close()
    if spares is not None:
        spares.close()
    exporter.close()


def rank_main(conn: Any, sock: str, device: str) -> None:
    from tensorwire.mm.held._rpc import serve_store
    from tensorwire.mm.held._staging import StagingArea
    from tensorwire.rdma import RdmaConfig, TensorReader

    if device.startswith("cuda"):
        torch.empty(1, device=device)  # the CUDA context before the NIXL agent
    cfg = RdmaConfig(device=device)
    area = StagingArea(lambda: TensorReader(cfg), device=device)
    area.warm_up()
    server = serve_store(f"unix:{sock}", staging=area)
    conn.send("ready")
    while True:
        msg = conn.recv()
        if msg[0] == "get":
            got = area.get(msg[1])
            conn.send(None if got is None else (str(got[0].device), got[0].cpu()))
        elif msg[0] == "keys":
            conn.send(area.keys())
        else:
            break
    server.stop(0)
    area.close()


class StoreProcs:
    """An owner on ``owner_device`` and one rank per entry of ``rank_devices``; ``segments``: the owner's store
    keeps host segments too (the vLLM producer's ``same_host_map``)."""

    def __init__(
        self,
        tmp: Path,
        owner_device: str,
        rank_devices: list[str],
        shape: tuple[int, ...],
        dtype: torch.dtype,
        *,
        segments: bool = False,
    ) -> None:
        ctx = mp.get_context("spawn")
        self.procs: list[Any] = []
        self.owner, child = ctx.Pipe()
        args = (child, owner_device, shape, dtype, segments)
        self.procs.append(ctx.Process(target=owner_main, args=args, daemon=True))
        self.ranks: list[Any] = []
        self.socks = [str(tmp / f"r{i}.sock") for i in range(len(rank_devices))]
        self.devices = rank_devices
        for sock, dev in zip(self.socks, rank_devices, strict=True):
            parent, child = ctx.Pipe()
            self.ranks.append(parent)
            self.procs.append(ctx.Process(target=rank_main, args=(child, sock, dev), daemon=True))
        for p in self.procs:
            p.start()
        try:
            assert self.owner.poll(180), "the owner did not start"
            self.endpoint = self.owner.recv()
            for r in self.ranks:
                assert r.poll(180) and r.recv() == "ready", "a rank did not start"
        except BaseException:
            self.close()
            raise

    def ask(self, conn: Any, *msg: Any) -> Any:
        conn.send(msg)
        assert conn.poll(120), f"no answer to {msg[0]}"
        return conn.recv()

    def close(self) -> None:
        for conn in [self.owner, *self.ranks]:
            try:
                conn.send(("quit",))
            except (OSError, BrokenPipeError):
                pass
        for p in self.procs:
            p.join(30)
            if p.is_alive():
                p.kill()
                p.join(5)
