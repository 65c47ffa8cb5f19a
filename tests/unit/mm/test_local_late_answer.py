"""A same-host request that timed out: its connection is kept for the worker's late answer, whose leases go to the
release queue instead of waiting for the worker's TTL. A real socket pair; the test plays the worker."""

from __future__ import annotations

import socket
import threading

import pytest
from fakes import rdma_receipt
from prometheus_client import CollectorRegistry

from tensorwire._local import unix as _unix
from tensorwire._ratelog import RateLimitedLog
from tensorwire.errors import DeadlineExceeded
from tensorwire.mm import wire
from tensorwire.mm._metrics import metrics_for
from tensorwire.mm._proto import encoder_pb2 as pb
from tensorwire.mm.client import _local as client_local
from tensorwire.mm.client._channel import Budget
from tensorwire.mm.wire._receipt import WireReceipt


@pytest.mark.parametrize("answer", ["late receipt", "worker hangs up", "no answer"])
def test_a_late_answer_is_released_and_the_connection_let_go(answer: str) -> None:
    ours, worker = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    placements = client_local._Placements(0, "cpu", RateLimitedLog(client_local.log))
    conn = client_local._Conn(ours, placements)
    metrics = metrics_for(CollectorRegistry())
    got: list[bytearray | None] = []
    reader = threading.Thread(target=lambda: got.append(_unix.recv_frame(worker, None, wire.MAX_MESSAGE_BYTES)))
    reader.start()
    with pytest.raises(DeadlineExceeded):
        conn.encode(pb.EncodeRequest(), Budget(100), "worker", metrics)  # the worker does not answer in time
    reader.join(10)
    assert got and got[0]  # the request was written
    conn.close()  # what the pool does with a broken connection
    requeued: list[list[str]] = []
    assert placements._graves and placements._graves[0].awaiting == 1  # kept for the answer
    placements.reap(requeued.append)
    assert requeued == [] and placements._graves  # nothing readable yet: still kept
    if answer == "late receipt":
        _unix.send_frame(worker, WireReceipt.from_message(rdma_receipt("lease-late")).to_stream_pieces(1), None)
    elif answer == "worker hangs up":
        worker.close()
    else:
        placements._graves[0].until = 0.0  # past LATE_ANSWER_S
    placements.reap(requeued.append)
    assert requeued == ([["lease-late"]] if answer == "late receipt" else [])
    assert placements._graves == [] and ours.fileno() == -1  # let go
    if answer != "worker hangs up":
        assert worker.recv(1) == b""  # the worker saw the caller go (its write side shut, then closed)
        worker.close()
