"""One AF_UNIX stream to one peer: deadlines, stall warnings, no SIGPIPE, EINTR and short I/O handled.

Every send uses MSG_NOSIGNAL (a dead peer is an error naming its rank, never a signal) and MSG_DONTWAIT,
falling back to poll() with the remaining time; receives go through a small read-ahead buffer so a 1 KiB frame
costs one recv. PEP 475 retries EINTR inside each call; the loops here handle short reads and writes.
"""

from __future__ import annotations

import errno
import logging
import os
import select
import socket
import time
from collections.abc import Callable, Sequence
from typing import Union

from tensorwire.errors import BroadcastTimeout, PeerClosed, Reason

log = logging.getLogger(__name__)

_SEND_FLAGS = socket.MSG_NOSIGNAL | socket.MSG_DONTWAIT
WaiterLike = Union["Waiter", Callable[[], "Waiter"]]  # a factory defers the clock reads to the slow path
_POLL_ERR = select.POLLERR | select.POLLHUP | select.POLLNVAL


class Waiter:
    """Deadline plus rate-limited stall warnings for one blocking wait; ``check()`` once per loop turn."""

    __slots__ = ("_start", "_deadline", "_timeout_s", "_warn_every", "_next_warn", "_what", "_rank")

    def __init__(self, rank: int, what: str, timeout_s: float | None, stall_warn_s: float) -> None:
        self._start = time.monotonic()
        self._timeout_s = timeout_s
        self._deadline = None if timeout_s is None else self._start + timeout_s
        self._warn_every = stall_warn_s
        self._next_warn = self._start + stall_warn_s
        self._what = what
        self._rank = rank

    def check(self, now: float | None = None) -> float:
        """Raise BroadcastTimeout past the deadline, warn when due; returns seconds until the next event."""
        now = time.monotonic() if now is None else now
        if self._deadline is not None and now >= self._deadline:
            raise BroadcastTimeout(
                f"rank {self._rank}: {self._what} timed out after {self._timeout_s:.3f} s",
                reason=Reason.BROADCAST_TIMEOUT,
            )
        if now >= self._next_warn:
            log.warning(
                "rank %d: %s still waiting after %.0f s; is that peer alive and calling broadcast?",
                self._rank,
                self._what,
                now - self._start,
            )
            self._next_warn = now + self._warn_every
        until = self._next_warn - now
        if self._deadline is not None:
            until = min(until, self._deadline - now)
        return max(until, 0.0)

    def retarget(self, what: str) -> None:
        self._what = what

    def blame(self, cause: str) -> None:
        """Name the likely cause in the timeout and stall messages (once; later calls keep the first)."""
        if "(" not in self._what:
            self._what = f"{self._what} ({cause})"


def _resolve(waiter: WaiterLike) -> Waiter:
    return waiter if isinstance(waiter, Waiter) else waiter()


class Link:
    """A connected stream socket to ``peer`` (a rank). Not thread-safe except ``shutdown()``."""

    def __init__(self, sock: socket.socket, my_rank: int, peer: int) -> None:
        sock.setblocking(False)
        self.sock = sock
        self.fd = sock.fileno()
        self.my_rank = my_rank
        self.peer = peer
        self._poll_in = select.poll()
        self._poll_in.register(self.fd, select.POLLIN)
        self._poll_out = select.poll()
        self._poll_out.register(self.fd, select.POLLOUT)
        self._rbuf = bytearray(64 * 1024)
        self._rmv = memoryview(self._rbuf)
        self._rstart = 0
        self._rend = 0

    # -- sending -------------------------------------------------------------------------------------------------
    def send_all(self, parts: Sequence[memoryview | bytes | bytearray], waiter: WaiterLike, total: int = -1) -> None:
        """Send every byte of ``parts`` (one sendmsg when the socket buffer has room)."""
        if total < 0:
            total = sum(len(p) for p in parts)
        try:
            sent = self.sock.sendmsg(parts, (), _SEND_FLAGS)
        except BlockingIOError:
            sent = 0
        except OSError as exc:
            raise self._closed_error("send", exc) from exc
        if sent == total:
            return
        flat = [memoryview(p).cast("B") for p in parts]
        while flat and sent >= len(flat[0]):
            sent -= len(flat[0])
            flat.pop(0)
        if flat:
            flat[0] = flat[0][sent:]
        for mv in flat:
            while len(mv):
                try:
                    n = self.sock.send(mv, _SEND_FLAGS)
                except BlockingIOError:
                    waiter = _resolve(waiter)
                    # The socket buffer toward this peer is full: if the wait times out, this peer is the cause.
                    waiter.blame(f"rank {self.my_rank} blocked sending to rank {self.peer}, which is not reading")
                    self._wait(self._poll_out, waiter)
                    continue
                except OSError as exc:
                    raise self._closed_error("send", exc) from exc
                mv = mv[n:]

    def send_nowait(self, data: bytes) -> bool:
        """Best effort, never blocks: False when the buffer is full or the peer is gone."""
        try:
            return self.sock.send(data, _SEND_FLAGS) == len(data)
        except OSError:
            return False

    # -- receiving -----------------------------------------------------------------------------------------------
    def buffered(self) -> int:
        return self._rend - self._rstart

    def fill(self, waiter: WaiterLike | None, spin_until: float = 0.0, idle: Callable[[], None] | None = None) -> None:
        """Read whatever is available into the read-ahead buffer, waiting (spin, then poll) for at least a byte."""
        if self._rstart == self._rend:
            self._rstart = self._rend = 0
        elif self._rend == len(self._rbuf):
            n = self._rend - self._rstart
            self._rmv[:n] = self._rmv[self._rstart : self._rend]
            self._rstart, self._rend = 0, n
        while True:
            try:
                n = self.sock.recv_into(self._rmv[self._rend :], 0, socket.MSG_DONTWAIT)
            except BlockingIOError:
                if spin_until and time.monotonic() < spin_until:
                    os.sched_yield()
                    continue
                if waiter is None:
                    return
                if idle is not None:
                    idle()
                waiter = _resolve(waiter)
                self._wait(self._poll_in, waiter)
                continue
            except OSError as exc:
                raise self._closed_error("recv", exc) from exc
            if n == 0:
                raise PeerClosed(
                    f"rank {self.my_rank}: rank {self.peer} closed the connection (EOF) "
                    f"while we were reading: it died or closed its broadcaster",
                    reason=Reason.PEER_CLOSED,
                )
            self._rend += n
            return

    def read_exact(self, n: int, waiter: WaiterLike) -> bytes:
        while self.buffered() < n:
            if n > len(self._rbuf):
                out = bytearray(n)
                self.recv_into_exact(memoryview(out), waiter)
                return bytes(out)
            self.fill(waiter)
        data = bytes(self._rmv[self._rstart : self._rstart + n])
        self._rstart += n
        return data

    def peek(self, n: int) -> memoryview:
        return self._rmv[self._rstart : self._rstart + n]

    def window(self) -> tuple[memoryview, int, int]:
        """(buffer, start, end): the read-ahead bytes are ``buffer[start:end]`` (no copy, no slice object)."""
        return self._rmv, self._rstart, self._rend

    def consume(self, n: int) -> None:
        self._rstart += n

    def recv_into_exact(self, mv: memoryview, waiter: WaiterLike) -> None:
        """Fill ``mv`` completely: first from the read-ahead buffer, then straight from the socket."""
        have = min(self.buffered(), len(mv))
        if have:
            mv[:have] = self._rmv[self._rstart : self._rstart + have]
            self._rstart += have
            mv = mv[have:]
        while len(mv):
            try:
                n = self.sock.recv_into(mv, 0, socket.MSG_DONTWAIT)
            except BlockingIOError:
                waiter = _resolve(waiter)
                self._wait(self._poll_in, waiter)
                continue
            except OSError as exc:
                raise self._closed_error("recv", exc) from exc
            if n == 0:
                raise PeerClosed(
                    f"rank {self.my_rank}: rank {self.peer} closed the connection (EOF) with "
                    f"{len(mv)} bytes of a frame still missing: it died or closed its broadcaster",
                    reason=Reason.PEER_CLOSED,
                )
            mv = mv[n:]

    def skip(self, n: int, waiter: WaiterLike) -> None:
        """Discard ``n`` bytes (alignment padding), in bounded chunks."""
        scratch = memoryview(bytearray(min(n, 1 << 16))) if n else None
        while n:
            k = min(n, 1 << 16)
            assert scratch is not None
            self.recv_into_exact(scratch[:k], waiter)
            n -= k

    def drain(self) -> bool:
        """Discard whatever is readable now; False when the peer has closed."""
        while True:
            try:
                n = self.sock.recv_into(self._rmv, 0, socket.MSG_DONTWAIT)
            except BlockingIOError:
                return True
            except OSError:
                return False
            if n == 0:
                return False

    # -- waiting -------------------------------------------------------------------------------------------------
    def _wait(self, poller: select.poll, waiter: WaiterLike) -> None:
        until = _resolve(waiter).check()
        timeout_ms = max(1, int(min(until, 3600.0) * 1000))
        events = poller.poll(timeout_ms)
        for _, ev in events:
            if ev & select.POLLNVAL:
                raise PeerClosed(
                    f"rank {self.my_rank}: link to rank {self.peer} was closed locally", reason=Reason.PEER_CLOSED
                )

    def poll_hangup(self) -> bool:
        """True when the peer hung up or sent something (peers only ever send a goodbye after bootstrap)."""
        return bool(self._poll_in.poll(0))

    def _closed_error(self, op: str, exc: OSError) -> PeerClosed:
        name = errno.errorcode.get(exc.errno or 0, str(exc.errno))
        return PeerClosed(
            f"rank {self.my_rank}: {op} to/from rank {self.peer} failed ({name}: {exc.strerror}); "
            f"rank {self.peer} died or closed its broadcaster",
            reason=Reason.PEER_CLOSED,
        )

    def shutdown(self) -> None:
        try:
            self.sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass

    def close(self) -> None:
        try:
            self.sock.close()
        except OSError:
            pass
