"""What the LLM side reads from: the producer allow-list, the compatibility hash, and typed Lookup refusals.

Real gRPC servers carry the control plane (HeldOutputs on 127.0.0.1:0); the data plane is the in-memory fake
(tests/unit/mm/fakes.py). Each refusal is checked for what it must not do (dial, read, keep a lease) as well as
for its reason and its fallback.
"""

from __future__ import annotations

import socket
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from prometheus_client import CollectorRegistry

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "mm"))

from fakes import FakeExporter, FakeFabric, FakeReader

from tensorwire.errors import ConfigError, LeaseExpired, ReadError, Reason
from tensorwire.integrations._vllm_ec.config import ECConfig
from tensorwire.integrations._vllm_ec.consumer import ConsumerScheduler
from tensorwire.integrations._vllm_ec.fetch import Fetcher, LocalStager
from tensorwire.integrations._vllm_ec.metrics import ECMetrics
from tensorwire.integrations._vllm_ec.params import parse_params
from tensorwire.integrations._vllm_ec.producer import ProducerScheduler, ProducerWorker
from tensorwire.integrations._vllm_ec.trust import ProducerGate, ProducerTrust, compat_hash, parse_trusted
from tensorwire.mm.held._rpc import HeldStoreClient, serve_store
from tensorwire.mm.held._staging import StagingArea
from tensorwire.mm.held._store import HeldStore, new_secret
from tensorwire.rdma import RdmaConfig

ROWS, WIDTH = 4, 8
OURS = compat_hash(vllm_version="0.32.0", model="m", revision=None, dtype="torch.float32", quantization=None)


class Pos:
    def __init__(self, offset: int, length: int) -> None:
        self.offset, self.length = offset, length

    def get_num_embeds(self) -> int:
        return self.length


class Feat:
    def __init__(self, identifier: str, media: bool = True) -> None:
        self.identifier, self.mm_position, self.modality = identifier, Pos(2, ROWS), "image"
        self.data = "media" if media else None


class Req:
    def __init__(self, rid: str, feats: list[Feat], params: Any = None) -> None:
        self.request_id, self.mm_features, self.ec_transfer_params = rid, feats, params

    @property
    def req_id(self) -> str:
        return self.request_id


class Rig:
    """An encoder instance's store (its own hash ``store_compat``, default ``producer_compat``) and scheduler
    (announcing ``producer_compat``), and an LLM instance's scheduler behind a ProducerGate (``trusted``,
    ``consumer_compat``, which its Lookups carry too)."""

    def __init__(
        self,
        *,
        trusted: str = "",
        producer_compat: str | None = OURS,
        consumer_compat: str | None = OURS,
        store_compat: str | None = None,
        fetch_timeout_ms: int = 5000,
    ) -> None:
        self.fabric = FakeFabric()
        self.metrics = ECMetrics(CollectorRegistry())
        self.store = HeldStore(
            FakeExporter(self.fabric, RdmaConfig(provider="none")),
            ttl_s=60,  # type: ignore[arg-type]
            compat=(producer_compat or "") if store_compat is None else store_compat,
        )
        self.server = serve_store("127.0.0.1:0", store=self.store)
        self.endpoint = self.server.address
        self.producer = ProducerScheduler(
            lambda: self.endpoint,
            self.metrics,
            dtype=torch.float32,
            width=lambda m: WIDTH,
            ttl_ms=60000,
            compat=producer_compat,
        )
        self.pworker = ProducerWorker(self.store, self.metrics)
        cfg = ECConfig(fetch_timeout_ms=fetch_timeout_ms, lookup_timeout_ms=2000, trusted_producers=trusted)
        self.area = StagingArea(lambda: FakeReader(self.fabric, RdmaConfig(provider="none")))
        self.fetcher = Fetcher(cfg, [LocalStager(self.area)], self.metrics, compat=consumer_compat or "")
        self.gate = ProducerGate(ProducerTrust.from_config(cfg.trusted_producers), consumer_compat)
        self.consumer = ConsumerScheduler(
            cfg, self.fetcher, self.metrics, has_media=lambda f: f.data is not None, retire_grace_s=0.0, gate=self.gate
        )
        self.cache: dict[str, torch.Tensor] = {}

    def produce(self, rid: str, mm_hash: str) -> dict[str, Any]:
        req = Req(rid, [Feat(mm_hash)])
        self.pworker.start_save_caches(self.cache, self.producer.build_step([req]))
        self.cache[mm_hash] = torch.full((ROWS, WIDTH), float(len(self.cache) + 1))
        self.pworker.save_caches(self.cache, mm_hash)
        params = self.producer.request_finished(req, finished_ok=True)
        assert params is not None
        return params

    def until(self, req: Req, timeout_s: float = 60.0) -> bool:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.consumer.ensure_cache_available(req, 0):
                return True
            if req.request_id in self.consumer.take_unavailable_requests():
                return False
            time.sleep(0.005)
        raise TimeoutError("the request stayed held")

    def count(self, counter: Any, label: str) -> float:
        return float(counter.labels(label)._value.get())

    def close(self) -> None:
        self.consumer.close()
        self.server.stop(0)


@pytest.fixture
def make_rig() -> Any:
    made: list[Rig] = []

    def make(**kw: Any) -> Rig:
        made.append(Rig(**kw))
        return made[-1]

    yield make
    for r in made:
        r.close()


def _wait(cond: Callable[[], bool], timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError("condition not met in time")
        time.sleep(0.01)


# -- the allow-list, rule by rule ---------------------------------------------------------------------------


def test_default_trusts_loopback_only() -> None:
    t = ProducerTrust.from_config("")
    assert t.admits("127.0.0.1:5000") and t.admits("127.8.9.1:1") and t.admits("[::1]:5000")
    assert t.admits("localhost:5000") and t.admits("LOCALHOST:1")
    for untrusted in (
        "10.0.0.5:5000",
        "0.0.0.0:5000",
        "127.1:5000",
        "2130706433:5000",
        "[fd00::1]:1",
        "localhost.evil.example:5000",
        "[::ffff:10.0.0.1]:1",
        "nonsense",
    ):
        assert not t.admits(untrusted), untrusted


def test_answers_stay_the_same_when_asked_again_and_past_the_remembered_count() -> None:
    t = ProducerTrust.from_config("10.0.0.0/8")
    asked = [f"10.0.{i // 250}.{i % 250}:5000" for i in range(1500)] + ["11.0.0.1:5000", "127.0.0.1:1"]
    first = [t.admits(e) for e in asked]
    assert first == [t.admits(e) for e in asked] == [True] * 1500 + [False, False]


def test_with_a_ca_the_certificate_is_what_is_trusted() -> None:
    assert ProducerTrust.from_config("", tls_ca="/etc/ca.pem").admits("10.9.9.9:5000")
    # an explicit list still applies with TLS
    assert not ProducerTrust.from_config("10.0.0.0/8", tls_ca="/etc/ca.pem").admits("11.0.0.1:5000")


def test_networks_addresses_and_mapped_addresses() -> None:
    t = ProducerTrust.from_config("10.0.0.0/8, fd00::/64 192.168.1.7")
    assert t.admits("10.200.0.1:5000") and t.admits("[fd00::abcd]:1") and t.admits("192.168.1.7:9")
    assert t.admits("[::ffff:10.0.0.1]:1")  # an IPv4-mapped IPv6 address is its IPv4 address
    assert not t.admits("192.168.1.8:9") and not t.admits("127.0.0.1:1") and not t.admits("[fd01::1]:1")


def test_endpoints_pin_the_port() -> None:
    t = ProducerTrust.from_config(["10.0.0.5:41234", "[fd00::5]:7"])
    assert t.admits("10.0.0.5:41234") and t.admits("[fd00::5]:7")
    assert not t.admits("10.0.0.5:41235") and not t.admits("[fd00::5]:8")


def test_names_match_as_written_never_networks() -> None:
    t = ProducerTrust.from_config("enc-1.internal, enc-2.internal:5000, 10.0.0.0/8")
    assert t.admits("enc-1.internal:1") and t.admits("ENC-1.INTERNAL:2") and t.admits("enc-2.internal:5000")
    assert not t.admits("enc-2.internal:5001") and not t.admits("enc-3.internal:1")
    # a name is never resolved to be matched against a network (it could resolve anywhere by dial time)
    assert not ProducerTrust.from_config("127.0.0.0/8").admits("localhost:1")


def test_star_turns_the_check_off_and_bad_entries_are_config_errors() -> None:
    assert parse_trusted("*") is None and ProducerTrust.from_config("*").admits("203.0.113.9:1")
    for bad in ("10.0.0.0/33", "host:99999", "bad host!", "[zz]:1"):
        with pytest.raises(ConfigError):
            parse_trusted(bad)
    with pytest.raises(ConfigError, match="trusted_producers"):
        ECConfig.from_extra({"trusted_producers": "10.0.0.0/40"})
    assert ECConfig.from_extra({"trusted_producers": ["10.0.0.0/8", "enc:1"]}).trusted_producers == "10.0.0.0/8,enc:1"
    assert ECConfig.from_extra({}, {"TENSORWIRE_VLLM_EC_TRUSTED_PRODUCERS": "*"}).trusted_producers == "*"


# -- refusals through the consumer ---------------------------------------------------------------------------


def test_untrusted_endpoint_is_never_dialed_and_the_item_encodes_locally(make_rig: Any) -> None:
    rig = make_rig(trusted="10.0.0.1")  # not loopback: the rig's own store is untrusted too
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen(16)
        listener.setblocking(False)
        params = rig.produce("p1", "h1")
        params["h1"]["tensorwire"]["endpoint"] = f"127.0.0.1:{listener.getsockname()[1]}"
        req = Req("c1", [Feat("h1")], params)
        assert rig.until(req)  # falls back at once: vLLM encodes the image
        no_media = Req("c2", [Feat("h2", media=False)], rig.produce("p2", "h2"))
        assert not rig.until(no_media)  # no media: vLLM fails the request
        rig.consumer.request_finished(req)
        rig.consumer.request_finished(no_media)
        rig.consumer.request_finished(Req("c3", [Feat("h3")], rig.produce("p3", "h3")))  # never looked at
        rig.fetcher.wait_released(10.0)
        with pytest.raises(BlockingIOError):
            listener.accept()  # nothing connected
    assert rig.count(rig.metrics.fallbacks, "untrusted_producer") == 1
    assert rig.count(rig.metrics.unavailable, "untrusted_producer") == 1
    assert rig.count(rig.metrics.refusals, "untrusted_producer") == 2
    assert rig.fetcher._clients == {}  # no client to any endpoint: not even a release was sent
    assert rig.store.stats().held_items == 3 and rig.fabric.reads == []


def test_trusted_endpoint_is_read(make_rig: Any) -> None:
    rig = make_rig(trusted="10.0.0.1, 127.0.0.1")
    req = Req("c1", [Feat("h1")], rig.produce("p1", "h1"))
    assert rig.until(req) and rig.consumer.has_cache_item("h1")
    assert rig.count(rig.metrics.delivered, "rdma") == 1
    rig.consumer.request_finished(req)


@pytest.mark.parametrize("announced", ["f" * 64, None], ids=["other-hash", "no-hash"])
def test_incompatible_producer_is_refused_before_any_read_and_its_grant_goes_back(
    make_rig: Any, announced: str | None
) -> None:
    rig = make_rig(producer_compat=announced)
    params = rig.produce("p1", "h1")
    assert params["h1"]["tensorwire"].get("compat") == announced
    req = Req("c1", [Feat("h1")], params)
    assert rig.until(req) and not rig.consumer.has_cache_item("h1")
    assert rig.count(rig.metrics.fallbacks, "incompatible") == 1
    assert rig.count(rig.metrics.refusals, "incompatible") == 1
    assert rig.fabric.reads == []
    assert rig.fetcher.wait_released(60.0)
    _wait(lambda: rig.store.stats().held_items == 0)  # released, not left to the TTL
    rig.consumer.request_finished(req)


def test_compatible_producer_is_read(make_rig: Any) -> None:
    rig = make_rig()
    params = rig.produce("p1", "h1")
    assert params["h1"]["tensorwire"]["compat"] == OURS
    req = Req("c1", [Feat("h1")], params)
    assert rig.until(req) and rig.consumer.has_cache_item("h1")
    assert rig.count(rig.metrics.refusals, "incompatible") == 0
    rig.consumer.request_finished(req)


def test_compat_hash_covers_version_model_dtype_and_schema() -> None:
    base = dict(vllm_version="0.32.0", model="m", revision=None, dtype="torch.float32", quantization=None)
    assert compat_hash(**base) == OURS and len(OURS) == 64
    for change in (
        {"vllm_version": "0.33.0"},
        {"model": "n"},
        {"revision": "r1"},
        {"dtype": "torch.bfloat16"},
        {"quantization": "fp8"},
    ):
        assert compat_hash(**{**base, **change}) != OURS, change


def test_another_schema_version_is_incompatible() -> None:
    (err,) = parse_params({"h": {"tensorwire": {"v": 2}}}).values()
    assert not isinstance(err, dict) and getattr(err, "reason", None) is Reason.INCOMPATIBLE
    (err,) = parse_params(
        {"h": {"tensorwire": {"v": 1, "endpoint": "127.0.0.1:1", "key": "h", "secret": "ab" * 16, "compat": "XYZ"}}}
    ).values()
    assert getattr(err, "reason", None) is Reason.INVALID_REQUEST


# -- typed refusals on the wire: not_held, not_ready ---------------------------------------------------------


def test_lookup_answers_not_ready_for_a_pending_grant_and_not_held_otherwise() -> None:
    store = HeldStore(None, ttl_s=60)
    server = serve_store("127.0.0.1:0", store=store)
    secret = new_secret()
    store.grant("k", secret)
    try:
        with pytest.raises(ReadError) as pending:
            store.lookup("k", secret)
        assert pending.value.reason is Reason.NOT_READY
        with pytest.raises(LeaseExpired) as unknown:
            store.lookup("k", new_secret())
        assert unknown.value.reason is Reason.NOT_HELD
        with HeldStoreClient(server.address) as c:
            ready, missing = c.lookup([("k", secret), ("other", secret)], timeout_s=10)
            assert isinstance(ready.error, ReadError) and ready.error.reason is Reason.NOT_READY
            assert isinstance(missing.error, LeaseExpired) and missing.error.reason is Reason.NOT_HELD
            store.hold("k", [torch.ones(2)])
            (held,) = c.lookup([("k", secret)], timeout_s=10)
            assert held.error is None and held.receipt is not None
    finally:
        server.stop(0)
        store.close()


def test_not_ready_is_retried_until_the_item_is_held(make_rig: Any) -> None:
    rig = make_rig()
    req = Req("p1", [Feat("h1")])
    rig.pworker.start_save_caches(rig.cache, rig.producer.build_step([req]))  # granted, not encoded yet
    params = rig.producer.request_finished(req, finished_ok=True)
    creq = Req("c1", [Feat("h1")], params)
    assert not rig.consumer.ensure_cache_available(creq, 0)
    _wait(lambda: rig.count(rig.metrics.refusals, "not_ready") >= 1)  # asked, told not ready, asking again
    rig.cache["h1"] = torch.full((ROWS, WIDTH), 7.0)
    threading.Thread(target=rig.pworker.save_caches, args=(rig.cache, "h1")).start()
    assert rig.until(creq) and rig.consumer.has_cache_item("h1")
    assert rig.count(rig.metrics.fallbacks, "not_ready") == 0
    rig.consumer.request_finished(creq)


def test_not_ready_until_the_budget_ends_falls_back_as_not_ready(make_rig: Any) -> None:
    rig = make_rig(fetch_timeout_ms=3000)
    req = Req("p1", [Feat("h1")])
    rig.pworker.start_save_caches(rig.cache, rig.producer.build_step([req]))
    creq = Req("c1", [Feat("h1")], rig.producer.request_finished(req, finished_ok=True))
    assert rig.until(creq) and not rig.consumer.has_cache_item("h1")
    assert rig.count(rig.metrics.fallbacks, "not_ready") == 1
    assert rig.count(rig.metrics.refusals, "not_ready") >= 1
    assert rig.fetcher.breakers.allow(rig.endpoint)  # says nothing about the encoder instance's health
    rig.consumer.request_finished(creq)


def test_lookup_with_another_hash_is_refused_by_the_store() -> None:
    store = HeldStore(None, ttl_s=60, compat="a" * 64)
    server = serve_store("127.0.0.1:0", store=store)
    secret = new_secret()
    store.grant("k", secret)
    store.hold("k", [torch.ones(2)])
    try:
        with HeldStoreClient(server.address) as c:
            refused, other = c.lookup([("k", secret), ("x", secret)], timeout_s=10, compat="b" * 64)
            assert refused.receipt is None and refused.error is not None
            assert refused.error.reason is Reason.INCOMPATIBLE and other.error is not None
            assert other.error.reason is Reason.INCOMPATIBLE  # refused before the store is asked
            (same,) = c.lookup([("k", secret)], timeout_s=10, compat="a" * 64)
            (unchecked,) = c.lookup([("k", secret)], timeout_s=10)
            assert same.error is None and unchecked.error is None
    finally:
        server.stop(0)
        store.close()


def test_params_that_claim_a_matching_hash_are_refused_by_an_incompatible_store(make_rig: Any) -> None:
    rig = make_rig(store_compat="e" * 64)  # the params say OURS (altered in transit); the store knows better
    params = rig.produce("p1", "h1")
    assert params["h1"]["tensorwire"]["compat"] == OURS
    req = Req("c1", [Feat("h1")], params)
    assert rig.until(req) and not rig.consumer.has_cache_item("h1")
    assert rig.count(rig.metrics.fallbacks, "incompatible") == 1
    assert rig.count(rig.metrics.refusals, "incompatible") == 1
    assert rig.fabric.reads == []
    assert rig.fetcher.wait_released(60.0)
    _wait(lambda: rig.store.stats().held_items == 0)  # the grant went back
    assert rig.fetcher.breakers.allow(rig.endpoint)
    rig.consumer.request_finished(req)
