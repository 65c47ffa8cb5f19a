"""UCX protocol-table parsing and the owner metadata endpoint (real sockets on 127.0.0.1)."""

from __future__ import annotations

import contextlib
import socket
import struct
import threading
import time
from collections.abc import Iterator

import pytest

from tensorwire.errors import ReadError, Reason
from tensorwire.rdma.providers import _metadata
from tensorwire.rdma.providers._ucx_probe import capture_stdout, is_slow_for_gpu, parse_read_tables

TABLES = """\
[1795966691.899754] [vm:5380 :0]   +--------+-------------+-------------------------------------------+
[1795966691.899754] [vm:5380 :0]   | B intra-node cfg#1                                               |
[1795966691.899754] [vm:5380 :0]   | remote memory read by ucp_get*(multi) into host memory from host |
[1795966691.899754] [vm:5380 :0]   +--------+-------------+-------------------------------------------+
[1795966691.899754] [vm:5380 :0]   | Range  | Description |                  Config                   |
[1795966691.899754] [vm:5380 :0]   +--------+-------------+-------------------------------------------+
[1795966691.899754] [vm:5380 :0]   | 0..inf | zero-copy   | cma/memory                                |
[1795966691.899754] [vm:5380 :0]   +--------+-------------+-------------------------------------------+
[1.0] [vm:1 :1]   | remote memory read by ucp_get*(multi) into cuda/GPU0 from cuda/dev[1] |
[1.0] [vm:1 :1]   |    0..8K | software emulation | tcp/lo |
[1.0] [vm:1 :1]   |  8K..inf | zero-copy | 50% on rc_mlx5/mlx5_0:1 and 50% on rc_mlx5/mlx5_1:1 |
"""


def test_parse_the_h200_table() -> None:
    # Seen on an H200 (UCX 1.23, two processes on one GPU).
    text = """\
[1795967947.420108] [vm:427  :0]   | tw-reader-vm-427-943aace9 intra-node cfg#2                            |
[1795967947.420108] [vm:427  :0]   | remote memory read by ucp_get*(multi) into cuda/GPU0 from cuda/dev[1] |
[1795967947.420108] [vm:427  :0]   | Range  | Description |                     Config                     |
[1795967947.420108] [vm:427  :0]   | 0..inf | zero-copy   | cuda_ipc/cuda                                  |
"""
    assert parse_read_tables(text) == {("VRAM", "VRAM"): "cuda_ipc/cuda"}


def test_parse_read_tables() -> None:
    found = parse_read_tables(TABLES)
    assert found[("DRAM", "DRAM")] == "cma/memory"
    gpu = found[("VRAM", "VRAM")]
    assert gpu.startswith("tcp/lo+rc_mlx5/mlx5_0:1+rc_mlx5/mlx5_1:1") and "emulated" in gpu
    assert is_slow_for_gpu(gpu) and not is_slow_for_gpu("cuda_ipc/cuda")
    assert parse_read_tables("nothing here\n") == {}


def test_capture_stdout_keeps_other_lines(capfd: pytest.CaptureFixture[str]) -> None:
    import os

    with capture_stdout() as cap:
        os.write(1, TABLES.encode())
        os.write(1, b"an ordinary line\n")
    assert "cma/memory" in cap.text
    out = capfd.readouterr().out
    assert "an ordinary line" in out and "cma/memory" not in out


TOKEN = b"t" * 32


@pytest.fixture
def server() -> Iterator[_metadata.MetadataServer]:
    srv = _metadata.MetadataServer("127.0.0.1", 0, lambda: ("agent-a", 5, b"md-bytes"), token=TOKEN)
    yield srv
    srv.close()


def _wait_stat(server: _metadata.MetadataServer, field: str, value: int) -> None:
    end = time.monotonic() + 2  # counted by the loop thread just after it answered
    while getattr(server.stats(), field) != value and time.monotonic() < end:
        time.sleep(0.01)
    assert getattr(server.stats(), field) == value, server.stats()


def test_fetch_round_trip(server: _metadata.MetadataServer) -> None:
    assert _metadata.fetch("127.0.0.1", server.port, "agent-a", token=TOKEN, timeout_s=2) == (5, b"md-bytes")
    _wait_stat(server, "served", 1)


def test_wrong_agent_is_refused(server: _metadata.MetadataServer) -> None:
    with pytest.raises(ReadError) as info:
        _metadata.fetch("127.0.0.1", server.port, "agent-b", token=TOKEN, timeout_s=2)
    assert info.value.reason is Reason.METADATA_UNAVAILABLE
    _wait_stat(server, "refused", 1)


def test_unreachable_endpoint_fails_within_the_timeout() -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # bound, not listening: refused
    with pytest.raises(ReadError) as info:
        _metadata.fetch("127.0.0.1", port, "x", token=TOKEN, timeout_s=0.25)
    assert info.value.reason is Reason.METADATA_UNAVAILABLE


def _closed_without_answer(payload: bytes, port: int) -> bool:
    with socket.create_connection(("127.0.0.1", port), timeout=2) as c:
        c.sendall(payload)
        try:
            return c.recv(100) == b""
        except ConnectionResetError:
            return True


def test_garbage_request_does_not_kill_the_server(server: _metadata.MetadataServer) -> None:
    assert _closed_without_answer(b"GET / HTTP/1.0\r\n\r\n", server.port)
    assert _closed_without_answer(struct.pack(">4sBH", b"TWMD", 1, 60000), server.port)  # name over the cap
    assert _closed_without_answer(struct.pack(">4sBHH", b"TWMD", 2, 1, 65000), server.port)  # token over the cap
    assert _metadata.fetch("127.0.0.1", server.port, "agent-a", token=TOKEN, timeout_s=2)[0] == 5


def test_oversized_metadata_reply_is_refused() -> None:
    with socket.socket() as lst:
        lst.bind(("127.0.0.1", 0))
        lst.listen(1)

        def evil() -> None:
            conn, _ = lst.accept()
            with conn:
                conn.recv(100)
                conn.sendall(struct.pack(">4sBBQI", b"TWMD", 2, 0, 1, 1 << 30))

        t = threading.Thread(target=evil)
        t.start()
        with pytest.raises(ReadError, match="over"):
            _metadata.fetch("127.0.0.1", lst.getsockname()[1], "a", token=TOKEN, timeout_s=2)
        t.join(timeout=5)


def test_a_silent_client_does_not_block_others(server: _metadata.MetadataServer) -> None:
    with socket.create_connection(("127.0.0.1", server.port), timeout=5):  # connects, never sends
        t0 = time.monotonic()
        assert _metadata.fetch("127.0.0.1", server.port, "agent-a", token=TOKEN, timeout_s=1)[0] == 5
        assert time.monotonic() - t0 < 0.5


def test_host_names_resolve() -> None:
    srv = _metadata.MetadataServer("127.0.0.1", 0, lambda: ("n", 1, b"m"), token=TOKEN)
    try:
        assert _metadata.fetch("localhost", srv.port, "n", token=TOKEN, timeout_s=2) == (1, b"m")
        with pytest.raises(ReadError):
            _metadata.fetch("no-such-host.invalid", srv.port, "n", token=TOKEN, timeout_s=0.5)
    finally:
        srv.close()


def _slow_answer(lst: socket.socket, delay_s: float, done: threading.Event) -> None:
    conn, _ = lst.accept()
    with conn:
        conn.recv(100)
        done.wait(delay_s)  # ``delay_s`` late, or at once when the test is over
        with contextlib.suppress(OSError):  # the client may have given up and closed
            conn.sendall(struct.pack(">4sBBQI", b"TWMD", 2, 0, 3, 2) + b"md")


@contextlib.contextmanager
def _slow_owner(delay_s: float) -> Iterator[int]:
    """A metadata endpoint on 127.0.0.1 (its port yielded) that answers one request ``delay_s`` late, or when the
    block ends, whichever comes first."""
    done = threading.Event()
    with socket.socket() as lst:
        lst.bind(("127.0.0.1", 0))
        lst.listen(1)
        t = threading.Thread(target=_slow_answer, args=(lst, delay_s, done))
        t.start()
        try:
            yield lst.getsockname()[1]
        finally:
            done.set()
            t.join(timeout=5)


def test_connect_timeout_bounds_the_connect_not_a_slow_answer() -> None:
    # A live owner whose serving thread answers late (a loaded host) is not "unreachable": only the connect is held
    # to connect_timeout_s; the answer may use the rest of the read budget (generous: a busy box delays it more).
    with _slow_owner(0.4) as port:
        got = _metadata.fetch("127.0.0.1", port, "a", token=TOKEN, timeout_s=30, connect_timeout_s=0.1)
    assert got == (3, b"md")


def test_an_answer_later_than_the_whole_budget_fails() -> None:
    # The owner answers only once the fetch is over (or after 60 s): the fetch can only end by its own budget,
    # however loaded the box; one that waited for the answer would take a minute and get it.
    with _slow_owner(60.0) as port:
        t0 = time.monotonic()
        with pytest.raises(ReadError) as info:
            _metadata.fetch("127.0.0.1", port, "a", token=TOKEN, timeout_s=0.3, connect_timeout_s=0.1)
        assert time.monotonic() - t0 < 0.3 + 20.0
    assert info.value.reason is Reason.METADATA_UNAVAILABLE
