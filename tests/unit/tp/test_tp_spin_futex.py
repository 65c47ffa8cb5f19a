"""Issue 17: the readers' adaptive spin window, the futex primitives and their config knobs."""

from __future__ import annotations

import mmap
import os
import threading
import time

import pytest

from tensorwire.errors import ConfigError
from tensorwire.tp import BroadcastConfig, _futex, _spin
from tensorwire.tp._spin import N, SpinWindow


def _fed(window: SpinWindow, waits: list[float]) -> SpinWindow:
    for w in waits:
        window.record(w)
    return window


def test_window_starts_at_spin_s_and_stays_there_for_back_to_back_traffic():
    w = SpinWindow(100e-6, 5e-3, 2.0, world=1)
    assert w.budget() == 100e-6
    assert _fed(w, [0.0, 20e-6] * N).budget() == 100e-6


def test_window_covers_a_steady_gap_after_half_the_history():
    w = SpinWindow(100e-6, 5e-3, 2.0, world=1)
    _fed(w, [0.0] * N)
    _fed(w, [2e-3] * (N // 2 - 1))
    assert w.budget() == 100e-6  # the median is still a back-to-back wait
    w.record(2e-3)
    assert w.budget() == pytest.approx(4e-3)  # factor x the median


def test_window_is_capped_and_falls_back_when_messages_come_further_apart():
    assert _fed(SpinWindow(100e-6, 5e-3, 2.0, world=1), [3e-3] * N).budget() == 5e-3  # 6 ms capped at 5
    assert _fed(SpinWindow(100e-6, 5e-3, 2.0, world=1), [20e-3] * N).budget() == 100e-6  # no point spinning
    # One long silence among short gaps does not turn spinning off.
    assert _fed(SpinWindow(100e-6, 5e-3, 2.0, world=1), [1e-3] * (N - 1) + [30.0]).budget() == 2e-3


def test_window_is_fixed_when_adaptation_is_off_or_the_ranks_outnumber_the_cpus(monkeypatch):
    assert _fed(SpinWindow(100e-6, 0.0, 2.0, world=1), [2e-3] * N).budget() == 100e-6
    monkeypatch.setattr(_spin, "_cpus", lambda: 2)
    assert _fed(SpinWindow(100e-6, 5e-3, 2.0, world=4), [2e-3] * N).budget() == 100e-6
    assert _fed(SpinWindow(100e-6, 5e-3, 2.0, world=2), [2e-3] * N).budget() == pytest.approx(4e-3)


def test_spin_knobs_are_validated_and_read_from_the_environment():
    for bad in ({"spin_max_s": -1.0}, {"spin_max_s": 2.0}, {"spin_gap_factor": 0.5}, {"spin_gap_factor": "2"}):
        with pytest.raises(ConfigError):
            BroadcastConfig(**bad)
    cfg = BroadcastConfig.from_env(
        {
            "TENSORWIRE_BROADCAST_SPIN_MAX_S": "0.002",
            "TENSORWIRE_BROADCAST_SPIN_GAP_FACTOR": "3",
            "TENSORWIRE_BROADCAST_FUTEX": "0",
        }
    )
    assert (cfg.spin_max_s, cfg.spin_gap_factor, cfg.futex) == (0.002, 3.0, False)
    assert BroadcastConfig().futex is True


needs_futex = pytest.mark.skipif(not _futex.AVAILABLE, reason="no futex syscall on this platform")


@pytest.fixture
def word() -> tuple[mmap.mmap, int]:
    mm = mmap.mmap(-1, 4096)
    yield mm, _futex.address_of(mm, 64)
    mm.close()  # address_of kept no buffer export: closing works


@needs_futex
def test_futex_wake_with_no_sleeper_wakes_nobody(word):
    assert _futex.wake(word[1]) == 0


@needs_futex
def test_futex_wait_returns_at_once_when_the_word_moved_on(word):
    mm, addr = word
    mm[64:68] = (7).to_bytes(4, "little")
    t0 = time.monotonic()
    _futex.wait(addr, 6, 30.0)  # the word holds 7, not 6: EAGAIN, no sleep
    assert time.monotonic() - t0 < 5.0
    t0 = time.monotonic()
    _futex.wait(addr, 7 + (5 << 32), 0.05)  # only the low 32 bits count: this one sleeps until its timeout
    assert time.monotonic() - t0 >= 0.04


@needs_futex
def test_futex_wake_from_another_thread_ends_a_wait(word):
    mm, addr = word
    woken: list[int] = []
    started = threading.Event()

    def waker() -> None:
        started.wait(10)
        deadline = time.monotonic() + 20
        while not woken and time.monotonic() < deadline:  # until the waiter is asleep and woken by us
            if _futex.wake(addr) == 1:
                woken.append(1)
            time.sleep(0.001)

    th = threading.Thread(target=waker, daemon=True)
    th.start()
    t0 = time.monotonic()
    started.set()
    _futex.wait(addr, 0, 30.0)  # the GIL is released while we sleep, so the waker runs
    took = time.monotonic() - t0
    th.join(10)
    assert woken == [1] and took < 20.0, took


def test_a_preempted_spin_falls_back_to_spin_s_for_the_next_waits():
    w = _fed(SpinWindow(100e-6, 5e-3, 2.0, world=1), [2e-3] * N)
    w.preempted()
    assert [w.budget() for _ in range(N)] == [100e-6] * N
    assert w.budget() == pytest.approx(4e-3)  # then it adapts again


def test_cpu_lists_are_counted_as_the_kernel_writes_them():
    assert [_spin._count(s) for s in ("0-3,8,10-11", "5", "", "0-1\n", "x-3")] == [7, 1, 0, 0, 0]


def test_a_rank_pinned_to_one_cpu_still_adapts_its_spin():
    # The per-process mask is not the group's CPU budget: ranks pinned one per CPU (vLLM's CPU workers, numactl,
    # bench --pin) used to lose the adaptive window and pay a wake-up on every message with a gap.
    import subprocess
    import sys

    if (os.cpu_count() or 1) < 2 or not hasattr(os, "sched_setaffinity"):
        pytest.skip("needs two CPUs and sched_setaffinity")
    code = (
        "import os; os.sched_setaffinity(0, {min(os.sched_getaffinity(0))}); "
        "from tensorwire.tp._spin import SpinWindow, N, _cpus; w = SpinWindow(100e-6, 5e-3, 2.0, world=2); "
        "[w.record(2e-3) for _ in range(N)]; print(len(os.sched_getaffinity(0)), _cpus() >= 2, w.budget())"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True)
    mask, enough, budget = out.stdout.split()
    assert mask == "1" and enough == "True" and float(budget) == pytest.approx(4e-3), out.stdout


def test_cpu_quotas_count_whole_cpus_and_no_limit_counts_none():
    assert [
        _spin._quota_cpus(q, p)
        for q, p in (
            ("150000", "100000"),
            ("200000", "100000"),
            ("max", "100000"),
            ("-1", "100000"),
            ("5", "0"),
            ("", ""),
        )
    ] == [2, 2, 0, 0, 0, 0]
