"""Fuzzing live servers: raw Encode / ReleaseLeases requests (images included) against a real encoder worker
in a child process, and handshakes against a real broadcaster rank 0. The server must answer every input with
a receipt or a typed status, keep serving correct answers (canary), and hold no lease after its GC window; rank
0 must end with a typed error within its timeout and leave no socket file.
"""

from __future__ import annotations

import random
import time

import pytest
from fuzz_settings import examples
from hypothesis import given, settings
from hypothesis import strategies as st

from tensorwire.mm import wire
from tensorwire.soak._corpus import build_corpus
from tensorwire.soak._fuzz_live import LiveEncoder, hello_live, seed_requests
from tensorwire.soak._fuzz_targets import seed_hellos
from tensorwire.soak._mutate import mutate, mutate_proto

CORPUS = build_corpus(3)
IMAGES = list(CORPUS.images)
REQUEST_SEEDS = seed_requests(IMAGES)[:-1]


@pytest.fixture(scope="module")
def server(nixl_available: bool) -> LiveEncoder:
    s = LiveEncoder(IMAGES, CORPUS.digests, env={"UCX_NET_DEVICES": "lo"})
    yield s
    s.close()


def _image(seed: int) -> bytes:
    rng = random.Random(seed)
    kind = rng.randrange(4)
    if kind == 0:
        return rng.randbytes(rng.randint(0, 64))
    if kind == 1:  # a valid image with a corrupted body or header
        return mutate(rng.choice(IMAGES), rng)
    if kind == 2:  # a PNG header claiming a huge size (decompression bomb) with no body
        header = bytes.fromhex("89504e470d0a1a0a0000000d49484452")
        return header + (60000).to_bytes(4, "big") * 2 + b"\x08\x02\x00\x00\x00"
    return rng.choice(IMAGES)


item = st.tuples(
    st.integers(0, 2**32),
    st.sampled_from(["image", "video", ""]),
    st.integers(-5, 10_000),
    st.dictionaries(st.text(max_size=5), st.text(max_size=5), max_size=2),
)


def _request(items: list[tuple[int, str, int, dict[str, str]]], support_rdma: bool, excluded: list[str]) -> bytes:
    from tensorwire.mm._proto import encoder_pb2 as pb

    req = pb.EncodeRequest(support_rdma=support_rdma, rdma_excluded_workers=excluded, deadline_ms=5000)
    for s, kind, t, params in items:
        req.inputs.add(data=_image(s), kind=kind, timeout_ms=t, params=params)
    return req.SerializeToString()


def _mutated_request(s: int) -> bytes:
    from tensorwire.mm._proto import encoder_pb2 as pb

    rng = random.Random(s)
    seed = rng.choice(REQUEST_SEEDS)
    return mutate_proto(seed, pb.EncodeRequest, rng) if rng.random() < 0.5 else mutate(seed, rng, REQUEST_SEEDS)


requests = st.one_of(
    st.builds(
        _request, st.lists(item, max_size=3), st.booleans(), st.lists(st.sampled_from(["fuzz-worker", "x"]), max_size=2)
    ),
    st.integers(0, 2**32).map(_mutated_request),
    st.binary(max_size=256),
)


@pytest.mark.timeout(240)
@settings(max_examples=examples(60))
@given(requests)
def test_encode_requests(server: LiveEncoder, data: bytes) -> None:
    out = server.encode(data)
    assert out == "ok" or out.startswith("typed:"), out


@pytest.mark.timeout(240)
@settings(max_examples=examples(30))
@given(
    st.one_of(
        st.binary(max_size=256),
        st.lists(st.text(max_size=300), max_size=20).map(
            lambda ids: wire.ReleaseLeasesRequest(lease_ids=ids).SerializeToString()
        ),
    )
)
def test_release_requests(server: LiveEncoder, data: bytes) -> None:
    out = server.release(data)
    assert out == "ok" or out.startswith("typed:"), out


@pytest.mark.timeout(120)
def test_server_still_serves_correct_answers_and_holds_no_leases(server: LiveEncoder) -> None:
    # Runs after the fuzzing above (file order): the worker is alive, answers correctly, and its GC (2 s)
    # reclaimed whatever fuzzed requests exported.
    for i in range(len(IMAGES)):
        assert server.canary(i), f"image {i}: wrong or no answer after fuzzing"
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and server.stats()["exporter"].get("live_leases"):
        time.sleep(0.25)
    st_ = server.stats()["exporter"]
    assert server.worker.alive()
    assert st_.get("live_leases", 0) == 0 and st_.get("busy_slots", 0) == 0


@pytest.mark.timeout(240)
@settings(max_examples=examples(15))
@given(
    st.one_of(
        st.binary(max_size=80),
        st.integers(0, 2**32).map(lambda s: mutate(random.Random(s).choice(seed_hellos()), random.Random(s))),
    )
)
def test_broadcaster_handshake_live(data: bytes) -> None:
    out = hello_live(data, 0.5)
    assert out.startswith("typed:"), out  # one fuzz peer can never complete a two-rank bootstrap
