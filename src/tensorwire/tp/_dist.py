"""broadcast_cpu: the torch.distributed-facing entry point (broadcaster inside a node, torch.distributed across).

The route is decided once per process group, by the whole group: every rank contributes (its requested route,
host identity, LOCAL_WORLD_SIZE) through ``all_gather_object``, every rank evaluates everyone's choice from the
same gathered list, and a disagreement raises ``BroadcastError(reason=PATH_DISAGREEMENT)`` on every rank instead of
leaving some ranks on the sockets and others in a collective (which would hang or corrupt data).
"""

from __future__ import annotations

import logging
import os
import secrets
import socket
import threading
from typing import Any

import torch

from tensorwire.errors import BootstrapError, BroadcastError, ConfigError, Reason

from ._broadcaster import CpuTpBroadcaster
from ._frame import (
    HEADER,
    KIND_DATA,
    allocate,
    byte_view,
    decode_header,
    decode_table,
    encode_prefix,
    flatten,
    unflatten,
)

log = logging.getLogger(__name__)

ENV_PATH = "TENSORWIRE_BROADCAST_PATH"  # auto | local | dist
ENV_BACKEND = "TENSORWIRE_BROADCAST_BACKEND"  # auto | uds | shm, for the local route
_routes: dict[int, tuple[str, CpuTpBroadcaster | None]] = {}
_lock = threading.Lock()


def _host_id() -> str:
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
    except OSError:
        boot = ""
    return f"{socket.gethostname()}/{boot}"


def _choice(requested: str, same_host: bool, fits: bool) -> str:
    if requested == "dist":
        return "dist"
    if same_host and fits:
        return "local"
    return "impossible-local" if requested == "local" else "dist"


def _decide(group: Any, rank: int, world: int) -> tuple[str, CpuTpBroadcaster | None]:
    import torch.distributed as dist

    requested = os.environ.get(ENV_PATH, "auto") or "auto"
    if requested not in ("auto", "local", "dist"):
        raise ConfigError(f"{ENV_PATH} must be auto, local or dist, got {requested!r}")
    lws_raw = os.environ.get("LOCAL_WORLD_SIZE")
    lws = int(lws_raw) if lws_raw and lws_raw.isdigit() else None
    token = secrets.token_hex(8) if rank == 0 else ""
    gathered: list[Any] = [None] * world
    dist.all_gather_object(gathered, (requested, _host_id(), lws, token), group=group)
    same_host = len({g[1] for g in gathered}) == 1
    choices = [_choice(g[0], same_host, same_host and (g[2] is None or world <= g[2])) for g in gathered]
    if len(set(choices)) != 1 or choices[0] == "impossible-local":
        raise BroadcastError(
            f"rank {rank}: broadcast_cpu ranks disagree on the path (per rank: {choices}; "
            f"{ENV_PATH} per rank: {[g[0] for g in gathered]}, same host: {same_host})",
            reason=Reason.PATH_DISAGREEMENT,
        )
    if choices[0] == "dist":
        log.info("broadcast_cpu rank %d/%d: torch.distributed fallback", rank, world)
        return "dist", None
    session = f"dist-{gathered[0][3]}"
    err: BaseException | None = None
    bcast = None
    try:
        bcast = CpuTpBroadcaster(rank, world, session, backend=os.environ.get(ENV_BACKEND, "auto") or "auto")
    except BroadcastError as exc:
        err = exc
    # Every rank learns whether every other rank came up, so none is left on a half-built star.
    status: list[Any] = [None] * world
    dist.all_gather_object(status, None if err is None else f"{type(err).__name__}: {err}", group=group)
    failed = {r: s for r, s in enumerate(status) if s is not None}
    if failed:
        if bcast is not None:
            bcast.close()
        raise BootstrapError(
            f"rank {rank}: broadcast_cpu set-up failed on ranks {sorted(failed)}: {failed}",
            reason=Reason.BOOTSTRAP_FAILED,
        ) from err
    return "local", bcast


def broadcast_cpu(value: Any, group: Any = None, src: int = 0) -> Any:
    """Broadcast CPU tensors (a tensor or a flat list/tuple/dict of tensors) from group rank 0.

    Inside one node the group's ranks use a :class:`CpuTpBroadcaster` (created on first use, cached per group);
    across nodes a torch.distributed broadcast of one self-describing frame gives the same results. Call on every
    rank of ``group`` in the same order; non-zero ranks pass ``None``. Only ``src=0`` is supported (on both paths).
    """
    import torch.distributed as dist

    if src != 0:
        raise ConfigError(f"broadcast_cpu supports only src=0 (group rank 0), got src={src}")
    if not dist.is_available() or not dist.is_initialized():
        raise ConfigError("broadcast_cpu needs an initialized torch.distributed process group")
    g = group if group is not None else dist.group.WORLD
    world = dist.get_world_size(g)
    rank = dist.get_rank(g)
    if world == 1:
        flatten(value, rank)
        return value
    key = id(g)
    with _lock:
        route = _routes.get(key)
        if route is None:
            route = _decide(g, rank, world)
            _routes[key] = route
    kind, bcast = route
    if kind == "local":
        assert bcast is not None
        return bcast.broadcast(value)
    return _dist_broadcast(value, g, rank)


def _dist_broadcast(value: Any, group: Any, rank: int) -> Any:
    import torch.distributed as dist

    src = dist.get_global_rank(group, 0) if group is not dist.group.WORLD else 0
    device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend(group) == "nccl" else None
    size = torch.zeros(1, dtype=torch.int64)
    if rank == 0:
        structure, keys, tensors = flatten(value, 0)
        prefix, offsets, payload = encode_prefix(KIND_DATA, 0, structure, keys, tensors, 1)
        frame = torch.empty(len(prefix) + payload, dtype=torch.uint8)
        fv = byte_view(frame)
        fv[: len(prefix)] = prefix
        for t, off in zip(tensors, offsets, strict=True):
            tv = byte_view(t)
            if len(tv):
                fv[len(prefix) + off : len(prefix) + off + len(tv)] = tv
        size[0] = frame.numel()
    _bcast(size, src, group, device)
    if rank != 0:
        frame = torch.empty(int(size[0]), dtype=torch.uint8)
    _bcast(frame, src, group, device)
    if rank == 0:
        return value
    fv = byte_view(frame)
    kind, _seq, n, table_bytes, payload, structure = decode_header(fv[: HEADER.size], rank)
    entries = decode_table(fv[HEADER.size : HEADER.size + table_bytes], n, payload, rank)
    from ._frame import Layout

    layout = Layout(kind, 0, structure, entries, table_bytes, payload)
    tensors = allocate(layout)
    pbase = HEADER.size + table_bytes
    for e, t in zip(entries, tensors, strict=True):
        if e.nbytes:
            byte_view(t)[:] = fv[pbase + e.offset : pbase + e.offset + e.nbytes]
    return unflatten(structure, entries, tensors)


def _bcast(t: torch.Tensor, src: int, group: Any, device: torch.device | None) -> None:
    import torch.distributed as dist

    if device is None:
        dist.broadcast(t, src=src, group=group)
        return
    staged = t.to(device)
    dist.broadcast(staged, src=src, group=group)
    t.copy_(staged.cpu())


def shutdown_broadcast_cpu() -> None:
    """Close every broadcaster that broadcast_cpu created (call before destroying the process groups)."""
    with _lock:
        routes = list(_routes.values())
        _routes.clear()
    for _, bcast in routes:
        if bcast is not None:
            bcast.close()
