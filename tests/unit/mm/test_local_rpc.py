"""The held-outputs store's same-host channel (mm/_local_rpc.py): the framed calls, their errors and their
refusals, and HeldStoreClient's discovery and gRPC fallback against a real StoreServer."""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Iterator
from typing import Any

import grpc
import pytest
import torch

from tensorwire._local import unix as _unix
from tensorwire.errors import ClosedError, DeadlineExceeded, InvalidPayload, LeaseExpired, Reason
from tensorwire.mm import wire
from tensorwire.mm._proto import held_pb2 as hpb
from tensorwire.mm.held._local import REQUEST_HEAD, LocalRpcClient, LocalRpcServer, LocalUnavailable
from tensorwire.mm.held._rpc import HeldStoreClient, HeldStoreServicer, serve_store
from tensorwire.mm.held._store import HeldStore, new_secret


def _echo(raw: bytes, _ctx: Any) -> bytes:
    return b"echo:" + raw


def _fails(_raw: bytes, ctx: Any) -> bytes:
    wire.abort_with(ctx, LeaseExpired("gone", reason=Reason.NOT_HELD))
    raise AssertionError("unreachable")


def _raises(_raw: bytes, _ctx: Any) -> bytes:
    raise InvalidPayload("bad thing", reason=Reason.INVALID_REQUEST)


def _slow(_raw: bytes, ctx: Any) -> bytes:
    time.sleep(3.0)
    return b"late"


@pytest.fixture
def server(tmp_path: Any) -> Iterator[LocalRpcServer]:
    events: Counter[str] = Counter()
    srv = LocalRpcServer(
        "t",
        {"Echo": _echo, "Fails": _fails, "Raises": _raises, "Slow": _slow},
        str(tmp_path / "rt"),
        max_conns=2,
        max_request_bytes=4096,
        on_event=lambda kind: events.update([kind]),
    )
    srv.events = events  # type: ignore[attr-defined]
    yield srv
    srv.close(0.0)


def test_a_call_is_answered_and_its_connection_reused(server: LocalRpcServer) -> None:
    c = LocalRpcClient(server.path)
    try:
        assert c.call("Echo", b"abc", 5.0, "Echo") == b"echo:abc"
        assert c.call("Echo", b"", 5.0, "Echo") == b"echo:"
        assert server.events["opened"] == 1  # type: ignore[attr-defined]
    finally:
        c.close()
    assert oct(os.stat(server.path).st_mode & 0o777) == "0o600"
    assert oct(os.stat(server.directory).st_mode & 0o777) == "0o700"


def test_errors_come_back_as_the_grpc_path_raises_them(server: LocalRpcServer) -> None:
    """The same handlers behind a real gRPC server: every error has the same class, reason and text."""
    from concurrent.futures import ThreadPoolExecutor

    methods = {"Fails": _fails}
    handler = grpc.method_handlers_generic_handler(
        "T", {name: grpc.unary_unary_rpc_method_handler(fn) for name, fn in methods.items()}
    )
    g = grpc.server(ThreadPoolExecutor(2))
    g.add_generic_rpc_handlers((handler,))
    port = g.add_insecure_port("127.0.0.1:0")
    g.start()
    c = LocalRpcClient(server.path)
    try:
        with grpc.insecure_channel(f"127.0.0.1:{port}") as ch:
            for name in methods:
                try:
                    ch.unary_unary(f"/T/{name}")(b"", timeout=5.0)
                except grpc.RpcError as exc:
                    want = wire.error_from_rpc(exc, name)
                with pytest.raises(type(want)) as got:
                    c.call(name, b"", 5.0, name)
                assert got.value.reason is want.reason and str(got.value) == str(want)
        assert want.reason is Reason.NOT_HELD
        # A handler that raises (gRPC would say UNKNOWN "Exception calling application") gets wire's status table.
        with pytest.raises(InvalidPayload) as e:
            c.call("Raises", b"", 5.0, "Raises")
        assert e.value.reason is Reason.INVALID_REQUEST and "bad thing" in str(e.value)
        with pytest.raises(Exception, match="UNIMPLEMENTED"):
            c.call("Nope", b"", 5.0, "Nope")
        assert c.call("Echo", b"x", 5.0, "Echo") == b"echo:x"  # the connection survived every error answer
    finally:
        c.close()
        g.stop(0)


def test_a_deadline_is_a_deadline_and_the_server_sees_the_caller_go(server: LocalRpcServer) -> None:
    c = LocalRpcClient(server.path)
    try:
        t0 = time.monotonic()
        with pytest.raises(DeadlineExceeded) as e:
            c.call("Slow", b"", 0.1, "Slow")
        assert e.value.reason is Reason.DEADLINE_EXCEEDED and time.monotonic() - t0 < 2.5  # not the 3 s answer
        assert c.call("Echo", b"y", 5.0, "Echo") == b"echo:y"  # a new connection
    finally:
        c.close()


def test_malformed_and_oversized_frames_end_only_their_connection(server: LocalRpcServer) -> None:
    def raw_conn() -> socket.socket:
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        s.connect(server.path)
        assert bytes(_unix.recv_frame(s, time.monotonic() + 5, 64) or b"") == b"TWR1\x00"
        return s

    s = raw_conn()
    _unix.send_frame(s, b"\x01", time.monotonic() + 5)  # shorter than the request header
    assert _unix.recv_frame(s, time.monotonic() + 5, 64) is None
    s.close()
    s = raw_conn()
    _unix.send_frame(s, REQUEST_HEAD.pack(0, 200) + b"Echo", time.monotonic() + 5)  # method longer than the frame
    assert _unix.recv_frame(s, time.monotonic() + 5, 64) is None
    s.close()
    s = raw_conn()
    s.sendall(_unix.FRAME_HEADER.pack(1 << 40))  # a length over the limit: not read, the connection ends
    assert _unix.recv_frame(s, time.monotonic() + 5, 64) is None
    s.close()
    assert server.events["bad_frame"] == 3  # type: ignore[attr-defined]
    c = LocalRpcClient(server.path)
    try:
        assert c.call("Echo", b"ok", 5.0, "Echo") == b"echo:ok"
    finally:
        c.close()


def test_connections_over_the_limit_are_told_to_use_grpc(server: LocalRpcServer) -> None:
    clients = [LocalRpcClient(server.path, pool=1) for _ in range(2)]
    try:
        for c in clients:
            assert c.call("Echo", b"", 5.0, "Echo") == b"echo:"  # each keeps its connection open
        third = LocalRpcClient(server.path)
        with pytest.raises(LocalUnavailable, match="full") as e:
            third.call("Echo", b"", 5.0, "Echo")
        assert e.value.sent is False and server.events["refused_full"] == 1  # type: ignore[attr-defined]
    finally:
        for c in clients:
            c.close()


def test_idle_and_stalled_connections_are_ended_and_a_pooled_client_just_reconnects(tmp_path: Any) -> None:
    events: Counter[str] = Counter()
    srv = LocalRpcServer(
        "t",
        {"Echo": _echo},
        str(tmp_path / "rt"),
        max_conns=1,
        idle_timeout_s=0.3,
        on_event=lambda kind: events.update([kind]),
    )
    c = LocalRpcClient(srv.path, pool=1)
    try:
        assert c.call("Echo", b"1", 5.0, "Echo") == b"echo:1"  # the connection goes back to the pool
        deadline = time.monotonic() + 30
        while (events["idle"] < 1 or srv.open_connections) and time.monotonic() < deadline:
            time.sleep(0.02)
        assert events["idle"] == 1 and srv.open_connections == 0  # the one slot is free again
        assert c.call("Echo", b"2", 5.0, "Echo") == b"echo:2"  # the pooled socket is seen gone: a new one
        assert events["opened"] == 2
        c.close()
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)  # a peer that starts a frame and stalls
        deadline = time.monotonic() + 30
        while srv.open_connections and time.monotonic() < deadline:  # the client's connection has ended
            time.sleep(0.02)
        s.connect(srv.path)
        assert bytes(_unix.recv_frame(s, time.monotonic() + 5, 64) or b"") == b"TWR1\x00"
        s.sendall(_unix.FRAME_HEADER.pack(100) + b"abc")
        t0 = time.monotonic()
        assert _unix.recv_frame(s, time.monotonic() + 30, 64) is None  # ended, not held
        assert time.monotonic() - t0 < 20 and events["bad_frame"] == 1
        s.close()
    finally:
        c.close()
        srv.close(0.0)


def test_a_removed_socket_or_a_stopped_server_is_unavailable(server: LocalRpcServer) -> None:
    c = LocalRpcClient(server.path)
    try:
        assert c.call("Echo", b"", 5.0, "Echo") == b"echo:"
        server.stop_accepting()  # the file goes; the connection ends (at once, or after its answer is out)
        with pytest.raises(LocalUnavailable):
            c.call("Echo", b"", 5.0, "Echo")  # sent or not, depending on that race: never run
        assert not os.path.exists(server.path)
        with pytest.raises(LocalUnavailable) as e:
            LocalRpcClient(server.path).call("Echo", b"", 5.0, "Echo")
        assert e.value.sent is False  # a new connection finds no socket: nothing was written
    finally:
        c.close()


def test_a_socket_anyone_can_reach_is_not_used(tmp_path: Any) -> None:
    srv = LocalRpcServer("t", {"Echo": _echo}, str(tmp_path / "rt"))
    try:
        os.chmod(srv.path, 0o666)
        with pytest.raises(LocalUnavailable, match="accessible to others"):
            LocalRpcClient(srv.path).call("Echo", b"", 5.0, "Echo")
    finally:
        srv.close(0.0)


_PEER = """
import socket, sys
s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
try:
    s.connect(sys.argv[1])
except OSError as exc:
    print("connect-failed", exc.errno)
    sys.exit(0)
s.settimeout(10)
data = s.recv(64)
print("hello" if data else "closed")
"""


@pytest.mark.skipif(os.geteuid() != 0 or shutil.which("setpriv") is None, reason="needs root and setpriv")
def test_a_peer_with_another_uid_is_refused(server: LocalRpcServer) -> None:
    def as_nobody(*caps: str) -> str:
        cmd = [
            "setpriv",
            "--reuid=65534",
            "--regid=65534",
            "--clear-groups",
            *caps,
            sys.executable,
            "-c",
            _PEER,
            server.path,
        ]
        return subprocess.run(cmd, capture_output=True, text=True, timeout=30, check=True).stdout.strip()

    assert as_nobody().startswith("connect-failed")  # the 0700 directory and the 0600 file
    assert as_nobody("--inh-caps=+dac_override", "--ambient-caps=+dac_override") == "closed"  # SO_PEERCRED
    assert server.events["refused_uid"] == 1  # type: ignore[attr-defined]


# -- HeldStoreClient against a StoreServer with and without the socket --------------------------------------


@pytest.fixture
def store() -> Iterator[HeldStore]:
    s = HeldStore(None, ttl_s=60.0)
    yield s
    s.close()


def _wait_local(c: HeldStoreClient, want: bool = True) -> None:
    end = time.monotonic() + 30
    while bool(c.local_path) != want:
        assert time.monotonic() < end, "discovery did not finish"
        time.sleep(0.01)


def _held(store: HeldStore, key: str) -> bytes:
    secret = new_secret()
    store.grant(key, secret)
    store.hold(key, [torch.arange(6, dtype=torch.float32)])
    return secret


def test_lookups_and_releases_go_over_the_socket_with_the_same_answers(store: HeldStore, tmp_path: Any) -> None:
    srv = serve_store("127.0.0.1:0", store=store, local_dir=str(tmp_path / "rt"))
    calls: Counter[tuple[str, str]] = Counter()
    try:
        assert srv.local is not None
        with (
            HeldStoreClient(srv.address, on_call=lambda m, ch: calls.update([(m, ch)])) as c,
            HeldStoreClient(srv.address, local_channel=False) as g,
        ):
            _wait_local(c)
            assert c.local_path == srv.local.path and g.local_path == ""
            secret = _held(store, "k1")
            ((hit, miss),) = [c.lookup([("k1", secret), ("k2", new_secret())], timeout_s=5.0)]
            (g_hit, g_miss) = g.lookup([("k1", secret), ("k2", new_secret())], timeout_s=5.0)
            assert hit.receipt == g_hit.receipt and hit.receipt is not None
            assert isinstance(miss.error, LeaseExpired) and miss.error.reason is Reason.NOT_HELD
            assert type(miss.error) is type(g_miss.error) and miss.error.reason is g_miss.error.reason
            assert c.release([("k1", secret)], timeout_s=5.0) == 1
            assert c.release([("k1", secret)], timeout_s=5.0) == 0
            assert store.stats().held_items == 0
        assert calls[("Lookup", "local")] == 1 and calls[("Release", "local")] == 2
        assert calls[("Lookup", "grpc")] == 0
    finally:
        srv.stop(0.5)


def test_a_gone_socket_falls_back_to_grpc_within_the_call(store: HeldStore, tmp_path: Any) -> None:
    srv = serve_store("127.0.0.1:0", store=store, local_dir=str(tmp_path / "rt"))
    calls: Counter[tuple[str, str]] = Counter()
    try:
        assert srv.local is not None
        with HeldStoreClient(srv.address, on_call=lambda m, ch: calls.update([(m, ch)])) as c:
            _wait_local(c)
            secret = _held(store, "k")
            srv.local.close(0.0)  # the socket dies under the client (file gone, connections cut)
            (out,) = c.lookup([("k", secret)], timeout_s=5.0)
            assert out.receipt is not None and out.error is None
            assert calls[("Lookup", "local_fallback")] == 1 and calls[("Lookup", "grpc")] == 1
            assert c.local_path == ""
    finally:
        srv.stop(0.5)


def test_no_socket_for_unix_stores_other_hosts_or_stores_without_it(
    store: HeldStore, tmp_path: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    plain = serve_store("127.0.0.1:0", store=store)  # no local_dir: LocalChannel answers empty
    try:
        assert plain.local is None
        with HeldStoreClient(plain.address) as c:
            (out,) = c.lookup([("k", new_secret())], timeout_s=5.0)
            assert isinstance(out.error, LeaseExpired)
            time.sleep(0.2)
            assert c.local_path == ""
    finally:
        plain.stop(0.5)
    srv = serve_store("127.0.0.1:0", store=store, local_dir=str(tmp_path / "rt"))
    try:
        monkeypatch.setattr(_unix, "host_token", lambda: "another-kernel")
        with HeldStoreClient(srv.address) as c:
            (out,) = c.lookup([("k", new_secret())], timeout_s=5.0)
            time.sleep(0.2)
            assert c.local_path == ""
    finally:
        srv.stop(0.5)


def test_an_owner_without_local_channel_is_served_over_grpc(store: HeldStore) -> None:
    """A store of an earlier version has no LocalChannel method (UNIMPLEMENTED): lookups just use gRPC."""
    servicer = HeldStoreServicer(store)
    handler = grpc.method_handlers_generic_handler(
        "tensorwire.mm.v1.HeldOutputs", {"Lookup": grpc.unary_unary_rpc_method_handler(servicer.lookup)}
    )
    from concurrent.futures import ThreadPoolExecutor

    old = grpc.server(ThreadPoolExecutor(2))
    old.add_generic_rpc_handlers((handler,))
    port = old.add_insecure_port("127.0.0.1:0")
    old.start()
    try:
        with HeldStoreClient(f"127.0.0.1:{port}") as c:
            secret = _held(store, "old")
            (out,) = c.lookup([("old", secret)], timeout_s=5.0)
            assert out.receipt is not None
            time.sleep(0.2)
            assert c.local_path == ""
    finally:
        old.stop(0)
    assert hpb.LookupRequest  # the messages are the gRPC ones


def test_a_channel_closed_under_a_call_is_a_closed_error_and_ends_a_discovery_quietly() -> None:
    """close() can close the gRPC channel while a call (the background discovery's, or a lookup) is past its
    closed check: grpc then raises ValueError ("closed channel"). The call raises ClosedError instead, and the
    discovery ends (no same-host socket, a retry scheduled) rather than letting it escape from its thread."""
    c = HeldStoreClient("127.0.0.1:1", local_channel=False)  # no background discovery of its own
    try:
        c._channel.close()  # closed under the call, as close() does, before _closed is seen
        with pytest.raises(ClosedError) as err:
            c.lookup([("k", b"s")], timeout_s=1.0)
        assert err.value.reason is Reason.CLOSED
        c._discover()
        assert c.local_path == ""
        assert time.monotonic() < c._local_due < float("inf")
    finally:
        c.close()


def test_staging_goes_over_its_socket_and_falls_back_to_its_grpc_socket(store: HeldStore, tmp_path: Any) -> None:
    from tensorwire.mm.held._rpc import StagingClient, receipt_for, serve_staging_local
    from tensorwire.mm.held._staging import Expect, StagingArea

    rt = tmp_path / "rt"
    rt.mkdir(mode=0o700)
    secret = _held(store, "k")
    receipt = receipt_for(store.lookup("k", secret), rdma=False)  # an inline receipt: no reader needed
    area = StagingArea(None)
    grpc_srv = serve_store(f"unix:{rt}/s.sock", staging=area)
    local = serve_staging_local(f"{rt}/s.local.sock", area)
    calls: Counter[tuple[str, str]] = Counter()
    try:
        with StagingClient(grpc_srv.address, local_path=local.path, on_call=lambda m, ch: calls.update([(m, ch)])) as c:
            assert c.stage("k1", receipt, timeout_ms=5000, expect=Expect((6,), torch.float32)) == 24
            assert torch.equal(area.get("k1")[0], torch.arange(6, dtype=torch.float32))  # type: ignore[index]
            with pytest.raises(Exception, match="shape") as e:  # the area's own check, same error as over gRPC
                c.stage("k2", receipt, timeout_ms=5000, expect=Expect((7,), torch.float32))
            assert getattr(e.value, "reason", None) is not None
            assert calls[("Stage", "local")] == 2 and calls[("Stage", "grpc")] == 0
            local.close(0.0)  # the worker's socket goes: the next calls use the gRPC socket
            assert c.drop(["k1"], timeout_s=5.0) == 1
            assert calls[("Drop", "local_fallback")] == 1 and calls[("Drop", "grpc")] == 1
    finally:
        local.close(0.0)
        grpc_srv.stop(0.5)
        area.close()


def test_the_connector_opens_the_socket_unless_its_store_requires_client_certificates() -> None:
    from tensorwire.errors import ConfigError
    from tensorwire.integrations._vllm_ec.config import ECConfig

    assert ECConfig().serves_local_channel
    mtls = {"tls_cert": "c.pem", "tls_key": "k.pem", "tls_ca": "ca.pem"}
    assert not ECConfig(**mtls).serves_local_channel  # type: ignore[arg-type]
    assert ECConfig(**mtls, tls_client_auth=False).serves_local_channel  # type: ignore[arg-type]
    assert ECConfig(**mtls, local_channel="on").serves_local_channel  # type: ignore[arg-type]
    assert not ECConfig(local_channel="off").serves_local_channel
    with pytest.raises(ConfigError, match="local_channel"):
        ECConfig(local_channel="yes")
    assert ECConfig.from_extra({"local_channel": "off"}).local_channel == "off"


def test_a_ranks_socket_sits_next_to_its_grpc_socket() -> None:
    from tensorwire.integrations._vllm_ec.runtime import staging_local_path

    assert staging_local_path("unix:/run/tw/e-dp0-tp1.sock") == "/run/tw/e-dp0-tp1.local.sock"


def test_a_rank_without_its_socket_still_serves_staging_over_grpc(
    tmp_path: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    from tensorwire.integrations._vllm_ec import runtime
    from tensorwire.integrations._vllm_ec.config import ECConfig

    def refuses(path: str, area: Any) -> Any:
        raise _unix.InsecurePath(f"{path}: refused for the test")

    monkeypatch.setattr(runtime, "serve_staging_local", refuses)
    cfg = ECConfig(runtime_dir=str(tmp_path / "rt"), rdma_provider="none")
    rt = runtime.StagingRuntime(cfg, "t-dp0", 0, "cpu", serve=True)
    try:
        assert rt.local is None and rt.server is not None  # the optional socket failed; the rank still serves
        from tensorwire.mm.held._rpc import StagingClient

        with StagingClient(rt.server.address, local_path=runtime.staging_local_path(rt.server.address)) as c:
            assert c.drop(["nothing"], timeout_s=5.0) == 0  # no socket file: straight to gRPC
    finally:
        rt.close()
