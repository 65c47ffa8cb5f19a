"""``python -m tensorwire.bench drain [--runs 20] [--save]``: SIGTERM a ``serve-encoder`` while RDMA fetches run.

Per run: start ``serve-encoder`` (a real process, RDMA on), open a health Watch, run ``--threads`` closed-loop
fetchers (RDMA plane) against it, and one *held* fetch whose RDMA read is held back by the client's observer
until after the server's drain period: it has its receipt (its lease is exported) when SIGTERM arrives and reads
only once the server refuses new work, which is when the old stop sequence had already closed the exporter.
While the server stops, health ``Check`` is polled. Then the run records:

- ``in_flight_failed``: fetches started before SIGTERM (the held one included) that did not succeed: must be 0;
- ``held_ok`` / ``held_plane``: the held fetch succeeded over RDMA (its lease outlived the stop of new work);
- ``not_serving_seen_s``: when ``Check`` first answered NOT_SERVING after SIGTERM (None: never);
- ``watch_ended_s``: when the open Watch call ended after SIGTERM (None: it held on until the process died);
- ``drain_served``: fetches started in the drain period that succeeded (the server still served then);
- ``refused``: the outcomes of later fetches, counted: a typed error (the server refuses new work, which is what
  a client sees behind no proxy; behind a proxy they go to another worker), or ``ok`` for one that reached the
  server in the moment between the end of the drain period and its refusing;
- ``exit_code`` (0) and ``stop_s``: SIGTERM to exit; less than drain + grace when the leases came back early.

The summary counts runs and failed in-flight fetches over all runs (target: 0 in 20 runs).
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import signal
import tempfile
import threading
import time
from collections import Counter
from pathlib import Path
from typing import Any

# A held read waits this long past the end of the drain period: the server refuses new work by then.
HOLD_PAST_DRAIN_S = 0.5


def run_once(
    *,
    threads: int = 3,
    drain_s: float = 2.0,
    grace_s: float = 10.0,
    warm: int = 4,
    log_dir: Path | None = None,
    startup_timeout_s: float = 120.0,
) -> dict[str, Any]:
    """One SIGTERM-during-fetches run (module docstring); returns its record."""
    import grpc
    from grpc_health.v1 import health_pb2
    from prometheus_client import CollectorRegistry

    from tensorwire.encoder import sample_paths
    from tensorwire.errors import TensorwireError
    from tensorwire.mm import MultimodalInput, RemoteOutputTransport, TransportConfig, metrics_for, wire
    from tensorwire.service._child import Child

    log_dir = log_dir or Path(tempfile.mkdtemp(prefix="tensorwire-drain-"))
    argv = [
        "serve-encoder",
        "--port",
        "0",
        "--metrics-port",
        "-1",
        "--wait-exporter-s",
        "30",
        "--grace-s",
        str(grace_s),
    ]
    if drain_s > 0:
        argv += ["--drain-s", str(drain_s)]
    server = Child("encoder", argv, log_dir)
    image = sample_paths()[0].read_bytes()
    record: dict[str, Any] = {"drain_s": drain_s, "grace_s": grace_s, "threads": threads}
    fetches: list[dict[str, Any]] = []
    lock = threading.Lock()
    stop = threading.Event()
    at_read, go = threading.Event(), threading.Event()
    holder: list[int] = []  # the thread id whose next read is held
    sigterm_at: list[float] = []
    channel = client = None
    try:
        endpoint = server.ready(startup_timeout_s)["grpc"]

        def observer(event: str, _details: dict[str, Any]) -> None:
            if event == "read" and holder and threading.get_ident() == holder[0]:
                at_read.set()
                go.wait(drain_s + grace_s + 30.0)

        cfg = dataclasses.replace(
            TransportConfig.from_env(os.environ), mode="auto", local_placement_bytes=0
        )  # held leases are what a drain must wait for
        client = RemoteOutputTransport(endpoint, cfg, observer=observer, metrics=metrics_for(CollectorRegistry()))
        record["rdma_ready"] = client.wait_ready(30.0)

        def fetch(tag: str) -> dict[str, Any]:
            t0 = time.monotonic()
            row: dict[str, Any] = {"tag": tag, "t0": t0}
            try:
                out = client.fetch([MultimodalInput(image)], timeout_ms=30_000)
                row.update(
                    ok=True, plane=out.plane.value, fallback=out.fallback_reason.value if out.fallback_reason else None
                )
            except TensorwireError as exc:
                row.update(ok=False, error=f"{type(exc).__name__}:{exc.reason.value}", message=str(exc)[:300])
            row["t1"] = time.monotonic()
            with lock:
                fetches.append(row)
            return row

        for _ in range(warm):
            fetch("warm")

        def loop() -> None:
            while not stop.is_set():
                if not fetch("loop")["ok"]:
                    stop.wait(0.05)  # a refused client backs off, as a serving loop would

        def held() -> None:
            holder.append(threading.get_ident())
            fetch("held")

        workers = [threading.Thread(target=loop, name=f"drain-fetch-{i}", daemon=True) for i in range(threads)]
        for t in workers:
            t.start()
        held_thread = threading.Thread(target=held, name="drain-held", daemon=True)
        held_thread.start()
        if not at_read.wait(60.0):
            raise RuntimeError("the held fetch never reached its RDMA read (is the RDMA plane up?)")

        channel = grpc.insecure_channel(endpoint)
        request = health_pb2.HealthCheckRequest(service=wire.SERVICE_NAME)
        check = channel.unary_unary(
            "/grpc.health.v1.Health/Check",
            request_serializer=health_pb2.HealthCheckRequest.SerializeToString,
            response_deserializer=health_pb2.HealthCheckResponse.FromString,
        )
        watch = channel.unary_stream(
            "/grpc.health.v1.Health/Watch",
            request_serializer=health_pb2.HealthCheckRequest.SerializeToString,
            response_deserializer=health_pb2.HealthCheckResponse.FromString,
        )(request, timeout=drain_s + grace_s + 30)
        watched: list[tuple[float, str]] = []

        def follow_watch() -> None:
            try:
                for msg in watch:
                    watched.append((time.monotonic(), health_pb2.HealthCheckResponse.ServingStatus.Name(msg.status)))
            except grpc.RpcError as exc:
                watched.append((time.monotonic(), f"ended:{exc.code().name}"))
            else:
                watched.append((time.monotonic(), "ended:OK"))

        watcher = threading.Thread(target=follow_watch, name="drain-watch", daemon=True)
        watcher.start()
        t_sig = time.monotonic()
        sigterm_at.append(t_sig)
        server.proc.send_signal(signal.SIGTERM)
        checks: list[tuple[float, str]] = []
        release_at = t_sig + drain_s + HOLD_PAST_DRAIN_S
        deadline = t_sig + drain_s + grace_s + 15.0
        while server.proc.poll() is None and time.monotonic() < deadline:
            try:
                status = check(request, timeout=1.0).status
                checks.append((time.monotonic(), health_pb2.HealthCheckResponse.ServingStatus.Name(status)))
            except grpc.RpcError as exc:
                checks.append((time.monotonic(), f"error:{exc.code().name}"))
            if not go.is_set() and time.monotonic() >= release_at:
                go.set()
            time.sleep(0.1)
        go.set()
        exit_code = server.proc.wait(max(1.0, deadline - time.monotonic()))
        t_exit = time.monotonic()
        stop.set()
        held_thread.join(40)
        for t in workers:
            t.join(40)
        watcher.join(5)
        record.update(exit_code=exit_code, stop_s=round(t_exit - t_sig, 3))
        record.update(_judge(fetches, t_sig, drain_s, checks, watched))
    finally:
        stop.set()
        go.set()
        if channel is not None:
            channel.close()
        if client is not None:
            client.close()
        server.terminate(grace_s=5.0)
    return record


def _judge(
    fetches: list[dict[str, Any]],
    t_sig: float,
    drain_s: float,
    checks: list[tuple[float, str]],
    watched: list[tuple[float, str]],
) -> dict[str, Any]:
    in_flight = [f for f in fetches if f["t0"] < t_sig and f["tag"] != "warm"]
    failed = [f for f in in_flight if not f["ok"]]
    held = next((f for f in fetches if f["tag"] == "held"), None)
    during = [f for f in fetches if t_sig <= f["t0"] < t_sig + drain_s]
    later = [f for f in fetches if f["t0"] >= t_sig + drain_s]
    not_serving = next((t for t, s in checks if s == "NOT_SERVING"), None)
    ended = next((t for t, s in watched if s.startswith("ended")), None)
    return {
        "in_flight": len(in_flight),
        "in_flight_failed": len(failed),
        "in_flight_failures": [{k: f.get(k) for k in ("tag", "error", "message")} for f in failed][:5],
        "held_ok": bool(held and held["ok"]),
        "held_plane": held.get("plane") if held else None,
        "in_flight_planes": dict(Counter(f.get("plane", "failed") for f in in_flight)),
        "drain_started": len(during),
        "drain_served": sum(1 for f in during if f["ok"]),
        "drain_failed": [f.get("error") for f in during if not f["ok"]][:5],
        "after_drain": len(later),
        "refused": dict(Counter(f.get("error", "ok") for f in later)),
        "not_serving_seen_s": None if not_serving is None else round(not_serving - t_sig, 3),
        "check_answers": dict(Counter(s for _, s in checks)),
        "watch": [s for _, s in watched],
        "watch_ended_s": None if ended is None else round(ended - t_sig, 3),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tensorwire.bench drain", description=__doc__.split("\n")[0])
    parser.add_argument("--runs", type=int, default=20)
    parser.add_argument("--threads", type=int, default=3, help="closed-loop fetchers besides the held one")
    parser.add_argument(
        "--drain-s", type=float, default=2.0, help="the server's --drain-s (default: 2, as serve-encoder)"
    )
    parser.add_argument("--grace-s", type=float, default=10.0)
    parser.add_argument(
        "--save",
        nargs="?",
        const="",
        default=None,
        metavar="PATH",
        help="write the JSON (default path: benchmarks/results/drain-<machine>.json)",
    )
    args = parser.parse_args(argv)
    os.environ.setdefault("UCX_NET_DEVICES", "lo")
    runs = []
    t0 = time.monotonic()
    from tensorwire.service._runtime import stdout_to_stderr

    for i in range(args.runs):
        with stdout_to_stderr():  # UCX prints its protocol tables to fd 1
            r = run_once(threads=args.threads, drain_s=args.drain_s, grace_s=args.grace_s)
        runs.append(r)
        print(
            f"run {i + 1}/{args.runs}: in flight {r['in_flight']} (failed {r['in_flight_failed']}), held "
            f"{r['held_plane'] if r['held_ok'] else 'FAILED'}, NOT_SERVING after {r['not_serving_seen_s']} s, "
            f"watch ended after {r['watch_ended_s']} s, drain served {r['drain_served']}/{r['drain_started']}, "
            f"refused {r['refused']}, exit {r['exit_code']} after {r['stop_s']} s",
            flush=True,
        )
    summary = {
        "runs": len(runs),
        "in_flight_fetches": sum(r["in_flight"] for r in runs),
        "in_flight_failed": sum(r["in_flight_failed"] for r in runs),
        "held_ok_over_rdma": sum(1 for r in runs if r["held_ok"] and r["held_plane"] == "rdma"),
        "not_serving_seen": sum(1 for r in runs if r["not_serving_seen_s"] is not None),
        "watch_ended": sum(1 for r in runs if r["watch_ended_s"] is not None),
        "clean_exits": sum(1 for r in runs if r["exit_code"] == 0),
        "stop_s_max": max((r["stop_s"] for r in runs), default=None),
        "wall_s": round(time.monotonic() - t0, 1),
    }
    print(f"summary: {summary}")
    if args.save is not None:
        from tensorwire.bench._common import write_result

        path = write_result("drain", {"config": vars(args), "summary": summary, "runs": runs}, out=args.save or None)
        print(f"wrote {path}")
    ok = summary["in_flight_failed"] == 0 and summary["clean_exits"] == len(runs)
    return 0 if ok else 1


__all__ = ["run_once", "main"]
