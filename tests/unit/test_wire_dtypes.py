"""One dtype numbering across the protos, and descriptors that old readers and old owners still understand.

encoder.proto (inline tensors) and descriptor.proto (RDMA manifests) number dtypes the same way; descriptors also
carry the numbering they used before (TensorMetaPB field 2), so a reader that predates field 5 reads the same dtype,
and a descriptor from an owner that predates field 5 (field 2 only) still parses. docs/wire.md states the rule.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from tensorwire.errors import InvalidDescriptor, Reason
from tensorwire.mm._proto import encoder_pb2 as mpb
from tensorwire.mm.wire._codec import DTYPE_TO_WIRE
from tensorwire.rdma import SUPPORTED_DTYPES, WIRE_DTYPES, Descriptor, Owner, TensorMeta
from tensorwire.rdma._proto import descriptor_pb2 as dpb

# The descriptor numbering of every release before the one numbering (frozen here on purpose: it is what old
# readers decode field 2 with and what old owners write there).
OLD_DESCRIPTOR_NUMBERING = {
    torch.float32: 1,
    torch.float16: 2,
    torch.bfloat16: 3,
    torch.float64: 4,
    torch.int8: 5,
    torch.uint8: 6,
    torch.int16: 7,
    torch.int32: 8,
    torch.int64: 9,
    torch.bool: 10,
}
# The inline numbering (encoder.proto), which every release used and which became the one numbering.
ONE_NUMBERING = {
    torch.float32: 1,
    torch.float16: 2,
    torch.bfloat16: 3,
    torch.float64: 4,
    torch.int64: 5,
    torch.int32: 6,
    torch.int16: 7,
    torch.int8: 8,
    torch.uint8: 9,
    torch.bool: 10,
}


def _values(enum: object, prefix: str = "") -> dict[str, int]:
    return {v.name.removeprefix(prefix): v.number for v in enum.DESCRIPTOR.values}  # type: ignore[attr-defined]


def test_both_protos_have_one_numbering() -> None:
    inline = _values(mpb.DType)
    rdma = _values(dpb.DType, "DTYPE_")
    assert inline.pop("DTYPE_UNSPECIFIED") == rdma.pop("UNSPECIFIED") == 0
    assert inline == rdma
    assert dict(WIRE_DTYPES) == ONE_NUMBERING == {dt: int(v) for dt, v in DTYPE_TO_WIRE.items()}
    assert set(ONE_NUMBERING) == set(SUPPORTED_DTYPES)


def test_legacy_enum_is_the_old_numbering() -> None:
    legacy = _values(dpb.LegacyDType, "LEGACY_")
    assert legacy.pop("DTYPE_UNSPECIFIED") == 0
    assert legacy == {str(dt).removeprefix("torch.").upper(): v for dt, v in OLD_DESCRIPTOR_NUMBERING.items()}


def _descriptor() -> Descriptor:
    entries, off = [], 0
    for dt in SUPPORTED_DTYPES:
        entries.append(TensorMeta((3,), dt, off, 3 * dt.itemsize))
        off += 4096
    return Descriptor(
        owner=Owner("tw-a", "127.0.0.1", 4242, 1),
        mem_type="DRAM",
        device_id=0,
        slot_addr=0x7F0000000000,
        payload_bytes=off,
        lease_id="l-1",
        generation=1,
        generation_addr=0x7E0000000008,
        manifest=tuple(entries),
    )


def test_new_descriptor_carries_both_numberings_for_old_readers() -> None:
    d = _descriptor()
    msg = dpb.DescriptorPB.FromString(d.to_bytes())
    for meta, e in zip(d.manifest, msg.manifest, strict=True):
        assert e.dtype == ONE_NUMBERING[meta.dtype]
        assert e.legacy_dtype == OLD_DESCRIPTOR_NUMBERING[meta.dtype]  # what an old reader decodes


def test_old_owners_descriptor_still_parses() -> None:
    d = _descriptor()
    msg = dpb.DescriptorPB.FromString(d.to_bytes())
    for e in msg.manifest:
        e.dtype = dpb.DTYPE_UNSPECIFIED  # an old owner never wrote field 5
    assert Descriptor.from_bytes(msg.SerializeToString()) == d


def test_one_numbering_wins_and_must_agree_with_the_legacy_field() -> None:
    d = dataclasses.replace(_descriptor(), manifest=(TensorMeta((3,), torch.int8, 0, 3),), payload_bytes=4096)
    msg = dpb.DescriptorPB.FromString(d.to_bytes())
    msg.manifest[0].legacy_dtype = dpb.LEGACY_DTYPE_UNSPECIFIED  # a writer of the one numbering only
    assert Descriptor.from_bytes(msg.SerializeToString()).manifest[0].dtype is torch.int8
    msg.manifest[0].legacy_dtype = dpb.LEGACY_UINT8  # same size, other dtype: must not be read either way
    with pytest.raises(InvalidDescriptor) as info:
        Descriptor.from_bytes(msg.SerializeToString())
    assert info.value.reason is Reason.UNSUPPORTED_DTYPE and "disagree" in str(info.value)
