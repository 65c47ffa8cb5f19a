"""Unix-socket star transport: rank 0 writes every frame to one stream per reader; readers parse it off their stream.

Frames on a stream are back to back (``_frame``: header, table, packed payload). An ABORT frame is rank 0's last
word before it hangs up; readers raise ``PeerClosed`` with its message. ``UdsRoot`` writes a frame to the streams
one after the other under ``_send_lock``, so an abort frame never lands inside a half-sent frame.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence

from tensorwire.errors import BroadcastError, FrameMismatch, PeerClosed, Reason

from ._config import BroadcastConfig
from ._frame import HEADER, KIND_ABORT, LastFrame, Layout, decode_header, decode_table, encode_abort, frame_seq
from ._link import Link, Waiter
from ._paths import Rendezvous
from ._spin import SpinWindow
from ._transport import Into, ReaderSide, RootSide, again


class UdsRoot(RootSide):
    """Rank 0's end of the star. See ``Transport`` for the contract."""

    align = 1

    def __init__(self, links: list[Link | None], endpoint: Rendezvous, config: BroadcastConfig, session: str) -> None:
        self._send_lock = threading.Lock()
        self._seq = 0
        super().__init__(links, endpoint, config, session)

    def send(
        self,
        seq: int,
        prefix: bytes | bytearray,
        views: Sequence[memoryview],
        offsets: Sequence[int],
        payload_bytes: int,
    ) -> None:
        def waiter() -> Waiter:
            return self._waiter(f"broadcast of message {seq}")

        parts: list[memoryview | bytes | bytearray] = [prefix]
        parts.extend(v for v in views if len(v))
        total = len(prefix) + payload_bytes
        dead: Link | None = None
        error: PeerClosed | None = None
        with self._send_lock:
            self._raise_if_aborted()
            for lk in self._peers:
                try:
                    lk.send_all(parts, waiter, total)
                except PeerClosed as exc:
                    dead, error = lk, exc
                    break
        if dead is not None and error is not None:
            if self._error is not None:  # aborted meanwhile (close from another thread, watchdog): say why
                raise again(self._error) from error
            # Outside the send lock: every other stream is at a frame boundary, so abort frames are safe.
            self._abort_group(dead.peer, "connection lost during a send")
            raise error
        self._seq = seq

    def _tell_group(self, dead: int, cause: str) -> None:
        note = encode_abort(self._seq + 1, f"rank {dead} {cause}" if dead > 0 else cause)
        if not self._send_lock.acquire(timeout=0.2):  # never interleave with a half-sent frame
            return  # a send is stuck on a full socket; the hang-up that follows tells every reader
        try:
            for lk in self._peers:
                if lk.peer != dead:
                    lk.send_nowait(note)
        finally:
            self._send_lock.release()

    def _release(self) -> None:
        pass


class UdsReader(ReaderSide):
    """A reader's end of the star: a 64 KiB read-ahead buffer, then large tensors straight into their storage."""

    align = 1

    def __init__(self, link: Link, rank: int, endpoint: Rendezvous, config: BroadcastConfig, world: int) -> None:
        super().__init__(link, rank, endpoint, config)
        self._last = LastFrame()
        self._window = SpinWindow(config.spin_s, config.spin_max_s, config.spin_gap_factor, world)

    def recv(self, seq: int, into: Into) -> Layout:
        if self._error is not None:
            raise again(self._error)
        try:
            return self._recv(seq, into)
        except BroadcastError as exc:
            if self._error is not None:  # our own abort() (close from another thread) shut the link
                raise again(self._error) from exc
            raise

    def _recv(self, seq: int, into: Into) -> Layout:
        link = self._link

        def waiter() -> Waiter:
            return self._waiter_for(seq)

        if link.buffered() < HEADER.size:
            t0 = time.monotonic()
            spin_until = t0 + self._window.budget()
            while link.buffered() < HEADER.size:
                link.fill(waiter, spin_until)
            self._window.record(time.monotonic() - t0)
        else:
            self._window.record(0.0)
        last = self._last
        buf, start, end = link.window()
        layout = last.match(buf, start, end)
        if layout is not None:  # the hot loop: same dtype and shape as the last frame
            fseq = frame_seq(buf, start)
            link.consume(last.prefix_bytes)
        else:
            kind, fseq, n, table_bytes, payload_bytes, structure = decode_header(link.peek(HEADER.size), self._rank)
            head = bytes(link.peek(HEADER.size))
            link.consume(HEADER.size)
            if kind == KIND_ABORT:
                msg = link.read_exact(min(payload_bytes, 4096), waiter).decode("utf-8", "replace")
                raise PeerClosed(f"rank {self._rank}: rank 0 aborted the group: {msg}", reason=Reason.PEER_CLOSED)
            table = link.read_exact(table_bytes, waiter)
            entries = decode_table(table, n, payload_bytes, self._rank)
            layout = Layout(kind, fseq, structure, entries, table_bytes, payload_bytes)
            last.remember(head + table, layout)
        if fseq != seq:
            raise FrameMismatch(
                f"rank {self._rank}: received message {fseq}, expected {seq}: the ranks are out of step"
            )
        views = into(layout)
        pos = 0
        for e, v in zip(layout.entries, views, strict=True):
            if e.offset != pos:
                link.skip(e.offset - pos, waiter)
            if e.nbytes:
                link.recv_into_exact(v, waiter)
            pos = e.offset + e.nbytes
        if layout.payload_bytes != pos:
            link.skip(layout.payload_bytes - pos, waiter)
        return layout
