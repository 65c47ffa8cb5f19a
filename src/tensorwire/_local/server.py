"""UnixConnServer: what both same-host servers of ``mm`` share (the encoder's control channel, ``server._local``,
and the held-outputs/staging calls, ``_local_rpc``): a private listening socket, same-uid peers only, one thread
per connection up to a cap, a hello, and the stop sequence.

The socket lives in a private directory (``_unix.ensure_private_dir``: 0700, ours) and is 0600; every accepted
peer's SO_PEERCRED uid must be ours (another uid is closed at once, nothing said). A connection over the cap gets
``magic + HELLO_FULL`` and is closed (its client uses gRPC: nothing of it ran); an admitted one gets
``magic + HELLO_OK`` and then belongs to the subclass's ``_serve``, which marks it ``busy`` while it works on a
request.

Stop: ``stop_accepting`` (never waits): the listener goes (its file first: new clients use gRPC), idle
connections are shut down at once, a busy one finishes its answer and then ends. ``close(grace_s)`` waits up to
the grace for those answers, cuts what is left and joins every thread.

``on_event(kind)``: ``refused_uid``, ``refused_full``, ``opened``, ``ended`` (for the owner's metrics).

Client side, :func:`connect`: the same checks from the other end (owner and mode of the advertised path, the
listener's SO_PEERCRED uid) and the hello, for both clients.
"""

from __future__ import annotations

import errno
import logging
import os
import secrets
import socket
import threading
import time
from collections.abc import Callable

from tensorwire._local import unix as _unix
from tensorwire._ratelog import RateLimitedLog

log = logging.getLogger(__name__)

HELLO_OK, HELLO_FULL = 0, 1
# connect() errors that mean "no channel here" (gone, not listening, not reachable for us), not "busy now".
_GONE_ERRNOS = (errno.ENOENT, errno.ECONNREFUSED, errno.ENOTDIR, errno.EACCES, errno.EPERM)
_JOIN_S = 5.0  # a cut connection's thread unwinds at once; this only bounds a bug


class Conn:
    """One admitted connection; ``busy`` (under ``lock``) while its thread works on a request."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.lock = threading.Lock()
        self.busy = False
        self.thread: threading.Thread | None = None

    def set_busy(self, busy: bool) -> None:
        with self.lock:
            self.busy = busy


class UnixConnServer:
    """The listening socket and its connection threads; ``path`` is what clients are told (see the module doc).

    ``path`` empty: ``<directory>/<prefix>-<pid>-<random>.sock``. Subclasses implement ``_serve(conn)`` (after
    the hello; return to end the connection; ``OSError`` is the client going away).
    """

    def __init__(
        self,
        directory: str,
        *,
        prefix: str,
        magic: bytes,
        max_conns: int,
        thread_name: str,
        path: str = "",
        on_event: Callable[[str], None] | None = None,
    ) -> None:
        self._magic = magic
        self._max_conns = max_conns
        self._thread_name = thread_name
        self._on_event = on_event or (lambda _kind: None)
        self.directory = _unix.ensure_private_dir(directory)
        self.path = path or os.path.join(self.directory, f"{prefix}-{os.getpid()}-{secrets.token_hex(4)}.sock")
        self.host_token = _unix.host_token()
        self._listener = _unix.listen(self.path)
        self._lock = threading.Lock()
        self._conns: set[Conn] = set()
        self._stopping = False
        self._rl = RateLimitedLog(log)
        self._acceptor = threading.Thread(target=self._accept_loop, name=thread_name + "-accept", daemon=True)
        self._acceptor.start()

    @property
    def open_connections(self) -> int:
        with self._lock:
            return len(self._conns)

    @property
    def stopping(self) -> bool:
        return self._stopping

    def path_for(self, host_token: str) -> str | None:
        """The socket path for a client on this host (its token is ours), else None (another host, or stopping)."""
        if self._stopping or not self.host_token or host_token != self.host_token:
            return None
        return self.path

    def _serve(self, conn: Conn) -> None:
        raise NotImplementedError

    # -- accept -------------------------------------------------------------------------------------------

    def _accept_loop(self) -> None:
        while True:
            try:
                sock, _ = self._listener.accept()
            except OSError:
                return  # shut down by stop_accepting()
            try:
                self._admit(sock)
            except OSError as exc:
                sock.close()
                self._rl.log(logging.INFO, "accept", "%s: a connection failed at accept: %s", self._thread_name, exc)

    def _admit(self, sock: socket.socket) -> None:
        pid, uid = _unix.peer_uid(sock)
        if uid != os.geteuid():
            self._on_event("refused_uid")  # counted before the peer can see the close: metrics never lag it
            sock.close()
            self._rl.log(
                logging.WARNING,
                "uid",
                "%s: refused a connection from pid %d running as uid %d (we run as uid %d; SO_PEERCRED)",
                self._thread_name,
                pid,
                uid,
                os.geteuid(),
            )
            return
        conn = Conn(sock)
        with self._lock:
            full = self._stopping or len(self._conns) >= self._max_conns
            if not full:
                self._conns.add(conn)
        if full:
            self._on_event("refused_full")
            try:
                _unix.send_frame(sock, self._magic + bytes((HELLO_FULL,)), time.monotonic() + 1.0)
            finally:
                sock.close()
            return
        conn.thread = threading.Thread(target=self._run, args=(conn,), name=self._thread_name, daemon=True)
        conn.thread.start()

    def _run(self, conn: Conn) -> None:
        self._on_event("opened")
        try:
            _unix.send_frame(conn.sock, self._magic + bytes((HELLO_OK,)), time.monotonic() + 5.0)
            self._serve(conn)
        except OSError:
            return  # the client went away, or stop shut the connection down
        finally:
            with self._lock:
                self._conns.discard(conn)
            conn.sock.close()
            self._on_event("ended")

    # -- stop ---------------------------------------------------------------------------------------------

    def stop_accepting(self) -> None:
        """The listener goes (its file first: new clients use gRPC), idle connections end now, busy ones after
        their answer. Never waits. Idempotent."""
        with self._lock:
            if self._stopping:
                return
            self._stopping = True
            conns = list(self._conns)
        try:
            os.unlink(self.path)
        except OSError:
            pass
        shutdown(self._listener)  # wakes accept()
        self._listener.close()
        for conn in conns:
            with conn.lock:
                if not conn.busy:
                    shutdown(conn.sock)  # wakes the thread waiting for the next request

    def close(self, grace_s: float | None = 0.0) -> None:
        """``stop_accepting``, then up to ``grace_s`` (None: no limit) for busy connections to answer; what is
        left is cut (its clients see the connection end) and every thread is joined. Idempotent."""
        self.stop_accepting()
        with self._lock:
            conns = list(self._conns)
        deadline = None if grace_s is None else time.monotonic() + grace_s
        for conn in conns:
            if conn.thread is not None:
                conn.thread.join(None if deadline is None else max(0.0, deadline - time.monotonic()))
        for conn in conns:
            shutdown(conn.sock)
        for conn in conns:
            if conn.thread is not None:
                conn.thread.join(_JOIN_S)
        self._acceptor.join(_JOIN_S)


class ChannelGone(Exception):
    """The advertised socket is not there or not ours (fails a check, another uid listens)."""


class ChannelBusy(Exception):
    """The socket is there and ours but takes no connection now (connect failed otherwise, no hello, full)."""


def connect(path: str, magic: bytes, timeout_s: float) -> socket.socket:
    """A connection to a :class:`UnixConnServer` at ``path`` that said hello with ``magic`` and ``HELLO_OK``.
    Checks first that ``path`` is a socket of ours in a private directory (``_unix.check_socket_path``), then
    that the listener's SO_PEERCRED uid is ours: nothing is sent to anyone else. ``ChannelGone`` or
    ``ChannelBusy``; nothing of the caller's was written in either case."""
    try:
        _unix.check_socket_path(path)
    except (OSError, _unix.InsecurePath) as exc:
        raise ChannelGone(str(exc)) from exc
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        deadline = time.monotonic() + timeout_s
        sock.settimeout(timeout_s)
        try:
            sock.connect(path)
        except OSError as exc:
            if exc.errno in _GONE_ERRNOS:
                raise ChannelGone(f"connect to {path}: {exc}") from exc
            raise ChannelBusy(f"connect to {path}: {exc}") from exc
        pid, uid = _unix.peer_uid(sock)
        if uid != os.geteuid():
            raise ChannelGone(f"{path} is served by pid {pid} running as uid {uid}, not us (uid {os.geteuid()})")
        try:
            hello = _unix.recv_frame(sock, deadline, 64)
        except (OSError, ValueError) as exc:
            raise ChannelBusy(f"no hello from {path}: {exc}") from exc
        if hello is None or len(hello) != len(magic) + 1 or hello[: len(magic)] != magic:
            raise ChannelBusy(f"{path} did not say hello")
        if hello[-1] != HELLO_OK:
            raise ChannelBusy(f"{path} refused the connection: it is full (its connection cap is reached)")
    except BaseException:
        sock.close()
        raise
    return sock


def shutdown(sock: socket.socket) -> None:
    try:
        sock.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass


__all__ = ["ChannelBusy", "ChannelGone", "Conn", "HELLO_FULL", "HELLO_OK", "UnixConnServer", "connect", "shutdown"]
