"""The EPD router: an HTTP front (aiohttp) for ``vllm serve`` encoder instances and LLM instances.

A chat request with media goes to an encoder instance first (round-robin over the instances that are up; a
one-token, non-streamed copy, see ``rewrite``), whose answer carries ``ec_transfer_params``; the client's own
request then goes to an LLM instance with those params, and its answer goes back to the client as it comes,
chunk by chunk (streamed or not, on every path). Anything else is passed to an LLM instance with its body's
transfer params removed (``GET /v1/models``, text-only chats, ``/v1/completions``, ...); ``GET /health`` and
``GET /metrics`` are the router's own.

Requests the router refuses before any instance sees them (400 unless said): a non-canonical path (percent-
encoding, dot or empty segments, a trailing slash, absolute form), a ``Transfer-Encoding`` other than
``chunked``, a request body with a ``Content-Encoding``  (415), a body over ``max_body_bytes`` (413) or not
read within ``body_timeout_s`` (408), a chat body that is not a JSON object. aiohttp's parser refuses duplicate
or malformed ``Content-Length`` and ``Content-Length`` with ``Transfer-Encoding``. The router frames every
upstream request itself, so nothing a client sends after its body can run upstream as another request.

Failures, each answered with vLLM's error body ``{"error": {"message", "type", "param", "code"}}`` naming
instances as ``encoder-N``/``llm-N``, never by URL (the log has both):

- an encoder instance refuses, does not start its answer within ``encoder_first_byte_timeout_s``, does not finish
  it within ``encoder_timeout_s``, answers 408/429/5xx or garbage: the next one is tried, and the failed one is
  out until its ``/health`` probe passes; when none answers, ``fallback=local`` sends the request on without
  params (it carries the media: the LLM instance encodes it), ``fallback=fail`` answers 503;
- an encoder instance answers another 4xx: the request itself is refused, that answer goes to the client;
- an LLM instance refuses the connection: the next one is tried (one probed down is tried last); one that times
  out or breaks before its answer started is not retried (it may have run): 504 or 502, logged with the request
  id. An answer that stalls for ``llm_timeout_s`` or breaks after it started is cut off (the client sees the
  connection close before the end).

Every answer carries ``X-Request-Id`` (the client's, else a new one, also sent to the instances, with
``traceparent``/``tracestate``) and ``X-Tensorwire-Encoder`` (the encoder instance used, ``none`` when no
encoder was needed or none answered).

Stopping (``stop``): ``/health`` answers 503 for ``drain_s``, then the listener closes, idle connections close,
running requests and streams get ``grace_s`` to finish (each connection closes after its answer), and what was
waited for is logged; whatever still runs after the grace period is cut.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import functools
import itertools
import json
import logging
import os
import signal
import socket
import ssl
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, cast

import aiohttp
from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, Counter, generate_latest

from tensorwire.errors import ClosedError, ConfigError, DeadlineExceeded, PeerUnavailable, ProtocolError, Reason
from tensorwire.integrations._vllm_router import rewrite
from tensorwire.integrations._vllm_router.balance import Instances
from tensorwire.integrations._vllm_router.config import RouterConfig
from tensorwire.integrations._vllm_router.metrics import RouterMetrics
from tensorwire.integrations._vllm_router.upstream import HOP_BY_HOP, Upstreams, client_ssl

log = logging.getLogger("tensorwire.integrations.vllm_router")

_FORWARDED_HEADERS = ("Authorization", "Accept", "Accept-Encoding", "User-Agent", "traceparent", "tracestate")
_JSON_TYPES = ("application/json", "")
_WHOLE_BYTES = 1 << 20  # answers up to this size with a Content-Length go out in one write
_NO_WAIT_BYTES = 16 * 1024  # asyncio's and uvloop's default low-water mark (the high-water one is 64 KiB)
_ACCEPT_BATCH = 512  # connections accepted per wake-up of the listener


@dataclass
class EncodeResult:
    """What the encoder step gave: ``params`` (None: none announced), or a client error to relay (``refused``)."""

    encoder: str | None = None
    params: dict[str, Any] | None = None
    refused: tuple[int, str, bytes] | None = None
    errors: list[str] = field(default_factory=list)


def error_body(status: int, message: str, kind: str) -> bytes:
    return json.dumps({"error": {"message": message, "type": kind, "param": None, "code": status}}).encode()


def _error(status: int, message: str, kind: str, rid: str, encoder: str | None = None) -> web.Response:
    return web.Response(
        status=status,
        body=error_body(status, message, kind),
        content_type="application/json",
        headers={"X-Request-Id": rid, "X-Tensorwire-Encoder": encoder or "none"},
    )


class _QuietLog(logging.LoggerAdapter):  # type: ignore[type-arg]
    """aiohttp's server logger: a client's malformed request is its problem, not an error with a traceback."""

    def exception(self, msg: object, *args: object, **kwargs: Any) -> None:
        kwargs.pop("exc_info", None)
        self.debug(msg, *args, **kwargs)


class _Refuse(asyncio.Protocol):
    """A connection over the cap (or arriving while stopping): a 503 and close, before reading anything."""

    _BODY = error_body(503, "the router is at its connection limit or stopping", "ServiceUnavailable")
    _ANSWER = (
        b"HTTP/1.1 503 Service Unavailable\r\nContent-Type: application/json\r\nConnection: close\r\n"
        b"Content-Length: %d\r\n\r\n%s" % (len(_BODY), _BODY)
    )

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        tr = cast(asyncio.Transport, transport)  # uvloop's transports are not asyncio.Transport
        tr.write(self._ANSWER)
        tr.close()


def _listen(config: RouterConfig) -> socket.socket:
    """The listening socket, bound now (so a port in use fails before anything starts)."""
    try:
        infos = socket.getaddrinfo(config.host, config.port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
        family, kind, proto, _, addr = infos[0]
        sock = socket.socket(family, kind, proto)
    except OSError as exc:
        raise ConfigError(
            f"cannot listen on {config.host}:{config.port}: {exc.strerror or exc}", reason=Reason.BIND_FAILED
        ) from exc
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(addr)
        sock.listen(config.backlog)
        sock.setblocking(False)
    except OSError as exc:
        sock.close()
        why = "the port is in use" if exc.errno == errno.EADDRINUSE else (exc.strerror or str(exc))
        raise ConfigError(f"cannot listen on {config.host}:{config.port}: {why}", reason=Reason.BIND_FAILED) from exc
    return sock


class Router:
    """Owns the listening socket, the event loop's server, the upstream pool and the health probes.

    The socket is bound in the constructor (``ConfigError`` with ``Reason.BIND_FAILED`` when it cannot be).
    ``run()`` serves on the calling thread until ``stop()``; ``start()`` serves on a background thread and
    ``close()`` stops it (no drain period, the configured grace) and joins it. ``stop()`` may be called from any
    thread or signal handler; ``stop(cut=True)`` (or a second ``stop()``) ends the grace period at once.
    Idempotent: ``close()`` again does nothing.
    """

    def __init__(self, config: RouterConfig) -> None:
        self.config = config
        self.metrics = RouterMetrics()
        # The labelled series, looked up once each (the label values are bounded: routes, instances, outcomes).
        self._upstream_calls = functools.cache(self.metrics.upstream_calls.labels)
        self._encoder_calls = functools.cache(self.metrics.encoder_calls.labels)
        self._request_seconds = functools.cache(self.metrics.request_seconds.labels)
        self._requests = functools.cache(self.metrics.requests.labels)
        self.encoders = Instances("encoder", config.encoders, lambda i, up: self._set_up("encoder", i, up))
        self.llms = Instances("llm", config.llms, lambda i, up: self._set_up("llm", i, up))
        for role, pool in (("encoder", self.encoders), ("llm", self.llms)):
            for i in range(len(pool.urls)):
                self.metrics.upstream_up.labels(pool.names[i], role).set(1)
        self._server_ssl: ssl.SSLContext | None = None
        if config.tls_cert:
            self._server_ssl = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
            self._server_ssl.load_cert_chain(config.tls_cert, config.tls_key)
        upstream_ssl = None
        if any(u.startswith("https:") for u in (*config.encoders, *config.llms)) or config.upstream_ca:
            upstream_ssl = client_ssl(config.upstream_ca, config.upstream_cert, config.upstream_key)
        self._up = Upstreams(
            connections=config.upstream_connections, keepalive_s=config.upstream_keepalive_s, ssl_context=upstream_ssl
        )
        self._sock = _listen(config)
        self._port = int(self._sock.getsockname()[1])
        self._accepting = False
        self._adopting: set[asyncio.Task[None]] = set()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._started = threading.Event()
        self._start_error: BaseException | None = None
        self._stop_requested: asyncio.Event | None = None
        self._cut: asyncio.Event | None = None
        self._idle: asyncio.Event | None = None
        self._closed = False
        self._pending_stop = 0
        self._drain_s = config.drain_s
        self._healthy = True
        self._closing = False
        self._active: dict[int, bool] = {}  # id(request) -> streamed
        self._web: web.Server | None = None
        log.info(
            "vLLM EPD router on %s: %s; %s; fallback %s",
            self.address,
            ", ".join(f"{n} = {u}" for n, u in zip(self.encoders.names, config.encoders, strict=True)),
            ", ".join(f"{n} = {u}" for n, u in zip(self.llms.names, config.llms, strict=True)),
            config.fallback,
        )

    @property
    def port(self) -> int:
        return self._port

    @property
    def address(self) -> str:
        host = self.config.host if ":" not in self.config.host else f"[{self.config.host}]"
        return f"{'https' if self._server_ssl else 'http'}://{host}:{self.port}"

    # -- lifecycle ---------------------------------------------------------------------------------------------

    def run(self, on_ready: Any = None, *, signals: bool = False) -> None:
        """Serves on this thread until ``stop()``; ``on_ready()`` runs once the listener accepts. ``signals``: the
        first SIGTERM/SIGINT stops (drain, grace), a second cuts what still runs (main thread only)."""
        with asyncio.Runner(loop_factory=loop_factory(self.config.loop)) as runner:
            runner.run(self._main(on_ready, signals))

    def start(self) -> Router:
        if self._closed:
            raise ClosedError("the router is closed")
        if self._thread is None:
            self._thread = threading.Thread(target=self._run_in_thread, name="tensorwire-router", daemon=True)
            self._thread.start()
            self._started.wait(60)
            if self._start_error is not None:
                raise self._start_error
        return self

    def _run_in_thread(self) -> None:
        try:
            self.run(on_ready=self._started.set)
        except BaseException as exc:
            self._start_error = exc
            log.exception("the router stopped on an error")
        finally:
            self._started.set()

    def stop(self, cut: bool = False) -> None:
        """Begin stopping (from any thread); ``cut``: end the grace period now. Returns at once."""
        loop = self._loop
        if loop is None or loop.is_closed():
            self._pending_stop = max(self._pending_stop, 2 if cut else 1)  # before the loop runs: at its start
            return
        try:
            loop.call_soon_threadsafe(self._request_stop, cut)
        except RuntimeError:  # the loop has just closed
            pass

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        thread = self._thread
        if thread is not None:
            self._drain_s = 0.0  # close(): no /health drain period, the grace period as configured
            self.stop()
            thread.join(timeout=self.config.grace_s + 30)
        self._sock.close()

    def __enter__(self) -> Router:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _on_signal(self, sig: signal.Signals) -> None:
        assert self._stop_requested is not None
        if self._stop_requested.is_set():
            log.warning("%s again: cutting what still runs", sig.name)
        else:
            log.info(
                "%s: stopping (drain %.1f s, grace %.1f s; a second signal cuts what still runs)",
                sig.name,
                self._drain_s,
                self.config.grace_s,
            )
        self._request_stop(False)

    def _request_stop(self, cut: bool) -> None:
        assert self._stop_requested is not None and self._cut is not None
        if cut or self._stop_requested.is_set():
            self._cut.set()
        self._stop_requested.set()

    async def _main(self, on_ready: Any, signals: bool) -> None:
        loop = asyncio.get_running_loop()
        self._loop = loop
        if signals:
            for sig in (signal.SIGTERM, signal.SIGINT):
                loop.add_signal_handler(sig, self._on_signal, sig)
        self._stop_requested, self._cut, self._idle = asyncio.Event(), asyncio.Event(), asyncio.Event()
        await self._up.start()
        self._web = web.Server(
            self._handle,
            keepalive_timeout=self.config.idle_timeout_s,
            access_log=None,
            logger=_QuietLog(logging.getLogger("tensorwire.integrations.vllm_router.http"), {}),
        )
        self.metrics.connections.set_function(lambda: len(self._web.connections) if self._web else 0)
        self.metrics.in_flight.set_function(lambda: len(self._active))
        loop.add_reader(self._sock.fileno(), self._accept)
        self._accepting = True
        probes = asyncio.create_task(self._probe_forever())
        if self._pending_stop:
            self._request_stop(self._pending_stop > 1)
        try:
            if on_ready is not None:
                on_ready()
            await self._stop_requested.wait()
            await self._drain()
        finally:
            self._stop_accepting()
            probes.cancel()
            for task in self._adopting:
                task.cancel()
            await asyncio.gather(probes, *self._adopting, return_exceptions=True)
            await self._up.close()
            self._loop = None

    def _accept(self) -> None:
        """The listener is readable: accepts every connection waiting, up to ``_ACCEPT_BATCH`` (uvloop's libuv
        accepts one per loop iteration: under load a burst of new connections waited seconds behind the running
        requests). Each is handed to the event loop (TLS handshake included) by ``_adopt``."""
        loop = self._loop
        assert loop is not None
        for _ in range(_ACCEPT_BATCH):
            try:
                conn, _ = self._sock.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError as exc:
                if exc.errno in (errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM):
                    log.error("cannot accept connections (%s): trying again in 1 s", exc.strerror or exc)
                    loop.remove_reader(self._sock.fileno())
                    loop.call_later(1.0, self._resume_accepting)
                    return
                continue  # that connection was reset before it was accepted
            conn.setblocking(False)
            task = loop.create_task(self._adopt(conn))
            self._adopting.add(task)
            task.add_done_callback(self._adopting.discard)

    async def _adopt(self, conn: socket.socket) -> None:
        assert self._loop is not None
        try:
            await self._loop.connect_accepted_socket(self._protocol, conn, ssl=self._server_ssl)
        except Exception as exc:  # a failed TLS handshake, a connection reset meanwhile: its problem
            log.debug("connection not taken: %s", exc)
            conn.close()

    def _resume_accepting(self) -> None:
        if self._accepting and self._loop is not None:
            self._loop.add_reader(self._sock.fileno(), self._accept)

    def _stop_accepting(self) -> None:
        """Closes the listener: new connections are refused by the kernel from here on."""
        if self._accepting:
            self._accepting = False
            if self._loop is not None:
                self._loop.remove_reader(self._sock.fileno())
            self._sock.close()

    def _protocol(self) -> asyncio.BaseProtocol:
        assert self._web is not None
        if self._closing or len(self._web.connections) >= self.config.max_connections:
            self.metrics.connections_refused.inc()
            return _Refuse()
        return self._web()

    async def _drain(self) -> None:
        assert self._web is not None and self._cut is not None
        cfg = self.config
        self._healthy = False
        t0 = time.monotonic()
        if self._drain_s > 0:
            log.info("stopping: /health answers 503 for %.1f s while requests are still served", self._drain_s)
            try:
                await asyncio.wait_for(self._cut.wait(), self._drain_s)
            except TimeoutError:
                pass
        self._closing = True
        self._stop_accepting()
        for conn in self._web.connections:
            conn.close()  # idle ones close now, busy ones after their answer
        running = dict(self._active)
        streams = sum(running.values())
        if running:
            log.info(
                "listener closed; waiting up to %.1f s for %d request(s) in flight (%d streamed answer(s))",
                cfg.grace_s,
                len(running),
                streams,
            )
            idle = asyncio.create_task(self._wait_idle())
            cut = asyncio.create_task(self._cut.wait())
            await asyncio.wait((idle, cut), timeout=cfg.grace_s, return_when=asyncio.FIRST_COMPLETED)
            idle.cancel()
            cut.cancel()
            if self._active:
                log.warning(
                    "grace period over after %.1f s: cutting %d request(s) still running",
                    time.monotonic() - t0,
                    len(self._active),
                )
            else:
                log.info(
                    "drained: the %d request(s) in flight finished (%.2f s after the stop)",
                    len(running),
                    time.monotonic() - t0,
                )
        else:
            log.info("listener closed; no request in flight")
        await self._web.shutdown(0.5)

    async def _wait_idle(self) -> None:
        assert self._idle is not None
        while self._active:
            self._idle.clear()
            await self._idle.wait()

    def _set_up(self, role: str, index: int, up: bool) -> None:
        pool = self.encoders if role == "encoder" else self.llms
        self.metrics.upstream_up.labels(pool.names[index], role).set(1 if up else 0)

    async def _probe_forever(self) -> None:
        pools = (self.encoders, self.llms)
        while True:
            checks = [(pool, i) for pool in pools for i in range(len(pool.urls))]
            results = await asyncio.gather(
                *(self._up.probe(pool.urls[i], self.config.probe_timeout_s) for pool, i in checks)
            )
            for (pool, i), why in zip(checks, results, strict=True):
                pool.probed(i, not why, why)
            await asyncio.sleep(self.config.probe_interval_s)

    # -- one request -------------------------------------------------------------------------------------------

    async def _handle(self, request: web.BaseRequest) -> web.StreamResponse:
        t0 = time.monotonic()
        key = id(request)
        self._active[key] = False
        state = _State(request_id(request))
        try:
            response = await self._dispatch(request, state, key)
            if self._closing:
                response.force_close()
            return response
        finally:
            del self._active[key]
            self._request_seconds(state.route).observe(time.monotonic() - t0)
            state.count(self._requests)
            if not self._active and self._idle is not None:
                self._idle.set()

    async def _dispatch(self, request: web.BaseRequest, state: _State, key: int) -> web.StreamResponse:
        rid = state.rid
        path = rewrite.canonical_path(request.raw_path)
        if path is None:
            return _refuse(
                400,
                "the request path is not canonical (percent-encoding, dot or empty segments, a "
                "trailing slash or an absolute URL): send the path as the API names it",
                "BadRequestError",
                rid,
            )
        te = [v.strip().lower() for h in request.headers.getall("Transfer-Encoding", []) for v in h.split(",")]
        if te and te != ["chunked"]:
            return _refuse(
                400,
                f"Transfer-Encoding {', '.join(te)!r} is not supported: send Content-Length or chunked",
                "BadRequestError",
                rid,
            )
        if request.headers.get("Content-Encoding", "identity").strip().lower() != "identity":
            return _refuse(415, "compressed request bodies are not supported", "BadRequestError", rid)
        if path == "/health" and request.method in ("GET", "HEAD"):
            state.route = "own"
            status = 200 if self._healthy else 503
            return web.Response(
                status=status,
                body=json.dumps({"status": "ok" if status == 200 else "stopping"}),
                content_type="application/json",
                headers={"X-Request-Id": rid},
            )
        if path == "/metrics" and request.method == "GET":
            state.route = "own"
            return web.Response(
                body=generate_latest(self.metrics.registry),
                headers={"Content-Type": CONTENT_TYPE_LATEST, "X-Request-Id": rid},
            )
        raw = b""
        if request.body_exists:
            got = await self._read_body(request, rid)
            if isinstance(got, web.Response):
                return got
            raw = got
        target = request.raw_path
        headers = self._upstream_headers(request, rid)
        body: Any = None
        if raw and request.content_type != "multipart/form-data":
            try:
                body = json.loads(raw)
            except ValueError as exc:
                if request.content_type in _JSON_TYPES or request.content_type.endswith("+json"):
                    return _error(400, f"the request body is not JSON: {exc}", "BadRequestError", rid)
        if isinstance(body, dict):
            body, removed = rewrite.strip_client_params(body)
            if removed:
                self.metrics.client_params_dropped.inc()
                log.warning(
                    "request %s to %s carried %s: removed (only encoder instances set them)",
                    rid,
                    path,
                    ", ".join(removed),
                )
                raw = json.dumps(body).encode()
        if path not in rewrite.CHAT_PATHS or request.method != "POST":
            state.route = "passthrough"
            if raw and "Content-Type" not in headers and request.headers.get("Content-Type"):
                headers["Content-Type"] = request.headers["Content-Type"]
            return await self._to_llm(request, state, key, target, raw or None, headers, encoder=None)
        if not isinstance(body, dict):
            return _error(400, "the request body must be a JSON object", "BadRequestError", rid)
        headers["Content-Type"] = "application/json"
        if not rewrite.has_media(body):
            state.route = "text"
            return await self._to_llm(request, state, key, target, raw, headers, encoder=None)
        result = await self._encode(target, body, headers, rid)
        if result.refused is not None:
            state.route = "encoder_rejected"
            status, ctype, answer = result.refused
            return web.Response(
                status=status,
                body=answer,
                headers={"Content-Type": ctype, "X-Request-Id": rid, "X-Tensorwire-Encoder": result.encoder or "none"},
            )
        if result.encoder is None:
            if self.config.fallback == "fail":
                state.route = "no_encoder"
                return _error(
                    503, "no encoder instance answered: " + "; ".join(result.errors), "ServiceUnavailable", rid
                )
            state.route = "fallback_local"
        else:
            state.route = "encoded" if result.params else "not_announced"
        if result.params:
            raw = json.dumps(rewrite.llm_body(body, result.params)).encode()
        return await self._to_llm(request, state, key, target, raw, headers, encoder=result.encoder)

    async def _read_body(self, request: web.BaseRequest, rid: str) -> bytes | web.Response:
        limit = self.config.max_body_bytes
        length = request.content_length
        if length is not None and length > limit:
            return _refuse(
                413, f"request body of {length} bytes; the router takes at most {limit}", "BadRequestError", rid
            )
        if request.headers.get("Expect", "").lower() == "100-continue":
            await request.writer.write(b"HTTP/%d.%d 100 Continue\r\n\r\n" % request.version)
        chunks: list[bytes] = []
        total = 0
        content = request.content
        # A body that is all here already (the common case) is read without arming a timer.
        bound = contextlib.nullcontext() if content.is_eof() else asyncio.timeout(self.config.body_timeout_s)
        try:
            async with bound:
                while chunk := await content.readany():
                    total += len(chunk)
                    if total > limit:
                        return _close(_error(413, f"request body over {limit} bytes", "BadRequestError", rid))
                    chunks.append(chunk)
        except TimeoutError:
            return _close(
                _error(
                    408,
                    f"the request body did not arrive within {self.config.body_timeout_s:g} s",
                    "BadRequestError",
                    rid,
                )
            )
        except aiohttp.ClientPayloadError:
            return _close(_error(400, "broken request body", "BadRequestError", rid))
        return b"".join(chunks)

    @staticmethod
    def _upstream_headers(request: web.BaseRequest, rid: str) -> dict[str, str]:
        headers = {k: v for k in _FORWARDED_HEADERS if (v := request.headers.get(k)) is not None}
        headers["X-Request-Id"] = rid
        return headers

    # -- the encoder step --------------------------------------------------------------------------------------

    async def _encode(self, target: str, body: dict[str, Any], headers: dict[str, str], rid: str) -> EncodeResult:
        """Asks the encoder instances that are up in turn until one answers; see the module docstring."""
        cfg = self.config
        payload = json.dumps(rewrite.encoder_body(body)).encode()
        enc_headers = {k: v for k, v in headers.items() if k != "Accept-Encoding"}
        timeout = aiohttp.ClientTimeout(
            total=cfg.encoder_timeout_s, sock_connect=cfg.connect_timeout_s, sock_read=cfg.encoder_first_byte_timeout_s
        )
        result = EncodeResult()
        order = self.encoders.order()
        if not order:
            result.errors.append("every encoder instance is out until its /health probe passes")
        for i in order:
            name, url = self.encoders.names[i], self.encoders.urls[i]
            t0 = time.monotonic()
            try:
                status, ctype, answer = await self._up.fetch(url, "POST", target, payload, enc_headers, timeout=timeout)
            except (PeerUnavailable, DeadlineExceeded, ProtocolError) as exc:
                outcome = {PeerUnavailable: "unavailable", DeadlineExceeded: "timeout"}.get(type(exc), "bad_answer")
                self._encoder_failed(i, outcome, str(exc), result, rid)
                continue
            if status == 200:
                try:
                    data = json.loads(answer)
                    params = data.get(rewrite.PARAMS_FIELD) if isinstance(data, dict) else None
                except ValueError:
                    self._encoder_failed(i, "bad_answer", "the answer is not JSON", result, rid)
                    continue
                result.encoder = name
                self._upstream_calls(name, "encoder", "ok").inc()
                if isinstance(params, dict) and params:
                    self._encoder_calls(name, "ok").inc()
                    self.metrics.encoder_seconds.observe(time.monotonic() - t0)
                    result.params = params
                else:
                    self._encoder_calls(name, "not_announced").inc()
                    log.warning(
                        "%s (%s) answered without ec_transfer_params (request %s): is it started with the "
                        "tensorwire connector as ec_producer? The LLM instance encodes",
                        name,
                        url,
                        rid,
                    )
                return result
            if status in (408, 429) or status >= 500:
                detail = answer[:200].decode("utf-8", "replace")
                self._encoder_failed(i, "error_status", f"HTTP {status} {detail}", result, rid)
                continue
            self._encoder_calls(name, "rejected").inc()
            self._upstream_calls(name, "encoder", "ok").inc()
            result.encoder, result.refused = name, (status, ctype, answer)
            return result
        return result

    def _encoder_failed(self, index: int, outcome: str, message: str, result: EncodeResult, rid: str) -> None:
        name, url = self.encoders.names[index], self.encoders.urls[index]
        self.encoders.failed(index, message)
        self._encoder_calls(name, outcome).inc()
        self._upstream_calls(name, "encoder", outcome).inc()
        result.errors.append(f"{name}: {message}")
        log.warning("request %s: encoder instance %s (%s) failed (%s): %s", rid, name, url, outcome, message)

    # -- the LLM step ------------------------------------------------------------------------------------------

    async def _to_llm(
        self,
        request: web.BaseRequest,
        state: _State,
        key: int,
        target: str,
        payload: bytes | None,
        headers: dict[str, str],
        *,
        encoder: str | None,
    ) -> web.StreamResponse:
        cfg = self.config
        rid = state.rid
        timeout = aiohttp.ClientTimeout(total=None, sock_connect=cfg.connect_timeout_s, sock_read=cfg.llm_timeout_s)
        failures: list[str] = []
        for i in self.llms.order(include_down=True):
            name, url = self.llms.names[i], self.llms.urls[i]
            try:
                upstream = await self._up.open(url, request.method, target, payload, headers, timeout=timeout)
            except PeerUnavailable as exc:
                self.llms.failed(i, str(exc))
                self._upstream_calls(name, "llm", "unavailable").inc()
                failures.append(f"{name}: {exc}")
                log.warning("request %s: LLM instance %s (%s) unavailable: %s", rid, name, url, exc)
                continue
            except (DeadlineExceeded, ProtocolError) as exc:
                timed_out = isinstance(exc, DeadlineExceeded)
                if timed_out:
                    self.llms.failed(i, str(exc))
                self._upstream_calls(name, "llm", "timeout" if timed_out else "bad_answer").inc()
                state.route = "llm_failed"
                status = 504 if timed_out else 502
                log.error("request %s: %d from LLM instance %s (%s): %s", rid, status, name, url, exc)
                return _error(status, f"{name}: {exc}", "GatewayTimeout" if timed_out else "BadGateway", rid, encoder)
            return await self._relay(request, state, key, upstream, name, encoder)
        state.route = "llm_failed"
        log.error("request %s: 503, no LLM instance answered: %s", rid, "; ".join(failures))
        return _error(503, "no LLM instance answered: " + "; ".join(failures), "ServiceUnavailable", rid, encoder)

    async def _relay_whole(
        self, request: web.BaseRequest, state: _State, upstream: aiohttp.ClientResponse, name: str, encoder: str | None
    ) -> web.StreamResponse:
        """A small answer with a Content-Length: read whole (each read within ``llm_timeout_s``), then sent in one
        write with its headers (fewer system calls and wake-ups than chunk by chunk)."""
        try:
            body = await upstream.read()
        except (TimeoutError, aiohttp.ClientError) as exc:
            upstream.close()
            self._upstream_calls(name, "llm", "timeout" if isinstance(exc, TimeoutError) else "bad_answer").inc()
            state.route = "llm_failed"
            timed_out = isinstance(exc, TimeoutError)
            log.error(
                "request %s: %d, the answer from %s %s",
                state.rid,
                504 if timed_out else 502,
                name,
                "stalled" if timed_out else f"broke ({type(exc).__name__})",
            )
            return _error(
                504 if timed_out else 502,
                f"{name}: the answer {'stalled' if timed_out else 'broke'}",
                "GatewayTimeout" if timed_out else "BadGateway",
                state.rid,
                encoder,
            )
        upstream.release()
        self._upstream_calls(name, "llm", "ok").inc()
        out = web.Response(status=upstream.status, reason=upstream.reason, body=body)
        for k, v in upstream.headers.items():
            if k.lower() not in HOP_BY_HOP:
                out.headers.add(k, v)
        out.headers["X-Request-Id"] = state.rid
        out.headers["X-Tensorwire-Encoder"] = encoder or "none"
        state.count(self._requests)
        return out

    async def _write(self, request: web.BaseRequest, step: Any, size: int) -> None:
        """One write of ``size`` bytes to the client, within ``write_timeout_s``; ``_ClientGone`` when it stalls or
        went away. A write that leaves the connection's send buffer under ``_NO_WAIT_BYTES`` (below the
        transport's low-water mark: nothing can pause it) cannot wait for the client, so no timer is armed."""
        transport = request.transport
        try:
            if transport is not None and transport.get_write_buffer_size() + size <= _NO_WAIT_BYTES:
                await step
                return
            async with asyncio.timeout(self.config.write_timeout_s):
                await step
        except TimeoutError as exc:
            raise _ClientGone(f"the client read nothing for {self.config.write_timeout_s:g} s") from exc
        except (ConnectionError, aiohttp.ClientError, RuntimeError) as exc:
            raise _ClientGone(f"the client went away ({type(exc).__name__})") from exc

    async def _relay(
        self,
        request: web.BaseRequest,
        state: _State,
        key: int,
        upstream: aiohttp.ClientResponse,
        name: str,
        encoder: str | None,
    ) -> web.StreamResponse:
        """Relays the answer as it comes; each upstream read waits ``llm_timeout_s`` at most, each client write
        ``write_timeout_s``. A stall or a break on either side closes both connections (vLLM aborts the request
        whose client went away; the client sees its answer end early)."""
        length = upstream.content_length
        if length is not None and length <= _WHOLE_BYTES and "Content-Encoding" not in upstream.headers:
            return await self._relay_whole(request, state, upstream, name, encoder)
        out = _Relayed(status=upstream.status, reason=upstream.reason)
        for k, v in upstream.headers.items():
            if k.lower() not in HOP_BY_HOP:
                out.headers.add(k, v)
        out.headers["X-Request-Id"] = state.rid
        out.headers["X-Tensorwire-Encoder"] = encoder or "none"
        if length is not None and "Content-Encoding" not in upstream.headers:
            out.content_length = length
        self._active[key] = True
        outcome = "ok"
        try:
            await self._write(request, out.prepare(request), 0)
            # The status line and headers go out with the first write: count them in it.
            head = 64 + sum(len(k) + len(v) + 4 for k, v in out.headers.items())
            content = upstream.content
            while chunk := await content.readany():
                if content.at_eof():  # the last piece: with the end of the answer in one send
                    break
                await self._write(request, out.write(chunk), head + len(chunk))
                head = 0
            state.count(self._requests)  # before the client can see the end of its answer
            await self._write(request, out.write_eof(chunk), head + len(chunk))
        except (TimeoutError, aiohttp.ClientError) as exc:  # the instance stalled or broke mid-answer
            outcome = "cut"
            state.route = "llm_failed"
            why = "stalled" if isinstance(exc, TimeoutError) else f"broke ({type(exc).__name__})"
            log.error("request %s: the answer from %s %s after it started: cut off", state.rid, name, why)
            _abort(request, out)
        except _ClientGone as exc:
            outcome = "client_gone"
            log.info("request %s: %s mid-answer; closing the call to %s", state.rid, exc, name)
            _abort(request, out)
        finally:
            if outcome == "ok":
                upstream.release()
            else:
                upstream.close()
            if outcome != "client_gone":
                self._upstream_calls(name, "llm", outcome).inc()
        return out


class _Relayed(web.StreamResponse):
    """A relayed answer whose status line and headers go out with its first bytes, in one send (a stream that
    the instance sent whole goes out whole: headers, events and end; every send to the client wakes it once)."""

    _send_headers_immediately = False


@dataclass
class _State:
    rid: str
    route: str = "bad_request"
    counted: bool = False

    def count(self, requests: Callable[[str], Counter]) -> None:
        if not self.counted:
            self.counted = True
            requests(self.route).inc()


class _ClientGone(Exception):
    pass


def _abort(request: web.BaseRequest, out: web.StreamResponse) -> None:
    out.force_close()
    if request.transport is not None:
        request.transport.abort()


def _refuse(status: int, message: str, kind: str, rid: str) -> web.Response:
    """A request refused for its framing or spelling: the connection closes after the answer (what follows on it
    cannot be trusted to start a request)."""
    return _close(_error(status, message, kind, rid))


def _close(response: web.Response) -> web.Response:
    response.force_close()
    return response


def loop_factory(kind: str) -> Any:
    """The event loop ``kind`` names: ``uvloop`` (``auto``: when installed), else asyncio's."""
    if kind in ("auto", "uvloop"):
        try:
            import uvloop
        except ImportError:
            if kind == "uvloop":
                raise ConfigError("RouterConfig.loop='uvloop' but uvloop is not installed") from None
            return None
        return uvloop.new_event_loop
    return None


_RID_PREFIX = os.urandom(8).hex()
_rid_counter = itertools.count(1)


def request_id(request: web.BaseRequest) -> str:
    """The client's ``X-Request-Id`` when printable and at most 128 characters, else a new one: 32 hex digits, a
    random per-process prefix and a counter (unique without a system call per request)."""
    given = request.headers.get("X-Request-Id", "")
    if given and len(given) <= 128 and given.isprintable():
        return given
    return f"{_RID_PREFIX}{next(_rid_counter):016x}"
