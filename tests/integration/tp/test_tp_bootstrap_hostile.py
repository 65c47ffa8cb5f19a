"""Bootstrap against hostile local processes (issue 15, finding 9), all real processes, another uid included
(the tests run as root and fork children that drop to ``nobody``):

* connections that are not peers (another uid, silent, garbage, closed mid-handshake) are dropped and bootstrap
  keeps accepting: the group still forms;
* an abstract name squatted by another uid moves the group to its private socket path;
* the runtime directory follows ``$XDG_RUNTIME_DIR`` when it is ours, and ignores it when it is not;
* a ``$TMPDIR/tensorwire-<uid>`` pre-created by another user does not make every rank fail.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import re
import socket
import stat
import uuid
from collections.abc import Iterator

import pytest
import tp_helpers as H
import tp_workers as W
from tp_hostile import NOBODY, Hostile, connect_retrying, hold_connection, make_dir, squat

from tensorwire.errors import Reason
from tensorwire.tp import _star
from tensorwire.tp._paths import make_endpoint

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="needs root to act as another uid (nobody)")


def _session() -> str:
    return f"h{uuid.uuid4().hex[:8]}"


@pytest.fixture
def dirs(monkeypatch: pytest.MonkeyPatch) -> Iterator[dict[str, str]]:
    """Short private TMPDIR, HOME and XDG_RUNTIME_DIR candidates; the default-directory variables cleared."""
    made = {name: H.short_dir() for name in ("tmp", "home", "xdg")}
    monkeypatch.delenv("TENSORWIRE_BROADCAST_DIR", raising=False)
    monkeypatch.delenv("XDG_RUNTIME_DIR", raising=False)
    monkeypatch.setenv("TMPDIR", made["tmp"])
    monkeypatch.setenv("HOME", made["home"])
    yield made
    for d in made.values():
        H.rmtree(d)


@pytest.mark.timeout(180)
@pytest.mark.parametrize("abstract", [True, False], ids=["abstract", "file"])
def test_foreign_and_failed_handshakes_are_dropped_and_bootstrap_goes_on(base, monkeypatch, abstract):
    session = _session()
    if abstract:
        monkeypatch.setenv("TENSORWIRE_BROADCAST_ABSTRACT", "1")  # the spawned ranks read it
    ep = make_endpoint(session, base, abstract)
    q = mp.get_context("spawn").Queue()
    procs = H.start(W.real_where, [0], 3, (base, session, 90), q)
    hostile: list[Hostile] = []
    try:
        if abstract:  # only the abstract namespace lets another uid reach the socket (the file is in a 0700 dir)
            hostile.append(Hostile(NOBODY, hold_connection(ep.address)))  # another uid, says nothing
            hostile.append(Hostile(NOBODY, hold_connection(ep.address, b"GET / HTTP/1.1\r\n\r\n" * 4)))
        me = os.geteuid()
        hostile.append(Hostile(me, hold_connection(ep.address)))  # ours, never sends its HELLO
        hostile.append(Hostile(me, hold_connection(ep.address, b"\0" * 64)))  # ours, garbage
        half = connect_retrying(ep.address)
        half.sendall(_star.HELLO_MAGIC + b"\x01\x00")  # a HELLO cut short by a close
        half.close()
        # The real peers come after all of them (the old code read handshakes in accept order and failed).
        procs += H.start(W.real_where, [1, 2], 3, (base, session, 90), q)
        out = H.ok(H.collect(q, procs, 3, 150))
    finally:
        for h in hostile:
            h.stop()
        H.kill(procs)
    assert out == {r: ["42", ep.display] for r in range(3)}


@pytest.mark.timeout(180)
@pytest.mark.parametrize("listen", [True, False], ids=["listening", "bound-only"])
def test_squatted_abstract_name_moves_the_group_to_its_private_path(base, monkeypatch, listen):
    session = _session()
    monkeypatch.setenv("TENSORWIRE_BROADCAST_ABSTRACT", "1")
    ep = make_endpoint(session, base, True)
    squatter = Hostile(NOBODY, squat(ep.address, listen))
    try:
        out = H.ok(H.run_ranks(W.real_where, 2, base, session, 60, timeout_s=150))
    finally:
        squatter.stop()
    private = make_endpoint(session, base, False)
    assert out == {r: ["42", private.display] for r in range(2)}
    assert not os.path.exists(private.display)  # the listener is gone after bootstrap, as for file sockets


@pytest.mark.timeout(120)
def test_abstract_name_held_by_our_own_uid_is_a_clear_error(base, monkeypatch):
    session = _session()
    monkeypatch.setenv("TENSORWIRE_BROADCAST_ABSTRACT", "1")
    ep = make_endpoint(session, base, True)
    holder = Hostile(os.geteuid(), squat(ep.address))
    try:
        out = H.run_ranks(W.real_where, 2, base, session, 30, timeout_s=100, ranks=[0])
    finally:
        holder.stop()
    assert out[0][0] == "err" and out[0][1][2] == Reason.BOOTSTRAP_FAILED.value, out
    assert "in use by a live broadcaster of our uid" in out[0][1][1]


@pytest.mark.timeout(180)
def test_runtime_dir_follows_xdg_runtime_dir_when_it_is_ours(dirs, monkeypatch):
    session = _session()
    monkeypatch.setenv("XDG_RUNTIME_DIR", dirs["xdg"])
    out = H.ok(H.run_ranks(W.real_where, 2, None, session, 60, timeout_s=150))
    runtime = os.path.join(dirs["xdg"], "tensorwire")
    assert out == {r: ["42", os.path.join(runtime, f"tw-{session}.sock")] for r in range(2)}
    st = os.stat(runtime)
    assert st.st_uid == os.geteuid() and stat.S_IMODE(st.st_mode) == 0o700
    # Another user's XDG_RUNTIME_DIR (a wrong environment, a shared shell) is ignored, not trusted.
    os.chown(dirs["xdg"], NOBODY, NOBODY)
    out = H.ok(H.run_ranks(W.real_where, 2, None, session, 60, timeout_s=150))
    tmp = os.path.join(dirs["tmp"], f"tensorwire-{os.geteuid()}")
    assert out == {r: ["42", os.path.join(tmp, f"tw-{session}.sock")] for r in range(2)}


@pytest.mark.timeout(180)
@pytest.mark.parametrize("mode", [0o777, 0o700], ids=["open", "private"])
def test_tmpdir_dir_precreated_by_another_user_does_not_fail_the_group(dirs, mode):
    session = _session()
    os.chmod(dirs["tmp"], 0o1777)  # a TMPDIR like /tmp: everyone may create entries
    planted = os.path.join(dirs["tmp"], f"tensorwire-{os.geteuid()}")
    Hostile(NOBODY, make_dir(planted, mode)).stop()
    assert os.stat(planted).st_uid == NOBODY
    out = H.ok(H.run_ranks(W.real_where, 2, None, session, 60, timeout_s=150))
    host = re.sub(r"[^A-Za-z0-9._-]", "_", socket.gethostname())
    fallback = os.path.join(dirs["home"], ".cache", "tensorwire", host)
    assert out == {r: ["42", os.path.join(fallback, f"tw-{session}.sock")] for r in range(2)}
    assert os.listdir(planted) == []  # nothing of ours went into the other user's directory
