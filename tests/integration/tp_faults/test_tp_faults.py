"""Broadcaster faults (issue 7): a peer killed in the middle of a broadcast, rank 0 killed, a slow reader.

Every rank runs in its own spawned process and streams 4 MiB frames. After the fault, every surviving rank
must end with a tensorwire error whose message names the cause (the dead or slow rank), within a deadline; no
rank hangs; no socket file is left in the rendezvous directory and no shared-memory segment in /dev/shm.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import signal
import time
import uuid
from pathlib import Path
from typing import Any

import pytest
from tp_fault_ranks import rank_main

from tensorwire.tp import shm_available

BACKENDS = ["uds"] + (["shm"] if shm_available() else [])
WORLD = 3


def _shm_entries() -> set[str]:
    """Named shared memory in /dev/shm, minus what other processes on the machine create and remove on their own
    schedule (multiprocessing semaphores ``sem.*``, UCX segments ``ucx_*`` of NIXL processes). The shm ring uses a
    memfd (no name); this catches a regression to named segments."""
    try:
        return {n for n in os.listdir("/dev/shm") if not n.startswith(("sem.", "ucx_"))}
    except OSError:
        return set()


class Group:
    def __init__(
        self,
        tmp_path: Path,
        backend: str,
        timeout_s: float | None | dict[int, float | None],
        roles: dict[int, str],
        stall_s: float = 0.0,
    ) -> None:
        ctx = mp.get_context("spawn")
        self.base = str(tmp_path / "rdv")
        os.makedirs(self.base, mode=0o700)
        session = f"faults-{uuid.uuid4().hex[:8]}"
        self.conns, self.procs = [], []
        for r in range(WORLD):
            parent, child = ctx.Pipe(duplex=False)
            p = ctx.Process(
                target=rank_main,
                daemon=True,
                name=f"rank{r}",
                args=(
                    r,
                    WORLD,
                    session,
                    self.base,
                    backend,
                    timeout_s.get(r) if isinstance(timeout_s, dict) else timeout_s,
                    roles.get(r, "normal"),
                    stall_s,
                    child,
                ),
            )
            p.start()
            child.close()
            self.conns.append(parent)
            self.procs.append(p)
        self.last: dict[int, tuple[Any, ...]] = {}
        self.steps = {r: 0 for r in range(WORLD)}

    def poll(self, timeout_s: float) -> None:
        for r, c in enumerate(self.conns):
            try:
                while c.poll(timeout_s if r == 0 else 0):
                    msg = c.recv()
                    if msg[0] == "step":
                        self.steps[r] = msg[1]
                    elif msg[0] in ("error", "done"):
                        self.last[r] = msg
            except (EOFError, OSError):
                continue

    def wait_steps(self, n: int, deadline_s: float) -> None:
        end = time.monotonic() + deadline_s
        while time.monotonic() < end and min(self.steps.values()) < n:
            self.poll(0.05)
        assert min(self.steps.values()) >= n, f"the group did not reach step {n}: {self.steps} {self.last}"

    def wait_final(self, ranks: list[int], deadline_s: float) -> dict[int, tuple[Any, ...]]:
        end = time.monotonic() + deadline_s
        while time.monotonic() < end and any(r not in self.last for r in ranks):
            self.poll(0.05)
        missing = [r for r in ranks if r not in self.last]
        assert not missing, f"ranks {missing} hung: no error within {deadline_s} s"
        for r in ranks:
            self.procs[r].join(10)
            assert not self.procs[r].is_alive(), f"rank {r} reported but did not exit"
        return {r: self.last[r] for r in ranks}

    def kill(self, rank: int) -> None:
        os.kill(self.procs[rank].pid, signal.SIGKILL)
        self.procs[rank].join(10)

    def cleanup(self) -> None:
        for p in self.procs:
            if p.is_alive():
                p.kill()
            p.join(10)
        for c in self.conns:
            c.close()


KNOWN_UDS_CAUSE = (
    "known gap (docs/reliability.md, .notes-bugs.md): on the uds backend a peer that rank 0 aborts "
    "in the middle of a frame sees only rank 0's EOF, not which rank died"
)
KNOWN_TIMEOUT_CAUSE = (
    "known gap (docs/reliability.md): rank 0's timeout names the slow reader, but another "
    "reader's own timeout can abort the group first"
)


def _xfail_unless(named: list[str], reason: str) -> None:
    """Checked last, after every hard assertion: a missing cause is a known tp gap, reported as xfail."""
    if named:
        pytest.xfail(f"{reason}: {named}")


def _assert_clean(base: str, shm_before: set[str]) -> None:
    assert os.listdir(base) == [], f"left in the rendezvous directory: {os.listdir(base)}"
    new_shm = _shm_entries() - shm_before
    assert not new_shm, f"left in /dev/shm: {sorted(new_shm)}"


@pytest.mark.timeout(120)
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("victim", [1, 2])
def test_peer_killed_mid_broadcast(tmp_path: Path, backend: str, victim: int) -> None:
    shm_before = _shm_entries()
    g = Group(tmp_path, backend, timeout_s=10.0, roles={})
    try:
        g.wait_steps(10, 60)
        g.kill(victim)
        survivors = [r for r in range(WORLD) if r != victim]
        final = g.wait_final(survivors, 20)
        for r, msg in final.items():
            assert msg[0] == "error", (r, msg)
            assert msg[2] in ("peer_closed", "broadcast_timeout"), (r, msg)
    finally:
        g.cleanup()
    _assert_clean(g.base, shm_before)
    unnamed = [final[r][3] for r in survivors if f"rank {victim}" not in final[r][3]]
    if backend == "shm":
        assert not unnamed, f"errors that do not name the dead rank {victim}: {unnamed}"
    _xfail_unless(unnamed, KNOWN_UDS_CAUSE)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("backend", BACKENDS)
def test_rank0_killed(tmp_path: Path, backend: str) -> None:
    shm_before = _shm_entries()
    g = Group(tmp_path, backend, timeout_s=None, roles={})  # no per-call timeout: death must still surface
    try:
        g.wait_steps(10, 60)
        g.kill(0)
        final = g.wait_final([1, 2], 20)
        for r, msg in final.items():
            assert msg[0] == "error" and msg[1] == "PeerClosed", (r, msg)
            assert "rank 0" in msg[3], f"rank {r}'s error does not name rank 0: {msg[3]}"
    finally:
        g.cleanup()
    _assert_clean(g.base, shm_before)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("backend", BACKENDS)
def test_slow_reader_times_out_rank0_and_aborts_the_group(tmp_path: Path, backend: str) -> None:
    shm_before = _shm_entries()
    g = Group(tmp_path, backend, timeout_s=2.0, roles={2: "slow"}, stall_s=8.0)
    try:
        final = g.wait_final([0, 1, 2], 45)
        for r in (0, 1, 2):
            # Rank 0 times out on the slow reader, or first hears that rank 1 gave up waiting (its own timeout).
            assert final[r][0] == "error", (r, final[r])
            assert final[r][2] in ("peer_closed", "broadcast_timeout", "frame_mismatch"), (r, final[r])
        assert any(final[r][2] == "broadcast_timeout" for r in (0, 1, 2)), final
    finally:
        g.cleanup()
    _assert_clean(g.base, shm_before)
    _xfail_unless(
        [] if any("rank 2" in final[r][3] for r in (0, 1)) else [final[0][3], final[1][3]], KNOWN_TIMEOUT_CAUSE
    )


@pytest.mark.timeout(120)
@pytest.mark.skipif("shm" not in BACKENDS, reason="no shm backend here")
def test_a_reader_whose_own_timeout_fires_first_names_the_slow_reader(tmp_path: Path) -> None:
    """Rank 1's timeout (2 s) runs out long before rank 0's (30 s) on the stalled rank 2: on the shm ring rank 1
    can see who has not consumed what rank 0 published, and its error says so (the race the test above leaves
    to chance, made certain)."""
    shm_before = _shm_entries()
    g = Group(tmp_path, "shm", timeout_s={0: 30.0, 1: 2.0, 2: 30.0}, roles={2: "slow"}, stall_s=8.0)
    try:
        final = g.wait_final([0, 1, 2], 45)
        assert final[1][0] == "error" and final[1][2] == "broadcast_timeout", final[1]
        assert "rank 1:" in final[1][3] and "probably waiting for rank 2" in final[1][3], final[1][3]
        for r in (0, 2):  # rank 1's abort reaches both: no one waits for the 30 s
            assert final[r][0] == "error" and final[r][2] in ("peer_closed", "broadcast_timeout"), (r, final[r])
    finally:
        g.cleanup()
    _assert_clean(g.base, shm_before)
