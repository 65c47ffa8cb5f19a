"""Receipts from the encoder instance's worker to its scheduler (``ReceiptBoard``) and in the params.

The board's file mode is what two processes of one vLLM instance use; two boards over the same directory stand in
for them here (the files are the whole interface). The read of a receipt over NIXL, from another process, is tested
in tests/integration/mm/test_store_processes.py; the whole path inside vLLM in tests/vllm.
"""

from __future__ import annotations

import base64
import os
from pathlib import Path

import pytest
import torch
from prometheus_client import CollectorRegistry

from tensorwire.errors import InvalidPayload
from tensorwire.integrations._vllm_ec.metrics import ECMetrics
from tensorwire.integrations._vllm_ec.params import ItemGrant, parse_entry, parse_params
from tensorwire.integrations._vllm_ec.producer import ProducerScheduler, ProducerWorker
from tensorwire.integrations._vllm_ec.receipts import MAX_RECEIPT_BYTES, ReceiptBoard, parse_receipt
from tensorwire.mm._proto import encoder_pb2 as pb


def _dir(tmp_path: Path) -> int:
    d = tmp_path / "rt"
    d.mkdir(mode=0o700, exist_ok=True)
    return os.open(d, os.O_RDONLY | os.O_DIRECTORY)


def test_a_receipt_crosses_from_one_board_to_another_once(tmp_path: Path) -> None:
    worker, scheduler = ReceiptBoard("inst-dp0", _dir(tmp_path)), ReceiptBoard("inst-dp0", _dir(tmp_path))
    try:
        worker.put("hash-a", b"receipt-a")
        worker.put("hash-b", b"receipt-b")
        assert scheduler.take("hash-a") == b"receipt-a"
        assert scheduler.take("hash-a") is None  # taken: removed
        scheduler.discard("hash-b")  # revoked: never announced
        assert scheduler.take("hash-b") is None
        assert not [n for n in os.listdir(tmp_path / "rt") if ".rcpt." in n]
        # Another instance's receipts are not this one's.
        ReceiptBoard("other-dp0", _dir(tmp_path)).put("hash-c", b"theirs")
        assert scheduler.take("hash-c") is None
        assert worker.clear() == 0  # clear removes this instance's receipts only
        assert len([n for n in os.listdir(tmp_path / "rt") if ".rcpt." in n]) == 1
    finally:
        worker.close()
        scheduler.close()


def test_in_one_process_the_receipts_stay_in_memory(tmp_path: Path) -> None:
    board = ReceiptBoard("inst-dp0", _dir(tmp_path))
    try:
        board.reader_here()
        board.put("hash-a", b"receipt-a")
        assert os.listdir(tmp_path / "rt") == []
        assert board.take("hash-a") == b"receipt-a" and board.take("hash-a") is None
    finally:
        board.close()


def test_a_planted_symlink_or_an_oversized_file_is_not_a_receipt(tmp_path: Path) -> None:
    worker, scheduler = ReceiptBoard("inst-dp0", _dir(tmp_path)), ReceiptBoard("inst-dp0", _dir(tmp_path))
    try:
        name = scheduler._file("hash-a")
        secret = tmp_path / "elsewhere"
        secret.write_bytes(b"not yours")
        os.symlink(secret, tmp_path / "rt" / name)
        assert scheduler.take("hash-a") is None  # O_NOFOLLOW
        worker.put("hash-b", b"x" * (MAX_RECEIPT_BYTES + 1))
        assert scheduler.take("hash-b") is None
    finally:
        worker.close()
        scheduler.close()


def test_params_carry_the_receipt_and_refuse_a_malformed_one() -> None:
    grant = ItemGrant("127.0.0.1:5000", "h1", b"\x01" * 16, (4, 8), "float32", 60000, "ab" * 16, b"\x00\xffslot")
    entry = {"tensorwire": grant.to_json()}
    back = parse_entry("h1", entry)
    assert back is not None and back.receipt == b"\x00\xffslot"
    bad = dict(entry["tensorwire"], receipt="not base64!")
    with pytest.raises(InvalidPayload):
        parse_entry("h1", {"tensorwire": bad})
    huge = dict(entry["tensorwire"], receipt=base64.b64encode(b"x" * 20000).decode() + "AAAA")
    assert isinstance(parse_params({"h1": {"tensorwire": huge}})["h1"], InvalidPayload)
    no_receipt = dict(entry["tensorwire"])
    del no_receipt["receipt"]
    got = parse_entry("h1", {"tensorwire": no_receipt})
    assert got is not None and got.receipt is None


def test_only_slot_receipts_are_accepted_from_params() -> None:
    inline = pb.EncodeResponse()
    inline.embedding.shape[:] = [1]
    assert parse_receipt(inline.SerializeToString()) is None  # tensor bytes never ride in params
    assert parse_receipt(b"\xff\xff\xff") is None
    slot = pb.EncodeResponse()
    slot.rdma_slots.add().descriptor = b"d"
    assert parse_receipt(slot.SerializeToString()) is not None


class _Feat:
    def __init__(self, ident: str) -> None:
        self.identifier = ident
        self.modality = "image"

        class _Pos:
            def get_num_embeds(self) -> int:
                return 4

        self.mm_position = _Pos()


class _Req:
    def __init__(self, rid: str, feats: list[_Feat]) -> None:
        self.req_id = self.request_id = rid
        self.mm_features = feats


class _Store:
    """A HeldStore stand-in that holds every item in RDMA slots (the receipt is what announceable makes)."""

    is_rdma = True

    def __init__(self) -> None:
        self.held: dict[str, object] = {}

    def grant(self, key: str, secret: bytes) -> None:
        pass

    def release(self, key: str, secret: bytes) -> bool:
        return True

    def holds(self, key: str) -> bool:
        return key in self.held

    def hold(self, key: str, tensors: list[torch.Tensor]) -> bool:
        self.held[key] = tensors
        return True

    def peek(self, key: str) -> object:
        return key


def test_the_producer_announces_the_receipt_its_worker_left(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import tensorwire.integrations._vllm_ec.producer as producer

    monkeypatch.setattr(producer, "announceable", lambda item: f"receipt-of-{item}".encode())
    metrics = ECMetrics(CollectorRegistry())
    worker_board, sched_board = ReceiptBoard("i-dp0", _dir(tmp_path)), ReceiptBoard("i-dp0", _dir(tmp_path))
    try:
        sched = ProducerScheduler(
            lambda: "127.0.0.1:5000",
            metrics,
            dtype=torch.float32,
            width=lambda m: 8,
            ttl_ms=60000,
            board=sched_board,
        )
        worker = ProducerWorker(_Store(), metrics, worker_board)  # type: ignore[arg-type]
        req = _Req("r1", [_Feat("h1")])
        step = sched.build_step([req])
        worker.start_save_caches({}, step)
        worker.save_caches({"h1": torch.zeros(4, 8)}, "h1")
        params = sched.request_finished(req, finished_ok=True)
        assert params is not None
        got = parse_params(params)["h1"]
        assert isinstance(got, ItemGrant) and got.receipt == b"receipt-of-h1"
        # A second request for the same item (held once, so one receipt on the board) is announced with it too.
        again = _Req("r2", [_Feat("h1")])
        sched.build_step([again])
        second = parse_params(sched.request_finished(again, finished_ok=True))["h1"]
        assert isinstance(second, ItemGrant) and second.receipt == b"receipt-of-h1"
        # A request that did not finish leaves nothing on the board.
        aborted = _Req("r3", [_Feat("h3")])
        worker.start_save_caches({}, sched.build_step([aborted]))
        worker.save_caches({"h3": torch.zeros(4, 8)}, "h3")
        assert sched.request_finished(aborted, finished_ok=False) is None
        assert sched_board.take("h3") is None
    finally:
        worker_board.close()
        sched_board.close()
