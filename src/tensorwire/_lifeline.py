"""Children that die with their parent, however the parent dies (SIGKILL included): no orphaned workers.

A parent that is SIGKILLed runs no ``finally`` and no ``atexit``, so the children it started (the demo's workers
and proxy, the soak's workers and clients) would keep running, holding ports, memory and GPU slots. Two
mechanisms, both armed in every child the CLI starts:

1. **A lifeline pipe.** The parent creates one pipe and keeps its write end (never written to; not inheritable,
   so no other child holds it). Each child gets the read end and a daemon thread blocked reading it. When the
   parent dies, the kernel closes the write end and the read returns EOF: the child exits at once
   (``os._exit(EXIT_ORPHANED)``). For ``multiprocessing`` spawn children the parent sentinel multiprocessing
   already passes is such a pipe, so ``follow_parent`` watches that.
2. **PR_SET_PDEATHSIG(SIGKILL)** (Linux, ``prctl`` through ctypes): the kernel SIGKILLs the child when its
   parent exits, even while the child's Python cannot run (a long native call holding the GIL). The kernel ties
   it to the parent *thread* that forked the child, so it is armed only when that was the parent's main thread
   (the parent says so); after arming, the child checks ``getppid()`` in case the parent died before.

Parent side: ``parent_lifeline().popen_kwargs(env)`` for ``subprocess.Popen``; ``child_env()`` for
``multiprocessing`` children (they call ``follow_parent``). Child side: ``arm_from_env()`` (the CLI's ``main``
calls it first thing) or ``follow_parent()``. A top-level private module (stdlib only) because every layer that
starts processes uses it: the CLI, the soak, ``tensorwire.testing``.
"""

from __future__ import annotations

import ctypes
import logging
import os
import signal
import sys
import threading
from collections.abc import Mapping, MutableMapping
from typing import Any

log = logging.getLogger(__name__)

ENV_FD = "TENSORWIRE_LIFELINE_FD"
ENV_PPID = "TENSORWIRE_LIFELINE_PPID"
ENV_PDEATHSIG = "TENSORWIRE_LIFELINE_PDEATHSIG"
EXIT_ORPHANED = 70  # what an orphaned child exits with (it never gets to report it; for strace and tests)
_PR_SET_PDEATHSIG = 1


class Lifeline:
    """The parent's end: one pipe shared by every child (each child sees EOF when the parent is gone)."""

    def __init__(self) -> None:
        self._r, self._w = os.pipe()  # both non-inheritable (PEP 446); the read end goes out via pass_fds only

    def child_env(self) -> dict[str, str]:
        """Environment entries telling a child to arm PR_SET_PDEATHSIG (when it is safe, see the module docstring)."""
        main = threading.current_thread() is threading.main_thread()
        return {ENV_PPID: str(os.getpid()), ENV_PDEATHSIG: "1" if main else "0"}

    def popen_kwargs(self, env: Mapping[str, str]) -> dict[str, Any]:
        """``env`` and ``pass_fds`` for ``subprocess.Popen`` of a CLI child (call from the thread that spawns)."""
        return {"env": {**env, **self.child_env(), ENV_FD: str(self._r)}, "pass_fds": (self._r,)}


_parent: Lifeline | None = None
_parent_lock = threading.Lock()


def parent_lifeline() -> Lifeline:
    """This process's lifeline, made once; it lives as long as the process (its death is the signal)."""
    global _parent
    with _parent_lock:
        if _parent is None:
            _parent = Lifeline()
        return _parent


def set_pdeathsig(expected_parent: int | None = None) -> bool:
    """Asks the kernel to SIGKILL this process when its parent (thread) exits; False where prctl is missing.
    Exits at once when the parent is already gone (``getppid()`` is no longer ``expected_parent``)."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        if libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0) != 0:
            return False
    except (OSError, AttributeError):
        return False
    if expected_parent is not None and os.getppid() != expected_parent:
        _orphaned(f"parent {expected_parent} died before this process armed PR_SET_PDEATHSIG")
    return True


def _orphaned(why: str) -> None:
    try:
        os.write(2, f"tensorwire: {why}; exiting (pid {os.getpid()})\n".encode())
    finally:
        os._exit(EXIT_ORPHANED)


def _watch_fd(fd: int, parent: int | None) -> None:
    def run() -> None:
        try:
            while os.read(fd, 1):  # nobody writes; bytes would only mean a foreign writer, keep waiting
                pass
        except OSError:
            pass
        _orphaned(f"parent {parent or '?'} is gone (lifeline closed)")

    threading.Thread(target=run, name="tensorwire-lifeline", daemon=True).start()


def arm_from_env(environ: MutableMapping[str, str] | None = None) -> bool:
    """In a CLI child: arm both mechanisms from the variables ``Lifeline.popen_kwargs`` set; True when armed.

    The variables are removed, so this process's own children are not mistaken for ours."""
    env = os.environ if environ is None else environ
    fd_text, ppid_text = env.pop(ENV_FD, None), env.pop(ENV_PPID, None)
    pdeathsig = env.pop(ENV_PDEATHSIG, "0") == "1"
    if fd_text is None:
        return False
    parent = int(ppid_text) if ppid_text and ppid_text.isdigit() else None
    if pdeathsig:
        set_pdeathsig(parent)
    try:
        fd = int(fd_text)
        os.fstat(fd)
    except (ValueError, OSError):
        log.warning("lifeline fd %r is not open here; only PR_SET_PDEATHSIG protects this process", fd_text)
        return pdeathsig
    _watch_fd(fd, parent)
    return True


def follow_parent(pdeathsig: bool | None = None) -> bool:
    """In a ``multiprocessing`` spawn child: exit when the parent dies. ``pdeathsig`` None reads the variable
    ``Lifeline.child_env`` set (passed in the child's environment by the caller)."""
    import multiprocessing as mp

    parent = mp.parent_process()
    if parent is None:
        return False
    if pdeathsig is None:
        pdeathsig = os.environ.pop(ENV_PDEATHSIG, "0") == "1"
        os.environ.pop(ENV_PPID, None)
    if pdeathsig:
        set_pdeathsig(parent.pid)
    sentinel = getattr(parent, "sentinel", None)
    if sentinel is None:
        return pdeathsig
    from multiprocessing.connection import wait

    def run() -> None:
        wait([sentinel])
        _orphaned(f"parent {parent.pid} is gone")

    threading.Thread(target=run, name="tensorwire-lifeline", daemon=True).start()
    return True


__all__ = ["ENV_FD", "EXIT_ORPHANED", "Lifeline", "arm_from_env", "follow_parent", "parent_lifeline", "set_pdeathsig"]
