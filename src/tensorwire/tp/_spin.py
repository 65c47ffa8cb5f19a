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

``spin_max_s <= spin_s`` turns the adaptation off (a fixed ``spin_s``), and so does a machine (CPU affinity) with
fewer CPUs than the group has ranks: there, spinning readers would take the CPU rank 0 needs to publish. Not
thread-safe (one reader).
"""

from __future__ import annotations

import os

N = 16  # waits remembered (a power of two)
PREEMPTED_S = 250e-6  # a gap between two polls of a spin loop this long means another task had our CPU


def _cpus() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


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
