"""StagingArea.stage(into=...): misuse is a typed refusal (InvalidPayload, INVALID_REQUEST) before any read."""

from __future__ import annotations

import pytest
import torch
from fakes import rdma_receipt

from tensorwire.errors import InvalidPayload, Reason
from tensorwire.mm.held._staging import StagingArea


class _NotATensorReader:
    def __init__(self) -> None:
        self.reads = 0

    def read(self, *args: object, **kwargs: object) -> list[torch.Tensor]:
        self.reads += 1
        return []

    def close(self) -> None:
        pass


@pytest.mark.parametrize("case", ["device area", "other reader"])
def test_into_misuse_is_refused_with_a_reason(case: str) -> None:
    reader = _NotATensorReader()
    area = StagingArea(lambda: reader, device="cuda:0" if case == "device area" else "cpu")  # type: ignore[arg-type, return-value]
    try:
        with pytest.raises(InvalidPayload, match="into") as info:
            area.stage("k", rdma_receipt(), timeout_ms=1000, into=lambda n: torch.empty(n, dtype=torch.uint8))
        assert info.value.reason is Reason.INVALID_REQUEST and reader.reads == 0
        assert area.get("k") is None
    finally:
        area.close()
