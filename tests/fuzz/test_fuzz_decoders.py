"""Property tests: every decoder of another process's bytes answers a typed error or a consistent value.

Targets live in ``tensorwire.soak._fuzz_targets`` (shared with the high-volume driver); a target raises only
on a crash (a non-tensorwire exception) or an inconsistent value (an AssertionError), which fails the test.
Inputs: arbitrary bytes, seeds mutated byte by byte, and structured messages with arbitrary field values.
"""

from __future__ import annotations

import random

import pytest
from fuzz_settings import examples
from hypothesis import given, settings
from hypothesis import strategies as st

from tensorwire.mm._proto import encoder_pb2 as pb
from tensorwire.rdma._proto import descriptor_pb2 as dpb
from tensorwire.soak import _fuzz_targets as T
from tensorwire.soak._mutate import mutate, mutate_proto

pytestmark = pytest.mark.timeout(120)

_RNG = random.Random(0)
DESC_SEEDS = T.seed_descriptors(_RNG)
INLINE_SEEDS = T.seed_inline_tensors(_RNG)
HEADER_SEEDS, TABLE_SEEDS = T.seed_frames(_RNG)
HELLO_SEEDS = T.seed_hellos()

u64 = st.integers(0, 2**64 - 1)
i64 = st.integers(-(2**63), 2**63 - 1)
small = st.integers(-3, 70_000)
mutation_seed = st.integers(0, 2**32 - 1)


def _mutated(seeds: list[bytes], cls: object = None) -> st.SearchStrategy[bytes]:
    def build(s: int) -> bytes:
        rng = random.Random(s)
        if cls is not None and rng.random() < 0.5:
            return mutate_proto(rng.choice(seeds), cls, rng)
        return mutate(rng.choice(seeds), rng, seeds)

    return mutation_seed.map(build)


meta = st.builds(
    dpb.TensorMetaPB,
    shape=st.lists(st.one_of(small, i64), max_size=5),
    dtype=st.integers(-1, 12),
    offset=st.one_of(st.integers(0, 1 << 20), u64),
    nbytes=st.one_of(st.integers(0, 1 << 20), u64),
)
descriptor_msg = st.builds(
    dpb.DescriptorPB,
    version=st.integers(0, 3),
    owner=st.builds(
        dpb.OwnerPB,
        agent_name=st.text(max_size=8),
        host=st.sampled_from(["", "127.0.0.1", "::1", "h"]),
        port=st.integers(0, 70_000),
        registration_epoch=u64,
    ),
    mem_type=st.integers(-1, 3),
    device_id=st.integers(0, 2**32 - 1),
    slot_addr=u64,
    payload_bytes=st.one_of(st.integers(0, 1 << 22), u64),
    lease_id=st.text(max_size=8),
    generation=u64,
    generation_addr=u64,
    manifest=st.lists(meta, max_size=4),
)


@settings(max_examples=examples(300))
@given(
    st.one_of(
        st.binary(max_size=512),
        _mutated(DESC_SEEDS, dpb.DescriptorPB),
        descriptor_msg.map(lambda m: m.SerializeToString()),
    )
)
def test_descriptor_bytes(data: bytes) -> None:
    assert T.target_descriptor(data).startswith(("ok", "typed:"))


@settings(max_examples=examples(300))
@given(
    st.one_of(
        st.binary(max_size=512),
        _mutated(INLINE_SEEDS, pb.Tensor),
        st.builds(
            pb.Tensor,
            dtype=st.integers(-1, 12),
            shape=st.lists(st.one_of(small, i64), max_size=5),
            data=st.binary(max_size=256),
        ).map(lambda m: m.SerializeToString()),
    )
)
def test_inline_tensor_payload(data: bytes) -> None:
    assert T.target_inline_tensor(data).startswith(("ok", "typed:"))


@pytest.fixture(scope="module")
def receipt_harness() -> T.ReceiptHarness:
    h = T.ReceiptHarness()
    yield h
    h.close()


RECEIPT_SEEDS = T.seed_receipts(random.Random(1))
slot = st.builds(
    pb.RdmaSlot,
    descriptor=st.one_of(st.sampled_from(DESC_SEEDS), _mutated(DESC_SEEDS, dpb.DescriptorPB)),
    roles=st.lists(st.integers(-1, 4), max_size=4),
)
tensor = st.builds(
    pb.Tensor, dtype=st.integers(0, 11), shape=st.lists(st.integers(-1, 6), max_size=3), data=st.binary(max_size=96)
)
receipt_msg = st.builds(
    pb.EncodeResponse,
    embedding=st.one_of(st.none(), tensor),
    position_ids=st.one_of(st.none(), tensor),
    extra_inputs=st.lists(tensor, max_size=2),
    split_sizes=st.lists(st.integers(-2, 8), max_size=3),
    rdma_slots=st.lists(slot, max_size=2),
)


@settings(max_examples=examples(300))
@given(
    st.one_of(
        st.binary(max_size=512),
        _mutated(RECEIPT_SEEDS, pb.EncodeResponse),
        receipt_msg.map(lambda m: m.SerializeToString()),
    )
)
def test_receipt_through_the_client(receipt_harness: T.ReceiptHarness, data: bytes) -> None:
    assert receipt_harness(data).startswith(("ok", "typed:"))


STREAM_SEEDS = T.seed_stream_answers(random.Random(2))
stream_msg = st.builds(pb.StreamResponse, id=u64, receipt=receipt_msg)


def _concat(parts: list[bytes]) -> bytes:
    return b"".join(parts)  # repeated records: protobuf merges them, the walk must too


@settings(max_examples=examples(300))
@given(
    st.one_of(
        st.binary(max_size=512),
        _mutated(RECEIPT_SEEDS, pb.EncodeResponse),
        receipt_msg.map(lambda m: m.SerializeToString()),
        st.lists(
            st.one_of(st.sampled_from(RECEIPT_SEEDS), receipt_msg.map(lambda m: m.SerializeToString())),
            min_size=2,
            max_size=3,
        ).map(_concat),
    )
)
def test_receipt_walk_reads_what_protobuf_reads(data: bytes) -> None:
    assert T.target_receipt_wire(data).startswith(("ok", "typed:"))


@settings(max_examples=examples(300))
@given(
    st.one_of(
        st.binary(max_size=512),
        _mutated(STREAM_SEEDS, pb.StreamResponse),
        stream_msg.map(lambda m: m.SerializeToString()),
        st.lists(st.sampled_from(STREAM_SEEDS), min_size=2, max_size=3).map(_concat),
    )
)
def test_stream_answer_walk_reads_what_protobuf_reads(data: bytes) -> None:
    assert T.target_stream_wire(data).startswith(("ok", "typed:"))


def test_receipt_seeds_decode(receipt_harness: T.ReceiptHarness) -> None:
    # The harness can fail: well-formed receipts come back as outputs, not errors.
    assert [receipt_harness(s) for s in RECEIPT_SEEDS] == ["ok"] * len(RECEIPT_SEEDS)


@settings(max_examples=examples(300))
@given(st.one_of(st.binary(max_size=64), _mutated(HEADER_SEEDS)))
def test_broadcaster_frame_header(data: bytes) -> None:
    assert T.target_frame_header(data).startswith(("ok", "typed:"))


@settings(max_examples=examples(300))
@given(st.one_of(st.binary(max_size=256), _mutated(TABLE_SEEDS)))
def test_broadcaster_frame_table(data: bytes) -> None:
    assert T.target_frame_table(data).startswith(("ok", "typed:"))


@settings(max_examples=examples(300))
@given(st.one_of(st.binary(max_size=64), _mutated(HELLO_SEEDS)))
def test_broadcaster_handshake_validation(data: bytes) -> None:
    assert T.HelloHarness()(data).startswith(("ok", "typed:"))


def test_seeds_are_accepted() -> None:
    assert all(T.target_descriptor(s) == "ok" for s in DESC_SEEDS)
    assert all(T.target_inline_tensor(s) == "ok" for s in INLINE_SEEDS)
    assert all(T.target_receipt_wire(s) == "ok" for s in RECEIPT_SEEDS)
    assert all(T.target_stream_wire(s) == "ok" for s in STREAM_SEEDS)
    assert all(T.target_frame_header(s) == "ok" for s in HEADER_SEEDS)
    assert all(T.target_frame_table(s) == "ok" for s in TABLE_SEEDS)
    assert all(T.HelloHarness()(s) == "ok" for s in HELLO_SEEDS)
