"""``TensorReader.read(into=...)``: READ into caller-owned host memory, and a typed refusal of a wrong ``into``
before anything is registered or read (against the recording fake provider)."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch
from _rdma_fake import FakeProvider

from tensorwire.errors import InvalidPayload, Reason
from tensorwire.rdma import RdmaConfig, TensorExporter, TensorReader, register_provider
from tensorwire.rdma._registry import _REGISTRY

PAYLOAD = torch.arange(16, dtype=torch.float32)  # 64 bytes


@pytest.fixture
def fake_cfg() -> Iterator[RdmaConfig]:
    register_provider("fake", lambda: FakeProvider)
    try:
        yield RdmaConfig(provider="fake")
    finally:
        _REGISTRY.pop("fake", None)


def test_reads_into_the_given_buffer(fake_cfg: RdmaConfig) -> None:
    with TensorExporter(fake_cfg) as exp, TensorReader(fake_cfg) as rd:
        d = exp.export([PAYLOAD])
        buf = torch.zeros(d.payload_bytes + 8, dtype=torch.uint8)  # larger than needed is fine
        (out,) = rd.read([d], into=[buf])
        assert torch.equal(out, PAYLOAD)
        assert out.untyped_storage().data_ptr() == buf.untyped_storage().data_ptr()  # a view, no copy


BAD_INTO: dict[str, Callable[[int], Any]] = {
    "too small": lambda n: [torch.zeros(n - 1, dtype=torch.uint8)],
    "wrong dtype": lambda n: [torch.zeros(n, dtype=torch.float32)],
    "not contiguous": lambda n: [torch.zeros(2 * n, dtype=torch.uint8)[::2]],
    "not a tensor": lambda n: [bytearray(n)],
    "too many": lambda n: [torch.zeros(n, dtype=torch.uint8)] * 2,
    "none": lambda n: [],
}


@pytest.mark.parametrize("case", sorted(BAD_INTO))
def test_a_wrong_into_is_refused_before_anything_is_read(fake_cfg: RdmaConfig, case: str) -> None:
    with TensorExporter(fake_cfg) as exp, TensorReader(fake_cfg) as rd:
        d = exp.export([PAYLOAD])
        prov = rd._provider
        assert isinstance(prov, FakeProvider)
        events = len(prov.events)
        with pytest.raises(InvalidPayload, match="into") as info:
            rd.read([d], into=BAD_INTO[case](d.payload_bytes))
        assert info.value.reason is Reason.INVALID_REQUEST
        assert isinstance(info.value, ValueError)  # what callers caught before still catches it
        assert prov.events[events:] == []  # nothing registered, nothing read
        assert rd.stats().buffers.slot_allocations == 0
        (out,) = rd.read([d])  # the reader is unharmed
        assert torch.equal(out, PAYLOAD)


def test_a_gpu_reader_refuses_into(fake_cfg: RdmaConfig, monkeypatch: pytest.MonkeyPatch) -> None:
    with TensorExporter(fake_cfg) as exp, TensorReader(fake_cfg) as rd:
        d = exp.export([PAYLOAD])
        monkeypatch.setattr(rd, "_device", torch.device("cuda", 0))  # the check only: nothing is read
        with pytest.raises(InvalidPayload, match="host readers only") as info:
            rd.read([d], into=[torch.zeros(d.payload_bytes, dtype=torch.uint8)])
        assert info.value.reason is Reason.INVALID_REQUEST
