"""``python -m tensorwire.bench router``: the EPD router against what users run instead, with stand-in instances.

    python -m tensorwire.bench router [--seconds 1] [--repeats 5] [--old-src DIR] [--out FILE] [--skip SCENARIO ...]

Stand-in ``vllm serve`` instances (``_router.upstream``: processes answering at once, plain JSON or SSE-streamed)
leave only the proxy in front measured. In the same run, side by side, taking turns in short slices:

- ``direct``: the client talks to the LLM stand-in itself (the floor);
- ``tensorwire``: ``python -m tensorwire.integrations.vllm_router``;
- ``fastapi``: FastAPI + aiohttp proxy of the shape of vLLM's example EPD proxy (``_router.fastapi_proxy``);
- ``stdlib_old``: the ``http.server`` router, run from an older tensorwire tree (``--old-src DIR``: its ``src``).

Scenarios (each bounded; loopback only):

- ``closed_loop``: c = 1 / 16 / 64 / 256 connections, each sending a chat request with an image (encoder
  stand-in, then LLM stand-in) as soon as its previous answer ended, plain and streamed (8 SSE events). Per
  concurrency the proxies take turns, ``--repeats`` times, in slices of ``--warmup`` + a measured window, plain
  and streamed alternating (the order rotated each repeat). A window lasts ``--seconds``, longer until c x
  ``--waves`` answers ended in it (at c=256 one answer can take longer than a second on a busy box). A slice's
  answers that ended in its window give p50/p99 latency (and first body byte for streams) and throughput (their
  number over the window); the proxy's CPU per answer, the client's CPU, threads, RSS and the load average go
  with it. A cell's figures are medians over its repeats,
  with their spread (min, max); the ratios pair tensorwire's and the FastAPI proxy's slices of the same repeat;
- ``idle_loris``: 1,000 idle keep-alive connections and 1,000 slow-loris connections (headers trickled a line a
  second) against each proxy; c=1 requests before and during; how many of the 2,000 each proxy closed within
  its idle timeout + 5 s; threads and RSS;
- ``sigterm``: 20 times: a fresh router, 3 streams under way (20 events 50 ms apart), SIGTERM; answers cut, exit
  codes;
- ``hung_encoder``: two encoder stand-ins, one accepting and never answering; c=16 for 10 s; p99 against the
  first-byte timeout (1 s) + 1 s; the FastAPI proxy for comparison (its requests to the hung one wait for the
  client's 10 s timeout).

The closed loop's client (``_router.client``) is one process of its own for the whole run, the same for every
proxy: a raw asyncio HTTP/1.1 client (keep-alive, one request at a time per connection; uvloop when installed)
that drives the stand-in directly (``direct``) many times faster than through any proxy, so it is not what limits
a proxy's figures. Each proxy is one process with one event loop (uvicorn: one worker). The other scenarios run
their client in this process. On a 2-core box everything shares the two cores (client, proxy, stand-ins, and
whatever else runs): the numbers compare proxies in the same conditions; they are not the proxies' capacity.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, cast

from tensorwire.bench._common import write_result
from tensorwire.bench._router.client import chat as _chat
from tensorwire.bench._router.client import closed_loop
from tensorwire.bench._router.client import connect as _open
from tensorwire.bench._router.client import loop_name as _loop_name
from tensorwire.bench._router.client import run as _run

PROXIES = ("direct", "tensorwire", "fastapi", "stdlib_old", "tensorwire_asyncio")
CONCURRENCY = (1, 16, 64, 256)
SRC = Path(__file__).resolve().parents[2]


# -- processes -------------------------------------------------------------------------------------------------


@dataclass
class Proc:
    name: str
    popen: subprocess.Popen[str]
    port: int

    def cpu_s(self) -> float:
        """User + system CPU seconds this process has used so far."""
        try:
            fields = Path(f"/proc/{self.popen.pid}/stat").read_text().rsplit(")", 1)[1].split()
            return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
        except (OSError, IndexError, ValueError):
            return 0.0

    def stats(self) -> dict[str, float]:
        out: dict[str, float] = {}
        try:
            for line in Path(f"/proc/{self.popen.pid}/status").read_text().splitlines():
                if line.startswith("Threads:"):
                    out["threads"] = int(line.split()[1])
                elif line.startswith("VmRSS:"):
                    out["rss_mb"] = int(line.split()[1]) / 1024
        except OSError:
            pass
        return out

    def stop(self) -> int | None:
        if self.popen.poll() is None:
            self.popen.kill()
        try:
            return self.popen.wait(timeout=30)
        except subprocess.TimeoutExpired:
            return None
        finally:
            if self.popen.stdout is not None:
                self.popen.stdout.close()


def _spawn(name: str, argv: list[str], src: Path = SRC, marker: str = "PORT ") -> Proc:
    env = dict(os.environ, PYTHONPATH=str(src))
    stderr = None if os.environ.get("BENCH_ROUTER_STDERR") else subprocess.DEVNULL  # 1: the proxies' logs show
    popen = subprocess.Popen(
        [sys.executable, *argv], stdout=subprocess.PIPE, stderr=stderr, text=True, env=env, stdin=subprocess.DEVNULL
    )
    assert popen.stdout is not None
    deadline = time.monotonic() + 90
    while time.monotonic() < deadline:
        line = popen.stdout.readline()
        if not line:
            raise RuntimeError(f"{name} exited before listening (code {popen.wait()})")
        if marker in line:
            return Proc(name, popen, int(line.strip().rsplit(":" if marker != "PORT " else " ", 1)[1]))
    popen.kill()
    raise RuntimeError(f"{name} did not listen within 90 s")


def _wait_health(proc: Proc, timeout_s: float = 60.0) -> Proc:
    """Until ``GET /health`` answers 200 (uvicorn prints nothing once serving; the router's probes start)."""
    import http.client

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            conn = http.client.HTTPConnection("127.0.0.1", proc.port, timeout=5)
            conn.request("GET", "/health")
            if conn.getresponse().status == 200:
                conn.close()
                return proc
            conn.close()
        except OSError:
            pass
        time.sleep(0.05)
    raise RuntimeError(f"{proc.name} did not answer /health within {timeout_s:g} s")


def _upstream(*extra: str) -> Proc:
    return _spawn("upstream", ["-m", "tensorwire.bench._router.upstream", "--port", "0", *extra])


def _proxy(kind: str, encoders: list[int], llm: int, old_src: Path | None, *extra: str) -> Proc | None:
    enc = [a for p in encoders for a in ("--encoder", f"http://127.0.0.1:{p}")]
    if kind == "tensorwire_asyncio":  # the router on asyncio's event loop, whether or not uvloop is installed
        return _proxy("tensorwire", encoders, llm, old_src, "--loop", "asyncio", *extra)
    if kind == "tensorwire":
        return _wait_health(
            _spawn(
                kind,
                [
                    "-m",
                    "tensorwire.integrations.vllm_router",
                    "--port",
                    "0",
                    *enc,
                    "--llm",
                    f"http://127.0.0.1:{llm}",
                    "--log-level",
                    "WARNING",
                    *extra,
                ],
                marker="listening on",
            )
        )
    if kind == "fastapi":
        return _wait_health(
            _spawn(
                kind,
                [
                    "-m",
                    "tensorwire.bench._router.fastapi_proxy",
                    "--port",
                    "0",
                    *enc,
                    "--llm",
                    f"http://127.0.0.1:{llm}",
                ],
            )
        )
    if kind == "stdlib_old" and old_src is not None:
        return _spawn(
            kind,
            [
                "-m",
                "tensorwire.integrations.vllm_router",
                "--port",
                "0",
                *enc,
                "--llm",
                f"http://127.0.0.1:{llm}",
                "--log-level",
                "WARNING",
            ],
            src=old_src,
            marker="listening on",
        )
    return None


# -- the load generator ----------------------------------------------------------------------------------------


class _Client:
    """The load generator (``_router.client``) in a process of its own, the same one for every slice of the run."""

    def __init__(self) -> None:
        env = dict(os.environ, PYTHONPATH=str(SRC))
        self.popen = subprocess.Popen(
            [sys.executable, "-m", "tensorwire.bench._router.client"],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            env=env,
        )

    def slice(self, port: int, stream: bool, c: int, seconds: float, warmup: float, waves: int) -> dict[str, Any]:
        assert self.popen.stdin is not None and self.popen.stdout is not None
        cmd = {"port": port, "stream": stream, "c": c, "seconds": seconds, "warmup": warmup, "waves": waves}
        self.popen.stdin.write(json.dumps(cmd) + "\n")
        self.popen.stdin.flush()
        line = self.popen.stdout.readline()
        if not line:
            raise RuntimeError(f"the load generator exited (code {self.popen.wait()})")
        return cast(dict[str, Any], json.loads(line))

    def close(self) -> None:
        for f in (self.popen.stdin, self.popen.stdout):
            if f is not None:
                f.close()
        try:
            self.popen.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.popen.kill()
            self.popen.wait()


# -- scenarios -------------------------------------------------------------------------------------------------


def scenario_closed_loop(args: argparse.Namespace, kinds: list[str]) -> list[dict[str, Any]]:
    """Every slice: (c, repeat, mode, proxy). Per concurrency, the proxies take turns in short slices, plain and
    streamed alternating, the order rotated each repeat, so that a burst of load from the neighbours lands on all
    of them (and on both modes) alike."""
    enc, llm = _upstream(), _upstream()
    procs = {k: _proxy(k, [enc.port], llm.port, args.old_src) for k in kinds if k != "direct"}
    ports = {"direct": llm.port, **{k: p.port for k, p in procs.items() if p is not None}}
    order = list(ports)
    client = _Client()
    slices = []
    try:
        for c in args.concurrency:
            for rep in range(args.repeats):
                for mode in ("plain", "stream"):
                    for kind in order[rep % len(order) :] + order[: rep % len(order)]:
                        proc = procs.get(kind)
                        cpu0 = proc.cpu_s() if proc else 0.0
                        load = os.getloadavg()[0]
                        row = client.slice(ports[kind], mode == "stream", c, args.seconds, args.warmup, args.waves)
                        # CPU the proxy spent per answer (warm-up included in both): robust on a busy box, where
                        # latency and throughput also measure the neighbours.
                        served = row["n"] * (row["window_s"] + args.warmup) / row["window_s"]
                        row["proxy_cpu_ms_per_request"] = (
                            ((proc.cpu_s() - cpu0) * 1e3 / served) if proc and served else None
                        )
                        row.update(
                            {"proxy": kind, "mode": mode, "c": c, "repeat": rep, "load_1m": load}
                            | (proc.stats() if proc else {})
                        )
                        slices.append(row)
            for cell in _cells([r for r in slices if r["c"] == c]):
                print(
                    f"  {cell['mode']:6} c={c:<4} {cell['proxy']:11} p50 {cell['p50_ms'] or 0:8.2f} ms  p99 "
                    f"{cell['p99_ms'] or 0:8.2f} ms  {cell['rps']:7.0f}/s ({cell['rps_min']:.0f}-"
                    f"{cell['rps_max']:.0f})  err {cell['errors']:3}  cpu/req "
                    f"{cell['proxy_cpu_ms_per_request'] or 0:6.3f} ms  client {cell['client_cores']:.2f} "
                    f"cores  threads {cell.get('threads', '-')}  rss {cell.get('rss_mb', 0):.0f} MB  "
                    f"load {cell['load_1m']:.1f}",
                    flush=True,
                )
    finally:
        client.close()
        for p in (*procs.values(), enc, llm):
            if p is not None:
                p.stop()
    return slices


def _median(values: list[Any]) -> float | None:
    got = [v for v in values if v is not None]
    return statistics.median(got) if got else None


def _cells(slices: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per (proxy, mode, c): medians over the repeats, with the spread (min, max) of throughput, p50 and p99."""
    out = []
    keys = sorted({(r["mode"], r["c"], r["proxy"]) for r in slices}, key=lambda k: (k[0], k[1], PROXIES.index(k[2])))
    for mode, c, proxy in keys:
        rows = [r for r in slices if (r["mode"], r["c"], r["proxy"]) == (mode, c, proxy)]
        cell: dict[str, Any] = {"proxy": proxy, "mode": mode, "c": c, "repeats": len(rows)}
        cell["n"] = sum(r["n"] for r in rows)
        cell["errors"] = sum(r["errors"] for r in rows)
        for k in ("rps", "p50_ms", "p99_ms", "max_ms", "first_byte_p50_ms", "first_byte_p99_ms"):
            cell[k] = _median([r[k] for r in rows])
        for k in ("rps", "p50_ms", "p99_ms"):
            got = [r[k] for r in rows if r[k] is not None]
            cell[k.replace("_ms", "") + "_min" + ("_ms" if k != "rps" else "")] = min(got) if got else None
            cell[k.replace("_ms", "") + "_max" + ("_ms" if k != "rps" else "")] = max(got) if got else None
        cell["proxy_cpu_ms_per_request"] = _median([r["proxy_cpu_ms_per_request"] for r in rows])
        cell["client_cores"] = _median([r["client_cpu_s"] / r["client_wall_s"] for r in rows]) or 0.0
        cell["client_cpu_ms_per_request"] = _median(
            [r["client_cpu_s"] * 1e3 / r["n"] if r["n"] else None for r in rows]
        )
        cell["load_1m"] = _median([r["load_1m"] for r in rows]) or 0.0
        for k in ("threads", "rss_mb"):
            if k in rows[-1]:
                cell[k] = rows[-1][k]
        out.append(cell)
    return out


def _spread(values: list[float]) -> dict[str, float | None]:
    return {
        "median": _median(values),
        "min": min(values) if values else None,
        "max": max(values) if values else None,
    }


def _ratios(slices: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per (mode, c), tensorwire against the FastAPI proxy, paired repeat by repeat (the two ran seconds apart):
    the median ratio and its spread; the overhead over ``direct`` the same way. ``*_met``: the target holds at
    the median."""
    out = []
    for mode in ("plain", "stream"):
        for c in sorted({r["c"] for r in slices}):
            reps: dict[int, dict[str, dict[str, Any]]] = {}
            for r in slices:
                if r["mode"] == mode and r["c"] == c:
                    reps.setdefault(r["repeat"], {})[r["proxy"]] = r
            entry: dict[str, Any] = {"mode": mode, "c": c}
            pairs = [(p["tensorwire"], p["fastapi"]) for p in reps.values() if "tensorwire" in p and "fastapi" in p]
            tput = [tw["rps"] / fa["rps"] for tw, fa in pairs if fa["rps"]]
            p99 = [tw["p99_ms"] / fa["p99_ms"] for tw, fa in pairs if tw["p99_ms"] and fa["p99_ms"]]
            if tput:
                entry["throughput_tensorwire_over_fastapi"] = _spread(tput)
                entry["throughput_met"] = bool(statistics.median(tput) >= 1.0)
            if p99:
                entry["p99_tensorwire_over_fastapi"] = _spread(p99)
                entry["p99_met"] = bool(statistics.median(p99) <= 1.0)
            for kind in ("tensorwire", "fastapi", "stdlib_old"):
                over = [
                    p[kind]["p50_ms"] - p["direct"]["p50_ms"]
                    for p in reps.values()
                    if kind in p and "direct" in p and p[kind]["p50_ms"] and p["direct"]["p50_ms"]
                ]
                if over:
                    entry[f"overhead_p50_ms_{kind}"] = _spread(over)
            out.append(entry)
    return out


async def _idle_and_loris(port: int, n: int) -> tuple[list[Any], list[Any]]:
    idle, loris = [], []
    for _ in range(n):
        r, w = await asyncio.open_connection("127.0.0.1", port)
        w.write(b"GET /health HTTP/1.1\r\nHost: bench\r\n\r\n")
        idle.append((r, w))
    for r, _ in idle:
        try:
            await asyncio.wait_for(r.readuntil(b"\r\n\r\n"), 30)
        except (TimeoutError, asyncio.IncompleteReadError, OSError):
            pass
    for _ in range(n):
        try:
            r, w = await asyncio.open_connection("127.0.0.1", port)
        except OSError:
            continue
        w.write(b"POST /v1/chat/completions HTTP/1.1\r\nHost: bench\r\n")
        loris.append((r, w))
    return idle, loris


async def _count_closed(conns: list[Any], within_s: float) -> int:
    async def closed(r: asyncio.StreamReader) -> bool:
        try:
            while await asyncio.wait_for(r.read(65536), within_s):
                pass
            return True
        except (TimeoutError, OSError):
            return False

    results = await asyncio.gather(*(closed(r) for r, _ in conns))
    return sum(results)


async def _trickle(conns: list[Any], stop: asyncio.Event) -> None:
    i = 0
    while not stop.is_set():
        for _, w in conns:
            if not w.is_closing():
                w.write(b"X-Slow-%d: 1\r\n" % i)
        i += 1
        try:
            await asyncio.wait_for(stop.wait(), 1.0)
        except TimeoutError:
            pass


async def _idle_loris_run(
    port: int, n: int, request: bytes, seconds: float, idle_s: float, proc: Proc
) -> dict[str, Any]:
    before = await closed_loop(port, request, 1, seconds)
    base = proc.stats()
    t_open = time.monotonic()
    idle, loris = await _idle_and_loris(port, n)
    stop = asyncio.Event()
    trickle = asyncio.create_task(_trickle(loris, stop))
    during = await closed_loop(port, request, 1, seconds)
    loaded = proc.stats()
    left_s = max(0.5, idle_s + 5 - (time.monotonic() - t_open))
    idle_closed, loris_closed = await asyncio.gather(_count_closed(idle, left_s), _count_closed(loris, left_s))
    stop.set()
    await trickle
    for _, w in (*idle, *loris):
        w.transport.abort()
    return {
        "connections": {"idle": len(idle), "slow_loris": len(loris)},
        "unloaded": before,
        "loaded": during,
        "p99_ratio_loaded_to_unloaded": (during["p99_ms"] or 0) / (before["p99_ms"] or 1),
        "closed_within_idle_timeout_plus_5s": {"idle": idle_closed, "slow_loris": loris_closed},
        "idle_timeout_s": idle_s,
        "proxy_before": base,
        "proxy_loaded": loaded,
    }


def scenario_idle_loris(args: argparse.Namespace, kinds: list[str]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for kind in kinds:
        if kind in ("direct", "stdlib_old"):
            continue
        enc, llm = _upstream(), _upstream()
        idle_s = 5.0 if kind == "tensorwire" else 5.0  # uvicorn's keep-alive timeout is 5 s by default
        proc = _proxy(
            kind, [enc.port], llm.port, None, *(("--idle-timeout-s", str(idle_s)) if kind == "tensorwire" else ())
        )
        assert proc is not None
        try:
            out[kind] = _run(
                _idle_loris_run(proc.port, args.idle_connections, _chat(False), max(args.seconds, 3.0), idle_s, proc)
            )
        finally:
            for p in (proc, enc, llm):
                p.stop()
        r = out[kind]
        print(
            f"  idle_loris {kind:10} p99 unloaded {r['unloaded']['p99_ms'] or 0:.2f} ms, loaded "
            f"{r['loaded']['p99_ms'] or 0:.2f} ms ({r['p99_ratio_loaded_to_unloaded']:.2f}x); closed "
            f"{r['closed_within_idle_timeout_plus_5s']}; threads {r['proxy_loaded'].get('threads')}, rss "
            f"{r['proxy_before'].get('rss_mb', 0):.0f} -> {r['proxy_loaded'].get('rss_mb', 0):.0f} MB",
            flush=True,
        )
    return out


async def _streams_then_term(port: int, pid: int, streams: int) -> list[bool]:
    request = _chat(True)
    conns = [await _open(port) for _ in range(streams)]
    asks = [asyncio.ensure_future(c.ask(request)) for c in conns]
    deadline = time.monotonic() + 30
    while not all(c.first for c in conns) and time.monotonic() < deadline:
        await asyncio.sleep(0.005)
    os.kill(pid, signal.SIGTERM)
    whole = []
    for c, a in zip(conns, asks, strict=True):
        try:
            status, _, _ = await asyncio.wait_for(a, 60)
            whole.append(status == 200 and b"data: [DONE]" in c.buf and c.buf.endswith(b"0\r\n\r\n"))
        except (ConnectionError, TimeoutError):
            whole.append(False)
        if c.transport is not None:
            c.transport.close()
    return whole


def scenario_sigterm(args: argparse.Namespace) -> dict[str, Any]:
    enc, llm = _upstream(), _upstream("--events", "20", "--event-delay-ms", "50")
    cut = complete = 0
    codes = []
    try:
        for _ in range(args.sigterms):
            proc = _proxy("tensorwire", [enc.port], llm.port, None, "--drain-s", "0", "--grace-s", "30")
            assert proc is not None
            whole = _run(_streams_then_term(proc.port, proc.popen.pid, 3))
            codes.append(proc.popen.wait(timeout=60))
            proc.stop()
            complete += sum(whole)
            cut += len(whole) - sum(whole)
    finally:
        enc.stop()
        llm.stop()
    print(
        f"  sigterm: {len(codes)} SIGTERMs, {complete} streams complete, {cut} cut, exit codes {sorted(set(codes))}",
        flush=True,
    )
    return {"sigterms": len(codes), "streams_complete": complete, "streams_cut": cut, "exit_codes": codes}


def scenario_hung_encoder(args: argparse.Namespace, kinds: list[str]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    first_byte_s = 1.0
    for kind in ("tensorwire", "fastapi"):
        if kind not in kinds:
            continue
        hung, good, llm = _upstream("--hang"), _upstream(), _upstream()
        proc = _proxy(
            kind,
            [hung.port, good.port],
            llm.port,
            None,
            *(
                ("--encoder-first-byte-timeout-s", str(first_byte_s), "--probe-timeout-s", "1")
                if kind == "tensorwire"
                else ()
            ),
        )
        assert proc is not None
        try:
            row = _run(closed_loop(proc.port, _chat(False), 16, args.hung_seconds, timeout_s=10.0))
        finally:
            for p in (proc, hung, good, llm):
                p.stop()
        row["target_p99_ms"] = (first_byte_s + 1.0) * 1e3 if kind == "tensorwire" else None
        out[kind] = row
        print(
            f"  hung_encoder {kind:10} p50 {row['p50_ms'] or 0:.2f} ms p99 {row['p99_ms'] or 0:.2f} ms max "
            f"{row['max_ms'] or 0:.2f} ms, {row['rps']:.0f}/s, errors (10 s client timeout) {row['errors']}",
            flush=True,
        )
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m tensorwire.bench router", description=__doc__.split("\n\n")[0])
    ap.add_argument("--seconds", type=float, default=1.0, help="measured time per closed-loop slice (default 1)")
    ap.add_argument(
        "--warmup",
        type=float,
        default=0.3,
        help="seconds per closed-loop slice before measuring (connections open, pools fill; default 0.3)",
    )
    ap.add_argument(
        "--waves",
        type=int,
        default=3,
        help="a closed-loop slice's window lasts until c x this many answers ended in it (at most 10x --seconds; "
        "default 3)",
    )
    ap.add_argument(
        "--repeats",
        type=int,
        default=5,
        help="slices per proxy and cell, the proxies taking turns (default 5); figures are medians over them",
    )
    ap.add_argument("--concurrency", type=int, nargs="+", default=list(CONCURRENCY))
    ap.add_argument(
        "--old-src",
        type=Path,
        default=None,
        help="src/ of a tensorwire tree with the http.server router (adds the stdlib_old column)",
    )
    ap.add_argument("--idle-connections", type=int, default=1000, help="idle and slow-loris connections, each")
    ap.add_argument("--sigterms", type=int, default=20)
    ap.add_argument("--hung-seconds", type=float, default=10.0)
    ap.add_argument("--skip", nargs="*", default=[], choices=("closed_loop", "idle_loris", "sigterm", "hung_encoder"))
    ap.add_argument("--proxies", nargs="+", default=list(PROXIES[:4]), choices=PROXIES)
    ap.add_argument("--note", default="", help="free text stored in the JSON (e.g. how busy the machine was)")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    kinds = [k for k in args.proxies if k != "stdlib_old" or args.old_src is not None]
    try:
        import resource

        soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    except (ValueError, OSError):
        pass
    result: dict[str, Any] = {
        "note": args.note,
        "python": sys.executable,
        "proxies": kinds,
        "seconds_per_slice": args.seconds,
        "warmup_s": args.warmup,
        "repeats": args.repeats,
        "waves": args.waves,
        "loop": _loop_name(),
        "stacks": _stacks(),
        "load_average_before": os.getloadavg(),
    }
    t0 = time.monotonic()
    if "closed_loop" not in args.skip:
        print("closed loop (chat with an image: encoder stand-in, then LLM stand-in)", flush=True)
        slices = scenario_closed_loop(args, kinds)
        result["closed_loop"] = _cells(slices)
        result["ratios"] = _ratios(slices)
        result["closed_loop_slices"] = slices
        for entry in result["ratios"]:
            print("  " + _ratio_line(entry), flush=True)
    if "idle_loris" not in args.skip:
        print(f"{args.idle_connections} idle keep-alive + {args.idle_connections} slow-loris connections", flush=True)
        result["idle_loris"] = scenario_idle_loris(args, kinds)
    if "sigterm" not in args.skip:
        print(f"{args.sigterms} SIGTERMs during streamed answers", flush=True)
        result["sigterm"] = scenario_sigterm(args)
    if "hung_encoder" not in args.skip:
        print("one hung encoder of two", flush=True)
        result["hung_encoder"] = scenario_hung_encoder(args, kinds)
    result["wall_s"] = time.monotonic() - t0
    result["load_average_after"] = os.getloadavg()
    path = write_result("router", result, args.out)
    print(f"wrote {path}")
    return 0


def _ratio_line(entry: dict[str, Any]) -> str:
    def f(key: str, fmt: str = ".2f") -> str:
        s = entry.get(key)
        return "-" if s is None else f"{s['median']:{fmt}} ({s['min']:{fmt}}-{s['max']:{fmt}})"

    return (
        f"{entry['mode']:6} c={entry['c']:<4} throughput tw/fastapi {f('throughput_tensorwire_over_fastapi')}  "
        f"p99 tw/fastapi {f('p99_tensorwire_over_fastapi')}  overhead p50 tw {f('overhead_p50_ms_tensorwire', '.3f')} "
        f"ms, fastapi {f('overhead_p50_ms_fastapi', '.3f')} ms"
    )


def _stacks() -> dict[str, str]:
    """What each proxy runs on, with this interpreter: both get one process and one event loop."""

    def has(name: str) -> bool:
        try:
            __import__(name)
        except ImportError:
            return False
        return True

    loop = "uvloop" if has("uvloop") else "asyncio"
    return {
        "tensorwire": f"1 process, 1 event loop ({loop}); aiohttp server and client (C HTTP parser: "
        f"{'yes' if has('aiohttp._http_parser') else 'no'})",
        "fastapi": f"uvicorn, 1 worker, 1 event loop ({loop}), HTTP parser "
        f"{'httptools' if has('httptools') else 'h11'}; aiohttp client",
        "client": f"1 process of its own for the whole run ({loop}), raw asyncio protocol",
    }


if __name__ == "__main__":
    sys.exit(main())
