"""Hostile local processes for the bootstrap tests: forked children that drop to another uid (the tests run as
root; ``nobody`` by default) or stay ours, and connect to, squat on or pre-create what a broadcaster group uses.

Each ``Hostile`` is one forked child that does its act, reports "ready" (or an error) on a pipe, and then holds
what it made (a connection, a listener) until ``stop()`` closes its control pipe. The child runs only socket and
os calls, then ``os._exit``: nothing of the parent's state (threads, logging) is used after the fork.
"""

from __future__ import annotations

import os
import select
import socket
import time
from collections.abc import Callable

NOBODY = 65534


def _drop_to(uid: int) -> None:
    if uid != os.geteuid():
        os.setgroups([])
        os.setgid(uid)
        os.setuid(uid)


def connect_retrying(address: str | bytes, deadline_s: float = 60.0) -> socket.socket:
    """Connect to a listener that may not be bound yet (ECONNREFUSED / ENOENT until it is)."""
    end = time.monotonic() + deadline_s
    while True:
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            s.connect(address)
            return s
        except OSError:
            s.close()
            if time.monotonic() > end:
                raise
            time.sleep(0.01)


class Hostile:
    """``act()`` runs in a child as ``uid``; it returns what to keep open until ``stop()``."""

    def __init__(self, uid: int, act: Callable[[], object], timeout_s: float = 60.0) -> None:
        status_r, status_w = os.pipe()
        control_r, control_w = os.pipe()
        pid = os.fork()
        if pid == 0:  # the child
            code = 0
            try:
                os.close(status_r)
                os.close(control_w)
                _drop_to(uid)
                kept = act()
                os.write(status_w, b"ready")
                os.read(control_r, 1)  # until the parent closes the pipe (or dies)
                del kept
            except BaseException as exc:  # report it; never return into the parent's code
                try:
                    os.write(status_w, f"error {type(exc).__name__}: {exc}".encode()[:512])
                except OSError:
                    pass
                code = 1
            os._exit(code)
        os.close(status_w)
        os.close(control_r)
        self.pid = pid
        self._control = control_w
        ready, _, _ = select.select([status_r], [], [], timeout_s)
        msg = os.read(status_r, 512).decode() if ready else "no report"
        os.close(status_r)
        if msg != "ready":
            self.stop()
            raise AssertionError(f"hostile child (uid {uid}) failed: {msg}")

    def stop(self) -> None:
        if self._control >= 0:
            os.close(self._control)
            self._control = -1
        end = time.monotonic() + 10
        while time.monotonic() < end:
            done, _ = os.waitpid(self.pid, os.WNOHANG)
            if done:
                return
            time.sleep(0.02)
        os.kill(self.pid, 9)
        os.waitpid(self.pid, 0)


def hold_connection(address: str | bytes, send: bytes = b"") -> Callable[[], object]:
    """Connect (waiting for the listener), send ``send``, then hold the connection open. Rank 0 may have dropped
    the connection before the bytes go out (it drops another uid's at accept): a refused send is part of the act."""

    def act() -> object:
        s = connect_retrying(address)
        if send:
            try:
                s.sendall(send)
            except (BrokenPipeError, ConnectionResetError):
                pass
        return s

    return act


def squat(address: bytes, listen: bool = True) -> Callable[[], object]:
    """Bind an abstract name first (and listen on it, never accepting)."""

    def act() -> object:
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        s.bind(address)
        if listen:
            s.listen(64)
        return s

    return act


def make_dir(path: str, mode: int = 0o777) -> Callable[[], object]:
    """Create a directory (as whoever runs the act)."""

    def act() -> object:
        os.mkdir(path)
        os.chmod(path, mode)
        return None

    return act
