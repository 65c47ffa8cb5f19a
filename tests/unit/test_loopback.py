"""tensorwire._loopback (socket owners from the kernel) and the checks built on it (tensorwire._grpc.owner), in one
process as one user: the owners it reads are the ones the kernel records, by sock_diag and by /proc alike, and a
listener or caller outside the trusted set is refused (test_other_user.py runs the same with a second user)."""

from __future__ import annotations

import os
import socket
from collections.abc import Iterator

import grpc
import pytest

from tensorwire import _loopback
from tensorwire._grpc import status
from tensorwire._grpc.owner import CallerCheck, guard_channel
from tensorwire._grpc.tls import TlsConfig, secure_or_insecure_channel
from tensorwire.errors import Reason

pytestmark = pytest.mark.skipif(not _loopback.available(), reason="needs Linux socket owners")


@pytest.fixture(params=["sock_diag", "proc"])
def source(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    if request.param == "proc":
        monkeypatch.setattr(_loopback, "_netlink_state", [False])
    elif not _loopback._netlink_ok():
        pytest.skip("no sock_diag here")
    yield request.param


@pytest.fixture
def listener() -> Iterator[socket.socket]:
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    s.listen()
    yield s
    s.close()


def test_owners_of_a_listener_and_of_a_connection(source: str, listener: socket.socket) -> None:
    port = listener.getsockname()[1]
    assert _loopback.listener_uids("127.0.0.1", port) == {os.geteuid()}
    assert _loopback.listener_uids("::1", port) == set()  # nothing listens there
    with socket.create_connection(("127.0.0.1", port)) as client:
        conn, (ip, peer_port) = listener.accept()
        with conn:
            assert client.getsockname()[1] == peer_port
            assert _loopback.connection_uid(ip, peer_port, port, ("127.0.0.1",)) == os.geteuid()
            assert _loopback.connection_uid("192.0.2.7", peer_port, port, ("127.0.0.1",)) is None  # not here


def test_trusted_uids_and_peer_strings(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(_loopback.ENV_TRUSTED_UIDS, "1001, x, 1002,")
    assert _loopback.trusted_uids() == {os.geteuid(), 0, 1001, 1002}
    assert _loopback.parse_peer("ipv4:127.0.0.1:5") == ("127.0.0.1", 5)
    assert _loopback.parse_peer("ipv6:[::1]:6") == ("::1", 6)
    assert _loopback.parse_peer("unix:/x") is None
    assert _loopback.is_local_address("127.0.0.1") and not _loopback.is_local_address("192.0.2.7")


def test_a_client_sends_nothing_to_a_listener_it_does_not_trust(
    listener: socket.socket, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(_loopback, "trusted_uids", lambda: frozenset({os.geteuid() + 12345}))
    port = listener.getsockname()[1]
    channel = secure_or_insecure_channel(f"127.0.0.1:{port}", TlsConfig(), [])
    try:
        call = channel.unary_unary("/x.Y/Z", request_serializer=None, response_deserializer=None)
        with pytest.raises(grpc.RpcError) as e:
            call(b"secret request", timeout=5)
        assert e.value.code() == grpc.StatusCode.UNAVAILABLE
        assert status.reason_from_rpc(e.value) is Reason.UNTRUSTED_LISTENER
        assert f"uid {os.geteuid()}" in (e.value.details() or "")
        stream = channel.stream_stream("/x.Y/S", request_serializer=None, response_deserializer=None)
        with pytest.raises(grpc.RpcError):
            next(iter(stream(iter([b"secret"]))))
    finally:
        channel.close()
    listener.setblocking(False)
    with pytest.raises(BlockingIOError):
        listener.accept()  # no connection was ever made


def test_a_listener_refuses_a_caller_it_does_not_trust(
    listener: socket.socket, monkeypatch: pytest.MonkeyPatch
) -> None:
    port = listener.getsockname()[1]
    with socket.create_connection(("127.0.0.1", port)) as client:
        conn, _ = listener.accept()
        with conn:
            peer = f"ipv4:127.0.0.1:{client.getsockname()[1]}"
            assert CallerCheck("127.0.0.1", port).allowed(peer) is None
            monkeypatch.setattr(_loopback, "trusted_uids", lambda: frozenset({os.geteuid() + 12345}))
            why = CallerCheck("127.0.0.1", port).allowed(peer)
            assert why is not None and f"uid {os.geteuid()}" in why
            assert CallerCheck("127.0.0.1", port).allowed(f"ipv4:192.0.2.7:{client.getsockname()[1]}") is not None
            assert CallerCheck("0.0.0.0", port).allowed(f"ipv4:192.0.2.7:{client.getsockname()[1]}") is None
            assert CallerCheck("127.0.0.1", port).allowed("unix:/run/x.sock") is None


def test_only_channels_to_this_host_are_guarded() -> None:
    channel = grpc.insecure_channel("192.0.2.7:1")
    try:
        assert guard_channel(channel, "192.0.2.7:1") is channel  # another host: its TLS is the answer
        assert guard_channel(channel, "unix:/run/x.sock") is channel
        assert guard_channel(channel, "127.0.0.1:1") is not channel
        assert guard_channel(channel, "localhost:1") is not channel
    finally:
        channel.close()
