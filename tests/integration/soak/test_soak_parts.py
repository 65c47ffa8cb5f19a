"""The soak's parts on their own: fault parsing, config checks, and that every receipt corruption the soak
injects is one the client detects (else the soak could report a "wrong output" that is a design limit)."""

from __future__ import annotations

import random

import pytest

from tensorwire.errors import ConfigError
from tensorwire.mm._proto import encoder_pb2 as pb
from tensorwire.soak import FAULT_KINDS, SoakConfig, parse_faults
from tensorwire.soak._corrupt import MUTATORS
from tensorwire.soak._fuzz_targets import ReceiptHarness, seed_receipts

# Detected only by the real data plane (generation word after the READ; metadata fetch from the owner), which
# the in-memory harness reader does not model; the soak counts them as stale_generation / metadata_unavailable.
NEEDS_REAL_READER = {"desc_generation", "desc_owner_port", "desc_agent_name"}


def test_parse_faults() -> None:
    assert parse_faults("all") == FAULT_KINDS
    assert parse_faults("none") == ()
    assert parse_faults("reader_kill, pool") == ("reader_kill", "pool")
    with pytest.raises(ConfigError, match="unknown fault"):
        parse_faults("reader_kill,explode")


def test_config_checks() -> None:
    with pytest.raises(ConfigError):
        SoakConfig(concurrency=0)
    with pytest.raises(ConfigError, match="pool fault needs two workers"):
        SoakConfig(workers=1, faults=("pool",))
    with pytest.raises(ConfigError):
        SoakConfig(planes=("rdma",))
    assert SoakConfig(concurrency=16).processes == 4 and SoakConfig(concurrency=2).processes == 2


@pytest.mark.timeout(60)
def test_every_injected_corruption_is_detected() -> None:
    harness = ReceiptHarness()
    seeds = seed_receipts(random.Random(0))
    try:
        assert all(harness(s) == "ok" for s in seeds)
        applied: set[str] = set()
        for name, mutator in MUTATORS.items():
            for i, raw in enumerate(seeds):
                for k in range(5):
                    resp = pb.EncodeResponse.FromString(raw)
                    if not mutator(resp, random.Random(i * 10 + k)):
                        continue
                    applied.add(name)
                    outcome = harness(resp.SerializeToString())
                    if name not in NEEDS_REAL_READER:
                        assert outcome.startswith("typed:"), f"{name} on seed {i} was not detected: {outcome}"
        assert applied == set(MUTATORS), f"mutators that never applied: {set(MUTATORS) - applied}"
    finally:
        harness.close()


def test_fault_windows_attribute_each_request_to_the_fault_it_overlapped() -> None:
    from tensorwire.soak._windows import FaultWindows, Outcome

    w = FaultWindows()
    w.add("client_cut", "front", 10.0, 12.0)
    restart = w.open("worker_restart", "w1", 20.0)
    w.add("worker_cut", "w0", 40.0, 41.0)
    assert w.open_at(25.0, ("worker_restart", "worker_cut")) == [restart]  # the scheduler's one-at-a-time check
    w.close(restart, 30.0)
    assert w.open_at(31.0, ("worker_restart", "worker_cut")) == []
    outcomes = [
        Outcome(11.0, 11.5, False, "PeerUnavailable:peer_unavailable"),  # inside the client cut: excluded
        Outcome(9.0, 10.1, True, ""),  # overlaps the cut's start: still the cut's
        Outcome(19.0, 21.0, False, "PeerUnavailable:peer_unavailable", "via proxy: ..."),  # the restart's
        Outcome(29.5, 33.0, True, ""),
        Outcome(40.5, 40.6, True, ""),
        Outcome(50.0, 51.0, True, ""),
        Outcome(11.9, 20.5, False, "x:y"),  # overlaps a cut and a restart: the client cut wins
    ]
    s = w.summarize(outcomes, end=60.0)
    rows = s["by_fault"]
    assert (rows["client_cut"]["requests"], rows["client_cut"]["ok"]) == (3, 1)
    assert (rows["worker_restart"]["requests"], rows["worker_restart"]["ok"]) == (2, 1)
    assert rows["worker_restart"]["failed_by_reason"] == {"PeerUnavailable:peer_unavailable": 1}
    assert rows["worker_restart"]["failure_examples"] == ["via proxy: ..."]
    assert (rows["worker_cut"]["requests"], rows["none"]["requests"]) == (1, 1)
    out = s["outside_client_cuts"]
    assert (out["requests"], out["ok"], out["met"]) == (4, 3, False)
    assert s["window_seconds"] == {"client_cut": 2.0, "worker_restart": 10.0, "worker_cut": 1.0}


def test_the_proxy_rejects_the_structurally_broken_corruptions() -> None:
    """What the proxy's receipt check (``_receipt.check_receipt``) catches of the soak's corruptions: each one it
    catches is retried on another worker instead of reaching the client."""
    from tensorwire.mm.client._rdma_receipt import check_receipt
    from tensorwire.rdma import Descriptor

    parse = lambda data: Descriptor.from_bytes(data, max_slot_bytes=1 << 48)  # noqa: E731 - as the proxy does
    seeds = seed_receipts(random.Random(0))
    assert all(check_receipt(pb.EncodeResponse.FromString(s), parse)[1] is None for s in seeds)
    caught: set[str] = set()
    for name, mutator in MUTATORS.items():
        for i, raw in enumerate(seeds):
            resp = pb.EncodeResponse.FromString(raw)
            if mutator(resp, random.Random(i)) and check_receipt(resp, parse)[1] is not None:
                caught.add(name)
    # Everything but what only the real data plane can see (the client falls back to inline on those).
    assert caught == set(MUTATORS) - NEEDS_REAL_READER, set(MUTATORS) - caught
