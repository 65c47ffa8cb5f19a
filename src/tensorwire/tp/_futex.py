"""Linux futex wait/wake on a 32-bit word of a shared mapping, through ``syscall(2)`` (ctypes; no extension).

``wait(addr, seen, timeout_s)`` returns at once when the word no longer holds ``seen`` (atomic with ``wake``),
so a writer that stores, then wakes, never loses a sleeper. ``AVAILABLE`` is False off Linux or on an unknown
architecture (the ring then wakes by socket). The calls release the GIL.
"""

from __future__ import annotations

import ctypes
import mmap
import platform
import sys
from typing import Any

_FUTEX_WAIT, _FUTEX_WAKE = 0, 1
_SYS_FUTEX = {"x86_64": 202, "amd64": 202, "aarch64": 98, "arm64": 98}.get(platform.machine().lower(), 0)
WAKE_ALL = 0x7FFFFFFF


class _Timespec(ctypes.Structure):
    _fields_ = [("tv_sec", ctypes.c_long), ("tv_nsec", ctypes.c_long)]


def _load() -> Any:
    if not sys.platform.startswith("linux") or not _SYS_FUTEX:
        return None
    try:
        fn = ctypes.CDLL(None, use_errno=True).syscall
    except (OSError, AttributeError):
        return None
    fn.restype = ctypes.c_long
    return fn


_syscall = _load()
AVAILABLE = _syscall is not None


def address_of(mm: mmap.mmap, offset: int) -> int:
    """The address of byte ``offset`` of a writable mapping (valid until it is unmapped; no buffer export kept)."""
    base = ctypes.c_char.from_buffer(mm)
    try:
        return ctypes.addressof(base) + offset
    finally:
        del base  # drop the export at once, so the mapping can still be closed


def wait(addr: int, seen: int, timeout_s: float) -> None:
    """Sleep while the u32 at ``addr`` holds ``seen`` (its low 32 bits), for at most ``timeout_s``.

    Returns on a wake, a timeout, a signal or a changed word alike: callers re-check their condition."""
    ts = _Timespec(int(timeout_s), int((timeout_s % 1.0) * 1e9))
    _syscall(
        ctypes.c_long(_SYS_FUTEX),
        ctypes.c_void_p(addr),
        ctypes.c_int(_FUTEX_WAIT),
        ctypes.c_uint(seen & 0xFFFFFFFF),
        ctypes.byref(ts),
        None,
        ctypes.c_int(0),
    )


def wake(addr: int, n: int = WAKE_ALL) -> int:
    """Wake up to ``n`` waiters on the u32 at ``addr``; returns how many were woken (-1 on an error)."""
    return int(
        _syscall(
            ctypes.c_long(_SYS_FUTEX),
            ctypes.c_void_p(addr),
            ctypes.c_int(_FUTEX_WAKE),
            ctypes.c_int(n),
            None,
            None,
            ctypes.c_int(0),
        )
    )
