"""Resource samples of a process, read from /proc (Linux): open fds, threads, RSS."""

from __future__ import annotations

import ipaddress
import os
import threading
from typing import Any

from tensorwire._loopback import proc_addr


def sample(pid: int | None = None) -> dict[str, Any]:
    """{"fds", "threads", "rss_bytes", "fd_kinds", "socket_details", "sockets", "native_threads"}; -1 where /proc
    cannot be read."""
    pid = os.getpid() if pid is None else pid
    listed = _fd_targets(pid)
    details = socket_details(pid, listed)
    out: dict[str, Any] = {
        "fds": -1 if listed is None else listed[0],
        "threads": -1,
        "rss_bytes": -1,
        "fd_kinds": fd_kinds(pid, listed),
        "socket_details": details,
        "sockets": _count_kinds(details),
        "native_threads": native_threads(pid),
    }
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


def _fd_targets(pid: int) -> tuple[int, list[str]] | None:
    """How many fds ``pid`` has open and where each still open one links (/proc/PID/fd); None if unreadable."""
    try:
        names = os.listdir(f"/proc/{pid}/fd")
    except OSError:
        return None
    targets = []
    for fd in names:
        try:
            targets.append(os.readlink(f"/proc/{pid}/fd/{fd}"))
        except OSError:  # closed meanwhile
            continue
    return len(names), targets


def fd_kinds(pid: int | None = None, listed: tuple[int, list[str]] | None = None) -> dict[str, int]:
    """Open fds by kind (socket, pipe, anon_inode, shm, file, ...): names what grew when fds did. ``listed``:
    ``_fd_targets(pid)`` when the caller has it."""
    pid = os.getpid() if pid is None else pid
    listed = listed if listed is not None else _fd_targets(pid)
    kinds: dict[str, int] = {}
    for target in listed[1] if listed is not None else ():
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


# /proc/net/netlink's protocol column, named where known (4: the socket-owner lookups of tensorwire._loopback,
# which pools its sockets), others by number
_NETLINK_PROTOCOLS = {"0": "route", "4": "sock_diag"}


def _rows(pid: int, table: str) -> list[list[str]]:
    """The rows of /proc/PID/net/<table> past its header, split on blanks; none if unreadable."""
    try:
        with open(f"/proc/{pid}/net/{table}") as f:
            next(f, None)
            return [line.split() for line in f]
    except OSError:
        return []


def _addr(text: str) -> str:
    """``/proc/net/tcp``'s ``0100007F:1F90`` (or tcp6's 32 hex digits) as ``127.0.0.1:8080`` (``[::1]:8080``);
    the text itself when it does not parse."""
    try:
        raw, port = proc_addr(text)
        size = len(text.partition(":")[0]) // 2  # 4 or 16 bytes (proc_addr pads to 16)
        ip = ipaddress.ip_address(raw[:size])
    except ValueError:
        return text
    return f"{ip}:{port}" if size == 4 else f"[{ip}]:{port}"


def _socket_table(pid: int) -> dict[str, tuple[str, str]]:
    """Every socket of ``pid``'s network namespace by inode: (kind and state, what names it: the local and remote
    addresses, or a unix socket's path)."""
    by_inode: dict[str, tuple[str, str]] = {}
    for table in ("tcp", "tcp6"):
        for cols in _rows(pid, table):
            if len(cols) > 9:
                state = "tcp:" + _TCP_STATES.get(cols[3].upper(), cols[3].lower())
                by_inode[cols[9]] = (state, f"{_addr(cols[1])} -> {_addr(cols[2])}")
    # (table, inode column): the unix table's inode is its 7th column (its path the 8th), the others' their 10th
    for table, ix in (("udp", 9), ("udp6", 9), ("netlink", 9), ("raw", 9), ("raw6", 9), ("unix", 6)):
        for cols in _rows(pid, table):
            if len(cols) > ix and cols[ix] not in by_inode:
                if table == "unix":
                    where = cols[7] if len(cols) > 7 else "(unnamed)"
                    kind = "unix"
                elif table == "netlink":
                    where = f"protocol {cols[1]}"
                    kind = f"netlink:{_NETLINK_PROTOCOLS.get(cols[1], cols[1])}"
                else:
                    where = f"{_addr(cols[1])} -> {_addr(cols[2])}"
                    kind = table.rstrip("6")
                by_inode[cols[ix]] = (kind, where)
    return by_inode


def socket_details(pid: int | None = None, listed: tuple[int, list[str]] | None = None) -> dict[str, str]:
    """Each open socket of ``pid`` as ``{inode: "kind[:state] where"}`` (``socket_states``' kinds, with the
    addresses or path): what a grown count does not say, e.g. whose port a stray listener holds."""
    pid = os.getpid() if pid is None else pid
    table = _socket_table(pid)
    listed = listed if listed is not None else _fd_targets(pid)
    out: dict[str, str] = {}
    for target in listed[1] if listed is not None else ():
        if target.startswith("socket:["):
            inode = target[8:-1]
            kind, where = table.get(inode, ("other", ""))
            out[inode] = f"{kind} {where}".strip()
    return out


def socket_states(pid: int | None = None, listed: tuple[int, list[str]] | None = None) -> dict[str, int]:
    """Open sockets by kind and state: ``tcp:established`` (the peer still has its end open), ``tcp:close_wait``
    (the peer closed, this process has not: what a leak of a server's connections looks like), ``tcp:listen``,
    ``unix``, ``udp``, ``netlink:<protocol>`` (``netlink:sock_diag``: ``tensorwire._loopback``'s pooled lookup
    sockets), ``raw``, ``other``. From /proc/PID/net/*, matched by inode. ``listed``:
    ``_fd_targets(pid)`` when the caller has it."""
    return _count_kinds(socket_details(pid, listed))


def _count_kinds(details: dict[str, str]) -> dict[str, int]:
    out: dict[str, int] = {}
    for desc in details.values():
        kind = desc.split(" ", 1)[0]
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
