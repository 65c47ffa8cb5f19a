"""The seam between CpuTpBroadcaster and the ways a frame reaches the readers: the shm ring and the socket star.

``ShmRoot`` / ``ShmReader`` and ``UdsRoot`` / ``UdsReader``; ``open_transport`` bootstraps the group and
returns one. The broadcaster frames tensors, keeps the sequence number and calls ``send``/``recv``/``abort``/
``close``; ``RootSide`` and ``ReaderSide`` hold what the backends share.
"""

from __future__ import annotations

import abc
import logging
import os
import select
import socket
import threading
from collections.abc import Callable, Sequence

from tensorwire.errors import BroadcastError, ClosedError, PeerClosed, Reason, TensorwireError

from ._config import BroadcastConfig
from ._frame import Layout
from ._link import Link, Waiter
from ._paths import Rendezvous

log = logging.getLogger(__name__)

BYE = b"BYE!"  # a reader's goodbye to rank 0's watchdog
Into = Callable[[Layout], Sequence[memoryview]]
Use = Callable[[Layout, memoryview], object]


def again(error: TensorwireError) -> TensorwireError:
    """A fresh exception like ``error`` (same class, message and reason) to raise from another call."""
    return type(error)(str(error), reason=error.reason)


class Transport(abc.ABC):
    """One rank's end of a bootstrapped broadcaster group: rank 0's sends the frames, each reader's receives them.

    Sequence: messages are numbered 1, 2, 3, ... with no gaps; rank 0 sends message s once, every reader receives
    it once, in order. ``align`` is the payload alignment that frames for this transport are encoded with.

    Ownership: ``send`` copies every byte of ``prefix`` and ``views`` out before it returns, so the caller may
    modify its tensors afterwards. ``recv`` calls ``into(layout)`` once, after the header and table are validated
    and before any payload byte is written (not at all when it raises before); ``into`` returns one writable view
    per entry (``nbytes`` bytes each), which ``recv`` fills and keeps no reference to after it returns; ``into`` may
    raise (``FrameMismatch``), which ``recv`` passes on. ``recv`` may return the previous call's ``Layout`` object
    again when the header (but the sequence number) and table are byte-identical, so callers may skip re-checking
    a target with ``layout is last_layout`` (a new object only means: check again).

    Threads: ``send`` (rank 0) and ``recv`` (readers) are called by one thread at a time and never overlap; the
    broadcaster serialises them. ``abort`` may be called from any thread at any time, also while ``send``/``recv``
    blocks in another thread; it is idempotent (the first error wins) and returns within about 0.2 s. ``close`` is
    called once no ``send``/``recv`` is running (the broadcaster waits for the call in flight) and never twice at
    the same time; it is idempotent and does what ``abort(ClosedError(...))`` does first when nothing aborted yet.

    Errors from ``send``/``recv``: ``PeerClosed`` (a rank died, hung up or aborted the group), ``FrameMismatch``
    (a frame this reader cannot accept, or is not the one expected), ``BroadcastTimeout`` (``config.timeout_s``
    passed), ``BroadcastError(SLOT_TOO_LARGE)`` (rank 0: larger than the shm arena; nothing was written). Once
    ``abort(error)`` ran, a blocked call returns promptly and it and every later call raise a copy of ``error``
    (``ClosedError`` for a close), except that a frame already complete when the abort came may still be delivered.
    """

    align: int = 1
    endpoint: Rendezvous | None = None  # where the group met (for logs)

    def send(
        self,
        seq: int,
        prefix: bytes | bytearray,
        views: Sequence[memoryview],
        offsets: Sequence[int],
        payload_bytes: int,
    ) -> None:
        """Rank 0: deliver message ``seq`` (``prefix`` = header and table, tensor i's bytes ``views[i]`` at
        payload offset ``offsets[i]``, ``payload_bytes`` in all) to every reader."""
        raise BroadcastError("send() is rank 0's; this is a reader's transport", reason=Reason.INVALID_CONFIG)

    def recv(self, seq: int, into: Into) -> Layout:
        """A reader: receive message ``seq`` into the views ``into(layout)`` returns; returns its layout."""
        raise BroadcastError("recv() is a reader's; this is rank 0's transport", reason=Reason.INVALID_CONFIG)

    def recv_view(self, seq: int, use: Use) -> object:
        """A reader: receive message ``seq`` and return ``use(layout, payload)``, ``payload`` a read-only view of its
        ``payload_bytes`` (entries at their offsets). The view is valid only during the call: ``use`` must copy
        what it keeps and hold no export of it after it returns (shm passes the ring itself, with no copy; the
        message's slot is released once ``use`` returns or raises). Errors as ``recv``, plus whatever ``use`` raises.
        This default receives into one buffer through ``recv``."""
        buf = bytearray(0)

        def into(layout: Layout) -> Sequence[memoryview]:
            buf.extend(bytes(layout.payload_bytes))
            mv = memoryview(buf)
            return [mv[e.offset : e.offset + e.nbytes] for e in layout.entries]

        layout = self.recv(seq, into)
        with memoryview(buf) as mv:
            return use(layout, mv.toreadonly())

    @abc.abstractmethod
    def abort(self, error: TensorwireError) -> None:
        """Give up on the group: wake a blocked call (it raises a copy of ``error``) and make the other ranks' calls
        fail. ``ClosedError`` means a clean close (rank 0 tells the readers it closed, a reader says goodbye), any
        other error a failure (this side hangs up; rank 0's watchdog then aborts the rest of the group)."""

    @abc.abstractmethod
    def close(self) -> None:
        """Release sockets, threads and shared memory. Only once no send()/recv() is running."""


class RootSide(Transport):
    """Rank 0's half of either backend: one Link per reader, the watchdog, and who aborted the group first.

    Subclasses implement ``_tell_group`` (how the readers learn that the group is over) and ``_release``.
    ``_error`` is written once, under ``_lock``; send loops read it to stop when the group is aborted.
    """

    def __init__(self, links: list[Link | None], endpoint: Rendezvous, config: BroadcastConfig, session: str) -> None:
        self.endpoint = endpoint
        self._cfg = config
        self._peers = [lk for lk in links if lk is not None]
        self._links = links
        self._error: TensorwireError | None = None
        self._lock = threading.Lock()
        self._released = False
        r, self._stop_w = os.pipe2(os.O_CLOEXEC | os.O_NONBLOCK)
        watchdog = threading.Thread(
            target=self._watch, args=(r,), name=f"tensorwire-tp-watchdog-{session}", daemon=True
        )
        self._watchdog: threading.Thread | None = watchdog
        watchdog.start()

    def _waiter(self, what: str) -> Waiter:
        return Waiter(0, what, self._cfg.timeout_s, self._cfg.stall_warn_s)

    def _raise_if_aborted(self) -> None:
        error = self._error
        if error is not None:
            raise again(error)

    @abc.abstractmethod
    def _tell_group(self, dead: int, cause: str) -> None:
        """Make every reader's current or next call raise PeerClosed: rank ``dead`` died or left (``dead`` > 0),
        or rank 0 closed (``dead`` == 0). Called once, under ``_lock``, before the links are hung up."""

    @abc.abstractmethod
    def _release(self) -> None:
        """Free what the subclass owns (the ring); under ``_lock``, after the links are closed."""

    def abort(self, error: TensorwireError) -> None:
        with self._lock:
            first = self._error is None and not self._released
            if first:
                self._error = error
                if isinstance(error, ClosedError):
                    self._tell_group(0, "rank 0 closed its broadcaster")
        self._hang_up()

    def _abort_group(self, dead: int, cause: str) -> None:
        """Rank ``dead`` died or left (watchdog), or its link failed during a send: abort the group naming it."""
        with self._lock:
            if self._error is None and not self._released:
                self._error = PeerClosed(
                    f"rank 0: rank {dead} {cause}; the group is aborted", reason=Reason.PEER_CLOSED
                )
                self._tell_group(dead, cause)
        self._hang_up()

    def _hang_up(self) -> None:
        for lk in self._peers:
            lk.shutdown()  # wakes a send blocked on this link; the reader sees EOF after what was sent

    def close(self) -> None:
        if self._error is None:
            self.abort(ClosedError("rank 0: broadcaster closed"))
        self._stop_watchdog()
        with self._lock:
            if self._released:
                return
            self._released = True
            for lk in self._peers:
                lk.close()
            self._release()

    def _stop_watchdog(self) -> None:
        if self._stop_w >= 0:
            try:
                os.write(self._stop_w, b"x")
            except OSError:
                pass
            if self._watchdog is not None and self._watchdog is not threading.current_thread():
                self._watchdog.join(timeout=2.0)
            os.close(self._stop_w)
            self._stop_w = -1
        self._watchdog = None

    def _watch(self, stop_r: int) -> None:
        """Peers never send after bootstrap, so anything readable on a link is a goodbye or a death."""
        try:
            poller = select.poll()
            by_fd = {lk.fd: lk for lk in self._peers}
            for fd in by_fd:
                poller.register(fd, select.POLLIN)
            poller.register(stop_r, select.POLLIN)
            while True:
                events = poller.poll()
                if any(fd == stop_r for fd, _ in events) or self._error is not None:
                    return  # stopped, or we aborted the group ourselves and this is the readers' echo
                for fd, _ev in events:
                    lk = by_fd.get(fd)
                    if lk is None:
                        continue
                    try:
                        data = lk.sock.recv(64, socket.MSG_DONTWAIT)
                    except OSError:
                        data = b""
                    if data.startswith(BYE):
                        log.info("rank 0: rank %d closed its broadcaster; aborting the group", lk.peer)
                        cause = "closed its broadcaster"
                    else:
                        log.warning("rank 0: lost the connection to rank %d (it died?); aborting the group", lk.peer)
                        cause = "died (its connection dropped)"
                    self._abort_group(lk.peer, cause)
                    return
        except Exception:  # the watchdog must never die silently with the group half-aborted
            log.exception("rank 0: broadcaster watchdog failed")
        finally:
            os.close(stop_r)


class ReaderSide(Transport):
    """A reader's half of either backend: its one Link to rank 0 and the abort bookkeeping.

    A blocked ``recv`` always ends up polling the link, so ``abort`` wakes it by shutting the link down; the
    subclass's ``recv`` then finds ``_error`` set and raises a copy of it instead of "rank 0 hung up".
    """

    def __init__(self, link: Link, rank: int, endpoint: Rendezvous, config: BroadcastConfig) -> None:
        self.endpoint = endpoint
        self._link = link
        self._rank = rank
        self._cfg = config
        self._error: TensorwireError | None = None
        self._lock = threading.Lock()
        self._released = False

    def _waiter_for(self, seq: int) -> Waiter:
        return Waiter(
            self._rank,
            f"broadcast (waiting for message {seq} from rank 0)",
            self._cfg.timeout_s,
            self._cfg.stall_warn_s,
        )

    def _release(self) -> None:
        """Free what the subclass owns (the ring); under ``_lock``, after the link is closed."""

    def abort(self, error: TensorwireError) -> None:
        with self._lock:
            if self._error is None and not self._released:
                self._error = error
                if isinstance(error, ClosedError):
                    self._link.send_nowait(BYE)  # rank 0 logs a goodbye instead of a death
        self._link.shutdown()  # hanging up tells rank 0's watchdog, which aborts the rest of the group

    def close(self) -> None:
        if self._error is None:
            self.abort(ClosedError(f"rank {self._rank}: broadcaster closed"))
        with self._lock:
            if self._released:
                return
            self._released = True
            self._link.close()
            self._release()
