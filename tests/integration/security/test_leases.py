"""Issue 15, deliverable 3 and finding 3: a lease id is a capability (128 random bits, only in the receipt), so a
client cannot release another client's leases by guessing, and unknown ids are answered and counted as unknown.

Against a real ``serve-encoder`` and a real NIXL read in this process. Before issue 15 the ids were one
per-worker prefix plus a counter: the attacker's guesses around its own lease id released the victim's lease
(the victim's read then failed with a stale generation) and ``ReleaseLeases`` answered ``released = len(ids)``.
"""

from __future__ import annotations

import re
import urllib.request
from pathlib import Path

import grpc
import pytest
from _sec import serve

from tensorwire.encoder import sample_paths
from tensorwire.mm import wire
from tensorwire.rdma import Descriptor, RdmaConfig, TensorReader
from tensorwire.testing import hostile


def _encode(ch: grpc.Channel, image: bytes) -> Descriptor:
    raw = ch.unary_unary(wire.ENCODE_METHOD)(hostile.encode_request([image], support_rdma=True), timeout=120)
    receipt = wire.EncodeResponse.FromString(raw)
    assert receipt.rdma_slots, "the worker answered inline; RDMA is needed for this test"
    return Descriptor.from_bytes(receipt.rdma_slots[0].descriptor)


@pytest.mark.timeout(300)
def test_guessed_releases_release_nothing_and_are_answered_as_unknown(tmp_path: Path, require_nixl: None) -> None:
    worker, ready = serve(tmp_path, "worker", "--port", "0", "--metrics-port", "0", "--wait-exporter-s", "60")
    image = sample_paths()[1].read_bytes()
    try:
        with grpc.insecure_channel(ready["grpc"], options=wire.channel_options()) as ch:
            mine = _encode(ch, image)  # the attacker's own receipt: all it learns about the worker's ids
            victims = [_encode(ch, image) for _ in range(3)]  # a victim's receipts, minted right after
            guesses = list(dict.fromkeys(hostile.guess_ids(mine.lease_id, 64) + hostile.guess_ids("", 64)))
            status, released, unknown = hostile.guessed_release(ch, guesses)
            assert status == "ok"
            assert released == 0, "a guessed id named a live lease"
            assert unknown == len(guesses)
            # Every victim lease is still live and reads (NIXL, from this process).
            with TensorReader(RdmaConfig()) as reader:
                for v in victims:
                    tensors = reader.read([v], timeout_ms=30_000)
                    assert tensors[0].shape[1] == 2048
            # Ids: 128 random bits as 32 hex digits, nothing shared between consecutive leases.
            ids = [mine.lease_id] + [v.lease_id for v in victims]
            assert all(re.fullmatch(r"[0-9a-f]{32}", i) for i in ids)
            assert len({i[:8] for i in ids}) == len(ids)
            # The holder of a receipt releases it; a second release of the same id is unknown.
            assert hostile.guessed_release(ch, [v.lease_id for v in victims]) == ("ok", 3, 0)
            assert hostile.guessed_release(ch, [victims[0].lease_id]) == ("ok", 0, 1)
        with urllib.request.urlopen(f"http://{ready['metrics']}/metrics", timeout=10) as resp:
            text = resp.read().decode()
        assert f'tensorwire_mm_encoder_released_leases_total{{outcome="unknown"}} {float(len(guesses) + 1)}' in text
    finally:
        worker.terminate(grace_s=5)
