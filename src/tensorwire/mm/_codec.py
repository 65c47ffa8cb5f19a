"""Wire form <-> Python values, shared by both sides and both planes: the inline tensor codec, reassembly,
request inputs, and the metric label of each slot role.

Decoding treats every byte as untrusted: the dtype, the dims, the element and byte counts and the exact payload
length are checked before anything is materialized, so a malformed message costs an InvalidPayload, never an
out-of-bounds read or a huge allocation.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from tensorwire.errors import InvalidPayload, Reason
from tensorwire.mm._proto import encoder_pb2 as pb
from tensorwire.mm._types import MultimodalInput

# The allow-list, one place for both planes: wire enum <-> torch dtype.
DTYPE_TO_WIRE: dict[torch.dtype, pb.DType] = {
    torch.float32: pb.FLOAT32,
    torch.float16: pb.FLOAT16,
    torch.bfloat16: pb.BFLOAT16,
    torch.float64: pb.FLOAT64,
    torch.int64: pb.INT64,
    torch.int32: pb.INT32,
    torch.int16: pb.INT16,
    torch.int8: pb.INT8,
    torch.uint8: pb.UINT8,
    torch.bool: pb.BOOL,
}
WIRE_TO_DTYPE: dict[int, torch.dtype] = {v: k for k, v in DTYPE_TO_WIRE.items()}
SUPPORTED_DTYPES: frozenset[torch.dtype] = frozenset(DTYPE_TO_WIRE)

# The ``role`` label of tensorwire_mm_bytes_total for each slot role; ROLE_UNSPECIFIED has none (it is rejected).
ROLE_LABELS: dict[int, str] = {pb.EMBEDDING: "embedding", pb.POS_ID: "pos_id", pb.EXTRA_INPUT: "extra_input"}

MAX_NDIM = 16
MAX_TENSOR_BYTES = 2**31 - 1  # one protobuf message cannot be larger


def encode_tensor(t: torch.Tensor, out: pb.Tensor | None = None) -> pb.Tensor:
    """Row-major host bytes of ``t`` (the ``.cpu()`` also orders after the producing CUDA stream)."""
    wire = DTYPE_TO_WIRE.get(t.dtype)
    if wire is None:
        raise InvalidPayload(f"dtype {t.dtype} is not in the inline allow-list {sorted(map(str, SUPPORTED_DTYPES))}",
                             reason=Reason.UNSUPPORTED_DTYPE)
    host = t.detach().to("cpu").contiguous()
    msg = out if out is not None else pb.Tensor()
    msg.dtype = wire
    msg.shape[:] = list(host.shape)
    msg.data = host.reshape(-1).view(torch.uint8).numpy().tobytes() if host.numel() else b""
    return msg


def decode_tensor(msg: pb.Tensor, what: str = "tensor") -> torch.Tensor:
    """An owning host tensor from an untrusted message; InvalidPayload before any allocation if malformed."""
    dtype = WIRE_TO_DTYPE.get(msg.dtype)
    if dtype is None:
        raise InvalidPayload(f"{what}: dtype enum {msg.dtype} is not in the allow-list",
                             reason=Reason.UNSUPPORTED_DTYPE)
    shape = list(msg.shape)
    if len(shape) > MAX_NDIM:
        raise InvalidPayload(f"{what}: {len(shape)} dims exceed the limit of {MAX_NDIM}",
                             reason=Reason.SIZE_OVERFLOW)
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
            raise InvalidPayload(f"{what}: shape {shape} of {dtype} exceeds {MAX_TENSOR_BYTES} bytes",
                                 reason=Reason.SIZE_OVERFLOW)
    nbytes = numel * itemsize
    if len(msg.data) != nbytes:
        raise InvalidPayload(f"{what}: payload is {len(msg.data)} bytes; shape {shape} of {dtype} needs {nbytes}",
                             reason=Reason.NBYTES_MISMATCH)
    if numel == 0:
        return torch.empty(shape, dtype=dtype)
    raw = torch.frombuffer(bytearray(msg.data), dtype=torch.uint8)  # bytearray: one owning, writable copy
    return raw.view(dtype).reshape(shape)


def assemble(
    embedding: torch.Tensor | None,
    split_sizes: Sequence[int],
    position_ids: torch.Tensor | None,
    extra_inputs: Sequence[torch.Tensor],
) -> tuple[list[torch.Tensor], list[torch.Tensor] | None, list[torch.Tensor]]:
    """Splits wire-form tensors per item after checking the invariants (ASSEMBLY_MISMATCH otherwise)."""
    splits = [int(s) for s in split_sizes]
    if embedding is None:
        if splits or position_ids is not None or extra_inputs:
            raise InvalidPayload("receipt has split sizes, position ids or extra inputs but no embedding",
                                 reason=Reason.ASSEMBLY_MISMATCH)
        return [], None, []
    if embedding.dim() == 0:
        raise InvalidPayload("embedding is a scalar; it needs a row dimension", reason=Reason.ASSEMBLY_MISMATCH)
    if any(s < 0 for s in splits):
        raise InvalidPayload(f"negative split size in {splits}", reason=Reason.ASSEMBLY_MISMATCH)
    total = sum(splits)
    if not splits or total != embedding.shape[0]:
        raise InvalidPayload(f"split sizes {splits} sum to {total}; the embedding has {embedding.shape[0]} rows",
                             reason=Reason.ASSEMBLY_MISMATCH)
    pos_parts: list[torch.Tensor] | None = None
    if position_ids is not None:
        rows = position_ids.shape[0] if position_ids.dim() else -1
        if rows != total:
            raise InvalidPayload(f"position ids have {rows} rows; split sizes sum to {total}",
                                 reason=Reason.ASSEMBLY_MISMATCH)
        pos_parts = [position_ids] if len(splits) == 1 else list(position_ids.split_with_sizes(splits))
    if extra_inputs and len(extra_inputs) != len(splits):
        raise InvalidPayload(f"extra_input count {len(extra_inputs)} != {len(splits)} items",
                             reason=Reason.ASSEMBLY_MISMATCH)
    # One item: the tensor itself (a split would only make a view of all of it, one more torch call per fetch).
    embs = [embedding] if len(splits) == 1 else list(embedding.split_with_sizes(splits))
    return embs, pos_parts, list(extra_inputs)


def decode_inline_receipt(
    receipt: pb.EncodeResponse,
) -> tuple[list[torch.Tensor], list[int], list[torch.Tensor] | None, list[torch.Tensor], int]:
    """(embeddings, split_sizes, position_ids, extra_inputs, payload bytes) of an inline receipt."""
    embedding = decode_tensor(receipt.embedding, "embedding") if receipt.HasField("embedding") else None
    pos = decode_tensor(receipt.position_ids, "position_ids") if receipt.HasField("position_ids") else None
    extras = [decode_tensor(t, f"extra_inputs[{i}]") for i, t in enumerate(receipt.extra_inputs)]
    splits = [int(s) for s in receipt.split_sizes]
    embs, pos_parts, extra_list = assemble(embedding, splits, pos, extras)
    nbytes = (len(receipt.embedding.data) + len(receipt.position_ids.data)
              + sum(len(t.data) for t in receipt.extra_inputs))
    return embs, splits, pos_parts, extra_list, nbytes


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
    return [MultimodalInput(data=i.data, kind=i.kind or "image", params=dict(i.params), timeout_ms=int(i.timeout_ms))
            for i in request.inputs]


__all__ = [
    "ROLE_LABELS",
    "inputs_to_pb",
    "inputs_from_pb",
    "DTYPE_TO_WIRE",
    "WIRE_TO_DTYPE",
    "SUPPORTED_DTYPES",
    "encode_tensor",
    "decode_tensor",
    "assemble",
    "decode_inline_receipt",
]
