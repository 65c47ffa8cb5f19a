"""The vLLM connector's engine-independent logic, without vLLM: params, config, the rank countdown, and both
roles' state machines driven with duck-typed requests.

Real gRPC servers carry the control plane (HeldOutputs on 127.0.0.1:0); the data plane is the in-memory fake
(tests/unit/mm/fakes.py), which these tests do not make claims about. NIXL across processes and real vLLM
engines are tested in tests/integration/mm/test_store_processes.py and tests/vllm.
"""

from __future__ import annotations

import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import torch
from prometheus_client import CollectorRegistry

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "mm"))

from fakes import FakeExporter, FakeFabric, FakeReader

from tensorwire.errors import ConfigError, InvalidPayload, Reason
from tensorwire.integrations._vllm_ec.config import ECConfig
from tensorwire.integrations._vllm_ec.consumer import ConsumerScheduler, ConsumerWorker
from tensorwire.integrations._vllm_ec.fetch import Fetcher, LocalStager, RankCountdown
from tensorwire.integrations._vllm_ec.metrics import ECMetrics
from tensorwire.integrations._vllm_ec.params import ItemGrant, entry_for, parse_params
from tensorwire.integrations._vllm_ec.producer import ProducerScheduler, ProducerWorker
from tensorwire.integrations._vllm_ec.version import check_version
from tensorwire.mm.held._rpc import serve_store
from tensorwire.mm.held._staging import Expect, StagingArea
from tensorwire.mm.held._store import HeldStore, new_secret
from tensorwire.rdma import RdmaConfig

ROWS, WIDTH = 4, 8


# -- duck-typed vLLM objects ---------------------------------------------------------------------------------


@dataclass
class Pos:
    offset: int
    length: int

    def get_num_embeds(self) -> int:
        return self.length


@dataclass
class Feat:
    identifier: str
    mm_position: Pos
    data: Any = "media"
    modality: str = "image"


@dataclass
class Req:
    request_id: str
    mm_features: list[Feat]
    ec_transfer_params: Any = None

    @property
    def req_id(self) -> str:  # NewRequestData's name for it
        return self.request_id


def feat(h: str, offset: int = 2, media: bool = True) -> Feat:
    return Feat(h, Pos(offset, ROWS), "media" if media else None)


# -- small pieces --------------------------------------------------------------------------------------------


def test_version_range() -> None:
    check_version("0.32.0", {})
    check_version("0.32.7.dev3+cpu", {})
    check_version("0.33.0", {})
    for bad in ("0.31.9", "0.34.0", "1.0.0", "garbage"):
        with pytest.raises(ImportError, match=r">=0\.32\.0,<0\.34\.0"):
            check_version(bad, {})
    with pytest.raises(ImportError, match="not installed"):
        check_version(None, {})
    check_version("0.34.0", {"TENSORWIRE_VLLM_ALLOW_UNTESTED": "1"})


def test_connector_module_fails_clearly_without_vllm() -> None:
    import importlib.util

    spec = importlib.util.find_spec("vllm")
    if spec is not None and spec.origin not in (None, "namespace"):  # tests/vllm is a namespace package here
        pytest.skip("vLLM is installed here")
    with pytest.raises(ImportError, match="needs vLLM >=0.32.0,<0.34.0"):
        import tensorwire.integrations.vllm
    import tensorwire
    import tensorwire.integrations._vllm_ec.consumer

    assert tensorwire.__version__


def test_config_from_extra_and_env() -> None:
    cfg = ECConfig.from_extra(
        {"port": "7001", "fallback": "fail", "open_seconds": 2},
        {"TENSORWIRE_VLLM_EC_FETCH_TIMEOUT_MS": "1234", "TENSORWIRE_VLLM_EC_PORT": "1"},
    )
    assert (cfg.port, cfg.fallback, cfg.open_seconds, cfg.fetch_timeout_ms) == (7001, "fail", 2.0, 1234)
    with pytest.raises(ConfigError, match="unknown key"):
        ECConfig.from_extra({"prot": 1}, {})
    with pytest.raises(ConfigError, match="fallback"):
        ECConfig.from_extra({"fallback": "maybe"}, {})
    with pytest.raises(ConfigError, match="port"):
        ECConfig.from_extra({"port": True}, {})


def test_params_round_trip_and_validation() -> None:
    g = ItemGrant("10.0.0.5:4000", "h1", new_secret(), (ROWS, WIDTH), "bfloat16", 60000)
    params = {"h1": entry_for(g, {"item_indices": [0], "metadata": {}}), "h2": {"other_connector": 1}}
    parsed = parse_params(params)
    assert parsed == {"h1": g} and params["h1"]["item_indices"] == [0]
    assert "secret" not in repr(g) and g.secret.hex() not in repr(g)
    for mutate in (
        lambda t: t.update(endpoint="no-port"),
        lambda t: t.update(key="h9"),
        lambda t: t.update(secret="abc"),
        lambda t: t.update(shape=[-1, 2]),
        lambda t: t.update(dtype="complex64"),
        lambda t: t.update(v=2),
    ):
        bad = {"h1": entry_for(g)}
        mutate(bad["h1"]["tensorwire"])
        assert isinstance(parse_params(bad)["h1"], InvalidPayload)
    assert parse_params("not a dict") == {} and parse_params(None) == {}


def test_rank_countdown_releases_once_after_every_rank() -> None:
    fired: list[int] = []
    c = RankCountdown(3, lambda: fired.append(1))
    assert not c.done(0) and not c.done(0)  # a duplicate report does not count twice
    assert not c.done(2) and c.outstanding == 1 and not fired
    assert c.done(1) and fired == [1]
    assert not c.done(1) and not c.force() and fired == [1]
    with pytest.raises(ValueError):
        c.done(3)
    forced: list[int] = []
    c2 = RankCountdown(2, lambda: forced.append(1))
    c2.done(0)
    assert c2.force() and forced == [1] and c2.released


# -- the two roles end to end (real gRPC, fake data plane) -------------------------------------------------------


@dataclass
class Rig:
    fabric: FakeFabric
    store: HeldStore
    producer: ProducerScheduler
    pworker: ProducerWorker
    consumer: ConsumerScheduler
    areas: list[StagingArea]
    cworker: ConsumerWorker
    metrics: ECMetrics
    endpoint: str
    servers: list[Any] = field(default_factory=list)
    encoder_cache: dict[str, torch.Tensor] = field(default_factory=dict)

    def produce(self, req: Req, *, ok: bool = True) -> dict[str, Any] | None:
        """One request through the encoder instance: scheduled (grants), encoded (saves), finished (params)."""
        step = self.producer.build_step([req])
        self.pworker.start_save_caches(self.encoder_cache, step)
        for f in req.mm_features:
            if f.identifier not in self.encoder_cache:
                self.encoder_cache[f.identifier] = torch.full((ROWS, WIDTH), float(len(self.encoder_cache) + 1))
                self.pworker.save_caches(self.encoder_cache, f.identifier)
        return self.producer.request_finished(req, finished_ok=ok)

    def until(self, req: Req, n: int = 0, timeout_s: float = 20.0) -> bool:
        """Calls ensure_cache_available as vLLM's scheduler does every step, until True (or times out)."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.consumer.ensure_cache_available(req, n):
                return True
            if req.request_id in self.consumer.take_unavailable_requests():
                return False
            time.sleep(0.005)
        raise TimeoutError("the request stayed held")


def _rig(
    cfg: ECConfig | None = None,
    ranks: int = 1,
    reader: Callable[[FakeFabric], Any] | None = None,
    retire_grace_s: float = 0.0,
) -> Rig:
    cfg = cfg or ECConfig(host="127.0.0.1", fetch_timeout_ms=3000, lookup_timeout_ms=1000)
    fabric = FakeFabric()
    metrics = ECMetrics(CollectorRegistry())
    store = HeldStore(FakeExporter(fabric, RdmaConfig(provider="none")), ttl_s=60)  # type: ignore[arg-type]
    server = serve_store("127.0.0.1:0", store=store)
    producer = ProducerScheduler(
        lambda: server.address, metrics, dtype=torch.float32, width=lambda m: WIDTH, ttl_ms=60000
    )
    make = reader or (lambda fabric: FakeReader(fabric, RdmaConfig(provider="none")))
    areas = [StagingArea(lambda: make(fabric)) for _ in range(ranks)]
    fetcher = Fetcher(cfg, [LocalStager(a, f"rank{i}") for i, a in enumerate(areas)], metrics)
    consumer = ConsumerScheduler(
        cfg, fetcher, metrics, has_media=lambda f: f.data is not None, retire_grace_s=retire_grace_s
    )
    return Rig(
        fabric,
        store,
        producer,
        ProducerWorker(store, metrics),
        consumer,
        areas,
        ConsumerWorker(areas[0], metrics),
        metrics,
        server.address,
        [server],
    )


@pytest.fixture
def rig() -> Any:
    r = _rig()
    yield r
    r.consumer.close()
    for s in r.servers:
        s.stop(0)


def _val(metrics: ECMetrics, counter: Any, *labels: str) -> float:
    return float((counter.labels(*labels) if labels else counter)._value.get())


def _wait(cond: Callable[[], bool], timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError("condition not met in time")
        time.sleep(0.01)


def test_item_is_held_back_fetched_announced_placed_and_released(rig: Rig) -> None:
    preq = Req("p1", [feat("h1")])
    params = rig.produce(preq)
    assert params is not None and rig.store.stats().held_items == 1
    tw = params["h1"]["tensorwire"]
    assert tw["endpoint"] == rig.endpoint and tw["shape"] == [ROWS, WIDTH] and tw["dtype"] == "float32"
    creq = Req("c1", [feat("h1")], params)
    assert not rig.consumer.has_cache_item("h1")
    assert rig.until(creq)
    assert rig.consumer.has_cache_item("h1")
    rig.consumer.update_state_after_alloc(creq, 0)
    loads = rig.consumer.take_loads()
    assert [h for h, _, _ in loads] == ["h1"]
    cache: dict[str, torch.Tensor] = {}
    rig.cworker.start_load_caches(cache, loads)
    assert torch.equal(cache["h1"], rig.encoder_cache["h1"])
    _wait(lambda: rig.store.stats().held_items == 0)  # every rank read: the grant went back at once
    assert _val(rig.metrics, rig.metrics.delivered, "rdma") == 1
    rig.consumer.request_finished(creq)
    _wait(lambda: rig.areas[0].stats().staged_items == 0)
    assert not rig.consumer.has_cache_item("h1")


def test_an_idle_ready_item_is_retired_when_its_grace_has_passed_and_not_before() -> None:
    r = _rig(retire_grace_s=600.0)
    shift = [0.0]
    r.consumer._clock = lambda: time.monotonic() + shift[0]  # type: ignore[method-assign]
    try:
        params = r.produce(Req("p1", [feat("h1")]))
        for n, (now, kept) in enumerate(((590.0, True), (1100.0, True), (1200.0, False))):
            if n < 2:  # loaded at 0, then again at 590: its grace counts from the last load
                creq = Req(f"c{n}", [feat("h1")], params)
                assert r.until(creq)
                r.consumer.update_state_after_alloc(creq, 0)
                r.cworker.start_load_caches({}, r.consumer.take_loads())
                r.consumer.request_finished(creq)
                assert len(r.consumer._idle_ready) == 1  # let go twice before a scan: listed once
            shift[0] = now
            r.consumer.poll()
            assert r.consumer.ready_items == (1 if kept else 0), now
    finally:
        r.consumer.close()
        for s in r.servers:
            s.stop(0)


def test_close_forgets_ready_items_without_dialing_the_workers(caplog: Any) -> None:
    # vLLM shuts its executor down before its scheduler: in the multiprocess executor the workers' staging
    # sockets are gone when the connector's scheduler closes, so a drop per ready item could only fail (it
    # logged "dropping 1 staged item(s) on tp0 failed ... No such file or directory" per item).
    r = _rig(retire_grace_s=600.0)
    try:
        params = r.produce(Req("p1", [feat("h1")]))
        creq = Req("c1", [feat("h1")], params)
        assert r.until(creq)
        r.consumer.update_state_after_alloc(creq, 0)
        r.cworker.start_load_caches({}, r.consumer.take_loads())
        r.consumer.request_finished(creq)
        _wait(lambda: r.store.stats().held_items == 0)  # the grant went back after the read, not at close
        assert r.consumer.ready_items == 1  # kept for the retire grace
        dialed: list[list[str]] = []

        def gone(keys: Any) -> None:
            dialed.append(list(keys))
            raise FileNotFoundError(2, "No such file or directory", "/run/tw/staging-tp0.sock")

        r.consumer._fetcher._stagers[0].drop = gone  # type: ignore[method-assign]
        with caplog.at_level("DEBUG", logger="tensorwire"):
            r.consumer.close()
        assert dialed == [] and r.consumer.ready_items == 0
        assert not [rec for rec in caplog.records if rec.levelno >= 30], caplog.text
    finally:
        r.consumer.close()
        for s in r.servers:
            s.stop(0)


def test_released_early_encodes_locally_with_media_and_fails_without(rig: Rig) -> None:
    params = rig.produce(Req("p1", [feat("h1")]))
    params2 = rig.produce(Req("p2", [feat("h2")]))
    assert params and params2
    for p in (params, params2):
        tw = next(iter(p.values()))["tensorwire"]
        rig.store.release(tw["key"], bytes.fromhex(tw["secret"]))
    with_media = Req("c1", [feat("h1")], params)
    assert rig.until(with_media) is True
    assert not rig.consumer.has_cache_item("h1")  # vLLM encodes it from the request's image
    assert _val(rig.metrics, rig.metrics.fallbacks, "not_held") == 1
    no_media = Req("c2", [feat("h2", media=False)], params2)
    assert rig.until(no_media) is False  # listed for take_unavailable_requests: vLLM fails it
    assert not rig.consumer.ensure_cache_available(no_media, 0)  # and it is never let through
    assert _val(rig.metrics, rig.metrics.unavailable, "not_held") == 1
    rig.consumer.request_finished(no_media)
    rig.consumer.request_finished(with_media)


def test_unreachable_endpoint_falls_back_and_opens_the_breaker(rig: Rig) -> None:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        dead = f"127.0.0.1:{s.getsockname()[1]}"
    reasons = []
    for i in range(4):
        params = rig.produce(Req(f"p{i}", [feat(f"h{i}")]))
        assert params
        params[f"h{i}"]["tensorwire"]["endpoint"] = dead
        req = Req(f"c{i}", [feat(f"h{i}")], params)
        t0 = time.monotonic()
        assert rig.until(req)
        assert time.monotonic() - t0 < 5.0
        reasons.append([k for k in ("peer_unavailable", "breaker_open") if _val(rig.metrics, rig.metrics.fallbacks, k)])
        rig.consumer.request_finished(req)
    assert _val(rig.metrics, rig.metrics.fallbacks, "peer_unavailable") == 3
    assert _val(rig.metrics, rig.metrics.fallbacks, "breaker_open") == 1


def test_bad_params_and_shape_mismatch_never_fetch(rig: Rig) -> None:
    params = rig.produce(Req("p1", [feat("h1")]))
    assert params
    params["h1"]["tensorwire"]["shape"] = [ROWS + 1, WIDTH]
    assert rig.until(Req("c1", [feat("h1")], params))
    assert _val(rig.metrics, rig.metrics.fallbacks, "result_mismatch") == 1
    _wait(lambda: rig.store.stats().held_items == 0)  # the unused grant was given back
    assert rig.until(Req("c2", [feat("h9")], {"h9": {"tensorwire": {"v": 1}}}))
    assert _val(rig.metrics, rig.metrics.fallbacks, "invalid_request") == 1
    assert rig.fabric.reads == []


def test_covered_items_and_requests_without_params_pass_at_once(rig: Rig) -> None:
    assert rig.consumer.ensure_cache_available(Req("c0", [feat("h0")]), 0)
    params = rig.produce(Req("p1", [feat("h1", offset=2)]))
    req = Req("c1", [feat("h1", offset=2)], params)
    assert rig.consumer.ensure_cache_available(req, 2 + ROWS)  # the prefix cache covers the image
    _wait(lambda: rig.store.stats().held_items == 0)  # not needed: its grant went back unused
    assert rig.fabric.reads == []


def test_second_request_with_the_same_item_uses_the_first_fetch(rig: Rig) -> None:
    p1 = rig.produce(Req("p1", [feat("h1")]))
    p2 = rig.produce(Req("p2", [feat("h1")]))  # cached on the encoder instance: a second grant, same export
    assert p1 and p2 and p1["h1"]["tensorwire"]["secret"] != p2["h1"]["tensorwire"]["secret"]
    r1, r2 = Req("c1", [feat("h1")], p1), Req("c2", [feat("h1")], p2)
    assert rig.until(r1)
    assert rig.until(r2)
    assert len(rig.fabric.reads) == 1
    _wait(lambda: rig.store.stats().held_items == 0)  # both grants ended: one read, one unused
    rig.consumer.request_finished(r1)
    assert rig.consumer.has_cache_item("h1")  # r2 still counts on it
    rig.consumer.request_finished(r2)
    rig.consumer.poll()
    assert not rig.consumer.has_cache_item("h1")


def test_request_finished_while_fetching_drops_the_late_result() -> None:
    gate = threading.Event()

    class SlowReader(FakeReader):
        def read(self, descriptors: Any, timeout_ms: int | None = None) -> Any:
            gate.wait(10)
            return super().read(descriptors, timeout_ms)

    r = _rig(reader=lambda fabric: SlowReader(fabric, RdmaConfig(provider="none")))
    try:
        params = r.produce(Req("p1", [feat("h1")]))
        req = Req("c1", [feat("h1")], params)
        assert not r.consumer.ensure_cache_available(req, 0)
        r.consumer.request_finished(req)
        gate.set()
        _wait(lambda: (r.consumer.poll(), r.store.stats().held_items == 0 and r.areas[0].stats().staged_items == 0)[1])
        assert not r.consumer.has_cache_item("h1")
    finally:
        gate.set()
        r.consumer.close()
        for s in r.servers:
            s.stop(0)


def test_a_stuck_read_is_given_up_on_within_the_budget() -> None:
    gate = threading.Event()

    class StuckReader(FakeReader):
        def read(self, descriptors: Any, timeout_ms: int | None = None) -> Any:
            gate.wait(30)  # ignores its deadline, as a wedged transport might
            return super().read(descriptors, timeout_ms)

    cfg = ECConfig(host="127.0.0.1", fetch_timeout_ms=300, lookup_timeout_ms=200)
    r = _rig(cfg, reader=lambda fabric: StuckReader(fabric, RdmaConfig(provider="none")))
    try:
        params = r.produce(Req("p1", [feat("h1")]))
        req = Req("c1", [feat("h1")], params)
        t0 = time.monotonic()
        assert r.until(req, timeout_s=10) is True  # local encode
        assert time.monotonic() - t0 < 0.3 + 2.0 + 1.0
        assert _val(r.metrics, r.metrics.fallbacks, "budget_exhausted") == 1
        gate.set()
        _wait(lambda: (r.consumer.poll(), r.areas[0].stats().staged_items == 0)[1])
    finally:
        gate.set()
        r.consumer.close()
        for s in r.servers:
            s.stop(0)


def test_every_rank_stages_and_the_grant_waits_for_the_last() -> None:
    gate = threading.Event()
    entered = threading.Event()

    class GatedReader(FakeReader):
        def read(self, descriptors: Any, timeout_ms: int | None = None) -> Any:
            if threading.current_thread().name.startswith("tensorwire-ec-rank"):
                entered.set()
                gate.wait(10)  # rank 1 is slow
            return super().read(descriptors, timeout_ms)

    r = _rig(ranks=2, reader=lambda fabric: GatedReader(fabric, RdmaConfig(provider="none")))
    try:
        params = r.produce(Req("p1", [feat("h1")]))
        req = Req("c1", [feat("h1")], params)
        assert not r.consumer.ensure_cache_available(req, 0)
        assert entered.wait(10)
        _wait(lambda: r.areas[0].stats().staged_items == 1)  # rank 0 has it ...
        time.sleep(0.2)
        assert r.store.stats().held_items == 1  # ... but the lease is kept for rank 1
        assert not r.consumer.ensure_cache_available(req, 0)
        gate.set()
        assert r.until(req)
        assert all(a.stats().staged_items == 1 for a in r.areas)
        _wait(lambda: r.store.stats().held_items == 0)
    finally:
        gate.set()
        r.consumer.close()
        for s in r.servers:
            s.stop(0)


def test_one_failing_rank_fails_the_item_and_nothing_is_left_behind() -> None:
    class FailOnRank1(FakeReader):
        def read(self, descriptors: Any, timeout_ms: int | None = None) -> Any:
            if threading.current_thread().name.startswith("tensorwire-ec-rank"):
                from tensorwire.errors import ReadError

                raise ReadError("rank 1's NIC is down", reason=Reason.RDMA_READ_ERROR)
            return super().read(descriptors, timeout_ms)

    r = _rig(ranks=2, reader=lambda fabric: FailOnRank1(fabric, RdmaConfig(provider="none")))
    try:
        params = r.produce(Req("p1", [feat("h1")]))
        req = Req("c1", [feat("h1")], params)
        assert r.until(req)  # local encode: the item was never announced
        assert not r.consumer.has_cache_item("h1")
        assert _val(r.metrics, r.metrics.fallbacks, "rdma_read_error") == 1
        _wait(lambda: r.store.stats().held_items == 0 and all(a.stats().staged_items == 0 for a in r.areas))
    finally:
        r.consumer.close()
        for s in r.servers:
            s.stop(0)


def test_producer_revokes_what_did_not_finish(rig: Rig) -> None:
    assert rig.produce(Req("p1", [feat("h1")]), ok=False) is None
    step = rig.producer.build_step([])
    assert len(step.revokes) == 1
    rig.pworker.start_save_caches(rig.encoder_cache, step)
    assert rig.store.stats().held_items == 0
    assert _val(rig.metrics, rig.metrics.grants, "revoked") == 1


def test_producer_without_a_known_endpoint_announces_nothing() -> None:
    metrics = ECMetrics(CollectorRegistry())
    p = ProducerScheduler(lambda: None, metrics, dtype=torch.float16, width=lambda m: None, ttl_ms=1)
    req = Req("p1", [feat("h1")])
    p.build_step([req])
    assert p.request_finished(req, finished_ok=True) is None
    assert len(p.build_step([]).revokes) == 1


def test_producer_endpoint_is_found_in_process_through_the_file_or_from_the_port(tmp_path: Path) -> None:
    import json

    from tensorwire.integrations._vllm_ec import runtime as rt

    cfg = ECConfig(host="127.0.0.1", runtime_dir=str(tmp_path / "rt"), rdma_provider="none")
    name = rt.instance_name("engine/with spaces", 0)
    assert "/" not in name and name.endswith("-dp0")
    prod = rt.producer_runtime(cfg, name, "cpu")
    try:
        assert prod.exporter is None  # no RDMA provider: the store serves inline copies
        assert rt.producer_endpoint(cfg, name) == prod.endpoint
        file = tmp_path / "rt" / f"{name}.producer.json"
        assert json.loads(file.read_text())["endpoint"] == prod.endpoint
        with rt._lock:
            del rt._producers[name]  # as the scheduler in another process sees it
        assert rt.producer_endpoint(cfg, name) == prod.endpoint
    finally:
        prod.close()
    assert not file.exists() and rt.producer_endpoint(cfg, name) is None
    fixed = ECConfig(host="127.0.0.1", port=7123, runtime_dir=str(tmp_path / "rt"))
    assert rt.producer_endpoint(fixed, "other-dp0") == "127.0.0.1:7123"


def test_runtime_dir_must_be_private(tmp_path: Path) -> None:
    import os

    from tensorwire.integrations._vllm_ec import runtime as rt

    shared = tmp_path / "shared"
    shared.mkdir(mode=0o755)
    os.chmod(shared, 0o755)
    with pytest.raises(ConfigError, match="0700") as e:
        rt.runtime_dir(ECConfig(runtime_dir=str(shared)))
    assert e.value.reason is Reason.INSECURE_PATH
    assert rt.staging_address(ECConfig(runtime_dir=str(tmp_path / "ok")), "n-dp0", 1).endswith("/n-dp0-tp1.sock")


def test_default_runtime_dir_is_per_user_and_its_parent_must_be_ours(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Unset, runtime_dir is ``vllm`` under tensorwire's per-user directory (one /tmp/tensorwire-vllm for every
    user made the second user on a host fail); a per-user directory someone else could write to is refused."""
    import os

    from tensorwire.integrations._vllm_ec import runtime as rt

    monkeypatch.delenv("XDG_RUNTIME_DIR", raising=False)
    monkeypatch.setenv("TMPDIR", str(tmp_path))
    mine = tmp_path / f"tensorwire-{os.geteuid()}"
    assert ECConfig().effective_runtime_dir == str(mine / "vllm")
    assert rt.runtime_dir(ECConfig()) == mine / "vllm"
    assert (os.stat(mine).st_mode & 0o777, os.stat(mine / "vllm").st_mode & 0o777) == (0o700, 0o700)
    xdg = tmp_path / "xdg"
    xdg.mkdir(mode=0o700)
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(xdg))
    assert rt.runtime_dir(ECConfig()) == xdg / "tensorwire" / "vllm"
    os.chmod(xdg / "tensorwire", 0o777)  # another user could swap the vllm folder inside it
    with pytest.raises(ConfigError, match="world-writable") as e:
        rt.runtime_dir(ECConfig())
    assert e.value.reason is Reason.INSECURE_PATH


def test_producer_rdma_endpoint_and_params_name_the_same_host() -> None:
    from tensorwire.integrations._vllm_ec.runtime import _advertise, _rdma_config
    from tensorwire.rdma._endpoint import resolve

    specific = ECConfig(host="10.1.2.3", rdma_port=7101)
    rdma = _rdma_config(specific, "cpu")
    # The metadata endpoint follows the store's gRPC host (no bind_ip of its own) on the configured port.
    assert (rdma.control_host, rdma.bind_ip, rdma.port) == ("10.1.2.3", "", 7101)
    assert _advertise(specific) == resolve(rdma.bind_ip, rdma.advertise_host, rdma.control_host).advertise_host
    # A wildcard host: ec_transfer_params and the descriptors both carry the detected address.
    wild = _rdma_config(ECConfig(), "cpu")
    assert _advertise(ECConfig()) == resolve(wild.bind_ip, wild.advertise_host, wild.control_host).advertise_host
    chosen = ECConfig(advertise_host="enc-1.example")
    assert _advertise(chosen) == _rdma_config(chosen, "cpu").advertise_host == "enc-1.example"


def test_host_agents_sleep_longer_when_idle_and_gpu_agents_keep_the_default() -> None:
    from tensorwire.integrations._vllm_ec.runtime import _CPU_PROGRESS_DELAY_US, _rdma_config
    from tensorwire.rdma import RdmaConfig

    assert _rdma_config(ECConfig(), "cpu").progress_delay_us == _CPU_PROGRESS_DELAY_US > RdmaConfig().progress_delay_us
    assert _rdma_config(ECConfig(), "cuda:0").progress_delay_us == RdmaConfig().progress_delay_us


# -- the release is off the fetch's critical path ------------------------------------------------------------


class _GatedStore(HeldStore):
    """A HeldStore whose release waits for ``gate`` (the encoder instance is slow to answer the Release)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.gate = threading.Event()
        self.release_started = threading.Event()

    def release(self, key: str, secret: bytes) -> bool:
        self.release_started.set()
        self.gate.wait(20)
        return super().release(key, secret)


def _fetch_one(rig: Rig, store_endpoint: str, fetcher: Fetcher, name: str) -> Any:
    params = rig.produce(Req(f"p-{name}", [feat(name)]))
    assert params
    params[name]["tensorwire"]["endpoint"] = store_endpoint
    grant = parse_params(params)[name]
    assert isinstance(grant, ItemGrant)
    return fetcher.start(grant, f"k-{name}", Expect(shape=(ROWS, WIDTH), dtype=torch.float32)).result(timeout=20)


def test_fetch_answers_before_the_release_and_the_release_still_happens(rig: Rig) -> None:
    fabric = rig.fabric
    store = _GatedStore(FakeExporter(fabric, RdmaConfig(provider="none")), ttl_s=60)  # type: ignore[arg-type]
    server = serve_store("127.0.0.1:0", store=store)
    rig.servers.append(server)
    rig.pworker.store = store  # the rig's producer exports into the gated store
    area = StagingArea(lambda: FakeReader(fabric, RdmaConfig(provider="none")))
    metrics = ECMetrics(CollectorRegistry())
    fetcher = Fetcher(ECConfig(host="127.0.0.1"), [LocalStager(area)], metrics)
    try:
        res = _fetch_one(rig, server.address, fetcher, "g1")
        # The item is staged and reported while the Release RPC is still blocked on the encoder side.
        assert res.ok and area.stats().staged_items == 1
        assert store.release_started.wait(20)
        assert store.stats().held_items == 1 and _val(metrics, metrics.releases, "ok") == 0
        store.gate.set()
        _wait(lambda: store.stats().held_items == 0)  # the grant went back: the lease ended
        _wait(lambda: _val(metrics, metrics.releases, "ok") == 1)
    finally:
        store.gate.set()
        fetcher.close()
        area.close()


def test_a_failed_release_is_counted_and_left_to_the_ttl(rig: Rig) -> None:
    area = StagingArea(lambda: FakeReader(rig.fabric, RdmaConfig(provider="none")))
    server = rig.servers[0]

    class StopsTheEncoder(LocalStager):
        """Stages, then the encoder instance goes away before the release can reach it."""

        def stage(self, key: str, receipt: Any, *, timeout_ms: int, expect: Any) -> int:
            n = super().stage(key, receipt, timeout_ms=timeout_ms, expect=expect)
            server.stop(0)
            return n

    metrics = ECMetrics(CollectorRegistry())
    fetcher = Fetcher(ECConfig(host="127.0.0.1", release_timeout_ms=2000), [StopsTheEncoder(area)], metrics)
    try:
        res = _fetch_one(rig, rig.endpoint, fetcher, "f1")
        assert res.ok and area.stats().staged_items == 1  # the item is delivered all the same
        _wait(lambda: _val(metrics, metrics.releases, "failed") == 1, timeout_s=30)
        assert _val(metrics, metrics.releases, "ok") == 0
        assert rig.store.stats().held_items == 1  # still held: the store's TTL GC reclaims it
        assert rig.store.stats().releases == 0
    finally:
        fetcher.close()
        area.close()


def test_the_producer_store_listens_on_loopback_unless_host_says_otherwise(tmp_path: Path, caplog: Any) -> None:
    from tensorwire.integrations._vllm_ec.runtime import ProducerRuntime

    assert ECConfig.from_extra({}, {}).host == "127.0.0.1"  # no wildcard listener by default (docs/security.md)
    with caplog.at_level("WARNING", logger="tensorwire.integrations._vllm_ec.runtime"):
        rt = ProducerRuntime(ECConfig(runtime_dir=str(tmp_path), rdma_provider="none"), "enc-test", "cpu")
    try:
        assert rt.endpoint.startswith("127.0.0.1:")
        assert any(
            "loopback only" in r.getMessage() and "ec_connector_extra_config.host" in r.getMessage()
            for r in caplog.records
        )
    finally:
        rt.close()
