"""GrpcHost, the one gRPC server assembly of the encoder server, the worker and the proxy: bind, health, and the
stop sequence, against a real server on 127.0.0.1 and a real channel."""

from __future__ import annotations

import threading
import time

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from tensorwire.errors import ClosedError, ConfigError
from tensorwire.mm import wire
from tensorwire.mm._host import STOP_SLACK_S, GrpcHost, HostState

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

    def handler(self) -> grpc.GenericRpcHandler:
        return grpc.method_handlers_generic_handler(SERVICE, {"Echo": grpc.unary_unary_rpc_method_handler(self)})


def health_of(address: str, name: str) -> int:
    with grpc.insecure_channel(address) as ch:
        check = health_pb2_grpc.HealthStub(ch).Check
        return int(check(health_pb2.HealthCheckRequest(service=name), timeout=5).status)


def test_bind_start_serve_and_report_health() -> None:
    echo = Echo()
    host = GrpcHost("test", (echo.handler(),), threads=2, thread_prefix="test-host", serving=(SERVICE,))
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
    host = GrpcHost("test", (echo.handler(),), threads=2, thread_prefix="test-host", serving=(SERVICE,))
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
    host = GrpcHost("test", (), threads=1, thread_prefix="test-host")
    host.bind("127.0.0.1:0")
    host.stop(0, drain=lambda: pytest.fail("nothing was serving"))
    assert host.state is HostState.STOPPED
    with pytest.raises(ClosedError):
        host.start()
    with pytest.raises(ClosedError):
        host.bind("127.0.0.1:0")


def test_an_address_that_cannot_be_bound_is_a_config_error_naming_it() -> None:
    host = GrpcHost("proxy", (), threads=1, thread_prefix="test-host")
    with pytest.raises(ConfigError, match="cannot listen on 256.1.1.1:0 for the proxy"):
        host.bind("256.1.1.1:0")
    assert host.state is HostState.NEW
    host.stop(0)


def test_stop_slack_is_bounded() -> None:
    assert 0 < STOP_SLACK_S <= 10  # a stop never waits unboundedly past its grace


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
    host = GrpcHost("test", (Echo().handler(),), threads=2, thread_prefix="test-host", serving=(SERVICE,))
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
    host = GrpcHost("test", (echo.handler(),), threads=4, thread_prefix="test-host", serving=(SERVICE,))
    host.bind("127.0.0.1:0")
    host.start()
    events: list[str] = []
    seen_during_drain: list[int] = []
    ch, watched, follower = _watch(host.address)
    try:
        assert _wait(lambda: watched == [health_pb2.HealthCheckResponse.SERVING])
        stopper = threading.Thread(target=host.stop, args=(10.0,), kwargs={
            "drain": lambda: events.append("drain"), "drain_s": 1.5, "quiesce": lambda: events.append("quiesce"),
            "settle": lambda deadline: events.append(f"settle {deadline - time.monotonic():.0f}")})
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
    assert watched == [health_pb2.HealthCheckResponse.SERVING, health_pb2.HealthCheckResponse.NOT_SERVING,
                       ("end", grpc.StatusCode.OK)]
    assert 1.5 <= elapsed < 6.0


def test_a_port_in_use_is_refused_unless_both_ask_to_share_it() -> None:
    first = GrpcHost("first", (), threads=1, thread_prefix="test-host")
    port = first.bind("127.0.0.1:0")
    first.start()
    try:
        second = GrpcHost("encoder", (), threads=1, thread_prefix="test-host")
        # gRPC's default (SO_REUSEPORT on) let a second server share the port and take half its connections.
        with pytest.raises(ConfigError, match=f"port {port} is in use") as info:
            second.bind(f"127.0.0.1:{port}")
        assert info.value.reason.value == "bind_failed"
        second.stop(0)
    finally:
        first.stop(0)
    a = GrpcHost("a", (), threads=1, thread_prefix="test-host", reuse_port=True)
    b = GrpcHost("b", (), threads=1, thread_prefix="test-host", reuse_port=True)
    try:
        shared = a.bind("127.0.0.1:0")
        assert b.bind(f"127.0.0.1:{shared}") == shared  # asked for explicitly: allowed
    finally:
        a.stop(0)
        b.stop(0)
