"""Bootstrap of the Unix-socket star: rank 0 listens, peers connect, handshake, two-way link probe.

Sequence (every read and write bounded by one ``init_timeout_s`` deadline)::

    rank 0                                         rank k > 0
    unlink stale socket; bind (umask 077); listen   connect, retry every connect_retry_s (ENOENT/ECONNREFUSED)
    accept; SO_PEERCRED uid check                   SO_PEERCRED uid check of the listener
    read HELLO  <----------------------------------  HELLO: magic, version, rank, world, backend,
                                                            session digest, params digest
    validate: magic/version, session; then rank range, duplicate, world size, params
      (a connection that is not one of ours is dropped and rank 0 keeps accepting; a peer of our session that
       disagrees fails the group: REPLY(reject, reason, message) to every connected peer, clean up, raise)
    ... after all world-1 peers said HELLO:
    REPLY(ok, nonce)  ----------------------------->  read REPLY
    read echo  <------------------------------------  echo nonce          (rank 0 checks: link probe)
    close + unlink listener
    READY(nonce) [+ shm fd via SCM_RIGHTS]  ------->  read READY, check nonce (peer checks: link probe)

Rank 0 closes the listener as soon as every peer is in: nothing accepts later, and a new broadcaster with the same
session can bind again after close(). No message is pickled; all structs are little-endian.

Connections that are not one of ours never fail the group: rank 0 reads every pending
handshake at once (poll), so a connection that sends nothing cannot hold up the others, and it drops (closes,
with a warning, without failing) a connection from another uid, one that closes or sends garbage before its
HELLO, one of another session, one that has not sent its HELLO within ``HELLO_TIMEOUT_S``, and the oldest pending
one when ``MAX_PENDING`` are waiting. Bootstrap then goes on until its deadline; a timeout names what was dropped.

Abstract names (``abstract=True``) can be bound by any local user first. Rank 0 then checks who holds the name:
another uid (or a holder it cannot identify) means squatted, and the group meets at the private socket path
(``_paths``) instead, with a warning; peers try that path whenever the abstract name refuses them or is held by
another uid. A holder of our own uid is another group with our session: an error, as for socket files.
"""

from __future__ import annotations

import errno
import logging
import os
import secrets
import select
import socket
import stat
import struct
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

from tensorwire._local import unix as _unix
from tensorwire.errors import BootstrapError, BootstrapTimeout, BroadcastTimeout, PeerClosed, Reason

from ._link import Link, Waiter
from ._paths import Rendezvous, effective_uid

log = logging.getLogger(__name__)

HELLO = struct.Struct("<4sHBBii16s16s")  # magic, version, backend, flags, rank, world, session, params
REPLY = struct.Struct("<4sBBH8s")  # magic, status (0 ok, else reject), reason index, message length, nonce
READY = struct.Struct("<4s8sQ")  # magic, nonce, extra (shm mapping size, 0 for uds)
HELLO_MAGIC, REPLY_MAGIC, READY_MAGIC = b"TWHS", b"TWHR", b"TWRY"
PROTO_VERSION = 1
BACKEND_CODES = {"uds": 1, "shm": 2}

_REASONS = [
    Reason.HANDSHAKE_FAILED,
    Reason.BAD_RANK,
    Reason.DUPLICATE_RANK,
    Reason.SESSION_MISMATCH,
    Reason.PARAMS_MISMATCH,
    Reason.BOOTSTRAP_FAILED,
]
_umask_lock = threading.Lock()
_RETRYABLE_CONNECT = (errno.ENOENT, errno.ECONNREFUSED, errno.EAGAIN, errno.EINTR)
# A connection gets this long to deliver its HELLO (a real peer sends it right after connect), and at most this
# many connections wait for theirs at once (the oldest is dropped first): idle connections cannot pin rank 0.
HELLO_TIMEOUT_S = 10.0
MAX_PENDING = 64


@dataclass(frozen=True)
class Hello:
    rank: int
    world: int
    backend: str
    session_digest: bytes
    params_digest: bytes


def _foreign(sock: socket.socket, who: str, my_rank: int) -> str | None:
    """Why ``sock``'s other end is refused (it runs as another uid than ours), or None when it is ours."""
    pid, uid = _unix.peer_uid(sock)
    want = effective_uid()
    if uid != want:
        return (
            f"rank {my_rank}: {who} (pid {pid}) runs as uid {uid}, we run as uid {want}; refusing the connection "
            f"(SO_PEERCRED)"
        )
    return None


class _Dropped(BootstrapError):
    """A connection rank 0 drops without failing the group (see the module docstring)."""


class _Squatted(Exception):
    """An abstract name is held by a process that is not one of ours (its message says who, as far as known)."""


def _check_holder(endpoint: Rendezvous) -> None:
    """Who holds the abstract name ``endpoint`` that we could not bind: ``_Squatted`` for another uid or a holder
    we cannot identify, BootstrapError for a live listener of our own uid (another group with our session)."""
    probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        probe.settimeout(0.5)
        probe.connect(endpoint.address)
        pid, uid = _unix.peer_uid(probe)
    except OSError as exc:
        raise _Squatted(
            f"is bound by a process that does not accept connections ({exc}); we cannot tell who it is"
        ) from None
    finally:
        probe.close()
    if uid != effective_uid():
        raise _Squatted(f"is held by pid {pid} of uid {uid}, not by us (uid {effective_uid()})")
    raise BootstrapError(
        f"rank 0: {endpoint.display} is in use by a live broadcaster of our uid (pid {pid}); two "
        f"groups share one session id",
        reason=Reason.BOOTSTRAP_FAILED,
    )


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
    return BootstrapTimeout(
        f"rank {rank}: bootstrap timed out after {timeout_s:.3f} s {what}", reason=Reason.BOOTSTRAP_TIMEOUT
    )


class _Pending:
    """An accepted connection whose HELLO has not fully arrived."""

    __slots__ = ("link", "since", "who")

    def __init__(self, link: Link, since: float, who: str) -> None:
        self.link = link
        self.since = since
        self.who = who


class RootBootstrap:
    """Rank 0's half. ``run()`` returns one Link per peer (index = peer rank; index 0 is None). ``fallback``
    builds the private socket-file endpoint an abstract endpoint falls back to when its name is squatted;
    ``endpoint`` is where the group met once ``run()`` returns."""

    def __init__(
        self,
        endpoint: Rendezvous,
        world: int,
        hello: Hello,
        timeout_s: float,
        sock_buf: int,
        check_uid: bool,
        fallback: Callable[[], Rendezvous] | None = None,
    ) -> None:
        self.endpoint = endpoint
        self.world = world
        self.hello = hello
        self.timeout_s = timeout_s
        self.sock_buf = sock_buf
        self.check_uid = check_uid
        self.fallback = fallback
        self.listener: socket.socket | None = None
        self.bound_path: str | None = None
        self.dropped: list[str] = []  # why each dropped connection was dropped, for the timeout message

    def _bind(self) -> socket.socket:
        try:
            return self._bind_to(self.endpoint)
        except _Squatted as squat:
            if self.fallback is None:
                raise BootstrapError(
                    f"rank 0: cannot listen on {self.endpoint.display}: {squat}", reason=Reason.BOOTSTRAP_FAILED
                ) from None
            private = self.fallback()
            log.warning(
                "rank 0: abstract socket %s %s; the group meets at %s instead",
                self.endpoint.display,
                squat,
                private.display,
            )
            self.endpoint = private
            return self._bind_to(private)

    def _bind_to(self, endpoint: Rendezvous) -> socket.socket:
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            path = endpoint.path
            if path is not None:
                _remove_stale(path)
            with _umask_lock:  # umask is process-wide; 0o177 makes the socket file 0600 from birth
                old = os.umask(0o177)
                try:
                    s.bind(endpoint.address)
                finally:
                    os.umask(old)
            if path is not None:
                self.bound_path = path
                os.chmod(path, 0o600)
            s.listen(max(self.world, MAX_PENDING))
            s.setblocking(False)
        except OSError as exc:
            s.close()
            self.cleanup_listener()
            if endpoint.is_abstract and exc.errno == errno.EADDRINUSE:
                _check_holder(endpoint)  # raises _Squatted unless the holder is one of ours
            raise BootstrapError(
                f"rank 0: cannot listen on {endpoint.display}: {exc}", reason=Reason.BOOTSTRAP_FAILED
            ) from exc
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
        pending: dict[int, _Pending] = {}
        if not self.check_uid:
            log.warning(
                "rank 0: the SO_PEERCRED uid check is off (check_peer_uid=False): any local user who can "
                "reach %s can join or disrupt this group; unsafe outside a single-user machine",
                self.endpoint.display,
            )
        self.listener = self._bind()
        poller = select.poll()
        poller.register(self.listener.fileno(), select.POLLIN)
        try:
            connected = 0
            while connected < self.world - 1:
                now = time.monotonic()
                remaining = deadline - now
                if remaining <= 0:
                    missing = [r for r in range(1, self.world) if links[r] is None]
                    dropped = (
                        f"; dropped {len(self.dropped)} connection(s) that were not peers of this group: "
                        f"{'; '.join(self.dropped[-4:])}"
                        if self.dropped
                        else ""
                    )
                    raise BootstrapTimeout(
                        f"rank 0: accept timed out after {self.timeout_s:.3f} s on {self.endpoint.display} while "
                        f"waiting for peer {connected + 1}/{self.world - 1} (missing ranks {missing}); did every rank "
                        f"start with the same session and world_size?{dropped}",
                        reason=Reason.BOOTSTRAP_TIMEOUT,
                    )
                for fd, p in list(pending.items()):
                    if now - p.since > HELLO_TIMEOUT_S:
                        self._drop(pending, poller, fd, f"{p.who} sent no handshake within {HELLO_TIMEOUT_S:.0f} s")
                wait_s = min(remaining, 1.0, *(p.since + HELLO_TIMEOUT_S - now for p in pending.values()))
                for fd, _ev in poller.poll(max(1, int(wait_s * 1000))):
                    if fd == self.listener.fileno():
                        self._accept(pending, poller)
                        continue
                    waiting = pending.get(fd)
                    if waiting is None:
                        continue
                    try:
                        waiting.link.fill(None)
                    except PeerClosed:
                        self._drop(pending, poller, fd, f"{waiting.who} closed before completing its handshake")
                        continue
                    if waiting.link.buffered() < HELLO.size:
                        continue
                    link = waiting.link
                    raw = link.read_exact(HELLO.size, _boot_waiter(0, "handshake read", deadline, self.timeout_s))
                    del pending[fd]
                    poller.unregister(fd)
                    try:
                        peer = self._validate(raw, links, link)
                    except _Dropped as exc:
                        self._note_drop(f"{waiting.who}: {exc}")
                        continue
                    link.peer = peer
                    links[peer] = link
                    connected += 1
            for p in pending.values():
                p.link.close()
            pending.clear()
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
                    echo = lk.read_exact(8, _boot_waiter(0, f"link probe read from rank {r}", deadline, self.timeout_s))
                except BroadcastTimeout as exc:
                    raise _timeout(exc, 0, f"waiting for rank {r}'s link probe echo", self.timeout_s) from exc
                except PeerClosed as exc:
                    raise BootstrapError(
                        f"rank 0: link probe read from rank {r} failed: rank {r} closed the connection (EOF)",
                        reason=Reason.HANDSHAKE_FAILED,
                    ) from exc
                if echo != nonce:
                    raise BootstrapError(
                        f"rank 0: link probe mismatch from rank {r}: got {echo.hex()}, expected {nonce.hex()}",
                        reason=Reason.HANDSHAKE_FAILED,
                    )
            self.cleanup_listener()
            ready = READY.pack(READY_MAGIC, nonce, ready_extra)
            for r in range(1, self.world):
                lk = links[r]
                assert lk is not None
                if ready_fds:
                    try:
                        socket.send_fds(lk.sock, [ready], ready_fds, socket.MSG_NOSIGNAL)
                    except OSError as exc:
                        raise BootstrapError(
                            f"rank 0: sending READY to rank {r} failed: {exc}", reason=Reason.HANDSHAKE_FAILED
                        ) from exc
                else:
                    self._send(lk, ready, deadline)
            return links
        except BaseException as exc:
            reason = getattr(exc, "reason", Reason.BOOTSTRAP_FAILED)
            for lk in links:
                if lk is not None:
                    _reject(lk, reason, str(exc))
                    lk.close()
            for p in pending.values():
                p.link.close()
            self.cleanup_listener()
            raise

    def _accept(self, pending: dict[int, _Pending], poller: select.poll) -> None:
        """Accept every connection waiting on the listener; drop at once those of another uid."""
        assert self.listener is not None
        while True:
            try:
                conn, _ = self.listener.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError as exc:  # ECONNABORTED, EMFILE, ...: that one connection is lost, not the group
                self._note_drop(f"accept failed: {exc}")
                return
            pid, uid = _unix.peer_uid(conn)
            who = f"a connection from pid {pid} (uid {uid})"
            if self.check_uid and uid != effective_uid():
                conn.close()  # not a word to another user's process
                self._note_drop(f"{who} runs as another uid than ours ({effective_uid()}) (SO_PEERCRED)")
                continue
            if len(pending) >= MAX_PENDING:
                oldest = min(pending, key=lambda fd: pending[fd].since)
                self._drop(
                    pending,
                    poller,
                    oldest,
                    f"{pending[oldest].who} was the oldest of {MAX_PENDING} connections waiting for their handshake",
                )
            conn.setblocking(False)
            _set_buffers(conn, self.sock_buf)
            link = Link(conn, 0, -1)
            pending[link.fd] = _Pending(link, time.monotonic(), who)
            poller.register(link.fd, select.POLLIN)

    def _drop(self, pending: dict[int, _Pending], poller: select.poll, fd: int, why: str) -> None:
        p = pending.pop(fd)
        poller.unregister(fd)
        p.link.close()
        self._note_drop(why)

    def _note_drop(self, why: str) -> None:
        log.warning("rank 0: dropped a connection during bootstrap, still accepting: %s", why)
        self.dropped.append(why)

    def _send(self, lk: Link, data: bytes, deadline: float) -> None:
        try:
            lk.send_all([data], _boot_waiter(0, f"handshake write to rank {lk.peer}", deadline, self.timeout_s))
        except BroadcastTimeout as exc:
            raise _timeout(exc, 0, f"writing to rank {lk.peer}", self.timeout_s) from exc
        except PeerClosed as exc:
            raise BootstrapError(
                f"rank 0: handshake write to rank {lk.peer} failed: {exc}", reason=Reason.HANDSHAKE_FAILED
            ) from exc

    def _validate(self, raw: bytes, links: list[Link | None], link: Link) -> int:
        magic, version, backend, _flags, rank, world, session, params = HELLO.unpack(raw)
        me = self.hello

        def fail(reason: Reason, msg: str) -> BootstrapError:
            _reject(link, reason, msg)
            link.close()
            return BootstrapError(msg, reason=reason)

        def drop(reason: Reason, msg: str) -> _Dropped:
            _reject(link, reason, msg)  # it may be a broadcaster that can report why; we go on accepting
            link.close()
            return _Dropped(msg, reason=reason)

        if magic != HELLO_MAGIC or version != PROTO_VERSION:
            raise drop(
                Reason.HANDSHAKE_FAILED,
                f"rank 0: bad handshake from a peer (magic {magic!r}, version "
                f"{version}); is it a tensorwire broadcaster of the same version?",
            )
        if session != me.session_digest:
            raise drop(
                Reason.SESSION_MISMATCH,
                f"rank 0: peer rank {rank} belongs to a different session (its "
                f"session id differs from ours, though both map to "
                f"{self.endpoint.display})",
            )
        if not 0 < rank < self.world:
            raise fail(Reason.BAD_RANK, f"rank 0: bad peer_rank {rank} (world_size={self.world})")
        if links[rank] is not None:
            raise fail(Reason.DUPLICATE_RANK, f"rank 0: duplicate peer rank {rank}")
        if world != self.world:
            raise fail(
                Reason.PARAMS_MISMATCH,
                f"rank 0: peer rank {rank} has world_size={world}, we have "
                f"{self.world} (re-init mismatch on one session)",
            )
        if backend != BACKEND_CODES[me.backend] or params != me.params_digest:
            names = {v: k for k, v in BACKEND_CODES.items()}
            raise fail(
                Reason.PARAMS_MISMATCH,
                f"rank 0: peer rank {rank} uses backend "
                f"{names.get(backend, backend)} / other parameters, we use "
                f"{me.backend} (re-init mismatch on one session)",
            )
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
        raise BootstrapError(
            f"rank 0: {path} exists and is not a socket; refusing to remove it", reason=Reason.INSECURE_PATH
        )
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
    raise BootstrapError(
        f"rank 0: {path} is in use by a live broadcaster; two groups share one session id",
        reason=Reason.BOOTSTRAP_FAILED,
    )


def peer_bootstrap(
    endpoint: Rendezvous,
    rank: int,
    hello: Hello,
    timeout_s: float,
    retry_s: float,
    sock_buf: int,
    check_uid: bool,
    want_fds: int,
    fallback: Callable[[], Rendezvous] | None = None,
) -> tuple[Link, int, list[int], Rendezvous]:
    """Rank k's half: returns the link to rank 0, READY's extra field, the fds passed with it, and the endpoint
    the group met at (``fallback()`` when rank 0 had to leave a squatted abstract name for it)."""
    deadline = time.monotonic() + timeout_s
    if not check_uid:
        log.warning(
            "rank %d: the SO_PEERCRED uid check is off (check_peer_uid=False): whoever listens on %s gets "
            "this rank's handshake and feeds it broadcasts; unsafe outside a single-user machine",
            rank,
            endpoint.display,
        )
    s, endpoint = _connect_root(endpoint, fallback, rank, timeout_s, retry_s, sock_buf, check_uid, deadline)
    link = Link(s, rank, 0)
    try:

        def waiter(what: str) -> Waiter:
            return _boot_waiter(rank, what, deadline, timeout_s)

        try:
            link.send_all(
                [
                    HELLO.pack(
                        HELLO_MAGIC,
                        PROTO_VERSION,
                        BACKEND_CODES[hello.backend],
                        0,
                        rank,
                        hello.world,
                        hello.session_digest,
                        hello.params_digest,
                    )
                ],
                waiter("handshake write"),
            )
            raw = link.read_exact(REPLY.size, waiter("handshake reply"))
            magic, status, reason_idx, msg_len, nonce = REPLY.unpack(raw)
            if magic != REPLY_MAGIC:
                raise BootstrapError(
                    f"rank {rank}: bad handshake reply from rank 0 (magic {magic!r})", reason=Reason.HANDSHAKE_FAILED
                )
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
                raise BootstrapError(
                    f"rank {rank}: rank 0 rejected the bootstrap after the link probe", reason=Reason.HANDSHAKE_FAILED
                )
            if magic != READY_MAGIC or echo != nonce:
                for fd in fds:
                    os.close(fd)
                raise BootstrapError(
                    f"rank {rank}: link probe mismatch: READY carried {echo.hex()} "
                    f"(magic {magic!r}), expected {nonce.hex()}",
                    reason=Reason.HANDSHAKE_FAILED,
                )
            if len(fds) != want_fds:
                for fd in fds:
                    os.close(fd)
                raise BootstrapError(
                    f"rank {rank}: READY carried {len(fds)} fds, expected {want_fds}", reason=Reason.HANDSHAKE_FAILED
                )
            return link, extra, fds, endpoint
        except BroadcastTimeout as exc:
            raise _timeout(exc, rank, "during the handshake with rank 0", timeout_s) from exc
        except PeerClosed as exc:
            raise BootstrapError(
                f"rank {rank}: rank 0 closed the connection during the handshake (link probe "
                f"or reply read failed: EOF)",
                reason=Reason.HANDSHAKE_FAILED,
            ) from exc
    except BaseException:
        link.close()
        raise


def _connect_root(
    endpoint: Rendezvous,
    fallback: Callable[[], Rendezvous] | None,
    rank: int,
    timeout_s: float,
    retry_s: float,
    sock_buf: int,
    check_uid: bool,
    deadline: float,
) -> tuple[socket.socket, Rendezvous]:
    """A socket connected to rank 0's listener (of our uid when ``check_uid``) and the endpoint it is at.

    An abstract endpoint with a ``fallback``: when the name refuses us or is held by another uid (squatted), the
    private path is tried too on every round, since rank 0 may have moved there (see the module docstring)."""
    targets = [endpoint]
    squat_noted = False
    attempts = 0
    last: OSError | None = None
    while True:
        for ep in targets:
            s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            try:
                _set_buffers(s, sock_buf)
                s.connect(ep.address)
            except OSError as exc:
                s.close()
                last = exc
                if exc.errno not in _RETRYABLE_CONNECT:
                    raise BootstrapError(
                        f"rank {rank}: connect({ep.display}) failed: {exc}", reason=Reason.BOOTSTRAP_FAILED
                    ) from exc
                continue
            why = _foreign(s, "rank 0's listener", rank) if check_uid else None
            if why is None:
                return s, ep
            s.close()
            if not (ep.is_abstract and fallback is not None):
                raise BootstrapError(why, reason=Reason.HANDSHAKE_FAILED)
            if not squat_noted:
                log.warning("%s: the abstract name is squatted; looking for rank 0 at the private path too", why)
                squat_noted = True
            last = ConnectionRefusedError(why)
        attempts += 1
        if fallback is not None and endpoint.is_abstract and len(targets) == 1:
            try:
                targets.append(fallback())
            except BootstrapError as exc:  # no private path here: the abstract name is all there is
                log.warning(
                    "rank %d: no private path to fall back to if %s is squatted: %s", rank, endpoint.display, exc
                )
                fallback = None
        if time.monotonic() + retry_s > deadline:
            where = " or ".join(ep.display for ep in targets)
            raise BootstrapTimeout(
                f"rank {rank}: connect({where}) failed after {attempts} attempts in {timeout_s:.3f} s: {last}; is "
                f"rank 0 running with the same session?",
                reason=Reason.BOOTSTRAP_TIMEOUT,
            ) from last
        time.sleep(retry_s)


def _recv_ready(link: Link, want_fds: int, waiter: Waiter) -> tuple[bytes, list[int]]:
    poller = select.poll()
    poller.register(link.fd, select.POLLIN)
    while True:
        waiter.check()
        if not poller.poll(100):
            continue
        try:
            msg, fds, _flags, _addr = socket.recv_fds(
                link.sock, READY.size, max(want_fds, 1), socket.MSG_DONTWAIT | socket.MSG_CMSG_CLOEXEC
            )
        except BlockingIOError:
            continue
        if not msg:
            raise PeerClosed(
                f"rank {link.my_rank}: rank 0 closed the connection before READY", reason=Reason.PEER_CLOSED
            )
        if len(msg) < READY.size:
            rest = link.read_exact(READY.size - len(msg), waiter)
            msg += rest
        return msg, list(fds)
