"""StagingArea.stage(into=...): misuse is a typed refusal (InvalidPayload, INVALID_REQUEST) before any read."""

from __future__ import annotations

import pytest
import torch

from tensorwire.errors import InvalidPayload, Reason
from tensorwire.mm._proto import encoder_pb2 as pb
from tensorwire.mm.held._staging import StagingArea
from tensorwire.rdma import Descriptor, Owner, TensorMeta


class _NotATensorReader:
    def __init__(self) -> None:
        self.reads = 0

    def read(self, *args: object, **kwargs: object) -> list[torch.Tensor]:
        self.reads += 1
        return []

    def close(self) -> None:
        pass


def _receipt() -> pb.EncodeResponse:
    d = Descriptor(
        owner=Owner("tw-exporter-a", "127.0.0.1", 4242),
        mem_type="DRAM",
        device_id=0,
        slot_addr=0x7F0000000000,
        payload_bytes=4096,
        lease_id="abc-1",
        generation=7,
        generation_addr=0x7E0000000008,
        manifest=(TensorMeta((4, 4), torch.float32, 0, 64),),
    )
    r = pb.EncodeResponse()
    r.rdma_slots.add(descriptor=d.to_bytes(), roles=[pb.EMBEDDING])
    return r


@pytest.mark.parametrize("case", ["device area", "other reader"])
def test_into_misuse_is_refused_with_a_reason(case: str) -> None:
    reader = _NotATensorReader()
    area = StagingArea(lambda: reader, device="cuda:0" if case == "device area" else "cpu")  # type: ignore[arg-type, return-value]
    try:
        with pytest.raises(InvalidPayload, match="into") as info:
            area.stage("k", _receipt(), timeout_ms=1000, into=lambda n: torch.empty(n, dtype=torch.uint8))
        assert info.value.reason is Reason.INVALID_REQUEST and reader.reads == 0
        assert area.get("k") is None
    finally:
        area.close()
