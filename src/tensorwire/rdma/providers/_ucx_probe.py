"""Best-effort detection of the UCX transport a READ used, from UCX's ``UCX_PROTO_INFO`` tables.

``capture_stdout`` redirects fd 1 around the first READ to each peer (under a lock), parses UCX's table and
writes every other line back to stdout. When nothing is printed the caller keeps its previous answer or
"unknown".
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import re
import sys
import tempfile
import threading
from collections.abc import Iterator
from typing import NamedTuple

_LOCK = threading.Lock()
# "... into host memory from host", "... into cuda/GPU0 from cuda/dev[1]" (UCX 1.23 on an H200)
_HEADER = re.compile(r"remote memory read by \S+ into (\S+)(?: memory)? from (\S+)")
_TRANSPORT = re.compile(r"\b([a-z][a-z0-9_]*/[A-Za-z0-9_:.\-]+)")
_TABLE_LINE = re.compile(r"^\[[\d.]+\]\s+\[[^\]]*\]\s+[|+]")
_MEM = {"host": "DRAM", "cuda": "VRAM", "rocm": "VRAM", "cuda-managed": "VRAM"}

try:
    _libc: ctypes.CDLL | None = ctypes.CDLL(None)
except OSError:  # pragma: no cover - no libc symbols (unusual interpreters)
    _libc = None


def _flush_c_stdio() -> None:
    if _libc is not None:
        _libc.fflush(None)


class MemPair(NamedTuple):
    """The memory types of a READ: where it lands and where it reads from ("DRAM"/"VRAM")."""

    local: str
    remote: str


class Capture:
    def __init__(self) -> None:
        self.text = ""


@contextlib.contextmanager
def capture_stdout() -> Iterator[Capture]:
    """Redirect fd 1 to a temp file for the block; ``Capture.text`` holds what was written."""
    cap = Capture()
    with _LOCK:
        try:
            sys.stdout.flush()
        except (AttributeError, ValueError, OSError):
            pass
        _flush_c_stdio()
        saved = os.dup(1)
        tmp = tempfile.TemporaryFile()
        try:
            os.dup2(tmp.fileno(), 1)
            try:
                yield cap
            finally:
                _flush_c_stdio()
                os.dup2(saved, 1)
                tmp.seek(0)
                cap.text = tmp.read().decode("utf-8", "replace")
        finally:
            os.close(saved)
            tmp.close()
        rest = [line for line in cap.text.splitlines(keepends=True) if not _TABLE_LINE.match(line)]
        if rest:
            os.write(1, "".join(rest).encode())


def parse_read_tables(text: str) -> dict[MemPair, str]:
    """{(local mem, remote mem): "tl/dev[+tl/dev]"} for every READ table in ``text``. "DRAM"/"VRAM" names."""
    out: dict[MemPair, str] = {}
    current: MemPair | None = None
    found: list[str] = []
    emulated = False
    for line in text.splitlines():
        if "|" not in line:
            continue
        line = line[line.index("|") :]
        m = _HEADER.search(line)
        if m:
            if current and found:
                out[current] = _name(found, emulated)
            current = MemPair(_mem_name(m.group(1)), _mem_name(m.group(2)))
            found, emulated = [], False
            continue
        if current is None:
            continue
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) >= 3 and ".." in cells[0]:
            if "emulation" in cells[1]:
                emulated = True
            for t in _TRANSPORT.findall(cells[-1]):
                if t not in found:
                    found.append(t)
    if current and found:
        out[current] = _name(found, emulated)
    return out


def _mem_name(text: str) -> str:
    """UCX memory type words ("host", "cuda", "cuda/GPU0", "cuda/dev[1]") -> "DRAM"/"VRAM"."""
    low = text.strip(" |").lower()
    if low.startswith("host"):
        return "DRAM"
    if low.startswith(("cuda", "rocm", "ze")):
        return "VRAM"
    return _MEM.get(low, low)


def _name(found: list[str], emulated: bool) -> str:
    return "+".join(found) + (" (emulated over active messages)" if emulated else "")


def is_slow_for_gpu(transport: str) -> bool:
    """True when a VRAM READ went over a host-staged or TCP path instead of cuda_ipc / an RDMA NIC."""
    return "tcp" in transport or "emulated" in transport
