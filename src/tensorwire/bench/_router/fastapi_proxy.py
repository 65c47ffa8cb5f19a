"""The baseline of ``bench router``: an EPD proxy of the shape of vLLM's example proxy, written for the bench.

    python -m tensorwire.bench._router.fastapi_proxy --port 0 --encoder URL --llm URL

FastAPI on uvicorn, one ``aiohttp.ClientSession`` per side: a one-token copy goes to an encoder (round-robin),
its ``ec_transfer_params`` join the request, which goes to an LLM instance. No fallback, no timeouts: the shape,
not a product. Prints ``PORT <n>`` once listening.
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import socket
import sys
from collections.abc import AsyncIterator
from typing import Any

# Module level (FastAPI resolves the handlers' string annotations in this module's globals): bench-only imports.
import aiohttp
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse


def build(encoders: list[str], llms: list[str]) -> Any:
    sessions: dict[str, aiohttp.ClientSession] = {}
    enc_cycle, llm_cycle = itertools.cycle(encoders), itertools.cycle(llms)

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        timeout = aiohttp.ClientTimeout(total=6 * 3600)
        sessions["enc"] = aiohttp.ClientSession(timeout=timeout, connector=aiohttp.TCPConnector(limit=0))
        sessions["llm"] = aiohttp.ClientSession(timeout=timeout, connector=aiohttp.TCPConnector(limit=0))
        yield
        for s in sessions.values():
            await s.close()

    app = FastAPI(lifespan=lifespan)

    @app.get("/health")
    async def health() -> JSONResponse:
        return JSONResponse({"status": "ok"})

    @app.post("/v1/chat/completions")
    async def chat(request: Request) -> Any:
        body = await request.json()
        has_media = any(
            isinstance(m.get("content"), list) and any(p.get("type") != "text" for p in m["content"])
            for m in body.get("messages", [])
        )
        if has_media:
            primer = {**body, "max_tokens": 1, "stream": False}
            primer.pop("stream_options", None)
            async with sessions["enc"].post(next(enc_cycle) + "/v1/chat/completions", json=primer) as resp:
                answer = await resp.json()
            if answer.get("ec_transfer_params"):
                body["ec_transfer_params"] = answer["ec_transfer_params"]
        url = next(llm_cycle) + "/v1/chat/completions"
        if body.get("stream"):

            async def relay() -> AsyncIterator[bytes]:
                async with sessions["llm"].post(url, json=body) as resp:
                    async for chunk in resp.content.iter_chunked(1024):
                        yield chunk

            return StreamingResponse(relay(), media_type="text/event-stream")
        async with sessions["llm"].post(url, json=body) as resp:
            return JSONResponse(await resp.json(), status_code=resp.status)

    return app


def main(argv: list[str] | None = None) -> int:
    import uvicorn

    ap = argparse.ArgumentParser(prog="python -m tensorwire.bench._router.fastapi_proxy")
    ap.add_argument("--port", type=int, default=0)
    ap.add_argument("--encoder", action="append", required=True)
    ap.add_argument("--llm", action="append", required=True)
    args = ap.parse_args(argv)
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", args.port))
    sock.listen(4096)  # connections queue until uvicorn serves; none is refused meanwhile
    print(f"PORT {sock.getsockname()[1]}", flush=True)
    config = uvicorn.Config(build(args.encoder, args.llm), log_level="warning", access_log=False, backlog=4096)
    uvicorn.Server(config).run(sockets=[sock])
    return 0


if __name__ == "__main__":
    sys.exit(main())
