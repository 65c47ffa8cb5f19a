"""Placed outputs: on the same-host channel the LLM lends the encoder a receive buffer, the encoder
writes its output there, and the answer carries only a manifest of where each tensor is.

Why: written in place by the encoder, in its own context (straight from ``allocate_output``), the output needs
no slot, lease, descriptor, READ or release, and the reader pays no copy after the writer's work.

This module has the buffers on both sides and the checks; the channel (``client._local``, ``server._local``) moves
the offers and answers, ``OutputTransport`` writes, ``RemoteOutputTransport`` takes the tensors.

Buffers (client side, :class:`RecvBuffer`): a dedicated allocation the caller's other memory never shares, so the
worker can reach nothing else of the caller's:

- host: a sealed memfd (``F_SEAL_SHRINK | F_SEAL_GROW | F_SEAL_SEAL``: its size cannot change under the worker,
  which would SIGBUS it), passed with the offer (SCM_RIGHTS) and mapped ``MAP_SHARED`` by the worker;
- CUDA: ``cuMemAlloc`` on the caller's device, its ``cuIpcGetMemHandle`` in the offer, opened by the worker with
  ``cuIpcOpenMemHandle`` (its size checked with ``cuMemGetAddressRange``).

Lifetime: a buffer belongs to one connection (the worker maps it once per connection, unmaps it when the
connection ends). While a fetch's tensors live they hold the buffer (a loan, ended by ``weakref.finalize`` when the
last tensor is gone; on CUDA an event is recorded on the dropping thread's current stream and waited for before
the buffer is lent again). A buffer whose request was in flight when its connection broke may still be written by
the worker: it is never lent again and is freed only once the worker's end of the connection is closed.

Checks on the answer (client, :func:`placed_views`): every tensor inside the buffer, offset a multiple of its
dtype's size, ``nbytes == prod(shape) * itemsize``, known role and dtype, at most ``MAX_DIMS`` dims, no overlaps:
``ProtocolError`` otherwise. Checks on the offer (worker, :func:`map_offer`): kind, size within the worker's cap,
the memfd sealed and as large as offered, the CUDA allocation as large as offered: ``PlacementRefused`` otherwise
(the request is answered as if no buffer was named).
"""

from __future__ import annotations

import ctypes
import errno
import fcntl
import logging
import math
import mmap
import os
import threading
import weakref
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import torch

from tensorwire._local import unix as _unix
from tensorwire.errors import ProtocolError, Reason
from tensorwire.mm._proto import encoder_pb2 as pb
from tensorwire.mm.wire import _codec
from tensorwire.rdma._devmem import wrap_device, wrap_device_as

log = logging.getLogger(__name__)

ALIGN = 512  # byte alignment of each placed tensor (any dtype's size divides it; a cache line and more)
MIN_BUFFER_BYTES = 1 << 20
MAX_DIMS = 16
HANDLE_BYTES = 64  # sizeof(CUipcMemHandle)
_SEALS = fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_SEAL
_WIRE_TO_DTYPE = _codec.WIRE_TO_DTYPE
_ROLES = frozenset((pb.EMBEDDING, pb.POS_ID, pb.EXTRA_INPUT))


class PlacementRefused(Exception):
    """The worker does not take an offered buffer (the message says why); the request goes on without it."""


def buffer_bytes(needed: int) -> int:
    """The size of a buffer for ``needed`` bytes: the next power of two, at least ``MIN_BUFFER_BYTES``."""
    size = MIN_BUFFER_BYTES
    while size < needed:
        size <<= 1
    return size


def align_up(n: int) -> int:
    return (n + ALIGN - 1) // ALIGN * ALIGN


def plan(specs: Sequence[tuple[Sequence[int], torch.dtype]], capacity: int) -> list[int] | None:
    """Byte offsets for tensors of ``specs`` packed (each at ``ALIGN``) into ``capacity`` bytes, or None."""
    offsets, at = [], 0
    for shape, dtype in specs:
        offsets.append(at)
        at = align_up(at + math.prod(shape) * dtype.itemsize)
    return offsets if at <= capacity else None


def needed_bytes(tensors: Sequence[torch.Tensor]) -> int:
    """What ``tensors`` take packed by :func:`plan`."""
    return sum(align_up(t.numel() * t.element_size()) for t in tensors)


def typed_view(base: torch.Tensor, offset: int, shape: Sequence[int], dtype: torch.dtype) -> torch.Tensor:
    """``base`` (1-D uint8) bytes at ``offset`` as a contiguous tensor of ``shape``/``dtype``."""
    n = math.prod(shape) * dtype.itemsize
    return base[offset : offset + n].view(dtype).view(tuple(shape))


# -- CUDA driver API ---------------------------------------------------------------------------------------


class _Handle(ctypes.Structure):
    _fields_ = [("reserved", ctypes.c_char * HANDLE_BYTES)]


class _Driver:
    """The few driver calls placement needs, on the device's primary context (the one torch uses)."""

    def __init__(self) -> None:
        lib = ctypes.CDLL("libcuda.so.1")
        self._lib = lib
        self._ctx: dict[int, ctypes.c_void_p] = {}
        self._lock = threading.Lock()
        self._check(lib.cuInit(0), "cuInit")

    def _check(self, rc: int, what: str) -> None:
        if rc != 0:
            name = ctypes.c_char_p()
            self._lib.cuGetErrorName(rc, ctypes.byref(name))
            raise RuntimeError(f"{what} failed: {name.value.decode() if name.value else rc}")

    def _context(self, device: int) -> ctypes.c_void_p:
        with self._lock:
            ctx = self._ctx.get(device)
            if ctx is None:
                dev = ctypes.c_int()
                self._check(self._lib.cuDeviceGet(ctypes.byref(dev), device), "cuDeviceGet")
                ctx = ctypes.c_void_p()
                self._check(self._lib.cuDevicePrimaryCtxRetain(ctypes.byref(ctx), dev), "cuDevicePrimaryCtxRetain")
                self._ctx[device] = ctx
            return ctx

    def call(self, device: int, fn: Callable[[], int], what: str) -> None:
        """``fn()`` (a driver call) with ``device``'s primary context current on this thread."""
        self._check(self._lib.cuCtxPushCurrent_v2(self._context(device)), "cuCtxPushCurrent")
        try:
            self._check(fn(), what)
        finally:
            self._lib.cuCtxPopCurrent_v2(ctypes.byref(ctypes.c_void_p()))

    def alloc(self, device: int, nbytes: int) -> int:
        ptr = ctypes.c_uint64()
        self.call(device, lambda: self._lib.cuMemAlloc_v2(ctypes.byref(ptr), ctypes.c_size_t(nbytes)), "cuMemAlloc")
        return int(ptr.value)

    def free(self, device: int, ptr: int) -> None:
        self.call(device, lambda: self._lib.cuMemFree_v2(ctypes.c_uint64(ptr)), "cuMemFree")

    def ipc_handle(self, device: int, ptr: int) -> bytes:
        handle = _Handle()
        self.call(
            device, lambda: self._lib.cuIpcGetMemHandle(ctypes.byref(handle), ctypes.c_uint64(ptr)), "cuIpcGetMemHandle"
        )
        return bytes(handle)  # all 64 bytes (``handle.reserved`` would stop at the first NUL)

    def ipc_open(self, device: int, raw: bytes) -> tuple[int, int]:
        """(mapped base, size of the allocation) for a handle from another process."""
        handle = _Handle.from_buffer_copy(raw)
        ptr, base, size = ctypes.c_uint64(), ctypes.c_uint64(), ctypes.c_size_t()
        self.call(
            device,
            lambda: self._lib.cuIpcOpenMemHandle_v2(ctypes.byref(ptr), handle, ctypes.c_uint(1)),
            "cuIpcOpenMemHandle",
        )
        try:
            self.call(
                device,
                lambda: self._lib.cuMemGetAddressRange_v2(ctypes.byref(base), ctypes.byref(size), ptr),
                "cuMemGetAddressRange",
            )
        except RuntimeError:
            self.ipc_close(device, int(ptr.value))
            raise
        return int(ptr.value), int(size.value) - (int(ptr.value) - int(base.value))

    def ipc_close(self, device: int, ptr: int) -> None:
        self.call(device, lambda: self._lib.cuIpcCloseMemHandle(ctypes.c_uint64(ptr)), "cuIpcCloseMemHandle")


_driver: _Driver | None = None
_driver_lock = threading.Lock()


def driver() -> _Driver:
    global _driver
    with _driver_lock:
        if _driver is None:
            _driver = _Driver()
        return _driver


# -- client side --------------------------------------------------------------------------------------------


class _Loan:
    """Counts the holders of one device loan; ``end`` runs once, when the last is gone (on the thread that dropped
    it), and only after ``start``: a lend that failed half way never starts its loan, so the holders it made end
    nothing (the caller frees the buffer itself)."""

    __slots__ = ("_left", "_end", "_lock", "_live")

    def __init__(self, holders: int, end: Callable[[], None]) -> None:
        self._left = holders
        self._end = end
        self._lock = threading.Lock()
        self._live = False

    def start(self) -> None:
        with self._lock:
            self._live = True
            done = self._left == 0
        if done:
            self._end()

    def drop(self) -> None:
        with self._lock:
            self._left -= 1
            done = self._live and self._left == 0
        if done:
            self._end()


class RecvBuffer:
    """A receive buffer of ``nbytes`` on ``device`` (see the module doc). ``busy`` while lent (to a request in
    flight or to the tensors of a fetch); ``retired``: never lent again."""

    def __init__(self, buffer_id: int, nbytes: int, device: torch.device) -> None:
        self.buffer_id = buffer_id
        self.nbytes = nbytes
        self.device = device
        self.busy = False
        self.retired = False
        self._ready: Any = None  # a CUDA event the next lending waits for
        self._event: Any = None
        self._fd = -1
        self._mm: mmap.mmap | None = None
        self._array: np.ndarray | None = None
        self._ptr = 0
        self._handle = b""
        if device.type == "cuda":
            idx = device.index or 0
            self._ptr = driver().alloc(idx, nbytes)
            try:
                self._handle = driver().ipc_handle(idx, self._ptr)
            except BaseException:
                driver().free(idx, self._ptr)
                raise
        else:
            fd = os.memfd_create(f"tensorwire-recv-{buffer_id}", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
            try:
                os.ftruncate(fd, nbytes)
                fcntl.fcntl(fd, fcntl.F_ADD_SEALS, _SEALS)
                self._mm = mmap.mmap(fd, nbytes, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
            except BaseException:
                os.close(fd)
                raise
            self._fd = fd
            self._array = np.frombuffer(self._mm, dtype=np.uint8)

    def offer(self) -> tuple[pb.BufferOffer, list[int]]:
        """The offer frame's body and the descriptors to pass with it."""
        if self.device.type == "cuda":
            return pb.BufferOffer(
                buffer_id=self.buffer_id, kind=pb.BufferOffer.CUDA, nbytes=self.nbytes, cuda_ipc_handle=self._handle
            ), []
        return pb.BufferOffer(buffer_id=self.buffer_id, kind=pb.BufferOffer.HOST, nbytes=self.nbytes), [self._fd]

    def wait_ready(self) -> None:
        """Before lending: the work the previous tensors' users queued on their stream has run."""
        ready, self._ready = self._ready, None
        if ready is not None:
            ready.synchronize()

    def lend(
        self, parts: Sequence[tuple[int, tuple[int, ...], torch.dtype]], on_end: Callable[[RecvBuffer], None]
    ) -> list[torch.Tensor]:
        """A contiguous tensor for each ``(offset, shape, dtype)`` of ``parts`` (inside the buffer, aligned and
        disjoint: ``placed_views`` checked); the loan ends (``on_end(self)``) when the last tensor built on them
        is gone."""
        if self.device.type == "cuda":
            return self._lend_device(parts, on_end)
        assert self._array is not None
        used = max((off + math.prod(shape) * dtype.itemsize for off, shape, dtype in parts), default=0)
        view = self._array[: max(used, 1)]
        weakref.finalize(view, on_end, self)
        base = torch.from_numpy(view)
        return [typed_view(base, off, shape, dtype) for off, shape, dtype in parts]

    def _lend_device(
        self, parts: Sequence[tuple[int, tuple[int, ...], torch.dtype]], on_end: Callable[[RecvBuffer], None]
    ) -> list[torch.Tensor]:
        # Each tensor wraps its own bytes (one torch op, where a wrap of the buffer sliced and viewed took four per
        # tensor); the loan ends with the last of their holders.
        # An empty tensor holds nothing of the buffer.
        loan = _Loan(sum(0 not in shape for _, shape, _ in parts), lambda: self._end_device_loan(on_end))
        out = []
        for off, shape, dtype in parts:
            if 0 in shape:
                out.append(torch.empty(shape, dtype=dtype, device=self.device))
                continue
            t, holder = wrap_device_as(self._ptr + off, shape, dtype, self.device)
            weakref.finalize(holder, loan.drop)
            out.append(t)
        loan.start()  # not reached when a wrap failed: the tensors made so far die with this frame, ending nothing
        return out

    def _end_device_loan(self, on_end: Callable[[RecvBuffer], None]) -> None:
        try:
            if self._event is None:
                self._event = torch.cuda.Event()  # type: ignore[no-untyped-call]  # torch: unannotated
            self._event.record(torch.cuda.current_stream(self.device))
            self._ready = self._event
        except Exception:  # no event, no ordering: wait for the device instead of risking an overwrite
            self._ready = None
            torch.cuda.synchronize(self.device)
        on_end(self)

    def close(self) -> None:
        """Frees the memory (the caller made sure nothing uses it any more); idempotent."""
        self.retired = True
        if self._ptr:
            ptr, self._ptr = self._ptr, 0
            try:
                driver().free(self.device.index or 0, ptr)
            except Exception:
                log.warning("freeing a receive buffer failed", exc_info=True)
        if self._mm is not None:
            self._array = None
            try:
                self._mm.close()
            except BufferError:  # a tensor still views it: the mapping goes with the last one
                pass
            self._mm = None
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1


def placed_views(
    placed: pb.PlacedOutput, buf: RecvBuffer, on_end: Callable[[RecvBuffer], None]
) -> tuple[list[torch.Tensor], list[int], int]:
    """(tensors, roles, payload bytes) of a placed answer, viewing ``buf`` (lent until they are gone).
    ``ProtocolError(RESULT_MISMATCH)`` when the manifest does not fit the buffer (nothing is lent then)."""
    parts: list[tuple[int, tuple[int, ...], torch.dtype]] = []
    roles: list[int] = []
    spans: list[tuple[int, int]] = []
    total = 0
    for i, t in enumerate(placed.tensors):
        dtype = _WIRE_TO_DTYPE.get(t.dtype)
        if dtype is None:
            raise _bad(f"placed tensor {i} has unknown dtype {t.dtype}")
        role = t.role
        if role not in _ROLES:
            raise _bad(f"placed tensor {i} has unknown role {role}")
        if len(t.shape) > MAX_DIMS:
            raise _bad(f"placed tensor {i} has a shape of {len(t.shape)} dims (at most {MAX_DIMS})")
        shape = tuple(t.shape)
        if shape and min(shape) < 0:
            raise _bad(f"placed tensor {i} has shape {shape}")
        n = math.prod(shape) * dtype.itemsize
        off = t.offset
        if n != t.nbytes or off % dtype.itemsize or off + n > buf.nbytes:
            raise _bad(
                f"placed tensor {i} ({shape}, {dtype}, {t.nbytes} bytes at {off}) does not fit a "
                f"{buf.nbytes}-byte buffer"
            )
        parts.append((off, shape, dtype))
        roles.append(role)
        total += n
        if n:
            spans.append((off, off + n))
    if not parts:
        raise _bad("placed answer names no tensor")
    if len(spans) > 1:
        spans.sort()
        for (_, end), (start, _) in zip(spans, spans[1:], strict=False):
            if start < end:
                raise _bad("placed tensors overlap")
    return buf.lend(parts, on_end), roles, total


def _bad(msg: str) -> ProtocolError:
    return ProtocolError(msg, reason=Reason.RESULT_MISMATCH)


# -- worker side --------------------------------------------------------------------------------------------


class MappedBuffer:
    """A caller's offered buffer mapped here: ``tensor`` (1-D uint8 over ``nbytes``) is where outputs go."""

    def __init__(self, buffer_id: int, nbytes: int, tensor: torch.Tensor, close: Callable[[], None]) -> None:
        self.buffer_id = buffer_id
        self.nbytes = nbytes
        self.tensor = tensor
        self._close = close
        self._typed: dict[torch.dtype, torch.Tensor] = {}  # the buffer as each dtype asked for so far

    def view(self, offset: int, shape: Sequence[int], dtype: torch.dtype) -> torch.Tensor:
        """What :func:`typed_view` of ``tensor`` gives, as one ``as_strided`` of the buffer reinterpreted once
        per dtype (a request's path pays one tensor op per output, not three). ``offset`` is a multiple of
        ``dtype``'s size (``plan`` aligns to ``ALIGN``)."""
        typed = self._typed.get(dtype)
        if typed is None:
            size = dtype.itemsize
            typed = self._typed[dtype] = self.tensor[: self.nbytes - self.nbytes % size].view(dtype)
        strides, step = [], 1
        for d in reversed(shape):
            strides.append(step)
            step *= max(int(d), 1)
        return typed.as_strided(tuple(shape), tuple(reversed(strides)), offset // dtype.itemsize)

    def close(self) -> None:
        close, self._close = self._close, lambda: None
        self.tensor = torch.empty(0, dtype=torch.uint8)
        self._typed = {}
        try:
            close()
        except Exception:
            log.warning("unmapping a placed buffer failed", exc_info=True)


def map_offer(offer: pb.BufferOffer, fds: list[int], device: torch.device, max_bytes: int) -> MappedBuffer:
    """Maps an offered buffer (closes ``fds``); ``PlacementRefused`` with the reason when it cannot be taken.
    CUDA buffers are opened on ``device`` (the worker's); a host buffer on a CUDA worker is refused (the output
    would take a device-to-host copy; the normal planes do that better)."""
    try:
        if offer.buffer_id == 0:
            raise PlacementRefused("buffer id 0")
        if not 0 < offer.nbytes <= max_bytes:
            raise PlacementRefused(f"{offer.nbytes} bytes offered; this worker takes 1..{max_bytes}")
        if offer.kind == pb.BufferOffer.HOST:
            if device.type != "cpu":
                raise PlacementRefused("a host buffer offered to a worker whose outputs are on " + str(device))
            if len(fds) != 1:
                raise PlacementRefused(f"a host buffer offer came with {len(fds)} descriptors, not 1")
            return _map_host(offer, fds[0])
        if offer.kind == pb.BufferOffer.CUDA:
            if device.type != "cuda":
                raise PlacementRefused("a CUDA buffer offered to a worker without a GPU")
            if len(offer.cuda_ipc_handle) != HANDLE_BYTES:
                raise PlacementRefused(f"CUDA IPC handle of {len(offer.cuda_ipc_handle)} bytes")
            return _map_cuda(offer, device)
        raise PlacementRefused(f"buffer kind {offer.kind}")
    finally:
        _unix.close_fds(fds)


def _map_host(offer: pb.BufferOffer, fd: int) -> MappedBuffer:
    try:
        seals = fcntl.fcntl(fd, fcntl.F_GET_SEALS)
        size = os.fstat(fd).st_size
    except OSError as exc:
        raise PlacementRefused(f"not a sealed memfd ({errno.errorcode.get(exc.errno or 0, exc)})") from exc
    if seals & (fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW) != (fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW):
        raise PlacementRefused("the memfd is not sealed against resizing")
    if size < offer.nbytes:
        raise PlacementRefused(f"the memfd has {size} bytes, {offer.nbytes} offered")
    try:
        mm = mmap.mmap(fd, offer.nbytes, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
    except OSError as exc:
        raise PlacementRefused(f"mmap failed: {exc}") from exc
    tensor = torch.frombuffer(mm, dtype=torch.uint8)

    def close() -> None:
        try:
            mm.close()
        except BufferError:  # a view is still alive; the mapping goes with it
            pass

    return MappedBuffer(offer.buffer_id, offer.nbytes, tensor, close)


def _map_cuda(offer: pb.BufferOffer, device: torch.device) -> MappedBuffer:
    idx = device.index or 0
    try:
        ptr, size = driver().ipc_open(idx, bytes(offer.cuda_ipc_handle))
    except (OSError, RuntimeError) as exc:
        raise PlacementRefused(f"cuIpcOpenMemHandle: {exc}") from exc
    if size < offer.nbytes:
        driver().ipc_close(idx, ptr)
        raise PlacementRefused(f"the CUDA allocation has {size} bytes, {offer.nbytes} offered")
    try:
        tensor, _ = wrap_device(ptr, offer.nbytes, device)
    except Exception as exc:
        driver().ipc_close(idx, ptr)
        raise PlacementRefused(f"wrapping the mapped buffer: {exc}") from exc

    def close() -> None:
        torch.cuda.synchronize(device)  # nothing of ours may still write into it
        driver().ipc_close(idx, ptr)  # views still alive would dangle: they were valid until transfer() returned

    return MappedBuffer(offer.buffer_id, offer.nbytes, tensor, close)


class Placement:
    """The buffer one request may write into (on the worker, in the request's ``CallScope``)."""

    def __init__(self, buffer: MappedBuffer) -> None:
        self.buffer = buffer
        self.used = False  # allocate_output handed out views of it (one allocation per request)

    def views(self, specs: Sequence[tuple[Sequence[int], torch.dtype]]) -> list[torch.Tensor] | None:
        """Tensors of ``specs`` inside the buffer, or None when they do not fit or the buffer is taken."""
        if self.used:
            return None
        offsets = plan(specs, self.buffer.nbytes)
        if offsets is None:
            return None
        self.used = True
        view = self.buffer.view
        return [view(off, shape, dtype) for off, (shape, dtype) in zip(offsets, specs, strict=True)]


__all__ = [
    "ALIGN",
    "MIN_BUFFER_BYTES",
    "MappedBuffer",
    "Placement",
    "PlacementRefused",
    "RecvBuffer",
    "buffer_bytes",
    "map_offer",
    "needed_bytes",
    "placed_views",
    "plan",
]
