"""An LLM-side client process of the soak: ``threads`` closed-loop fetchers sharing one RemoteOutputTransport.

Each output's digest is checked; results go one message per request over the child's own pipe, counters in a
RawArray the parent reads even after a SIGKILL, so a killed child wedges no lock. Fault ``reader_kill``: the
next RDMA read arms a timer that SIGKILLs the process 0-3 ms later, mid-read.
"""

from __future__ import annotations

import os
import random
import signal
import threading
import time
from typing import Any

# RawArray layout, per client: [started, finished, kill_flag]
STARTED, FINISHED, KILL = 0, 1, 2
FIELDS = 3
# A client that just failed waits this long before its next request (as a serving loop would), so an
# UNAVAILABLE window is not counted as tens of thousands of instant failures.
ERROR_BACKOFF_S = 0.05


def _child(conn: Any, counters: Any, slot: int, spec: dict[str, Any], stop: Any, env: dict[str, str]) -> None:
    if spec.get("netns"):  # first, before any thread or socket exists (tensorwire.testing.netns)
        from tensorwire.testing.netns import enter

        enter(spec["netns"])
    os.environ.update(env)
    from tensorwire._lifeline import follow_parent

    follow_parent()  # a SIGKILLed soak leaves no client behind
    os.dup2(2, 1)  # native code (UCX protocol tables) writes to fd 1; the soak's stdout is its report
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    import dataclasses
    import logging

    logging.getLogger("tensorwire").setLevel(env.get("TENSORWIRE_SOAK_CHILD_LOG_LEVEL", "ERROR"))

    from tensorwire.errors import TensorwireError
    from tensorwire.mm import MultimodalInput, RemoteOutputTransport, TransportConfig
    from tensorwire.service._runtime import drain_releases, stdout_to_stderr
    from tensorwire.soak._corpus import output_digest
    from tensorwire.soak._sample import sample, thread_names

    base = slot * FIELDS
    send_lock = threading.Lock()

    def send(msg: Any) -> None:
        with send_lock:
            conn.send(msg)

    armed = threading.Event()

    def observer(event: str, details: dict[str, Any]) -> None:
        if event == "read" and counters[base + KILL] and not armed.is_set():
            armed.set()
            threading.Timer(random.uniform(0.0, 0.003), os.kill, (os.getpid(), signal.SIGKILL)).start()

    cfg = TransportConfig.from_env(os.environ)
    cfg = dataclasses.replace(
        cfg, mode=spec["mode"], release_timeout_ms=spec["release_timeout_ms"], open_seconds=spec["breaker_open_s"]
    )
    images: list[bytes] = spec["images"]
    digests: dict[tuple[int, ...], str] = spec["digests"]
    keys = sorted(digests)
    budget_ms: int = spec["budget_ms"]
    hang_after_s = budget_ms / 1000.0 + spec["hang_grace_s"]
    inflight: dict[int, float] = {}
    inflight_lock = threading.Lock()
    hung_reported: set[int] = set()

    with stdout_to_stderr():
        transport = RemoteOutputTransport(spec["endpoint"], cfg, observer=observer)
    try:
        if spec["mode"] == "auto":
            transport.wait_ready(30.0)

        def one(rng: random.Random, tid: int) -> dict[str, Any]:
            key = keys[rng.randrange(len(keys))]
            inputs = [MultimodalInput(images[i]) for i in key]
            with inflight_lock:  # += on a RawArray is not atomic across threads
                inflight[tid] = started = time.monotonic()
                counters[base + STARTED] += 1
            t0 = time.perf_counter()
            # t0/t1 are CLOCK_MONOTONIC, the parent's clock too (one host): it places each result in its fault windows.
            res: dict[str, Any] = {"key": key, "t0": started}
            try:
                out = transport.fetch(inputs, timeout_ms=budget_ms)
            except TensorwireError as exc:
                res.update(outcome="error", kind=type(exc).__name__, reason=exc.reason.value, msg=str(exc)[:200])
            except Exception as exc:  # an untyped error is a finding; count it, keep going
                res.update(outcome="untyped", kind=type(exc).__name__, reason="untyped", msg=repr(exc)[:300])
            else:
                digest = output_digest(out.embeddings, out.position_ids)
                ok = digest == digests[key]
                res.update(
                    outcome="ok" if ok else "wrong",
                    plane=out.plane.value,
                    fallback=out.fallback_reason.value if out.fallback_reason else None,
                    worker=out.worker_id,
                    nbytes=out.payload_bytes,
                )
            finally:
                with inflight_lock:
                    inflight.pop(tid, None)
                    counters[base + FINISHED] += 1
            res["latency_ms"] = (time.perf_counter() - t0) * 1e3
            res["t1"] = time.monotonic()
            return res

        # Warm-up: fetches of every request shape; the parent checks them (before any fault for the first clients).
        warm_rng = random.Random(spec["seed"])
        warm = [one(warm_rng, -1) for _ in range(spec["warmup"])]
        send(("ready", warm))
        ready_t = time.monotonic()
        baseline: dict[str, Any] | None = None
        baseline_names: list[str] = []
        baseline_t = 0.0
        stop_lock = threading.Lock()

        def loop(tid: int) -> None:
            rng = random.Random(spec["seed"] * 1000 + tid)
            while not stop.value:
                res = one(rng, tid)
                send(("result", res))
                if res["outcome"] != "ok":
                    time.sleep(ERROR_BACKOFF_S)

        threads = [
            threading.Thread(target=loop, args=(i,), name=f"soak-client-{i}", daemon=True)
            for i in range(spec["threads"])
        ]
        for t in threads:
            t.start()
        while not stop.value:
            time.sleep(0.5)
            now = time.monotonic()
            if baseline is None and now - ready_t >= spec["ramp_s"]:
                # Steady state: pools, lazily opened connections and UCX endpoints exist by now (see _runner).
                baseline, baseline_names, baseline_t = sample(), thread_names(), now
            with inflight_lock:
                late = [tid for tid, t0 in inflight.items() if now - t0 > hang_after_s and tid not in hung_reported]
            for tid in late:
                hung_reported.add(tid)
                send(("hung", tid))
        deadline = time.monotonic() + hang_after_s
        for t in threads:
            t.join(max(0.0, deadline - time.monotonic()))
        hung = [t.name for t in threads if t.is_alive()]
        with stop_lock:
            drained = drain_releases(transport, 5.0)
        time.sleep(0.2)  # the last batch's RPC may still be in flight after pending reached 0
        end = sample()
        send(
            (
                "final",
                {
                    "baseline": baseline,
                    "baseline_t": baseline_t,
                    "end": end,
                    "hung_at_stop": len(hung),
                    "drained": drained,
                    "baseline_thread_names": baseline_names,
                    "end_thread_names": thread_names(),
                    "release_queue_dropped": _dropped(transport),
                },
            )
        )
    except (EOFError, BrokenPipeError):
        pass
    finally:
        transport.close()


def _dropped(transport: Any) -> float:
    try:
        total = 0.0
        for metric in transport.metrics.release_queue_dropped.collect():
            for s in metric.samples:
                if s.name.endswith("_total"):
                    total += s.value
        return total
    except Exception:  # a number for the report only
        return -1.0


__all__ = ["FIELDS", "STARTED", "FINISHED", "KILL"]
