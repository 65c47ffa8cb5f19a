"""Inputs the fuzzers found that once crashed a decoder; each must now get a typed error."""

from __future__ import annotations

import pytest

from tensorwire.errors import InvalidPayload, Reason
from tensorwire.mm._proto import encoder_pb2 as pb
from tensorwire.mm.wire import _codec
from tensorwire.soak._fuzz_targets import target_inline_tensor

# Found by `python -m tensorwire.soak.fuzz --inputs 1000000` (84 of 150,000 inline-tensor inputs): a zero dim made
# numel 0, so the size check passed for [0, 3, 2**63-1] and torch.empty raised RuntimeError("Stride calculation
# overflowed"), an untyped exception out of RemoteOutputTransport.fetch on an inline receipt.
CRASHERS = [
    "0805120b0003ffffffffffffffff7f",
    "0805120f00ffffffffffffffff7fffffffff07",
    "0805121300ffffffffffffffff7fffffffffffffffff7f",
]


@pytest.mark.parametrize("hex_input", CRASHERS)
def test_zero_dim_with_huge_dims_is_a_size_overflow(hex_input: str) -> None:
    assert target_inline_tensor(bytes.fromhex(hex_input)) == "typed:size_overflow"


def test_empty_tensors_with_real_shapes_still_decode() -> None:
    for shape in ([0], [0, 2048], [3, 0, 5], [0, 1 << 20]):
        t = _codec.decode_tensor(pb.Tensor(dtype=pb.FLOAT32, shape=shape, data=b""))
        assert list(t.shape) == shape and t.numel() == 0
    with pytest.raises(InvalidPayload) as err:
        _codec.decode_tensor(pb.Tensor(dtype=pb.FLOAT32, shape=[0, 1 << 40], data=b""))
    assert err.value.reason is Reason.SIZE_OVERFLOW
