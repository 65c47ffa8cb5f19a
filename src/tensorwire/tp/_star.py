"""Bootstrap of the Unix-socket star: rank 0 listens, peers connect, handshake, two-way link probe.

Sequence (every read and write bounded by one ``init_timeout_s`` deadline)::

    rank 0                                         rank k > 0
    unlink stale socket; bind (umask 077); listen   connect, retry every connect_retry_s (ENOENT/ECONNREFUSED)
    accept; SO_PEERCRED uid check                   SO_PEERCRED uid check of the listener
    read HELLO  <----------------------------------  HELLO: magic, version, rank, world, backend,
                                                            session digest, params digest
    validate: rank range, duplicate, world size, session, params
      (on failure: REPLY(reject, reason, message) to every connected peer, clean up, raise)
    ... after all world-1 peers said HELLO:
    REPLY(ok, nonce)  ----------------------------->  read REPLY
    read echo  <------------------------------------  echo nonce          (rank 0 checks: link probe)
    close + unlink listener
    READY(nonce) [+ shm fd via SCM_RIGHTS]  ------->  read READY, check nonce (peer checks: link probe)

Rank 0 closes the listener as soon as every peer is in: nothing accepts later, and a new broadcaster with the same
session can bind again after close(). No message is pickled; all structs are little-endian.
"""

from __future__ import annotations

import errno
import logging
import os
import secrets
import socket
import stat
import struct
import threading
import time
from dataclasses import dataclass

from tensorwire.errors import BootstrapError, BootstrapTimeout, BroadcastTimeout, PeerClosed, Reason

from ._link import Link, Waiter
from ._paths import Endpoint, effective_uid

log = logging.getLogger(__name__)

HELLO = struct.Struct("<4sHBBii16s16s")  # magic, version, backend, flags, rank, world, session, params
REPLY = struct.Struct("<4sBBH8s")  # magic, status (0 ok, else reject), reason index, message length, nonce
READY = struct.Struct("<4s8sQ")  # magic, nonce, extra (shm mapping size, 0 for uds)
HELLO_MAGIC, REPLY_MAGIC, READY_MAGIC = b"TWHS", b"TWHR", b"TWRY"
PROTO_VERSION = 1
BACKEND_CODES = {"uds": 1, "shm": 2}

_REASONS = [Reason.HANDSHAKE_FAILED, Reason.BAD_RANK, Reason.DUPLICATE_RANK, Reason.SESSION_MISMATCH,
            Reason.PARAMS_MISMATCH, Reason.BOOTSTRAP_FAILED]
_umask_lock = threading.Lock()
_RETRYABLE_CONNECT = (errno.ENOENT, errno.ECONNREFUSED, errno.EAGAIN, errno.EINTR)


@dataclass(frozen=True)
class Hello:
    rank: int
    world: int
    backend: str
    session_digest: bytes
    params_digest: bytes


def _peer_uid_check(sock: socket.socket, who: str, my_rank: int) -> None:
    creds = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
    pid, uid, _gid = struct.unpack("3i", creds)
    want = effective_uid()
    if uid != want:
        raise BootstrapError(f"rank {my_rank}: {who} (pid {pid}) runs as uid {uid}, we run as uid {want}; refusing "
                             f"the connection (SO_PEERCRED)", reason=Reason.HANDSHAKE_FAILED)


def _set_buffers(sock: socket.socket, nbytes: int) -> None:
    if nbytes:
        for opt in (socket.SO_SNDBUF, socket.SO_RCVBUF):
            try:
                sock.setsockopt(socket.SOL_SOCKET, opt, nbytes)
            except OSError:
                pass


def _boot_waiter(rank: int, what: str, deadline: float, timeout_s: float) -> Waiter:
    w = Waiter(rank, what, max(deadline - time.monotonic(), 1e-3), stall_warn_s=max(timeout_s, 1.0) * 10)
    return w


def _timeout(exc: BroadcastTimeout, rank: int, what: str, timeout_s: float) -> BootstrapTimeout:
    return BootstrapTimeout(f"rank {rank}: bootstrap timed out after {timeout_s:.3f} s {what}",
                            reason=Reason.BOOTSTRAP_TIMEOUT)


class RootBootstrap:
    """Rank 0's half. ``run()`` returns one Link per peer (index = peer rank; index 0 is None)."""

    def __init__(self, endpoint: Endpoint, world: int, hello: Hello, timeout_s: float, sock_buf: int,
                 check_uid: bool) -> None:
        self.endpoint = endpoint
        self.world = world
        self.hello = hello
        self.timeout_s = timeout_s
        self.sock_buf = sock_buf
        self.check_uid = check_uid
        self.listener: socket.socket | None = None
        self.bound_path: str | None = None

    def _bind(self) -> socket.socket:
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            path = self.endpoint.path
            if path is not None:
                _remove_stale(path)
            with _umask_lock:  # umask is process-wide; 0o177 makes the socket file 0600 from birth
                old = os.umask(0o177)
                try:
                    s.bind(self.endpoint.address)
                finally:
                    os.umask(old)
            if path is not None:
                self.bound_path = path
                os.chmod(path, 0o600)
            s.listen(self.world)
            s.setblocking(False)
        except OSError as exc:
            s.close()
            self.cleanup_listener()
            raise BootstrapError(f"rank 0: cannot listen on {self.endpoint.display}: {exc}",
                                 reason=Reason.BOOTSTRAP_FAILED) from exc
        except BaseException:
            s.close()
            raise
        return s

    def cleanup_listener(self) -> None:
        if self.listener is not None:
            self.listener.close()
            self.listener = None
        if self.bound_path is not None:
            try:
                os.unlink(self.bound_path)
            except FileNotFoundError:
                pass
            self.bound_path = None

    def run(self, ready_fds: list[int], ready_extra: int) -> list[Link | None]:
        deadline = time.monotonic() + self.timeout_s
        links: list[Link | None] = [None] * self.world
        pending: list[socket.socket] = []
        self.listener = self._bind()
        import select

        poller = select.poll()
        poller.register(self.listener.fileno(), select.POLLIN)
        try:
            connected = 0
            while connected < self.world - 1:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    missing = [r for r in range(1, self.world) if links[r] is None]
                    raise BootstrapTimeout(
                        f"rank 0: accept timed out after {self.timeout_s:.3f} s on {self.endpoint.display} while "
                        f"waiting for peer {connected + 1}/{self.world - 1} (missing ranks {missing}); did every rank "
                        f"start with the same session and world_size?", reason=Reason.BOOTSTRAP_TIMEOUT)
                if not poller.poll(max(1, int(min(remaining, 1.0) * 1000))):
                    continue
                try:
                    conn, _ = self.listener.accept()
                except (BlockingIOError, InterruptedError):
                    continue
                pending.append(conn)
                conn.setblocking(False)
                _set_buffers(conn, self.sock_buf)
                if self.check_uid:
                    _peer_uid_check(conn, "a connecting peer", 0)
                link = Link(conn, 0, -1)
                try:
                    raw = link.read_exact(HELLO.size, _boot_waiter(0, "handshake read", deadline, self.timeout_s))
                except BroadcastTimeout as exc:
                    raise _timeout(exc, 0, "reading a peer's handshake", self.timeout_s) from exc
                except PeerClosed as exc:
                    raise BootstrapError(f"rank 0: a peer closed its connection before the handshake ({exc})",
                                         reason=Reason.HANDSHAKE_FAILED) from exc
                peer = self._validate(raw, links, link)
                link.peer = peer
                links[peer] = link
                pending.remove(conn)
                connected += 1
            # Two-way link probe: every peer echoes a fresh nonce; then READY carries it back.
            nonce = secrets.token_bytes(8)
            for r in range(1, self.world):
                lk = links[r]
                assert lk is not None
                self._send(lk, REPLY.pack(REPLY_MAGIC, 0, 0, 0, nonce), deadline)
            for r in range(1, self.world):
                lk = links[r]
                assert lk is not None
                try:
                    echo = lk.read_exact(8, _boot_waiter(0, f"link probe read from rank {r}", deadline,
                                                         self.timeout_s))
                except BroadcastTimeout as exc:
                    raise _timeout(exc, 0, f"waiting for rank {r}'s link probe echo", self.timeout_s) from exc
                except PeerClosed as exc:
                    raise BootstrapError(f"rank 0: link probe read from rank {r} failed: rank {r} closed the "
                                         f"connection (EOF)", reason=Reason.HANDSHAKE_FAILED) from exc
                if echo != nonce:
                    raise BootstrapError(f"rank 0: link probe mismatch from rank {r}: got {echo.hex()}, expected "
                                         f"{nonce.hex()}", reason=Reason.HANDSHAKE_FAILED)
            self.cleanup_listener()
            ready = READY.pack(READY_MAGIC, nonce, ready_extra)
            for r in range(1, self.world):
                lk = links[r]
                assert lk is not None
                if ready_fds:
                    try:
                        socket.send_fds(lk.sock, [ready], ready_fds, socket.MSG_NOSIGNAL)
                    except OSError as exc:
                        raise BootstrapError(f"rank 0: sending READY to rank {r} failed: {exc}",
                                             reason=Reason.HANDSHAKE_FAILED) from exc
                else:
                    self._send(lk, ready, deadline)
            return links
        except BaseException as exc:
            reason = getattr(exc, "reason", Reason.BOOTSTRAP_FAILED)
            for lk in links:
                if lk is not None:
                    _reject(lk, reason, str(exc))
                    lk.close()
            for conn in pending:
                conn.close()
            self.cleanup_listener()
            raise

    def _send(self, lk: Link, data: bytes, deadline: float) -> None:
        try:
            lk.send_all([data], _boot_waiter(0, f"handshake write to rank {lk.peer}", deadline, self.timeout_s))
        except BroadcastTimeout as exc:
            raise _timeout(exc, 0, f"writing to rank {lk.peer}", self.timeout_s) from exc
        except PeerClosed as exc:
            raise BootstrapError(f"rank 0: handshake write to rank {lk.peer} failed: {exc}",
                                 reason=Reason.HANDSHAKE_FAILED) from exc

    def _validate(self, raw: bytes, links: list[Link | None], link: Link) -> int:
        magic, version, backend, _flags, rank, world, session, params = HELLO.unpack(raw)
        me = self.hello

        def fail(reason: Reason, msg: str) -> BootstrapError:
            _reject(link, reason, msg)
            link.close()
            return BootstrapError(msg, reason=reason)

        if magic != HELLO_MAGIC or version != PROTO_VERSION:
            raise fail(Reason.HANDSHAKE_FAILED, f"rank 0: bad handshake from a peer (magic {magic!r}, version "
                                                f"{version}); is it a tensorwire broadcaster of the same version?")
        if session != me.session_digest:
            raise fail(Reason.SESSION_MISMATCH, f"rank 0: peer rank {rank} belongs to a different session (its "
                                                f"session id differs from ours, though both map to "
                                                f"{self.endpoint.display})")
        if not 0 < rank < self.world:
            raise fail(Reason.BAD_RANK, f"rank 0: bad peer_rank {rank} (world_size={self.world})")
        if links[rank] is not None:
            raise fail(Reason.DUPLICATE_RANK, f"rank 0: duplicate peer rank {rank}")
        if world != self.world:
            raise fail(Reason.PARAMS_MISMATCH, f"rank 0: peer rank {rank} has world_size={world}, we have "
                                               f"{self.world} (re-init mismatch on one session)")
        if backend != BACKEND_CODES[me.backend] or params != me.params_digest:
            names = {v: k for k, v in BACKEND_CODES.items()}
            raise fail(Reason.PARAMS_MISMATCH, f"rank 0: peer rank {rank} uses backend "
                                               f"{names.get(backend, backend)} / other parameters, we use "
                                               f"{me.backend} (re-init mismatch on one session)")
        return int(rank)


def _reject(link: Link, reason: Reason, message: str) -> None:
    body = message.encode("utf-8", "replace")[:1024]
    idx = _REASONS.index(reason) if reason in _REASONS else _REASONS.index(Reason.BOOTSTRAP_FAILED)
    link.send_nowait(REPLY.pack(REPLY_MAGIC, 1, idx, len(body), b"\0" * 8) + body)


def _remove_stale(path: str) -> None:
    """Remove a socket file left by a crashed run; refuse to steal one that a live listener owns."""
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return
    if not stat.S_ISSOCK(st.st_mode):
        raise BootstrapError(f"rank 0: {path} exists and is not a socket; refusing to remove it",
                             reason=Reason.INSECURE_PATH)
    probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        probe.settimeout(0.5)
        probe.connect(path)
    except OSError:
        log.info("removing stale broadcaster socket %s", path)
        os.unlink(path)
        return
    finally:
        probe.close()
    raise BootstrapError(f"rank 0: {path} is in use by a live broadcaster; two groups share one session id",
                         reason=Reason.BOOTSTRAP_FAILED)


def peer_bootstrap(endpoint: Endpoint, rank: int, hello: Hello, timeout_s: float, retry_s: float, sock_buf: int,
                   check_uid: bool, want_fds: int) -> tuple[Link, int, list[int]]:
    """Rank k's half: returns the link to rank 0, READY's extra field and the fds passed with it."""
    deadline = time.monotonic() + timeout_s
    attempts = 0
    last: OSError | None = None
    while True:
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            _set_buffers(s, sock_buf)
            s.connect(endpoint.address)
            break
        except OSError as exc:
            s.close()
            attempts += 1
            last = exc
            if exc.errno not in _RETRYABLE_CONNECT:
                raise BootstrapError(f"rank {rank}: connect({endpoint.display}) failed: {exc}",
                                     reason=Reason.BOOTSTRAP_FAILED) from exc
            if time.monotonic() + retry_s > deadline:
                raise BootstrapTimeout(
                    f"rank {rank}: connect({endpoint.display}) failed after {attempts} attempts in "
                    f"{timeout_s:.3f} s: {last}; is rank 0 running with the same session?",
                    reason=Reason.BOOTSTRAP_TIMEOUT) from exc
            time.sleep(retry_s)
    link = Link(s, rank, 0)
    try:
        if check_uid:
            _peer_uid_check(s, "rank 0's listener", rank)

        def waiter(what: str) -> Waiter:
            return _boot_waiter(rank, what, deadline, timeout_s)

        try:
            link.send_all([HELLO.pack(HELLO_MAGIC, PROTO_VERSION, BACKEND_CODES[hello.backend], 0, rank, hello.world,
                                      hello.session_digest, hello.params_digest)], waiter("handshake write"))
            raw = link.read_exact(REPLY.size, waiter("handshake reply"))
            magic, status, reason_idx, msg_len, nonce = REPLY.unpack(raw)
            if magic != REPLY_MAGIC:
                raise BootstrapError(f"rank {rank}: bad handshake reply from rank 0 (magic {magic!r})",
                                     reason=Reason.HANDSHAKE_FAILED)
            if status != 0:
                msg = link.read_exact(msg_len, waiter("reject message")).decode("utf-8", "replace")
                reason = _REASONS[reason_idx] if reason_idx < len(_REASONS) else Reason.BOOTSTRAP_FAILED
                raise BootstrapError(f"rank {rank}: rank 0 rejected the bootstrap: {msg}", reason=reason)
            link.send_all([nonce], waiter("link probe echo"))
            # READY may carry fds; recv_fds reads only what we ask, so the buffer must be empty here.
            if link.buffered():
                raw_ready = link.read_exact(READY.size, waiter("READY"))
                fds: list[int] = []
            else:
                raw_ready, fds = _recv_ready(link, want_fds, waiter("READY"))
            magic, echo, extra = READY.unpack(raw_ready)
            if magic == REPLY_MAGIC:
                raise BootstrapError(f"rank {rank}: rank 0 rejected the bootstrap after the link probe",
                                     reason=Reason.HANDSHAKE_FAILED)
            if magic != READY_MAGIC or echo != nonce:
                for fd in fds:
                    os.close(fd)
                raise BootstrapError(f"rank {rank}: link probe mismatch: READY carried {echo.hex()} "
                                     f"(magic {magic!r}), expected {nonce.hex()}", reason=Reason.HANDSHAKE_FAILED)
            if len(fds) != want_fds:
                for fd in fds:
                    os.close(fd)
                raise BootstrapError(f"rank {rank}: READY carried {len(fds)} fds, expected {want_fds}",
                                     reason=Reason.HANDSHAKE_FAILED)
            return link, extra, fds
        except BroadcastTimeout as exc:
            raise _timeout(exc, rank, "during the handshake with rank 0", timeout_s) from exc
        except PeerClosed as exc:
            raise BootstrapError(f"rank {rank}: rank 0 closed the connection during the handshake (link probe "
                                 f"or reply read failed: EOF)", reason=Reason.HANDSHAKE_FAILED) from exc
    except BaseException:
        link.close()
        raise


def _recv_ready(link: Link, want_fds: int, waiter: Waiter) -> tuple[bytes, list[int]]:
    import select

    poller = select.poll()
    poller.register(link.fd, select.POLLIN)
    while True:
        waiter.check()
        if not poller.poll(100):
            continue
        try:
            msg, fds, _flags, _addr = socket.recv_fds(link.sock, READY.size, max(want_fds, 1),
                                                     socket.MSG_DONTWAIT | socket.MSG_CMSG_CLOEXEC)
        except BlockingIOError:
            continue
        if not msg:
            raise PeerClosed(f"rank {link.my_rank}: rank 0 closed the connection before READY",
                             reason=Reason.PEER_CLOSED)
        if len(msg) < READY.size:
            rest = link.read_exact(READY.size - len(msg), waiter)
            msg += rest
        return msg, list(fds)

