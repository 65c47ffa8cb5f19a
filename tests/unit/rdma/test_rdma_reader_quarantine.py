"""Reader timeout handling against a fake provider whose READ "hangs": the destination is quarantined."""

from __future__ import annotations

import pytest
import torch
from _rdma_fake import FakePending, FakeProvider

from tensorwire.errors import ReadTimeout
from tensorwire.rdma import RdmaConfig, TensorExporter, TensorReader, register_provider
from tensorwire.rdma.providers import _REGISTRY


@pytest.fixture
def fake_cfg() -> RdmaConfig:
    register_provider("fake", lambda: FakeProvider)
    try:
        yield RdmaConfig(provider="fake")
    finally:
        _REGISTRY.pop("fake", None)


def test_timed_out_buffer_is_not_reused_until_the_transfer_finishes(fake_cfg: RdmaConfig) -> None:
    with TensorExporter(fake_cfg) as exp, TensorReader(fake_cfg) as rd:
        d = exp.export([torch.arange(16, dtype=torch.float32)])
        prov = rd._provider
        assert isinstance(prov, FakeProvider)
        pending = FakePending()
        prov.hang_next = pending
        with pytest.raises(ReadTimeout):
            rd.read([d])
        st = rd.stats()
        assert st.quarantined == 1 and st.quarantine_live == 1 and st.read_timeouts == 1
        assert st.buffers.busy_slots == 1  # still held for the engine
        # A new read must get another buffer while the first is quarantined.
        out = rd.read([d])
        assert torch.equal(out[0], torch.arange(16, dtype=torch.float32))
        assert rd.stats().buffers.busy_slots == 1 and rd.stats().buffers.slot_allocations == 2
        pending.finished.set()
        rd.read([d])  # drains the quarantine first
        st = rd.stats()
        assert st.quarantine_live == 0 and st.quarantine_freed == 1 and st.buffers.busy_slots == 0


def test_close_abandons_what_is_still_in_flight(fake_cfg: RdmaConfig) -> None:
    with TensorExporter(fake_cfg) as exp:
        rd = TensorReader(fake_cfg)
        d = exp.export([torch.ones(4)])
        pending = FakePending()
        rd._provider.hang_next = pending  # type: ignore[union-attr]
        with pytest.raises(ReadTimeout):
            rd.read([d])
        rd.close()
        assert pending.abandoned
        rd.close()  # idempotent


def test_zero_budget_fails_before_touching_memory(fake_cfg: RdmaConfig) -> None:
    with TensorExporter(fake_cfg) as exp, TensorReader(fake_cfg) as rd:
        d = exp.export([torch.ones(4)])
        with pytest.raises(ReadTimeout):
            rd.read([d], timeout_ms=0)
        assert rd.stats().buffers.slot_allocations == 0
