"""The shared-memory ring's mapping: its layout, creation by rank 0, attachment by readers, the abort word.

One mapping, a memfd created by rank 0 and passed to peers over the bootstrap socket with SCM_RIGHTS. It never has
a name, so nothing can be opened by others, nothing is left in /dev/shm after a crash, and no
``multiprocessing.resource_tracker`` is involved; the mapping dies with the last process that maps it::

    line 0      control, written once by rank 0: magic, version, world, n_slots, slot_bytes, arena_bytes,
                slots_off, arena_off                                                    (8 x u64)
    line 1      writer:  PUB = last published sequence | ABORT code | ABORT rank
    line 1+r    reader r (1..world-1), one 64-byte line each (no false sharing): ACK = last sequence r finished
    sleep flags one byte per rank (1 = asleep on its socket), packed so the writer checks all with one compare
    slots       n_slots x slot_bytes; slot i: 64-byte header (seq, frame_len, where, arena_off) + inline frame
    arena       arena_bytes; frames that do not fit a slot (where = 1); FIFO allocation, reset to 0 when empty

The publication protocol on top of it (who writes which word when, and the fences) is in ``_shm``.
"""

from __future__ import annotations

import mmap
import os

from tensorwire.errors import BootstrapError, PeerClosed, Reason

from . import _fence

_MAGIC = int.from_bytes(b"TWSHRING", "little")
_VERSION = 1
_LINE_WORDS = 8
PUB, ABORT, ABORT_RANK = 8, 9, 10  # word indices in line 1
ABORT_PEER_DIED, ABORT_ROOT_CLOSED, ABORT_ROOT_FAILED = 1, 2, 3  # values of the ABORT word
SLOT_HEADER = 64


def align(n: int, a: int) -> int:
    return (n + a - 1) // a * a


def _sleep_flags_off(world: int) -> int:
    return 64 * (1 + world)


def layout_sizes(world: int, n_slots: int, slot_bytes: int, arena_bytes: int) -> tuple[int, int, int]:
    """(slots_off, arena_off, total size) of a ring with these parameters."""
    slots_off = align(_sleep_flags_off(world) + align(world, 64), 4096)
    arena_off = align(slots_off + n_slots * slot_bytes, 4096)
    return slots_off, arena_off, arena_off + arena_bytes


class Ring:
    """One process's mapping of the ring, with typed views of its words.

    ``w`` is the control lines as u64 words (``w[PUB]``, ``w[ack_idx[r]]``), ``hdr[i]`` slot i's header as u64
    words, ``mv`` the whole mapping as bytes. Not thread-safe; the transport that owns it serialises access and
    calls ``release()`` once nothing uses the views any more.
    """

    def __init__(self, mm: mmap.mmap, rank: int, world: int, n_slots: int, slot_bytes: int, arena_bytes: int):
        self.mm, self.rank, self.world = mm, rank, world
        self.n_slots, self.slot_bytes, self.arena_bytes = n_slots, slot_bytes, arena_bytes
        self.slots_off, self.arena_off, self.size = layout_sizes(world, n_slots, slot_bytes, arena_bytes)
        self.mv = memoryview(mm)
        self.w = self.mv[: self.slots_off].cast("Q")
        self.hdr = [self.mv[self.slot_base(i) - SLOT_HEADER : self.slot_base(i)].cast("Q") for i in range(n_slots)]
        self.ack_idx = [_LINE_WORDS * (1 + r) for r in range(world)]  # index 0 unused (rank 0 does not ack)
        self.sleep_off = _sleep_flags_off(world)  # one byte per rank
        # The same bytes as u64 words, so the writer tests eight flags with one load (the area is 64-byte aligned
        # and padded to 64 bytes).
        self.sleep_words = self.mv[self.sleep_off : self.sleep_off + align(world, 8)].cast("Q")
        self.released = False

    def slot_base(self, slot: int) -> int:
        """Offset of slot ``slot``'s inline frame (just after its header)."""
        return self.slots_off + slot * self.slot_bytes + SLOT_HEADER

    @classmethod
    def create(cls, world: int, n_slots: int, slot_bytes: int, arena_bytes: int) -> tuple[Ring, int]:
        """Rank 0: a fresh ring and its memfd (the caller passes the fd to the peers, then closes it)."""
        _, _, size = layout_sizes(world, n_slots, slot_bytes, arena_bytes)
        fd = -1
        try:
            fd = os.memfd_create("tensorwire-tp-ring", os.MFD_CLOEXEC)
            os.ftruncate(fd, size)
            mm = mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        except (OSError, AttributeError) as exc:
            if fd >= 0:
                os.close(fd)
            raise BootstrapError(
                f"rank 0: cannot create the shared-memory ring ({size} bytes): {exc}", reason=Reason.BOOTSTRAP_FAILED
            ) from exc
        ring = cls(mm, 0, world, n_slots, slot_bytes, arena_bytes)
        for i, v in enumerate(ring._control()):
            ring.w[i] = v
        return ring, fd

    @classmethod
    def attach(cls, fd: int, size: int, rank: int, world: int, n_slots: int, slot_bytes: int, arena_bytes: int) -> Ring:
        """A reader: map the fd rank 0 sent (and close it) after checking its size and control line."""
        _, _, want = layout_sizes(world, n_slots, slot_bytes, arena_bytes)
        try:
            if size != want or os.fstat(fd).st_size != want:
                raise BootstrapError(
                    f"rank {rank}: shared-memory ring is {size} bytes, expected {want}", reason=Reason.PARAMS_MISMATCH
                )
            mm = mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        finally:
            os.close(fd)  # the mapping keeps the memory alive
        ring = cls(mm, rank, world, n_slots, slot_bytes, arena_bytes)
        got = tuple(ring.w[i] for i in range(8))
        if got != ring._control():
            ring.release()
            raise BootstrapError(
                f"rank {rank}: shared-memory ring header {got} does not match our parameters",
                reason=Reason.PARAMS_MISMATCH,
            )
        return ring

    def _control(self) -> tuple[int, ...]:
        return (
            _MAGIC,
            _VERSION,
            self.world,
            self.n_slots,
            self.slot_bytes,
            self.arena_bytes,
            self.slots_off,
            self.arena_off,
        )

    def release(self) -> None:
        """Drop every view and unmap. Idempotent."""
        if self.released:
            return
        self.released = True
        views = [*self.hdr, self.sleep_words, self.w, self.mv]
        self.hdr = []
        for v in views:
            v.release()
        try:
            self.mm.close()
        except (BufferError, ValueError):
            pass  # a view is still referenced somewhere; the mapping goes when it is collected

    # -- abort word ----------------------------------------------------------------------------------------------
    def set_abort(self, code: int, rank: int) -> None:
        """Rank 0: tell every reader that the group is over (``code`` says why, ``rank`` names the dead rank)."""
        self.w[ABORT_RANK] = rank
        _fence.release()
        self.w[ABORT] = code

    def abort_error(self) -> PeerClosed | None:
        """A reader: the error the abort word asks us to raise, or None while it is clear."""
        code = self.w[ABORT]
        if not code:
            return None
        _fence.acquire()
        who = self.w[ABORT_RANK]
        if code == ABORT_PEER_DIED:
            msg = f"rank {self.rank}: rank 0 aborted the group because rank {who} died or closed its broadcaster"
        elif code == ABORT_ROOT_CLOSED:
            msg = f"rank {self.rank}: rank 0 closed its broadcaster"
        else:
            msg = f"rank {self.rank}: rank 0 aborted the group after a failure"
        return PeerClosed(msg, reason=Reason.PEER_CLOSED)
