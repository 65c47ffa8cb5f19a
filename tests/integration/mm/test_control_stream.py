"""The EncodeStream control plane against real gRPC servers on 127.0.0.1 (the data plane is the in-memory fake).

Claims: the stream carries Encode and the success-path release, gives what unary gives (outputs and errors),
holds the fetch's deadline, releases what a timed-out request exported, falls back to unary where the encoder
cannot or will not stream (without running a request twice), survives server stops and restarts, serves many
threads at once, and leaves no thread behind. test_nixl_transport.py runs both paths over real NIXL.
"""

from __future__ import annotations

import threading
import time
from concurrent import futures
from typing import Any

import grpc
import pytest
import torch
from _env import ERROR_CASES, ERROR_IDS, INPUTS, Env, Fails, Held, check_output, encode_fn, wait_for
from grpc_health.v1 import health_pb2, health_pb2_grpc

from tensorwire.errors import (
    ControlPlaneError,
    DeadlineExceeded,
    InvalidPayload,
    PeerUnavailable,
    Reason,
    TensorwireError,
)
from tensorwire.mm import EncoderOutput, MultimodalInput, Plane, TransportConfig, wire
from tensorwire.mm._proto import encoder_pb2 as pb
from tensorwire.service._proxy import EncoderProxy, ProxyConfig

pytestmark = pytest.mark.timeout(60)

UNARY = TransportConfig(control_stream=False)


def rpcs(env: Env, path: str) -> float:
    return env.sample("tensorwire_mm_control_rpcs_total", {"path": path})


def stream_events(env: Env, event: str, side: str = "llm") -> float:
    return env.sample("tensorwire_mm_control_stream_events_total", {"side": side, "event": event})


def same_bits(a: Any, b: Any) -> bool:
    assert a.split_sizes == b.split_sizes and len(a.extra_inputs) == len(b.extra_inputs)
    pairs = [
        *zip(a.embeddings, b.embeddings, strict=True),
        *zip(a.position_ids or [], b.position_ids or [], strict=True),
        *zip(a.extra_inputs, b.extra_inputs, strict=True),
    ]
    return all(
        x.dtype == y.dtype
        and x.shape == y.shape
        and torch.equal(x.contiguous().view(torch.uint8), y.contiguous().view(torch.uint8))
        for x, y in pairs
    )


def control_threads() -> list[str]:
    return [
        t.name
        for t in threading.enumerate()
        if t.name.startswith("tensorwire-mm-control") or "consume_request_iterator" in t.name
    ]


@pytest.mark.parametrize("mode", ["auto", "grpc"], ids=["rdma", "inline"])
def test_stream_path_is_used_and_gives_the_bits_unary_gives(env: Env, mode: str) -> None:
    srv = env.server()
    on, on_channel = env.client_with_channel(srv.address, TransportConfig(mode=mode))  # type: ignore[arg-type]
    off = env.client(srv.address, TransportConfig(mode=mode, control_stream=False))  # type: ignore[arg-type]
    plane = Plane.RDMA if mode == "auto" else Plane.INLINE
    for _ in range(3):
        a, b = on.fetch(INPUTS), off.fetch(INPUTS)
        assert a.plane is plane and b.plane is plane
        check_output(a)
        assert same_bits(a, b)
    assert rpcs(env, "stream") == 3 and rpcs(env, "unary") == 3
    assert [d["path"] for e, d in env.events if e == "request"] == ["stream", "unary"] * 3
    assert stream_events(env, "opened") == 1  # one stream, reused
    assert on_channel.open_streams == 1 and srv.service.open_streams == 1
    assert env.sample("tensorwire_mm_encoder_control_streams") == 1


@pytest.mark.parametrize("exc,cls,reason", ERROR_CASES, ids=ERROR_IDS)
def test_errors_on_the_stream_are_the_unary_errors_and_the_stream_stays_open(
    env: Env, exc: BaseException, cls: type[TensorwireError], reason: Reason
) -> None:
    srv = env.server(fn=Fails(exc))
    on, off = env.client(srv.address), env.client(srv.address, UNARY)
    bad = [MultimodalInput(b"bad"), MultimodalInput(b"x")]
    with pytest.raises(TensorwireError) as over_unary:
        off.fetch(bad)
    with pytest.raises(TensorwireError) as over_stream:
        on.fetch(bad)
    assert type(over_unary.value) is cls and over_unary.value.reason is reason
    assert type(over_stream.value) is cls and over_stream.value.reason is reason
    assert str(over_stream.value) == str(over_unary.value)  # same status name and details, too
    assert rpcs(env, "stream") == 1
    check_output(on.fetch(INPUTS))  # the same stream answers the next request
    assert rpcs(env, "stream") == 2 and stream_events(env, "opened") == 1 and stream_events(env, "closed") == 0


def test_invalid_output_is_invalid_payload_on_both_paths(env: Env) -> None:
    srv = env.server(
        fn=lambda inputs: (
            encode_fn(inputs)
            if inputs[0].data != b"bad"
            else EncoderOutput(embeddings=[torch.zeros(1, 2, dtype=torch.complex64)])
        )
    )
    for cfg in (TransportConfig(mode="grpc"), TransportConfig(mode="grpc", control_stream=False)):
        c = env.client(srv.address, cfg)
        with pytest.raises(InvalidPayload) as ei:
            c.fetch([MultimodalInput(b"bad"), MultimodalInput(b"x")])
        assert ei.value.reason is Reason.UNSUPPORTED_DTYPE
        check_output(c.fetch(INPUTS))
    assert rpcs(env, "stream") == 2 and rpcs(env, "unary") == 2


def test_slow_encoder_hits_the_budget_on_the_stream_and_exports_nothing_for_the_gone_caller(env: Env) -> None:
    slow = Held(b"slow")
    srv = env.server(fn=slow)
    c = env.client(srv.address)
    check_output(c.fetch(INPUTS))  # the stream is open and warm
    t0 = time.monotonic()
    with pytest.raises(DeadlineExceeded) as ei:
        c.fetch([MultimodalInput(b"slow"), MultimodalInput(b"x")], timeout_ms=1000)
    elapsed = time.monotonic() - t0
    assert ei.value.reason is Reason.DEADLINE_EXCEEDED  # what the unary path raises for its deadline
    assert 0.99 <= elapsed < 1.0 + 3.0, elapsed  # the watchdog ended the wait on time (a busy 2-core box's slack)
    assert slow.entered.is_set() and stream_events(env, "deadline") == 1
    wait_for(lambda: stream_events(env, "closed") == 1)  # the cancelled stream is dropped, never reused
    exported = len(env.fabric.exported)
    slow.gate.set()  # the encoder finishes for a caller that is gone: it drops the work
    # Counted once: before the export when the server already sees the stream cancelled, else after the export,
    # its leases released at once (the cancel reaches the server some time after the client gave up; on a loaded
    # box that can be after the gate opened). Either way nothing stays leased.
    wait_for(
        lambda: env.sample("tensorwire_mm_errors_total", {"side": "encoder", "reason": "cancelled"}) == 1, timeout_s=30
    )
    assert set(env.fabric.exported[exported:]) <= set(env.fabric.released) and not env.fabric.live()
    wait_for(lambda: srv.service.open_streams == 0)
    check_output(c.fetch(INPUTS))  # a new stream
    assert stream_events(env, "opened") == 2 and rpcs(env, "stream") == 3 and rpcs(env, "unary") == 0


def test_server_over_its_stream_cap_serves_the_rest_over_unary(env: Env) -> None:
    srv = env.server(TransportConfig(worker_id="worker-1", server_threads=4, server_stream_cap=1))
    a, (b, b_channel) = env.client(srv.address), env.client_with_channel(srv.address)
    check_output(a.fetch(INPUTS))  # a holds the only stream
    check_output(b.fetch(INPUTS))  # b's stream is refused; the same fetch goes over unary
    check_output(b.fetch(INPUTS))  # and b does not ask again for open_seconds
    check_output(a.fetch(INPUTS))
    assert stream_events(env, "refused") == 1 and stream_events(env, "refused", side="encoder") == 1
    assert rpcs(env, "stream") == 2 and rpcs(env, "unary") == 2
    assert srv.service.open_streams == 1 and b_channel.open_streams == 0
    wait_for(lambda: not env.fabric.live())  # both release paths released everything


def unary_only_server(env: Env) -> tuple[grpc.Server, str]:
    """An encoder that predates EncodeStream: the same servicer, only its unary methods registered."""
    srv = env.server()  # for its transport; it is not what the client talks to
    service = srv.service
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=4), options=wire.channel_options())
    server.add_generic_rpc_handlers(
        (
            grpc.method_handlers_generic_handler(
                wire.SERVICE_NAME,
                {
                    "Encode": grpc.unary_unary_rpc_method_handler(service.encode),
                    "ReleaseLeases": grpc.unary_unary_rpc_method_handler(service.release_leases),
                },
            ),
        )
    )
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    return server, f"127.0.0.1:{port}"


def test_encoder_without_encode_stream_is_served_over_unary_and_not_asked_again(env: Env) -> None:
    server, address = unary_only_server(env)
    try:
        c = env.client(address)
        for _ in range(3):
            out = c.fetch(INPUTS)
            assert out.plane is Plane.RDMA
            check_output(out)
        assert stream_events(env, "unimplemented") == 1 and stream_events(env, "opened") == 1
        assert rpcs(env, "unary") == 3 and rpcs(env, "stream") == 0
        assert [d["path"] for e, d in env.events if e == "request"] == ["stream", "unary", "unary"]
        assert env.names().count("release_async") == 3  # no stream: the queue's ReleaseLeases RPC
        wait_for(lambda: not env.fabric.live())
    finally:
        server.stop(0)


def test_proxy_without_encode_stream_is_served_over_unary(env: Env) -> None:
    srv = env.server()
    proxy = EncoderProxy(ProxyConfig(workers=(srv.address,), check_workers=False, worker_wait_s=5))
    proxy.start("127.0.0.1:0")
    try:
        c = env.client(f"127.0.0.1:{proxy.port}")
        for _ in range(3):
            out = c.fetch(INPUTS)
            assert out.plane is Plane.RDMA and out.worker_id == "worker-1"
            check_output(out)
        assert stream_events(env, "unimplemented") == 1 and rpcs(env, "unary") == 3 and rpcs(env, "stream") == 0
        wait_for(lambda: not env.fabric.live())  # released through the proxy
    finally:
        proxy.stop(0)


def test_server_stop_with_open_streams_is_prompt_and_a_restart_on_the_port_recovers(env: Env) -> None:
    srv = env.server()
    c = env.client(srv.address)
    other = env.client(srv.address)
    check_output(c.fetch(INPUTS))
    check_output(other.fetch(INPUTS))
    assert srv.service.open_streams == 2
    t0 = time.monotonic()
    srv.stop(grace=5.0)  # idle streams must not hold the stop for the whole grace
    assert time.monotonic() - t0 < 1.0
    with pytest.raises(PeerUnavailable):
        c.fetch(INPUTS, timeout_ms=2000)
    restarted = env.server(TransportConfig(worker_id="worker-2"), address=srv.address)

    def fetched() -> bool:
        try:
            return c.fetch(INPUTS, timeout_ms=2000).worker_id == "worker-2"
        except PeerUnavailable:
            return False  # the channel's reconnect backoff

    wait_for(fetched, timeout_s=20)
    before = rpcs(env, "stream")
    check_output(c.fetch(INPUTS))
    assert rpcs(env, "stream") == before + 1 and restarted.service.open_streams == 1


def test_stop_lets_the_encode_in_flight_on_a_stream_answer(env: Env) -> None:
    slow = Held()
    srv = env.server(fn=slow)
    c = env.client(srv.address, TransportConfig(mode="grpc"))
    with futures.ThreadPoolExecutor(2) as pool:
        fetch = pool.submit(c.fetch, INPUTS)
        assert slow.entered.wait(5)
        stop = pool.submit(srv.stop, 5.0)
        wait_for(lambda: srv.service._stopping)
        slow.gate.set()
        check_output(fetch.result(5))  # answered within the grace
        t0 = time.monotonic()
        stop.result(5)
        assert time.monotonic() - t0 < 1.0
    wait_for(lambda: srv.service.open_streams == 0)


def test_a_stream_that_broke_after_sending_is_not_resent(env: Env) -> None:
    counted = Held(b"hold")
    srv = env.server(fn=counted)
    c = env.client(srv.address)
    check_output(c.fetch(INPUTS))
    with futures.ThreadPoolExecutor(1) as pool:
        fetch = pool.submit(c.fetch, [MultimodalInput(b"hold"), MultimodalInput(b"x")], 5000)
        assert counted.entered.wait(5)
        srv.stop(grace=0)  # the server goes away while the request is being handled
        with pytest.raises(PeerUnavailable):
            fetch.result(5)
    counted.gate.set()
    assert counted.calls == 2  # the warm-up and the one attempt: not sent again over unary
    assert rpcs(env, "unary") == 0 and stream_events(env, "broken") == 1


def test_sixteen_threads_fetch_at_once_each_getting_its_own_answer(env: Env) -> None:
    def tagged(inputs: list[MultimodalInput]) -> EncoderOutput:
        tag = float(inputs[0].data.decode())
        return EncoderOutput(embeddings=[torch.full((3, 8), tag)], position_ids=torch.full((3, 2), int(tag)))

    srv = env.server(TransportConfig(worker_id="worker-1", server_threads=24, server_stream_cap=16), fn=tagged)
    c, channel = env.client_with_channel(srv.address, TransportConfig(control_stream_pool=8))
    barrier = threading.Barrier(16)

    def run(thread: int) -> int:
        barrier.wait(10)
        for i in range(20):
            tag = thread * 100 + i
            out = c.fetch([MultimodalInput(str(tag).encode())])
            assert out.plane is Plane.RDMA
            assert torch.equal(out.embeddings[0], torch.full((3, 8), float(tag)))
            assert torch.equal(out.position_ids[0], torch.full((3, 2), tag))
        return thread

    with futures.ThreadPoolExecutor(16) as pool:
        assert sorted(pool.map(run, range(16))) == list(range(16))
    assert rpcs(env, "stream") + rpcs(env, "unary") == 320
    assert rpcs(env, "stream") >= 20 and channel.open_streams <= 8
    assert stream_events(env, "opened") <= 8 and stream_events(env, "closed") == 0
    wait_for(lambda: not env.fabric.live())


def test_releases_ride_the_stream_and_free_every_lease(env: Env) -> None:
    srv = env.server()
    c = env.client(srv.address)
    for _ in range(5):
        check_output(c.fetch(INPUTS))
    assert env.names().count("release_stream") == 5 and "release_async" not in env.names()
    wait_for(lambda: not env.fabric.live())  # while the client is still open: not at close, not by a GC
    assert len(env.fabric.released) == len(env.fabric.exported) == 5
    assert env.sample("tensorwire_mm_release_leases_total", {"mode": "stream", "outcome": "sent"}) == 5
    assert env.sample("tensorwire_mm_encoder_released_leases_total", {"outcome": "ok"}) == 5
    assert env.sample("tensorwire_mm_release_leases_total", {"mode": "async", "outcome": "ok"}) == 0
    assert c.release_queue.sent == 0


def test_malformed_stream_messages_get_typed_errors_and_the_server_keeps_serving(env: Env) -> None:
    srv = env.server()
    with grpc.insecure_channel(srv.address) as ch:
        method = ch.stream_stream(wire.ENCODE_STREAM_METHOD)
        # Bytes that are no StreamRequest end that stream with INVALID_ARGUMENT and reason invalid_request.
        call = method(iter([b"\xff\xff\xff\xff"]), timeout=5)
        with pytest.raises(grpc.RpcError) as ei:
            next(call)
        err = wire.error_from_rpc(ei.value, "EncodeStream")
        assert type(err) is InvalidPayload and err.reason is Reason.INVALID_REQUEST
        # A body this encoder does not know is answered under its id; the stream goes on.
        request = pb.StreamRequest(
            id=8,
            encode=pb.EncodeRequest(
                inputs=[pb.MultimodalInput(data=b"a", kind="image"), pb.MultimodalInput(data=b"b")]
            ),
        )
        too_many = pb.StreamRequest(release=pb.ReleaseLeasesRequest(lease_ids=["x"] * 65_537))
        call = method(
            iter(
                [pb.StreamRequest(id=7).SerializeToString(), too_many.SerializeToString(), request.SerializeToString()]
            ),
            timeout=5,
        )
        first = pb.StreamResponse.FromString(next(call))
        assert first.id == 7 and first.WhichOneof("body") == "error"
        err = wire.error_from_stream(first.error, "Encode")
        assert type(err) is ControlPlaneError and err.reason is Reason.UNIMPLEMENTED
        second = pb.StreamResponse.FromString(next(call))  # the oversized release was dropped, unanswered
        assert second.id == 8 and second.WhichOneof("body") == "receipt" and list(second.receipt.split_sizes) == [4, 5]
        with pytest.raises(StopIteration):
            next(call)  # the client half-closed: the stream ends cleanly
        assert env.sample("tensorwire_mm_errors_total", {"side": "encoder", "reason": "invalid_request"}) == 1
        health = health_pb2_grpc.HealthStub(ch)
        resp = health.Check(health_pb2.HealthCheckRequest(service=wire.SERVICE_NAME), timeout=5)
        assert resp.status == health_pb2.HealthCheckResponse.SERVING
    check_output(env.client(srv.address).fetch(INPUTS))


def test_close_flushes_and_ends_the_streams_and_leaves_no_thread(env: Env) -> None:
    srv = env.server()
    c, channel = env.client_with_channel(srv.address)
    with futures.ThreadPoolExecutor(4) as pool:
        list(pool.map(lambda _: check_output(c.fetch(INPUTS)), range(16)))
    assert channel.open_streams >= 1 and control_threads()
    c.close()
    c.close()  # idempotent
    assert not env.fabric.live()  # nothing left leased: every release reached the encoder
    wait_for(lambda: srv.service.open_streams == 0)
    wait_for(lambda: not control_threads())
    assert stream_events(env, "closed") == stream_events(env, "opened")


def test_the_deadline_watchdog_sleeps_through_a_steady_state(env: Env) -> None:
    srv = env.server()
    c, channel = env.client_with_channel(srv.address)
    for _ in range(100):
        c.fetch(INPUTS, timeout_ms=60_000)
    assert channel.watchdog.wakeups == 0  # multi-second budgets: the thread slept through 100 requests
    assert channel.watchdog.pending <= 2  # answered entries do not pile up


class EndingContext:
    """The part of grpc.ServicerContext the stream handler uses, for driving its generator by hand."""

    def __init__(self) -> None:
        self.active = True
        self.callbacks: list[Any] = []

    def is_active(self) -> bool:
        return self.active

    def add_callback(self, callback: Any) -> bool:
        self.callbacks.append(callback)
        return True


@pytest.mark.parametrize("ended_by", ["generator_closed", "call_terminated"])
def test_a_receipt_whose_send_failed_has_its_leases_released(env: Env, ended_by: str) -> None:
    # gRPC resumes the handler only after a send completed; if the call ends while the receipt is out, gRPC closes
    # the generator (GeneratorExit at the yield) and runs the termination callbacks. Either one releases the
    # receipt's leases, once.
    srv = env.server()
    context = EndingContext()
    request = pb.StreamRequest(
        id=1,
        encode=pb.EncodeRequest(
            support_rdma=True,
            inputs=[pb.MultimodalInput(data=b"a", kind="image"), pb.MultimodalInput(data=b"b", kind="image")],
        ),
    )
    handler = srv.service.encode_stream(iter([request.SerializeToString()]), context)  # type: ignore[arg-type]
    answer = pb.StreamResponse.FromString(next(handler))  # handed to gRPC; the send is "in flight"
    assert answer.id == 1 and len(answer.receipt.rdma_slots) == 1 and len(env.fabric.live()) == 1
    context.active = False
    if ended_by == "call_terminated":
        for callback in context.callbacks:
            callback()
        assert not env.fabric.live()
    handler.close()
    assert not env.fabric.live() and len(env.fabric.released) == 1
    assert env.sample("tensorwire_mm_encoder_released_leases_total", {"outcome": "ok"}) == 1  # released once
    assert srv.service.open_streams == 0


def _cancelled_after(*messages: bytes, then: str) -> Any:
    """A stream's request iterator: ``messages``, then the client's cancel (gRPC raises RpcError in the handler's
    read) or its half-close."""
    yield from messages
    if then == "cancel":
        raise grpc.RpcError()


@pytest.mark.parametrize("then", ["cancel", "release_then_cancel", "half_close"])
def test_an_answer_sent_as_the_caller_cancelled_has_its_leases_released(env: Env, then: str) -> None:
    # The send of the answer completed on the server, but the client cancelled at its deadline before the answer
    # reached it (gRPC drops it on the client): the handler resumes, the call then ends cancelled. Nothing said the
    # client had the answer (no later message on the stream), so its leases are released at once, counted as a
    # cancelled caller. A client that sent its release first, or half-closed (it ended cleanly: it holds the
    # answer), keeps them.
    srv = env.server()
    request = pb.StreamRequest(
        id=1,
        encode=pb.EncodeRequest(
            support_rdma=True,
            inputs=[pb.MultimodalInput(data=b"a", kind="image"), pb.MultimodalInput(data=b"b", kind="image")],
        ),
    )
    answered = threading.Event()

    def requests() -> Any:
        yield request.SerializeToString()
        assert answered.is_set()  # read again only after the answer was handed to gRPC and the handler resumed
        later = []
        if then == "release_then_cancel":
            later.append(pb.StreamRequest(release=pb.ReleaseLeasesRequest(lease_ids=sorted(env.fabric.live()))))
        yield from _cancelled_after(
            *(m.SerializeToString() for m in later), then="half_close" if then == "half_close" else "cancel"
        )

    handler = srv.service.encode_stream(requests(), EndingContext())  # type: ignore[arg-type]
    answer = pb.StreamResponse.FromString(next(handler))
    assert answer.id == 1 and len(answer.receipt.rdma_slots) == 1 and len(env.fabric.live()) == 1
    answered.set()
    with pytest.raises(StopIteration):
        next(handler)  # the send completed: the handler resumes and reads on
    cancelled = env.sample("tensorwire_mm_errors_total", {"side": "encoder", "reason": "cancelled"})
    if then == "half_close":
        assert len(env.fabric.live()) == 1 and cancelled == 0  # the client's to read and release
        srv.transport.release(sorted(env.fabric.live()))
    else:
        assert cancelled == (1 if then == "cancel" else 0)
    assert not env.fabric.live() and len(env.fabric.released) == 1
    assert env.sample("tensorwire_mm_encoder_released_leases_total", {"outcome": "ok"}) == 1  # released once
    assert srv.service.open_streams == 0
