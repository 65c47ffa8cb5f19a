"""``python -m tensorwire.bench router``: the EPD router against what users run instead, with stand-in instances.

    python -m tensorwire.bench router [--seconds 3] [--old-src DIR] [--out FILE] [--skip SCENARIO ...]

Stand-in ``vllm serve`` instances (``_router.upstream``: processes answering at once, plain JSON or SSE-streamed)
leave only the proxy in front measured. In the same run, side by side, interleaved per cell:

- ``direct``: the client talks to the LLM stand-in itself (the floor);
- ``tensorwire``: ``python -m tensorwire.integrations.vllm_router``;
- ``fastapi``: FastAPI + aiohttp proxy of the shape of vLLM's example EPD proxy (``_router.fastapi_proxy``);
- ``stdlib_old``: the ``http.server`` router, run from an older tensorwire tree (``--old-src DIR``: its ``src``).

Scenarios (each bounded; loopback only):

- ``closed_loop``: c = 1 / 16 / 64 / 256 connections, each sending a chat request with an image (encoder
  stand-in, then LLM stand-in) as soon as its previous answer ended, plain and streamed (8 SSE events), for
  ``--seconds`` after a ``--warmup``; the answers that ended in that window give p50/p99 latency (and first
  body byte for streams) and throughput; errors, the proxy's CPU per answer, threads and RSS;
- ``idle_loris``: 1,000 idle keep-alive connections and 1,000 slow-loris connections (headers trickled a line a
  second) against each proxy; c=1 requests before and during; how many of the 2,000 each proxy closed within
  its idle timeout + 5 s; threads and RSS;
- ``sigterm``: 20 times: a fresh router, 3 streams under way (20 events 50 ms apart), SIGTERM; answers cut, exit
  codes;
- ``hung_encoder``: two encoder stand-ins, one accepting and never answering; c=16 for 10 s; p99 against the
  first-byte timeout (1 s) + 1 s; the FastAPI proxy for comparison (its requests to the hung one wait for the
  client's 10 s timeout).

The client is an asyncio raw-HTTP/1.1 client in this process (keep-alive, one request at a time per connection;
uvloop when installed). On a 2-core box everything shares the two cores (client, proxy, stand-ins): the numbers
compare proxies in the same conditions; they are not the proxies' capacity.
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, cast

from tensorwire.bench._common import summarize, write_result

PROXIES = ("direct", "tensorwire", "fastapi", "stdlib_old")
CONCURRENCY = (1, 16, 64, 256)
SRC = Path(__file__).resolve().parents[2]


def _chat(stream: bool) -> bytes:
    image = base64.b64encode(bytes(range(256)) * 6).decode()
    body = {
        "model": "m",
        "max_tokens": 8,
        "stream": stream,
        "messages": [
            {
                "role": "user",
                "content": [
                    {"type": "image_url", "image_url": {"url": f"data:image/png;base64,{image}"}},
                    {"type": "text", "text": "What is in the image?"},
                ],
            }
        ],
    }
    raw = json.dumps(body).encode()
    return (
        b"POST /v1/chat/completions HTTP/1.1\r\nHost: bench\r\nContent-Type: application/json\r\n"
        b"Content-Length: %d\r\n\r\n%s" % (len(raw), raw)
    )


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


# -- the client ------------------------------------------------------------------------------------------------


class _Conn(asyncio.Protocol):
    """One keep-alive connection; ``ask(request)`` -> (status, first body byte time, end time)."""

    def __init__(self) -> None:
        self.transport: asyncio.Transport | None = None
        self.buf = bytearray()
        self.waiter: asyncio.Future[tuple[int, float, float]] | None = None
        self.head_end = -1
        self.first = 0.0
        self.closed = False

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)  # uvloop's transports are not asyncio.Transport

    def connection_lost(self, exc: BaseException | None) -> None:
        self.closed = True
        if self.waiter is not None and not self.waiter.done():
            self.waiter.set_exception(ConnectionError("closed by the server"))

    def data_received(self, data: bytes) -> None:
        now = time.perf_counter()
        self.buf += data
        if self.head_end < 0:
            self.head_end = self.buf.find(b"\r\n\r\n")
            if self.head_end < 0:
                return
        if not self.first and len(self.buf) > self.head_end + 4:
            self.first = now
        head = bytes(self.buf[: self.head_end]).lower()
        body_len = len(self.buf) - self.head_end - 4
        done = False
        i = head.find(b"content-length:")
        if i >= 0:
            n = int(head[i + 15 :].split(b"\r\n", 1)[0])
            done = body_len >= n
        elif b"chunked" in head:
            done = self.buf.endswith(b"0\r\n\r\n") and body_len >= 5
        if done and self.waiter is not None and not self.waiter.done():
            status = int(self.buf[9:12])
            self.waiter.set_result((status, self.first or now, now))

    async def ask(self, request: bytes) -> tuple[int, float, float]:
        assert self.transport is not None
        self.buf.clear()
        self.head_end = -1
        self.first = 0.0
        self.waiter = asyncio.get_running_loop().create_future()
        self.transport.write(request)
        return await self.waiter


async def _open(port: int) -> _Conn:
    _, conn = await asyncio.get_running_loop().create_connection(_Conn, "127.0.0.1", port)
    return conn


@dataclass
class _Tally:
    latencies: list[float] = field(default_factory=list)
    firsts: list[float] = field(default_factory=list)
    errors: int = 0
    done: int = 0


async def _worker(port: int, request: bytes, t_start: float, t_end: float, tally: _Tally, timeout_s: float) -> None:
    conn: _Conn | None = None
    while time.perf_counter() < t_end:
        try:
            if conn is None or conn.closed:
                conn = await asyncio.wait_for(_open(port), timeout_s)
            t0 = time.perf_counter()
            status, first, end = await asyncio.wait_for(conn.ask(request), timeout_s)
        except (OSError, TimeoutError, ConnectionError):
            if time.perf_counter() >= t_start:
                tally.errors += 1
            if conn is not None and conn.transport is not None:
                conn.transport.abort()
            conn = None
            continue
        if t_start <= end <= t_end:  # answers that ended in the window, whenever they started
            if status != 200:
                tally.errors += 1
                continue
            tally.latencies.append(end - t0)
            tally.firsts.append(first - t0)
            tally.done += 1
    if conn is not None and conn.transport is not None:
        conn.transport.close()


async def closed_loop(
    port: int, request: bytes, c: int, seconds: float, warmup_s: float = 0.5, timeout_s: float = 10.0
) -> dict[str, Any]:
    tally = _Tally()
    t_start = time.perf_counter() + warmup_s
    t_end = t_start + seconds
    await asyncio.gather(*(_worker(port, request, t_start, t_end, tally, timeout_s) for _ in range(c)))
    lat, first = summarize(tally.latencies), summarize(tally.firsts)
    return {
        "n": tally.done,
        "errors": tally.errors,
        "rps": tally.done / seconds,
        "p50_ms": lat.get("median_ms"),
        "p99_ms": lat.get("p99_ms"),
        "max_ms": lat.get("max_ms"),
        "first_byte_p50_ms": first.get("median_ms"),
        "first_byte_p99_ms": first.get("p99_ms"),
    }


def _run(coro: Any) -> Any:
    try:
        import uvloop

        return uvloop.run(coro)
    except ImportError:
        return asyncio.run(coro)


# -- scenarios -------------------------------------------------------------------------------------------------


def scenario_closed_loop(args: argparse.Namespace, kinds: list[str]) -> list[dict[str, Any]]:
    enc, llm = _upstream(), _upstream()
    procs = {k: _proxy(k, [enc.port], llm.port, args.old_src) for k in kinds if k != "direct"}
    ports = {"direct": llm.port, **{k: p.port for k, p in procs.items() if p is not None}}
    rows = []
    try:
        for mode in ("plain", "stream"):
            request = _chat(mode == "stream")
            for c in args.concurrency:
                for kind in ports:
                    proc = procs.get(kind)
                    cpu0 = proc.cpu_s() if proc else 0.0
                    row = _run(closed_loop(ports[kind], request, c, args.seconds, warmup_s=args.warmup))
                    # CPU the proxy spent per answer (warm-up included in both): robust on a busy box, where
                    # latency and throughput also measure the neighbours.
                    served = row["n"] * (args.seconds + args.warmup) / args.seconds
                    row["proxy_cpu_ms_per_request"] = (
                        ((proc.cpu_s() - cpu0) * 1e3 / served) if proc and served else None
                    )
                    row.update({"proxy": kind, "mode": mode, "c": c, **(proc.stats() if proc else {})})
                    rows.append(row)
                    print(
                        f"  {mode:6} c={c:<4} {kind:11} p50 {row['p50_ms'] or 0:8.2f} ms  p99 "
                        f"{row['p99_ms'] or 0:8.2f} ms  {row['rps']:8.0f}/s  err {row['errors']:4}  cpu/req "
                        f"{row['proxy_cpu_ms_per_request'] or 0:6.3f} ms  "
                        f"threads {row.get('threads', '-')}  rss {row.get('rss_mb', 0):.0f} MB",
                        flush=True,
                    )
    finally:
        for p in (*procs.values(), enc, llm):
            if p is not None:
                p.stop()
    return rows


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
                _idle_loris_run(proc.port, args.idle_connections, _chat(False), args.seconds, idle_s, proc)
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


def _ratios(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    out = []
    for mode in ("plain", "stream"):
        for c in sorted({r["c"] for r in rows}):
            cell = {r["proxy"]: r for r in rows if r["mode"] == mode and r["c"] == c}
            tw, fa, direct = cell.get("tensorwire"), cell.get("fastapi"), cell.get("direct")
            entry: dict[str, Any] = {"mode": mode, "c": c}
            if tw and fa and fa["rps"] and tw["p99_ms"] and fa["p99_ms"]:
                entry["throughput_tensorwire_over_fastapi"] = tw["rps"] / fa["rps"]
                entry["p99_tensorwire_over_fastapi"] = tw["p99_ms"] / fa["p99_ms"]
            if tw and direct and tw["p50_ms"] and direct["p50_ms"]:
                entry["overhead_p50_ms_tensorwire"] = tw["p50_ms"] - direct["p50_ms"]
            if fa and direct and fa["p50_ms"] and direct["p50_ms"]:
                entry["overhead_p50_ms_fastapi"] = fa["p50_ms"] - direct["p50_ms"]
            old = cell.get("stdlib_old")
            if old and direct and old["p50_ms"] and direct["p50_ms"]:
                entry["overhead_p50_ms_stdlib_old"] = old["p50_ms"] - direct["p50_ms"]
            out.append(entry)
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m tensorwire.bench router", description=__doc__.split("\n\n")[0])
    ap.add_argument("--seconds", type=float, default=3.0, help="measured time per closed-loop cell (default 3)")
    ap.add_argument(
        "--warmup",
        type=float,
        default=1.0,
        help="seconds per closed-loop cell before measuring (connections open, pools fill; default 1)",
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
    ap.add_argument("--proxies", nargs="+", default=list(PROXIES), choices=PROXIES)
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
        "seconds_per_cell": args.seconds,
        "warmup_s": args.warmup,
        "loop": _loop_name(),
        "load_average_before": os.getloadavg(),
    }
    t0 = time.monotonic()
    if "closed_loop" not in args.skip:
        print("closed loop (chat with an image: encoder stand-in, then LLM stand-in)", flush=True)
        rows = scenario_closed_loop(args, kinds)
        result["closed_loop"] = rows
        result["ratios"] = _ratios(rows)
        for entry in result["ratios"]:
            print("  " + json.dumps(entry), flush=True)
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


def _loop_name() -> str:
    try:
        import uvloop  # noqa: F401

        return "uvloop"
    except ImportError:
        return "asyncio"


if __name__ == "__main__":
    sys.exit(main())
