"""OutputTransport.allocate_output: an allocation never outlives its request, whatever path the answer takes.

In-process with a real TensorExporter (NIXL over loopback); the two-process read of a zero-copy output is in
test_nixl_transport.py.
"""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
import pytest
import torch
from prometheus_client import CollectorRegistry

from tensorwire.errors import InvalidPayload
from tensorwire.mm import EncoderOutput, OutputBuffers, OutputTransport, TransportConfig, TransportMetrics
from tensorwire.mm._proto import encoder_pb2 as pb
from tensorwire.rdma import Descriptor, has_rdma

pytestmark = [pytest.mark.timeout(120), pytest.mark.skipif(not has_rdma(), reason="NIXL provider not importable")]


@pytest.fixture
def transport() -> Iterator[OutputTransport]:
    t = OutputTransport(TransportConfig(worker_id="zc"), metrics=TransportMetrics(CollectorRegistry()))
    t.start()
    assert t.wait_ready(30)
    try:
        yield t
    finally:
        t.close()


def live(t: OutputTransport) -> int:
    exporter = t._holder.get()
    assert exporter is not None
    return exporter.stats().live_leases


def fill(b: OutputBuffers) -> OutputBuffers:
    b.embedding.copy_(torch.arange(b.embedding.numel(), dtype=torch.float32).reshape(b.embedding.shape))
    if b.position_ids is not None:
        b.position_ids.copy_(torch.arange(b.position_ids.numel()).reshape(b.position_ids.shape))
    return b


def test_published_in_place_and_only_once(transport: OutputTransport) -> None:
    b = fill(transport.allocate_output(4, 8, torch.float32, position_cols=2))  # type: ignore[arg-type]
    r = transport.transfer(
        pb.EncodeRequest(support_rdma=True),
        EncoderOutput(embeddings=b.embedding, split_sizes=[1, 3], position_ids=b.position_ids),
    )
    assert len(r.message.rdma_slots) == 1 and list(r.message.rdma_slots[0].roles) == [pb.EMBEDDING, pb.POS_ID]
    d = Descriptor.from_bytes(r.message.rdma_slots[0].descriptor)
    assert d.lease_id == b.lease.lease_id and [m.shape for m in d.manifest] == [(4, 8), (4, 2)]
    # The allocation's cost is reported, so benchmarks count it as transfer rather than the encoder's compute.
    assert r.message.encoder_stage_us["allocate"] == b.allocate_us and b.allocate_us > 0
    assert live(transport) == 1  # the reader's now
    transport.release([d.lease_id])
    assert live(transport) == 0


def test_other_paths_release_the_allocation(transport: OutputTransport) -> None:
    # Output is not the buffers (a copy): exported by copy, the allocation released.
    b = fill(transport.allocate_output(4, 8, torch.float32))  # type: ignore[arg-type]
    r = transport.transfer(
        pb.EncodeRequest(support_rdma=True), EncoderOutput(embeddings=b.embedding.clone(), split_sizes=[4])
    )
    slots = r.message.rdma_slots
    assert len(slots) == 1 and Descriptor.from_bytes(slots[0].descriptor).lease_id != b.lease.lease_id
    assert live(transport) == 1
    transport.release([Descriptor.from_bytes(r.message.rdma_slots[0].descriptor).lease_id])
    # The caller did not ask for RDMA: serialized inline from the buffers, then released.
    b = fill(transport.allocate_output(4, 8, torch.float32))  # type: ignore[arg-type]
    expected = b.embedding.clone()
    r = transport.transfer(pb.EncodeRequest(support_rdma=False), EncoderOutput(embeddings=b.embedding, split_sizes=[4]))
    assert not r.message.rdma_slots and bytes(r.embedding) == expected.numpy().tobytes()
    # The receipt is serialized after transfer() returned the slot to the pool: it must hold a copy, not a view.
    start = b.embedding.data_ptr()
    held = np.frombuffer(r.embedding, dtype=np.uint8).ctypes.data
    assert not start <= held < start + b.embedding.numel() * b.embedding.element_size()
    # The encoder failed after allocating.
    transport.release_output(transport.allocate_output(2, 8, torch.float32))  # type: ignore[arg-type]
    assert live(transport) == 0
    # The encoder returned an inconsistent output (split sizes do not sum to the rows).
    b = transport.allocate_output(4, 8, torch.float32)
    assert b is not None
    with pytest.raises(InvalidPayload):
        transport.transfer(pb.EncodeRequest(support_rdma=True), EncoderOutput(embeddings=b.embedding, split_sizes=[3]))
    assert live(transport) == 0


def test_no_allocation_when_it_cannot_help(transport: OutputTransport) -> None:
    too_big = transport.config.rdma.max_slot_bytes // 4 + 1
    assert transport.allocate_output(too_big, 1, torch.float32) is None  # needs more than one slot
    grpc_only = OutputTransport(TransportConfig(mode="grpc"), metrics=TransportMetrics(CollectorRegistry()))
    assert grpc_only.allocate_output(4, 8) is None
    grpc_only.close()


def test_release_pending_ends_only_this_threads_allocations(transport: OutputTransport) -> None:
    import threading

    other: list[OutputBuffers | None] = []
    t = threading.Thread(target=lambda: other.append(transport.allocate_output(2, 8, torch.float32)))
    t.start()
    t.join(10)
    transport.allocate_output(2, 8, torch.float32)
    transport.allocate_output(3, 8, torch.float32)
    assert live(transport) == 3
    assert transport.release_pending() == 2  # what an encoder that raised left behind on this thread
    assert live(transport) == 1
    transport.release_output(other[0])  # type: ignore[arg-type]
    assert live(transport) == 0
