"""Shared-memory transport: rank 0 writes each frame once into the ring (``_ring``), every reader copies it out once.

Publication protocol (sequence numbers start at 1 and only grow; message s uses slot s % n_slots)::

    writer (ShmRoot.send)                           reader r (ShmReader.recv)
    wait until min(ACK) >= s - n_slots (slot free)  spin: until PUB >= s (sched_yield between polls), spin_s
    wait for arena room (frames freed by ACKs)      then sleep: SLEEP_r = 1; full fence; re-check PUB;
    copy frame; write slot header                           poll(socket) -> woken by a byte from rank 0
    release fence                                   acquire fence
    PUB = s                                         check slot.seq == s; copy payload out
    full fence                                      release fence
    for r with SLEEP_r == 1: send 1 byte to r       ACK_r = s

The release/acquire pair orders the payload before PUB (writer) and PUB before the payload loads (reader); the
reader's release before ACK keeps its loads of the slot before the writer may overwrite it. The full fences make
the sleep hand-off a Dekker pair: either the writer sees SLEEP_r and wakes r, or r sees PUB >= s before sleeping,
so no wake-up is lost; the sleeping reader still re-checks every ``wait_poll_s`` as a safety net. See ``_fence``
for what the fences are on each architecture.

The wake-up mechanism (sleep flags plus a byte on the reader's socket) is confined to ``ShmRoot._wake`` and
``ShmReader._sleep_until``; a futex or an adaptive wait replaces those two methods and nothing else.
"""

from __future__ import annotations

import collections
import os
import select
import time
from collections.abc import Sequence

from tensorwire.errors import BroadcastError, FrameMismatch, PeerClosed, Reason

from . import _fence
from ._config import BroadcastConfig
from ._frame import HEADER, KIND_DATA, LastFrame, Layout, decode_header, decode_table
from ._link import Link, Waiter
from ._paths import Endpoint
from ._ring import ABORT, ABORT_PEER_DIED, ABORT_ROOT_CLOSED, PUB, SLOT_HEADER, Ring, align
from ._transport import Into, ReaderSide, RootSide, again

_WAKE = b"\x01"


class ShmRoot(RootSide):
    """Rank 0's end of the ring. See the module docstring for the protocol and ``Transport`` for the contract."""

    align = 64

    def __init__(self, ring: Ring, links: list[Link | None], endpoint: Endpoint, config: BroadcastConfig,
                 session: str) -> None:
        self._ring = ring
        # Hot-path copies of the ring's views and sizes (valid until close(), which runs after the last send).
        self._mv, self._w, self._hdr, self._n_slots = ring.mv, ring.w, ring.hdr, ring.n_slots
        self._bases = [ring.slot_base(i) for i in range(ring.n_slots)]
        self._inline_room = ring.slot_bytes - SLOT_HEADER
        self._sleep_word_idx = range(len(ring.sleep_words))
        self._arena_live: collections.deque[tuple[int, int, int]] = collections.deque()  # (seq, start, end)
        self._known_ack = 0  # a lower bound of min(ACK): acks only grow, so re-read only when it is too low
        super().__init__(links, endpoint, config, session)

    def send(self, seq: int, prefix: bytes | bytearray, views: Sequence[memoryview], offsets: Sequence[int],
             payload_bytes: int) -> None:
        need = seq - self._n_slots
        if need > self._known_ack:
            self._raise_if_aborted()
            self._known_ack = self._min_ack()[0]
            if self._known_ack < need:
                self._wait_acks(need, seq)
            else:
                _fence.acquire()
        elif self._error is not None:
            raise again(self._error)
        plen = len(prefix)
        pstart = (plen + 63) & ~63
        frame_len = pstart + payload_bytes
        slot = seq % self._n_slots
        if frame_len <= self._inline_room:
            base, where, aoff = self._bases[slot], 0, 0
        else:
            aoff = self._arena_alloc(seq, frame_len)
            base, where = self._ring.arena_off + aoff, 1
        mv = self._mv
        mv[base: base + plen] = prefix
        pbase = base + pstart
        for src, off in zip(views, offsets, strict=True):
            n = len(src)
            if n:
                mv[pbase + off: pbase + off + n] = src
        h = self._hdr[slot]
        h[0], h[1], h[2], h[3] = seq, frame_len, where, aoff
        _fence.release()
        self._w[PUB] = seq
        _fence.full()
        self._wake()

    def _wake(self) -> None:
        """Send one wake byte to every reader whose sleep flag is set (none while readers keep up)."""
        words = self._ring.sleep_words
        for i in self._sleep_word_idx:
            if words[i]:
                break
        else:
            return
        ring = self._ring
        for r, f in enumerate(bytes(ring.mv[ring.sleep_off: ring.sleep_off + ring.world])):
            lk = self._links[r]
            if f and lk is not None:
                lk.send_nowait(_WAKE)  # a full buffer already holds wake bytes; a dead peer shows elsewhere

    def _min_ack(self) -> tuple[int, int]:
        ring = self._ring
        w = ring.w
        best, who = -1, 0
        for r in range(1, ring.world):
            a = w[ring.ack_idx[r]]
            if best < 0 or a < best:
                best, who = a, r
        return best, who

    def _wait_acks(self, need: int, seq: int) -> None:
        spin_until = time.monotonic() + self._cfg.spin_s
        sleep = 50e-6
        waiter: Waiter | None = None
        while True:
            got, who = self._min_ack()
            if got >= need:
                _fence.acquire()
                self._known_ack = max(self._known_ack, got)
                return
            now = time.monotonic()
            if now < spin_until:
                os.sched_yield()
                continue
            if waiter is None:
                waiter = self._waiter(f"broadcast of message {seq}")
            waiter.retarget(f"broadcast (rank 0 waiting for rank {who} to consume message {need})")
            waiter.check(now)
            self._raise_if_aborted()
            time.sleep(sleep)
            sleep = min(sleep * 2, 1e-3)

    def _arena_alloc(self, seq: int, n: int) -> int:
        arena_bytes = self._ring.arena_bytes
        if n > arena_bytes:
            raise BroadcastError(f"rank 0: frame of {n} bytes exceeds the shared-memory arena ({arena_bytes} "
                                 f"bytes); raise BroadcastConfig.arena_bytes", reason=Reason.SLOT_TOO_LARGE)
        live = self._arena_live
        while True:
            done, _ = self._min_ack()
            while live and live[0][0] <= done:
                live.popleft()
            if not live:
                start: int | None = 0
            else:
                first, last_end = live[0][1], live[-1][2]
                wrapped = live[-1][1] < first
                if not wrapped:
                    start = last_end if last_end + n <= arena_bytes else (0 if n <= first else None)
                else:
                    start = last_end if last_end + n <= first else None
            if start is not None:
                live.append((seq, start, align(start + n, 64)))
                return start
            self._wait_acks(live[0][0], seq)

    def _tell_group(self, dead: int, cause: str) -> None:
        self._ring.set_abort(ABORT_PEER_DIED if dead > 0 else ABORT_ROOT_CLOSED, dead)

    def _release(self) -> None:
        self._ring.release()


class ShmReader(ReaderSide):
    """A reader's end of the ring. See the module docstring for the protocol and ``Transport`` for the contract."""

    align = 64

    def __init__(self, ring: Ring, link: Link, rank: int, endpoint: Endpoint, config: BroadcastConfig) -> None:
        super().__init__(link, rank, endpoint, config)
        self._ring = ring
        # Hot-path copies of the ring's views and sizes (valid until close(), which runs after the last recv).
        self._mv, self._w, self._hdr, self._n_slots = ring.mv, ring.w, ring.hdr, ring.n_slots
        self._bases = [ring.slot_base(i) for i in range(ring.n_slots)]
        self._ack = ring.ack_idx[rank]
        self._last = LastFrame()
        self._hit_len = -1  # frame_len of self._last.layout when that frame sat in a slot, else -1
        self._hit_pstart = 0  # ... and its payload offset

    def recv(self, seq: int, into: Into) -> Layout:
        if self._error is not None:
            raise again(self._error)
        w = self._w
        if w[PUB] >= seq:
            _fence.acquire()
        else:
            self._wait_published(seq)
        slot = seq % self._n_slots
        h = self._hdr[slot]
        mv = self._mv
        layout = None
        if h[0] == seq and h[1] == self._hit_len and h[2] == 0:
            # The hot loop of broadcast_: the same dtype and shape as the last message, in a slot.
            base = self._bases[slot]
            layout = self._last.match(mv, base, base + self._hit_len)
            pbase = base + self._hit_pstart
        if layout is None:
            layout, pbase = self._frame(seq)
        entries, views = layout.entries, into(layout)
        if len(entries) == 1:  # the common case, without the loop
            e = entries[0]
            views[0][:] = mv[pbase + e.offset: pbase + e.offset + e.nbytes]
        else:
            for e, v in zip(entries, views, strict=True):
                if e.nbytes:
                    v[:] = mv[pbase + e.offset: pbase + e.offset + e.nbytes]
        _fence.release()
        w[self._ack] = seq
        return layout

    def _wait_published(self, seq: int) -> None:
        w = self._ring.w
        spin_until = time.monotonic() + self._cfg.spin_s
        while time.monotonic() < spin_until:
            if w[PUB] >= seq:
                _fence.acquire()
                return
            if w[ABORT]:
                raise self._ring.abort_error()  # type: ignore[misc]
            os.sched_yield()
        self._sleep_until(seq, self._waiter_for(seq))

    def _sleep_until(self, seq: int, waiter: Waiter) -> None:
        """Sleep on the socket until PUB >= seq: raise the flag, fence, re-check, poll (see the module docstring)."""
        ring, link = self._ring, self._link
        w, mv = ring.w, ring.mv
        me = ring.sleep_off + self._rank
        poll_s = self._cfg.wait_poll_s
        poller = select.poll()
        poller.register(link.fd, select.POLLIN)
        try:
            while True:
                mv[me] = 1
                _fence.full()
                if w[PUB] >= seq:
                    _fence.acquire()
                    return
                err = ring.abort_error()
                if err is not None:
                    raise err
                if self._error is not None:
                    raise again(self._error)
                until = waiter.check()
                if poller.poll(max(1, int(min(until, poll_s) * 1000))) and not link.drain():
                    if w[PUB] >= seq:  # published before the hang-up: deliver it, fail on the next call
                        _fence.acquire()
                        return
                    if self._error is not None:  # our own abort() (close from another thread) shut the link
                        raise again(self._error)
                    raise ring.abort_error() or PeerClosed(
                        f"rank {self._rank}: rank 0 hung up while we waited for message {seq}: it died or "
                        f"closed its broadcaster", reason=Reason.PEER_CLOSED)
        finally:
            mv[me] = 0

    def _frame(self, seq: int) -> tuple[Layout, int]:
        """Locate and validate message ``seq``; returns its layout and the absolute offset of its payload."""
        ring = self._ring
        slot = seq % ring.n_slots
        h = ring.hdr[slot]
        got, frame_len, where, aoff = h[0], h[1], h[2], h[3]
        if got != seq:
            raise FrameMismatch(f"rank {self._rank}: slot {slot} holds message {got}, expected {seq}")
        if where == 0:
            base, limit = self._bases[slot], ring.slot_bytes - SLOT_HEADER
        else:
            base, limit = ring.arena_off + aoff, ring.arena_bytes - aoff
        if frame_len > limit or frame_len < HEADER.size:
            raise FrameMismatch(f"rank {self._rank}: message {seq} claims {frame_len} bytes, room is {limit}")
        mv = ring.mv
        kind, fseq, n, table_bytes, payload_bytes, structure = decode_header(mv[base: base + HEADER.size],
                                                                             self._rank)
        if kind != KIND_DATA or fseq != seq:
            raise FrameMismatch(f"rank {self._rank}: slot carries kind {kind} seq {fseq}, expected data seq {seq}")
        tstart = base + HEADER.size
        pstart = align(HEADER.size + table_bytes, 64)
        if pstart + payload_bytes != frame_len:
            raise FrameMismatch(f"rank {self._rank}: message {seq} sizes disagree ({frame_len} vs "
                                f"{pstart} + {payload_bytes})")
        entries = decode_table(mv[tstart: tstart + table_bytes], n, payload_bytes, self._rank)
        layout = Layout(kind, seq, structure, entries, table_bytes, payload_bytes)
        self._last.remember(mv[base: tstart + table_bytes], layout)
        self._hit_len, self._hit_pstart = (frame_len, pstart) if where == 0 else (-1, 0)
        return layout, base + pstart

    def _release(self) -> None:
        self._ring.release()
