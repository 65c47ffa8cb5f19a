"""Shared-memory transport: rank 0 writes each frame once into the ring (``_ring``), every reader copies it out once.

Publication protocol (sequence numbers start at 1 and only grow; message s uses slot s % n_slots)::

    writer (ShmRoot.send)                           reader r (ShmReader.recv)
    wait until min(ACK) >= s - n_slots (slot free)  spin: until PUB >= s (sched_yield between polls), for the
    wait for arena room (frames freed by ACKs)            adaptive window (``_spin.SpinWindow``)
    copy frame; write slot header                   then sleep: SLEEP_r = 2 (futex) or 1 (socket); full fence;
    release fence                                         p = PUB; if p >= s: done; else
    PUB = s                                               futex_wait(&PUB low 32 bits, p) or poll(socket)
    full fence                                      acquire fence
    if some SLEEP_r == 2: futex_wake(&PUB, all)     check slot.seq == s; copy payload out
    for r with SLEEP_r == 1: send 1 byte to r       release fence; ACK_r = s

The release/acquire pair orders the payload before PUB (writer) and PUB before the payload loads (reader); the
reader's release before ACK keeps its loads of the slot before the writer may overwrite it.

No lost wake-up. The full fences make the sleep hand-off a Dekker pair: either the writer's load of SLEEP_r sees
the flag (and it wakes r), or r's load of PUB sees s (and r does not sleep). In the futex case, r passes the PUB
value p it saw to FUTEX_WAIT, which the kernel compares and queues atomically with respect to FUTEX_WAKE on the
same word: if the writer stored s before that compare, the wait returns at once; if after, r is queued before the
writer's wake, which the flag guarantees comes. The futex word is PUB's low half, so the comparison is exact short
of 2**32 messages between r's load and its syscall. Socket sleepers are woken by a byte, as before (the fallback
without a futex, ``BroadcastConfig.futex=False``). Every sleep is bounded by ``wait_poll_s`` (0.1 s), after which
the reader re-checks PUB, the abort word, its own abort (close from another thread also FUTEX_WAKEs the word) and
whether rank 0 hung up its socket (a futex sleeper learns of rank 0's death there, within ``wait_poll_s``). See
``_fence`` for what the fences are on each architecture.

The wake-up mechanism is confined to ``ShmRoot._wake`` and ``ShmReader._sleep_until``.
"""

from __future__ import annotations

import collections
import os
import select
import time
from collections.abc import Sequence

from tensorwire.errors import BroadcastError, BroadcastTimeout, FrameMismatch, PeerClosed, Reason, TensorwireError

from . import _fence, _futex
from ._config import BroadcastConfig
from ._frame import HEADER, KIND_DATA, LastFrame, Layout, decode_header, decode_table
from ._link import Link, Waiter
from ._paths import Rendezvous
from ._ring import ABORT, ABORT_PEER_DIED, ABORT_ROOT_CLOSED, PUB, SLOT_HEADER, Ring, align
from ._spin import PREEMPTED_S, SpinWindow
from ._transport import Into, ReaderSide, RootSide, Use, again

_WAKE = b"\x01"
ASLEEP_SOCKET, ASLEEP_FUTEX = 1, 2  # values of a reader's sleep flag


class ShmRoot(RootSide):
    """Rank 0's end of the ring. See the module docstring for the protocol and ``Transport`` for the contract."""

    align = 64

    def __init__(
        self, ring: Ring, links: list[Link | None], endpoint: Rendezvous, config: BroadcastConfig, session: str
    ) -> None:
        self._ring = ring
        # Hot-path copies of the ring's views and sizes (valid until close(), which runs after the last send).
        self._mv, self._w, self._hdr, self._n_slots = ring.mv, ring.w, ring.hdr, ring.n_slots
        self._bases = [ring.slot_base(i) for i in range(ring.n_slots)]
        self._inline_room = ring.slot_bytes - SLOT_HEADER
        self._sleep_word_idx = range(len(ring.sleep_words))
        self._arena_live: collections.deque[tuple[int, int, int]] = collections.deque()  # (seq, start, end)
        self._known_ack = 0  # a lower bound of min(ACK): acks only grow, so re-read only when it is too low
        self._pub_addr = _futex.address_of(ring.mm, PUB * 8) if _futex.AVAILABLE else 0
        super().__init__(links, endpoint, config, session)

    def send(
        self,
        seq: int,
        prefix: bytes | bytearray,
        views: Sequence[memoryview],
        offsets: Sequence[int],
        payload_bytes: int,
    ) -> None:
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
        mv[base : base + plen] = prefix
        pbase = base + pstart
        for src, off in zip(views, offsets, strict=True):
            n = len(src)
            if n:
                mv[pbase + off : pbase + off + n] = src
        h = self._hdr[slot]
        h[0], h[1], h[2], h[3] = seq, frame_len, where, aoff
        _fence.release()
        self._w[PUB] = seq
        _fence.full()
        self._wake()

    def _wake(self) -> None:
        """Wake every reader whose sleep flag is set (none while readers keep up): one FUTEX_WAKE for all futex
        sleepers, one byte to each socket sleeper."""
        words = self._ring.sleep_words
        for i in self._sleep_word_idx:
            if words[i]:
                break
        else:
            return
        ring = self._ring
        flags = bytes(ring.mv[ring.sleep_off : ring.sleep_off + ring.world])
        if self._pub_addr and ASLEEP_FUTEX in flags:
            _futex.wake(self._pub_addr)
        if ASLEEP_SOCKET in flags:
            for r, f in enumerate(flags):
                lk = self._links[r]
                if f == ASLEEP_SOCKET and lk is not None:
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
            raise BroadcastError(
                f"rank 0: frame of {n} bytes exceeds the shared-memory arena ({arena_bytes} "
                f"bytes); raise BroadcastConfig.arena_bytes",
                reason=Reason.SLOT_TOO_LARGE,
            )
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
        if self._pub_addr:
            _fence.full()
            _futex.wake(self._pub_addr)  # futex sleepers see the abort word now, not after wait_poll_s

    def _release(self) -> None:
        self._ring.release()


class ShmReader(ReaderSide):
    """A reader's end of the ring. See the module docstring for the protocol and ``Transport`` for the contract."""

    align = 64

    def __init__(self, ring: Ring, link: Link, rank: int, endpoint: Rendezvous, config: BroadcastConfig) -> None:
        super().__init__(link, rank, endpoint, config)
        self._ring = ring
        # Hot-path copies of the ring's views and sizes (valid until close(), which runs after the last recv).
        self._mv, self._w, self._hdr, self._n_slots = ring.mv, ring.w, ring.hdr, ring.n_slots
        self._bases = [ring.slot_base(i) for i in range(ring.n_slots)]
        self._ack = ring.ack_idx[rank]
        self._last = LastFrame()
        self._hit_len = -1  # frame_len of self._last.layout when that frame sat in a slot, else -1
        self._hit_pstart = 0  # ... and its payload offset
        self._window = SpinWindow(config.spin_s, config.spin_max_s, config.spin_gap_factor, ring.world)
        self._futex_addr = _futex.address_of(ring.mm, PUB * 8) if config.futex and _futex.AVAILABLE else 0

    def recv(self, seq: int, into: Into) -> Layout:
        if self._error is not None:
            raise again(self._error)
        w = self._w
        if w[PUB] >= seq:
            _fence.acquire()
            self._window.record(0.0)
        else:
            self._wait_published(seq)
        layout, pbase = self._locate(seq)
        mv = self._mv
        entries, views = layout.entries, into(layout)
        if len(entries) == 1:  # the common case, without the loop
            e = entries[0]
            views[0][:] = mv[pbase + e.offset : pbase + e.offset + e.nbytes]
        else:
            for e, v in zip(entries, views, strict=True):
                if e.nbytes:
                    v[:] = mv[pbase + e.offset : pbase + e.offset + e.nbytes]
        _fence.release()
        w[self._ack] = seq
        return layout

    def _locate(self, seq: int) -> tuple[Layout, int]:
        """Message ``seq``'s layout and the absolute offset of its payload (published: PUB >= seq)."""
        slot = seq % self._n_slots
        h = self._hdr[slot]
        if h[0] == seq and h[1] == self._hit_len and h[2] == 0:
            # The hot loop: the same header and table (but the sequence number) as the last message, in a slot.
            base = self._bases[slot]
            layout = self._last.match(self._mv, base, base + self._hit_len)
            if layout is not None:
                return layout, base + self._hit_pstart
        return self._frame(seq)

    def recv_view(self, seq: int, use: Use) -> object:
        """Zero-copy: ``use`` reads the payload straight from the ring; the slot is acked after it returns."""
        if self._error is not None:
            raise again(self._error)
        if self._w[PUB] >= seq:
            _fence.acquire()
            self._window.record(0.0)
        else:
            self._wait_published(seq)
        layout, pbase = self._locate(seq)
        view = self._mv[pbase : pbase + layout.payload_bytes].toreadonly()
        try:
            return use(layout, view)
        finally:
            try:
                view.release()
            except BufferError:
                pass  # ``use`` kept an export against the contract; the mapping then outlives close()
            _fence.release()
            self._w[self._ack] = seq

    def _wait_published(self, seq: int) -> None:
        """Spin for the adaptive window (``_spin``), then sleep; records how long the message took to come."""
        w = self._w
        t0 = last = time.monotonic()
        spin_until = t0 + self._window.budget()
        while True:
            if w[PUB] >= seq:
                _fence.acquire()
                self._window.record(time.monotonic() - t0)
                return
            now = time.monotonic()
            if now >= spin_until:
                break
            if now - last > PREEMPTED_S:  # another task had our CPU: sleeping serves us (and rank 0) better
                self._window.preempted()
                break
            last = now
            if self._error is not None:  # close() from another thread while we spin
                raise again(self._error)
            if w[ABORT]:
                raise self._ring.abort_error()  # type: ignore[misc]
            os.sched_yield()
        self._sleep_until(seq, self._waiter_for(seq))
        self._window.record(time.monotonic() - t0)

    def abort(self, error: TensorwireError) -> None:
        super().abort(error)
        if self._futex_addr:
            _futex.wake(self._futex_addr)  # a futex sleeper is not woken by the link's shutdown

    def _sleep_until(self, seq: int, waiter: Waiter) -> None:
        """Sleep until PUB >= seq: raise the flag, fence, re-check, then FUTEX_WAIT on PUB or poll the socket (see
        the module docstring)."""
        ring, link = self._ring, self._link
        w, mv = ring.w, ring.mv
        me = ring.sleep_off + self._rank
        poll_s = self._cfg.wait_poll_s
        addr = self._futex_addr
        flag = ASLEEP_FUTEX if addr else ASLEEP_SOCKET
        poller = select.poll()
        poller.register(link.fd, select.POLLIN)
        try:
            while True:
                mv[me] = flag
                _fence.full()
                pub = w[PUB]
                if pub >= seq:
                    _fence.acquire()
                    return
                if self._error is not None:  # our own abort first: rank 0's echo of it must not win
                    raise again(self._error)
                err = ring.abort_error()
                if err is not None:
                    raise err
                try:
                    until = waiter.check()
                except BroadcastTimeout as exc:
                    raise self._explained(exc) from None
                if addr:
                    _futex.wait(addr, pub, min(until, poll_s))
                    if w[PUB] >= seq or self._error is not None or w[ABORT]:
                        continue  # the loop's checks deliver it or raise
                    ready = poller.poll(0)  # woken for nothing, or timed out: did rank 0 hang up?
                else:
                    ready = poller.poll(max(1, int(min(until, poll_s) * 1000)))
                if ready and not link.drain():
                    if w[PUB] >= seq:  # published before the hang-up: deliver it, fail on the next call
                        _fence.acquire()
                        return
                    if self._error is not None:  # our own abort() (close from another thread) shut the link
                        raise again(self._error)
                    raise ring.abort_error() or PeerClosed(
                        f"rank {self._rank}: rank 0 hung up while we waited for message {seq}: it died or "
                        f"closed its broadcaster",
                        reason=Reason.PEER_CLOSED,
                    )
        finally:
            mv[me] = 0

    def _explained(self, exc: BroadcastTimeout) -> BroadcastTimeout:
        """``exc`` naming the reader rank 0 is most likely blocked on: the ring shows every reader's progress, and
        one that has not consumed everything published keeps rank 0 from publishing more once the ring is full.
        Our timeout and rank 0's (on that reader) run out at about the same time; whichever fires first, the
        group's errors then name the slow rank."""
        ring, w = self._ring, self._w
        pub = w[PUB]
        behind = [(w[ring.ack_idx[r]], r) for r in range(1, ring.world) if r != self._rank and w[ring.ack_idx[r]] < pub]
        if not behind:
            return exc
        acked, who = min(behind)
        return BroadcastTimeout(
            f"{exc}; rank 0 has published up to message {pub} but rank {who} has consumed only "
            f"up to {acked}: rank 0 is probably waiting for rank {who}",
            reason=exc.reason,
        )

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
        kind, fseq, n, table_bytes, payload_bytes, structure = decode_header(mv[base : base + HEADER.size], self._rank)
        if kind != KIND_DATA or fseq != seq:
            raise FrameMismatch(f"rank {self._rank}: slot carries kind {kind} seq {fseq}, expected data seq {seq}")
        tstart = base + HEADER.size
        pstart = align(HEADER.size + table_bytes, 64)
        if pstart + payload_bytes != frame_len:
            raise FrameMismatch(
                f"rank {self._rank}: message {seq} sizes disagree ({frame_len} vs {pstart} + {payload_bytes})"
            )
        entries = decode_table(mv[tstart : tstart + table_bytes], n, payload_bytes, self._rank)
        layout = Layout(kind, seq, structure, entries, table_bytes, payload_bytes)
        self._last.remember(mv[base : tstart + table_bytes], layout)
        self._hit_len, self._hit_pstart = (frame_len, pstart) if where == 0 else (-1, 0)
        return layout, base + pstart

    def _release(self) -> None:
        self._ring.release()
