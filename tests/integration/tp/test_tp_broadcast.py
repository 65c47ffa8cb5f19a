"""Multi-process tests of CpuTpBroadcaster: real processes, real Unix sockets, real shared memory."""

from __future__ import annotations

import os
import socket
import threading
import time
from pathlib import Path

import pytest
import torch
import tp_helpers as H
import tp_workers as W

from tensorwire.errors import BootstrapError, BootstrapTimeout, Reason
from tensorwire.tp import BroadcastConfig, CpuTpBroadcaster, shm_available
from tensorwire.tp._paths import make_endpoint

BACKENDS = ["uds", pytest.param("shm", marks=pytest.mark.skipif(not shm_available(), reason="no shm fence"))]


@pytest.mark.timeout(150)
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("world,rounds", [(2, 60), (4, 30), (8, 12)])
def test_happy_path_mixed_structures(base, backend, world, rounds):
    seed = H.seed()
    res = H.ok(H.run_ranks(W.happy, world, base, backend, rounds, seed, timeout_s=120))
    assert {r["backend"] for r in res.values()} == {backend}
    assert not os.path.exists(os.path.join(base, "tw-happy.sock"))  # listener closed after bootstrap


def test_world_size_one_needs_no_sockets(tmp_path):
    with CpuTpBroadcaster(0, 1, "solo", base_dir=str(tmp_path / "never-created")) as b:
        t = torch.arange(3)
        assert b.broadcast(t) is t
        assert b.broadcast_(t) is t
        v = {"a": torch.zeros(0)}
        assert b.broadcast(v) is v
    assert not (tmp_path / "never-created").exists()


@pytest.mark.timeout(150)
def test_bad_peer_rank_is_rejected(base):
    root, fakes = _root_with_fakes(base, world=2, fakes=[(9, 2, None)])
    assert root[0] == "err" and root[1][0] == "BootstrapError" and root[1][2] == Reason.BAD_RANK.value
    assert "bad peer_rank 9" in root[1][1]
    assert fakes[0][1][0] == 1 and "bad peer_rank 9" in fakes[0][1][1]  # the peer was told why


@pytest.mark.timeout(150)
def test_duplicate_rank_is_rejected(base):
    root, fakes = _root_with_fakes(base, world=3, fakes=[(1, 3, None), (1, 3, None)])
    assert root[0] == "err" and root[1][2] == Reason.DUPLICATE_RANK.value, root
    assert "duplicate peer rank 1" in root[1][1]


@pytest.mark.timeout(150)
def test_bad_link_probe_echo_is_rejected(base):
    root, fakes = _root_with_fakes(base, world=2, fakes=[(1, 2, b"wrongxxx")])
    assert root[0] == "err" and root[1][2] == Reason.HANDSHAKE_FAILED.value
    assert "link probe mismatch from rank 1" in root[1][1]


@pytest.mark.timeout(150)
def test_bad_ready_token_is_rejected_by_the_peer(base):
    import multiprocessing as mp

    q = mp.get_context("spawn").Queue()
    procs = H.start(W.fake_root_bad_ready, [0], 2, (base,), q) + H.start(W.real, [1], 2, (base,), q)
    out = H.collect(q, procs, 2, 120)
    assert out[1][0] == "err" and out[1][1][2] == Reason.HANDSHAKE_FAILED.value
    assert "link probe mismatch" in out[1][1][1]


@pytest.mark.timeout(150)
def test_wrong_session_with_the_same_socket_path_is_rejected(base):
    import multiprocessing as mp

    q = mp.get_context("spawn").Queue()
    # "a/b" and "a_b" sanitize to the same file name; the handshake still tells them apart. The stranger is told
    # why and dropped; rank 0 keeps accepting, and its real peer still joins.
    procs = H.start(W.real, [0], 2, (base, "a/b"), q) + H.start(W.real, [1], 2, (base, "a_b"), q)
    try:
        stranger = H.collect(q, procs[1:], 1, 120)
        assert stranger[1][0] == "err" and stranger[1][1][2] == Reason.SESSION_MISMATCH.value, stranger
        assert "rank 1" in stranger[1][1][1]
        procs += H.start(W.real, [1], 2, (base, "a/b"), q)
        out = H.collect(q, procs, 2, 120)
    finally:
        H.kill(procs)
    assert out == {0: ("ok", "42"), 1: ("ok", "42")}, out


@pytest.mark.timeout(150)
@pytest.mark.parametrize("peer_args", [("s", "shm"), ("s", "uds", 20, None)], ids=["backend", "world"])
def test_different_parameters_on_one_session_are_rejected(base, peer_args):
    if peer_args[1] == "shm" and not shm_available():
        pytest.skip("no shm")
    import multiprocessing as mp

    q = mp.get_context("spawn").Queue()
    peer_world = 2 if len(peer_args) == 2 else 3
    procs = H.start(W.real, [0], 2, (base, "s", "uds"), q) + H.start(W.real, [1], peer_world, (base, *peer_args[:2]), q)
    out = H.collect(q, procs, 2, 120)
    for r in (0, 1):
        assert out[r][0] == "err" and out[r][1][2] == Reason.PARAMS_MISMATCH.value, out[r]
    assert "re-init mismatch" in out[0][1][1]


@pytest.mark.timeout(150)
def test_stale_socket_file_is_replaced(base):
    path = make_endpoint("s", base, False).path
    stale = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    stale.bind(path)  # bound, never listening, then abandoned: what a crashed run leaves
    stale.close()
    assert os.path.exists(path)
    res = H.ok(H.run_ranks(W.real, 2, base, timeout_s=120))
    assert res == {0: "42", 1: "42"}
    assert not os.path.exists(path)


@pytest.mark.timeout(150)
@pytest.mark.parametrize("backend", BACKENDS)
def test_reinit_with_the_same_session_after_close(base, backend):
    res = H.ok(H.run_ranks(W.reinit, 3, base, backend, timeout_s=120))
    assert all(v == [1, 11, 21] for v in res.values())


@pytest.mark.timeout(150)
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("victim", [0, 2], ids=["root", "reader"])
def test_peer_killed_with_sigkill_surfaces_on_every_live_rank(base, backend, victim):
    stamp = os.path.join(base, "killed-at")
    import multiprocessing as mp

    q = mp.get_context("spawn").Queue()
    procs = H.start(W.kill_mid_broadcast, [0, 1, 2], 3, (base, backend, victim, stamp), q)
    out = H.collect(q, procs, 2, 120)  # the victim never reports
    assert out.get(victim) is None
    killed_at = float(Path(stamp).read_text())
    for r in set(range(3)) - {victim}:
        kind, res = out[r]
        assert kind == "ok", res
        assert res["type"] == "PeerClosed", res
        assert res["t"] - killed_at < 2.0, f"rank {r} noticed after {res['t'] - killed_at:.2f} s"
        if victim != 0:
            assert f"rank {victim}" in res["msg"], res["msg"]


@pytest.mark.timeout(150)
@pytest.mark.parametrize("backend", BACKENDS)
def test_stalled_broadcast_times_out_and_poisons_the_group(base, backend):
    res = H.ok(H.run_ranks(W.stall, 2, base, backend, timeout_s=120))
    assert res[1]["type"] == "BroadcastTimeout" and 0.25 < res[1]["elapsed"] < 1.5, res[1]
    assert "timed out after 0.300 s" in res[1]["msg"]
    assert res[0]["type"] == "PeerClosed", res[0]


@pytest.mark.timeout(30)
def test_init_timeout_on_rank0_cleans_up(base):
    t0 = time.monotonic()
    with pytest.raises(BootstrapTimeout) as ei:
        CpuTpBroadcaster(0, 2, "lonely", base_dir=base, init_timeout_s=0.5)
    assert 0.4 < time.monotonic() - t0 < 5
    assert "accept timed out" in str(ei.value) and "missing ranks [1]" in str(ei.value)
    assert not os.path.exists(os.path.join(base, "tw-lonely.sock"))


@pytest.mark.timeout(30)
def test_init_timeout_on_a_peer(base):
    with pytest.raises(BootstrapTimeout) as ei:
        CpuTpBroadcaster(1, 2, "lonely", base_dir=base, init_timeout_s=0.3)
    assert "rank 1" in str(ei.value) and "connect(" in str(ei.value)


def _bootstrap_alone(rank: int, base: str, **kwargs) -> tuple[BaseException | None, float]:
    """Bootstrap a rank whose peers never come; in a thread, so that a wrong (120 s) timeout fails the test
    after 20 s instead of hanging it."""
    out: dict[str, object] = {}

    def run() -> None:
        t0 = time.monotonic()
        try:
            CpuTpBroadcaster(rank, 2, f"alone{rank}", base_dir=base, **kwargs).close()
            out["error"] = None
        except BaseException as exc:  # the test inspects it
            out["error"] = exc
        out["s"] = time.monotonic() - t0

    th = threading.Thread(target=run, daemon=True)
    th.start()
    th.join(20)
    assert not th.is_alive(), "bootstrap still waiting after 20 s: the configured init_timeout_s was ignored"
    return out["error"], out["s"]  # type: ignore[return-value]


@pytest.mark.timeout(60)
def test_init_timeout_from_config_is_honoured(base):
    # Issue 13: the keyword default (120 s) used to replace config.init_timeout_s.
    error, took = _bootstrap_alone(0, base, config=BroadcastConfig(init_timeout_s=0.5))
    assert isinstance(error, BootstrapTimeout) and "accept timed out after 0.500 s" in str(error), error
    assert took < 5, took


@pytest.mark.timeout(60)
def test_init_timeout_from_the_environment_is_honoured(base, monkeypatch):
    # Issue 13: ... and TENSORWIRE_BROADCAST_INIT_TIMEOUT_S when no config is passed.
    monkeypatch.setenv("TENSORWIRE_BROADCAST_INIT_TIMEOUT_S", "0.4")
    error, took = _bootstrap_alone(1, base)
    assert isinstance(error, BootstrapTimeout) and "in 0.400 s" in str(error), error
    assert took < 5, took


@pytest.mark.timeout(150)
def test_broadcast_cpu_honours_the_broadcast_environment(base):
    # Issue 13: broadcast_cpu builds its broadcaster without keywords; the variables must reach it.
    env = {"TENSORWIRE_BROADCAST_INIT_TIMEOUT_S": "9", "TENSORWIRE_BROADCAST_TIMEOUT_S": "30"}
    res = H.ok(H.run_ranks(W.dist_config, 2, os.path.join(base, "store"), env, timeout_s=120))
    assert res == {0: {"init_timeout_s": 9.0, "timeout_s": 30.0}, 1: {"init_timeout_s": 9.0, "timeout_s": 30.0}}


def test_path_too_long_is_a_clear_error():
    base = "/tmp/" + "d" * 120
    with pytest.raises(BootstrapError) as ei:
        CpuTpBroadcaster(0, 2, "s", base_dir=base, init_timeout_s=0.1)
    assert ei.value.reason is Reason.PATH_TOO_LONG
    assert "UDS path too long" in str(ei.value) and "limit 107" in str(ei.value)
    assert not os.path.exists(base)


@pytest.mark.timeout(150)
def test_so_peercred_rejects_another_uid(base):
    import multiprocessing as mp

    q = mp.get_context("spawn").Queue()
    # Rank 0 pretends to run as another uid, so the real peer's credentials do not match: rank 0 drops it
    # (not a word to another user's process) and keeps accepting until its deadline, whose error says why.
    procs = H.start(W.real, [0], 2, (base, "s", "uds", 8, os.geteuid() + 1), q) + H.start(W.real, [1], 2, (base,), q)
    out = H.collect(q, procs, 2, 120)
    assert out[0][0] == "err" and out[0][1][2] == Reason.BOOTSTRAP_TIMEOUT.value, out[0]
    assert "SO_PEERCRED" in out[0][1][1] and "dropped 1 connection" in out[0][1][1], out[0]
    assert out[1][0] == "err", out[1]


@pytest.mark.timeout(150)
@pytest.mark.parametrize(
    "env,route",
    [({}, "local"), ({"TENSORWIRE_BROADCAST_PATH": "dist"}, "dist")],
    ids=["inside-node", "torch-distributed-fallback"],
)
def test_broadcast_cpu(base, env, route):
    store = os.path.join(base, "store")
    res = H.ok(H.run_ranks(W.dist_bcast, 2, store, env, 20, timeout_s=120))
    assert all(r == {"route": route} for r in res.values()), res


@pytest.mark.timeout(150)
def test_broadcast_cpu_path_disagreement_fails_on_every_rank(base):
    import multiprocessing as mp

    store = os.path.join(base, "store")
    q = mp.get_context("spawn").Queue()
    procs = H.start(W.dist_bcast, [0], 2, (store, {"TENSORWIRE_BROADCAST_PATH": "dist"}, 2), q) + H.start(
        W.dist_bcast, [1], 2, (store, {"TENSORWIRE_BROADCAST_PATH": "local"}, 2), q
    )
    res = H.ok(H.collect(q, procs, 2, 120))
    for r in (0, 1):
        assert res[r]["reason"] == Reason.PATH_DISAGREEMENT.value, res[r]


def _root_with_fakes(base, world, fakes):
    import multiprocessing as mp

    q = mp.get_context("spawn").Queue()
    procs = H.start(W.real, [0], world, (base,), q)
    for i, (claimed_rank, claimed_world, echo) in enumerate(fakes):
        procs += H.start(W.fake_peer, [100 + i], world, (base, claimed_rank, claimed_world, echo), q)
    out = H.collect(q, procs, 1 + len(fakes), 120)
    return out[0], [out[100 + i] for i in range(len(fakes))]


@pytest.mark.timeout(150)
def test_abstract_namespace_socket_leaves_no_file(base, monkeypatch):
    monkeypatch.setenv("TENSORWIRE_BROADCAST_ABSTRACT", "1")  # spawned ranks read it through BroadcastConfig
    res = H.ok(H.run_ranks(W.real, 3, base, "abs", timeout_s=120))
    assert res == {0: "42", 1: "42", 2: "42"}
    assert os.listdir(base) == []


@pytest.mark.timeout(150)
@pytest.mark.parametrize("backend", BACKENDS)
def test_signals_during_large_transfers(base, backend):
    res = H.ok(H.run_ranks(W.eintr, 2, base, backend, timeout_s=120))
    assert all(hits > 10 for hits in res.values()), res  # the handler really ran during the transfers
