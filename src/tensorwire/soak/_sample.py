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
        "sockets": socket_states(pid),
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


_TCP_STATES = {
    "01": "established",
    "02": "syn_sent",
    "03": "syn_recv",
    "04": "fin_wait1",
    "05": "fin_wait2",
    "06": "time_wait",
    "07": "close",
    "08": "close_wait",
    "09": "last_ack",
    "0A": "listen",
    "0B": "closing",
}


def socket_states(pid: int | None = None) -> dict[str, int]:
    """Open sockets by kind and state: ``tcp:established`` (the peer still has its end open), ``tcp:close_wait``
    (the peer closed, this process has not: what a leak of a server's connections looks like), ``tcp:listen``,
    ``unix``, ``udp``, ``netlink``, ``raw``, ``other``. From /proc/PID/net/*, matched by inode."""
    pid = os.getpid() if pid is None else pid
    by_inode: dict[str, str] = {}
    for table in ("tcp", "tcp6"):
        try:
            with open(f"/proc/{pid}/net/{table}") as f:
                next(f, None)
                for line in f:
                    cols = line.split()
                    if len(cols) > 9:
                        by_inode[cols[9]] = "tcp:" + _TCP_STATES.get(cols[3].upper(), cols[3].lower())
        except OSError:
            pass
    for table, ix in (("udp", 9), ("udp6", 9), ("netlink", 9), ("raw", 9), ("raw6", 9)):
        try:
            with open(f"/proc/{pid}/net/{table}") as f:
                next(f, None)
                for line in f:
                    cols = line.split()
                    if len(cols) > ix:
                        by_inode.setdefault(cols[ix], table.rstrip("6"))
        except OSError:
            pass
    try:
        with open(f"/proc/{pid}/net/unix") as f:
            next(f, None)
            for line in f:
                cols = line.split()
                if len(cols) > 6:
                    by_inode.setdefault(cols[6], "unix")
    except OSError:
        pass
    out: dict[str, int] = {}
    try:
        names = os.listdir(f"/proc/{pid}/fd")
    except OSError:
        return out
    for fd in names:
        try:
            target = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:
            continue
        if target.startswith("socket:["):
            kind = by_inode.get(target[8:-1], "other")
            out[kind] = out.get(kind, 0) + 1
    return out


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
