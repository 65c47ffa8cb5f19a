"""The same-host control channel (issue 18) against real encoder servers, real Unix sockets and real processes.

Claims: a same-host client discovers the worker's socket over gRPC and then sends its Encodes and releases there;
it gives what gRPC gives (outputs, errors with their class, reason and text, deadlines, releases); faults end in
a typed error or a gRPC fallback and never hang (worker killed mid-request, socket file removed, server stop and
restart, connections over the cap, another host); the socket is private (0700 directory, 0600 file) and a peer
of another uid is refused by SO_PEERCRED; a proxy's clients stay on gRPC. test_orchestration.py runs the whole
fetch policy over both channels; test_nixl_transport.py the RDMA success path over real NIXL.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import stat
import subprocess
import sys
import threading
import time
from concurrent import futures
from typing import Any

import pytest
import torch
from _env import ERROR_CASES, ERROR_IDS, INPUTS, Env, Fails, Held, check_output, wait_for
from prometheus_client import CollectorRegistry

from tensorwire._local import unix as _unix
from tensorwire._local.server import connect
from tensorwire.errors import (
    DeadlineExceeded,
    PeerUnavailable,
    Reason,
    TensorwireError,
)
from tensorwire.mm import EncoderOutput, MultimodalInput, Plane, TransportConfig
from tensorwire.mm.client._local import LocalControlChannel
from tensorwire.mm.server import _local as _local_server
from tensorwire.mm.wire._local import HELLO_MAGIC
from tensorwire.service._proxy import EncoderProxy, ProxyConfig

pytestmark = pytest.mark.timeout(90)


@pytest.fixture
def env(any_env: Env) -> Env:
    return any_env


def rpcs(env: Env, path: str) -> float:
    return env.sample("tensorwire_mm_control_rpcs_total", {"path": path})


def events(env: Env, event: str, side: str = "llm") -> float:
    return env.sample("tensorwire_mm_control_stream_events_total", {"side": side, "event": event})


def expected_path(env: Env) -> str:
    return "local" if env.local == "auto" else "stream"


@pytest.mark.parametrize("mode", ["auto", "grpc"], ids=["rdma", "inline"])
def test_fetch_gives_the_bits_and_frees_every_lease(env: Env, mode: str) -> None:
    srv = env.server()
    c = env.client(srv.address, TransportConfig(mode=mode))  # type: ignore[arg-type]
    plane = Plane.RDMA if mode == "auto" else Plane.INLINE
    for _ in range(5):
        out = c.fetch(INPUTS)
        assert out.plane is plane and out.worker_id == "worker-1"
        check_output(out)
    path = expected_path(env)
    assert rpcs(env, path) == 5 and sum(rpcs(env, p) for p in ("local", "stream", "unary")) == 5
    assert [d["path"] for e, d in env.events if e == "request"] == [path] * 5
    if mode == "auto":
        assert env.names().count("release_stream") == 5
        wait_for(lambda: not env.fabric.live())  # the fire-and-forget releases reached the encoder
    if env.local == "auto":
        assert events(env, "local_opened") == 1 and srv.service.local.open_connections == 1  # one, reused
        assert env.sample("tensorwire_mm_release_leases_total", {"mode": "local", "outcome": "sent"}) == (
            5 if mode == "auto" else 0
        )


@pytest.mark.parametrize("exc,cls,reason", ERROR_CASES, ids=ERROR_IDS)
def test_errors_are_the_unary_errors_and_the_connection_stays_open(
    local_env: Env, exc: BaseException, cls: type[TensorwireError], reason: Reason
) -> None:
    env = local_env
    srv = env.server(fn=Fails(exc))
    on = env.client(srv.address)
    off = env.client(srv.address, TransportConfig(control_stream=False), local="off")
    bad = [MultimodalInput(b"bad"), MultimodalInput(b"x")]
    with pytest.raises(TensorwireError) as over_unary:
        off.fetch(bad)
    with pytest.raises(TensorwireError) as over_local:
        on.fetch(bad)
    assert type(over_unary.value) is cls and over_unary.value.reason is reason
    assert type(over_local.value) is cls and over_local.value.reason is reason
    assert str(over_local.value) == str(over_unary.value)
    check_output(on.fetch(INPUTS))  # the same connection answers the next request
    assert rpcs(env, "local") == 2 and events(env, "local_opened") == 1


def _encoder_errors(env: Env) -> float:
    return sum(
        s.value
        for m in env.registry.collect()
        if m.name == "tensorwire_mm_errors"
        for s in m.samples
        if s.name.endswith("_total") and s.labels.get("side") == "encoder"
    )


def test_slow_encoder_hits_the_budget_and_exports_nothing_for_a_caller_that_is_gone(env: Env) -> None:
    slow = Held(b"slow")
    srv = env.server(fn=slow)
    c = env.client(srv.address)
    check_output(c.fetch(INPUTS))  # warm
    dropped = _encoder_errors(env)  # before the call: the encoder may count the gone caller before we look again
    t0 = time.monotonic()
    with pytest.raises(DeadlineExceeded) as ei:
        c.fetch([MultimodalInput(b"slow"), MultimodalInput(b"x")], timeout_ms=1000)
    elapsed = time.monotonic() - t0
    assert ei.value.reason is Reason.DEADLINE_EXCEEDED
    assert 0.99 <= elapsed < 1.0 + 3.0, elapsed  # on time (a busy 2-core box's slack): no hung caller
    exported = len(env.fabric.exported)
    slow.gate.set()  # the encoder finishes for a caller that is gone: it drops the work, exports nothing (issue 15)
    # A request that reached encode_fn is dropped and counted once: before the export when the encoder already
    # sees the caller gone, else after it (its leases released at once: the client may close its stream only after
    # the check, or while the answer is being sent, on a loaded box). One that reaches the server after its
    # deadline is never run.
    wait_for(lambda: _encoder_errors(env) == dropped + (1 if slow.entered.is_set() else 0), timeout_s=30)
    late = env.fabric.exported[exported:]
    assert set(late) <= set(env.fabric.released) and not env.fabric.live()
    check_output(c.fetch(INPUTS))  # a new connection / stream
    assert rpcs(env, expected_path(env)) == 3
    if env.local == "auto":
        assert events(env, "local_deadline") == 1 and events(env, "local_opened") == 2


def test_sixteen_threads_at_once_each_get_their_own_answer(env: Env) -> None:
    def tagged(inputs: list[MultimodalInput]) -> EncoderOutput:
        tag = float(inputs[0].data.decode())
        return EncoderOutput(embeddings=[torch.full((3, 8), tag)], position_ids=torch.full((3, 2), int(tag)))

    srv = env.server(TransportConfig(worker_id="worker-1", server_threads=24, server_stream_cap=16), fn=tagged)
    c = env.client(srv.address, TransportConfig(control_stream_pool=8))
    barrier = threading.Barrier(16)

    def run(thread: int) -> int:
        barrier.wait(10)
        for i in range(10):
            tag = thread * 100 + i
            out = c.fetch([MultimodalInput(str(tag).encode())])
            assert torch.equal(out.embeddings[0], torch.full((3, 8), float(tag)))
        return thread

    with futures.ThreadPoolExecutor(16) as pool:
        assert sorted(pool.map(run, range(16))) == list(range(16))
    total = sum(rpcs(env, p) for p in ("local", "stream", "unary"))
    assert total == 160
    if env.local == "auto":
        assert rpcs(env, "local") >= 10 and events(env, "local_opened") <= 8  # at most the pool's cap
    wait_for(lambda: not env.fabric.live())


def test_server_stop_is_prompt_and_a_restart_on_the_port_recovers(env: Env) -> None:
    srv = env.server()
    c = env.client(srv.address, TransportConfig(open_seconds=0.2))
    check_output(c.fetch(INPUTS))
    t0 = time.monotonic()
    srv.stop(grace=60.0)  # idle connections must not hold the stop for the whole grace
    assert time.monotonic() - t0 < 15.0  # well short of it, with a busy box's slack
    with pytest.raises(PeerUnavailable):
        c.fetch(INPUTS, timeout_ms=2000)
    restarted = env.server(TransportConfig(worker_id="worker-2"), address=srv.address)

    def fetched() -> bool:
        try:
            return c.fetch(INPUTS, timeout_ms=2000).worker_id == "worker-2"
        except PeerUnavailable:
            return False

    wait_for(fetched, timeout_s=20)
    if env.local == "auto":  # the new worker's new socket is found again (open_seconds later)
        assert srv.service.local is not None and not os.path.exists(srv.service.local.path)
        new_path = restarted.service.local.path  # type: ignore[union-attr]
        # A fetch whose channel is due to ask again does so (in the background; that fetch uses gRPC).
        wait_for(
            lambda: c.fetch(INPUTS) is not None and c._channel.local_path == new_path,  # type: ignore[attr-defined]
            timeout_s=10,
        )
        before = rpcs(env, "local")
        check_output(c.fetch(INPUTS))
        assert rpcs(env, "local") == before + 1


def test_stop_lets_the_encode_in_flight_answer(env: Env) -> None:
    slow = Held(b"img-a")
    srv = env.server(fn=slow)
    c = env.client(srv.address, TransportConfig(mode="grpc"))
    with futures.ThreadPoolExecutor(2) as pool:
        fetch = pool.submit(c.fetch, INPUTS)
        assert slow.entered.wait(5)
        stop = pool.submit(srv.stop, 5.0)
        wait_for(lambda: srv.service._stopping)
        slow.gate.set()
        check_output(fetch.result(5))  # answered within the grace
        stop.result(5)


def test_a_connection_that_broke_after_sending_is_not_resent(env: Env) -> None:
    held = Held(b"hold")
    srv = env.server(fn=held)
    c = env.client(srv.address)
    check_output(c.fetch(INPUTS))
    with futures.ThreadPoolExecutor(1) as pool:
        fetch = pool.submit(c.fetch, [MultimodalInput(b"hold"), MultimodalInput(b"x")], 5000)
        assert held.entered.wait(5)
        srv.stop(grace=0)
        held.gate.set()
        with pytest.raises(PeerUnavailable):
            fetch.result(5)
    assert held.calls == 2  # the warm-up and the one attempt: not sent again over gRPC
    assert rpcs(env, "unary") == 0


@pytest.mark.parametrize("channel", ["grpc", "local"])
def test_worker_killed_mid_request_is_a_typed_error_not_a_hang(channel: str) -> None:
    import _held_proc

    from tensorwire.mm import RemoteOutputTransport, TransportMetrics

    p, entered, address, path = _held_proc.start()
    try:
        assert path is not None and stat.S_IMODE(os.stat(path).st_mode) == 0o600
        reg = CollectorRegistry()
        cfg = TransportConfig(mode="grpc", local_channel="auto" if channel == "local" else "off")
        with RemoteOutputTransport(address, cfg, metrics=TransportMetrics(reg)) as c:
            assert c.fetch([MultimodalInput(b"x")]).plane is Plane.INLINE
            with futures.ThreadPoolExecutor(1) as pool:
                fetch = pool.submit(c.fetch, [MultimodalInput(b"hold")], 30_000)
                assert entered.wait(30)
                t0 = time.monotonic()
                os.kill(p.pid, signal.SIGKILL)
                with pytest.raises(PeerUnavailable) as ei:
                    fetch.result(15)
                assert time.monotonic() - t0 < 10
            assert ei.value.reason is Reason.PEER_UNAVAILABLE
            label = "local" if channel == "local" else "stream"
            assert reg.get_sample_value("tensorwire_mm_control_rpcs_total", {"path": label}) == 2
            with pytest.raises(PeerUnavailable):
                c.fetch([MultimodalInput(b"x")], timeout_ms=3000)  # and the next fetch fails fast too
    finally:
        p.kill()
        p.join(10)


def test_socket_file_removed_falls_back_to_grpc(local_env: Env) -> None:
    env = local_env
    srv = env.server()
    first = env.client(srv.address)
    check_output(first.fetch(INPUTS))
    assert rpcs(env, "local") == 1
    os.unlink(srv.service.local.path)  # type: ignore[union-attr]
    check_output(first.fetch(INPUTS))  # its open connection still works (the kernel keeps it)
    assert rpcs(env, "local") == 2
    late = env.client(srv.address)  # discovery finds no socket at the path: gRPC
    for _ in range(2):
        check_output(late.fetch(INPUTS))
    assert rpcs(env, "local") == 2 and rpcs(env, "stream") == 2
    assert late._channel.local_path is None  # type: ignore[attr-defined]
    with futures.ThreadPoolExecutor(2) as pool:  # a second connection for the first client: ENOENT, gRPC
        held = [pool.submit(first.fetch, INPUTS) for _ in range(4)]
        for f in held:
            check_output(f.result(10))
    wait_for(lambda: not env.fabric.live())


def test_private_directory_and_socket_modes(local_env: Env, tmp_path: Any) -> None:
    base = tmp_path / "rt"
    base.mkdir(mode=0o755)
    srv = local_env.server(TransportConfig(worker_id="worker-1", local_channel_dir=str(base)))
    local = srv.service.local
    assert local is not None and os.path.dirname(local.path) == str(base)
    assert stat.S_IMODE(os.stat(base).st_mode) == 0o700  # tightened
    st = os.lstat(local.path)
    assert stat.S_ISSOCK(st.st_mode) and stat.S_IMODE(st.st_mode) == 0o600 and st.st_uid == os.geteuid()
    srv.stop(0)
    assert not os.path.exists(local.path)  # the file goes with the server
    open_dir = tmp_path / "open"
    open_dir.mkdir()
    os.chmod(open_dir, 0o777)
    insecure = local_env.server(TransportConfig(worker_id="worker-2", local_channel_dir=str(open_dir)))
    assert insecure.service.local is None  # refused: gRPC only
    check_output(local_env.client(insecure.address).fetch(INPUTS))
    assert rpcs(local_env, "stream") == 1


_PEER = r"""
import socket, sys
s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
s.settimeout(10)
try:
    s.connect(sys.argv[1])
except OSError as exc:
    print("connect-failed", exc.errno)
    sys.exit(0)
try:
    data = s.recv(64)
except OSError as exc:
    print("recv-failed", exc.errno)
    sys.exit(0)
print("hello" if data else "closed")
"""


@pytest.mark.skipif(os.geteuid() != 0 or shutil.which("setpriv") is None, reason="needs root and setpriv")
def test_a_peer_with_another_uid_is_refused(local_env: Env) -> None:
    srv = local_env.server()
    path = srv.service.local.path  # type: ignore[union-attr]

    def as_nobody(*caps: str) -> str:
        cmd = ["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups", *caps, sys.executable, "-c", _PEER, path]
        return subprocess.run(cmd, capture_output=True, text=True, timeout=30, check=True).stdout.strip()

    # Without privileges the 0700 directory and the 0600 file keep it out ...
    assert as_nobody().startswith("connect-failed")
    # ... and with CAP_DAC_OVERRIDE (file permissions bypassed) SO_PEERCRED does: closed without a hello.
    assert as_nobody("--inh-caps=+dac_override", "--ambient-caps=+dac_override") == "closed"
    assert events(local_env, "local_refused_uid", side="encoder") == 1
    check_output(local_env.client(srv.address).fetch(INPUTS))  # our own uid is served
    assert rpcs(local_env, "local") == 1


def test_a_socket_of_another_uid_is_not_used(local_env: Env, tmp_path: Any) -> None:
    d = tmp_path / "d"
    d.mkdir(mode=0o700)
    path = str(d / "s.sock")
    listener = _unix.listen(path)
    try:
        _unix.check_socket_path(path)  # ours: fine
        if os.geteuid() == 0:
            os.chown(path, 65534, 65534)
            with pytest.raises(_unix.InsecurePath, match="owned by uid 65534"):
                _unix.check_socket_path(path)
        os.chmod(path, 0o666)
        with pytest.raises(_unix.InsecurePath):
            _unix.check_socket_path(path)
    finally:
        listener.close()


def test_a_worker_on_another_host_is_reached_over_grpc(local_env: Env, monkeypatch: pytest.MonkeyPatch) -> None:
    srv = local_env.server()
    monkeypatch.setattr(_unix, "host_token", lambda: "another-kernel")  # the client's boot id differs
    c = local_env.client(srv.address)
    check_output(c.fetch(INPUTS))
    assert c._channel.local_path is None and rpcs(local_env, "stream") == 1  # type: ignore[attr-defined]


def test_connections_over_the_worker_cap_use_grpc(local_env: Env) -> None:
    env = local_env
    slow = Held(b"img-a")
    srv = env.server(TransportConfig(worker_id="worker-1", local_channel_conns=1), fn=slow)
    c = env.client(srv.address)
    with futures.ThreadPoolExecutor(2) as pool:
        first = pool.submit(c.fetch, INPUTS)
        assert slow.entered.wait(5)
        slow.entered.clear()
        second = pool.submit(c.fetch, [MultimodalInput(b"other"), MultimodalInput(b"x")])
        check_output(second.result(10))  # refused at hello: nothing was sent; gRPC answered it
        slow.gate.set()
        check_output(first.result(10))
    assert rpcs(env, "local") == 1 and rpcs(env, "stream") == 1
    assert events(env, "local_refused", side="encoder") == 1


def test_idle_connections_are_ended_and_the_client_lets_go_first(
    local_env: Env, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The worker ends a connection that sends no request for local_channel_idle_ms (it held a thread and one of
    local_channel_conns for good), and one whose request frame stalls; the client's pool drops its own idle
    connection at half that time, so a fetch never goes into a connection the worker is ending."""
    env = local_env
    monkeypatch.setattr(_local_server, "REQUEST_FRAME_S", 1.0)
    cfg = TransportConfig(worker_id="worker-1", local_channel_idle_ms=3000)
    srv = env.server(cfg)
    path = srv.service.local.path  # type: ignore[union-attr]
    quiet = connect(path, HELLO_MAGIC, 5.0)  # a peer that never sends a request
    t0 = time.monotonic()
    assert _unix.recv_frame(quiet, time.monotonic() + 30, 64) is None  # ended by the worker, not held
    assert 2.5 < time.monotonic() - t0 < 30 and events(env, "local_idle", side="encoder") == 1
    quiet.close()
    stalled = connect(path, HELLO_MAGIC, 5.0)
    stalled.sendall(_unix.FRAME_HEADER.pack(100) + b"abc")  # starts a frame, then nothing: ended, not held
    assert _unix.recv_frame(stalled, time.monotonic() + 30, 64) is None
    stalled.close()
    c = env.client(srv.address, cfg)
    check_output(c.fetch(INPUTS))
    assert events(env, "local_opened") == 1
    time.sleep(1.8)  # past the client's 1.5 s, before the worker's 3 s: the client opens a new one
    check_output(c.fetch(INPUTS))
    assert events(env, "local_opened") == 2 and rpcs(env, "local") == 2 and rpcs(env, "stream") == 0


def test_a_proxy_has_no_local_channel_and_its_clients_stay_on_grpc(local_env: Env) -> None:
    srv = local_env.server()
    proxy = EncoderProxy(
        ProxyConfig(workers=(srv.address,), check_workers=False, worker_wait_s=5), registry=CollectorRegistry()
    )
    proxy.start("127.0.0.1:0")
    try:
        c = local_env.client(f"127.0.0.1:{proxy.port}")
        for _ in range(2):
            check_output(c.fetch(INPUTS))
        assert c._channel.local_path is None and rpcs(local_env, "local") == 0  # type: ignore[attr-defined]
        wait_for(lambda: not local_env.fabric.live())
    finally:
        proxy.stop(0)


def test_close_leaves_no_thread_and_no_connection(local_env: Env) -> None:
    srv = local_env.server()
    channel = LocalControlChannel(srv.address, TransportConfig(), local_env.metrics)
    assert channel.wait_discovered(5)
    c = local_env.client(srv.address, channel=channel)
    with futures.ThreadPoolExecutor(4) as pool:
        list(pool.map(lambda _: check_output(c.fetch(INPUTS)), range(16)))
    assert srv.service.local.open_connections >= 1  # type: ignore[union-attr]
    c.close()
    c.close()
    assert not local_env.fabric.live()
    wait_for(lambda: srv.service.local.open_connections == 0)  # type: ignore[union-attr]
    # This channel's discovery thread (not every thread of that name: an earlier test's channel may still be
    # unwinding on a busy machine; the suite failed on that once).
    asking = channel._asking  # type: ignore[attr-defined]
    assert asking is not None and not asking.is_alive()


def test_malformed_frames_end_the_connection_and_the_server_keeps_serving(local_env: Env) -> None:
    srv = local_env.server()
    path = srv.service.local.path  # type: ignore[union-attr]
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.connect(path)
    assert _unix.recv_frame(s, time.monotonic() + 5, 64) == b"TWL1\x00"
    _unix.send_frame(s, b"\xff\xff\xff\xff", time.monotonic() + 5)
    assert _unix.recv_frame(s, time.monotonic() + 5, 64) is None  # closed, no answer
    s.close()
    wait_for(
        lambda: local_env.sample("tensorwire_mm_errors_total", {"side": "encoder", "reason": "invalid_request"}) == 1
    )
    check_output(local_env.client(srv.address).fetch(INPUTS))
    assert rpcs(local_env, "local") == 1


def test_a_client_that_stops_reading_its_answer_does_not_hold_the_worker(local_env: Env) -> None:
    """An answer far larger than the socket buffers, to a client that never reads it: the worker gives up at the
    request's deadline (plus a second's slack), ends that connection, and serves the next client."""
    from tensorwire.mm import wire
    from tensorwire.mm.wire._codec import inputs_to_pb

    big = EncoderOutput(embeddings=torch.ones(4096, 1024, dtype=torch.bfloat16), split_sizes=[4096])  # 8 MiB
    srv = local_env.server(TransportConfig(mode="grpc", worker_id="worker-1"), fn=lambda inputs: big)
    local = srv.service.local  # type: ignore[union-attr]
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.connect(local.path)
    assert _unix.recv_frame(s, time.monotonic() + 5, 64) == b"TWL1\x00"
    request = inputs_to_pb(INPUTS)
    request.deadline_ms = 500
    t0 = time.monotonic()
    _unix.send_frame(
        s, wire.stream_frame(1, wire.STREAM_ENCODE_FIELD, request.SerializeToString()), time.monotonic() + 5
    )
    wait_for(lambda: local.open_connections == 0, timeout_s=30)  # not read: ended, not held
    assert time.monotonic() - t0 >= 1.0  # the deadline and its slack, not at once
    s.close()
    out = local_env.client(srv.address, TransportConfig(mode="grpc")).fetch(INPUTS)
    assert out.embeddings[0].shape == (4096, 1024) and rpcs(local_env, "local") == 1


def test_a_client_started_before_its_worker_finds_the_channel_soon(local_env: Env) -> None:
    probe = socket.socket()
    probe.bind(("127.0.0.1", 0))
    address = f"127.0.0.1:{probe.getsockname()[1]}"
    probe.close()
    c = local_env.client(address, TransportConfig(mode="grpc"))  # discovery finds nobody (open_seconds is 30)
    assert c._channel.local_path is None  # type: ignore[attr-defined]
    srv = local_env.server(TransportConfig(mode="grpc", worker_id="worker-1"), address=address)

    def on_local() -> bool:
        try:
            c.fetch(INPUTS, timeout_ms=2000)
        except PeerUnavailable:
            return False  # gRPC's reconnect backoff
        return c._channel.local_path == srv.service.local.path  # type: ignore[attr-defined,union-attr]

    wait_for(on_local, timeout_s=15)  # asked again about a second later, not after open_seconds
    before = rpcs(local_env, "local")
    check_output(c.fetch(INPUTS))
    assert rpcs(local_env, "local") == before + 1
