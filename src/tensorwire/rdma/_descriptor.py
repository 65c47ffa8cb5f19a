"""``Descriptor`` (one exported slot) and ``TensorMeta`` (one manifest entry), their wire form and validation.

Descriptors cross process and trust boundaries, so ``Descriptor.from_bytes`` and ``TensorReader.read`` run
:meth:`Descriptor.validate` before any memory is touched. Rules, each raising ``InvalidDescriptor`` with a reason:

- presence: version 1, owner agent name, host and port 1..65535, a metadata token of at most 64 bytes (empty
  from owners that predate it), a non-empty lease id (<= 256 chars), a known mem
  type, non-zero slot and generation addresses (the generation word 8-byte aligned), a non-empty manifest
  (<= ``MAX_MANIFEST_ENTRIES``) -> DESCRIPTOR_MALFORMED / EMPTY_LEASE_ID / EMPTY_MANIFEST;
- sizes: ``0 < payload_bytes <= max_slot_bytes`` -> OUT_OF_BOUNDS / SLOT_TOO_LARGE; slot_addr + payload_bytes
  must not wrap the 64-bit address space;
- binding: when ``binding`` is set (0 only from owners that predate it), ``generation`` equals
  :func:`bound_generation` of it, the slot address and the payload size (DESCRIPTOR_MALFORMED): a descriptor
  edited to name other memory is refused before anything is read; the owner's ``pid`` is a uint32 and its
  ``host_id`` at most 64 bytes;
- per tensor: known dtype, and field 5 and the legacy field 2 agree when both are set (UNSUPPORTED_DTYPE);
  <= ``MAX_DIMS`` dims, each >= 0 (NEGATIVE_DIM); prod(shape) x
  itemsize computed in Python integers and capped at 2**63 (SIZE_OVERFLOW); nbytes equal to it
  (NBYTES_MISMATCH); offset a multiple of ``slot_align`` (MISALIGNED_OFFSET); offset + nbytes <= payload_bytes
  (OUT_OF_BOUNDS);
- no two non-empty tensors overlap (OVERLAPPING_TENSORS).
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import itertools
import math
import struct
import threading
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
from google.protobuf.message import DecodeError

from tensorwire.errors import InvalidDescriptor, Reason
from tensorwire.rdma import _dtypes
from tensorwire.rdma._config import RdmaConfig
from tensorwire.rdma._proto import descriptor_pb2 as pb

WIRE_VERSION = 1
MAX_DESCRIPTOR_BYTES = 1 << 20
MAX_MANIFEST_ENTRIES = 4096
MAX_DIMS = 16
MAX_LEASE_ID_CHARS = 256
MAX_NAME_CHARS = 256
MAX_TOKEN_BYTES = 64
_INT63 = 1 << 63
_UINT64 = 1 << 64

MEM_TYPES = ("DRAM", "VRAM")
_MEM_TO_WIRE = {"DRAM": pb.MEM_DRAM, "VRAM": pb.MEM_VRAM}
_MEM_FROM_WIRE = {v: k for k, v in _MEM_TO_WIRE.items()}


@dataclass(frozen=True)
class TensorMeta:
    """One manifest entry: a tensor of ``shape``/``dtype`` stored at ``offset`` in the slot payload."""

    shape: tuple[int, ...]
    dtype: torch.dtype
    offset: int
    nbytes: int

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


@dataclass(frozen=True)
class Owner:
    """Who owns a slot: the data-plane agent name and the endpoint serving its metadata.

    ``metadata_token`` is what that endpoint demands before it hands out the owner's agent metadata (random per
    owner process; empty from owners that predate it). It travels only inside descriptors, so only a peer that got
    one over the control plane can fetch the metadata; it is left out of ``repr`` so that logs do not carry it.
    """

    agent_name: str
    host: str
    port: int
    registration_epoch: int = 0
    metadata_token: bytes = field(default=b"", repr=False)
    pid: int = 0
    host_id: bytes = field(default=b"", repr=False)

    @property
    def endpoint(self) -> str:
        return f"[{self.host}]:{self.port}" if ":" in self.host else f"{self.host}:{self.port}"


@dataclass(frozen=True)
class Descriptor:
    """Serializable address of one exported slot plus its manifest. Immutable; build with the exporter.

    ``lease_id`` is globally unique across processes and hosts; return it to the owner with
    ``TensorExporter.release``. ``generation`` is the slot generation at export and ``generation_addr`` the owner
    address of the word that holds the current one (see ``tensorwire.rdma._pool`` for the protocol).
    """

    owner: Owner
    mem_type: str
    device_id: int
    slot_addr: int
    payload_bytes: int
    lease_id: str
    generation: int
    generation_addr: int
    manifest: tuple[TensorMeta, ...] = field(default_factory=tuple)
    binding: int = 0

    @property
    def nbytes(self) -> int:
        """Sum of the manifest's tensor sizes (payload_bytes also counts alignment padding)."""
        return sum(m.nbytes for m in self.manifest)

    def with_owner(self, owner: Owner) -> Descriptor:
        """This descriptor with ``owner`` instead (a reader filling in what it learned of the owner elsewhere). A
        validated descriptor stays validated once ``owner`` passes the owner rules, and its ``to_bytes`` is then
        remembered by ``from_bytes``: a reader that rewrites an untrusted descriptor and hands the bytes on parses
        them once."""
        new = dataclasses.replace(self, owner=owner)
        limits = self.__dict__.get("_valid_for")
        if limits is not None:
            try:
                _validate_owner(owner)
            except (TypeError, ValueError, AttributeError, OverflowError) as exc:
                raise InvalidDescriptor(f"owner fields have wrong types: {exc}") from exc
            object.__setattr__(new, "_valid_for", limits)
        return new

    def to_bytes(self) -> bytes:
        data = self._serialize()
        if self.__dict__.get("_valid_for") == _DEFAULT_LIMITS and len(data) <= _PARSED_MAX_BYTES:
            _remember(data, self)
        return data

    def _serialize(self) -> bytes:
        # A serialized message is the concatenation of its serialized fields, so the owner's field (one per
        # exporter and registration epoch) is serialized once and prepended: ~30% of this call on a slow host.
        msg = pb.DescriptorPB(
            version=WIRE_VERSION,
            mem_type=_MEM_TO_WIRE.get(self.mem_type, pb.MEM_UNSPECIFIED),
            device_id=self.device_id,
            slot_addr=self.slot_addr,
            payload_bytes=self.payload_bytes,
            lease_id=self.lease_id,
            generation=self.generation,
            generation_addr=self.generation_addr,
            binding=self.binding,
        )
        add = msg.manifest.add
        for m in self.manifest:
            add(
                shape=m.shape,
                dtype=_dtypes.to_wire(m.dtype),
                legacy_dtype=_dtypes.to_legacy(m.dtype),
                offset=m.offset,
                nbytes=m.nbytes,
            )
        return _owner_field(self.owner) + msg.SerializeToString()

    @classmethod
    def from_bytes(
        cls,
        data: bytes,
        *,
        max_slot_bytes: int = RdmaConfig.max_slot_bytes,
        slot_align: int = RdmaConfig.slot_align,
    ) -> Descriptor:
        """Parse and validate untrusted bytes; raises ``InvalidDescriptor`` (never another exception). The last
        ``_PARSED_KEPT`` results of up to ``_PARSED_MAX_BYTES`` with the default limits are remembered by their
        bytes (an equal input returns the same immutable descriptor)."""
        if not isinstance(data, (bytes, bytearray, memoryview)):
            raise InvalidDescriptor(f"descriptor must be bytes, got {type(data).__name__}")
        if len(data) > MAX_DESCRIPTOR_BYTES:
            raise InvalidDescriptor(f"descriptor is {len(data)} bytes, over the {MAX_DESCRIPTOR_BYTES} limit")
        default = (max_slot_bytes, slot_align) == _DEFAULT_LIMITS and len(data) <= _PARSED_MAX_BYTES
        if default:
            data = data if type(data) is bytes else bytes(data)
            known = _parsed.get(data)
            if known is not None:
                return known
        msg = pb.DescriptorPB()
        try:
            msg.ParseFromString(data if type(data) is bytes else bytes(data))
        except (DecodeError, ValueError, RuntimeError) as exc:
            raise InvalidDescriptor(f"descriptor bytes do not parse: {exc}") from exc
        if msg.version != WIRE_VERSION:
            raise InvalidDescriptor(f"descriptor version {msg.version} is not {WIRE_VERSION}")
        # Each attribute access on a parsed message builds a wrapper object: every field is read once.
        wire_manifest = msg.manifest
        if len(wire_manifest) > MAX_MANIFEST_ENTRIES:
            raise InvalidDescriptor(f"manifest has {len(wire_manifest)} entries, over {MAX_MANIFEST_ENTRIES}")
        entries = []
        for i, e in enumerate(wire_manifest):
            dtype = _manifest_dtype(i, e)
            shape = e.shape
            if len(shape) > MAX_DIMS:
                raise InvalidDescriptor(f"manifest[{i}]: {len(shape)} dims, over {MAX_DIMS}")
            # Repeated integer fields yield Python ints: tuple() is the conversion (_validate checks the types).
            entries.append(TensorMeta(shape=tuple(shape), dtype=dtype, offset=e.offset, nbytes=e.nbytes))
        mem_type = _MEM_FROM_WIRE.get(msg.mem_type)
        if mem_type is None:
            raise InvalidDescriptor(f"unknown mem_type value {msg.mem_type}")
        o = msg.owner
        desc = cls(
            owner=Owner(o.agent_name, o.host, o.port, o.registration_epoch, o.metadata_token, o.pid, o.host_id),
            mem_type=mem_type,
            device_id=msg.device_id,
            slot_addr=msg.slot_addr,
            payload_bytes=msg.payload_bytes,
            lease_id=msg.lease_id,
            generation=msg.generation,
            generation_addr=msg.generation_addr,
            manifest=tuple(entries),
            binding=msg.binding,
        )
        desc.validate(max_slot_bytes=max_slot_bytes, slot_align=slot_align)
        if default:
            _remember(data, desc)
        return desc

    def validate(
        self, *, max_slot_bytes: int = RdmaConfig.max_slot_bytes, slot_align: int = RdmaConfig.slot_align
    ) -> None:
        """Check every rule of the module docstring; raises ``InvalidDescriptor`` with a reason.

        The instance is immutable, so a pass is remembered per (max_slot_bytes, slot_align): a descriptor parsed by
        the transport and then read is checked once (this costs ~50 us of Python on a slow host)."""
        limits = (max_slot_bytes, slot_align)
        if self.__dict__.get("_valid_for") == limits:
            return
        try:
            _validate(self, max_slot_bytes, slot_align)
        except InvalidDescriptor:
            raise
        except (TypeError, ValueError, AttributeError, OverflowError) as exc:
            # Hand-built descriptors with wrong field types end up here rather than as a crash later.
            raise InvalidDescriptor(f"descriptor fields have wrong types: {exc}") from exc
        object.__setattr__(self, "_valid_for", limits)


@functools.lru_cache(maxsize=64)
def _owner_field(o: Owner) -> bytes:
    """``o`` as the serialized ``owner`` field of a DescriptorPB."""
    return pb.DescriptorPB(
        owner=pb.OwnerPB(
            agent_name=o.agent_name,
            host=o.host,
            port=o.port,
            registration_epoch=o.registration_epoch,
            metadata_token=o.metadata_token,
            pid=o.pid,
            host_id=o.host_id,
        )
    ).SerializeToString()


def bound_generation(binding: int, slot_addr: int, payload_bytes: int) -> int:
    """The generation of a slot exported at ``slot_addr`` with ``payload_bytes`` under ``binding`` (a random
    64-bit number): 63 bits of BLAKE2b over the three, never 0 (``_pool``'s module docstring, step 5)."""
    h = hashlib.blake2b(struct.pack("<QQQ", binding, slot_addr, payload_bytes), digest_size=8, person=b"tw-gen")
    return (int.from_bytes(h.digest(), "little") >> 1) or 1


_DEFAULT_LIMITS = (RdmaConfig.max_slot_bytes, RdmaConfig.slot_align)
_PARSED_KEPT = 256
_PARSED_MAX_BYTES = 4096  # a one-tensor item's descriptor is ~300 bytes; large manifests are parsed every time
_parsed: dict[bytes, Descriptor] = {}
_parsed_lock = threading.Lock()


def _remember(data: bytes, desc: Descriptor) -> None:
    with _parsed_lock:
        if len(_parsed) >= _PARSED_KEPT:
            del _parsed[next(iter(_parsed))]  # the oldest (dicts keep insertion order)
        _parsed[data] = desc


def _validate(d: Descriptor, max_slot_bytes: int, slot_align: int) -> None:
    _validate_owner(d.owner)
    _validate_body(d, max_slot_bytes, slot_align)


def _validate_owner(o: Owner) -> None:
    if not isinstance(o, Owner) or not o.agent_name or len(o.agent_name) > MAX_NAME_CHARS:
        raise InvalidDescriptor("owner agent name is empty or too long")
    if not o.host or len(o.host) > MAX_NAME_CHARS:
        raise InvalidDescriptor("owner host is empty or too long")
    if not isinstance(o.port, int) or not 1 <= o.port <= 65535:
        raise InvalidDescriptor(f"owner port {o.port!r} is not in 1..65535")
    if not _u64(o.registration_epoch):
        raise InvalidDescriptor("registration epoch is not a uint64")
    if not isinstance(o.metadata_token, bytes) or len(o.metadata_token) > MAX_TOKEN_BYTES:
        raise InvalidDescriptor(f"metadata token is not bytes of at most {MAX_TOKEN_BYTES}")
    if not isinstance(o.pid, int) or isinstance(o.pid, bool) or not 0 <= o.pid < 1 << 32:
        raise InvalidDescriptor(f"owner pid {o.pid!r} is not a uint32")
    if not isinstance(o.host_id, bytes) or len(o.host_id) > MAX_TOKEN_BYTES:
        raise InvalidDescriptor(f"owner host id is not bytes of at most {MAX_TOKEN_BYTES}")


def _validate_body(d: Descriptor, max_slot_bytes: int, slot_align: int) -> None:
    if not isinstance(d.lease_id, str) or not d.lease_id:
        raise InvalidDescriptor("lease id is empty", reason=Reason.EMPTY_LEASE_ID)
    if len(d.lease_id) > MAX_LEASE_ID_CHARS:
        raise InvalidDescriptor(f"lease id is {len(d.lease_id)} chars, over {MAX_LEASE_ID_CHARS}")
    if d.mem_type not in MEM_TYPES:
        raise InvalidDescriptor(f"mem_type {d.mem_type!r} is not one of {MEM_TYPES}")
    if not isinstance(d.device_id, int) or not 0 <= d.device_id < 1 << 16:
        raise InvalidDescriptor(f"device id {d.device_id!r} is out of range")
    for name in ("slot_addr", "generation_addr", "generation", "payload_bytes"):
        if not _u64(getattr(d, name)):
            raise InvalidDescriptor(f"{name} is not a uint64")
    if not _u64(d.binding):
        raise InvalidDescriptor("binding is not a uint64")
    if d.slot_addr == 0:
        raise InvalidDescriptor("slot address is 0")
    if d.generation_addr == 0 or d.generation_addr % 8:
        raise InvalidDescriptor(f"generation address {d.generation_addr:#x} is 0 or not 8-byte aligned")
    if d.payload_bytes == 0:
        raise InvalidDescriptor("payload_bytes is 0", reason=Reason.OUT_OF_BOUNDS)
    if d.payload_bytes > max_slot_bytes:
        raise InvalidDescriptor(
            f"payload_bytes {d.payload_bytes} exceeds max_slot_bytes {max_slot_bytes}", reason=Reason.SLOT_TOO_LARGE
        )
    if d.slot_addr + d.payload_bytes >= _UINT64:
        raise InvalidDescriptor("slot address + payload_bytes wraps around", reason=Reason.OUT_OF_BOUNDS)
    if d.binding and d.generation != bound_generation(d.binding, d.slot_addr, d.payload_bytes):
        raise InvalidDescriptor("the generation does not match its binding: the slot address or size was changed")
    if not d.manifest:
        raise InvalidDescriptor("manifest is empty", reason=Reason.EMPTY_MANIFEST)
    if len(d.manifest) > MAX_MANIFEST_ENTRIES:
        raise InvalidDescriptor(f"manifest has {len(d.manifest)} entries, over {MAX_MANIFEST_ENTRIES}")
    spans: list[tuple[int, int, int]] = []
    for i, m in enumerate(d.manifest):
        if not isinstance(m.dtype, torch.dtype) or not _dtypes.is_supported(m.dtype):
            raise InvalidDescriptor(f"manifest[{i}]: unsupported dtype {m.dtype!r}", reason=Reason.UNSUPPORTED_DTYPE)
        if len(m.shape) > MAX_DIMS:
            raise InvalidDescriptor(f"manifest[{i}]: {len(m.shape)} dims, over {MAX_DIMS}")
        nbytes = _dtypes.itemsize(m.dtype)
        for dim in m.shape:
            if not isinstance(dim, int) or isinstance(dim, bool):
                raise InvalidDescriptor(f"manifest[{i}]: dim {dim!r} is not an int")
            if dim < 0:
                raise InvalidDescriptor(f"manifest[{i}]: negative dim in {m.shape}", reason=Reason.NEGATIVE_DIM)
        for dim in m.shape:
            nbytes *= dim
            if nbytes >= _INT63:
                raise InvalidDescriptor(
                    f"manifest[{i}]: shape {m.shape} overflows int64 bytes", reason=Reason.SIZE_OVERFLOW
                )
        if not _u64(m.nbytes) or not _u64(m.offset):
            raise InvalidDescriptor(f"manifest[{i}]: offset/nbytes are not uint64")
        if m.nbytes != nbytes:
            raise InvalidDescriptor(
                f"manifest[{i}]: nbytes {m.nbytes} != prod{m.shape} x {_dtypes.itemsize(m.dtype)} = {nbytes}",
                reason=Reason.NBYTES_MISMATCH,
            )
        if m.offset % slot_align:
            raise InvalidDescriptor(
                f"manifest[{i}]: offset {m.offset} is not a multiple of {slot_align}", reason=Reason.MISALIGNED_OFFSET
            )
        if not (m.offset <= d.payload_bytes and m.nbytes <= d.payload_bytes - m.offset):
            raise InvalidDescriptor(
                f"manifest[{i}]: [{m.offset}, +{m.nbytes}) exceeds payload_bytes {d.payload_bytes}",
                reason=Reason.OUT_OF_BOUNDS,
            )
        if m.nbytes:
            spans.append((m.offset, m.offset + m.nbytes, i))
    spans.sort()
    for (_, end_a, ia), (start_b, _, ib) in itertools.pairwise(spans):
        if start_b < end_a:
            raise InvalidDescriptor(f"manifest[{ia}] and manifest[{ib}] overlap", reason=Reason.OVERLAPPING_TENSORS)


def _u64(v: object) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and 0 <= v < _UINT64


def views(
    buf: torch.Tensor, manifest: Sequence[TensorMeta], typed: dict[torch.dtype, torch.Tensor] | None = None
) -> list[torch.Tensor]:
    """The manifest's tensors as views of ``buf`` (a contiguous 1-D uint8 tensor over a slot's payload).

    One ``as_strided`` per tensor on ``buf`` reinterpreted as its dtype, instead of a slice and two views: these
    run once per export and per read, where every torch call costs several microseconds on a slow host.
    ``typed`` caches the reinterpretations for a buffer that lives on (a pooled slot). Offsets that are not a
    multiple of the item size (never produced by ``layout``) take the slice path.
    """
    out = []
    for m in manifest:
        size = m.dtype.itemsize
        base = typed.get(m.dtype) if typed is not None else None
        if base is None and not (buf.numel() % size or buf.storage_offset() % size or m.offset % size):
            base = buf.view(m.dtype)
            if typed is not None:
                typed[m.dtype] = base
        if base is None or m.offset % size:
            out.append(buf[m.offset : m.offset + m.nbytes].view(m.dtype).view(m.shape))
        else:
            out.append(base.as_strided(m.shape, _strides(m.shape), base.storage_offset() + m.offset // size))
    return out


def _strides(shape: tuple[int, ...]) -> tuple[int, ...]:
    strides, step = [], 1
    for dim in reversed(shape):
        strides.append(step)
        step *= max(dim, 1)
    return tuple(reversed(strides))


def _manifest_dtype(i: int, e: pb.TensorMetaPB) -> torch.dtype:
    """The dtype of manifest entry ``i``: field 5 (the one numbering) when set, and then field 2 (legacy numbering,
    still written for old readers) must agree when it is set too; field 2 alone from an owner that predates 5."""
    if e.dtype:
        dtype = _dtypes.from_wire(e.dtype)
        if dtype is None:
            raise InvalidDescriptor(f"manifest[{i}]: unknown dtype value {e.dtype}", reason=Reason.UNSUPPORTED_DTYPE)
        if e.legacy_dtype and _dtypes.from_legacy(e.legacy_dtype) is not dtype:
            raise InvalidDescriptor(
                f"manifest[{i}]: dtype {e.dtype} ({_dtypes.dtype_name(dtype)}) and legacy dtype "
                f"{e.legacy_dtype} disagree",
                reason=Reason.UNSUPPORTED_DTYPE,
            )
        return dtype
    legacy = _dtypes.from_legacy(e.legacy_dtype)
    if legacy is None:
        raise InvalidDescriptor(
            f"manifest[{i}]: unknown dtype value {e.legacy_dtype} (legacy field; field 5 unset)",
            reason=Reason.UNSUPPORTED_DTYPE,
        )
    return legacy


def layout(
    shapes_and_dtypes: Sequence[tuple[Sequence[int], torch.dtype]], slot_align: int
) -> tuple[list[TensorMeta], int]:
    """Manifest entries packed at ``slot_align`` offsets, in order, and the payload size (>= 1 byte)."""
    entries: list[TensorMeta] = []
    offset = 0
    for shape, dtype in shapes_and_dtypes:
        shape_t = tuple(int(d) for d in shape)
        nbytes = math.prod(shape_t) * _dtypes.itemsize(dtype)
        entries.append(TensorMeta(shape=shape_t, dtype=dtype, offset=offset, nbytes=nbytes))
        offset += -(-nbytes // slot_align) * slot_align
    last_end = max((m.offset + m.nbytes for m in entries), default=0)
    return entries, max(last_end, 1)
