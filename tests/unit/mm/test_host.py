"""GrpcHost, the one gRPC server assembly of the encoder server, the worker and the proxy: bind, health, and the
stop sequence, against a real server on 127.0.0.1 and a real channel."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from tensorwire._grpc.host import STOP_SLACK_S, GrpcHost, HostState, Lane, Method, Service
from tensorwire._grpc.limits import ServerLimits
from tensorwire.errors import ClosedError, ConfigError, Reason
from tensorwire.mm import wire

pytestmark = pytest.mark.timeout(60)

SERVICE = "tensorwire.test.v1.Echo"


class Echo:
    """A unary method that can be held open, to stand for an in-flight call during a stop."""

    def __init__(self) -> None:
        self.entered, self.gate = threading.Event(), threading.Event()

    def __call__(self, raw: bytes, context: grpc.ServicerContext) -> bytes:
        if raw == b"hold":
            self.entered.set()
            self.gate.wait(10)
        return raw

    def service(self) -> Service:
        return Service(SERVICE, (Method("Echo", self),))


def health_of(address: str, name: str) -> int:
    with grpc.insecure_channel(address) as ch:
        check = health_pb2_grpc.HealthStub(ch).Check
        return int(check(health_pb2.HealthCheckRequest(service=name), timeout=5).status)


def test_bind_start_serve_and_report_health() -> None:
    echo = Echo()
    host = GrpcHost("test", (echo.service(),), work_slots=2, thread_prefix="test-host", serving=(SERVICE,))
    assert host.state is HostState.NEW
    port = host.bind("127.0.0.1:0")
    assert port > 0 and host.address == f"127.0.0.1:{port}" and host.state is HostState.BOUND
    host.start()
    try:
        assert host.state is HostState.SERVING and host.wait(0.05) is False  # still serving: the wait timed out
        for name in ("", SERVICE):
            assert health_of(host.address, name) == health_pb2.HealthCheckResponse.SERVING
        with grpc.insecure_channel(host.address, options=wire.channel_options()) as ch:
            assert ch.unary_unary(f"/{SERVICE}/Echo")(b"x" * (8 << 20), timeout=10) == b"x" * (8 << 20)  # > 4 MiB
    finally:
        host.stop(0)
    assert host.state is HostState.STOPPED and host.wait(5)


def test_the_stop_sequence_lets_in_flight_calls_finish_then_drains_once() -> None:
    echo = Echo()
    host = GrpcHost("test", (echo.service(),), work_slots=2, thread_prefix="test-host", serving=(SERVICE,))
    host.bind("127.0.0.1:0")
    host.start()
    events: list[str] = []
    with grpc.insecure_channel(host.address) as ch:
        call = ch.unary_unary(f"/{SERVICE}/Echo").future(b"hold", timeout=20)
        assert echo.entered.wait(10)

        def drain() -> None:
            events.append("drain")
            echo.gate.set()  # what a drain does: end what would hold the stop (here: the held call)

        t0 = time.monotonic()
        host.stop(10.0, drain=drain)
        elapsed = time.monotonic() - t0
        assert call.result(timeout=5) == b"hold"  # finished within the grace, not cancelled
    assert events == ["drain"] and elapsed < 10.0  # the drain, not the grace, ended the stop
    host.stop(10.0, drain=drain)  # idempotent: no second drain, no wait
    assert events == ["drain"]


def test_a_stop_before_start_drains_nothing_and_refuses_a_later_start() -> None:
    host = GrpcHost("test", (), work_slots=1, thread_prefix="test-host")
    host.bind("127.0.0.1:0")
    host.stop(0, drain=lambda: pytest.fail("nothing was serving"))
    assert host.state is HostState.STOPPED
    with pytest.raises(ClosedError):
        host.start()
    with pytest.raises(ClosedError):
        host.bind("127.0.0.1:0")


def test_an_address_that_cannot_be_bound_is_a_config_error_naming_it() -> None:
    host = GrpcHost("proxy", (), work_slots=1, thread_prefix="test-host")
    with pytest.raises(ConfigError, match="cannot listen on 256.1.1.1:0 for the proxy") as info:
        host.bind("256.1.1.1:0", insecure=True)
    assert info.value.reason is Reason.BIND_FAILED
    assert host.state is HostState.NEW
    host.stop(0)


def test_stop_slack_is_bounded() -> None:
    assert 0 < STOP_SLACK_S <= 10  # a stop never waits unboundedly past its grace


# -- the guard (issue 15, finding 4): request deadline, per-peer limits, lanes, plaintext only on loopback ------


class Gate:
    """A method that blocks until released, recording the calls that reached it."""

    def __init__(self) -> None:
        self.gate = threading.Event()
        self.entered = threading.Semaphore(0)
        self.calls = 0

    def __call__(self, raw: bytes, context: grpc.ServicerContext) -> bytes:
        self.calls += 1
        self.entered.release()
        if raw == b"hold":
            self.gate.wait(20)
        return raw


def _host(limits: ServerLimits, gate: Gate, *, work_slots: int = 4) -> GrpcHost:
    host = GrpcHost(
        "test",
        (Service(SERVICE, (Method("Work", gate, lane=Lane.WORK), Method("Control", gate))),),
        work_slots=work_slots,
        thread_prefix="test-guard",
        limits=limits,
        serving=(SERVICE,),
    )
    host.bind("127.0.0.1:0")
    host.start()
    return host


def _hold(ch: grpc.Channel, method: str, n: int, gate: Gate) -> list[grpc.Future]:
    """``n`` calls of ``method`` that the gate holds, each already inside the handler."""
    held = [ch.unary_unary(f"/{SERVICE}/{method}").future(b"hold", timeout=20) for _ in range(n)]
    for _ in held:
        assert gate.entered.acquire(timeout=10)
    return held


def _release_all(held: list[grpc.Future], gate: Gate) -> None:
    gate.gate.set()
    assert [f.result(timeout=10) for f in held] == [b"hold"] * len(held)


def _unsent(ch: grpc.Channel, method: str) -> tuple[grpc.Future, threading.Event]:
    release = threading.Event()

    def never() -> Iterator[bytes]:
        release.wait(30)
        return
        yield b""

    return ch.stream_unary(f"/{SERVICE}/{method}").future(never(), timeout=30), release


def test_a_call_that_never_sends_its_request_is_dropped_after_request_timeout() -> None:
    gate = Gate()
    host = _host(ServerLimits(request_timeout_ms=300), gate)
    try:
        with grpc.insecure_channel(host.address) as ch:
            t0 = time.monotonic()
            pending = [_unsent(ch, "Work") for _ in range(10)]
            for fut, _ in pending:
                with pytest.raises(grpc.RpcError) as info:
                    fut.result(timeout=10)
                assert info.value.code() is grpc.StatusCode.CANCELLED
            assert time.monotonic() - t0 < 5.0  # dropped at the request deadline, not at the client's 30 s
            for _, release in pending:
                release.set()
            assert gate.calls == 0 and host.stats().request_timeouts == 10
            assert ch.unary_unary(f"/{SERVICE}/Work")(b"x", timeout=5) == b"x"  # and the server serves on
    finally:
        host.stop(0)


def test_a_peer_over_its_share_is_refused_at_once_and_the_refusal_says_why() -> None:
    gate = Gate()
    host = _host(ServerLimits(max_inflight_per_peer=3, max_streams_per_peer=1), gate)
    try:
        with grpc.insecure_channel(host.address) as ch:
            held = _hold(ch, "Control", 3, gate)
            t0 = time.monotonic()
            with pytest.raises(grpc.RpcError) as info:
                ch.unary_unary(f"/{SERVICE}/Control")(b"x", timeout=10)
            assert time.monotonic() - t0 < 2.0
            assert info.value.code() is grpc.StatusCode.RESOURCE_EXHAUSTED
            assert wire.reason_from_rpc(info.value) is Reason.PEER_LIMIT
            assert host.stats().peer_limit_refusals == 1 and host.stats().inflight == 3
            _release_all(held, gate)
            assert ch.unary_unary(f"/{SERVICE}/Control")(b"y", timeout=5) == b"y"
    finally:
        host.stop(0)


def test_control_calls_never_wait_behind_work_and_work_waits_within_its_deadline() -> None:
    gate = Gate()
    host = _host(ServerLimits(), gate, work_slots=2)
    try:
        with grpc.insecure_channel(host.address) as ch:
            work = _hold(ch, "Work", 2, gate)  # both work slots taken
            t0 = time.monotonic()
            for _ in range(5):
                assert ch.unary_unary(f"/{SERVICE}/Control")(b"c", timeout=5) == b"c"
            assert health_of(host.address, "") == health_pb2.HealthCheckResponse.SERVING
            assert time.monotonic() - t0 < 3.0
            with pytest.raises(grpc.RpcError) as info:  # a third Work waits for a slot, within its deadline only
                ch.unary_unary(f"/{SERVICE}/Work")(b"w", timeout=0.5)
            assert info.value.code() is grpc.StatusCode.DEADLINE_EXCEEDED
            _release_all(work, gate)
            assert ch.unary_unary(f"/{SERVICE}/Work")(b"w", timeout=5) == b"w"
    finally:
        host.stop(0)


def test_plaintext_leaves_the_loopback_only_with_insecure() -> None:
    for address in ("0.0.0.0:0", "[::]:0", "192.0.2.1:0", "example.com:0"):
        host = GrpcHost("encoder", (), work_slots=1, thread_prefix="test-host")
        with pytest.raises(ConfigError, match="refusing a plaintext encoder listener.*--insecure"):
            host.bind(address)
        host.stop(0)
    host = GrpcHost("encoder", (), work_slots=1, thread_prefix="test-host")
    assert host.bind("0.0.0.0:0", insecure=True) > 0
    host.stop(0)
    for address in ("127.0.0.1:0", "localhost:0", "[::1]:0"):
        host = GrpcHost("encoder", (), work_slots=1, thread_prefix="test-host")
        try:
            assert host.bind(address) > 0
        except ConfigError as exc:  # no IPv6 loopback on this machine: only that is acceptable
            assert "::1" in address and "cannot listen" in str(exc)
        host.stop(0)


def test_a_stream_is_ended_when_it_idles_past_stream_idle_timeout() -> None:
    def echo(requests: Iterator[bytes], context: grpc.ServicerContext) -> Iterator[bytes]:
        yield from requests

    host = GrpcHost(
        "test",
        (Service(SERVICE, (Method("Echo", echo, kind="stream"),)),),
        work_slots=1,
        thread_prefix="test-guard",
        limits=ServerLimits(stream_idle_timeout_ms=400),
        serving=(SERVICE,),
    )
    host.bind("127.0.0.1:0")
    host.start()
    try:
        with grpc.insecure_channel(host.address) as ch:
            release = threading.Event()

            def one_then_idle() -> Iterator[bytes]:
                yield b"hello"
                release.wait(30)

            t0 = time.monotonic()
            call = ch.stream_stream(f"/{SERVICE}/Echo")(one_then_idle(), timeout=30)
            assert next(call) == b"hello"  # a stream in use is not idle
            with pytest.raises(grpc.RpcError) as info:
                next(call)
            release.set()
            assert info.value.code() is grpc.StatusCode.CANCELLED
            assert 0.3 < time.monotonic() - t0 < 10.0 and host.stats().stream_idle_ends == 1
            deadline = time.monotonic() + 10
            while host.stats().inflight and time.monotonic() < deadline:  # the handler unwinds after the cancel
                time.sleep(0.01)
            assert host.stats().inflight == 0
    finally:
        host.stop(0)


# ---- issue 16: health phases, the drain period, Watch, port sharing


def _watch(address: str, name: str = SERVICE) -> tuple[grpc.Channel, list[object], threading.Thread]:
    """A Watch on ``name`` followed by a thread; the list gets each status, then ("end", code)."""
    ch = grpc.insecure_channel(address)
    seen: list[object] = []
    stream = health_pb2_grpc.HealthStub(ch).Watch(health_pb2.HealthCheckRequest(service=name), timeout=30)

    def follow() -> None:
        try:
            for msg in stream:
                seen.append(int(msg.status))
        except grpc.RpcError as exc:
            seen.append(("end", exc.code()))
        else:
            seen.append(("end", grpc.StatusCode.OK))

    t = threading.Thread(target=follow, daemon=True)
    t.start()
    return ch, seen, t


def _wait(cond, timeout_s: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if cond():
            return True
        time.sleep(0.01)
    return cond()


def test_start_not_serving_until_set_serving() -> None:
    host = GrpcHost("test", (Echo().service(),), work_slots=2, thread_prefix="test-host", serving=(SERVICE,))
    host.bind("127.0.0.1:0")
    host.start(serving=False)  # a worker whose model is still loading: reachable, but not ready
    try:
        assert health_of(host.address, SERVICE) == health_pb2.HealthCheckResponse.NOT_SERVING
        host.set_serving(True)
        assert health_of(host.address, "") == health_pb2.HealthCheckResponse.SERVING
    finally:
        host.stop(0)


def test_stop_is_not_serving_for_the_drain_period_then_drains_settles_and_ends_watches() -> None:
    echo = Echo()
    host = GrpcHost("test", (echo.service(),), work_slots=4, thread_prefix="test-host", serving=(SERVICE,))
    host.bind("127.0.0.1:0")
    host.start()
    events: list[str] = []
    seen_during_drain: list[int] = []
    ch, watched, follower = _watch(host.address)
    try:
        assert _wait(lambda: watched == [health_pb2.HealthCheckResponse.SERVING])
        stopper = threading.Thread(
            target=host.stop,
            args=(10.0,),
            kwargs={
                "drain": lambda: events.append("drain"),
                "drain_s": 1.5,
                "quiesce": lambda: events.append("quiesce"),
                "settle": lambda deadline: events.append(f"settle {deadline - time.monotonic():.0f}"),
            },
        )
        t0 = time.monotonic()
        stopper.start()
        # The drain period: Check already says NOT_SERVING (the old host flipped it only together with the stop)
        # while calls are still served and nothing was drained yet.
        assert _wait(lambda: health_of(host.address, SERVICE) == health_pb2.HealthCheckResponse.NOT_SERVING, 5)
        seen_during_drain.append(health_of(host.address, ""))
        with grpc.insecure_channel(host.address) as c2:
            assert c2.unary_unary(f"/{SERVICE}/Echo")(b"still served", timeout=5) == b"still served"
        assert events == []
        stopper.join(20)
        elapsed = time.monotonic() - t0
        follower.join(10)
    finally:
        ch.close()
    assert seen_during_drain == [health_pb2.HealthCheckResponse.NOT_SERVING]
    # After the drain period: stop taking work, wait for it (the whole grace still ahead), then end idle streams.
    assert events == ["quiesce", "settle 10", "drain"]
    # The open Watch saw NOT_SERVING and then ended (OK) at the stop: it did not hold the stop for the 10 s grace.
    assert watched == [
        health_pb2.HealthCheckResponse.SERVING,
        health_pb2.HealthCheckResponse.NOT_SERVING,
        ("end", grpc.StatusCode.OK),
    ]
    assert 1.5 <= elapsed < 6.0


def test_a_port_in_use_is_refused_unless_both_ask_to_share_it() -> None:
    first = GrpcHost("first", (), work_slots=1, thread_prefix="test-host")
    port = first.bind("127.0.0.1:0")
    first.start()
    try:
        second = GrpcHost("encoder", (), work_slots=1, thread_prefix="test-host")
        # gRPC's default (SO_REUSEPORT on) let a second server share the port and take half its connections.
        with pytest.raises(ConfigError, match=f"port {port} is in use") as info:
            second.bind(f"127.0.0.1:{port}")
        assert info.value.reason.value == "bind_failed"
        second.stop(0)
    finally:
        first.stop(0)
    a = GrpcHost("a", (), work_slots=1, thread_prefix="test-host", reuse_port=True)
    b = GrpcHost("b", (), work_slots=1, thread_prefix="test-host", reuse_port=True)
    try:
        shared = a.bind("127.0.0.1:0")
        assert b.bind(f"127.0.0.1:{shared}") == shared  # asked for explicitly: allowed
    finally:
        a.stop(0)
        b.stop(0)
