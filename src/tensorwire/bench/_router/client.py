"""The load generator of ``bench router``: closed-loop keep-alive HTTP/1.1 connections, raw asyncio.

    python -m tensorwire.bench._router.client

As a process (the way ``bench router`` runs it, one for the whole run, the same for every proxy): reads one JSON
command a line on stdin, ``{"port", "stream", "c", "seconds", "warmup", "waves"}``, runs that closed loop and writes one
JSON line with its result, the client's own CPU seconds included; ends at end of input. uvloop when installed.

The client is deliberately cheap: a protocol per connection that finds the end of an answer by its
``Content-Length`` or the chunked terminator, no HTTP library in between, so that it can drive the stand-in
instance directly (the ``direct`` column) many times faster than any proxy answers.
"""

from __future__ import annotations

import asyncio
import base64
import json
import resource
import sys
import time
from dataclasses import dataclass, field
from typing import Any, cast

from tensorwire.bench._common import summarize


def chat(stream: bool) -> bytes:
    """The bench's request: a chat with an image (so a proxy asks an encoder first), plain or streamed."""
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


class Conn(asyncio.Protocol):
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


async def connect(port: int) -> Conn:
    _, conn = await asyncio.get_running_loop().create_connection(Conn, "127.0.0.1", port)
    return conn


@dataclass
class _Tally:
    t_start: float
    t_min_end: float  # the window lasts at least until here ...
    t_end: float  # ... and until ``min_answers`` ended in it, at most until here
    min_answers: int
    latencies: list[float] = field(default_factory=list)
    firsts: list[float] = field(default_factory=list)
    errors: int = 0
    done: int = 0

    def ended(self, now: float) -> None:
        """One more answer ended in the window: close the window once it is long and full enough."""
        self.done += 1
        if now >= self.t_min_end and self.done >= self.min_answers and now < self.t_end:
            self.t_end = now


async def _worker(port: int, request: bytes, tally: _Tally, timeout_s: float) -> None:
    conn: Conn | None = None
    while time.perf_counter() < tally.t_end:
        try:
            if conn is None or conn.closed:
                conn = await asyncio.wait_for(connect(port), timeout_s)
            t0 = time.perf_counter()
            status, first, end = await asyncio.wait_for(conn.ask(request), timeout_s)
        except (OSError, TimeoutError, ConnectionError):
            if time.perf_counter() >= tally.t_start:
                tally.errors += 1
            if conn is not None and conn.transport is not None:
                conn.transport.abort()
            conn = None
            continue
        if tally.t_start <= end <= tally.t_end:  # answers that ended in the window, whenever they started
            if status != 200:
                tally.errors += 1
                continue
            tally.latencies.append(end - t0)
            tally.firsts.append(first - t0)
            tally.ended(end)
    if conn is not None and conn.transport is not None:
        conn.transport.close()


async def closed_loop(
    port: int,
    request: bytes,
    c: int,
    seconds: float,
    warmup_s: float = 0.5,
    timeout_s: float = 10.0,
    waves: int = 0,
) -> dict[str, Any]:
    """``c`` connections, each sending ``request`` again as soon as its previous answer ended, for ``warmup_s``
    then a measured window of ``seconds``, longer until ``waves * c`` answers ended in it (at most ten times
    ``seconds``): at high concurrency an answer can take longer than a short window, and a window holding
    fewer than a few rounds of answers counts whole rounds or none. The answers that ended in the window give
    the figures; throughput is their number over the window's length."""
    t_start = time.perf_counter() + warmup_s
    tally = _Tally(t_start, t_start + seconds, t_start + seconds * (10 if waves else 1), waves * c)
    await asyncio.gather(*(_worker(port, request, tally, timeout_s) for _ in range(c)))
    window_s = tally.t_end - tally.t_start
    lat, first = summarize(tally.latencies), summarize(tally.firsts)
    return {
        "n": tally.done,
        "errors": tally.errors,
        "window_s": window_s,
        "rps": tally.done / window_s,
        "p50_ms": lat.get("median_ms"),
        "p99_ms": lat.get("p99_ms"),
        "max_ms": lat.get("max_ms"),
        "first_byte_p50_ms": first.get("median_ms"),
        "first_byte_p99_ms": first.get("p99_ms"),
    }


def run(coro: Any) -> Any:
    """Runs ``coro`` on uvloop when installed, else on asyncio's loop."""
    try:
        import uvloop
    except ImportError:
        return asyncio.run(coro)
    return uvloop.run(coro)


def loop_name() -> str:
    try:
        import uvloop  # noqa: F401
    except ImportError:
        return "asyncio"
    return "uvloop"


def _cpu_s() -> float:
    ru = resource.getrusage(resource.RUSAGE_SELF)
    return ru.ru_utime + ru.ru_stime


def main() -> int:
    requests = {False: chat(False), True: chat(True)}
    for line in sys.stdin:
        if not line.strip():
            continue
        cmd = json.loads(line)
        cpu0, t0 = _cpu_s(), time.perf_counter()
        row = run(
            closed_loop(
                cmd["port"], requests[bool(cmd["stream"])], cmd["c"], cmd["seconds"], cmd["warmup"], waves=cmd["waves"]
            )
        )
        row["client_cpu_s"] = _cpu_s() - cpu0
        row["client_wall_s"] = time.perf_counter() - t0
        print(json.dumps(row), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
