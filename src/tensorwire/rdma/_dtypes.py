"""The dtypes the rdma layer moves: torch dtype <-> wire enum <-> item size, in one table."""

from __future__ import annotations

import torch

from tensorwire.rdma._proto import descriptor_pb2 as pb

# torch dtype -> (wire enum value, itemsize). Order is the documentation order; keep the wire values stable.
_TABLE: dict[torch.dtype, tuple[int, int]] = {
    torch.float32: (pb.DTYPE_FLOAT32, 4),
    torch.float16: (pb.DTYPE_FLOAT16, 2),
    torch.bfloat16: (pb.DTYPE_BFLOAT16, 2),
    torch.float64: (pb.DTYPE_FLOAT64, 8),
    torch.int8: (pb.DTYPE_INT8, 1),
    torch.uint8: (pb.DTYPE_UINT8, 1),
    torch.int16: (pb.DTYPE_INT16, 2),
    torch.int32: (pb.DTYPE_INT32, 4),
    torch.int64: (pb.DTYPE_INT64, 8),
    torch.bool: (pb.DTYPE_BOOL, 1),
}
_BY_WIRE: dict[int, torch.dtype] = {wire: dt for dt, (wire, _) in _TABLE.items()}

SUPPORTED_DTYPES: tuple[torch.dtype, ...] = tuple(_TABLE)


def is_supported(dtype: torch.dtype) -> bool:
    return dtype in _TABLE


def itemsize(dtype: torch.dtype) -> int:
    return _TABLE[dtype][1]


def to_wire(dtype: torch.dtype) -> int:
    return _TABLE[dtype][0]


def from_wire(value: int) -> torch.dtype | None:
    """The torch dtype of a wire value, or None for UNSPECIFIED and unknown values."""
    return _BY_WIRE.get(value)


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")
