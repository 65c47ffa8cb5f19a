"""The metadata endpoint hands the owner's NIXL metadata only to token holders, names nobody, and idle sockets
cannot lock readers out (issue 15 findings 1 and 8, at the socket level; tests/integration/net/ drives the real
processes)."""

from __future__ import annotations

import socket
import struct
import threading
import time
from collections.abc import Iterator

import pytest
from _md_wire import REFUSED_V2, ask, v1_request, v2_request

from tensorwire.errors import ReadError, Reason
from tensorwire.rdma.providers import _metadata

TOKEN = bytes(range(32))
NAME = "tw-exporter-host-1234-abcd"
MD = b"secret-agent-metadata" * 8


@pytest.fixture
def server() -> Iterator[_metadata.MetadataServer]:
    srv = _metadata.MetadataServer("127.0.0.1", 0, lambda: (NAME, 7, MD), token=TOKEN)
    yield srv
    srv.close()


@pytest.mark.parametrize(
    "name, token", [(NAME, b""), (NAME, b"x" * 32), (NAME, TOKEN[:-1] + b"\0"), ("someone-else", TOKEN), ("", b"")]
)
def test_without_the_token_or_with_another_name_nothing_is_handed_out(
    server: _metadata.MetadataServer, name: str, token: bytes
) -> None:
    answer = ask(server.port, v2_request(name.encode(), token))
    assert answer == REFUSED_V2
    assert NAME.encode() not in answer and MD not in answer


def test_a_tokenless_v1_request_gets_neither_metadata_nor_the_name(server: _metadata.MetadataServer) -> None:
    # Today's readers before tokens, and the attack of finding 1: a request with a wrong agent name was answered
    # with the right one, a request with the right name with the metadata.
    for name in (NAME, "guess"):
        answer = ask(server.port, v1_request(name.encode()))
        assert answer == struct.pack(">4sBBQH", b"TWMD", 1, _metadata.STATUS_WRONG_AGENT, 0, 0) + struct.pack(">I", 0)
    assert server.stats().refused == 2 and server.stats().served == 0


def test_the_token_holder_gets_the_metadata(server: _metadata.MetadataServer) -> None:
    assert _metadata.fetch("127.0.0.1", server.port, NAME, token=TOKEN, timeout_s=2) == (7, MD)
    with pytest.raises(ReadError, match="refused") as info:
        _metadata.fetch("127.0.0.1", server.port, NAME, token=b"wrong", timeout_s=2)
    assert info.value.reason is Reason.METADATA_UNAVAILABLE and NAME not in str(info.value).split("for")[0]


def test_a_reader_still_talks_to_an_owner_that_predates_tokens() -> None:
    # Descriptors from such an owner carry no token: the reader speaks version 1 and checks the echoed name.
    with socket.socket() as lst:
        lst.bind(("127.0.0.1", 0))
        lst.listen(2)

        def old_owner() -> None:
            for _ in range(2):
                conn, _ = lst.accept()
                with conn:
                    head = conn.recv(7)
                    assert head[:5] == b"TWMD\x01"
                    (n,) = struct.unpack(">H", head[5:7])
                    conn.recv(n)
                    conn.sendall(struct.pack(">4sBBQH", b"TWMD", 1, 0, 3, 3) + b"old" + struct.pack(">I", 2) + b"md")

        t = threading.Thread(target=old_owner)
        t.start()
        port = lst.getsockname()[1]
        assert _metadata.fetch("127.0.0.1", port, "old", timeout_s=2) == (3, b"md")
        with pytest.raises(ReadError, match="serves agent 'old'"):
            _metadata.fetch("127.0.0.1", port, "new", timeout_s=2)
        t.join(timeout=5)


@pytest.mark.parametrize("cap, idle", [(32, 40), (_metadata.MAX_CONNECTIONS, 40)])
def test_idle_connections_do_not_lock_readers_out(cap: int, idle: int) -> None:
    # Finding 8: 40 idle TCP connections exhausted a cap of 32 and every new reader fell back inline.
    srv = _metadata.MetadataServer("127.0.0.1", 0, lambda: (NAME, 7, MD), token=TOKEN, max_connections=cap)
    socks: list[socket.socket] = []
    try:
        for _ in range(idle):
            socks.append(socket.create_connection(("127.0.0.1", srv.port), timeout=3))
        for _ in range(5):
            t0 = time.monotonic()
            assert _metadata.fetch("127.0.0.1", srv.port, NAME, token=TOKEN, timeout_s=2) == (7, MD)
            assert time.monotonic() - t0 < 1.0
        if idle > cap:
            assert srv.stats().evicted >= idle - cap
    finally:
        for s in socks:
            s.close()
        srv.close()


def test_a_request_not_sent_in_time_is_dropped() -> None:
    srv = _metadata.MetadataServer("127.0.0.1", 0, lambda: (NAME, 7, MD), token=TOKEN, request_timeout_s=0.2)
    try:
        with socket.create_connection(("127.0.0.1", srv.port), timeout=5) as c:
            c.sendall(b"TWMD\x02")  # half a header, then silence
            t0 = time.monotonic()
            assert c.recv(10) == b""  # closed by the server
            assert 0.1 < time.monotonic() - t0 < 2.0
        assert srv.stats().rejected >= 1
    finally:
        srv.close()


def test_a_request_split_over_many_packets_is_answered(server: _metadata.MetadataServer) -> None:
    payload = v2_request(NAME.encode(), TOKEN)
    with socket.create_connection(("127.0.0.1", server.port), timeout=3) as c:
        c.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        for b in payload:
            c.sendall(bytes([b]))
        out = b""
        while chunk := c.recv(65536):
            out += chunk
    assert out == struct.pack(">4sBBQI", b"TWMD", 2, 0, 7, len(MD)) + MD


def test_large_metadata_reaches_a_slow_reader() -> None:
    # Many registrations make the metadata large; the answer is written as the reader drains its socket.
    big = bytes(range(256)) * (16 * 1024)  # 4 MiB, far over any socket buffer
    srv = _metadata.MetadataServer("127.0.0.1", 0, lambda: (NAME, 9, big), token=TOKEN, io_timeout_s=60)
    try:
        with socket.create_connection(("127.0.0.1", srv.port), timeout=30) as c:
            c.sendall(v2_request(NAME.encode(), TOKEN))
            time.sleep(0.3)  # let the server fill the socket buffers and block on them
            out = b""
            while chunk := c.recv(65536):
                out += chunk
        assert out == struct.pack(">4sBBQI", b"TWMD", 2, 0, 9, len(big)) + big
        assert _metadata.fetch("127.0.0.1", srv.port, NAME, token=TOKEN, timeout_s=30) == (9, big)
    finally:
        srv.close()
