"""A stand-in ``vllm serve`` instance for ``bench router``: answers at once, so only the proxy in front is measured.

    python -m tensorwire.bench._router.upstream --port 0 [--events 8] [--event-delay-ms 0] [--hang]

Raw asyncio, HTTP/1.1 keep-alive. ``GET /health``: 200; a streamed POST: ``--events`` SSE chunks, then
``data: [DONE]``; other POSTs: JSON with ``ec_transfer_params``. ``--hang`` never answers. Prints ``PORT <n>``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
from typing import cast

_ANSWER = json.dumps(
    {
        "id": "chatcmpl-bench",
        "object": "chat.completion",
        "model": "m",
        "choices": [
            {
                "index": 0,
                "message": {"role": "assistant", "content": "a short answer from the stand-in"},
                "finish_reason": "length",
            }
        ],
        "usage": {"prompt_tokens": 12, "completion_tokens": 8, "total_tokens": 20},
        "ec_transfer_params": {"hash-0": {"item_indices": [0], "tensorwire": {"v": 1}}},
    }
).encode()
_HEALTH = b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: 2\r\n\r\n{}"


def _plain() -> bytes:
    return b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n" % len(_ANSWER) + _ANSWER


def _event(i: int) -> bytes:
    data = b'data: {"id":"c","choices":[{"index":0,"delta":{"content":"tok%d "}}]}\n\n' % i
    return b"%x\r\n%s\r\n" % (len(data), data)


_STREAM_HEAD = b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n\r\n"
_DONE = b"e\r\ndata: [DONE]\n\n\r\n0\r\n\r\n"


class _Upstream(asyncio.Protocol):
    def __init__(self, events: int, delay_s: float, hang: bool) -> None:
        self._buf = b""
        self._events = events
        self._delay_s = delay_s
        self._hang = hang
        self._transport: asyncio.Transport | None = None
        self._busy = False

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self._transport = cast(asyncio.Transport, transport)  # uvloop's transports are not asyncio.Transport

    def data_received(self, data: bytes) -> None:
        if self._hang:
            return
        self._buf += data
        self._serve()

    def _serve(self) -> None:
        while not self._busy:
            end = self._buf.find(b"\r\n\r\n")
            if end < 0:
                return
            head = self._buf[:end].decode("latin-1")
            length = 0
            for line in head.split("\r\n")[1:]:
                name, _, value = line.partition(":")
                if name.strip().lower() == "content-length":
                    length = int(value)
            if len(self._buf) < end + 4 + length:
                return
            body = self._buf[end + 4 : end + 4 + length]
            self._buf = self._buf[end + 4 + length :]
            assert self._transport is not None
            if head.startswith("GET /health"):
                self._transport.write(_HEALTH)
            elif b'"stream": true' in body or b'"stream":true' in body:
                if self._delay_s > 0:
                    self._busy = True
                    asyncio.get_running_loop().create_task(self._slow_stream())
                    return
                self._transport.write(_STREAM_HEAD + b"".join(_event(i) for i in range(self._events)) + _DONE)
            else:
                self._transport.write(_plain())

    async def _slow_stream(self) -> None:
        assert self._transport is not None
        self._transport.write(_STREAM_HEAD)
        for i in range(self._events):
            self._transport.write(_event(i))
            await asyncio.sleep(self._delay_s)
        self._transport.write(_DONE)
        self._busy = False
        self._serve()


async def _main(args: argparse.Namespace) -> None:
    loop = asyncio.get_running_loop()
    server = await loop.create_server(
        lambda: _Upstream(args.events, args.event_delay_ms / 1e3, args.hang), "127.0.0.1", args.port, backlog=4096
    )
    print(f"PORT {server.sockets[0].getsockname()[1]}", flush=True)
    await server.serve_forever()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m tensorwire.bench._router.upstream")
    ap.add_argument("--port", type=int, default=0)
    ap.add_argument("--events", type=int, default=8)
    ap.add_argument("--event-delay-ms", type=float, default=0.0)
    ap.add_argument("--hang", action="store_true")
    args = ap.parse_args(argv)
    try:
        import uvloop

        uvloop.run(_main(args))
    except ImportError:
        asyncio.run(_main(args))
    return 0


if __name__ == "__main__":
    sys.exit(main())
