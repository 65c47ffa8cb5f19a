"""Self-describing binary frames for one broadcast: header, tensor table, raw tensor bytes. No pickle.

Frame (little-endian)::

    header  40 B   magic "TWB1" | version u16 | kind u16 | seq u64 | n_tensors u32 | table_bytes u32 |
                   payload_bytes u64 | structure u8 | 7 reserved bytes
    table          per tensor: dtype u8 | ndim u8 | key_len u16 | offset u64 | nbytes u64 | ndim x i64 shape |
                   key_len bytes of UTF-8 key (dict keys; empty otherwise)
    payload        payload_bytes; tensor i occupies [offset_i, offset_i + nbytes_i)

``structure`` says what the tensors form (one tensor, a list, a tuple, a dict, or, for ``broadcast_object``, one
uint8 entry holding a pickle or, with a schema, a fingerprinted msgpack). ``kind`` is DATA (a broadcast) or ABORT
(rank 0 gives up; the payload is a UTF-8 reason). The receiver validates every field before allocating, so a corrupt
or hostile frame raises FrameMismatch instead of allocating terabytes. Tensor offsets are packed for the socket path
and 64-byte aligned in shared memory.
"""

from __future__ import annotations

import ctypes
import struct
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from tensorwire.errors import BroadcastError, FrameMismatch, Reason

MAGIC = b"TWB1"
VERSION = 1
KIND_DATA = 1
KIND_ABORT = 2

S_TENSOR, S_LIST, S_TUPLE, S_DICT = 0, 1, 2, 3
S_OBJECT = 4  # broadcast_object: one uint8 entry holding a pickle (protocol 5) of the object
S_TYPED = 5  # broadcast_object(schema=T): one uint8 entry holding a schema fingerprint + msgpack (``_typed``)
OBJECTS = (S_OBJECT, S_TYPED)

HEADER = struct.Struct("<4sHHQIIQB7x")
SEQ_AT = struct.calcsize("<4sHH")  # header bytes [SEQ_AT, SEQ_END) hold the sequence number
SEQ_END = SEQ_AT + 8
SEQ = struct.Struct("<Q")  # SEQ.pack_into(prefix, SEQ_AT, seq) re-stamps an encoded header
ENTRY = struct.Struct("<BBHQQ")
MAX_NDIM = 32
MAX_TENSORS = 1 << 16
MAX_TABLE_BYTES = 16 << 20

_DTYPE_NAMES = [
    "bool",
    "uint8",
    "int8",
    "int16",
    "int32",
    "int64",
    "float16",
    "bfloat16",
    "float32",
    "float64",
    "complex64",
    "complex128",
    "uint16",
    "uint32",
    "uint64",
    "float8_e4m3fn",
    "float8_e5m2",
    "float8_e4m3fnuz",
    "float8_e5m2fnuz",
]
# Codes are positions in _DTYPE_NAMES (stable: append only); dtypes this torch lacks are skipped.
CODE_OF: dict[torch.dtype, int] = {}
DTYPE_OF: dict[int, torch.dtype] = {}
for _code, _name in enumerate(_DTYPE_NAMES, start=1):
    _dt = getattr(torch, _name, None)
    if isinstance(_dt, torch.dtype):
        CODE_OF[_dt] = _code
        DTYPE_OF[_code] = _dt
ITEMSIZE: dict[int, int] = {c: torch.empty((), dtype=d).element_size() for c, d in DTYPE_OF.items()}


@dataclass(frozen=True)
class Entry:
    key: str
    code: int
    shape: tuple[int, ...]
    offset: int
    nbytes: int

    @property
    def dtype(self) -> torch.dtype:
        return DTYPE_OF[self.code]


@dataclass(frozen=True)
class Layout:
    """A decoded header + table: everything a receiver needs before it touches the payload."""

    kind: int
    seq: int
    structure: int
    entries: tuple[Entry, ...]
    table_bytes: int
    payload_bytes: int


def byte_view(t: torch.Tensor) -> memoryview:
    """Writable byte view of a contiguous CPU tensor's storage (the caller keeps ``t`` alive)."""
    n = t.numel() * t.element_size()
    if n == 0:
        return memoryview(bytearray(0))
    return memoryview((ctypes.c_char * n).from_address(t.data_ptr())).cast("B")


def flatten(value: Any, rank: int) -> tuple[int, list[str], list[torch.Tensor]]:
    """Split a tensor or a flat list/tuple/dict of tensors into (structure, keys, contiguous CPU tensors)."""
    if isinstance(value, torch.Tensor):
        structure, keys, tensors = S_TENSOR, [""], [value]
    elif isinstance(value, (list, tuple)):
        structure = S_LIST if isinstance(value, list) else S_TUPLE
        keys, tensors = [""] * len(value), list(value)
    elif isinstance(value, dict):
        structure = S_DICT
        keys, tensors = [], []
        for k, v in value.items():
            if not isinstance(k, str):
                raise BroadcastError(
                    f"rank {rank}: broadcast dict keys must be str, got {type(k).__name__}",
                    reason=Reason.INVALID_CONFIG,
                )
            keys.append(k)
            tensors.append(v)
    else:
        raise BroadcastError(
            f"rank {rank}: broadcast takes a CPU tensor or a list/tuple/dict of CPU tensors, "
            f"got {type(value).__name__}",
            reason=Reason.INVALID_CONFIG,
        )
    if len(tensors) > MAX_TENSORS:
        raise BroadcastError(
            f"rank {rank}: at most {MAX_TENSORS} tensors per broadcast, got {len(tensors)}",
            reason=Reason.INVALID_CONFIG,
        )
    out = []
    for i, t in enumerate(tensors):
        if not isinstance(t, torch.Tensor):
            raise BroadcastError(
                f"rank {rank}: item {keys[i] or i} is a {type(t).__name__}, not a tensor", reason=Reason.INVALID_CONFIG
            )
        if t.device.type != "cpu":
            raise BroadcastError(
                f"rank {rank}: broadcast requires CPU tensors (item {keys[i] or i} is on {t.device})",
                reason=Reason.WRONG_DEVICE,
            )
        if t.dtype not in CODE_OF:
            raise BroadcastError(
                f"rank {rank}: unsupported dtype {t.dtype} (item {keys[i] or i})", reason=Reason.UNSUPPORTED_DTYPE
            )
        out.append(plain(t))
    return structure, keys, out


def plain(t: torch.Tensor) -> torch.Tensor:
    """``t`` if its storage bytes are its values (contiguous, no lazy conjugate/negative bit), else such a copy."""
    if t.is_contiguous() and not t.is_conj() and not t.is_neg():
        return t
    return t.resolve_conj().resolve_neg().contiguous()


def encode_prefix(
    kind: int, seq: int, structure: int, keys: Sequence[str], tensors: Sequence[torch.Tensor], align: int
) -> tuple[bytes, list[int], int]:
    """Header + table bytes, the payload offset of each tensor, and the payload size."""
    parts: list[bytes] = []
    offsets: list[int] = []
    off = 0
    for key, t in zip(keys, tensors, strict=True):
        nbytes = t.numel() * t.element_size()
        if align > 1:
            off = (off + align - 1) // align * align
        kb = key.encode("utf-8")
        shape = tuple(t.shape)
        parts.append(ENTRY.pack(CODE_OF[t.dtype], len(shape), len(kb), off, nbytes))
        if shape:
            parts.append(struct.pack(f"<{len(shape)}q", *shape))
        parts.append(kb)
        offsets.append(off)
        off += nbytes
    table = b"".join(parts)
    header = HEADER.pack(MAGIC, VERSION, kind, seq, len(tensors), len(table), off, structure)
    return header + table, offsets, off


def frame_seq(buf: bytes | memoryview, start: int = 0) -> int:
    """The sequence number of the frame whose header starts at ``buf[start]``."""
    return int(SEQ.unpack_from(buf, start + SEQ_AT)[0])


class LastFrame:
    """Readers' "same header and table as the last frame" cache, for both transports.

    A hot loop sends the same dtype and shape every step, so the encoded header and table differ from the last
    frame's only in the sequence number. ``match()`` compares everything else byte for byte (the header before and
    after the sequence number, then the table) and returns the layout decoded last time, the same object, so
    callers can also skip their own checks with ``layout is last_layout``. Anything else decodes as usual and is
    then ``remember()``-ed. Not thread-safe (one reader).
    """

    __slots__ = ("prefix_bytes", "layout", "_head", "_tail")

    def __init__(self) -> None:
        self.prefix_bytes = 1 << 62  # no prefix is that long: match() fails until remember()
        self.layout: Layout | None = None
        self._head = b""
        self._tail = b""

    def match(self, buf: memoryview, start: int, end: int) -> Layout | None:
        """The cached layout when ``buf[start:end]`` begins with the remembered header (but the sequence number)
        and table, else None (also when fewer than the remembered prefix's bytes are there)."""
        n = start + self.prefix_bytes
        if n > end or bytes(buf[start + SEQ_END : n]) != self._tail or bytes(buf[start : start + SEQ_AT]) != self._head:
            return None
        return self.layout

    def remember(self, prefix: bytes | memoryview, layout: Layout) -> None:
        """``prefix`` is the header and table of the frame just decoded into ``layout``."""
        self._head = bytes(prefix[:SEQ_AT])
        self._tail = bytes(prefix[SEQ_END:])
        self.prefix_bytes = len(prefix)
        self.layout = layout


def encode_abort(seq: int, message: str) -> bytes:
    body = message.encode("utf-8", "replace")[:4096]
    return HEADER.pack(MAGIC, VERSION, KIND_ABORT, seq, 0, 0, len(body), S_TENSOR) + body


def decode_header(buf: bytes | memoryview, rank: int) -> tuple[int, int, int, int, int, int]:
    """(kind, seq, n_tensors, table_bytes, payload_bytes, structure), validated."""
    magic, version, kind, seq, n, table_bytes, payload_bytes, structure = HEADER.unpack_from(buf)
    if magic != MAGIC or version != VERSION:
        raise FrameMismatch(
            f"rank {rank}: bad frame header (magic {magic!r}, version {version}); "
            f"expected {MAGIC!r} v{VERSION}: the ranks are out of step or the stream is corrupt"
        )
    if kind not in (KIND_DATA, KIND_ABORT) or structure > S_TYPED or n > MAX_TENSORS or table_bytes > MAX_TABLE_BYTES:
        raise FrameMismatch(
            f"rank {rank}: frame header out of range (kind {kind}, structure {structure}, "
            f"{n} tensors, table {table_bytes} B)"
        )
    if structure in (S_TENSOR, *OBJECTS) and kind == KIND_DATA and n != 1:
        raise FrameMismatch(f"rank {rank}: single-entry frame (structure {structure}) carries {n} entries")
    return kind, seq, n, table_bytes, payload_bytes, structure


def decode_table(buf: bytes | memoryview, n: int, payload_bytes: int, rank: int) -> tuple[Entry, ...]:
    entries = []
    pos = 0
    end_prev = 0
    try:
        for _ in range(n):
            code, ndim, key_len, off, nbytes = ENTRY.unpack_from(buf, pos)
            pos += ENTRY.size
            if code not in DTYPE_OF or ndim > MAX_NDIM:
                raise FrameMismatch(f"rank {rank}: frame names unknown dtype code {code} or ndim {ndim}")
            shape = struct.unpack_from(f"<{ndim}q", buf, pos) if ndim else ()
            pos += 8 * ndim
            key = bytes(buf[pos : pos + key_len]).decode("utf-8")
            pos += key_len
            numel = 1
            for d in shape:
                if d < 0:
                    raise FrameMismatch(f"rank {rank}: negative dimension in shape {shape}")
                numel *= d
            if numel * ITEMSIZE[code] != nbytes or off < end_prev or off + nbytes > payload_bytes:
                raise FrameMismatch(
                    f"rank {rank}: tensor entry inconsistent (shape {shape}, {nbytes} B at "
                    f"offset {off}, payload {payload_bytes} B)"
                )
            end_prev = off + nbytes
            entries.append(Entry(key, code, tuple(shape), off, nbytes))
    except (struct.error, UnicodeDecodeError) as exc:
        raise FrameMismatch(f"rank {rank}: truncated or corrupt tensor table: {exc}") from exc
    if pos != len(buf):
        raise FrameMismatch(f"rank {rank}: tensor table has {len(buf) - pos} trailing bytes")
    return tuple(entries)


def allocate(layout: Layout) -> list[torch.Tensor]:
    return [torch.empty(e.shape, dtype=e.dtype) for e in layout.entries]


def encode_object_prefix(seq: int, nbytes: int, structure: int = S_OBJECT) -> bytes:
    """Header + table of a ``broadcast_object`` frame: one uint8 entry of ``nbytes`` (the pickle, or for
    ``S_TYPED`` the fingerprinted msgpack) at offset 0."""
    table = ENTRY.pack(CODE_OF[torch.uint8], 1, 0, 0, nbytes) + struct.pack("<q", nbytes)
    return HEADER.pack(MAGIC, VERSION, KIND_DATA, seq, 1, len(table), nbytes, structure) + table


def unflatten(structure: int, entries: Sequence[Entry], tensors: list[torch.Tensor]) -> Any:
    if structure in OBJECTS:
        raise FrameMismatch(
            "rank 0 sent an object (broadcast_object) where this rank called broadcast; the ranks "
            "called different methods"
        )
    if structure == S_TENSOR:
        return tensors[0]
    if structure == S_LIST:
        return tensors
    if structure == S_TUPLE:
        return tuple(tensors)
    return {e.key: t for e, t in zip(entries, tensors, strict=True)}


def check_inplace(layout: Layout, target: torch.Tensor, rank: int) -> None:
    """broadcast_(): the frame must carry exactly one tensor of the target's dtype and shape."""
    if layout.structure != S_TENSOR or len(layout.entries) != 1:
        raise FrameMismatch(
            f"rank {rank}: broadcast_ expected one tensor, rank 0 sent {len(layout.entries)} "
            f"(structure {layout.structure}); the ranks called different methods"
        )
    e = layout.entries[0]
    if e.dtype != target.dtype or e.shape != tuple(target.shape):
        raise FrameMismatch(
            f"rank {rank}: broadcast_ target is {target.dtype}{list(target.shape)} but rank 0 sent "
            f"{e.dtype}{list(e.shape)}"
        )
