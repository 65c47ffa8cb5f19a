"""Descriptor wire format and every validation rule (table-driven), plus a property test on mutated bytes."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tensorwire.errors import InvalidDescriptor, Reason
from tensorwire.rdma import Descriptor, Owner, TensorMeta, _dtypes
from tensorwire.rdma._descriptor import MAX_DESCRIPTOR_BYTES, MAX_DIMS, MAX_MANIFEST_ENTRIES
from tensorwire.rdma._proto import descriptor_pb2 as pb

ALIGN = 4096


def valid() -> Descriptor:
    return Descriptor(
        owner=Owner("tw-exporter-a", "127.0.0.1", 4242, 3),
        mem_type="DRAM",
        device_id=0,
        slot_addr=0x7F0000000000,
        payload_bytes=3 * ALIGN,
        lease_id="abc-1",
        generation=7,
        generation_addr=0x7E0000000008,
        manifest=(
            TensorMeta((2, 3), torch.float32, 0, 24),
            TensorMeta((4,), torch.bfloat16, ALIGN, 8),
            TensorMeta((0, 5), torch.int64, 2 * ALIGN, 0),
        ),
    )


def test_round_trip() -> None:
    d = valid()
    assert Descriptor.from_bytes(d.to_bytes()) == d
    assert d.nbytes == 32
    assert d.owner.endpoint == "127.0.0.1:4242"


def test_wire_form_is_one_message_and_follows_the_owner() -> None:
    # to_bytes prepends a cached serialization of the owner field: the result must parse as the same message a
    # single DescriptorPB with every field serializes to, and a changed owner must not reuse another's bytes.
    d = valid()
    o = d.owner
    whole = pb.DescriptorPB(
        version=1,
        owner=pb.OwnerPB(
            agent_name=o.agent_name,
            host=o.host,
            port=o.port,
            registration_epoch=o.registration_epoch,
            metadata_token=o.metadata_token,
        ),
        mem_type=pb.MEM_DRAM,
        device_id=d.device_id,
        slot_addr=d.slot_addr,
        payload_bytes=d.payload_bytes,
        lease_id=d.lease_id,
        generation=d.generation,
        generation_addr=d.generation_addr,
    )
    for e in d.manifest:
        whole.manifest.add(
            shape=list(e.shape),
            dtype=_dtypes.to_wire(e.dtype),
            legacy_dtype=_dtypes.to_legacy(e.dtype),
            offset=e.offset,
            nbytes=e.nbytes,
        )
    parsed = pb.DescriptorPB()
    parsed.ParseFromString(d.to_bytes())
    assert parsed == whole
    for owner in (
        dataclasses.replace(o, registration_epoch=4),
        dataclasses.replace(o, metadata_token=b"t" * 32),
        dataclasses.replace(o, port=4243),
    ):
        moved = dataclasses.replace(d, owner=owner)
        assert Descriptor.from_bytes(moved.to_bytes()).owner == owner
    assert Descriptor.from_bytes(d.to_bytes()).owner == o


def test_round_trip_every_dtype() -> None:
    from tensorwire.rdma import SUPPORTED_DTYPES

    entries, off = [], 0
    for dt in SUPPORTED_DTYPES:
        n = 3 * torch.empty(0, dtype=dt).element_size()
        entries.append(TensorMeta((3,), dt, off, n))
        off += ALIGN
    d = dataclasses.replace(valid(), manifest=tuple(entries), payload_bytes=off)
    assert Descriptor.from_bytes(d.to_bytes()).manifest == tuple(entries)


def m(
    shape: tuple[int, ...], dtype: torch.dtype = torch.float32, offset: int = 0, nbytes: int | None = None
) -> TensorMeta:
    if nbytes is None:
        n = torch.empty(0, dtype=dtype).element_size()
        for s in shape:
            n *= s
        nbytes = n
    return TensorMeta(shape, dtype, offset, nbytes)


# (case id, field changes, expected reason). Each row breaks exactly one rule of _descriptor's docstring.
CASES = [
    ("empty agent", {"owner": Owner("", "127.0.0.1", 4242)}, Reason.DESCRIPTOR_MALFORMED),
    ("empty host", {"owner": Owner("a", "", 4242)}, Reason.DESCRIPTOR_MALFORMED),
    ("port 0", {"owner": Owner("a", "h", 0)}, Reason.DESCRIPTOR_MALFORMED),
    ("port 65536", {"owner": Owner("a", "h", 65536)}, Reason.DESCRIPTOR_MALFORMED),
    ("empty lease", {"lease_id": ""}, Reason.EMPTY_LEASE_ID),
    ("long lease", {"lease_id": "x" * 257}, Reason.DESCRIPTOR_MALFORMED),
    ("bad mem type", {"mem_type": "HBM"}, Reason.DESCRIPTOR_MALFORMED),
    ("slot addr 0", {"slot_addr": 0}, Reason.DESCRIPTOR_MALFORMED),
    ("gen addr 0", {"generation_addr": 0}, Reason.DESCRIPTOR_MALFORMED),
    ("gen addr unaligned", {"generation_addr": 0x7E0000000004}, Reason.DESCRIPTOR_MALFORMED),
    ("payload 0", {"payload_bytes": 0}, Reason.OUT_OF_BOUNDS),
    ("payload over max", {"payload_bytes": (1 << 30) + ALIGN}, Reason.SLOT_TOO_LARGE),
    ("address wraps", {"slot_addr": (1 << 64) - ALIGN}, Reason.OUT_OF_BOUNDS),
    ("empty manifest", {"manifest": ()}, Reason.EMPTY_MANIFEST),
    (
        "too many entries",
        {"manifest": tuple(m((0,)) for _ in range(MAX_MANIFEST_ENTRIES + 1))},
        Reason.DESCRIPTOR_MALFORMED,
    ),
    ("unsupported dtype", {"manifest": (TensorMeta((2,), torch.complex64, 0, 16),)}, Reason.UNSUPPORTED_DTYPE),
    ("negative dim", {"manifest": (TensorMeta((2, -1), torch.float32, 0, 0),)}, Reason.NEGATIVE_DIM),
    ("too many dims", {"manifest": (m((1,) * (MAX_DIMS + 1)),)}, Reason.DESCRIPTOR_MALFORMED),
    ("numel overflow", {"manifest": (TensorMeta((1 << 40, 1 << 40), torch.float32, 0, 0),)}, Reason.SIZE_OVERFLOW),
    ("bytes overflow", {"manifest": (TensorMeta((1 << 61,), torch.float64, 0, 0),)}, Reason.SIZE_OVERFLOW),
    ("nbytes mismatch", {"manifest": (m((2, 3), nbytes=20),)}, Reason.NBYTES_MISMATCH),
    ("bf16 read as fp32", {"manifest": (TensorMeta((4,), torch.float32, 0, 8),)}, Reason.NBYTES_MISMATCH),
    ("misaligned offset", {"manifest": (m((2,), offset=100),)}, Reason.MISALIGNED_OFFSET),
    ("past payload", {"manifest": (m((2 * ALIGN,), torch.uint8, offset=2 * ALIGN),)}, Reason.OUT_OF_BOUNDS),
    ("offset past payload", {"manifest": (m((0,), offset=4 * ALIGN),)}, Reason.OUT_OF_BOUNDS),
    (
        "overlap",
        {"manifest": (m((2 * ALIGN,), torch.uint8, 0), m((8,), torch.uint8, ALIGN))},
        Reason.OVERLAPPING_TENSORS,
    ),
    ("dim not int", {"manifest": (TensorMeta((2.0,), torch.float32, 0, 8),)}, Reason.DESCRIPTOR_MALFORMED),  # type: ignore[arg-type]
]


@pytest.mark.parametrize("changes,reason", [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_validate_rejects(changes: dict, reason: Reason) -> None:
    d = dataclasses.replace(valid(), **changes)
    with pytest.raises(InvalidDescriptor) as info:
        d.validate()
    assert info.value.reason is reason, info.value


@pytest.mark.parametrize("changes,reason", [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_from_bytes_rejects_the_same(changes: dict, reason: Reason) -> None:
    """The same rules hold on the wire path (rows that cannot be encoded are built as raw protobuf)."""
    d = dataclasses.replace(valid(), **changes)
    msg = pb.DescriptorPB()
    msg.ParseFromString(valid().to_bytes())
    o = d.owner
    msg.owner.agent_name, msg.owner.host = o.agent_name, o.host
    if 0 <= o.port < (1 << 32):
        msg.owner.port = o.port
    msg.lease_id = d.lease_id
    msg.mem_type = {"DRAM": pb.MEM_DRAM, "VRAM": pb.MEM_VRAM}.get(d.mem_type, 7)
    msg.slot_addr, msg.payload_bytes, msg.generation_addr = d.slot_addr, d.payload_bytes, d.generation_addr
    del msg.manifest[:]
    for e in d.manifest:
        from tensorwire.rdma import _dtypes

        wire = _dtypes.to_wire(e.dtype) if _dtypes.is_supported(e.dtype) else 99
        try:
            msg.manifest.add(shape=list(e.shape), dtype=wire, offset=e.offset, nbytes=e.nbytes)
        except TypeError:
            pytest.skip("not representable on the wire (float dim)")
    with pytest.raises(InvalidDescriptor) as info:
        Descriptor.from_bytes(msg.SerializeToString())
    expected = Reason.DESCRIPTOR_MALFORMED if reason is Reason.DESCRIPTOR_MALFORMED and d.mem_type == "HBM" else reason
    assert info.value.reason is expected, info.value


def test_from_bytes_rejects_version_garbage_and_size() -> None:
    msg = pb.DescriptorPB()
    msg.ParseFromString(valid().to_bytes())
    msg.version = 2
    with pytest.raises(InvalidDescriptor, match="version"):
        Descriptor.from_bytes(msg.SerializeToString())
    with pytest.raises(InvalidDescriptor, match="parse"):
        Descriptor.from_bytes(b"\xff\xff\xff")
    with pytest.raises(InvalidDescriptor, match="over"):
        Descriptor.from_bytes(b"\x00" * (MAX_DESCRIPTOR_BYTES + 1))
    with pytest.raises(InvalidDescriptor):
        Descriptor.from_bytes("not bytes")  # type: ignore[arg-type]
    with pytest.raises(InvalidDescriptor) as info:
        Descriptor.from_bytes(b"")
    assert info.value.reason is Reason.DESCRIPTOR_MALFORMED


def test_unspecified_dtype_is_rejected_on_the_wire() -> None:
    msg = pb.DescriptorPB()
    msg.ParseFromString(valid().to_bytes())
    msg.manifest[0].dtype = pb.DTYPE_UNSPECIFIED
    msg.manifest[0].legacy_dtype = pb.LEGACY_DTYPE_UNSPECIFIED  # alone it is an old owner's descriptor
    with pytest.raises(InvalidDescriptor) as info:
        Descriptor.from_bytes(msg.SerializeToString())
    assert info.value.reason is Reason.UNSUPPORTED_DTYPE


def test_limits_are_parameters() -> None:
    d = valid()
    with pytest.raises(InvalidDescriptor) as info:
        Descriptor.from_bytes(d.to_bytes(), max_slot_bytes=ALIGN)
    assert info.value.reason is Reason.SLOT_TOO_LARGE
    with pytest.raises(InvalidDescriptor) as info:
        Descriptor.from_bytes(d.to_bytes(), slot_align=8192)
    assert info.value.reason is Reason.MISALIGNED_OFFSET


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_mutated_bytes_only_raise_invalid_descriptor(data: st.DataObject) -> None:
    raw = bytearray(valid().to_bytes())
    for _ in range(data.draw(st.integers(1, 6))):
        op = data.draw(st.sampled_from(["flip", "set", "cut", "insert"]))
        if not raw:
            break
        i = data.draw(st.integers(0, len(raw) - 1))
        if op == "flip":
            raw[i] ^= 1 << data.draw(st.integers(0, 7))
        elif op == "set":
            raw[i] = data.draw(st.integers(0, 255))
        elif op == "cut":
            del raw[i : i + data.draw(st.integers(1, 8))]
        else:
            raw[i:i] = data.draw(st.binary(min_size=1, max_size=8))
    try:
        d = Descriptor.from_bytes(bytes(raw))
    except InvalidDescriptor:
        return
    d.validate()  # whatever parses is fully valid
    assert Descriptor.from_bytes(d.to_bytes()) == d


@pytest.mark.parametrize("typed", [None, {}])
def test_views_match_slicing_for_every_dtype_and_offset(typed):
    from tensorwire.rdma._descriptor import layout, views

    specs = [
        ((3, 5), torch.bfloat16),
        ((7,), torch.int8),
        ((2, 0, 4), torch.float32),
        ((), torch.int64),
        ((4, 3), torch.float64),
        ((9,), torch.uint8),
    ]
    manifest, payload = layout(specs, 8)  # small alignment: offsets not multiples of every item size
    buf = torch.arange(payload + 64, dtype=torch.int64).to(torch.uint8)[:payload]
    for _ in range(2):  # the second pass goes through the cached reinterpretations
        got = views(buf, manifest, typed)
        for t, m in zip(got, manifest, strict=True):
            want = buf[m.offset : m.offset + m.nbytes].view(m.dtype).view(m.shape)
            assert t.shape == want.shape and t.dtype == want.dtype and t.data_ptr() == want.data_ptr()
            assert t.is_contiguous()
            assert torch.equal(t.reshape(-1).view(torch.uint8), want.reshape(-1).view(torch.uint8))
    got[0].fill_(1.5)  # views, not copies
    assert torch.equal(buf[manifest[0].offset : manifest[0].offset + 2], torch.tensor([192, 63], dtype=torch.uint8))


def test_views_of_a_buffer_not_a_whole_number_of_items_fall_back_to_slices():
    from tensorwire.rdma._descriptor import layout, views

    manifest, payload = layout([((4,), torch.float32)], 8)
    buf = torch.arange(payload + 3, dtype=torch.uint8)  # cannot be reinterpreted as float32 as a whole
    typed: dict = {}
    (t,) = views(buf, manifest, typed)
    assert not typed and t.data_ptr() == buf.data_ptr() and t.shape == (4,) and t.dtype == torch.float32
    assert torch.equal(t.view(torch.uint8), buf[:16])


# -- parsed once: the memo of from_bytes and with_owner ----------------------------------------------------------


def test_equal_bytes_parse_to_the_same_descriptor_once_validated() -> None:
    data = valid().to_bytes()
    first = Descriptor.from_bytes(data)
    assert Descriptor.from_bytes(bytes(data)) is first and Descriptor.from_bytes(bytearray(data)) is first
    # Other limits are checked again, never answered from what the default limits passed.
    with pytest.raises(InvalidDescriptor):
        Descriptor.from_bytes(data, max_slot_bytes=ALIGN)


def test_a_rewritten_owner_is_parsed_from_memory_and_a_bad_one_is_refused() -> None:
    d = Descriptor.from_bytes(valid().to_bytes())
    o = dataclasses.replace(d.owner, metadata_token=b"t" * 16, pid=4242, host_id=b"h" * 16)
    d2 = d.with_owner(o)
    assert d2.owner == o and dataclasses.replace(d2, owner=d.owner) == d
    assert Descriptor.from_bytes(d2.to_bytes()) is d2
    for bad in (dataclasses.replace(o, agent_name=""), dataclasses.replace(o, pid=-1), dataclasses.replace(o, port=0)):
        with pytest.raises(InvalidDescriptor):
            d.with_owner(bad)


def test_bytes_of_a_descriptor_nobody_validated_are_still_checked() -> None:
    # A hand-built descriptor that breaks a rule (its generation does not match its binding) serializes fine; its
    # bytes must not be remembered as valid, with or without with_owner.
    bad = dataclasses.replace(valid(), binding=12345)
    for d in (bad, bad.with_owner(dataclasses.replace(bad.owner, pid=7))):
        with pytest.raises(InvalidDescriptor):
            Descriptor.from_bytes(d.to_bytes())
