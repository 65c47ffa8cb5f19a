"""Shared-memory ring: rank 0 writes each frame once, every reader copies it out once.

Layout of the one mapping (a memfd created by rank 0, passed to peers over the bootstrap socket with SCM_RIGHTS;
it never has a name, so nothing can be opened by others, nothing is left in /dev/shm after a crash, and no
``multiprocessing.resource_tracker`` is involved; the mapping dies with the last process that maps it)::

    line 0      control, written once by rank 0: magic, version, world, n_slots, slot_bytes, arena_bytes,
                slots_off, arena_off                                                    (8 x u64)
    line 1      writer:  PUB = last published sequence | ABORT code | ABORT rank
    line 1+r    reader r (1..world-1), one 64-byte line each (no false sharing): ACK = last sequence r finished
    sleep flags one byte per rank (1 = asleep on its socket), packed so the writer checks all with one compare
    slots       n_slots x slot_bytes; slot i: 64-byte header (seq, frame_len, where, arena_off) + inline frame
    arena       arena_bytes; frames that do not fit a slot (where = 1); FIFO allocation, reset to 0 when empty

Publication protocol (sequence numbers start at 1 and only grow; message s uses slot s % n_slots):

    writer                                          reader r
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
so no wake-up is lost; the sleeping reader still re-checks every ``wait_poll_s`` as a safety net. See
``_fence`` for what the fences are on each architecture.
"""

from __future__ import annotations

import collections
import mmap
import os
import select
import time
from typing import Callable, Sequence

from tensorwire.errors import BootstrapError, FrameMismatch, PeerClosed, Reason, BroadcastError

from . import _fence
from ._frame import HEADER, KIND_DATA, S_TENSOR, Layout, decode_header, decode_table
from ._link import Link, Waiter

_MAGIC = int.from_bytes(b"TWSHRING", "little")
_VERSION = 1
_LINE_WORDS = 8
_PUB, _ABORT, _ABORT_RANK = 8, 9, 10
ABORT_PEER_DIED, ABORT_ROOT_CLOSED, ABORT_ROOT_FAILED = 1, 2, 3
_WAKE = b"\x01"


def _align(n: int, a: int) -> int:
    return (n + a - 1) // a * a


def sleep_flags_off(world: int) -> int:
    return 64 * (1 + world)


def layout_sizes(world: int, n_slots: int, slot_bytes: int, arena_bytes: int) -> tuple[int, int, int]:
    slots_off = _align(sleep_flags_off(world) + _align(world, 64), 4096)
    arena_off = _align(slots_off + n_slots * slot_bytes, 4096)
    return slots_off, arena_off, arena_off + arena_bytes


class ShmRing:
    """One side of the ring (``rank`` 0 writes, others read). Not thread-safe except ``abort()``."""

    def __init__(self, mm: mmap.mmap, rank: int, world: int, n_slots: int, slot_bytes: int, arena_bytes: int):
        self.mm = mm
        self.rank = rank
        self.world = world
        self.n_slots = n_slots
        self.slot_bytes = slot_bytes
        self.arena_bytes = arena_bytes
        self.slots_off, self.arena_off, self.size = layout_sizes(world, n_slots, slot_bytes, arena_bytes)
        self.mv = memoryview(mm)
        self.w = self.mv[: self.slots_off].cast("Q")
        self.hdr = [self.mv[self.slots_off + i * slot_bytes: self.slots_off + i * slot_bytes + 64].cast("Q")
                    for i in range(n_slots)]
        self.ack_idx = [_LINE_WORDS * (1 + r) for r in range(world)]  # index 0 unused (rank 0 does not ack)
        self.sleep_off = sleep_flags_off(world)  # one byte per rank; the writer tests them all with one compare
        self._awake = bytes(world)
        self._arena_live: collections.deque[tuple[int, int, int]] = collections.deque()  # (seq, start, end)
        self._known_ack = 0  # a lower bound of min(ACK): acks only grow, so re-read only when it is too low
        self._rcache: tuple[int, int, bytes, bytes, Layout, int, int] | None = None
        self.hit = False  # did the last frame() reuse the cached layout?

    # -- construction ------------------------------------------------------------------------------------------
    @classmethod
    def create(cls, world: int, n_slots: int, slot_bytes: int, arena_bytes: int) -> tuple[ShmRing, int]:
        _, _, size = layout_sizes(world, n_slots, slot_bytes, arena_bytes)
        fd = -1
        try:
            fd = os.memfd_create("tensorwire-tp-ring", os.MFD_CLOEXEC)
            os.ftruncate(fd, size)
            mm = mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        except (OSError, AttributeError) as exc:
            if fd >= 0:
                os.close(fd)
            raise BootstrapError(f"rank 0: cannot create the shared-memory ring ({size} bytes): {exc}",
                                 reason=Reason.BOOTSTRAP_FAILED) from exc
        ring = cls(mm, 0, world, n_slots, slot_bytes, arena_bytes)
        w = ring.w
        for i, v in enumerate((_MAGIC, _VERSION, world, n_slots, slot_bytes, arena_bytes, ring.slots_off,
                               ring.arena_off)):
            w[i] = v
        return ring, fd

    @classmethod
    def attach(cls, fd: int, size: int, rank: int, world: int, n_slots: int, slot_bytes: int,
               arena_bytes: int) -> ShmRing:
        _, _, want = layout_sizes(world, n_slots, slot_bytes, arena_bytes)
        try:
            if size != want or os.fstat(fd).st_size != want:
                raise BootstrapError(f"rank {rank}: shared-memory ring is {size} bytes, expected {want}",
                                     reason=Reason.PARAMS_MISMATCH)
            mm = mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        finally:
            os.close(fd)  # the mapping keeps the memory alive
        ring = cls(mm, rank, world, n_slots, slot_bytes, arena_bytes)
        got = tuple(ring.w[i] for i in range(8))
        if got != (_MAGIC, _VERSION, world, n_slots, slot_bytes, arena_bytes, ring.slots_off, ring.arena_off):
            ring.close()
            raise BootstrapError(f"rank {rank}: shared-memory ring header {got} does not match our parameters",
                                 reason=Reason.PARAMS_MISMATCH)
        return ring

    def close(self) -> None:
        views = [*self.hdr, self.w, self.mv]
        self.hdr = []
        for v in views:
            v.release()
        try:
            self.mm.close()
        except (BufferError, ValueError):
            pass  # a view is still referenced somewhere; the mapping goes when it is collected

    # -- abort word ----------------------------------------------------------------------------------------------
    def abort(self, code: int, rank: int) -> None:
        if self.w.obj is None:  # released
            return
        self.w[_ABORT_RANK] = rank
        _fence.release()
        self.w[_ABORT] = code

    def abort_error(self) -> PeerClosed | None:
        code = self.w[_ABORT]
        if not code:
            return None
        _fence.acquire()
        who = self.w[_ABORT_RANK]
        if code == ABORT_PEER_DIED:
            msg = f"rank {self.rank}: rank 0 aborted the group because rank {who} died or closed its broadcaster"
        elif code == ABORT_ROOT_CLOSED:
            msg = f"rank {self.rank}: rank 0 closed its broadcaster"
        else:
            msg = f"rank {self.rank}: rank 0 aborted the group after a failure"
        return PeerClosed(msg, reason=Reason.PEER_CLOSED)

    # -- writer --------------------------------------------------------------------------------------------------
    def min_ack(self) -> tuple[int, int]:
        w = self.w
        best, who = -1, 0
        for r in range(1, self.world):
            a = w[self.ack_idx[r]]
            if best < 0 or a < best:
                best, who = a, r
        return best, who

    def _wait_acks(self, need: int, make_waiter: Callable[[], Waiter], spin_s: float,
                   check_alive: Callable[[], None]) -> None:
        spin_until = time.monotonic() + spin_s
        sleep = 50e-6
        waiter: Waiter | None = None
        while True:
            got, who = self.min_ack()
            if got >= need:
                _fence.acquire()
                self._known_ack = max(self._known_ack, got)
                return
            now = time.monotonic()
            if now < spin_until:
                os.sched_yield()
                continue
            if waiter is None:
                waiter = make_waiter()
            waiter.retarget(f"broadcast (rank 0 waiting for rank {who} to consume message {need})")
            waiter.check(now)
            check_alive()
            time.sleep(sleep)
            sleep = min(sleep * 2, 1e-3)

    def _arena_alloc(self, seq: int, n: int, make_waiter: Callable[[], Waiter], spin_s: float,
                     check_alive: Callable[[], None]) -> int:
        if n > self.arena_bytes:
            raise BroadcastError(f"rank 0: frame of {n} bytes exceeds the shared-memory arena ({self.arena_bytes} "
                                 f"bytes); raise BroadcastConfig.arena_bytes", reason=Reason.SLOT_TOO_LARGE)
        live = self._arena_live
        while True:
            done, _ = self.min_ack()
            while live and live[0][0] <= done:
                live.popleft()
            if not live:
                start: int | None = 0
            else:
                first, last_end = live[0][1], live[-1][2]
                wrapped = live[-1][1] < first
                if not wrapped:
                    start = last_end if last_end + n <= self.arena_bytes else (0 if n <= first else None)
                else:
                    start = last_end if last_end + n <= first else None
            if start is not None:
                live.append((seq, start, _align(start + n, 64)))
                return start
            self._wait_acks(live[0][0], make_waiter, spin_s, check_alive)

    def publish(self, seq: int, prefix: bytes | bytearray, views: Sequence[memoryview], offsets: Sequence[int],
                payload_bytes: int, links: Sequence[Link | None], make_waiter: Callable[[], Waiter], spin_s: float,
                check_alive: Callable[[], None]) -> None:
        need = seq - self.n_slots
        if need > self._known_ack:
            self._known_ack = self.min_ack()[0]
            if self._known_ack < need:
                self._wait_acks(need, make_waiter, spin_s, check_alive)
            else:
                _fence.acquire()
        pstart = _align(len(prefix), 64)
        frame_len = pstart + payload_bytes
        slot = seq % self.n_slots
        if frame_len <= self.slot_bytes - 64:
            base, where, aoff = self.slots_off + slot * self.slot_bytes + 64, 0, 0
        else:
            aoff = self._arena_alloc(seq, frame_len, make_waiter, spin_s, check_alive)
            base, where = self.arena_off + aoff, 1
        mv = self.mv
        mv[base: base + len(prefix)] = prefix
        pbase = base + pstart
        for src, off in zip(views, offsets):
            n = len(src)
            if n:
                mv[pbase + off: pbase + off + n] = src
        h = self.hdr[slot]
        h[0], h[1], h[2], h[3] = seq, frame_len, where, aoff
        self._publish_tail(seq, links)

    def publish_small(self, seq: int, prefix: bytes | bytearray, view: memoryview,
                      links: Sequence[Link | None]) -> bool:
        """Fast path of ``publish`` for one tensor that fits a slot whose readers are known to be done.
        Returns False (nothing written) when the general path is needed."""
        if seq - self.n_slots > self._known_ack:
            return False
        plen = len(prefix)
        pstart = (plen + 63) & ~63
        n = len(view)
        if pstart + n > self.slot_bytes - 64:
            return False
        slot = seq % self.n_slots
        base = self.slots_off + slot * self.slot_bytes + 64
        mv = self.mv
        mv[base: base + plen] = prefix
        if n:
            mv[base + pstart: base + pstart + n] = view
        h = self.hdr[slot]
        h[0], h[1], h[2], h[3] = seq, pstart + n, 0, 0
        self._publish_tail(seq, links)
        return True

    def _publish_tail(self, seq: int, links: Sequence[Link | None]) -> None:
        _fence.release()
        self.w[_PUB] = seq
        _fence.full()
        flags = self.mv[self.sleep_off: self.sleep_off + self.world]
        if flags != self._awake:
            for r, f in enumerate(bytes(flags)):
                lk = links[r]
                if f and lk is not None:
                    lk.send_nowait(_WAKE)  # a full buffer already holds wake bytes; a dead peer shows elsewhere

    # -- reader --------------------------------------------------------------------------------------------------
    def wait_published(self, seq: int, link: Link, make_waiter: Callable[[], Waiter], spin_s: float,
                       poll_s: float) -> None:
        w = self.w
        if w[_PUB] >= seq:
            _fence.acquire()
            return
        spin_until = time.monotonic() + spin_s
        while time.monotonic() < spin_until:
            if w[_PUB] >= seq:
                _fence.acquire()
                return
            if w[_ABORT]:
                raise self.abort_error()  # type: ignore[misc]
            os.sched_yield()
        waiter = make_waiter()
        me = self.sleep_off + self.rank
        mv = self.mv
        poller = select.poll()
        poller.register(link.fd, select.POLLIN)
        try:
            while True:
                mv[me] = 1
                _fence.full()
                if w[_PUB] >= seq:
                    _fence.acquire()
                    return
                err = self.abort_error()
                if err is not None:
                    raise err
                until = waiter.check()
                if poller.poll(max(1, int(min(until, poll_s) * 1000))):
                    if not link.drain():
                        if w[_PUB] >= seq:  # published before the hang-up: deliver it, fail on the next call
                            _fence.acquire()
                            return
                        raise self.abort_error() or PeerClosed(
                            f"rank {self.rank}: rank 0 hung up while we waited for message {seq}: it died or "
                            f"closed its broadcaster", reason=Reason.PEER_CLOSED)
        finally:
            mv[me] = 0

    def frame(self, seq: int) -> tuple[Layout, int]:
        """Decode message ``seq`` in place; returns its layout and the absolute offset of its payload."""
        slot = seq % self.n_slots
        h = self.hdr[slot]
        got, frame_len, where, aoff = h[0], h[1], h[2], h[3]
        if got != seq:
            raise FrameMismatch(f"rank {self.rank}: slot {slot} holds message {got}, expected {seq}")
        if where == 0:
            base, limit = self.slots_off + slot * self.slot_bytes + 64, self.slot_bytes - 64
        else:
            base, limit = self.arena_off + aoff, self.arena_bytes - aoff
        if frame_len > limit or frame_len < HEADER.size:
            raise FrameMismatch(f"rank {self.rank}: message {seq} claims {frame_len} bytes, room is {limit}")
        mv = self.mv
        c = self._rcache
        if c is not None and c[0] == frame_len and bytes(mv[base + 16: base + c[1]]) == c[2] \
                and bytes(mv[base: base + 8]) == c[3]:
            # Same header (but the sequence number) and table as the last message: the hot loop of broadcast_.
            self.hit = True
            return c[4], base + c[5]
        self.hit = False
        kind, fseq, n, table_bytes, payload_bytes, structure = decode_header(mv[base: base + HEADER.size],
                                                                             self.rank)
        if kind != KIND_DATA or fseq != seq:
            raise FrameMismatch(f"rank {self.rank}: slot carries kind {kind} seq {fseq}, expected data seq {seq}")
        tstart = base + HEADER.size
        pstart = _align(HEADER.size + table_bytes, 64)
        if pstart + payload_bytes != frame_len:
            raise FrameMismatch(f"rank {self.rank}: message {seq} sizes disagree ({frame_len} vs "
                                f"{pstart} + {payload_bytes})")
        entries = decode_table(mv[tstart: tstart + table_bytes], n, payload_bytes, self.rank)
        layout = Layout(kind, seq, structure, entries, table_bytes, payload_bytes)
        end = tstart + table_bytes
        single = structure == S_TENSOR and len(entries) == 1 and entries[0].offset == 0 and where == 0
        self._rcache = (frame_len, end - base, bytes(mv[base + 16: end]), bytes(mv[base: base + 8]), layout, pstart,
                        payload_bytes if single else -1)
        return layout, base + pstart

    def read_cached(self, seq: int, dst: memoryview) -> bool:
        """Fast path of broadcast_: message ``seq`` (already published) has the cached single-tensor layout of
        ``len(dst)`` bytes in a slot; copy it into ``dst`` and ack. False (nothing read) otherwise."""
        c = self._rcache
        if c is None or c[6] != len(dst):
            return False
        slot = seq % self.n_slots
        h = self.hdr[slot]
        if h[0] != seq or h[1] != c[0] or h[2] != 0:
            return False
        base = self.slots_off + slot * self.slot_bytes + 64
        mv = self.mv
        if bytes(mv[base + 16: base + c[1]]) != c[2] or bytes(mv[base: base + 8]) != c[3]:
            return False
        p = base + c[5]
        dst[:] = mv[p: p + len(dst)]
        _fence.release()
        self.w[self.ack_idx[self.rank]] = seq
        return True

    def ack(self, seq: int) -> None:
        _fence.release()
        self.w[self.ack_idx[self.rank]] = seq
