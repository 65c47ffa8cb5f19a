"""Issue 15, data-plane handshake, against a real `tensorwire serve-encoder` process on loopback (default flags).

Findings reproduced as an attacker would, from this (another) process:
1. the RDMA metadata listener bound all interfaces with --host 127.0.0.1; any peer got the owner's NIXL metadata,
   and a request with a wrong agent name was answered with the right one;
8. 40 idle TCP connections exhausted the listener (cap 32): every new client fell back to inline.
Each test here fails on 664a5a7.
"""

from __future__ import annotations

import ipaddress
import os
import socket
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
from prometheus_client import CollectorRegistry

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "unit" / "rdma"))  # the hand-written wire format
from _md_wire import REFUSED_V2, ask, v1_request, v2_request

from tensorwire.encoder import sample_paths
from tensorwire.mm import MultimodalInput, RemoteOutputTransport, TransportConfig, metrics_for, wire
from tensorwire.mm._proto import encoder_pb2 as pb
from tensorwire.rdma import Descriptor
from tensorwire.service._child import Child

pytestmark = pytest.mark.usefixtures("require_nixl")
IMAGE = sample_paths()[0].read_bytes()


@pytest.fixture(scope="module")
def encoder(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Child, str]]:
    child = Child(
        "enc",
        [
            "serve-encoder",
            "--port",
            "0",
            "--metrics-port",
            "-1",
            "--wait-exporter-s",
            "60",
            "--rdma-slot-gc-timeout-ms",
            "5000",
        ],
        tmp_path_factory.mktemp("enc"),
    )
    try:
        yield child, child.ready(120)["grpc"]
    finally:
        child.terminate(grace_s=5)


def _descriptor(address: str) -> Descriptor:
    """One RDMA receipt's first descriptor, got the way any control-plane peer gets it (its lease is left to GC)."""
    with grpc.insecure_channel(address, options=wire.channel_options()) as ch:
        call = ch.unary_unary(
            wire.ENCODE_METHOD,
            request_serializer=pb.EncodeRequest.SerializeToString,
            response_deserializer=pb.EncodeResponse.FromString,
        )
        receipt = call(
            pb.EncodeRequest(inputs=[pb.MultimodalInput(data=IMAGE, kind="image")], support_rdma=True), timeout=60
        )
    assert receipt.rdma_slots, "the encoder answered inline; no exporter?"
    return Descriptor.from_bytes(receipt.rdma_slots[0].descriptor)


def _listening(pid: int) -> list[str]:
    """The local addresses of every TCP socket ``pid`` listens on (from /proc)."""
    inodes = set()
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            target = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:
            continue
        if target.startswith("socket:["):
            inodes.add(target[8:-1])
    out = []
    for table, v6 in (("tcp", False), ("tcp6", True)):
        with open(f"/proc/{pid}/net/{table}") as f:
            for line in list(f)[1:]:
                cols = line.split()
                if cols[3] != "0A" or cols[9] not in inodes:  # 0A: LISTEN
                    continue
                hexaddr = cols[1].split(":")[0]
                raw = bytes.fromhex(hexaddr)
                if v6:
                    raw = b"".join(raw[i : i + 4][::-1] for i in range(0, 16, 4))
                    out.append(str(ipaddress.IPv6Address(raw)))
                else:
                    out.append(str(ipaddress.IPv4Address(raw[::-1])))
    return out


@pytest.mark.timeout(180)
def test_nothing_listens_on_a_wildcard_address(encoder: tuple[Child, str]) -> None:
    child, address = encoder
    desc = _descriptor(address)
    assert desc.owner.host == "127.0.0.1"  # follows --host
    listening = _listening(child.proc.pid)
    assert listening, "found no listening socket of serve-encoder"
    wild = [a for a in listening if ipaddress.ip_address(a).is_unspecified]
    assert not wild, f"serve-encoder listens on a wildcard address: {listening}"


@pytest.mark.timeout(180)
def test_metadata_only_for_the_descriptor_holder_and_no_name_leak(encoder: tuple[Child, str]) -> None:
    owner = _descriptor(encoder[1]).owner
    name = owner.agent_name.encode()
    # The v1 request an attacker who knows (or guesses) the name would send: no metadata, no name.
    for guess in (name, b"tw-exporter-guess"):
        answer = ask(owner.port, v1_request(guess))
        assert name not in answer and len(answer) <= 32, answer
    assert len(owner.metadata_token) >= 16
    # v2 with the right name and a wrong token, or the right token and a wrong name: refused, nothing named.
    for n, t in ((name, b"\0" * 32), (b"tw-exporter-guess", owner.metadata_token)):
        answer = ask(owner.port, v2_request(n, t))
        assert answer == REFUSED_V2, answer
    # The descriptor holder gets it.
    answer = ask(owner.port, v2_request(name, owner.metadata_token))
    assert answer[:6] == b"TWMD\x02\x00" and len(answer) > 100


class _Flood:
    """``idle`` connections to (127.0.0.1, port) that never send a byte, reopened as soon as the server drops one."""

    def __init__(self, port: int, idle: int) -> None:
        self._port, self._idle = port, idle
        self._stop = threading.Event()
        self.opened = 0
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        socks: list[socket.socket] = []
        try:
            while not self._stop.is_set():
                while len(socks) < self._idle:
                    s = socket.socket()
                    s.settimeout(1.0)
                    try:
                        s.connect(("127.0.0.1", self._port))
                    except OSError:
                        s.close()
                        break
                    s.setblocking(False)
                    socks.append(s)
                    self.opened += 1
                alive = []
                for s in socks:  # a dropped connection reads as EOF (or an error): replace it
                    try:
                        if s.recv(1) == b"":
                            s.close()
                            continue
                    except BlockingIOError:
                        pass
                    except OSError:
                        s.close()
                        continue
                    alive.append(s)
                socks = alive
                self._stop.wait(0.02)
        finally:
            for s in socks:
                s.close()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(10)


@pytest.mark.timeout(240)
def test_idle_sockets_do_not_force_new_clients_inline(encoder: tuple[Child, str]) -> None:
    address = encoder[1]
    port = _descriptor(address).owner.port
    flood = _Flood(port, idle=40)
    try:
        end = time.monotonic() + 10
        while flood.opened < 40 and time.monotonic() < end:
            time.sleep(0.05)
        assert flood.opened >= 40
        for _ in range(3):  # fresh readers: each must fetch the owner's metadata while the flood holds on
            with RemoteOutputTransport(address, TransportConfig(), metrics=metrics_for(CollectorRegistry())) as c:
                assert c.wait_ready(60)
                out = c.fetch([MultimodalInput(IMAGE)], timeout_ms=60_000)
                assert out.plane.value == "rdma", out.fallback_reason
    finally:
        flood.stop()
