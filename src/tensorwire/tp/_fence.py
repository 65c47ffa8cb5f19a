"""Memory fences for the shared-memory ring; Python has no memory model, so we bring our own.

The ring publishes with plain 8-byte stores and loads through ``memoryview.cast("Q")`` (an aligned 8-byte memcpy,
one instruction on x86-64 and AArch64, so single-copy atomic). What orders them:

* ``release()`` before a store that publishes earlier writes (payload before the sequence word, reads of a slot
  before the reader's ack); ``acquire()`` after a load that grants access (sequence word before the payload).
* ``full()`` where a store must be visible before a later load (Dekker pattern of the sleep/wake hand-off:
  reader stores "sleeping", then loads the sequence; writer stores the sequence, then loads "sleeping").

Implementation, best first:

1. ``atomic_thread_fence`` from libatomic (GCC's runtime, present wherever GCC-built Python is): a real C11 fence
   (``dmb ish``/``dmb ishld`` on AArch64, ``mfence`` on x86-64), called through ``ctypes.PyDLL``.
2. x86-64 without libatomic: acquire/release are free under TSO (the opaque C calls around them already stop the
   compiler from reordering), and ``full()`` is an uncontended ``threading.Lock`` acquire/release, whose
   ``lock cmpxchg``/``lock xadd`` is a full barrier on x86.
3. Anything else: no fence we can trust, so ``AVAILABLE`` is False and ``backend="auto"`` uses the socket star.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import platform
import threading
from collections.abc import Callable
from typing import Any

_ACQUIRE, _RELEASE, _SEQ_CST = 2, 3, 5
_X86 = platform.machine().lower() in ("x86_64", "amd64", "i386", "i686")


def _noop() -> None:
    return None


def _atomic_thread_fence() -> Any:
    """libatomic's C11 ``atomic_thread_fence(int)``, or None without libatomic."""
    for name in (ctypes.util.find_library("atomic"), "libatomic.so.1"):
        if not name:
            continue
        try:
            fn = ctypes.PyDLL(name).atomic_thread_fence
        except (OSError, AttributeError):
            continue
        fn.argtypes = [ctypes.c_int]
        fn.restype = None
        return fn
    return None


def _load() -> tuple[str, Callable[[], None], Callable[[], None], Callable[[], None]]:
    fn = _atomic_thread_fence()
    if fn is not None:
        if _X86:  # TSO: acquire and release fences compile to nothing; skip the call
            return "libatomic", _noop, _noop, lambda: fn(_SEQ_CST)
        return "libatomic", lambda: fn(_ACQUIRE), lambda: fn(_RELEASE), lambda: fn(_SEQ_CST)
    if _X86:
        lock = threading.Lock()

        def full() -> None:
            lock.acquire()
            lock.release()

        return "x86-lock", _noop, _noop, full
    return "none", _noop, _noop, _noop


KIND, acquire, release, full = _load()
AVAILABLE = KIND != "none"
