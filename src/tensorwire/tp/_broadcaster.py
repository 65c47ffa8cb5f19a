"""CpuTpBroadcaster: rank 0 of a node-local tensor-parallel group broadcasts CPU tensors to the other ranks."""

from __future__ import annotations

import hashlib
import logging
import os
import select
import socket
import struct
import threading
import time
from typing import Any

import torch

from tensorwire.errors import (
    BroadcastError,
    BroadcastTimeout,
    ClosedError,
    ConfigError,
    FrameMismatch,
    PeerClosed,
    Reason,
)

from . import _fence
from ._config import UNSET, BroadcastConfig, Unset
from ._frame import (
    CODE_OF,
    HEADER,
    KIND_ABORT,
    KIND_DATA,
    S_TENSOR,
    Layout,
    allocate,
    assemble,
    byte_view,
    check_inplace,
    decode_header,
    decode_table,
    encode_abort,
    encode_prefix,
    flatten,
    plain,
)
from ._link import Link, Waiter
from ._paths import Endpoint, make_endpoint, session_digest
from ._shm import _PUB, ABORT_PEER_DIED, ABORT_ROOT_CLOSED, ABORT_ROOT_FAILED, ShmRing
from ._star import Hello, RootBootstrap, peer_bootstrap

log = logging.getLogger(__name__)

BACKENDS = ("auto", "uds", "shm")
_BYE = b"BYE!"
_SEQ = struct.Struct("<Q")
_TERMINAL = (PeerClosed, FrameMismatch, BroadcastTimeout)


def shm_available() -> bool:
    """True when this machine has what the shared-memory ring needs (memfd and a trustworthy fence)."""
    return _fence.AVAILABLE and hasattr(os, "memfd_create")


class CpuTpBroadcaster:
    """Broadcast CPU tensors from rank 0 to the other ranks of one node, every step, without NCCL.

    Every rank constructs it with the same ``world_size``, ``session``, ``backend`` and config; construction blocks
    until the whole group is connected (``init_timeout_s``) and raises ``BootstrapError`` naming the rank and the
    cause otherwise. Backends: ``"uds"`` (rank 0 writes each frame to one Unix socket per peer), ``"shm"`` (rank 0
    writes each frame once into a shared-memory ring; the sockets remain for wake-ups and failure detection),
    ``"auto"`` (shm when available, else uds).

    Contract:
      * Lockstep: every rank calls ``broadcast``/``broadcast_`` the same number of times in the same order.
        Rank 0 passes the value, other ranks pass ``None`` (``broadcast``) or a tensor of the same dtype and shape
        (``broadcast_``). Values are CPU tensors, or a flat list/tuple/dict (str keys) of CPU tensors.
      * Ownership: rank 0 may modify its tensors as soon as the call returns (bytes were copied to the sockets or
        the ring); readers get fresh tensors (``broadcast``) or their own tensor filled in (``broadcast_``).
      * Threads: one call at a time per broadcaster; a concurrent or re-entrant call raises ``BroadcastError``.
        ``close()`` must not race an in-flight call.
      * Failures are terminal: after ``PeerClosed``, ``FrameMismatch`` or ``BroadcastTimeout`` the broadcaster
        is poisoned, the group is aborted (every rank raises within a second or two) and every later call raises.
        Close it and build a new one (the same session works after ``close()``).
      * ``close()`` is idempotent; afterwards calls raise ``ClosedError``.

    Settings come from ``config`` (or, when it is None, ``BroadcastConfig.from_env()``); ``init_timeout_s`` and
    ``timeout_s`` override the config only when passed (``timeout_s=None`` then means no limit).
    """

    def __init__(self, rank: int, world_size: int, session: str, backend: str = "auto", base_dir: str | None = None,
                 init_timeout_s: float | Unset = UNSET, timeout_s: float | None | Unset = UNSET, *,
                 config: BroadcastConfig | None = None) -> None:
        self._closed = True  # until set-up finishes
        self._shut = False
        self._links: list[Link | None] = []
        self._ring: ShmRing | None = None
        self._watchdog: threading.Thread | None = None
        self._stop_w = -1
        if not isinstance(world_size, int) or isinstance(world_size, bool) or world_size < 1:
            raise ConfigError(f"world_size must be an int >= 1, got {world_size!r}")
        if not isinstance(rank, int) or isinstance(rank, bool) or not 0 <= rank < world_size:
            raise ConfigError(f"rank must be an int in [0, {world_size}), got {rank!r}")
        if backend not in BACKENDS:
            raise ConfigError(f"backend must be one of {BACKENDS}, got {backend!r}")
        # Keywords override the config only when passed; config=None reads TENSORWIRE_BROADCAST_*.
        self.config = BroadcastConfig.resolve(config, init_timeout_s=init_timeout_s, timeout_s=timeout_s)
        if backend == "auto":
            backend = "shm" if shm_available() else "uds"
        elif backend == "shm" and not shm_available():
            raise ConfigError(f"backend='shm' needs os.memfd_create and a memory fence (libatomic, or x86-64); "
                              f"this machine has fence={_fence.KIND!r}; use backend='uds'")
        self.rank = rank
        self.world_size = world_size
        self.session = session
        self.backend = backend
        self.endpoint: Endpoint | None = None
        self._seq = 0
        self._failed: BroadcastError | None = None
        self._call_lock = threading.Lock()
        self._wcache: tuple[Any, bytearray, list[int], int] | None = None
        self._ucache: tuple[int, bytes, bytes, Layout] | None = None
        self._vcache: tuple[tuple[int, int], memoryview] | None = None
        self._tcache: tuple[torch.dtype, torch.Size] | None = None
        self._tlayout: Layout | None = None  # the uds layout that _tcache was checked against
        self._send_lock = threading.Lock()
        self._abort_lock = threading.Lock()
        if world_size == 1:
            self._closed = False
            return
        cfg = self.config
        self.endpoint = make_endpoint(session, base_dir, cfg.abstract)
        hello = Hello(rank, world_size, backend, session_digest(session), self._params_digest())
        t0 = time.monotonic()
        if rank == 0:
            fd = -1
            try:
                extra, fds = 0, []
                if backend == "shm":
                    self._ring, fd = ShmRing.create(world_size, cfg.n_slots, cfg.slot_bytes, cfg.arena_bytes)
                    extra, fds = self._ring.size, [fd]
                root = RootBootstrap(self.endpoint, world_size, hello, cfg.init_timeout_s, cfg.socket_buffer_bytes,
                                     cfg.check_peer_uid)
                self._links = root.run(fds, extra)
            except BaseException:
                if self._ring is not None:
                    self._ring.close()
                    self._ring = None
                raise
            finally:
                if fd >= 0:
                    os.close(fd)  # peers received their own copy; our mapping keeps the memory
            self._start_watchdog()
        else:
            link, extra, fds = peer_bootstrap(self.endpoint, rank, hello, cfg.init_timeout_s, cfg.connect_retry_s,
                                              cfg.socket_buffer_bytes, cfg.check_peer_uid,
                                              1 if backend == "shm" else 0)
            try:
                if backend == "shm":
                    self._ring = ShmRing.attach(fds[0], extra, rank, world_size, cfg.n_slots, cfg.slot_bytes,
                                                cfg.arena_bytes)
            except BaseException:
                link.close()
                raise
            self._links = [link]
        self._closed = False
        log.info("broadcaster rank %d/%d up: backend=%s endpoint=%s session=%s (%.1f ms)", rank, world_size,
                 backend, self.endpoint.display, session, (time.monotonic() - t0) * 1e3)

    def _params_digest(self) -> bytes:
        c = self.config
        text = f"{self.backend}|{c.slot_bytes}|{c.n_slots}|{c.arena_bytes}|{c.abstract}|frame1"
        return hashlib.blake2b(text.encode(), digest_size=16).digest()

    # -- public API ------------------------------------------------------------------------------------------------
    def broadcast(self, value: Any = None) -> Any:
        """Rank 0: send ``value`` and return it. Other ranks: pass ``None``, get the same structure back."""
        self._enter()
        try:
            if self.rank == 0:
                if isinstance(value, torch.Tensor) and value.is_cpu:
                    if self.world_size > 1:
                        self._send_one(plain(value))
                    elif value.dtype not in CODE_OF:
                        flatten(value, 0)
                    return value
                structure, keys, tensors = flatten(value, 0)
                if self.world_size > 1:
                    self._send(structure, keys, tensors)
                return value
            if value is not None:
                raise BroadcastError(f"rank {self.rank}: broadcast(value) takes None on ranks other than 0, got "
                                     f"{type(value).__name__}; use broadcast_(tensor) to fill a tensor in place",
                                     reason=Reason.INVALID_CONFIG)
            return self._recv(None)
        except _TERMINAL as exc:
            self._poison(exc)
            raise
        finally:
            self._call_lock.release()

    def broadcast_(self, tensor: torch.Tensor) -> torch.Tensor:
        """In-place, fixed-shape form for hot loops: rank 0 sends ``tensor``; other ranks receive into theirs
        (same dtype and shape, CPU; non-contiguous targets are filled through a contiguous copy)."""
        self._enter()
        try:
            # dtype is checked by _send_one (rank 0) and against the frame (readers); world 1 checks it here.
            if not isinstance(tensor, torch.Tensor) or not tensor.is_cpu or (self.world_size == 1
                                                                              and tensor.dtype not in CODE_OF):
                flatten(tensor, self.rank)  # raises the precise error
                raise BroadcastError(f"rank {self.rank}: broadcast_ takes one tensor", reason=Reason.INVALID_CONFIG)
            if self.world_size == 1:
                return tensor
            if self.rank == 0:
                self._send_one(plain(tensor))
                return tensor
            ring = self._ring
            direct = tensor.is_contiguous() and not tensor.is_conj() and not tensor.is_neg()
            if ring is not None and direct and self._tcache == (tensor.dtype, tensor.shape):
                # Hot loop: same target as last time. Any surprise falls through to the checked path below.
                seq = self._seq + 1
                if ring.w[_PUB] < seq:
                    link = self._links[0]
                    assert link is not None
                    ring.wait_published(seq, link, lambda: self._waiter(f"broadcast (waiting for message {seq} "
                                                                        f"from rank 0)"),
                                        self.config.spin_s, self.config.wait_poll_s)
                else:
                    _fence.acquire()
                if ring.read_cached(seq, self._view(tensor)):
                    self._seq = seq
                    return tensor
            if direct:
                self._recv(tensor)
            else:  # non-contiguous or a lazy conj/neg view: its storage bytes are not its values
                tmp = torch.empty(tensor.shape, dtype=tensor.dtype)
                self._recv(tmp, check_against=tensor)
                tensor.copy_(tmp)
            return tensor
        except _TERMINAL as exc:
            self._poison(exc)
            raise
        finally:
            self._call_lock.release()

    def close(self) -> None:
        """Release sockets, the ring and the watchdog. Idempotent; safe on a half-built object."""
        if self._shut:
            return
        self._shut = True
        self._closed = True
        if self.rank == 0:
            if self._ring is not None and self._failed is None:
                self._ring.abort(ABORT_ROOT_CLOSED, 0)
            self._stop_watchdog()
            for lk in self._links:
                if lk is not None:
                    if self.backend == "uds" and self._failed is None:
                        lk.send_nowait(encode_abort(self._seq + 1, "rank 0 closed its broadcaster"))
                    lk.close()
        else:
            for lk in self._links:
                if lk is not None:
                    lk.send_nowait(_BYE)
                    lk.close()
        self._links = []
        if self._ring is not None:
            self._ring.close()
            self._ring = None

    def __enter__(self) -> CpuTpBroadcaster:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @property
    def closed(self) -> bool:
        return self._closed

    def __repr__(self) -> str:
        return (f"CpuTpBroadcaster(rank={self.rank}, world_size={self.world_size}, session={self.session!r}, "
                f"backend={self.backend!r}, closed={self._closed})")

    # -- internals -------------------------------------------------------------------------------------------------
    def _enter(self) -> None:
        if self._closed:
            raise ClosedError(f"rank {self.rank}: broadcaster is closed; build a new one")
        if not self._call_lock.acquire(blocking=False):
            raise BroadcastError(f"rank {self.rank}: concurrent or re-entrant broadcast on one broadcaster; "
                                 f"calls must be serialized", reason=Reason.INVALID_CONFIG)
        failed = self._failed
        if failed is not None:
            self._call_lock.release()
            raise type(failed)(f"rank {self.rank}: broadcaster failed earlier ({failed}); close it and build a new "
                               f"one", reason=failed.reason)

    def _poison(self, exc: BroadcastError) -> None:
        if self._failed is None:
            self._failed = exc
        if self.rank == 0:
            self._abort_group(-1, str(exc))
        else:
            # Hanging up tells rank 0's watchdog, which aborts the rest of the group.
            for lk in self._links:
                if lk is not None:
                    lk.shutdown()

    def _raise_if_failed(self) -> None:
        if self._failed is not None:
            raise self._failed

    def _waiter(self, what: str) -> Waiter:
        return Waiter(self.rank, what, self.config.timeout_s, self.config.stall_warn_s)

    # rank 0 ---------------------------------------------------------------------------------------------------------
    def _send_one(self, t: torch.Tensor) -> None:
        """Hot path for one contiguous CPU tensor: the header and table are cached per (dtype, shape)."""
        key = (t.dtype, t.shape)
        c = self._wcache
        if c is None or c[0] != key:
            flatten(t, 0)
            prefix, offsets, payload = encode_prefix(KIND_DATA, 0, S_TENSOR, [""], [t],
                                                     64 if self._ring is not None else 1)
            c = self._wcache = (key, bytearray(prefix), offsets, payload)
        seq = self._seq + 1
        _SEQ.pack_into(c[1], 8, seq)
        view = self._view(t)
        ring = self._ring
        if ring is not None and ring.publish_small(seq, c[1], view, self._links):
            self._seq = seq
            return
        self._send_frame(seq, c[1], [view], c[2], c[3])

    def _send(self, structure: int, keys: list[str], tensors: list[torch.Tensor]) -> None:
        seq = self._seq + 1
        prefix, offsets, payload = encode_prefix(KIND_DATA, seq, structure, keys, tensors,
                                                 64 if self._ring is not None else 1)
        self._send_frame(seq, prefix, [byte_view(t) for t in tensors], offsets, payload)

    def _send_frame(self, seq: int, prefix: bytes | bytearray, views: list[memoryview], offsets: list[int],
                    payload: int) -> None:
        def waiter() -> Waiter:
            return self._waiter(f"broadcast of message {seq}")

        if self._ring is not None:
            self._ring.publish(seq, prefix, views, offsets, payload, self._links, waiter, self.config.spin_s,
                               self._raise_if_failed)
        else:
            parts: list[memoryview | bytes | bytearray] = [prefix]
            parts.extend(v for v in views if len(v))
            total = len(prefix) + sum(len(v) for v in views)
            dead: Link | None = None
            error: PeerClosed | None = None
            with self._send_lock:
                self._raise_if_failed()
                for lk in self._links[1:]:
                    assert lk is not None
                    try:
                        lk.send_all(parts, waiter, total)
                    except PeerClosed as exc:
                        dead, error = lk, exc
                        break
            if dead is not None and error is not None:
                # Outside the send lock: every other stream is at a frame boundary, so abort frames are safe.
                self._abort_group(dead.peer, "connection lost during a send")
                raise error
        self._seq = seq

    def _start_watchdog(self) -> None:
        r, w = os.pipe2(os.O_CLOEXEC | os.O_NONBLOCK)
        self._stop_w = w
        t = threading.Thread(target=self._watch, args=(r,), name=f"tensorwire-tp-watchdog-{self.session}",
                             daemon=True)
        self._watchdog = t
        t.start()

    def _stop_watchdog(self) -> None:
        if self._stop_w >= 0:
            try:
                os.write(self._stop_w, b"x")
            except OSError:
                pass
            if self._watchdog is not None:
                self._watchdog.join(timeout=2.0)
            os.close(self._stop_w)
            self._stop_w = -1
        self._watchdog = None

    def _watch(self, stop_r: int) -> None:
        """Rank 0's watchdog: peers never send after bootstrap, so any readable event is a goodbye or a death."""
        try:
            poller = select.poll()
            by_fd: dict[int, Link] = {}
            for lk in self._links:
                if lk is not None:
                    poller.register(lk.fd, select.POLLIN)
                    by_fd[lk.fd] = lk
            poller.register(stop_r, select.POLLIN)
            while True:
                events = poller.poll()
                if any(fd == stop_r for fd, _ in events):
                    return
                for fd, _ev in events:
                    lk = by_fd.get(fd)
                    if lk is None:
                        continue
                    try:
                        data = lk.sock.recv(64, socket.MSG_DONTWAIT)
                    except OSError:
                        data = b""
                    if data.startswith(_BYE):
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

    def _abort_group(self, dead: int, cause: str) -> None:
        """Rank 0: record the failure and make every peer raise (abort word, abort frame, hang-up)."""
        with self._abort_lock:
            first = self._failed is None
            if first:
                who = f"rank {dead}" if dead > 0 else "a rank"
                self._failed = PeerClosed(f"rank 0: {who} {cause}; the group is aborted", reason=Reason.PEER_CLOSED)
            if not first:
                pass  # the group was already aborted with the first cause; keep that one for the readers
            elif self._ring is not None:
                self._ring.abort(ABORT_PEER_DIED if dead > 0 else ABORT_ROOT_FAILED, max(dead, 0))
            else:
                note = encode_abort(self._seq + 1, f"rank {dead} {cause}" if dead > 0 else cause)
                got = self._send_lock.acquire(timeout=0.2)  # never interleave with a half-sent frame
                try:
                    for lk in self._links:
                        if lk is not None and lk.peer != dead and got:
                            lk.send_nowait(note)
                finally:
                    if got:
                        self._send_lock.release()
            for lk in self._links:
                if lk is not None:
                    lk.shutdown()

    # readers --------------------------------------------------------------------------------------------------------
    def _recv(self, target: torch.Tensor | None, check_against: torch.Tensor | None = None) -> Any:
        seq = self._seq + 1

        def waiter() -> Waiter:
            return self._waiter(f"broadcast (waiting for message {seq} from rank 0)")

        link = self._links[0]
        assert link is not None
        if self._ring is not None:
            ring = self._ring
            ring.wait_published(seq, link, waiter, self.config.spin_s, self.config.wait_poll_s)
            layout, pbase = ring.frame(seq)
            if target is not None and ring.hit and check_against is None and self._tcache == (target.dtype,
                                                                                              target.shape):
                tensors = [target]  # same layout as the last call, already checked against this dtype and shape
            else:
                tensors = self._targets(layout, target, check_against)
                self._tcache = None if target is None else (target.dtype, target.shape)
            mv = ring.mv
            for e, t in zip(layout.entries, tensors):
                if e.nbytes:
                    self._view(t)[:] = mv[pbase + e.offset: pbase + e.offset + e.nbytes]
            ring.ack(seq)
        else:
            spin_until = time.monotonic() + self.config.spin_s
            while link.buffered() < HEADER.size:
                link.fill(waiter, spin_until)
            c = self._ucache
            if c is not None and link.buffered() >= c[0] and bytes(link.peek(c[0])[16:]) == c[1] \
                    and bytes(link.peek(8)) == c[2]:
                # Same header (but the sequence number) and table as the last frame: skip decoding.
                fseq = _SEQ.unpack_from(link.peek(16), 8)[0]
                layout = c[3]
                link.consume(c[0])
            else:
                kind, fseq, n, table_bytes, payload_bytes, structure = decode_header(link.peek(HEADER.size),
                                                                                     self.rank)
                head = bytes(link.peek(HEADER.size))
                link.consume(HEADER.size)
                if kind == KIND_ABORT:
                    msg = link.read_exact(min(payload_bytes, 4096), waiter).decode("utf-8", "replace")
                    raise PeerClosed(f"rank {self.rank}: rank 0 aborted the group: {msg}",
                                     reason=Reason.PEER_CLOSED)
                table = link.read_exact(table_bytes, waiter)
                entries = decode_table(table, n, payload_bytes, self.rank)
                layout = Layout(kind, fseq, structure, entries, table_bytes, payload_bytes)
                self._ucache = (HEADER.size + table_bytes, head[16:] + table, head[:8], layout)
            if fseq != seq:
                raise FrameMismatch(f"rank {self.rank}: received message {fseq}, expected {seq}: the ranks are out "
                                    f"of step")
            if target is not None and layout is self._tlayout and check_against is None \
                    and self._tcache == (target.dtype, target.shape):
                tensors = [target]  # same layout object as the last call, already checked against this target
            else:
                tensors = self._targets(layout, target, check_against)
                self._tcache = None if target is None else (target.dtype, target.shape)
                self._tlayout = layout
            pos = 0
            for e, t in zip(layout.entries, tensors):
                if e.offset != pos:
                    link.skip(e.offset - pos, waiter)
                if e.nbytes:
                    link.recv_into_exact(self._view(t), waiter)
                pos = e.offset + e.nbytes
            if layout.payload_bytes != pos:
                link.skip(layout.payload_bytes - pos, waiter)
        self._seq = seq
        return assemble(layout.structure, layout.entries, tensors)

    def _view(self, t: torch.Tensor) -> memoryview:
        """byte_view with a one-entry cache keyed by address and size (the broadcast_ target of a hot loop)."""
        key = (t.data_ptr(), t.nbytes)
        c = self._vcache
        if c is not None and c[0] == key:
            return c[1]
        v = byte_view(t)
        self._vcache = (key, v)
        return v

    def _targets(self, layout: Layout, target: torch.Tensor | None,
                 check_against: torch.Tensor | None) -> list[torch.Tensor]:
        if target is None:
            return allocate(layout)
        check_inplace(layout, check_against if check_against is not None else target, self.rank)
        return [target]
