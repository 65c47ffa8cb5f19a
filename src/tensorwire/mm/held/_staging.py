"""StagingArea: read a held item's receipt now, keep the tensors under a key until dropped (reader side, no gRPC).

The counterpart of :class:`~tensorwire.mm.held._store.HeldStore` on the reading side. A coordinator (for vLLM: the
LLM instance's scheduler) looks an item up, then asks one staging area per consumer process (for vLLM: one per
tensor-parallel rank) to read it; each answers only when the tensors are local, so the coordinator knows that
every consumer has them before it tells anyone the item exists. Whoever then uses the tensors calls ``get``
(any number of times) and the coordinator ``drop``s the key when nobody needs it any more.

Receipts are untrusted: ``stage`` parses every descriptor (``Descriptor.from_bytes`` validates it), requires one
known role per manifest tensor, checks the optional expected shape and dtype of the first tensor before any
byte is read, and reads with the area's ``TensorReader`` (which checks the results against the manifest).

Ownership: staged tensors are owned (they outlive the remote lease and the reader) and complete when ``stage``
returns (on CUDA the calling thread's stream is synchronized first). ``get`` returns them, not copies; a
caller must not modify them in place if others may ``get`` them too. Thread safety: every method may be called
from many threads; two ``stage`` calls for one key race and the later replaces the earlier.
Errors: ``InvalidPayload`` / ``InvalidDescriptor`` (bad receipt), ``ProtocolError(RESULT_MISMATCH)`` (not what
was expected), the reader's ``ReadError`` family, ``ClosedError``.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from tensorwire.errors import ClosedError, InvalidPayload, ProtocolError, ReadError, Reason
from tensorwire.mm._proto import encoder_pb2 as pb
from tensorwire.mm.wire._codec import DTYPE_TO_WIRE, WIRE_TO_DTYPE, decode_tensor
from tensorwire.rdma import Descriptor, Reader, TensorReader

log = logging.getLogger(__name__)

ReaderFactory = Callable[[], Reader]


@dataclass(frozen=True)
class Expect:
    """What the first tensor of an item must be (None: not checked)."""

    shape: tuple[int, ...] | None = None
    dtype: torch.dtype | None = None

    def check(self, shape: Sequence[int], dtype: torch.dtype, what: str) -> None:
        if self.shape is not None and tuple(shape) != tuple(self.shape):
            raise ProtocolError(
                f"{what}: shape {list(shape)} but {list(self.shape)} was expected", reason=Reason.RESULT_MISMATCH
            )
        if self.dtype is not None and dtype != self.dtype:
            raise ProtocolError(f"{what}: dtype {dtype} but {self.dtype} was expected", reason=Reason.RESULT_MISMATCH)

    def to_pb(self, req: object) -> None:
        if self.shape is not None:
            req.expect_shape[:] = list(self.shape)  # type: ignore[attr-defined]
        if self.dtype is not None:
            req.expect_dtype = DTYPE_TO_WIRE[self.dtype]  # type: ignore[attr-defined]

    @classmethod
    def from_pb(cls, req: object) -> Expect:
        shape = tuple(int(d) for d in req.expect_shape) or None  # type: ignore[attr-defined]
        wire = int(req.expect_dtype)  # type: ignore[attr-defined]
        if wire and wire not in WIRE_TO_DTYPE:
            raise InvalidPayload(f"expect_dtype enum {wire} is not in the allow-list", reason=Reason.UNSUPPORTED_DTYPE)
        return cls(shape, WIRE_TO_DTYPE.get(wire))


@dataclass(frozen=True)
class StagingStats:
    staged_items: int
    staged_bytes: int
    stages: int
    stage_failures: int
    rdma_stages: int
    inline_stages: int
    drops: int
    expired: int
    put_items: int = 0  # kept by ``put``: got another way (a mapped host segment), not read by the area


class StagingArea:
    """Reads receipts into tensors on ``device`` and keeps them under keys.

    The ``TensorReader`` comes from ``reader_factory`` on first use (building a NIXL agent costs a fraction of a
    second; ``warm_up()`` does it ahead). ``ttl_s``: items staged longer ago than this are dropped (None: never;
    a coordinator that drops what it staged does not need it). The area owns its reader and closes it.
    """

    def __init__(
        self,
        reader_factory: ReaderFactory | None,
        *,
        device: str = "cpu",
        ttl_s: float | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._factory = reader_factory
        self._device = torch.device(device)
        self._ttl_s = ttl_s
        self._clock = clock
        self._lock = threading.Lock()
        self._reader_lock = threading.Lock()
        self._reader: Reader | None = None
        self._reader_error: BaseException | None = None
        self._closed = False
        self._items: dict[str, tuple[tuple[torch.Tensor, ...], int, float, bool]] = {}  # tensors, bytes, when, put
        self._n = dict.fromkeys(
            ("stages", "stage_failures", "rdma_stages", "inline_stages", "drops", "expired", "put_items"), 0
        )

    @property
    def device(self) -> torch.device:
        return self._device

    def warm_up(self) -> bool:
        """Builds the reader now; False if it cannot be built (RDMA receipts then fail with its error)."""
        try:
            self._get_reader()
            return True
        except Exception:
            return False

    def stage(
        self,
        key: str,
        receipt: pb.EncodeResponse,
        *,
        timeout_ms: int,
        expect: Expect | None = None,
        into: Callable[[int], torch.Tensor] | None = None,
    ) -> int:
        """Reads the receipt's tensors and keeps them under ``key``; returns their bytes. Raises on any failure
        (then nothing is kept under ``key``; a previous item under it stays).

        ``into`` (host areas only): called once with the bytes the item needs, it returns the caller's contiguous
        uint8 host buffer of at least that size (shared memory, say); the tensors land there (RDMA: READ straight
        into it; inline: copied) and are views of it. ``into`` on a device area, or with a reader that is not a
        ``TensorReader``, raises InvalidPayload (reason INVALID_REQUEST), as the reader does for a bad ``into``."""
        if into is not None and self._device.type != "cpu":
            raise InvalidPayload("into: host staging areas only", reason=Reason.INVALID_REQUEST)
        if not isinstance(key, str) or not key:
            raise InvalidPayload("staging key must be a non-empty string", reason=Reason.INVALID_REQUEST)
        if self._closed:
            raise ClosedError("StagingArea is closed")
        expect = expect or Expect()
        try:
            if receipt.rdma_slots:
                tensors = self._read_rdma(key, receipt, timeout_ms, expect, into)
                kind = "rdma_stages"
            else:
                tensors = self._decode_inline(key, receipt, expect)
                if into is not None:
                    tensors = _copy_into(tensors, into)
                kind = "inline_stages"
            if self._device.type == "cuda":
                # The reader's copy-outs are queued on this thread's stream; whoever uses the tensors next may
                # run on another stream (another thread's, a model runner's): "staged" means complete.
                torch.cuda.current_stream(self._device).synchronize()
        except Exception:
            with self._lock:
                self._n["stage_failures"] += 1
            raise
        return self._keep(key, tensors, ("stages", kind), put=False)

    def put(self, key: str, tensors: Sequence[torch.Tensor]) -> int:
        """Keeps ``tensors``, which the caller got another way (a host segment it mapped), under ``key`` as ``stage``
        would (a previous item under it is replaced); returns their bytes. They must be on this area's device."""
        if not isinstance(key, str) or not key:
            raise InvalidPayload("staging key must be a non-empty string", reason=Reason.INVALID_REQUEST)
        if any(t.device != self._device for t in tensors):
            raise InvalidPayload(f"put: tensors must be on {self._device}", reason=Reason.INVALID_REQUEST)
        return self._keep(key, tensors, ("put_items",), put=True)

    def was_put(self, key: str) -> bool:
        """Whether the item under ``key`` came through ``put`` (False: staged, or no such item)."""
        with self._lock:
            entry = self._items.get(key)
            return entry is not None and entry[3]

    def _keep(self, key: str, tensors: Sequence[torch.Tensor], counters: tuple[str, ...], *, put: bool) -> int:
        nbytes = sum(t.numel() * t.element_size() for t in tensors)
        with self._lock:
            if self._closed:
                raise ClosedError("StagingArea is closed")
            gone = self._sweep_locked()
            gone.append(self._items.pop(key, None))  # a previous item under the key
            self._items[key] = (tuple(tensors), nbytes, self._clock(), put)
            for c in counters:
                self._n[c] += 1
        gone.clear()  # outside the lock, as in drop
        return nbytes

    def get(self, key: str) -> tuple[torch.Tensor, ...] | None:
        with self._lock:
            entry = self._items.get(key)
            return entry[0] if entry is not None else None

    def drop(self, keys: Sequence[str]) -> int:
        with self._lock:
            gone = [e for e in (self._items.pop(k, None) for k in keys) if e is not None]
            self._n["drops"] += len(gone)
        n = len(gone)
        # Released here, outside the lock: the last reference to a mapped item unmaps it (~0.6 ms per used 10 MB,
        # its pages freed), which would hold up a stage or put of another item waiting for the lock meanwhile.
        gone.clear()
        return n

    def keys(self) -> list[str]:
        with self._lock:
            return list(self._items)

    def stats(self) -> StagingStats:
        with self._lock:
            gone = self._sweep_locked()
            stats = StagingStats(
                staged_items=len(self._items), staged_bytes=sum(e[1] for e in self._items.values()), **self._n
            )
        gone.clear()
        return stats

    def close(self) -> None:
        """Drops everything and closes the reader. Idempotent."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            self._items.clear()
        with self._reader_lock:
            reader, self._reader = self._reader, None
        if reader is not None:
            reader.close()

    def __enter__(self) -> StagingArea:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- internals --

    def _get_reader(self) -> Reader:
        with self._reader_lock:
            if self._closed:
                raise ClosedError("StagingArea is closed")
            if self._reader is None:
                if self._factory is None:
                    raise ReadError(
                        "this staging area has no RDMA reader; only inline receipts can be staged",
                        reason=Reason.PROVIDER_UNAVAILABLE,
                    )
                if self._reader_error is not None:
                    raise ReadError(
                        f"the RDMA reader could not be built: {self._reader_error}",
                        reason=getattr(self._reader_error, "reason", Reason.PROVIDER_UNAVAILABLE),
                    )
                try:
                    self._reader = self._factory()
                except Exception as exc:
                    # Not retried: the provider's failures at construction are permanent (no NIXL, bad config).
                    self._reader_error = exc
                    log.warning("staging area: RDMA reader unavailable (%s); RDMA receipts will fail", exc)
                    raise
            return self._reader

    def _read_rdma(
        self,
        key: str,
        receipt: pb.EncodeResponse,
        timeout_ms: int,
        expect: Expect,
        into: Callable[[int], torch.Tensor] | None = None,
    ) -> list[torch.Tensor]:
        descs = []
        n_tensors = 0
        for i, slot in enumerate(receipt.rdma_slots):
            d = Descriptor.from_bytes(bytes(slot.descriptor))  # validates (bounds, dtypes, overlap)
            roles = list(slot.roles)
            if len(roles) != len(d.manifest) or any(r not in (pb.EMBEDDING, pb.EXTRA_INPUT) for r in roles):
                raise ProtocolError(
                    f"item {key[:64]!r} slot {i}: roles {roles} do not match its {len(d.manifest)} tensor(s)",
                    reason=Reason.PROTOCOL_ERROR,
                )
            if i == 0:
                first = d.manifest[0]
                expect.check(first.shape, first.dtype, f"item {key[:64]!r}")
            n_tensors += len(d.manifest)
            descs.append(d)
        reader = self._get_reader()
        if into is None:
            tensors = reader.read(descs, timeout_ms=timeout_ms)
        else:
            if not isinstance(reader, TensorReader):
                raise InvalidPayload("into: needs a TensorReader", reason=Reason.INVALID_REQUEST)
            offsets = _packed([d.payload_bytes for d in descs])
            buf = into(offsets[-1])
            tensors = reader.read(
                descs,
                timeout_ms=timeout_ms,
                into=[buf[o : o + d.payload_bytes] for o, d in zip(offsets, descs, strict=False)],
            )
        if len(tensors) != n_tensors:
            raise ProtocolError(
                f"item {key[:64]!r}: read {len(tensors)} tensor(s), the receipt names {n_tensors}",
                reason=Reason.RESULT_MISMATCH,
            )
        return tensors

    def _decode_inline(self, key: str, receipt: pb.EncodeResponse, expect: Expect) -> list[torch.Tensor]:
        if not receipt.HasField("embedding"):
            raise InvalidPayload(
                f"item {key[:64]!r}: the receipt has neither RDMA slots nor an inline tensor",
                reason=Reason.INVALID_PAYLOAD,
            )
        first = decode_tensor(receipt.embedding, f"item {key[:64]!r}")
        expect.check(first.shape, first.dtype, f"item {key[:64]!r}")
        tensors = [first] + [decode_tensor(t, f"item {key[:64]!r} extra") for t in receipt.extra_inputs]
        if self._device.type != "cpu":
            tensors = [t.to(self._device) for t in tensors]
        return tensors

    def _sweep_locked(self) -> list[Any]:
        """Forgets items older than the TTL; returns them, for the caller to let go of after the lock."""
        if self._ttl_s is None:
            return []
        horizon = self._clock() - self._ttl_s
        old = [k for k, e in self._items.items() if e[2] <= horizon]
        gone = [self._items.pop(k) for k in old]
        if old:
            self._n["expired"] += len(old)
            log.warning("staging area dropped %d item(s) staged more than %.0f s ago", len(old), self._ttl_s)
        return gone


_ALIGN = 64


def _packed(sizes: Sequence[int]) -> list[int]:
    """Offsets of ``sizes`` placed back to back at ``_ALIGN``, then the total."""
    out, at = [], 0
    for n in sizes:
        out.append(at)
        at += -(-n // _ALIGN) * _ALIGN
    out.append(at)
    return out


def _copy_into(tensors: list[torch.Tensor], into: Callable[[int], torch.Tensor]) -> list[torch.Tensor]:
    sizes = [t.numel() * t.element_size() for t in tensors]
    offsets = _packed(sizes)
    buf = into(offsets[-1])
    out = []
    for t, o, n in zip(tensors, offsets, sizes, strict=False):
        view = buf[o : o + n].view(t.dtype).view(t.shape)
        view.copy_(t)
        out.append(view)
    return out


__all__ = ["StagingArea", "StagingStats", "Expect", "ReaderFactory"]
