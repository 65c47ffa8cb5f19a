"""UCX/NIXL environment defaults, set in one place before the first NIXL agent (UCX reads them at context init).

Each is ``os.environ.setdefault``: an operator's explicit value always wins. They are process-wide and the first
agent of the process fixes them, so a process that mixes CPU and CUDA roles should create its CUDA one first.
Never set here: ``UCX_NET_DEVICES``/``UCX_TLS`` (the library must not assume one host or one NIC; tests and the demo
restrict UCX to loopback themselves).
"""

from __future__ import annotations

import os
import sys

#: Glob UCX_PROTO_INFO accepts: print only the "remote memory read" protocol tables (once per endpoint config),
#: which the provider captures to report the transport a READ used. Small enough to be harmless if it leaks.
PROTO_INFO_GLOB = "*memory read*"


def _cuda_initialized() -> bool:
    """A CPU-side agent in a process that already uses CUDA keeps UCX memory events (its GPU agents need them)."""
    torch = sys.modules.get("torch")
    try:
        return bool(torch is not None and torch.cuda.is_initialized())
    except Exception:  # a broken CUDA install counts as "not in use"
        return False


def quiet_nixl() -> None:
    """NIXL's Python logger reads NIXL_LOG_LEVEL at import: call before ``import nixl``. INFO lines go to stdout."""
    os.environ.setdefault("NIXL_LOG_LEVEL", "WARN")


def apply_defaults(*, cuda: bool, probe_transport: bool = True) -> dict[str, str]:
    """Set the defaults; returns the effective values of the variables we care about (for the startup log)."""
    quiet_nixl()
    if cuda:
        # Without this UCX enables cuda_ipc zero-copy GET only where it detects NVLink; elsewhere (one GPU, PCIe
        # hosts) a same-host VRAM READ silently goes over TCP, ~10^4 x slower (nixl-on-h200.md). CUDA only:
        # without the cuda module loaded UCX warns about an unused variable.
        os.environ.setdefault("UCX_CUDA_IPC_ENABLE_GET_ZCOPY", "y")
    elif not _cuda_initialized():
        # UCM's mmap hooks cost ~400 ms per agent start on CPU hosts. On GPU keep them: UCX needs memory
        # events to keep its registration / memory-type caches right when CUDA memory is freed.
        os.environ.setdefault("UCX_MEM_EVENTS", "no")
    if probe_transport:
        os.environ.setdefault("UCX_PROTO_INFO", PROTO_INFO_GLOB)
    keys = (
        "NIXL_LOG_LEVEL",
        "UCX_CUDA_IPC_ENABLE_GET_ZCOPY",
        "UCX_MEM_EVENTS",
        "UCX_PROTO_INFO",
        "UCX_TLS",
        "UCX_NET_DEVICES",
    )
    return {k: os.environ[k] for k in keys if k in os.environ}
