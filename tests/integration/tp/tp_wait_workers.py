"""Rank bodies for the reader-wait tests (issue 17): module-level so spawned processes can import them."""

from __future__ import annotations

import dataclasses
import random
import threading
import time
from typing import Any

import torch

from tensorwire.tp import BroadcastConfig, CpuTpBroadcaster

# A lost wake-up must not be papered over by the periodic re-check: make that 60 s and the call limit 30 s, so a
# reader that misses its wake-up fails with BroadcastTimeout instead of arriving late.
STRICT = {"wait_poll_s": 60.0, "timeout_s": 30.0}


def gaps(rank: int, world: int, base: str, backend: str, futex: bool, gaps_ms: list[float]) -> dict:
    """Rank 0 sends one message after each gap (tensor, object and in-place forms in turn); readers check each.
    Readers report how long each receive took, so the caller can see that they slept (a gap past the window)."""
    cfg = BroadcastConfig(spin_s=20e-6, spin_max_s=2e-3, futex=futex, **STRICT)
    waits = []
    with CpuTpBroadcaster(
        rank, world, f"gaps-{backend}-{futex}", backend=backend, base_dir=base, init_timeout_s=60, config=cfg
    ) as b:
        t = torch.zeros(256, dtype=torch.int64)
        for i, gap in enumerate(gaps_ms):
            want_t = torch.arange(256, dtype=torch.int64) + i
            want_o = {"i": i, "s": "x" * (i % 7), "l": list(range(i % 50))}
            kind = i % 3
            if rank == 0:
                time.sleep(gap / 1e3)
                if kind == 0:
                    b.broadcast(want_t)
                elif kind == 1:
                    b.broadcast_object(want_o)
                else:
                    t.copy_(want_t)
                    b.broadcast_(t)
                continue
            t0 = time.monotonic()
            if kind == 0:
                got: Any = b.broadcast(None)
                ok = torch.equal(got, want_t)
            elif kind == 1:
                got = b.broadcast_object(None)
                ok = got == want_o
            else:
                b.broadcast_(t)
                ok = torch.equal(t, want_t)
            waits.append(time.monotonic() - t0)
            if not ok:
                raise AssertionError(f"rank {rank}: message {i} after a {gap} ms gap is wrong: {got!r}")
    return {"waits": waits}


def random_gaps(seed: int, n: int) -> list[float]:
    """Gaps around the readers' spin window (0-4 ms) and a few long ones (past it), in ms."""
    rng = random.Random(seed)
    return [
        rng.choice([0.0, rng.uniform(0, 4.0), rng.uniform(0, 4.0), 250.0 if rng.random() < 0.03 else 1.0])
        for _ in range(n)
    ]


def close_while_spinning(rank: int, world: int, base: str, done: Any) -> dict:
    """Rank 1 waits in a receive with a 1 s spin window (nothing comes) and is closed from another thread 50 ms in:
    the call must end with ClosedError long before the window would have run out."""
    from tensorwire.tp import _shm

    # On a busy machine the spin would end early as "preempted" (and sleep, where close() is seen anyway): switch
    # that rule off here, so that only the spin loop's own check of close() can end the call before 1 s.
    _shm.PREEMPTED_S = 10.0
    cfg = BroadcastConfig(spin_s=1.0, spin_max_s=1.0, timeout_s=60.0)
    b = CpuTpBroadcaster(rank, world, "spinning", backend="shm", base_dir=base, init_timeout_s=60, config=cfg)
    if rank == 0:
        ok = done.wait(60)
        b.close()
        return {"closer_finished": ok}
    out: dict[str, Any] = {}

    def call() -> None:
        t0 = time.monotonic()
        try:
            b.broadcast(None)
            out["error"] = None
        except Exception as exc:  # the test checks which
            out["error"] = type(exc).__name__
        out["call_s"] = time.monotonic() - t0

    th = threading.Thread(target=call)
    th.start()
    time.sleep(0.05)  # not synchronisation: the call is spinning or about to; either way close() must end it
    t0 = time.monotonic()
    b.close()
    th.join(30)
    out["close_to_return_s"] = time.monotonic() - t0
    out["returned"] = not th.is_alive()
    done.set()
    return out


def objects(rank: int, world: int, base: str, backend: str) -> dict:
    """broadcast_object: assorted objects (one larger than a slot, one holding a tensor), an unpicklable one that
    fails on rank 0 alone, then rank 0 calling broadcast while the readers call broadcast_object."""
    cfg = BroadcastConfig(slot_bytes=64 * 1024, n_slots=4, arena_bytes=16 << 20, timeout_s=60.0)
    values: list[Any] = [
        None,
        7,
        "x" * 100,
        {"a": [1, 2, (3, "b")], "t": torch.arange(5)},
        b"\0" * (1 << 20),
        {"k": set(range(100))},
    ]
    out: dict[str, Any] = {}
    with CpuTpBroadcaster(
        rank, world, f"objects-{backend}", backend=backend, base_dir=base, init_timeout_s=60, config=cfg
    ) as b:
        for i, want in enumerate(values):
            got = b.broadcast_object(want if rank == 0 else None)
            same = torch.equal(got["t"], want["t"]) and got["a"] == want["a"] if i == 3 else got == want
            if not same:
                raise AssertionError(f"rank {rank}: object {i} arrived as {got!r}")
        if rank == 0:
            try:
                b.broadcast_object(lambda: None)  # lambdas do not pickle
            except Exception as exc:  # the test checks which
                out["unpicklable"] = type(exc).__name__
            b.broadcast_object("still in step")
            b.broadcast(torch.ones(3))
        else:
            out["after"] = b.broadcast_object(None)
            try:
                b.broadcast_object(None)
            except Exception as exc:  # the test checks which
                out["mismatch"] = type(exc).__name__
    return out


def close_object_call_from_signal(rank: int, world: int, base: str, done: Any) -> dict:
    """Rank 1 blocks in broadcast_object; a SIGALRM handler on that thread closes the broadcaster. close() must see
    that it runs inside the call (and return at once) instead of waiting 5 s for the call to leave."""
    import signal

    b = CpuTpBroadcaster(
        rank,
        world,
        "objsignal",
        backend="shm",
        base_dir=base,
        init_timeout_s=60,
        config=BroadcastConfig(timeout_s=60.0),
    )
    if rank == 0:
        ok = done.wait(60)
        b.close()
        return {"closer_finished": ok}
    out: dict[str, Any] = {}

    def on_alarm(signum: int, frame: Any) -> None:
        t0 = time.monotonic()
        b.close()
        out["close_s"] = time.monotonic() - t0

    signal.signal(signal.SIGALRM, on_alarm)
    signal.setitimer(signal.ITIMER_REAL, 0.3)
    try:
        b.broadcast_object(None)
        out["error"] = None
    except Exception as exc:  # the test checks which
        out["error"] = type(exc).__name__
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
    done.set()
    return out


@dataclasses.dataclass
class Step:
    """A small scheduler-output-like schema for the typed ``broadcast_object`` tests."""

    step: int
    ids: list[str]
    tokens: list[list[int]]
    blocks: dict[str, list[int] | None]
    done: set[str]
    blob: bytes = b""


@dataclasses.dataclass
class LookAlike(Step):
    """Step's fields under another name: a reader that names it must not decode Step's messages as it."""


@dataclasses.dataclass
class Holder:
    t: Any  # a tensor: msgspec cannot encode it


def step(i: int, blob: int = 0) -> Step:
    ids = [f"req-{k}" for k in range(i % 9)]
    return Step(
        i,
        ids,
        [[k * i, k] for k in range(len(ids))],
        {r: ([i] if k % 2 else None) for k, r in enumerate(ids)},
        {f"fin-{i}"},
        b"\x07" * blob,
    )


def typed_objects(rank: int, world: int, base: str, backend: str) -> dict:
    """broadcast_object(schema=...): a run of dataclass trees (one larger than a slot) and a generic alias; values
    rank 0 cannot send (wrong type, unencodable) fail on rank 0 alone; then a pickled object where the readers
    expect a typed one."""
    cfg = BroadcastConfig(slot_bytes=64 * 1024, n_slots=4, arena_bytes=16 << 20, timeout_s=60.0)
    out: dict[str, Any] = {"rank0": []}
    with CpuTpBroadcaster(
        rank, world, f"typed-{backend}", backend=backend, base_dir=base, init_timeout_s=60, config=cfg
    ) as b:
        for i in range(40):
            want = step(i, blob=(1 << 20) if i == 17 else 0)
            got = b.broadcast_object(want if rank == 0 else None, schema=Step)
            if type(got) is not Step or got != want:
                raise AssertionError(f"rank {rank}: message {i} arrived as {got!r}")
        got = b.broadcast_object([3, 1, 2] if rank == 0 else None, schema=list[int])
        if got != [3, 1, 2]:
            raise AssertionError(f"rank {rank}: list[int] arrived as {got!r}")
        if rank == 0:
            for bad in ({"step": 1}, Holder(torch.ones(2))):
                try:
                    b.broadcast_object(bad, schema=Step if isinstance(bad, dict) else Holder)
                except Exception as exc:  # the test checks which
                    out["rank0"].append(type(exc).__name__)
            b.broadcast_object(step(99), schema=Step)
            b.broadcast_object(step(100))  # no schema: pickled
        else:
            out["after"] = b.broadcast_object(None, schema=Step).step
            try:
                b.broadcast_object(None, schema=Step)
            except Exception as exc:  # the test checks which
                out["mismatch"] = f"{type(exc).__name__}: {exc}"
    return out


def typed_mismatch(rank: int, world: int, base: str, backend: str, how: str) -> dict:
    """One typed message the readers must refuse (terminal FrameMismatch): ``other_schema`` (they name LookAlike),
    ``forged`` (rank 0's bytes carry Step's fingerprint but do not decode as Step)."""
    cfg = BroadcastConfig(timeout_s=60.0)
    out: dict[str, Any] = {}
    with CpuTpBroadcaster(
        rank, world, f"typed-{how}-{backend}", backend=backend, base_dir=base, init_timeout_s=60, config=cfg
    ) as b:
        if rank == 0:
            if how == "forged":
                b._codec(list[int]).fingerprint = b._codec(Step).fingerprint  # a peer that lies about its schema
                b.broadcast_object([1, 2, 3], schema=list[int])
            else:
                b.broadcast_object(step(3), schema=Step)
            return out
        try:
            b.broadcast_object(None, schema=LookAlike if how == "other_schema" else Step)
        except Exception as exc:  # the test checks which
            out["error"] = f"{type(exc).__name__}: {exc}"
    return out
