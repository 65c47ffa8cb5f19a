from __future__ import annotations

import pytest
import torch

from tensorwire.errors import InvalidPayload, Reason
from tensorwire.mm._proto import encoder_pb2 as pb
from tensorwire.mm.wire import _codec
from tensorwire.mm.wire._receipt import WireReceipt


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.reshape(-1).view(torch.uint8) if t.dtype != torch.bool else t.reshape(-1)


@pytest.mark.parametrize("dtype", sorted(_codec.SUPPORTED_DTYPES, key=str))
@pytest.mark.parametrize("shape", [(), (0,), (3,), (2, 5), (4, 0, 3), (2, 3, 4)])
def test_round_trip_every_dtype_and_shape(dtype: torch.dtype, shape: tuple[int, ...]) -> None:
    g = torch.Generator().manual_seed(1)
    if dtype == torch.bool:
        src = torch.rand(shape, generator=g) > 0.5
    else:
        src = (torch.randn(shape, generator=g) * 50).to(dtype)
    msg = pb.Tensor.FromString(_codec.encode_tensor(src).SerializeToString())
    out = _codec.decode_tensor(msg)
    assert out.dtype == dtype and tuple(out.shape) == shape
    assert torch.equal(_bits(out), _bits(src))  # bitwise: NaN payloads and -0.0 must survive too
    if out.numel():
        out.view(-1)[0] = out.view(-1)[0]  # owning and writable


def test_bfloat16_bits_survive() -> None:
    src = torch.tensor([1.0, -2.5, float("inf"), 3.140625], dtype=torch.bfloat16)
    out = _codec.decode_tensor(_codec.encode_tensor(src))
    assert torch.equal(out.view(torch.int16), src.view(torch.int16))


def test_decoded_tensor_does_not_alias_the_message() -> None:
    msg = _codec.encode_tensor(torch.arange(4, dtype=torch.int32))
    out = _codec.decode_tensor(msg)
    msg.data = b"\x00" * 16
    assert out.tolist() == [0, 1, 2, 3]


@pytest.mark.parametrize(
    "mutate,reason",
    [
        (lambda m: setattr(m, "dtype", pb.DTYPE_UNSPECIFIED), Reason.UNSUPPORTED_DTYPE),
        (lambda m: setattr(m, "dtype", 99), Reason.UNSUPPORTED_DTYPE),
        (lambda m: m.shape.__setitem__(0, -2), Reason.NEGATIVE_DIM),
        (lambda m: m.shape.extend([2**40, 2**40]), Reason.SIZE_OVERFLOW),
        (lambda m: m.shape.extend([1] * 20), Reason.SIZE_OVERFLOW),
        (lambda m: setattr(m, "data", m.data + b"\x00"), Reason.NBYTES_MISMATCH),
        (lambda m: setattr(m, "data", m.data[:-1]), Reason.NBYTES_MISMATCH),
        (lambda m: setattr(m, "data", b""), Reason.NBYTES_MISMATCH),
    ],
)
def test_malformed_payload_rejected_before_materializing(mutate, reason: Reason) -> None:  # type: ignore[no-untyped-def]
    msg = _codec.encode_tensor(torch.ones(2, 3, dtype=torch.float32))
    mutate(msg)
    with pytest.raises(InvalidPayload) as ei:
        _codec.decode_tensor(msg)
    assert ei.value.reason is reason


def test_empty_message_is_not_a_float32_scalar() -> None:
    with pytest.raises(InvalidPayload):
        _codec.decode_tensor(pb.Tensor())


def test_assemble_checks_every_invariant() -> None:
    emb = torch.arange(10.0).reshape(5, 2)
    pos_ids = torch.arange(5).reshape(5, 1)
    embs, pos, extras = _codec.split_per_item(emb, [2, 3], pos_ids, [torch.ones(1), torch.ones(2)])
    assert [e.shape[0] for e in embs] == [2, 3] and pos is not None and [p.shape[0] for p in pos] == [2, 3]
    with pytest.raises(InvalidPayload, match="sum"):
        _codec.split_per_item(emb, [2, 2], None, [])
    with pytest.raises(InvalidPayload, match="position ids"):
        _codec.split_per_item(emb, [2, 3], torch.arange(4).reshape(4, 1), [])
    with pytest.raises(InvalidPayload, match="extra_input count"):
        _codec.split_per_item(emb, [2, 3], None, [torch.ones(1)] * 3)
    with pytest.raises(InvalidPayload, match="scalar"):
        _codec.split_per_item(torch.tensor(1.0), [1], None, [])
    with pytest.raises(InvalidPayload, match="negative"):
        _codec.split_per_item(emb, [7, -2], None, [])
    with pytest.raises(InvalidPayload, match="no embedding"):
        _codec.split_per_item(None, [1], None, [])
    assert _codec.split_per_item(None, [], None, []) == ([], None, [])


def test_inline_receipt_decode_rejects_inconsistent_receipts() -> None:
    r = pb.EncodeResponse(split_sizes=[2, 3])
    _codec.encode_tensor(torch.zeros(5, 4), r.embedding)
    _codec.encode_tensor(torch.zeros(4, 1), r.position_ids)  # 4 rows, split total 5
    with pytest.raises(InvalidPayload, match="position ids"):
        _codec.decode_inline_receipt(WireReceipt.from_message(r))
    r.ClearField("position_ids")
    for _ in range(3):
        _codec.encode_tensor(torch.zeros(1), r.extra_inputs.add())
    with pytest.raises(InvalidPayload, match="extra_input count"):
        _codec.decode_inline_receipt(WireReceipt.from_message(r))
    empty = _codec.decode_inline_receipt(WireReceipt())
    assert empty[:4] == ([], [], None, []) and empty[4] == 0
