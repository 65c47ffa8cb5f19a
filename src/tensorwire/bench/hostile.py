"""Benchmark: a legitimate client's fetches while 50 hostile calls run against the same worker.

    python -m tensorwire.bench hostile [--tls] [--hostile 50] [--fetches 200] [--out PATH]

One real ``tensorwire serve-encoder`` process (built-in ViT, default limits) serves one legitimate LLM-side
client, which fetches a 224x224 image in a closed loop, alone (unloaded) and while ``--hostile`` hostile actors
run (loaded), in ``--rounds`` alternating rounds (so both phases see the same machine), the same number of
fetches each. The actors are split evenly over five kinds
(``tensorwire.testing.hostile``), each keeping one hostile call in flight at a time and starting the next
``--pace-ms`` after the last ended. They run in a process of their own at nice 19: they stand for machines of
their own, so their client-side CPU (building 130 MB requests, say) must not be what slows the victim on a small
box; the server's work for every hostile call is fully there.

- ``idle_stream``: EncodeStreams that send nothing, or one release and then nothing, held open;
- ``unsent_body``: unary Encodes whose request message never comes;
- ``guessed_release``: ReleaseLeases of 64 made-up ids (near the lease ids the attacker's own fetches got);
- ``oversized``: Encodes of one item 1 MiB over the request limit, and 65 KB PNGs declaring 8192x8192 pixels,
  alternately;
- ``metadata_flood``: idle TCP connections to the worker's RDMA metadata endpoint (from a receipt).

Target: the legitimate client's fetch success stays 100% and its p99 is within 2x of its unloaded p99.
``--tls``: everything over mTLS, the attackers with a certificate of their own (authenticated but hostile);
without it everyone is plaintext on 127.0.0.1, so the attackers share the legitimate client's peer key (the
harder case for per-peer limits). Writes benchmarks/results/hostile[-tls]-<machine>.json.
"""

from __future__ import annotations

import argparse
import io
import multiprocessing as mp
import os
import sys
import tempfile
import threading
import time
from collections import Counter
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any

KINDS = ("idle_stream", "unsent_body", "guessed_release", "oversized", "metadata_flood")


def _image() -> bytes:
    import numpy as np
    from PIL import Image

    rng = np.random.default_rng(15)
    buf = io.BytesIO()
    Image.fromarray(rng.integers(0, 255, (224, 224, 3), dtype=np.uint8)).save(buf, format="JPEG", quality=90)
    return buf.getvalue()


def _percentile(xs: list[float], q: float) -> float:
    if not xs:
        return float("nan")
    s = sorted(xs)
    return s[min(len(s) - 1, int(round(q * (len(s) - 1))))]


def _summary(lat_ms: list[float], ok: int, failed: Counter[str], planes: Counter[str]) -> dict[str, Any]:
    import statistics

    n = ok + sum(failed.values())
    return {
        "fetches": n,
        "ok": ok,
        "success_rate": ok / n if n else 0.0,
        "failures": dict(failed),
        "planes": dict(planes),
        "median_ms": statistics.median(lat_ms) if lat_ms else float("nan"),
        "p90_ms": _percentile(lat_ms, 0.90),
        "p99_ms": _percentile(lat_ms, 0.99),
        "max_ms": max(lat_ms) if lat_ms else float("nan"),
        "latencies_ms": lat_ms,
    }


def _merge(parts: list[dict[str, Any]]) -> dict[str, Any]:
    lat = [x for p in parts for x in p["latencies_ms"]]
    failed: Counter[str] = Counter()
    planes: Counter[str] = Counter()
    for p in parts:
        failed.update(p["failures"])
        planes.update(p["planes"])
    out = _summary(lat, sum(p["ok"] for p in parts), failed, planes)
    out["round_p99_ms"] = [p["p99_ms"] for p in parts]
    out["slowest_stage_ms"] = sorted(
        (s for p in parts for s in p["slowest_stage_ms"]), key=lambda s: -s.get("total", 0.0)
    )[:5]
    del out["latencies_ms"]
    return out


def _fetch_loop(client: Any, image: bytes, n: int) -> dict[str, Any]:
    from tensorwire.errors import TensorwireError
    from tensorwire.mm import MultimodalInput

    lat: list[float] = []
    failed: Counter[str] = Counter()
    planes: Counter[str] = Counter()
    slowest: list[tuple[float, dict[str, float]]] = []
    ok = 0
    for _ in range(n):
        t0 = time.perf_counter()
        try:
            out = client.fetch([MultimodalInput(image)], timeout_ms=30_000)
        except TensorwireError as exc:
            failed[f"{type(exc).__name__}:{exc.reason.value}"] += 1
            continue
        ms = (time.perf_counter() - t0) * 1e3
        lat.append(ms)
        slowest = sorted([*slowest, (ms, {k: round(v, 2) for k, v in out.stage_ms.items()})], key=lambda x: -x[0])[:3]
        planes[out.plane.value] += 1
        ok += 1
    out_summary = _summary(lat, ok, failed, planes)
    out_summary["slowest_stage_ms"] = [stages for _, stages in slowest]
    return out_summary


class _Actor(threading.Thread):
    def __init__(
        self,
        kind: str,
        index: int,
        call: Callable[[], str],
        pace_s: float,
        stop: threading.Event,
        tally: Counter[str],
        lock: threading.Lock,
    ) -> None:
        super().__init__(name=f"hostile-{kind}-{index}", daemon=True)
        self.kind, self._call, self._pace_s, self._halt, self._tally, self._lock = kind, call, pace_s, stop, tally, lock

    def run(self) -> None:
        while not self._halt.is_set():
            try:
                outcome = self._call()
            except Exception as exc:
                outcome = type(exc).__name__
            with self._lock:
                self._tally[f"{self.kind}:{outcome}"] += 1
            self._halt.wait(self._pace_s)


def _attackers(
    target: str,
    tls: Any,
    seen_id: str,
    endpoint: str,
    n: int,
    pace_s: float,
    hold_s: float,
    big_bytes: int,
    commands: Any,
    out: Any,
) -> None:
    """The hostile actors, in a process of their own (nice 19). Commands: "on" starts every actor (answered
    "started"), "off" stops them and waits for their calls to end (answered "stopped"), "quit" answers
    (actors per kind, outcomes)."""
    os.nice(19)
    from tensorwire.mm import wire
    from tensorwire.testing import hostile

    tally: Counter[str] = Counter()
    lock = threading.Lock()
    bomb = hostile.pixel_bomb_png(8192)
    big = bytes(big_bytes)
    release_msg = wire.stream_frame(
        0, wire.STREAM_RELEASE_FIELD, wire.ReleaseLeasesRequest(lease_ids=["x"]).SerializeToString()
    )
    per_kind = max(1, n // len(KINDS))
    channels = {(kind, i): hostile.channel(target, tls) for kind in KINDS for i in range(per_kind)}
    kinds: Counter[str] = Counter()

    def call_for(kind: str, i: int, ch: Any, stop: threading.Event) -> Callable[[], str] | None:
        if kind == "idle_stream":
            return partial(hostile.idle_stream, ch, first=release_msg if i % 2 else None, hold_s=hold_s, stop=stop)
        if kind == "unsent_body":
            return partial(hostile.unsent_body, ch, hold_s=hold_s, stop=stop)
        if kind == "guessed_release":
            return lambda: hostile.guessed_release(ch, hostile.guess_ids(seen_id))[0]
        if kind == "oversized":
            flip = [i % 2 == 0]

            def oversized() -> str:
                flip[0] = not flip[0]
                return (
                    hostile.oversized(ch, len(big), payload=big)
                    if flip[0]
                    else "pixels:" + hostile.pixel_bomb(ch, bomb)
                )

            return oversized
        return partial(hostile.metadata_flood, endpoint, hold_s=hold_s, stop=stop) if endpoint else None

    def actors_for(stop: threading.Event) -> list[_Actor]:
        actors = []
        for (kind, i), ch in channels.items():
            call = call_for(kind, i, ch, stop)
            if call is not None:
                actors.append(_Actor(kind, i, call, pace_s, stop, tally, lock))
        return actors

    running: list[_Actor] = []
    stop = threading.Event()
    while True:
        command = commands.get()
        if command == "on":
            stop = threading.Event()
            running = actors_for(stop)
            kinds = Counter(a.kind for a in running)
            for a in running:
                a.start()
            out.put("started")
        elif command == "off":
            stop.set()
            for a in running:
                a.join(60)
            out.put("stopped")
        else:
            out.put((dict(kinds), dict(tally)))
            return


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m tensorwire.bench hostile", description=__doc__.split("\n\n")[0])
    ap.add_argument("--tls", action="store_true", help="mTLS for everyone; the attackers hold their own certificate")
    ap.add_argument("--hostile", type=int, default=50, help="hostile actors (split over the five kinds)")
    ap.add_argument("--fetches", type=int, default=200, help="legitimate fetches per phase (over all rounds)")
    ap.add_argument("--rounds", type=int, default=4, help="alternating unloaded / loaded rounds")
    ap.add_argument("--pace-ms", type=float, default=10.0, help="pause between one actor's hostile calls")
    ap.add_argument("--warmup-s", type=float, default=5.0, help="hostile load before the loaded phase is timed")
    ap.add_argument("--hold-s", type=float, default=150.0, help="how long an actor holds a stream or connection")
    ap.add_argument("--out", default=None, help="JSON path (default benchmarks/results/hostile[-tls]-<machine>.json)")
    args = ap.parse_args(argv)
    os.environ.setdefault("NIXL_LOG_LEVEL", "WARN")

    import grpc
    from prometheus_client import CollectorRegistry

    from tensorwire._grpc.tls import TlsConfig
    from tensorwire.bench._common import write_result
    from tensorwire.mm import RemoteOutputTransport, TransportConfig, metrics_for, wire
    from tensorwire.rdma import Descriptor
    from tensorwire.service._child import Child
    from tensorwire.testing import hostile
    from tensorwire.testing.pki import make_pki

    load_start = os.getloadavg()  # the machine may be shared: a loaded run says so in its JSON
    tmp = tempfile.TemporaryDirectory(prefix="tensorwire-bench-hostile-")
    llm_tls = attacker_tls = None
    argv_tls: list[str] = []
    if args.tls:
        pki = make_pki(tmp.name, ["worker", "llm", "attacker"])
        argv_tls = ["--tls-cert", str(pki["worker"].cert), "--tls-key", str(pki["worker"].key), "--tls-ca", str(pki.ca)]
        llm_tls = TlsConfig(cert=str(pki["llm"].cert), key=str(pki["llm"].key), ca=str(pki.ca))
        attacker_tls = TlsConfig(cert=str(pki["attacker"].cert), key=str(pki["attacker"].key), ca=str(pki.ca))
    worker = Child(
        "hostile-worker",
        [
            "serve-encoder",
            "--port",
            "0",
            "--metrics-port",
            "0",
            "--worker-id",
            "bench-hostile",
            "--wait-exporter-s",
            "30",
            *argv_tls,
        ],
        Path(tmp.name),
    )
    attackers = None
    try:
        ready = worker.ready(180)
        target = ready["grpc"]
        cfg = TransportConfig() if llm_tls is None else TransportConfig(tls=llm_tls)
        image = _image()
        with RemoteOutputTransport(target, cfg, metrics=metrics_for(CollectorRegistry())) as client:
            client.wait_ready(30)
            _fetch_loop(client, image, 10)  # warm: stream open, reader connected, encoder's first forward done
            # What an attacker learns from fetches of its own: a lease id (to guess near) and the metadata endpoint.
            ach = hostile.channel(target, attacker_tls)
            encode: grpc.UnaryUnaryMultiCallable[bytes, bytes] = ach.unary_unary(wire.ENCODE_METHOD)
            seen = wire.EncodeResponse.FromString(
                encode(hostile.encode_request([image], support_rdma=True), timeout=60)
            )
            seen_id, endpoint = "", ""
            if seen.rdma_slots:
                desc = Descriptor.from_bytes(seen.rdma_slots[0].descriptor)
                seen_id, endpoint = desc.lease_id, desc.owner.endpoint
                hostile.guessed_release(ach, [seen_id])  # its own: nothing of the victim's
            from tensorwire._grpc.limits import ServerLimits

            ctx = mp.get_context("spawn")
            commands, answers = ctx.Queue(), ctx.Queue()
            attackers = ctx.Process(
                target=_attackers,
                daemon=True,
                args=(
                    target,
                    attacker_tls,
                    seen_id,
                    endpoint,
                    args.hostile,
                    args.pace_ms / 1000.0,
                    args.hold_s,
                    ServerLimits().max_request_bytes + (1 << 20),
                    commands,
                    answers,
                ),
            )
            attackers.start()
            # Alternating rounds, so both phases see the same (shared, noisy) machine.
            per_round = max(1, args.fetches // args.rounds)
            phases: dict[str, list[dict[str, Any]]] = {"unloaded": [], "loaded": []}
            for rnd in range(args.rounds):
                phases["unloaded"].append(_fetch_loop(client, image, per_round))
                commands.put("on")
                if answers.get(timeout=300) != "started":
                    raise SystemExit("the attackers did not start")
                time.sleep(args.warmup_s)  # every hostile call in flight before this round's loaded phase
                phases["loaded"].append(_fetch_loop(client, image, per_round))
                commands.put("off")
                answers.get(timeout=300)
                print(
                    f"round {rnd + 1}/{args.rounds}: unloaded p99 {phases['unloaded'][-1]['p99_ms']:.1f} ms, "
                    f"loaded p99 {phases['loaded'][-1]['p99_ms']:.1f} ms, loaded ok "
                    f"{phases['loaded'][-1]['ok']}/{per_round}",
                    flush=True,
                )
            commands.put("quit")
            actors, tally = answers.get(timeout=120)
            attackers.join(30)
            unloaded, loaded = _merge(phases["unloaded"]), _merge(phases["loaded"])
            print("unloaded:", unloaded, flush=True)
            print("loaded:", loaded, flush=True)
        import urllib.request

        with urllib.request.urlopen(f"http://{ready['metrics']}/metrics", timeout=10) as resp:
            scraped = [
                line
                for line in resp.read().decode().splitlines()
                if line.startswith(
                    (
                        "tensorwire_mm_server_refused_calls_total",
                        "tensorwire_mm_encoder_released_leases_total",
                        "tensorwire_mm_fallbacks_total",
                        "tensorwire_mm_errors_total",
                    )
                )
            ]
    finally:
        if attackers is not None and attackers.is_alive():
            attackers.kill()
            attackers.join(10)
        worker.terminate(grace_s=5)
        tmp.cleanup()
    ratio = loaded["p99_ms"] / unloaded["p99_ms"]
    targets = {
        "success_rate_loaded": loaded["success_rate"],
        "p99_loaded_over_unloaded": ratio,
        "meets_success": loaded["success_rate"] == 1.0,
        "meets_p99_2x": ratio <= 2.0,
    }
    print("targets:", targets)
    path = write_result(
        "hostile-tls" if args.tls else "hostile",
        {
            "what": "one serve-encoder (builtin ViT, default limits); a legitimate client fetching a 224x224 JPEG in a "
            f"closed loop, alone and then with {sum(actors.values())} hostile actors in a process of their own at "
            f"nice 19 (each one hostile call in flight, {args.pace_ms:g} ms between calls)",
            "control_plane": "mtls (attackers with their own certificate)"
            if args.tls
            else "plaintext (attackers share the client's peer key ip:127.0.0.1)",
            "actors": actors,
            "unloaded": unloaded,
            "loaded": loaded,
            "hostile_outcomes": dict(sorted(tally.items())),
            "worker_metrics": scraped,
            "targets": targets,
            "loadavg_start": list(load_start),
            "loadavg_end": list(os.getloadavg()),
        },
        args.out,
    )
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
