"""Same-host Unix-socket plumbing both ``mm`` and ``tp`` may use (neither imports the other; both may import this).

What is here: the per-user private runtime directory (0700, owned by us, never a symlink; opened as a handle and
checked through it, files in it opened relative to the handle), the owner checks of a
socket someone advertised to us, the SO_PEERCRED uid of a connected peer, the host token (the kernel's boot id:
equal tokens mean one kernel, so one file system namespace is at least possible; the path checks decide), and
length-prefixed frames on a stream socket.

Frames: an 8-byte little-endian length, then that many bytes. Every wait is bounded by a ``deadline`` on
``time.monotonic()`` (None: block, for a server thread waiting for its next request; closing the socket from
another thread with ``shutdown`` wakes it). Errors are the transport's own (``OSError`` and its subclasses,
``TimeoutError`` for a deadline, ``ValueError`` for a length over the limit): the layer above translates them
into tensorwire errors, as ``mm`` does with ``grpc.RpcError``.
"""

from __future__ import annotations

import array
import errno
import fcntl
import logging
import os
import secrets
import select
import socket
import stat
import struct
import tempfile
import time
from collections.abc import Sequence

FRAME_HEADER = struct.Struct("<Q")
MAX_FDS = 1  # descriptors one frame may carry (recv_frame(fds=)); a receive buffer's memfd
SUN_PATH_LIMIT = 108  # sizeof(sockaddr_un.sun_path) on Linux; one byte is the terminating NUL
_BOOT_ID = "/proc/sys/kernel/random/boot_id"
_GONE = select.POLLHUP | select.POLLERR | getattr(select, "POLLRDHUP", 0)

Buffer = bytes | bytearray | memoryview

log = logging.getLogger(__name__)


class InsecurePath(Exception):
    """A directory or socket that fails the owner/mode checks (the message says which and why)."""


def host_token() -> str:
    """The kernel's boot id ("" when it cannot be read: then nothing counts as the same host)."""
    try:
        with open(_BOOT_ID, encoding="ascii") as f:
            return f.read().strip()
    except OSError:
        return ""


def xdg_runtime_dir(uid: int | None = None) -> tuple[str | None, str]:
    """``($XDG_RUNTIME_DIR, "")`` when it is usable: an absolute path to a real directory (not a symlink) of
    ``uid`` (default: our effective uid) that nobody else may write; else ``(None, why)`` (``why`` is "" when the
    variable is not set). Another user's or a group-writable runtime directory is ignored rather than trusted:
    whoever may write to it may rename our subdirectory away and plant their own."""
    xdg = os.environ.get("XDG_RUNTIME_DIR")
    if not xdg:
        return None, ""
    uid = os.geteuid() if uid is None else uid
    try:
        st = os.lstat(xdg)
    except OSError as exc:
        return None, str(exc)
    if not os.path.isabs(xdg) or not stat.S_ISDIR(st.st_mode):
        return None, "not an absolute path to a directory"
    if st.st_uid != uid:
        return None, f"owned by uid {st.st_uid}, not by us (uid {uid})"
    if st.st_mode & 0o022:
        return None, f"group/world-writable (mode {stat.S_IMODE(st.st_mode):04o})"
    return xdg, ""


_warned_xdg: set[tuple[str | None, str]] = set()
_fallbacks: dict[tuple[str, int], str] = {}
_FALLBACK_LOCK_S = 2.0  # how long a process waits for another making the fallback directory (then goes ahead)


def default_runtime_dir() -> str:
    """The per-user private directory, created if missing: ``$XDG_RUNTIME_DIR/tensorwire`` when
    :func:`xdg_runtime_dir` accepts it (a per-user tmpfs), else ``$TMPDIR`` (or /tmp) ``/tensorwire-<uid>``, the
    broadcaster's default directory too. When that name is taken by something that fails the checks of
    :func:`open_private_dir` (another user pre-created it, or a symlink), a private ``tensorwire-<uid>-<random>``
    next to it (:func:`fallback_runtime_dir`): a squatted name costs nobody their start-up."""
    xdg, why = xdg_runtime_dir()
    if xdg is not None:
        return os.path.join(xdg, "tensorwire")
    if why and (os.environ.get("XDG_RUNTIME_DIR"), why) not in _warned_xdg:
        _warned_xdg.add((os.environ.get("XDG_RUNTIME_DIR"), why))  # once per value: callers ask again and again
        log.warning("ignoring XDG_RUNTIME_DIR=%s for the same-host socket: %s", os.environ.get("XDG_RUNTIME_DIR"), why)
    base = os.environ.get("TMPDIR") or "/tmp"
    primary = os.path.join(base, f"tensorwire-{os.geteuid()}")
    try:
        os.close(open_private_dir(primary))
        return primary
    except InsecurePath as exc:
        return fallback_runtime_dir(base, str(exc))


def fallback_runtime_dir(base: str, why: str = "") -> str:
    """A private directory of ours under ``base`` that every process of our uid agrees on without talking:
    the ``tensorwire-<uid>-*`` directories that pass :func:`open_private_dir` (anyone can create such names,
    only ours pass), the first by name; one is made (``mkdtemp``) when there is none. Making it holds an
    ``flock`` on ``base``, so two processes starting at once make one; whoever holds that lock longer than
    ``_FALLBACK_LOCK_S`` only delays us. Remembered per process."""
    uid = os.geteuid()
    known = _fallbacks.get((base, uid))
    if known is not None:
        try:
            os.close(open_private_dir(known, create=False))
            return known
        except (InsecurePath, OSError):
            _fallbacks.pop((base, uid), None)
    prefix = f"tensorwire-{uid}-"
    lock_fd = os.open(base, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        _flock_for(lock_fd, _FALLBACK_LOCK_S)
        chosen = _first_private(base, prefix)
        if chosen is None:
            made = tempfile.mkdtemp(prefix=prefix, dir=base)  # 0700, ours
            chosen = _first_private(base, prefix) or made
    finally:
        os.close(lock_fd)  # releases the lock
    log.warning(
        "the runtime directory %s cannot be used (%s); using %s instead",
        os.path.join(base, f"tensorwire-{uid}"),
        why or "taken",
        chosen,
    )
    _fallbacks[(base, uid)] = chosen
    return chosen


def _flock_for(fd: int, wait_s: float) -> bool:
    deadline = time.monotonic() + wait_s
    while True:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return True
        except OSError:
            if time.monotonic() >= deadline:
                return False
            time.sleep(0.01)


def _first_private(base: str, prefix: str) -> str | None:
    names = sorted(e.name for e in os.scandir(base) if e.name.startswith(prefix))
    for name in names:
        path = os.path.join(base, name)
        try:
            os.close(open_private_dir(path, create=False))
            return path
        except (InsecurePath, OSError):
            continue
    return None


def open_private_dir(path: str, uid: int | None = None, *, create: bool = True, strict: bool = False) -> int:
    """Opens ``path`` as a directory handle (``O_DIRECTORY | O_NOFOLLOW``: a symlink in its last component is
    refused, not followed) and checks the handle, not the name: a directory owned by ``uid`` (default: our
    effective uid) that nobody else can write to (readable bits are tightened to 0700 quietly; ``strict``: refused
    too, the mode must be 0700). ``create``:
    make it (0700, and missing parents) first. Returns the descriptor (the caller closes it); files in it are
    then opened relative to it (``dir_fd=``), so whatever replaces the name later is never used.
    ``InsecurePath`` when it is missing and not made, a symlink, not a directory, or fails a check."""
    path = os.path.abspath(path)
    if create:
        try:
            os.makedirs(os.path.dirname(path), mode=0o700, exist_ok=True)
            os.mkdir(path, 0o700)
        except FileExistsError:
            pass
        except OSError as exc:
            raise InsecurePath(f"cannot create {path}: {exc}") from exc
    try:
        fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError as exc:
        if exc.errno in (errno.ELOOP, errno.ENOTDIR):
            raise InsecurePath(f"{path} is not a plain directory (symlink or file)") from exc
        raise InsecurePath(f"cannot open {path}: {exc}") from exc
    try:
        st = os.fstat(fd)
        check_private_dir(path, st, uid)
        if strict and stat.S_IMODE(st.st_mode) & 0o077:
            raise InsecurePath(f"{path} has mode {stat.S_IMODE(st.st_mode):04o}, not 0700")
        if stat.S_IMODE(st.st_mode) != 0o700:
            os.fchmod(fd, 0o700)
    except BaseException:
        os.close(fd)
        raise
    return fd


def ensure_private_dir(path: str, uid: int | None = None) -> str:
    """Creates ``path`` (0700) if missing and checks it (:func:`open_private_dir`): a plain directory, owned by
    ``uid`` (default: our effective uid), not group/world-writable (readable bits are tightened quietly). Returns
    the absolute path; ``InsecurePath``. The one implementation of these checks: the broadcaster's directory
    (``tp._paths``) and the same-host channel's both come here."""
    path = os.path.abspath(path)
    os.close(open_private_dir(path, uid))
    return path


def check_private_dir(path: str, st: os.stat_result | None = None, uid: int | None = None) -> None:
    """``InsecurePath`` unless ``path`` (or ``st``, its ``lstat`` or its handle's ``fstat``) is a plain directory
    of ``uid`` (default: ours) that nobody else can write to."""
    st = st if st is not None else os.lstat(path)
    uid = os.geteuid() if uid is None else uid
    if stat.S_ISLNK(st.st_mode) or not stat.S_ISDIR(st.st_mode):
        raise InsecurePath(f"{path} is not a plain directory (symlink or file)")
    if st.st_uid != uid:
        raise InsecurePath(f"{path} is owned by uid {st.st_uid}, not by us (uid {uid})")
    if st.st_mode & 0o022:
        raise InsecurePath(f"{path} is group/world-writable (mode {stat.S_IMODE(st.st_mode):04o})")


def read_private_file(dir_fd: int, name: str, max_bytes: int = 1 << 20) -> bytes:
    """The bytes of ``name`` in the directory handle ``dir_fd`` (``O_NOFOLLOW``): a regular file of ours, else
    ``InsecurePath``; ``OSError`` (``FileNotFoundError``) as the system says."""
    fd = os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK, dir_fd=dir_fd)
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or st.st_uid != os.geteuid():
            raise InsecurePath(f"{name} is not a regular file of ours")
        return os.read(fd, max_bytes)
    finally:
        os.close(fd)


def write_private_file(dir_fd: int, name: str, data: bytes) -> None:
    """Writes ``name`` in the directory handle ``dir_fd`` atomically (a 0600 temporary file of a unique name,
    then a rename over ``name``)."""
    tmp = f".{name}.{os.getpid()}.{secrets.token_hex(4)}"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600, dir_fd=dir_fd)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.replace(tmp, name, src_dir_fd=dir_fd, dst_dir_fd=dir_fd)
    except BaseException:
        try:
            os.unlink(tmp, dir_fd=dir_fd)
        except OSError:
            pass
        raise


def check_socket_path(path: str) -> None:
    """``InsecurePath`` (or ``OSError``, e.g. it is gone) unless ``path`` is a socket of ours, 0600 at most,
    in a private directory of ours: what a client checks before it connects to an advertised path."""
    if not os.path.isabs(path) or len(os.fsencode(path)) >= SUN_PATH_LIMIT:
        raise InsecurePath(f"{path!r} is not an absolute socket path under {SUN_PATH_LIMIT} bytes")
    check_private_dir(os.path.dirname(path))
    st = os.lstat(path)
    if not stat.S_ISSOCK(st.st_mode):
        raise InsecurePath(f"{path} is not a socket")
    if st.st_uid != os.geteuid():
        raise InsecurePath(f"{path} is owned by uid {st.st_uid}, not by us (uid {os.geteuid()})")
    if st.st_mode & 0o077:
        raise InsecurePath(f"{path} is accessible to others (mode {stat.S_IMODE(st.st_mode):04o})")


def peer_uid(sock: socket.socket) -> tuple[int, int]:
    """(pid, uid) of the process at the other end of a connected Unix socket (SO_PEERCRED)."""
    creds = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
    pid, uid, _gid = struct.unpack("3i", creds)
    return pid, uid


def listen(path: str, backlog: int = 64) -> socket.socket:
    """A listening stream socket at ``path`` (a stale file there is replaced), mode 0600. The caller made the
    directory private (``ensure_private_dir``): nobody else can reach the file between bind and chmod."""
    if len(os.fsencode(path)) >= SUN_PATH_LIMIT:
        raise InsecurePath(f"socket path too long ({len(os.fsencode(path))} bytes, limit {SUN_PATH_LIMIT - 1})")
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        sock.bind(path)
        os.chmod(path, 0o600)
        sock.listen(backlog)
    except BaseException:
        sock.close()
        raise
    return sock


def is_gone(sock: socket.socket) -> bool:
    """True when the peer hung up or the socket failed (never blocks, reads nothing)."""
    p = select.poll()
    p.register(sock, _GONE)
    return bool(p.poll(0))


def is_quiet(sock: socket.socket) -> bool:
    """True when nothing is readable and the peer is still there: an idle connection that may be reused."""
    p = select.poll()
    p.register(sock, select.POLLIN | _GONE)
    return not p.poll(0)


def _blocking(sock: socket.socket) -> None:
    """Puts ``sock`` in blocking mode once (one ioctl); the frame functions then bound their waits themselves.

    Why not ``settimeout(left)`` before every call: CPython's ``settimeout`` issues an ioctl each time, and a socket
    with a timeout polls before every send and recv; a round trip paid ~6 of those syscalls more than it needs
    (measured ~1 us each on these VMs). In blocking mode ``MSG_DONTWAIT`` makes one call non-blocking, and
    ``_poll`` waits only when the call would block."""
    if sock.gettimeout() is not None:
        sock.settimeout(None)


def _poll(sock: socket.socket, events: int, deadline: float) -> None:
    """Waits until ``sock`` is ready for ``events`` (or hung up / failed: the next call says how), else
    ``TimeoutError`` at ``deadline``."""
    fd = sock.fileno()
    if fd < 0:
        raise OSError(errno.EBADF, "the socket is closed")
    p = select.poll()
    p.register(fd, events)
    while True:
        left = deadline - time.monotonic()
        if left <= 0:
            raise TimeoutError("deadline passed")
        if p.poll(left * 1000.0):  # milliseconds, rounded up
            return


def wait_readable(sock: socket.socket, deadline: float) -> bool:
    """True once ``sock`` has bytes to read or the peer hung up (a read then says which); False at ``deadline``.
    For a server waiting for a client's next request: an idle connection can be ended."""
    _blocking(sock)
    try:
        _poll(sock, select.POLLIN, deadline)
    except TimeoutError:
        return False
    return True


def send_frame(
    sock: socket.socket, payload: Buffer | Sequence[Buffer], deadline: float | None, fds: Sequence[int] = ()
) -> None:
    """Writes one frame (header, then ``payload``: one buffer or pieces, sent without joining them). ``fds``:
    file descriptors passed with the frame's first byte (SCM_RIGHTS; the receiver needs ``recv_frame(fds=)``)."""
    pieces: list[memoryview] = [
        memoryview(p).cast("B")
        for p in ((payload,) if isinstance(payload, (bytes, bytearray, memoryview)) else payload)
    ]
    total = sum(len(p) for p in pieces)
    pieces.insert(0, memoryview(FRAME_HEADER.pack(total)))
    _blocking(sock)
    if deadline is not None and deadline <= time.monotonic():
        raise TimeoutError("deadline passed")
    ancillary = [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", fds))] if fds else []
    while pieces:
        if deadline is None:
            sent = sock.sendmsg(pieces[:512], ancillary)  # IOV_MAX is 1024
        else:
            try:
                sent = sock.sendmsg(pieces[:512], ancillary, socket.MSG_DONTWAIT)
            except BlockingIOError:  # the socket buffer is full: wait for room
                _poll(sock, select.POLLOUT, deadline)
                continue
        ancillary = []  # sent with the first byte
        while sent:
            n = len(pieces[0])
            if sent >= n:
                sent -= n
                pieces.pop(0)
            else:
                pieces[0] = pieces[0][sent:]
                sent = 0
        while pieces and not len(pieces[0]):
            pieces.pop(0)


def _recv_exact(
    sock: socket.socket,
    view: memoryview,
    deadline: float | None,
    started: bool,
    expect_wait: bool = False,
    fds: list[int] | None = None,
) -> bool:
    """Fills ``view``; False on a clean EOF before its first byte when ``started`` is False. ``expect_wait``:
    the bytes are probably not there yet (an answer to a request just sent), so poll before the first read.
    ``fds``: collects the descriptors passed with these bytes (``_recv_into``)."""
    got = 0
    if deadline is not None and expect_wait:
        _poll(sock, select.POLLIN, deadline)
    while got < len(view):
        if deadline is None:
            n = _recv_into(sock, view[got:], 0, fds)
        else:
            try:
                n = _recv_into(sock, view[got:], socket.MSG_DONTWAIT, fds)
            except BlockingIOError:
                _poll(sock, select.POLLIN, deadline)
                continue
        if n == 0:
            if got == 0 and not started:
                return False
            raise ConnectionAbortedError("peer closed the connection in the middle of a frame")
        got += n
    return True


_FDS_SPACE = socket.CMSG_SPACE(MAX_FDS * array.array("i").itemsize)


def _recv_into(sock: socket.socket, view: memoryview, flags: int, fds: list[int] | None) -> int:
    """One ``recv_into``; with ``fds``, a ``recvmsg_into`` that adds the descriptors passed with the bytes to it
    (at most ``MAX_FDS``: more, or a truncated set, close what came and fail, so a peer cannot make us hold
    descriptors)."""
    if fds is None:
        return sock.recv_into(view, 0, flags)
    n, ancdata, msg_flags, _ = sock.recvmsg_into([view], _FDS_SPACE, flags)
    for level, kind, data in ancdata:
        if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
            passed = array.array("i")
            passed.frombytes(data[: len(data) - len(data) % passed.itemsize])
            fds.extend(passed)
    if msg_flags & socket.MSG_CTRUNC or len(fds) > MAX_FDS:
        close_fds(fds)
        raise ValueError(f"more than {MAX_FDS} file descriptors passed with one frame")
    return n


def close_fds(fds: list[int]) -> None:
    """Closes and forgets every descriptor in ``fds``."""
    while fds:
        try:
            os.close(fds.pop())
        except OSError:
            pass


def recv_frame(
    sock: socket.socket,
    deadline: float | None,
    max_bytes: int,
    fds: list[int] | None = None,
    *,
    expect_wait: bool = True,
) -> bytearray | None:
    """Reads one frame into fresh memory; None when the peer closed cleanly between frames. ``fds``: a list that
    receives the descriptors passed with the frame (the caller owns and closes them; without it none are
    accepted: the kernel closes any that arrive). ``expect_wait=False``: the caller knows bytes are there (it
    polled), so the first read goes without another poll."""
    _blocking(sock)
    if deadline is not None and deadline <= time.monotonic():
        raise TimeoutError("deadline passed")
    head = bytearray(FRAME_HEADER.size)
    if not _recv_exact(sock, memoryview(head), deadline, started=False, expect_wait=expect_wait, fds=fds):
        return None
    (n,) = FRAME_HEADER.unpack(head)
    if n > max_bytes:
        raise ValueError(f"frame of {n} bytes is over the limit of {max_bytes}")
    body = bytearray(n)
    _recv_exact(sock, memoryview(body), deadline, started=True)
    return body


__all__ = [
    "FRAME_HEADER",
    "MAX_FDS",
    "InsecurePath",
    "SUN_PATH_LIMIT",
    "check_private_dir",
    "check_socket_path",
    "close_fds",
    "default_runtime_dir",
    "ensure_private_dir",
    "fallback_runtime_dir",
    "host_token",
    "is_gone",
    "is_quiet",
    "listen",
    "open_private_dir",
    "peer_uid",
    "read_private_file",
    "recv_frame",
    "send_frame",
    "wait_readable",
    "write_private_file",
    "xdg_runtime_dir",
]
