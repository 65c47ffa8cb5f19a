"""Placed outputs (issue 18): on the same-host channel the client lends receive buffers and the encoder writes its
output there. Real encoder servers, real Unix sockets, memfds passed with SCM_RIGHTS; one worker in a separate
process that is killed mid-request.

Claims: a placed fetch gives the reference bits and leases, READs and releases nothing; every output a caller
still holds keeps its own buffer (a later fetch never writes into it), and buffers come back when the outputs
are dropped; an output larger than the buffer goes by another plane once and is placed from the next fetch on;
``allocate_output`` writes straight into the caller's buffer; a worker that takes no buffers turns offers off;
a manifest that does not fit the buffer is a ``ProtocolError``; a buffer whose request was in flight when the
fetch gave up (deadline) or its worker died is never lent again and is freed once the worker's end is closed.
"""

from __future__ import annotations

import gc
import os
import signal
import time
from concurrent import futures
from typing import Any

import pytest
import torch
from _env import EMB, EXTRAS, INPUTS, POS, Env, Held, check_output, encode_fn, wait_for
from prometheus_client import CollectorRegistry

from tensorwire.errors import DeadlineExceeded, PeerUnavailable, ProtocolError, Reason
from tensorwire.mm import EncoderOutput, MultimodalInput, OutputTransport, Plane, TransportConfig
from tensorwire.mm.client._local import LocalControlChannel
from tensorwire.mm.wire._placed import MIN_BUFFER_BYTES

pytestmark = pytest.mark.timeout(90)


@pytest.fixture
def env(placed_env: Env) -> Env:
    return placed_env


def placements(c: Any) -> Any:
    channel = c._channel
    assert isinstance(channel, LocalControlChannel)
    return channel.placements


def test_placed_fetch_gives_the_bits_and_leases_nothing(env: Env) -> None:
    srv = env.server()
    c = env.client(srv.address)
    for _ in range(5):
        out = c.fetch(INPUTS)
        assert out.plane is Plane.PLACED and out.worker_id == "worker-1"
        check_output(out)
        del out
    assert env.names().count("read") == 0 and not any(n.startswith("release") for n in env.names())
    assert not env.fabric.live() and not env.fabric.exported
    assert env.sample("tensorwire_mm_requests_total", {"side": "encoder", "plane": "placed"}) == 5
    assert env.sample("tensorwire_mm_requests_total", {"side": "llm", "plane": "placed"}) == 5
    assert (
        env.sample("tensorwire_mm_control_stream_events_total", {"side": "encoder", "event": "local_offer_mapped"}) == 1
    )
    gc.collect()
    assert placements(c).bytes_in_use == MIN_BUFFER_BYTES  # one buffer, lent and given back five times


class Counting:
    """Outputs that differ per call (call i: embedding rows filled with i), to tell one fetch's bytes from
    another's."""

    def __init__(self) -> None:
        self.calls = 0

    def __call__(self, inputs: list[MultimodalInput]) -> EncoderOutput:
        self.calls += 1
        emb = torch.full((9, 16), float(self.calls), dtype=torch.bfloat16)
        return EncoderOutput(embeddings=[emb[:4], emb[4:]], position_ids=POS, extra_inputs=EXTRAS)


def test_held_outputs_keep_their_buffers(env: Env) -> None:
    srv = env.server(fn=Counting())
    c = env.client(srv.address)
    held = [c.fetch(INPUTS) for _ in range(6)]
    planes = [o.plane for o in held]
    # Four buffers per connection: the fifth and sixth held outputs come by RDMA, not into a buffer in use.
    assert planes == [Plane.PLACED] * 4 + [Plane.RDMA] * 2, planes
    for i, out in enumerate(held, 1):
        assert torch.equal(torch.cat(out.embeddings), torch.full((9, 16), float(i), dtype=torch.bfloat16))
    in_use = placements(c).bytes_in_use
    del held, out
    gc.collect()
    later = [c.fetch(INPUTS) for _ in range(3)]
    assert [o.plane for o in later] == [Plane.PLACED] * 3
    for i, out in enumerate(later, 7):
        assert torch.equal(torch.cat(out.embeddings), torch.full((9, 16), float(i), dtype=torch.bfloat16))
    assert placements(c).bytes_in_use == in_use  # the freed buffers were lent again, none allocated


def test_an_output_larger_than_the_buffer_goes_by_rdma_once(env: Env) -> None:
    big = torch.arange(600 * 1024, dtype=torch.float32).reshape(600, 1024)  # 2.4 MB: over the first 1 MiB buffer

    def fn(inputs: list[MultimodalInput]) -> EncoderOutput:
        return EncoderOutput(embeddings=[big[:100], big[100:]])

    srv = env.server(fn=fn)
    c = env.client(srv.address)
    first = c.fetch(INPUTS)
    assert first.plane is Plane.RDMA and torch.equal(torch.cat(first.embeddings), big)
    assert env.sample("tensorwire_mm_fallbacks_total", {"side": "encoder", "reason": "placement_too_large"}) == 1
    for _ in range(2):
        out = c.fetch(INPUTS)
        assert out.plane is Plane.PLACED and torch.equal(torch.cat(out.embeddings), big)
        del out
    assert placements(c).hint >= big.numel() * 4


def test_allocate_output_writes_into_the_callers_buffer(env: Env) -> None:
    box: dict[str, OutputTransport] = {}

    def fn(inputs: list[MultimodalInput]) -> EncoderOutput:
        buffers = box["t"].allocate_output(9, 16, torch.bfloat16, position_cols=3)
        assert buffers is not None and buffers.lease is None  # the caller's buffer: no slot was leased
        buffers.embedding.copy_(EMB)
        assert buffers.position_ids is not None
        buffers.position_ids.copy_(POS)
        return EncoderOutput(
            embeddings=[buffers.embedding[:4], buffers.embedding[4:]],
            position_ids=buffers.position_ids,
            extra_inputs=EXTRAS,
        )

    srv = env.server(fn=fn)
    box["t"] = srv.service.transport
    c = env.client(srv.address)
    for _ in range(3):
        out = c.fetch(INPUTS)
        # The split embedding is not the allocation as a whole, so it is copied in: still placed, still right.
        assert out.plane is Plane.PLACED
        check_output(out)
    assert not env.fabric.exported and not env.fabric.live()


def test_in_place_output_needs_no_copy(env: Env) -> None:
    box: dict[str, OutputTransport] = {}

    def fn(inputs: list[MultimodalInput]) -> EncoderOutput:
        buffers = box["t"].allocate_output(9, 16, torch.bfloat16)
        assert buffers is not None
        buffers.embedding.copy_(EMB)
        return EncoderOutput(embeddings=buffers.embedding, split_sizes=[4, 5])

    srv = env.server(fn=fn)
    box["t"] = srv.service.transport
    c = env.client(srv.address)
    out = c.fetch(INPUTS)
    assert out.plane is Plane.PLACED and "encoder.allocate" in out.stage_ms
    assert torch.equal(torch.cat(out.embeddings).view(torch.int16), EMB.view(torch.int16))


def test_a_worker_that_takes_no_buffers_turns_offers_off(env: Env) -> None:
    srv = env.server(TransportConfig(worker_id="worker-1", local_placement_bytes=0))
    c = env.client(srv.address)
    for _ in range(3):
        out = c.fetch(INPUTS)
        assert out.plane is Plane.RDMA
        check_output(out)
    assert (
        env.sample("tensorwire_mm_control_stream_events_total", {"side": "encoder", "event": "local_offer_refused"})
        == 1
    )
    assert not placements(c).enabled()


class BadManifest(OutputTransport):
    """A worker whose placed manifest points past the end of the caller's buffer."""

    def _try_place(self, placement, emb, pos, extras, buffers, receipt):  # type: ignore[no-untyped-def]
        ok = super()._try_place(placement, emb, pos, extras, buffers, receipt)
        if ok:
            receipt.placed.tensors[0].offset = placement.buffer.nbytes - 8
        return ok


def test_a_manifest_outside_the_buffer_is_a_protocol_error(env: Env) -> None:
    from fakes import FakeExporter

    from tensorwire.mm import serve_encoder

    cfg = TransportConfig(worker_id="worker-1")
    transport = BadManifest(cfg, exporter_factory=lambda rc: FakeExporter(env.fabric, rc), metrics=env.metrics)
    srv = serve_encoder(encode_fn, cfg, "127.0.0.1:0", transport=transport)
    env.servers.append(srv)
    c = env.client(srv.address)
    for _ in range(2):
        with pytest.raises(ProtocolError) as ei:
            c.fetch(INPUTS)
        assert ei.value.reason is Reason.RESULT_MISMATCH and "does not fit" in str(ei.value)
    gc.collect()
    assert placements(c).bytes_in_use == MIN_BUFFER_BYTES  # the one buffer, free again each time


def test_a_fetch_that_gives_up_never_lends_that_buffer_again(env: Env) -> None:
    held = Held(trigger=b"slow")
    srv = env.server(fn=held)
    c = env.client(srv.address)
    check_output(c.fetch(INPUTS))
    mgr = placements(c)
    with pytest.raises(DeadlineExceeded):
        c.fetch([MultimodalInput(b"slow"), MultimodalInput(b"b")], timeout_ms=300)
    assert mgr.buried == 1  # the worker may still write its output into it
    for _ in range(2):
        out = c.fetch(INPUTS)  # another connection, another buffer
        assert out.plane is Plane.PLACED
        check_output(out)
    held.gate.set()  # the held request now writes into the buried buffer, then the worker ends that connection
    check_output(out)  # which is not this output's
    wait_for(lambda: (c.fetch(INPUTS), mgr.buried == 0)[1], timeout_s=10)  # freed once the worker let go


def test_worker_killed_mid_request_frees_its_buffer() -> None:
    import _held_proc

    from tensorwire.mm import RemoteOutputTransport, TransportMetrics

    p, entered, address, _ = _held_proc.start(mode="auto")
    try:
        reg = CollectorRegistry()
        with RemoteOutputTransport(address, TransportConfig(), metrics=TransportMetrics(reg)) as c:
            assert c.fetch([MultimodalInput(b"x")]).plane is Plane.PLACED
            with futures.ThreadPoolExecutor(1) as pool:
                fetch = pool.submit(c.fetch, [MultimodalInput(b"hold")], 30_000)
                assert entered.wait(30)
                os.kill(p.pid, signal.SIGKILL)
                with pytest.raises(PeerUnavailable):
                    fetch.result(15)
            mgr = placements(c)
            assert mgr.buried == 1
            deadline = time.monotonic() + 10
            while mgr.buried and time.monotonic() < deadline:
                mgr.reap()
                time.sleep(0.01)
            assert mgr.buried == 0
    finally:
        p.kill()
        p.join(10)


class NamesAnotherBuffer(OutputTransport):
    """A worker that, from its second answer on, says it placed the output in the caller's first buffer (which
    the caller's first output still holds)."""

    calls = 0

    def _try_place(self, placement, emb, pos, extras, buffers, receipt):  # type: ignore[no-untyped-def]
        ok = super()._try_place(placement, emb, pos, extras, buffers, receipt)
        NamesAnotherBuffer.calls += 1
        if ok and NamesAnotherBuffer.calls > 1:
            receipt.placed.buffer_id = 1
        return ok


def test_an_answer_naming_a_buffer_this_request_did_not_lend_is_refused(env: Env) -> None:
    from fakes import FakeExporter

    from tensorwire.mm import serve_encoder

    cfg = TransportConfig(worker_id="worker-1")
    transport = NamesAnotherBuffer(cfg, exporter_factory=lambda rc: FakeExporter(env.fabric, rc), metrics=env.metrics)
    srv = serve_encoder(Counting(), cfg, "127.0.0.1:0", transport=transport)
    env.servers.append(srv)
    c = env.client(srv.address)
    first = c.fetch(INPUTS)
    assert first.plane is Plane.PLACED
    with pytest.raises(ProtocolError, match="did not lend"):
        c.fetch(INPUTS)
    # The held output was not handed out a second time, and is as it was.
    assert torch.equal(torch.cat(first.embeddings), torch.full((9, 16), 1.0, dtype=torch.bfloat16))
    del first
    gc.collect()
    assert placements(c).bytes_in_use == 0  # that connection was ended: its buffers went, the held one when dropped
    with pytest.raises(ProtocolError, match="did not lend"):
        c.fetch(INPUTS)  # a new connection, a new buffer: the worker still names buffer 1
