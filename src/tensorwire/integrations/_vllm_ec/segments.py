"""One READ per item and host: the LLM instance's scheduler process reads an item into a shared-memory segment
that every local tensor-parallel rank maps.

Scheduler side (:class:`SegmentStager`, a ``fetch.Stager`` for the whole host): ``stage`` takes an anonymous
``memfd`` (``tw-ec-<pid>-<n>-<random>``, sized for the item, its pages allocated up front), reads the item into it with
this process's ``TensorReader`` (an encoder instance on this host: one ``process_vm_readv``, see
``tensorwire.rdma._local``; else a READ, the mapping registered for it) and keeps the descriptor open until
``drop``. Allocating a segment's pages costs about 0.4 ms per MB, so segments of the sizes recently staged are
made ahead (:class:`SegmentSpares`, also used by the uniproc rank's ``fetch.LocalStager``) on a background thread
that allocates them without holding the GIL, ``REFILL_DELAY_S`` after the READ that took one (at most
``SPARES_PER_SIZE`` per size and ``SPARE_BYTES`` in all); a segment is still used once. Nothing is named in a
file system: the segment cannot be opened by another user, and it is freed when the scheduler has dropped it and
the last rank's mapping is gone (a crashed engine leaves nothing behind).

Worker side (:func:`map_segment`): the step's metadata carries a :class:`SegmentRef` (the scheduler's pid, the
descriptor number, the memfd's name, size and the first tensor's layout); the rank opens
``/proc/<pid>/fd/<fd>``, checks that the link names this item's memfd (a reused descriptor number would name
another), maps it shared and returns the tensor as a view of the mapping, without a copy. The mapping lives as
long as the tensor (vLLM's encoder cache holds it); dropping the item on the scheduler side never changes bytes
a rank still maps (a segment is never reused).

Same host, no read (``map_host``): an encoder instance's store may keep each item in such a segment of its own
too (``HeldStore(segments=...)``), named in the receipt; :func:`open_host_segment` opens it from the owner process
when the owner is on this host, and the stager hands that over instead of reading (the ranks map it through the
scheduler's descriptor as they map a segment of ours; the uniproc rank's ``fetch.LocalStager`` maps it itself).

Why a memfd reached through ``/proc`` rather than a file in ``/dev/shm``: a named file outlives a killed engine;
the descriptor dies with the process. Opening ``/proc/<pid>/fd/<n>`` needs the same uid (and a dumpable process),
which the ranks of one vLLM instance have.
"""

from __future__ import annotations

import ctypes
import errno
import itertools
import logging
import mmap
import os
import secrets
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import torch

from tensorwire.errors import ProtocolError, ReadError, Reason, TensorwireError
from tensorwire.mm._proto import encoder_pb2 as pb
from tensorwire.mm.held._staging import Expect, ReaderFactory, StagingArea
from tensorwire.rdma import Descriptor
from tensorwire.rdma._descriptor import MAX_DIMS as _MAX_DIMS
from tensorwire.rdma._descriptor import TensorMeta, views
from tensorwire.rdma._local import host_id

log = logging.getLogger(__name__)

_PREFIX = "tw-ec-"
SPARES_PER_SIZE = 2
SPARE_BYTES = 512 * 1024**2
# Making a spare right after a READ took one ran beside the rest of that hand-off (the scheduler's next step, the
# worker's load) and, on a host with few free cores, slowed it by as long as the allocation took.
# A fixed delay rather than "once no READ for a while": under a steady stream of items that moment never comes,
# and every READ would allocate its segment on the scheduler's thread.
REFILL_DELAY_S = 0.1
_names = itertools.count(1)
_DTYPES = {
    str(d).removeprefix("torch."): d
    for d in (
        torch.float32,
        torch.float16,
        torch.bfloat16,
        torch.float64,
        torch.int64,
        torch.int32,
        torch.int16,
        torch.int8,
        torch.uint8,
        torch.bool,
    )
}


@dataclass(frozen=True)
class SegmentRef:
    """Where a rank finds an item's first tensor (plain values: it travels in vLLM's step metadata)."""

    pid: int
    fd: int
    name: str
    size: int
    offset: int
    shape: tuple[int, ...]
    dtype: str


class _Segment:
    """A memfd of ``size`` bytes mapped in this process, its pages allocated; ``tensor`` is a uint8 view of the
    whole mapping."""

    def __init__(self, size: int) -> None:
        # Random: a producer's segment is named in the receipts it hands out, and its name is what lets a reader
        # on the host map it (``open_host_segment``); a counter would let one receipt's holder name the next.
        self.name = f"{_PREFIX}{os.getpid()}-{next(_names)}-{secrets.token_hex(16)}"
        self.size = max(1, size)
        self.fd = os.memfd_create(self.name, os.MFD_CLOEXEC)
        try:
            os.ftruncate(self.fd, self.size)
            populated = _populate_write is not None
            flags = mmap.MAP_SHARED if populated else mmap.MAP_SHARED | _POPULATE
            self._map: mmap.mmap | None = mmap.mmap(self.fd, self.size, flags=flags)
            self.tensor = torch.frombuffer(self._map, dtype=torch.uint8)
            if populated and not _populate(self.tensor.data_ptr(), self.size):
                self.tensor = None  # type: ignore[assignment]  # (its mapping goes with the last reference)
                self._map = mmap.mmap(self.fd, self.size, flags=mmap.MAP_SHARED | _POPULATE)
                self.tensor = torch.frombuffer(self._map, dtype=torch.uint8)
        except BaseException:
            self.tensor, self._map = None, None  # type: ignore[assignment]  # the mapping's own descriptor too
            os.close(self.fd)
            raise

    def close(self) -> None:
        """Closes the descriptor; this process's mapping goes when the last view of it does."""
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1
        self._map = None


_POPULATE = getattr(mmap, "MAP_POPULATE", 0)
_MADV_POPULATE_WRITE = 23  # Linux 5.14+


def _libc_madvise() -> Any:
    try:
        fn = ctypes.CDLL(None, use_errno=True).madvise
    except (OSError, AttributeError):
        return None
    fn.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    fn.restype = ctypes.c_int
    return fn


# Allocating a segment's pages takes ~0.4 ms per MB. CPython's mmap() holds the GIL throughout, so MAP_POPULATE
# on the maker thread stalled the engine's scheduler thread for as long (~5 ms per 10 MB item in a real engine,
# between the READ and the worker's load); a ctypes call releases the GIL, so the pages are allocated by
# madvise(MADV_POPULATE_WRITE) through ctypes instead. Older kernels keep MAP_POPULATE.
_populate_write = _libc_madvise()


def _populate(addr: int, nbytes: int) -> bool:
    """Allocates every page of the mapping at ``addr`` without the GIL; False when the kernel cannot."""
    global _populate_write
    fn = _populate_write
    if fn is None:
        return False
    if fn(addr, nbytes, _MADV_POPULATE_WRITE) == 0:
        return True
    err = ctypes.get_errno()
    if err == errno.EINVAL:  # a kernel before 5.14: never again in this process
        _populate_write = None
        return False
    raise OSError(err, f"madvise(MADV_POPULATE_WRITE) of a {nbytes}-byte segment: {os.strerror(err)}")


class SegmentSpares:
    """Segments of the sizes recently taken, made ahead on one background thread (at most ``SPARES_PER_SIZE`` per
    size and ``SPARE_BYTES`` in all): ``take`` hands out a ready one, or makes one now when none is; each taken
    segment is used once. Call ``refill`` after the READ that used a taken one: the spare is made ``delay_s``
    later (refills in the order asked), so that its allocation does not compete for the CPU with the rest of that
    hand-off. ``close`` does not wait for a pending one. Thread-safe."""

    def __init__(self, *, background: bool = True, delay_s: float = REFILL_DELAY_S) -> None:
        self._lock = threading.Lock()
        self._spares: dict[int, list[_Segment]] = {}
        self._bytes = 0
        self._delay_s = delay_s
        self._stop = threading.Event()  # set by close(): no spare is kept after it
        self._maker = (
            ThreadPoolExecutor(max_workers=1, thread_name_prefix="tensorwire-ec-segments") if background else None
        )

    @property
    def spare_bytes(self) -> int:
        with self._lock:
            return self._bytes

    def take(self, nbytes: int) -> _Segment:
        """A segment of ``nbytes``: a spare when one is ready, else one made now; ``ReadError`` (reason
        POOL_EXHAUSTED) when the memory cannot be had (the fetch then fails with that reason, not ``unknown``)."""
        size = max(1, nbytes)
        with self._lock:
            ready = self._spares.get(size)
            if ready:
                seg = ready.pop()
                self._bytes -= seg.size
                return seg
        try:
            return _Segment(size)
        except OSError as exc:  # ENOMEM, EMFILE, a full /dev/shm-less tmpfs: out of memory for this item
            raise ReadError(f"no memory for a {size}-byte segment: {exc}", reason=Reason.POOL_EXHAUSTED) from exc

    def refill(self, size: int) -> None:
        if self._maker is None:
            return
        try:
            self._maker.submit(self._make, max(1, size), time.monotonic() + self._delay_s)
        except RuntimeError:  # shut down
            pass

    def _make(self, size: int, due: float) -> None:
        if self._stop.wait(max(0.0, due - time.monotonic())):
            return
        with self._lock:
            if self._stop.is_set() or len(self._spares.get(size, ())) >= SPARES_PER_SIZE:
                return
            if self._bytes + size > SPARE_BYTES:
                return
        try:
            seg = _Segment(size)
        except OSError as exc:
            log.debug("no spare segment of %d bytes: %s", size, exc)
            return
        with self._lock:
            if not self._stop.is_set():
                self._spares.setdefault(size, []).append(seg)
                self._bytes += seg.size
                return
        seg.close()

    def close(self) -> None:
        with self._lock:
            self._stop.set()
            spares = [seg for segs in self._spares.values() for seg in segs]
            self._spares, self._bytes = {}, 0
        if self._maker is not None:
            self._maker.shutdown(wait=True, cancel_futures=True)
        for seg in spares:
            seg.close()


class HostSegment:
    """A producer's host segment (``HeldStore(segments=...)``) opened by this process: ``fd`` is ours (read-only),
    ``manifest`` the item's tensors at their offsets in it. ``close`` closes our descriptor; mappings made from it
    stay valid."""

    def __init__(self, fd: int, name: str, size: int, manifest: tuple[TensorMeta, ...]) -> None:
        self.fd, self.name, self.size, self.manifest = fd, name, size, manifest

    @property
    def nbytes(self) -> int:
        return sum(m.nbytes for m in self.manifest)

    def tensors(self) -> list[torch.Tensor]:
        """The item's tensors as views of a private mapping of the segment (no copy: the pages are faulted in when
        first read, from the producer's memory)."""
        m = mmap.mmap(self.fd, self.size, flags=mmap.MAP_PRIVATE, prot=mmap.PROT_READ | mmap.PROT_WRITE)
        return views(torch.frombuffer(m, dtype=torch.uint8), self.manifest)

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1


def open_host_segment(receipt: pb.EncodeResponse, expect: Expect, key: str) -> HostSegment | None:
    """The memfd the receipt's ``host_segment`` names, opened from the owner process, when this host can map it
    instead of reading the slot; None otherwise (the caller reads the slot, which reports the lease's state).

    Mapped only when the receipt has one host-memory slot whose owner is on this host (the descriptor's pid and
    host id: the fetch puts there what a Lookup answer said, never what params said), the segment's name has the
    producer prefix and, checked on the descriptor once open (the owner may have closed the number and reused it
    meanwhile), it is the memfd so named, of the announced size, which holds the payload. The name is random and
    the segment is written once, before the receipt exists: whoever holds the receipt can map that item's bytes
    and no other. ``Expect`` failures raise, as a read would."""
    if not receipt.HasField("host_segment") or len(receipt.rdma_slots) != 1:
        return None
    hs = receipt.host_segment
    try:
        d = Descriptor.from_bytes(bytes(receipt.rdma_slots[0].descriptor))
    except TensorwireError:
        return None
    o = d.owner
    if d.mem_type != "DRAM" or not o.host_id or o.host_id != host_id() or hs.nbytes < d.payload_bytes:
        return None
    if not d.manifest:
        return None
    first = d.manifest[0]
    expect.check(first.shape, first.dtype, f"item {key[:64]!r}")
    fd = _open_memfd(o.pid, hs)
    return HostSegment(fd, hs.name, int(hs.nbytes), d.manifest) if fd is not None else None


def open_announced_segment(hs: pb.HostSegment, pid: int, expect: Expect, key: str) -> HostSegment | None:
    """The memfd ``hs`` names in process ``pid`` (an owner on this host that a Lookup answer named, never a pid
    from params), laid out as ``hs`` itself says (its one tensor's shape, dtype and offset): the descriptor is not
    needed. None when ``hs`` carries no layout or one that does not fit the segment, or the memfd cannot be opened
    as :func:`open_host_segment` opens it (the caller then takes the descriptor's path). ``Expect`` failures raise."""
    dtype = _DTYPES.get(hs.dtype)
    shape = tuple(hs.shape)
    if dtype is None or not 0 < len(shape) <= _MAX_DIMS or min(shape) < 0:
        return None
    nbytes = dtype.itemsize * _numel(shape)
    if hs.offset % dtype.itemsize or hs.offset + nbytes > hs.nbytes or nbytes >= 1 << 63:
        return None
    expect.check(shape, dtype, f"item {key[:64]!r}")
    fd = _open_memfd(pid, hs)
    if fd is None:
        return None
    return HostSegment(fd, hs.name, int(hs.nbytes), (TensorMeta(shape, dtype, int(hs.offset), nbytes),))


def _open_memfd(pid: int, hs: pb.HostSegment) -> int | None:
    """Our read-only descriptor of process ``pid``'s memfd that ``hs`` names, or None. Opened only if
    ``/proc/<pid>/fd/<fd>`` links to a memfd of that name (the producer prefix, no slash), and kept only if the
    descriptor we got is that memfd, of ``hs.nbytes`` bytes (the owner may have closed the number and reused it
    between the two looks)."""
    if pid <= 0 or not hs.name.startswith(_PREFIX) or "/" in hs.name:
        return None
    names = (f"/memfd:{hs.name} (deleted)", f"/memfd:{hs.name}")
    path = f"/proc/{int(pid)}/fd/{int(hs.fd)}"
    try:
        if os.readlink(path) not in names:  # not even opened: another kind of file (a FIFO would block an open)
            return None
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | os.O_NONBLOCK | os.O_NOCTTY)
    except OSError:  # the owner closed it (released, expired, gone) or may not be opened by us: read the slot
        return None
    try:
        if os.readlink(f"/proc/self/fd/{fd}") in names and os.fstat(fd).st_size == hs.nbytes:
            return fd
    except OSError:
        pass
    os.close(fd)
    return None


class SegmentStager:
    """The host's one reader (see the module docstring). ``stage`` runs on any thread, one call per key."""

    name = "host"
    inline = True  # no RPC: the fetch may run it on the calling (scheduler) thread

    def __init__(self, reader_factory: ReaderFactory | None, *, spares: bool = True, map_host: bool = False) -> None:
        self.area = StagingArea(reader_factory, device="cpu")
        self._lock = threading.Lock()
        self._segments: dict[str, tuple[_Segment | HostSegment, SegmentRef]] = {}
        self._spares = SegmentSpares(background=spares)
        self.map_host = map_host
        self.mapped = 0  # items handed over as a producer's host segment (no read)

    @property
    def spare_bytes(self) -> int:
        return self._spares.spare_bytes

    def warm_up(self) -> bool:
        return self.area.warm_up()

    def stage(self, key: str, receipt: pb.EncodeResponse, *, timeout_ms: int, expect: Expect) -> int:
        host = open_host_segment(receipt, expect, key) if self.map_host else None
        if host is not None:
            return self._hand_over(key, host)
        made: list[_Segment] = []

        def alloc(nbytes: int) -> torch.Tensor:
            seg = self._spares.take(nbytes)
            made.append(seg)
            return seg.tensor

        try:
            nbytes = self.area.stage(key, receipt, timeout_ms=timeout_ms, expect=expect, into=alloc)
            staged = self.area.get(key)
            if staged is None or len(made) != 1:
                raise ProtocolError(f"item {key[:64]!r} was not staged into one segment", reason=Reason.UNKNOWN)
            seg, first = made[0], staged[0]
            offset = first.data_ptr() - seg.tensor.data_ptr()
            if not 0 <= offset <= seg.size - first.numel() * first.element_size():
                raise ProtocolError(f"item {key[:64]!r} landed outside its segment", reason=Reason.UNKNOWN)
            ref = SegmentRef(
                os.getpid(),
                seg.fd,
                seg.name,
                seg.size,
                offset,
                tuple(first.shape),
                str(first.dtype).removeprefix("torch."),
            )
        except BaseException:
            self.area.drop([key])
            for seg in made:
                seg.close()
            raise
        finally:
            for seg in made:
                self._spares.refill(seg.size)
        self._keep(key, seg, ref)
        return nbytes

    def map_announced(self, key: str, hs: pb.HostSegment, pid: int, expect: Expect) -> int | None:
        """Stages the item ``hs`` announces in process ``pid`` (``open_announced_segment``) by handing that segment
        over; its bytes, or None when it cannot be (nothing staged: take ``stage``). Raises on ``Expect``
        failures."""
        host = open_announced_segment(hs, pid, expect, key) if self.map_host else None
        return self._hand_over(key, host) if host is not None else None

    def _hand_over(self, key: str, host: HostSegment) -> int:
        """The producer's own segment, kept under ``key``: the ranks map it through our descriptor, nothing is
        read."""
        m = host.manifest[0]
        dtype = str(m.dtype).removeprefix("torch.")
        self._keep(key, host, SegmentRef(os.getpid(), host.fd, host.name, host.size, m.offset, m.shape, dtype))
        self.mapped += 1
        return host.nbytes

    def _keep(self, key: str, seg: _Segment | HostSegment, ref: SegmentRef) -> None:
        with self._lock:
            old = self._segments.pop(key, None)
            self._segments[key] = (seg, ref)
        if old is not None:
            old[0].close()

    def plane_of(self, key: str) -> str | None:
        """``"map"`` when the item under ``key`` is a producer's host segment (nothing was read), else None."""
        with self._lock:
            entry = self._segments.get(key)
        return "map" if entry is not None and isinstance(entry[0], HostSegment) else None

    def ref(self, key: str) -> SegmentRef | None:
        with self._lock:
            entry = self._segments.get(key)
        return entry[1] if entry is not None else None

    def drop(self, keys: Sequence[str]) -> None:
        self.area.drop(keys)
        with self._lock:
            gone = [self._segments.pop(k, None) for k in keys]
        for entry in gone:
            if entry is not None:
                entry[0].close()

    @property
    def staged(self) -> int:
        with self._lock:
            return len(self._segments)

    def close(self) -> None:
        with self._lock:
            gone, self._segments = list(self._segments.values()), {}
        self._spares.close()
        for seg, _ in gone:
            seg.close()
        self.area.close()


def map_segment(ref: SegmentRef, *, opener: Callable[[str], int] | None = None) -> torch.Tensor:
    """The item's first tensor as a view of the scheduler's segment (worker side). Raises ``OSError`` when the
    segment cannot be opened and ``ProtocolError`` when the descriptor names another one or the layout does not
    fit it."""
    path = f"/proc/{int(ref.pid)}/fd/{int(ref.fd)}"
    link = os.readlink(path)
    if link not in (f"/memfd:{ref.name} (deleted)", f"/memfd:{ref.name}") or not ref.name.startswith(_PREFIX):
        raise ProtocolError(f"{path} is {link!r}, not the segment {ref.name!r}", reason=Reason.STALE_GENERATION)
    fd = (opener or (lambda p: os.open(p, os.O_RDWR | os.O_CLOEXEC)))(path)
    try:
        size = os.fstat(fd).st_size
        dtype = _DTYPES.get(ref.dtype)
        nbytes = (dtype.itemsize if dtype is not None else 0) * _numel(ref.shape)
        if dtype is None or size != ref.size or not 0 <= ref.offset <= size - nbytes or ref.offset % dtype.itemsize:
            raise ProtocolError(
                f"segment {ref.name!r} ({size} bytes) does not hold {list(ref.shape)}/{ref.dtype} at {ref.offset}",
                reason=Reason.RESULT_MISMATCH,
            )
        # Not populated: the pages exist (the scheduler's READ wrote them); mapping them in now would hold this
        # worker's GIL ~1 ms per 10 MB (CPython's mmap() keeps it), where faulting them in on first use maps 16
        # pages per fault, as the file connector's safetensors mapping does.
        m = mmap.mmap(fd, size, flags=mmap.MAP_SHARED)
    finally:
        os.close(fd)
    base = torch.frombuffer(m, dtype=torch.uint8)
    return base[ref.offset : ref.offset + nbytes].view(dtype).view(ref.shape)


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for d in shape:
        n *= int(d)
    return n


__all__ = [
    "HostSegment",
    "SegmentRef",
    "SegmentSpares",
    "SegmentStager",
    "map_segment",
    "open_announced_segment",
    "open_host_segment",
]
