"""The LLM side's fast path without vLLM: fetches advanced on the caller's thread (a Lookup written to the
encoder instance's same-host socket and collected without blocking), and items staged once per host into a
shared-memory segment that another process maps.

Real pieces: the store's gRPC server and same-host socket, memfd segments opened from another OS process. The
data plane is inline (``HeldStore`` without an exporter); the NIXL READ into a segment is tested in
tests/integration/mm/test_store_processes.py, the whole path inside vLLM in tests/vllm.
"""

from __future__ import annotations

import dataclasses
import pickle
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from prometheus_client import CollectorRegistry

from tensorwire.errors import DeadlineExceeded, ProtocolError, Reason
from tensorwire.integrations._vllm_ec.config import ECConfig
from tensorwire.integrations._vllm_ec.consumer import ConsumerWorker
from tensorwire.integrations._vllm_ec.fetch import Fetcher, LocalStager
from tensorwire.integrations._vllm_ec.metrics import ECMetrics
from tensorwire.integrations._vllm_ec.params import ItemGrant
from tensorwire.integrations._vllm_ec.segments import SegmentRef, SegmentStager, map_segment
from tensorwire.mm.held._local import LocalRpcClient, LocalRpcServer
from tensorwire.mm.held._rpc import HeldStoreClient, StoreServer, receipt_for, serve_store
from tensorwire.mm.held._staging import Expect, StagingArea
from tensorwire.mm.held._store import HeldStore, new_secret

SHAPE = (16, 32)
SRC = str(Path(__file__).resolve().parents[3] / "src")


def _val(counter: Any, *labels: str) -> float:
    return float((counter.labels(*labels) if labels else counter)._value.get())


def _wait(cond: Any, what: str, timeout_s: float = 20.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not cond():
        assert time.monotonic() < deadline, what
        time.sleep(0.01)


# -- a call whose answer is collected without blocking ------------------------------------------------------------


def test_a_pending_call_never_blocks_while_the_answer_is_not_there(tmp_path: Path) -> None:
    gate = threading.Event()

    def held_back(raw: bytes, _ctx: Any) -> bytes:
        assert gate.wait(30)
        return b"late:" + raw

    srv = LocalRpcServer("t", {"Held": held_back}, str(tmp_path / "rt"))
    client = LocalRpcClient(srv.path)
    try:
        call = client.begin("Held", b"x", 30.0, "Held")
        for _ in range(20):  # the handler is stuck: every look returns at once, empty
            t0 = time.monotonic()
            assert call.poll() is None
            assert time.monotonic() - t0 < 1.0
        gate.set()
        got = None
        deadline = time.monotonic() + 20
        while got is None and time.monotonic() < deadline:
            got = call.poll()
            time.sleep(0.001)
        assert got == b"late:x"
        # the connection went back to the pool and serves the next call
        assert client.call("Held", b"y", 10.0, "Held") == b"late:y"
    finally:
        gate.set()
        client.close()
        srv.close(0)


def test_a_pending_call_past_its_deadline_says_so(tmp_path: Path) -> None:
    gate = threading.Event()
    srv = LocalRpcServer("t", {"Held": lambda raw, ctx: (gate.wait(30), raw)[1]}, str(tmp_path / "rt"))
    client = LocalRpcClient(srv.path)
    try:
        call = client.begin("Held", b"x", 0.2, "Held")
        with pytest.raises(DeadlineExceeded):
            deadline = time.monotonic() + 20
            while time.monotonic() < deadline:
                call.poll()
                time.sleep(0.01)
    finally:
        gate.set()
        client.close()
        srv.close(0)


# -- the inline fetch ---------------------------------------------------------------------------------------------


@pytest.fixture
def store_server(tmp_path: Path) -> Iterator[tuple[HeldStore, StoreServer]]:
    store = HeldStore(None, ttl_s=60)  # inline receipts
    server = serve_store("127.0.0.1:0", store=store, local_dir=str(tmp_path / "rt"))
    yield store, server
    server.stop(0)
    store.close()


class _ThreadNoting(LocalStager):
    def __init__(self, area: StagingArea) -> None:
        super().__init__(area)
        self.threads: list[str] = []

    def stage(self, key: str, receipt: Any, *, timeout_ms: int, expect: Expect) -> int:
        self.threads.append(threading.current_thread().name)
        return super().stage(key, receipt, timeout_ms=timeout_ms, expect=expect)


def _fetcher(stager: Any) -> tuple[Fetcher, ECMetrics]:
    metrics = ECMetrics(CollectorRegistry())
    cfg = ECConfig(host="127.0.0.1", fetch_timeout_ms=20000, lookup_timeout_ms=10000)
    return Fetcher(cfg, [stager], metrics), metrics


def _hold(store: HeldStore, endpoint: str, key: str, seed: float) -> tuple[ItemGrant, torch.Tensor]:
    secret = new_secret()
    t = torch.full(SHAPE, seed)
    store.grant(key, secret)
    assert store.hold(key, [t])
    return ItemGrant(endpoint, key, secret, SHAPE, "float32"), t


def _discovered(fetcher: Fetcher, endpoint: str) -> None:
    client: HeldStoreClient = fetcher._client(endpoint)  # starts the discovery of the same-host socket
    _wait(lambda: client.local_path != "", "the store's same-host socket was not discovered")


def test_an_inline_fetch_stages_on_the_callers_thread_and_releases(store_server: tuple[HeldStore, StoreServer]) -> None:
    store, server = store_server
    stager = _ThreadNoting(StagingArea(None))
    fetcher, metrics = _fetcher(stager)
    try:
        _discovered(fetcher, server.address)
        grant, want = _hold(store, server.address, "item-1", 3.0)
        fut = fetcher.start(grant, "k1", Expect(SHAPE, torch.float32))
        assert fetcher.inline_pending == 1 and not fut.done()
        _wait(lambda: (fetcher.advance(), fut.done())[1], "the inline fetch did not finish")
        res = fut.result()
        assert res.ok and res.plane == "inline" and res.nbytes == want.numel() * 4, res
        assert stager.threads == [threading.current_thread().name]  # staged here, not on a fetch thread
        got = stager.area.get("k1")
        assert got is not None and torch.equal(got[0], want)
        assert _val(metrics.fetch_paths, "inline") == 1 and _val(metrics.fetch_paths, "thread") == 0
        # The release waits for the step that loads the item (the connector flushes after the forward pass) ...
        assert store.stats().held_items == 1
        fetcher.flush_releases()
        _wait(lambda: store.stats().held_items == 0, "the grant was not released after the read")
        # ... and went out on this thread's socket too: no release thread was woken for it.
        _wait(lambda: (fetcher.advance(), _val(metrics.control_calls, "Release", "local") == 1)[1], "no local Release")
        assert not [t for t in threading.enumerate() if t.name.startswith("tensorwire-ec-release")]
        assert _val(metrics.releases, "ok") == 1 and fetcher.wait_released(10)
    finally:
        fetcher.close()


def test_an_inline_lookup_of_a_missing_item_fails_with_not_held(store_server: tuple[HeldStore, StoreServer]) -> None:
    store, server = store_server
    fetcher, _ = _fetcher(_ThreadNoting(StagingArea(None)))
    try:
        _discovered(fetcher, server.address)
        grant = ItemGrant(server.address, "nothing", new_secret(), SHAPE, "float32")
        fut = fetcher.start(grant, "k1", Expect(SHAPE, torch.float32))
        _wait(lambda: (fetcher.advance(), fut.done())[1], "the inline fetch did not finish")
        res = fut.result()
        assert not res.ok and res.reason is Reason.NOT_HELD, res
    finally:
        fetcher.close()


def test_an_inline_lookup_answered_not_ready_asks_again_until_the_item_is_held(
    store_server: tuple[HeldStore, StoreServer],
) -> None:
    store, server = store_server
    stager = _ThreadNoting(StagingArea(None))
    fetcher, metrics = _fetcher(stager)
    try:
        _discovered(fetcher, server.address)
        secret = new_secret()
        store.grant("late", secret)  # granted, not held yet: the encoder instance is still saving it
        grant = ItemGrant(server.address, "late", secret, SHAPE, "float32")
        fut = fetcher.start(grant, "k1", Expect(SHAPE, torch.float32))
        _wait(
            lambda: (fetcher.advance(), _val(metrics.refusals, Reason.NOT_READY.value) >= 1)[1], "no not_ready answer"
        )
        assert not fut.done()
        assert store.hold("late", [torch.full(SHAPE, 9.0)])
        _wait(lambda: (fetcher.advance(), fut.done())[1], "the inline fetch did not finish")
        res = fut.result()
        assert res.ok, res
        assert set(stager.threads) == {threading.current_thread().name}
    finally:
        fetcher.close()


def test_without_the_socket_the_fetch_thread_takes_it(store_server: tuple[HeldStore, StoreServer]) -> None:
    store, server = store_server
    stager = _ThreadNoting(StagingArea(None))
    fetcher, metrics = _fetcher(stager)
    try:
        grant, want = _hold(store, server.address, "item-1", 5.0)
        # First contact: the same-host socket is not known yet, so a fetch thread runs the Lookup over gRPC.
        res = fetcher.start(grant, "k1", Expect(SHAPE, torch.float32)).result(timeout=30)
        assert res.ok and stager.threads and stager.threads[0] != threading.current_thread().name
        assert _val(metrics.fetch_paths, "thread") == 1
    finally:
        fetcher.close()


def test_a_socket_that_stops_answering_hands_the_fetch_to_a_thread(store_server: tuple[HeldStore, StoreServer]) -> None:
    store, server = store_server
    stager = _ThreadNoting(StagingArea(None))
    fetcher, _ = _fetcher(stager)
    try:
        _discovered(fetcher, server.address)
        grant, want = _hold(store, server.address, "item-1", 6.0)
        fut = fetcher.start(grant, "k1", Expect(SHAPE, torch.float32))
        assert fetcher.inline_pending == 1
        server.local.close(0)  # type: ignore[union-attr]  # the socket's server goes: the written Lookup is lost
        _wait(lambda: (fetcher.advance(), fut.done())[1], "the fetch did not finish")
        res = fut.result()
        assert res.ok, res  # the Lookup went again over gRPC on a fetch thread
        got = stager.area.get("k1")
        assert got is not None and torch.equal(got[0], want)
    finally:
        fetcher.close()


# -- one READ per host: a segment every rank maps ----------------------------------------------------------------

_MAP_IN_CHILD = """
import pickle, sys
sys.path.insert(0, sys.argv[1])
from tensorwire.integrations._vllm_ec.segments import map_segment
ref = pickle.loads(bytes.fromhex(sys.argv[2]))
try:
    t = map_segment(ref)
    sys.stdout.write(pickle.dumps(("ok", t.clone())).hex())
except Exception as exc:
    sys.stdout.write(pickle.dumps(("error", type(exc).__name__)).hex())
"""


def _map_elsewhere(ref: SegmentRef) -> tuple[str, Any]:
    out = subprocess.run(
        [sys.executable, "-c", _MAP_IN_CHILD, SRC, pickle.dumps(ref).hex()], capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0, out.stderr
    status, value = pickle.loads(bytes.fromhex(out.stdout))
    return status, value


def test_the_host_stager_fetches_once_and_another_process_maps_the_item(
    store_server: tuple[HeldStore, StoreServer],
) -> None:
    store, server = store_server
    stager = SegmentStager(None)
    fetcher, metrics = _fetcher(stager)
    try:
        _discovered(fetcher, server.address)
        grant, want = _hold(store, server.address, "item-1", 7.0)
        fut = fetcher.start(grant, "k1", Expect(SHAPE, torch.float32))
        _wait(lambda: (fetcher.advance(), fut.done())[1], "the inline fetch did not finish")
        assert fut.result().ok
        ref = fetcher.load_ref("k1")
        assert isinstance(ref, SegmentRef) and ref.shape == SHAPE and ref.dtype == "float32"
        status, got = _map_elsewhere(ref)  # a rank's worker process
        assert status == "ok" and torch.equal(got, want)
        # The worker half places it from the segment (here: this process maps it too).
        cache: dict[str, torch.Tensor] = {}
        ConsumerWorker(None, metrics).start_load_caches(cache, [("h1", "k1", ref)])
        assert torch.equal(cache["h1"], want) and _val(metrics.placed) == 1
        # Dropped on the scheduler side: the descriptor is closed, no process can open it any more, and what a
        # rank mapped before stays intact.
        fetcher.drop_async(["k1"])
        _wait(lambda: stager.staged == 0, "the segment was not dropped")
        status, _ = _map_elsewhere(ref)
        assert status == "error"
        assert torch.equal(cache["h1"], want)
    finally:
        fetcher.close()


def test_a_segment_reference_that_does_not_fit_its_segment_is_refused() -> None:
    store = HeldStore(None, ttl_s=60)
    stager = SegmentStager(None)
    try:
        secret = new_secret()
        store.grant("a", secret)
        store.hold("a", [torch.ones(SHAPE)])
        stager.stage(
            "k",
            receipt_for(store.lookup("a", secret), rdma=False),
            timeout_ms=5000,
            expect=Expect(SHAPE, torch.float32),
        )
        ref = stager.ref("k")
        assert ref is not None and torch.equal(map_segment(ref), torch.ones(SHAPE))
        with pytest.raises(ProtocolError):  # the descriptor number now names another memfd
            map_segment(dataclasses.replace(ref, name="tw-ec-other"))
        with pytest.raises(ProtocolError):  # a layout past the segment's end
            map_segment(dataclasses.replace(ref, offset=ref.size))
        with pytest.raises(ProtocolError):  # not a segment at all
            map_segment(dataclasses.replace(ref, fd=0))
    finally:
        stager.close()
        store.close()


def test_segments_are_made_ahead_and_each_is_used_once() -> None:
    store = HeldStore(None, ttl_s=60)
    stager = SegmentStager(None)
    try:
        refs = []
        for i in range(4):
            secret = new_secret()
            store.grant(f"a{i}", secret)
            store.hold(f"a{i}", [torch.full(SHAPE, float(i))])
            stager.stage(
                f"k{i}",
                receipt_for(store.lookup(f"a{i}", secret), rdma=False),
                timeout_ms=5000,
                expect=Expect(SHAPE, torch.float32),
            )
            ref = stager.ref(f"k{i}")
            assert ref is not None
            refs.append(ref)
            # A spare of this size is made in the background for the next item.
            size = ref.size
            _wait(lambda: stager.spare_bytes >= size, "no spare segment was made ahead")  # noqa: B023
        assert len({r.name for r in refs}) == 4  # never the same segment twice
        for i, ref in enumerate(refs):  # earlier items are intact: a segment in use is never handed out again
            assert torch.equal(map_segment(ref), torch.full(SHAPE, float(i)))
    finally:
        stager.close()
        store.close()
    assert stager.spare_bytes == 0
