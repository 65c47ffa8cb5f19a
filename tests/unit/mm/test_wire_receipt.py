"""WireReceipt: inline tensor bytes written once on the encoder, viewed (not copied) on the client, and the bytes
on the wire stay what any protobuf parser reads as the same EncodeResponse / StreamResponse (old peers)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from tensorwire.errors import InvalidPayload, Reason
from tensorwire.mm import EncoderOutput, OutputTransport, TransportConfig
from tensorwire.mm._proto import encoder_pb2 as pb
from tensorwire.mm.wire import _codec
from tensorwire.mm.wire._protobuf import WireError
from tensorwire.mm.wire._receipt import (
    ALIGN,
    UPB_MAX_BYTES,
    WireReceipt,
    parse_receipt,
    parse_stream_response,
    read_stream_response,
)

BIG = _codec.VIEW_MIN_BYTES  # from here on the client views the payload instead of copying it


@pytest.fixture(scope="module")
def transport() -> OutputTransport:
    t = OutputTransport(TransportConfig(mode="grpc", worker_id="w"))
    yield t
    t.close()


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.reshape(-1).view(torch.uint8) if t.dtype != torch.bool else t.reshape(-1)


def _inside(t: torch.Tensor, raw: bytes) -> bool:
    start = np.frombuffer(raw, dtype=np.uint8).ctypes.data
    return start <= t.data_ptr() and t.data_ptr() + t.numel() * t.element_size() <= start + len(raw)


def _output(dtype: torch.dtype, rows: int, cols: int) -> EncoderOutput:
    g = torch.Generator().manual_seed(rows)
    emb = (
        (torch.randn(rows, cols, generator=g) * 50).to(dtype)
        if dtype != torch.bool
        else torch.rand(rows, cols, generator=g) > 0.5
    )
    half = rows // 2
    return EncoderOutput(
        embeddings=emb,
        split_sizes=[half, rows - half],
        position_ids=torch.arange(rows * 3, dtype=torch.int64).reshape(rows, 3),
        extra_inputs=[torch.randn(2, 3, generator=g), torch.ones(0, 4)],
    )


def _decode(raw: bytes, framed: bool) -> tuple[WireReceipt, list[torch.Tensor], list[torch.Tensor], list[torch.Tensor]]:
    if framed:
        message_id, receipt = parse_stream_response(raw)
        assert message_id == 2**40 + 3 and isinstance(receipt, WireReceipt)
    else:
        receipt = parse_receipt(raw)
    embs, _splits, pos, extras, _n = _codec.decode_inline_receipt(receipt)
    assert pos is not None
    return receipt, embs, pos, extras


@pytest.mark.parametrize("framed", [False, True], ids=["unary", "stream"])
@pytest.mark.parametrize("dtype", sorted(_codec.SUPPORTED_DTYPES, key=str))
@pytest.mark.parametrize("rows", [2, 9, 301])
def test_round_trip_views_the_received_bytes(
    transport: OutputTransport, dtype: torch.dtype, rows: int, framed: bool
) -> None:
    out = _output(dtype, rows, 113)  # an odd row width: nothing lines up by accident
    receipt = transport.transfer(pb.EncodeRequest(), out)
    raw = receipt.to_stream_frame(2**40 + 3) if framed else receipt.to_bytes()
    _, embs, pos, extras = _decode(raw, framed)
    assert torch.equal(_bits(torch.cat(embs)), _bits(out.embeddings))  # bitwise: NaN payloads, -0.0 survive
    assert torch.equal(torch.cat(pos), out.position_ids) and len(extras) == 2
    assert torch.equal(extras[0], out.extra_inputs[0]) and extras[1].shape == (0, 4)
    emb = embs[0]
    nbytes = rows * 113 * emb.element_size()
    # Zero copy from VIEW_MIN_BYTES on, aligned for the dtype; below it an owning copy.
    assert _inside(emb, raw) == (nbytes >= BIG)
    assert emb.data_ptr() % ALIGN == 0 if nbytes >= BIG else True
    emb.view(-1)[0] = emb.view(-1)[-1]  # writable either way


@pytest.mark.parametrize("framed", [False, True], ids=["unary", "stream"])
def test_an_old_client_reads_the_same_message(transport: OutputTransport, framed: bool) -> None:
    receipt = transport.transfer(pb.EncodeRequest(), _output(torch.bfloat16, 301, 113))
    want = receipt.to_message()
    if framed:
        got = pb.StreamResponse.FromString(receipt.to_stream_frame(9))
        assert got.id == 9 and got.WhichOneof("body") == "receipt"
        got = got.receipt
    else:
        got = pb.EncodeResponse.FromString(receipt.to_bytes())
    got.DiscardUnknownFields()  # the padding records
    assert got == want and got.embedding.data == bytes(receipt.embedding)


def test_an_old_encoders_receipt_decodes_even_unaligned() -> None:
    emb = torch.arange(BIG // 4 * 3, dtype=torch.float32).reshape(3, -1)
    msg = pb.EncodeResponse(split_sizes=[3])
    _codec.encode_tensor(emb, msg.embedding)
    viewed = set()
    for shift in range(8):  # moves the payload's offset through every residue
        raw = _old_layout(msg, shift)
        embs, splits, _, _, n = _codec.decode_inline_receipt(parse_receipt(raw))
        assert splits == [3] and n == emb.numel() * 4 and torch.equal(embs[0], emb)
        assert embs[0].data_ptr() % 4 == 0  # copied when the sender did not align it
        viewed.add(_inside(embs[0], raw))
    assert viewed == {True, False}  # both the view and the copy were taken


def _old_layout(msg: pb.EncodeResponse, shift: int) -> bytes:
    """What protobuf itself writes (fields in number order, minimal varints), with ``shift`` bytes of an unknown
    field first so that the payload lands at every offset."""
    return bytes([0xFA, 0x01, shift]) + bytes(shift) + msg.SerializeToString()  # field 31, length-delimited


def test_repeated_records_merge_as_protobuf_merges_them(transport: OutputTransport) -> None:
    a = transport.transfer(pb.EncodeRequest(), _output(torch.float32, 4, 8)).to_bytes()
    b = transport.transfer(pb.EncodeRequest(), _output(torch.float32, 6, 8)).to_bytes()
    for raw in (a + b, b + a, a + a):
        want = pb.EncodeResponse.FromString(raw)
        want.DiscardUnknownFields()
        got = parse_receipt(raw).to_message()
        got.DiscardUnknownFields()
        assert got == want  # shapes appended, the last data wins, extra inputs accumulate


@pytest.mark.parametrize(
    "raw",
    [
        b"\x0a\x05\x08\x01",  # a tensor record longer than the message
        b"\x0a\x03\x1a\x05ab",  # data longer than its tensor
        b"\x0a\x80",  # truncated length
        b"\x20" + b"\xff" * 10 + b"\x01",  # an 11-byte varint
        b"\x0a\x86\x80\x80\x80\x80\x00",  # a 6-byte length (upb refuses it too)
        b"\x00\x01",  # field number 0
        b"\x0b\x0c",  # a group
        b"\x0f",  # wire type 7
    ],
)
def test_malformed_framing_is_refused_before_anything_is_sliced(raw: bytes) -> None:
    with pytest.raises(WireError):
        parse_receipt(raw)
    framed = b"\x08\x01\x12" + bytes([len(raw)]) + raw
    with pytest.raises(WireError):
        parse_stream_response(framed)
    if raw == b"\x0b\x0c":  # protobuf's own parser (small answers) skips an unknown group, as every peer's does
        assert read_stream_response(framed)[0] == 1
        return
    with pytest.raises(WireError):
        read_stream_response(framed)


def test_validation_still_applies_to_viewed_payloads(transport: OutputTransport) -> None:
    receipt = transport.transfer(pb.EncodeRequest(), EncoderOutput(embeddings=torch.zeros(BIG // 4, 2)))
    parsed = parse_receipt(receipt.to_bytes())
    parsed.embedding = parsed.embedding[:-1]  # type: ignore[index]
    with pytest.raises(InvalidPayload) as ei:
        _codec.decode_inline_receipt(parsed)
    assert ei.value.reason is Reason.NBYTES_MISMATCH
    parsed = parse_receipt(receipt.to_bytes())
    parsed.message.embedding.dtype = pb.DTYPE_UNSPECIFIED
    with pytest.raises(InvalidPayload) as ei:
        _codec.decode_inline_receipt(parsed)
    assert ei.value.reason is Reason.UNSUPPORTED_DTYPE


def test_the_encoder_views_a_host_output_and_copies_only_what_it_must(transport: OutputTransport) -> None:
    emb = torch.randn(64, 32)
    receipt = transport.transfer(pb.EncodeRequest(), EncoderOutput(embeddings=emb))
    assert np.frombuffer(receipt.embedding, dtype=np.uint8).ctypes.data == emb.data_ptr()  # type: ignore[arg-type]
    strided = torch.randn(32, 64).t()
    receipt = transport.transfer(pb.EncodeRequest(), EncoderOutput(embeddings=strided))
    assert bytes(receipt.embedding) == strided.contiguous().numpy().tobytes()  # type: ignore[arg-type]
    view = _codec.host_view(emb, pb.Tensor(), private=True)
    assert np.frombuffer(view, dtype=np.uint8).ctypes.data != emb.data_ptr()


def test_decoded_tensors_keep_the_bytes_alive_and_do_not_share_them(transport: OutputTransport) -> None:
    out = _output(torch.float32, BIG // 100 + 3, 100)
    raw = transport.transfer(pb.EncodeRequest(), out).to_bytes()
    _, embs, pos, _ = _decode(raw, framed=False)
    del raw
    embs[0].fill_(7.0)  # the first item's rows only
    assert torch.equal(embs[1], out.embeddings[embs[0].shape[0] :])  # type: ignore[index]
    assert torch.equal(torch.cat(pos), out.position_ids)


def test_a_receipt_over_protobufs_limit_is_refused() -> None:
    huge = np.zeros(2**31, dtype=np.uint8)  # calloc: no page is touched
    msg = pb.EncodeResponse(split_sizes=[1])
    msg.embedding.dtype = pb.UINT8
    msg.embedding.shape[:] = [1, 2**31]
    with pytest.raises(InvalidPayload) as ei:
        WireReceipt(msg, embedding=memoryview(huge)).to_bytes()
    assert ei.value.reason is Reason.SIZE_OVERFLOW


def test_from_message_and_to_message_are_inverse() -> None:
    msg = pb.EncodeResponse(split_sizes=[2])
    _codec.encode_tensor(torch.arange(6).reshape(2, 3), msg.embedding)
    _codec.encode_tensor(torch.ones(1), msg.extra_inputs.add())
    w = WireReceipt.from_message(msg)
    assert not w.message.embedding.data and bytes(w.embedding) == msg.embedding.data  # type: ignore[arg-type]
    assert w.to_message() == msg and w.payload_bytes == 6 * 8 + 4
    assert msg.embedding.data  # the caller's message is left alone


def _slots_receipt() -> WireReceipt:
    msg = pb.EncodeResponse(split_sizes=[3, 4])
    msg.worker.worker_id = "w-1"
    msg.rdma_slots.add(descriptor=b"d" * 40, roles=[pb.EMBEDDING])
    msg.placed.buffer_id = 7
    msg.placed.tensors.add(role=pb.EMBEDDING, dtype=pb.BFLOAT16, shape=[7, 16], offset=512, nbytes=224)
    msg.encoder_stage_us["place"] = 12
    return WireReceipt(msg)


@pytest.mark.parametrize("framed", [False, True], ids=["unary", "stream"])
def test_a_receipt_without_inline_tensors_is_protobufs_own_bytes(framed: bool) -> None:
    """The fast path for RDMA and placed receipts (serialized as they are) writes what protobuf reads back whole."""
    receipt = _slots_receipt()
    if framed:
        raw = receipt.to_stream_frame(2**33 + 1)
        want = pb.StreamResponse(id=2**33 + 1)
        want.receipt.CopyFrom(receipt.message)
        assert pb.StreamResponse.FromString(raw) == want
        assert raw == b"".join(bytes(p) for p in receipt.to_stream_pieces(2**33 + 1))
    else:
        raw = receipt.to_bytes()
        assert raw == receipt.message.SerializeToString()
    assert (
        pb.EncodeResponse.FromString(
            raw if not framed else pb.StreamResponse.FromString(raw).receipt.SerializeToString()
        )
        == receipt.message
    )


@pytest.mark.parametrize("rows", [2, 30, 4000])
def test_read_stream_response_reads_what_the_walk_reads(transport: OutputTransport, rows: int) -> None:
    """Protobuf's parser for small answers, the walk for large ones: the same receipt either way; only a large
    answer's payloads view the received bytes."""
    out = _output(torch.float32, rows, 113)
    raw = bytearray(transport.transfer(pb.EncodeRequest(), out).to_stream_frame(5))
    got_id, got = read_stream_response(raw)
    want_id, want = parse_stream_response(raw)
    assert got_id == want_id == 5 and isinstance(got, WireReceipt) and isinstance(want, WireReceipt)
    assert got.to_message() == want.to_message()
    assert isinstance(got.embedding, memoryview) == (len(raw) > UPB_MAX_BYTES)
    embs, _, pos, _, _ = _codec.decode_inline_receipt(got)
    assert torch.equal(torch.cat(embs), out.embeddings) and pos is not None


def test_read_stream_response_reads_receipts_errors_and_unknown_bodies() -> None:
    receipt = _slots_receipt()
    got_id, got = read_stream_response(receipt.to_stream_frame(9))
    assert got_id == 9 and isinstance(got, WireReceipt) and got.message == receipt.message
    err = pb.StreamResponse(id=4, error=pb.StreamError(code=5, message="gone"))
    assert read_stream_response(err.SerializeToString()) == (4, err.error)
    assert read_stream_response(pb.StreamResponse(id=3).SerializeToString()) == (3, None)
    # A later body replaces an earlier one (protobuf's oneof rule), as in the walk.
    both = receipt.to_stream_frame(9) + err.SerializeToString()
    assert read_stream_response(both) == parse_stream_response(both) == (4, err.error)
