"""Fault windows: when each injected fault was in effect, and which window each request fell in.

Windows are ``[start, end]`` on CLOCK_MONOTONIC. Kinds: ``client_cut`` (outside the availability target),
``worker_restart``, ``worker_cut``. A request goes to the first window of ``PRIORITY`` that its ``[t0, t1]``
overlaps, else ``none``; ``summarize`` gives per kind the counts, failures by reason and success rate.
"""

from __future__ import annotations

import bisect
import threading
from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

PRIORITY = ("client_cut", "worker_restart", "worker_cut")
WORKER_KINDS = ("worker_restart", "worker_cut")
AVAILABILITY_TARGET = 0.999


@dataclass
class FaultWindow:
    kind: str
    target: str
    start: float
    end: float = float("inf")  # open until closed


@dataclass(frozen=True)
class Outcome:
    t0: float
    t1: float
    ok: bool
    reason: str  # "" for a success, else "<ExceptionClass>:<reason>" (or the untyped/wrong kind)
    message: str = ""  # a failure's message (trimmed), for the examples in the summary


class FaultWindows:
    """Thread-safe record of windows (``open``/``close``/``add``) and the attribution of outcomes to them."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._windows: list[FaultWindow] = []

    def open(self, kind: str, target: str, start: float) -> FaultWindow:
        w = FaultWindow(kind, target, start)
        with self._lock:
            self._windows.append(w)
        return w

    def close(self, window: FaultWindow, end: float) -> None:
        with self._lock:
            window.end = end

    def add(self, kind: str, target: str, start: float, end: float) -> FaultWindow:
        w = FaultWindow(kind, target, start, end)
        with self._lock:
            self._windows.append(w)
        return w

    def open_at(self, now: float, kinds: Iterable[str]) -> list[FaultWindow]:
        """Windows of ``kinds`` in effect at ``now`` (a worker fault waits for the last one to end)."""
        wanted = set(kinds)
        with self._lock:
            return [w for w in self._windows if w.kind in wanted and w.start <= now <= w.end]

    def snapshot(self) -> list[FaultWindow]:
        with self._lock:
            return [FaultWindow(**w.__dict__) for w in self._windows]

    def attribute(self, t0: float, t1: float, windows: list[FaultWindow] | None = None) -> str:
        """The kind a request that ran over ``[t0, t1]`` is attributed to (``PRIORITY`` order), or ``none``."""
        hit = {w.kind for w in (windows if windows is not None else self.snapshot()) if w.start <= t1 and t0 <= w.end}
        return next((k for k in PRIORITY if k in hit), "none")

    def summarize(
        self, outcomes: Iterable[Outcome], end: float, origin: float = 0.0, max_listed: int = 100
    ) -> dict[str, Any]:
        """The attribution (module docstring); times in the listed windows and failures are relative to
        ``origin`` (the start of the soak)."""
        windows = self.snapshot()
        listed: list[dict[str, Any]] = []
        for w in windows:  # a window still open at the end of the run ends there
            w.end = min(w.end, end)
        by_start = sorted(windows, key=lambda w: w.start)
        starts = [w.start for w in by_start]
        rows: dict[str, dict[str, Any]] = {
            k: {"requests": 0, "ok": 0, "failed": Counter(), "examples": []} for k in (*PRIORITY, "none")
        }
        for o in outcomes:
            # Only windows that started before the request ended can overlap it.
            candidates = by_start[: bisect.bisect_right(starts, o.t1)]
            kind = self.attribute(o.t0, o.t1, candidates)
            row = rows[kind]
            row["requests"] += 1
            if o.ok:
                row["ok"] += 1
            else:
                row["failed"][o.reason] += 1
                if kind != "client_cut" and len(listed) < max_listed:
                    hit = [f"{w.kind}:{w.target}" for w in candidates if w.start <= o.t1 and o.t0 <= w.end]
                    listed.append(
                        {
                            "t0_s": round(o.t0 - origin, 3),
                            "t1_s": round(o.t1 - origin, 3),
                            "windows": hit,
                            "reason": o.reason,
                            "message": o.message,
                        }
                    )
                if len(row["examples"]) < 5:
                    row["examples"].append(o.message)
        out: dict[str, Any] = {
            "by_fault": {},
            "windows": Counter(w.kind for w in windows),
            "window_seconds": {k: round(sum(w.end - w.start for w in windows if w.kind == k), 1) for k in PRIORITY},
        }
        for kind, row in rows.items():
            out["by_fault"][kind] = {
                "requests": row["requests"],
                "ok": row["ok"],
                "failed": sum(row["failed"].values()),
                "failed_by_reason": dict(row["failed"]),
                "success_rate": _rate(row["ok"], row["requests"]),
                "failure_examples": row["examples"],
            }
        inside = [rows[k] for k in (*WORKER_KINDS, "none")]
        n, ok = sum(r["requests"] for r in inside), sum(r["ok"] for r in inside)
        out["outside_client_cuts"] = {
            "requests": n,
            "ok": ok,
            "failed": n - ok,
            "success_rate": _rate(ok, n),
            "target": AVAILABILITY_TARGET,
            "met": n > 0 and ok / n >= AVAILABILITY_TARGET,
        }
        out["windows"] = dict(out["windows"])
        out["window_list"] = [
            {
                "kind": w.kind,
                "target": w.target,
                "start_s": round(w.start - origin, 3),
                "end_s": round(w.end - origin, 3),
            }
            for w in by_start[:500]
        ]
        out["failures_outside_client_cuts"] = listed
        return out


def _rate(ok: int, n: int) -> float | None:
    return round(ok / n, 5) if n else None


__all__ = ["AVAILABILITY_TARGET", "FaultWindow", "FaultWindows", "Outcome", "PRIORITY", "WORKER_KINDS"]
