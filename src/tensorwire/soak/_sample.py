"""Resource samples of a process, read from /proc (Linux): open fds, threads, RSS."""

from __future__ import annotations

import os
import threading
from typing import Any


def sample(pid: int | None = None) -> dict[str, Any]:
    """{"fds": int, "threads": int, "rss_bytes": int}; -1 where /proc cannot be read."""
    pid = os.getpid() if pid is None else pid
    out: dict[str, Any] = {"fds": -1, "threads": -1, "rss_bytes": -1}
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


def thread_names() -> list[str]:
    """Python-level thread names of this process (for naming a leak)."""
    return sorted(t.name for t in threading.enumerate())


__all__ = ["sample", "thread_names"]
