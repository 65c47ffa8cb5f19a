"""Resource samples of a process, read from /proc (Linux): open fds, threads, RSS."""

from __future__ import annotations

import os
import threading
from typing import Any


def sample(pid: int | None = None) -> dict[str, Any]:
    """{"fds", "threads", "rss_bytes", "fd_kinds"}; -1 where /proc cannot be read."""
    pid = os.getpid() if pid is None else pid
    out: dict[str, Any] = {
        "fds": -1,
        "threads": -1,
        "rss_bytes": -1,
        "fd_kinds": fd_kinds(pid),
        "native_threads": native_threads(pid),
    }
    try:
        out["fds"] = len(os.listdir(f"/proc/{pid}/fd"))
    except OSError:
        pass
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("Threads:"):
                    out["threads"] = int(line.split()[1])
                elif line.startswith("VmRSS:"):
                    out["rss_bytes"] = int(line.split()[1]) * 1024
    except OSError:
        if pid == os.getpid():
            out["threads"] = threading.active_count()
    return out


def fd_kinds(pid: int | None = None) -> dict[str, int]:
    """Open fds by kind (socket, pipe, anon_inode, shm, file, ...): names what grew when fds did."""
    pid = os.getpid() if pid is None else pid
    kinds: dict[str, int] = {}
    try:
        names = os.listdir(f"/proc/{pid}/fd")
    except OSError:
        return kinds
    for fd in names:
        try:
            target = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:
            continue
        if target.startswith("/dev/shm/"):
            kind = "shm"
        elif target.startswith("/"):
            kind = "file"
        else:
            kind = target.split(":", 1)[0]
        kinds[kind] = kinds.get(kind, 0) + 1
    return kinds


def native_threads(pid: int | None = None) -> dict[str, int]:
    """Threads by kernel name (/proc/PID/task/*/comm): names native threads (gRPC, UCX, torch) Python cannot."""
    pid = os.getpid() if pid is None else pid
    names: dict[str, int] = {}
    try:
        tasks = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return names
    for tid in tasks:
        try:
            with open(f"/proc/{pid}/task/{tid}/comm") as f:
                name = f.read().strip()
        except OSError:
            continue
        names[name] = names.get(name, 0) + 1
    return names


def thread_names() -> list[str]:
    """Python-level thread names of this process (for naming a leak)."""
    return sorted(t.name for t in threading.enumerate())


__all__ = ["fd_kinds", "native_threads", "sample", "thread_names"]
