"""The dtypes tensorwire moves, in one table for both planes: torch dtype <-> wire value <-> item size.

The wire value is the one numbering every proto uses (``tensorwire.rdma.DType`` and ``tensorwire.mm.v1.DType``
have the same names and values; ``mm._codec`` builds its inline table from this one). Descriptors also carry
the legacy numbering they used before (``LegacyDType``, TensorMetaPB field 2) so that readers that predate the
one numbering keep working; see docs/wire.md, "dtypes".
"""

from __future__ import annotations

from types import MappingProxyType

import torch

from tensorwire.rdma._proto import descriptor_pb2 as pb

# torch dtype -> (wire value, legacy descriptor value, itemsize). Order is the documentation order; the wire and
# legacy values never change.
_TABLE: dict[torch.dtype, tuple[int, int, int]] = {
    torch.float32: (pb.DTYPE_FLOAT32, pb.LEGACY_FLOAT32, 4),
    torch.float16: (pb.DTYPE_FLOAT16, pb.LEGACY_FLOAT16, 2),
    torch.bfloat16: (pb.DTYPE_BFLOAT16, pb.LEGACY_BFLOAT16, 2),
    torch.float64: (pb.DTYPE_FLOAT64, pb.LEGACY_FLOAT64, 8),
    torch.int64: (pb.DTYPE_INT64, pb.LEGACY_INT64, 8),
    torch.int32: (pb.DTYPE_INT32, pb.LEGACY_INT32, 4),
    torch.int16: (pb.DTYPE_INT16, pb.LEGACY_INT16, 2),
    torch.int8: (pb.DTYPE_INT8, pb.LEGACY_INT8, 1),
    torch.uint8: (pb.DTYPE_UINT8, pb.LEGACY_UINT8, 1),
    torch.bool: (pb.DTYPE_BOOL, pb.LEGACY_BOOL, 1),
}
_BY_WIRE: dict[int, torch.dtype] = {wire: dt for dt, (wire, _, _) in _TABLE.items()}
_BY_LEGACY: dict[int, torch.dtype] = {legacy: dt for dt, (_, legacy, _) in _TABLE.items()}

SUPPORTED_DTYPES: tuple[torch.dtype, ...] = tuple(_TABLE)
# Public, read-only: torch dtype -> its value in the one numbering (mm's inline codec maps with this).
WIRE_DTYPES = MappingProxyType({dt: wire for dt, (wire, _, _) in _TABLE.items()})


def is_supported(dtype: torch.dtype) -> bool:
    return dtype in _TABLE


def itemsize(dtype: torch.dtype) -> int:
    return _TABLE[dtype][2]


def to_wire(dtype: torch.dtype) -> int:
    """The one numbering's value of ``dtype`` (KeyError for a dtype off the table)."""
    return _TABLE[dtype][0]


def to_legacy(dtype: torch.dtype) -> int:
    """The legacy descriptor value of ``dtype`` (TensorMetaPB field 2, for readers that predate field 5)."""
    return _TABLE[dtype][1]


def from_wire(value: int) -> torch.dtype | None:
    """The torch dtype of a wire value, or None for UNSPECIFIED and unknown values."""
    return _BY_WIRE.get(value)


def from_legacy(value: int) -> torch.dtype | None:
    """The torch dtype of a legacy descriptor value, or None for UNSPECIFIED and unknown values."""
    return _BY_LEGACY.get(value)


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")
