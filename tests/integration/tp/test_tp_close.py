"""close() while a call is blocked (issue 13): a clean cancel with ClosedError on both backends, no leaks.

Before the fix, closing a shm broadcaster from another thread while a reader waited released the ring under the
reader's feet (``ValueError: operation forbidden on released memoryview object``), and the uds reader saw
``PeerClosed`` from a socket closed under it. Each test runs a real group of spawned ranks; the closing rank checks
its own fds and mappings after close().
"""

from __future__ import annotations

import multiprocessing as mp

import pytest
import tp_helpers as H
import tp_workers as W

from tensorwire.tp import shm_available

BACKENDS = ["uds", pytest.param("shm", marks=pytest.mark.skipif(not shm_available(), reason="no shm fence"))]


def _run(base: str, backend: str, world: int, closer: int, mode: str) -> tuple[dict, dict]:
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    done = ctx.Event()
    procs = H.start(W.close_while_blocked, list(range(world)), world, (base, backend, closer, mode, done), q)
    res = H.ok(H.collect(q, procs, world, 150))
    return res[closer], {r: v for r, v in res.items() if r != closer}


def _assert_clean_cancel(me: dict) -> None:
    call = me["call"]
    assert call["type"] == "ClosedError" and call["reason"] == "closed", call
    assert "closed" in call["msg"], call
    assert me.get("call_returned", True), "the blocked call did not return after close()"
    assert me["close_s"] < 10.0, f"close() took {me['close_s']:.1f} s"
    assert me["second_close"] == {"type": None}, me["second_close"]
    assert me["after_close"]["type"] == "ClosedError", me["after_close"]
    assert not me["ring_mapped"], "the shared-memory ring is still mapped after close()"
    assert me["leaked_fds"] == {}, f"fds left open by close(): {me['leaked_fds']}"
    assert me["socket_files"] == [], me["socket_files"]


@pytest.mark.timeout(200)
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("closer", [1, 0], ids=["reader", "root"])
def test_close_from_another_thread_cancels_a_blocked_call(base, backend, closer):
    me, others = _run(base, backend, 3, closer, "thread")
    _assert_clean_cancel(me)
    assert me["was_blocked"], "the call never blocked; the test did not exercise the blocked case"
    for r, rep in others.items():
        assert rep["first"] == 1, rep
        err = rep["error"]
        # The group cannot go on without the closer: every other rank's next call fails, typed, naming it.
        assert err["type"] == "PeerClosed" and err["reason"] == "peer_closed", (r, err)
        if r == 0:
            assert f"rank {closer}" in err["msg"], err
        if closer == 0:
            assert "rank 0" in err["msg"], err


@pytest.mark.timeout(200)
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("mode", ["signal", "at_once"])
def test_close_from_a_signal_handler_or_racing_the_call(base, backend, mode):
    me, others = _run(base, backend, 2, 1, mode)
    _assert_clean_cancel(me)
    assert others[0]["error"]["type"] == "PeerClosed", others[0]
