"""How long a reader busy-polls for the next message before it sleeps: adapted to the waits it has seen.

A reader that sleeps pays a wake-up (tens of microseconds, more at TP 8) on every message; one that spins burns a
core while it waits. ``SpinWindow`` keeps the last ``N`` waits (time from entering a receive to the message being
there; 0 when it already was) and spins for ``factor`` x their median, at least ``spin_s``, at most
``spin_max_s``. When the median itself exceeds ``spin_max_s`` (messages come further apart than we are willing to
spin) the window falls back to ``spin_s``: spinning would only burn the core and then sleep anyway. So:

* back-to-back traffic: waits are ~0, the window stays near ``spin_s``, and every message is caught spinning;
* a steady gap below ``spin_max_s / factor`` (a decode loop): after about N/2 messages the window covers the gap,
  readers spin through it and never pay a wake-up (a core each while messages flow, like vLLM's readers);
* idle or slow traffic: one window of at most ``spin_max_s`` after the last message, then sleep, so an idle reader
  costs ``spin_max_s`` of CPU once per silence, not a core.

A spin that loses its CPU is worse than a sleep: on an oversubscribed machine the spinner piles up CPU time and the
scheduler then leaves it off the CPU for milliseconds, where a sleeper would have been woken at once. So a spin
loop that sees a poll-to-poll gap over ``PREEMPTED_S`` calls :meth:`SpinWindow.preempted`, stops spinning and
sleeps, and the next ``N`` waits spin only ``spin_s``.

``spin_max_s <= spin_s`` turns the adaptation off (a fixed ``spin_s``), and so does a machine (or cgroup) with
fewer CPUs than the group has ranks: there, spinning readers would take the CPU rank 0 needs to publish. Not
thread-safe (one reader).
"""

from __future__ import annotations

import os

N = 16  # waits remembered (a power of two)
PREEMPTED_S = 250e-6  # a gap between two polls of a spin loop this long means another task had our CPU


def _cpus() -> int:
    """CPUs the machine gives this process's cgroup (its cpuset, capped by a CPU quota), else all of them.

    Not this process's own affinity mask: ranks are often pinned one per CPU or per core range (vLLM's CPU workers,
    numactl, ``--pin``), and a rank pinned to one CPU says nothing about whether the group has a CPU per rank. A
    group squeezed onto fewer CPUs by ``taskset`` alone is left to the spin loop's preemption check.
    """
    n = _cgroup_cpus()
    return n if n else (os.cpu_count() or 1)


def _cgroup_cpus() -> int:
    """cgroup v2 or v1 cpuset size, capped by the cgroup's CPU quota; 0 when neither can be read."""
    try:
        with open("/proc/self/cgroup") as f:
            lines = [ln.strip().split(":", 2) for ln in f if ln.count(":") >= 2]
    except OSError:
        return 0
    paths = {ctrl: path for _, ctrls, path in lines for ctrl in (ctrls.split(",") if ctrls else ["v2"])}
    cpuset = quota = 0
    if "v2" in paths and os.path.exists("/sys/fs/cgroup/cgroup.controllers"):  # unified hierarchy
        base = "/sys/fs/cgroup" + paths["v2"]
        cpuset = _count(_read(base + "/cpuset.cpus.effective"))
        limit = _read(base + "/cpu.max").split()  # "max 100000" or "<quota> <period>"
        if len(limit) == 2:
            quota = _quota_cpus(*limit)
    else:
        if "cpuset" in paths:
            cpuset = _count(_read(f"/sys/fs/cgroup/cpuset{paths['cpuset']}/cpuset.effective_cpus"))
        if "cpu" in paths:
            base = f"/sys/fs/cgroup/cpu{paths['cpu']}"
            quota = _quota_cpus(_read(base + "/cpu.cfs_quota_us"), _read(base + "/cpu.cfs_period_us"))
    return min(n for n in (cpuset, quota) if n) if cpuset or quota else 0


def _quota_cpus(quota: str, period: str) -> int:
    """CPUs a CPU quota amounts to (rounded up); 0 for no limit ("max", -1) or an unreadable one."""
    if not (quota.isdigit() and period.isdigit()) or int(period) == 0:
        return 0
    return -(-int(quota) // int(period))


def _read(path: str) -> str:
    try:
        with open(path) as f:
            return f.read().strip()
    except (OSError, ValueError):
        return ""


def _count(cpulist: str) -> int:
    """Size of a kernel CPU list such as ``0-3,8,10-11``; 0 for an empty or unreadable one."""
    n = 0
    for part in filter(None, cpulist.split(",")):
        lo, _, hi = part.partition("-")
        if not lo.isdigit() or (hi and not hi.isdigit()):
            return 0
        n += int(hi) - int(lo) + 1 if hi else 1
    return n


class SpinWindow:
    __slots__ = ("_base", "_max", "_factor", "_waits", "_i", "_calm")

    def __init__(self, spin_s: float, spin_max_s: float, factor: float, world: int) -> None:
        self._base = spin_s
        self._max = max(spin_s, spin_max_s) if _cpus() >= world else spin_s
        self._factor = factor
        self._waits = [0.0] * N
        self._i = 0
        self._calm = 0  # waits left that spin only spin_s, after a preempted spin

    def record(self, wait_s: float) -> None:
        """One receive waited ``wait_s`` for its message (0: it was already there)."""
        self._waits[self._i] = wait_s
        self._i = (self._i + 1) & (N - 1)

    def budget(self) -> float:
        """Seconds to spin before sleeping on the next wait (called only when a message is not there yet)."""
        if self._max <= self._base:
            return self._base
        if self._calm:
            self._calm -= 1
            return self._base
        median = sorted(self._waits)[N // 2]
        if median > self._max:
            return self._base
        return min(self._max, max(self._base, self._factor * median))

    def preempted(self) -> None:
        """A spin lost its CPU (see the module docstring): spin only ``spin_s`` for the next ``N`` waits."""
        self._calm = N
