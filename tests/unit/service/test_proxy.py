"""The proxy over real gRPC (127.0.0.1:0) in front of scripted workers (tests/unit/service/fake_worker.py)."""

from __future__ import annotations

import socket
from collections.abc import Iterator

import grpc
import pytest
from prometheus_client import CollectorRegistry

from tensorwire.errors import ConfigError, PeerUnavailable
from tensorwire.mm import wire
from tensorwire.service._proxy import EncoderProxy, ProxyConfig, may_have_orphaned

from .fake_worker import FakeWorker, abort_with, sleep_then

pytestmark = pytest.mark.timeout(60)


def _dead_address() -> str:
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()  # nothing listens there now
    return f"127.0.0.1:{port}"


class Harness:
    def __init__(self, workers: list[FakeWorker], extra: tuple[str, ...] = (), clock=None, **cfg: object) -> None:
        self.workers = [w.start() for w in workers]
        self.registry = CollectorRegistry()
        config = ProxyConfig(workers=tuple(w.address for w in self.workers) + extra, worker_wait_s=5.0, **cfg)
        self.proxy = EncoderProxy(config, registry=self.registry, **({"clock": clock} if clock else {}))
        self.proxy.start("127.0.0.1:0")
        self.channel = grpc.insecure_channel(f"127.0.0.1:{self.proxy.port}", options=wire.channel_options())
        self.encode_rpc = self.channel.unary_unary(
            wire.ENCODE_METHOD,
            request_serializer=wire.EncodeRequest.SerializeToString,
            response_deserializer=wire.EncodeResponse.FromString,
        )
        self.release_rpc = self.channel.unary_unary(
            wire.RELEASE_METHOD,
            request_serializer=wire.ReleaseLeasesRequest.SerializeToString,
            response_deserializer=wire.ReleaseLeasesResponse.FromString,
        )

    def encode(self, rdma: bool = True, timeout: float = 10.0, item_timeout_ms: int = 0) -> wire.EncodeResponse:
        req = wire.EncodeRequest(support_rdma=rdma)
        req.inputs.add(data=b"img", kind="image", timeout_ms=item_timeout_ms)
        return self.encode_rpc(req, timeout=timeout)

    def release(self, ids: list[str]) -> int:
        return self.release_rpc(wire.ReleaseLeasesRequest(lease_ids=ids), timeout=10).released

    def addr(self, index: int) -> str:
        """The ``worker`` label of the index-th worker: its address as configured."""
        return str(self.proxy.config.workers[index])

    def metric(self, name: str, **labels: str) -> float:
        return self.registry.get_sample_value(name, labels or None) or 0.0

    def close(self) -> None:
        self.channel.close()
        self.proxy.stop(1.0)
        for w in self.workers:
            w.stop()


@pytest.fixture
def make() -> Iterator:
    made: list[Harness] = []

    def factory(*args: object, **kwargs: object) -> Harness:
        h = Harness(*args, **kwargs)  # type: ignore[arg-type]
        made.append(h)
        return h

    yield factory
    for h in made:
        h.close()


def _leases(resp: wire.EncodeResponse) -> list[str]:
    from tensorwire.rdma import Descriptor

    return [Descriptor.from_bytes(s.descriptor).lease_id for s in resp.rdma_slots]


def test_spreads_and_releases_to_owners_batched(make) -> None:
    h = make([FakeWorker("w0"), FakeWorker("w1")])
    got = [h.encode() for _ in range(4)]
    assert sorted(r.worker.worker_id for r in got) == ["w0", "w0", "w1", "w1"]
    ids = [lease for r in got for lease in _leases(r)]
    assert len(h.proxy.routes) == 4
    assert h.release(ids + ["never-seen"]) == 4
    # One batch per owner, each holding only that owner's ids.
    assert [sorted(b) for b in h.workers[0].releases] == [sorted(i for i in ids if i.startswith("w0"))]
    assert [sorted(b) for b in h.workers[1].releases] == [sorted(i for i in ids if i.startswith("w1"))]
    assert len(h.proxy.routes) == 0
    assert h.metric("tensorwire_proxy_release_leases_total", outcome="unknown") == 1
    # Inline receipts are forwarded unchanged and create no route.
    inline = h.encode(rdma=False)
    assert inline.embedding.shape == [4, 8] and not inline.rdma_slots and len(h.proxy.routes) == 0


def test_retry_on_another_worker_when_one_is_down(make) -> None:
    h = make([FakeWorker("w0")], extra=(_dead_address(),), check_workers=False)
    for _ in range(4):
        assert h.encode().worker.worker_id == "w0"
    assert h.metric("tensorwire_proxy_retries_total") >= 1
    assert h.metric("tensorwire_proxy_worker_errors_total", worker=h.addr(1), code="UNAVAILABLE") >= 1
    # Connection refused: the worker never ran the request, so nothing can be orphaned.
    assert h.metric("tensorwire_proxy_possibly_orphaning_attempts_total", worker=h.addr(1)) == 0


def test_request_errors_are_not_retried_and_keep_their_reason(make) -> None:
    bad = abort_with(grpc.StatusCode.INVALID_ARGUMENT, "image 0: cannot decode")
    h = make([FakeWorker("w0", on_encode=bad), FakeWorker("w1", on_encode=bad)])
    with pytest.raises(grpc.RpcError) as info:
        h.encode()
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "cannot decode" in info.value.details()
    assert (wire.REASON_METADATA_KEY, "invalid_payload") in tuple(info.value.trailing_metadata())
    assert h.workers[0].encodes + h.workers[1].encodes == 1
    assert h.metric("tensorwire_proxy_retries_total") == 0


def test_retry_after_possible_export_is_counted_as_orphan(make) -> None:
    # w0 takes longer than the per-attempt budget (item timeout 300 ms, margin 0): the call times out after the
    # worker may have exported. The proxy retries on w1 within the caller's 10 s and counts the orphan.
    slow = FakeWorker("w0", on_encode=sleep_then(1.0, ["slow-lease"]))
    h = make([slow, FakeWorker("w1")], rpc_timeout_margin_ms=0, check_workers=False)
    h.proxy._rr = iter(range(0, 10**6, 2))  # always start at w0
    resp = h.encode(item_timeout_ms=300)
    assert resp.worker.worker_id == "w1"
    assert h.metric("tensorwire_proxy_possibly_orphaning_attempts_total", worker=h.addr(0)) == 1
    assert h.metric("tensorwire_proxy_worker_errors_total", worker=h.addr(0), code="DEADLINE_EXCEEDED") == 1
    assert h.proxy.routes.lookup("slow-lease") is None  # the orphan never reached a reader or the table
    # Without RDMA nothing could be exported, so nothing is counted.
    assert h.encode(rdma=False, item_timeout_ms=300).worker.worker_id == "w1"
    assert h.metric("tensorwire_proxy_possibly_orphaning_attempts_total", worker=h.addr(0)) == 1


def test_may_have_orphaned_table() -> None:
    assert may_have_orphaned(grpc.StatusCode.DEADLINE_EXCEEDED, True)
    assert may_have_orphaned(grpc.StatusCode.INTERNAL, True)
    assert not may_have_orphaned(grpc.StatusCode.DEADLINE_EXCEEDED, False)
    assert not may_have_orphaned(grpc.StatusCode.UNAVAILABLE, True)
    assert not may_have_orphaned(grpc.StatusCode.INVALID_ARGUMENT, True)


def test_failed_release_keeps_the_route_for_a_retry(make) -> None:
    h = make([FakeWorker("w0", release_failures=1)])
    ids = _leases(h.encode())
    with pytest.raises(grpc.RpcError) as info:
        h.release(ids)
    assert info.value.code() == grpc.StatusCode.UNAVAILABLE
    assert h.proxy.routes.lookup(ids[0]) == h.workers[0].address
    assert h.release(ids) == 1
    assert h.proxy.routes.lookup(ids[0]) is None and h.workers[0].releases == [ids]


def test_collision_poisons_and_releases_on_both(make) -> None:
    same = lambda _r, _c: ["dup-lease"]  # noqa: E731
    h = make([FakeWorker("w0", on_encode=same), FakeWorker("w1", on_encode=same)])
    h.encode()
    h.encode()
    assert h.proxy.routes.is_poisoned("dup-lease")
    assert h.metric("tensorwire_proxy_lease_collisions_total") == 1
    # Both owners get the poisoned id back (asynchronously).
    import time

    deadline = time.monotonic() + 5
    while time.monotonic() < deadline and not (h.workers[0].releases and h.workers[1].releases):
        time.sleep(0.02)
    assert h.workers[0].releases == [["dup-lease"]] and h.workers[1].releases == [["dup-lease"]]
    assert h.release(["dup-lease"]) == 0  # a reader's release of a poisoned id is not forwarded
    assert h.metric("tensorwire_proxy_release_leases_total", outcome="poisoned") == 1


def test_route_ttl_comes_from_the_workers(make) -> None:
    h = make([FakeWorker("w0", slot_gc_timeout_ms=2_000), FakeWorker("w1", slot_gc_timeout_ms=10_000)])
    assert h.proxy.routes.ttl_s == 15.0
    assert [i.worker_id for i in h.proxy.worker_infos] == ["w0", "w1"]


def test_fixed_rdma_port_shared_on_one_host_is_rejected() -> None:
    workers = [FakeWorker("w0", rdma_port=7000).start(), FakeWorker("w1", rdma_port=7000).start()]
    try:
        proxy = EncoderProxy(
            ProxyConfig(workers=tuple(w.address for w in workers), worker_wait_s=5.0), registry=CollectorRegistry()
        )
        with pytest.raises(ConfigError, match="fixed RDMA port 7000"):
            proxy.start("127.0.0.1:0")
        proxy.stop()
        # Other hosts, or port 0, are fine.
        workers[1].hostname = "host-b"
        ok = EncoderProxy(
            ProxyConfig(workers=tuple(w.address for w in workers), worker_wait_s=5.0), registry=CollectorRegistry()
        )
        assert ok.start("127.0.0.1:0") > 0
        ok.stop()
    finally:
        for w in workers:
            w.stop()


def test_unreachable_worker_fails_start() -> None:
    proxy = EncoderProxy(ProxyConfig(workers=(_dead_address(),), worker_wait_s=0.5), registry=CollectorRegistry())
    with pytest.raises(PeerUnavailable, match="did not answer WorkerInfo"):
        proxy.start("127.0.0.1:0")
    proxy.stop()


@pytest.mark.parametrize(
    "kwargs,match",
    [
        ({"workers": ()}, "at least one"),
        ({"workers": ("a:1", "a:1")}, "twice"),
        ({"workers": ("nohost",)}, "HOST:PORT"),
        ({"workers": ("a:1",), "release_timeout_ms": 0}, "release_timeout_ms"),
    ],
)
def test_config_validation(kwargs: dict, match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        ProxyConfig(**kwargs)


def test_release_rpc_carries_the_release_timeout(make) -> None:
    h = make([FakeWorker("w0")], release_timeout_ms=700)
    assert h.release(_leases(h.encode())) == 1
    [left] = h.workers[0].release_time_left
    assert 0.3 < left <= 0.71  # gRPC rounds the deadline; 1 s (the default) would show here


def test_expired_routes_are_not_forwarded(make) -> None:
    now = [100.0]
    h = make([FakeWorker("w0")], clock=lambda: now[0], check_workers=False, slot_gc_timeout_ms=1_000)
    assert h.proxy.routes.ttl_s == 6.0
    ids = _leases(h.encode())
    now[0] += 6.5
    assert h.release(ids) == 0
    assert h.workers[0].releases == []  # the worker's GC has reclaimed it by now; nothing to forward
    assert h.metric("tensorwire_proxy_release_leases_total", outcome="unknown") == 1
    assert h.metric("tensorwire_proxy_expired_routes_total") == 1


# ---- health, routing around sick workers, broken receipts (issue 16)


def _proxy_health(h: Harness) -> int:
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    stub = health_pb2_grpc.HealthStub(h.channel)
    return int(stub.Check(health_pb2.HealthCheckRequest(service=wire.SERVICE_NAME), timeout=5).status)


def _until(cond, timeout_s: float = 10.0) -> bool:
    import time

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if cond():
            return True
        time.sleep(0.02)
    return cond()


def test_proxy_health_says_whether_any_worker_can_serve(make) -> None:
    from tensorwire._grpc.health import NOT_SERVING, SERVING

    h = make([FakeWorker("w0"), FakeWorker("w1")], probe_interval_s=0.05, probe_timeout_s=1.0)
    assert _proxy_health(h) == SERVING
    assert h.metric("tensorwire_proxy_worker_up", worker=h.addr(0)) == 1
    # One worker says NOT_SERVING (loading, draining): it is DOWN, the proxy still serves through the other.
    h.workers[0].health.set_all(NOT_SERVING)
    assert _until(lambda: h.metric("tensorwire_proxy_worker_up", worker=h.addr(0)) == 0)
    assert _proxy_health(h) == SERVING
    assert {h.encode().worker.worker_id for _ in range(6)} == {"w1"}
    # Both down (the second one dead): NOT_SERVING, where the old proxy answered SERVING forever.
    h.workers[1].stop()
    assert _until(lambda: _proxy_health(h) == NOT_SERVING)
    assert h.metric("tensorwire_proxy_worker_up", worker=h.addr(1)) == 0
    assert h.metric("tensorwire_proxy_worker_down_total", worker=h.addr(1)) == 1
    # A worker back to SERVING is probed back UP, and so is the proxy.
    h.workers[0].health.set_all(SERVING)
    assert _until(lambda: _proxy_health(h) == SERVING)
    assert h.encode().worker.worker_id == "w0"


def test_a_failed_worker_gets_no_new_requests_until_probed_back(make) -> None:
    dead = _dead_address()
    h = make([FakeWorker("w0")], extra=(dead,), check_workers=False, probe_interval_s=30.0)
    for _ in range(10):
        assert h.encode().worker.worker_id == "w0"
    # The old round robin sent every other request to the dead worker first (5 failed attempts); now the first
    # failure takes it out of the rotation and nobody waits on it again.
    assert h.metric("tensorwire_proxy_worker_errors_total", worker=h.addr(1), code="UNAVAILABLE") <= 1
    assert h.metric("tensorwire_proxy_worker_up", worker=h.addr(1)) == 0


def test_every_worker_is_tried_even_when_all_look_down(make) -> None:
    from tensorwire._grpc.health import NOT_SERVING

    workers = [FakeWorker("w0"), FakeWorker("w1")]
    for w in workers:  # both say NOT_SERVING (wrongly: they still answer Encode): the first probes find both DOWN
        w.health.set_all(NOT_SERVING)
    h = make(workers, probe_interval_s=30.0)
    assert _until(lambda: not h.proxy.health.any_up())
    assert h.encode().worker.worker_id in ("w0", "w1")  # a last resort, not a refusal
    assert h.proxy.health.any_up()  # and the success brings that worker back


def _truncate_inline(resp: wire.EncodeResponse) -> None:
    resp.embedding.data = resp.embedding.data[:-4]


def _bad_roles(resp: wire.EncodeResponse) -> None:
    for slot in resp.rdma_slots:
        slot.roles[:] = [0]


@pytest.mark.parametrize("rdma,breaker", [(False, _truncate_inline), (True, _bad_roles)])
def test_a_receipt_a_reader_would_reject_is_retried_on_another_worker(make, rdma: bool, breaker) -> None:
    import time

    h = make([FakeWorker("w0", on_receipt=breaker), FakeWorker("w1")], probe_interval_s=30.0)
    h.proxy._rr = iter(range(0, 10**6, 2))  # always start at w0
    resp = h.encode(rdma=rdma)
    assert resp.worker.worker_id == "w1"  # the old proxy forwarded w0's broken receipt
    assert h.metric("tensorwire_proxy_bad_receipts_total") == 1
    assert h.metric("tensorwire_proxy_worker_errors_total", worker=h.addr(0), code="BAD_RECEIPT") == 1
    if rdma:  # the broken receipt's lease goes back to w0 at once instead of waiting for its GC
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline and not h.workers[0].releases:
            time.sleep(0.02)
        assert h.workers[0].releases == [["w0-1"]]
        assert h.proxy.routes.lookup("w0-1") is None


def test_the_last_workers_broken_receipt_is_forwarded_for_the_client_to_judge(make) -> None:
    h = make([FakeWorker("w0", on_receipt=_truncate_inline)], probe_interval_s=30.0)
    resp = h.encode(rdma=False)
    assert resp.worker.worker_id == "w0" and len(resp.embedding.data) == 124  # the client raises InvalidPayload


def test_draining_proxy_refuses_encode_but_still_routes_releases(make) -> None:
    import threading
    import time

    h = make([FakeWorker("w0")], probe_interval_s=30.0)
    ids = _leases(h.encode())
    stopper = threading.Thread(target=h.proxy.stop, kwargs={"grace_s": 10.0, "drain_s": 2.0})
    t0 = time.monotonic()
    stopper.start()
    try:
        assert _until(lambda: _proxy_health(h) != 1, 5.0)  # NOT_SERVING at once
        ids += _leases(h.encode())  # the drain period still serves
        assert _until(lambda: h.proxy._encodes.closed, 10.0)  # the drain period is over
        with pytest.raises(grpc.RpcError) as info:
            h.encode()
        assert info.value.code() == grpc.StatusCode.UNAVAILABLE and "draining" in info.value.details()
        assert h.release(ids) == 2  # readers of receipts handed out before still release through the proxy
    finally:
        stopper.join(15)
    assert not stopper.is_alive()
    # Every route was released, so the stop did not wait out its 10 s grace.
    assert time.monotonic() - t0 < 8.0


def test_workers_the_caller_names_are_asked_last(make) -> None:
    # The client's inline fallback names the worker whose receipt it could not read (it may have died with its
    # slots, and the proxy may not know yet): the retry goes to another worker, though round robin says w0.
    h = make([FakeWorker("w0"), FakeWorker("w1")], probe_interval_s=30.0)
    h.proxy._rr = iter(range(0, 10**6, 2))  # always start at w0
    req = wire.EncodeRequest(rdma_excluded_workers=["w0"])
    req.inputs.add(data=b"img", kind="image")
    assert h.encode_rpc(req, timeout=10).worker.worker_id == "w1"
    assert h.workers[0].encodes == 0
    # Only when nobody else can answer does it go to a named worker.
    h.workers[1].stop()
    assert h.encode_rpc(req, timeout=10).worker.worker_id == "w0"


def test_a_second_round_asks_a_worker_again_once_the_other_failed_too(make) -> None:
    # The request meets one worker's fault, retries on the other, which fails in turn (it dies while the first
    # is back): a second round, 50 ms later, asks the first again instead of failing the request.
    def fail_first(worker: str):
        calls = []

        def fn(_request, context):
            calls.append(1)
            if len(calls) == 1:
                context.abort(grpc.StatusCode.UNAVAILABLE, f"{worker} restarting")
            return [f"{worker}-ok"]

        return fn

    h = make(
        [FakeWorker("w0", on_encode=fail_first("w0")), FakeWorker("w1", on_encode=fail_first("w1"))],
        probe_interval_s=30.0,
    )
    assert h.encode().worker.worker_id in ("w0", "w1")
    assert h.metric("tensorwire_proxy_retries_total") == 2
    assert h.workers[0].encodes + h.workers[1].encodes == 3


def test_a_request_no_worker_could_answer_says_what_each_attempt_met(make) -> None:
    h = make([FakeWorker("w0")], extra=(_dead_address(),), check_workers=False, probe_interval_s=30.0)
    h.workers[0].stop()
    with pytest.raises(grpc.RpcError) as info:
        h.encode()
    assert info.value.code() == grpc.StatusCode.UNAVAILABLE
    # Three rounds over both workers, each attempt named: an operator sees where the time and the failures went.
    assert "via proxy after 6 attempt(s) [" in info.value.details(), info.value.details()
    assert info.value.details().count(":UNAVAILABLE") == 6
