"""Wire form <-> Python values, shared by both sides and both planes: the inline tensor codec, reassembly,
request inputs, and the metric label of each slot role.

Decoding treats every byte as untrusted: dtype, dims, counts and the exact payload length are checked before
anything is materialized (``InvalidPayload``). ``host_view`` and ``decode_tensor`` avoid copies where they can:
a contiguous host tensor is viewed, a device tensor goes through reused pinned memory.
"""

from __future__ import annotations

import threading
import warnings
from collections.abc import Sequence
from typing import TYPE_CHECKING, cast

import torch

from tensorwire.errors import InvalidPayload, Reason
from tensorwire.mm._proto import encoder_pb2 as pb
from tensorwire.mm._types import MultimodalInput
from tensorwire.mm.wire._protobuf import Buffer
from tensorwire.rdma import WIRE_DTYPES

if TYPE_CHECKING:
    from tensorwire.mm.wire._receipt import WireReceipt

# The allow-list: wire enum <-> torch dtype, built from the rdma layer's table (one table and one numbering for
# both planes and both protos; tests/unit/test_wire_dtypes.py checks that encoder.proto's values are its values).
DTYPE_TO_WIRE: dict[torch.dtype, pb.DType] = {dt: cast(pb.DType, wire) for dt, wire in WIRE_DTYPES.items()}
WIRE_TO_DTYPE: dict[int, torch.dtype] = {v: k for k, v in DTYPE_TO_WIRE.items()}
SUPPORTED_DTYPES: frozenset[torch.dtype] = frozenset(DTYPE_TO_WIRE)

# The ``role`` label of tensorwire_mm_bytes_total for each slot role; ROLE_UNSPECIFIED has none (it is rejected).
ROLE_LABELS: dict[int, str] = {pb.EMBEDDING: "embedding", pb.POS_ID: "pos_id", pb.EXTRA_INPUT: "extra_input"}

MAX_NDIM = 16
MAX_TENSOR_BYTES = 2**31 - 1  # one protobuf message cannot be larger
# Below this a payload is copied into an owning tensor: a view would save microseconds and could alias a bytes
# object CPython shares (the one-byte ones are singletons).
VIEW_MIN_BYTES = 64 << 10


def host_view(t: torch.Tensor, out: pb.Tensor, *, private: bool = False) -> memoryview:
    """Sets ``out``'s dtype and shape and returns ``t``'s row-major bytes in host memory, copying only what must
    be copied: a contiguous host tensor is viewed as is (``private``: copied anyway, for memory that is reused
    once the caller returns), a strided one is made contiguous, a device one is copied into pinned host memory
    from torch's caching host allocator (pages reused from call to call; the copy orders after the current
    stream, as ``.cpu()`` does). The view keeps its tensor alive. InvalidPayload for a dtype off the allow-list.
    """
    wire = DTYPE_TO_WIRE.get(t.dtype)
    if wire is None:
        raise InvalidPayload(
            f"dtype {t.dtype} is not in the inline allow-list {sorted(map(str, SUPPORTED_DTYPES))}",
            reason=Reason.UNSUPPORTED_DTYPE,
        )
    out.dtype = wire
    out.shape[:] = list(t.shape)
    if t.numel() == 0:
        return memoryview(b"")
    t = t.detach()
    if t.device.type == "cuda":
        try:
            host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
        except RuntimeError:  # no pinned memory to be had: pageable, as .cpu() gives
            host = torch.empty(t.shape, dtype=t.dtype)
        host.copy_(t)  # blocking: done when it returns
    elif t.device.type != "cpu":
        host = t.to("cpu").contiguous()
    elif private:
        host = t.clone(memory_format=torch.contiguous_format)
    else:
        host = t.contiguous()
    return host.reshape(-1).view(torch.uint8).numpy().data  # the array's memoryview: it keeps the array alive


def encode_tensor(t: torch.Tensor, out: pb.Tensor | None = None) -> pb.Tensor:
    """A complete Tensor message (its bytes copied into ``data``): for tools and tests; the encoder's receipts
    keep the bytes outside the message (``_wire_receipt``)."""
    msg = out if out is not None else pb.Tensor()
    msg.data = host_view(t, msg).tobytes()
    return msg


def check_tensor(msg: pb.Tensor, nbytes: int, what: str = "tensor") -> tuple[torch.dtype, list[int], int]:
    """(dtype, shape, numel) of an untrusted message whose payload is ``nbytes`` long, or InvalidPayload when the
    dtype, the dims and the payload length disagree. Nothing is copied or allocated."""
    dtype = WIRE_TO_DTYPE.get(msg.dtype)
    if dtype is None:
        raise InvalidPayload(
            f"{what}: dtype enum {msg.dtype} is not in the allow-list", reason=Reason.UNSUPPORTED_DTYPE
        )
    shape = list(msg.shape)
    if len(shape) > MAX_NDIM:
        raise InvalidPayload(f"{what}: {len(shape)} dims exceed the limit of {MAX_NDIM}", reason=Reason.SIZE_OVERFLOW)
    numel = 1
    extent = 1  # product of the non-zero dims: a zero dim makes numel 0 but torch still computes the strides
    itemsize = torch.empty((), dtype=dtype).element_size()
    for d in shape:
        if d < 0:
            raise InvalidPayload(f"{what}: negative dim in shape {shape}", reason=Reason.NEGATIVE_DIM)
        numel *= d
        extent *= max(d, 1)
        # Python ints do not overflow, but a C consumer would; stop as soon as the size cannot be real.
        if extent * itemsize > MAX_TENSOR_BYTES:
            raise InvalidPayload(
                f"{what}: shape {shape} of {dtype} exceeds {MAX_TENSOR_BYTES} bytes", reason=Reason.SIZE_OVERFLOW
            )
    if nbytes != numel * itemsize:
        raise InvalidPayload(
            f"{what}: payload is {nbytes} bytes; shape {shape} of {dtype} needs {numel * itemsize}",
            reason=Reason.NBYTES_MISMATCH,
        )
    return dtype, shape, numel


def decode_tensor(msg: pb.Tensor, what: str = "tensor", payload: Buffer | None = None) -> torch.Tensor:
    """A host tensor from an untrusted message; InvalidPayload before any allocation if malformed.

    ``payload``: the tensor's bytes when they are held outside the message (a parsed ``WireReceipt``); from
    ``VIEW_MIN_BYTES`` on, the tensor views them (no copy; they are the receiver's own) unless they are not
    aligned for the dtype (an old encoder's receipt), which costs one copy. Without ``payload`` (or below that
    size) the tensor owns a copy, and never aliases the message.
    """
    data = msg.data if payload is None else payload
    dtype, shape, numel = check_tensor(msg, len(data), what)
    if numel == 0:
        return torch.empty(shape, dtype=dtype)
    if payload is None or len(data) < VIEW_MIN_BYTES:
        raw = torch.frombuffer(bytearray(data), dtype=torch.uint8)  # bytearray: one owning, writable copy
    else:
        raw = _frombuffer(data)
        if raw.data_ptr() % dtype.itemsize:
            raw = raw.clone()
    return raw.view(dtype).reshape(shape)


_quiet_lock = threading.Lock()
_quiet = False


def _frombuffer(data: Buffer) -> torch.Tensor:
    """``torch.frombuffer`` of received bytes. They are immutable ``bytes`` that only this receipt holds, so the
    tensor may write them; torch warns once per process that it cannot mark the tensor read-only, and that one
    warning is swallowed here (the first time only, so other threads' warnings are filtered for one call)."""
    global _quiet
    if _quiet or not memoryview(data).readonly:
        return torch.frombuffer(data, dtype=torch.uint8)
    with _quiet_lock, warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="The given buffer is not writable", category=UserWarning)
        out = torch.frombuffer(data, dtype=torch.uint8)
        _quiet = True
    return out


def split_per_item(
    embedding: torch.Tensor | None,
    split_sizes: Sequence[int],
    position_ids: torch.Tensor | None,
    extra_inputs: Sequence[torch.Tensor],
) -> tuple[list[torch.Tensor], list[torch.Tensor] | None, list[torch.Tensor]]:
    """Splits wire-form tensors per item after checking the invariants (ASSEMBLY_MISMATCH otherwise)."""
    splits = check_layout(
        None if embedding is None else embedding.shape,
        split_sizes,
        None if position_ids is None else position_ids.shape,
        len(extra_inputs),
    )
    if embedding is None:
        return [], None, []
    pos_parts: list[torch.Tensor] | None = None
    if position_ids is not None:
        pos_parts = [position_ids] if len(splits) == 1 else list(position_ids.split_with_sizes(splits))
    # One item: the tensor itself (a split would only make a view of all of it, one more torch call per fetch).
    embs = [embedding] if len(splits) == 1 else list(embedding.split_with_sizes(splits))
    return embs, pos_parts, list(extra_inputs)


def check_layout(
    embedding_shape: Sequence[int] | None,
    split_sizes: Sequence[int],
    position_shape: Sequence[int] | None,
    n_extras: int,
) -> list[int]:
    """The reassembly invariants on shapes alone (ASSEMBLY_MISMATCH otherwise); returns the split sizes."""
    splits = [int(s) for s in split_sizes]
    if embedding_shape is None:
        if splits or position_shape is not None or n_extras:
            raise InvalidPayload(
                "receipt has split sizes, position ids or extra inputs but no embedding",
                reason=Reason.ASSEMBLY_MISMATCH,
            )
        return splits
    if len(embedding_shape) == 0:
        raise InvalidPayload("embedding is a scalar; it needs a row dimension", reason=Reason.ASSEMBLY_MISMATCH)
    if any(s < 0 for s in splits):
        raise InvalidPayload(f"negative split size in {splits}", reason=Reason.ASSEMBLY_MISMATCH)
    total = sum(splits)
    if not splits or total != embedding_shape[0]:
        raise InvalidPayload(
            f"split sizes {splits} sum to {total}; the embedding has {embedding_shape[0]} rows",
            reason=Reason.ASSEMBLY_MISMATCH,
        )
    if position_shape is not None:
        rows = position_shape[0] if len(position_shape) else -1
        if rows != total:
            raise InvalidPayload(
                f"position ids have {rows} rows; split sizes sum to {total}", reason=Reason.ASSEMBLY_MISMATCH
            )
    if n_extras and n_extras != len(splits):
        raise InvalidPayload(f"extra_input count {n_extras} != {len(splits)} items", reason=Reason.ASSEMBLY_MISMATCH)
    return splits


def check_inline_receipt(receipt: pb.EncodeResponse) -> None:
    """What ``decode_inline_receipt`` checks, without copying a byte: InvalidPayload when it would fail."""
    emb = (
        check_tensor(receipt.embedding, len(receipt.embedding.data), "embedding")[1]
        if receipt.HasField("embedding")
        else None
    )
    pos = (
        check_tensor(receipt.position_ids, len(receipt.position_ids.data), "position_ids")[1]
        if receipt.HasField("position_ids")
        else None
    )
    for i, t in enumerate(receipt.extra_inputs):
        check_tensor(t, len(t.data), f"extra_inputs[{i}]")
    check_layout(emb, receipt.split_sizes, pos, len(receipt.extra_inputs))


def decode_inline_receipt(
    receipt: WireReceipt,
) -> tuple[list[torch.Tensor], list[int], list[torch.Tensor] | None, list[torch.Tensor], int]:
    """(embeddings, split_sizes, position_ids, extra_inputs, payload bytes) of an inline receipt; the tensors view
    the receipt's payloads (``decode_tensor``)."""
    m = receipt.message
    embedding = decode_tensor(m.embedding, "embedding", receipt.embedding) if m.HasField("embedding") else None
    pos = decode_tensor(m.position_ids, "position_ids", receipt.position_ids) if m.HasField("position_ids") else None
    if len(receipt.extra_inputs) != len(m.extra_inputs):
        raise InvalidPayload(
            f"receipt has {len(m.extra_inputs)} extra inputs and {len(receipt.extra_inputs)} payloads for them",
            reason=Reason.ASSEMBLY_MISMATCH,
        )
    extras = [
        decode_tensor(t, f"extra_inputs[{i}]", p)
        for i, (t, p) in enumerate(zip(m.extra_inputs, receipt.extra_inputs, strict=True))
    ]
    splits = [int(s) for s in m.split_sizes]
    embs, pos_parts, extra_list = split_per_item(embedding, splits, pos, extras)
    return embs, splits, pos_parts, extra_list, receipt.payload_bytes


def inputs_to_pb(inputs: Sequence[MultimodalInput], request: pb.EncodeRequest | None = None) -> pb.EncodeRequest:
    """The EncodeRequest carrying ``inputs`` (added to ``request`` when given)."""
    req = request if request is not None else pb.EncodeRequest()
    for item in inputs:
        m = req.inputs.add()
        m.data = bytes(item.data)
        m.kind = item.kind
        for k, v in dict(item.params).items():
            m.params[str(k)] = str(v)
        m.timeout_ms = int(item.timeout_ms)
    return req


def inputs_from_pb(request: pb.EncodeRequest) -> list[MultimodalInput]:
    """The inputs an EncodeRequest carries (an empty kind reads as "image", the proto's documented default)."""
    return [
        MultimodalInput(data=i.data, kind=i.kind or "image", params=dict(i.params), timeout_ms=int(i.timeout_ms))
        for i in request.inputs
    ]


__all__ = [
    "ROLE_LABELS",
    "inputs_to_pb",
    "inputs_from_pb",
    "DTYPE_TO_WIRE",
    "WIRE_TO_DTYPE",
    "SUPPORTED_DTYPES",
    "VIEW_MIN_BYTES",
    "host_view",
    "encode_tensor",
    "check_tensor",
    "decode_tensor",
    "check_layout",
    "check_inline_receipt",
    "split_per_item",
    "decode_inline_receipt",
]
