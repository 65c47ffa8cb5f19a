"""The EPD router: an HTTP front for ``vllm serve`` encoder instances and LLM instances (standard library only).

A chat request with media goes to an encoder instance first (round-robin; a one-token, non-streamed copy, see
``rewrite``), whose answer carries ``ec_transfer_params``; the client's own request then goes to an LLM instance
with those params, and its answer (streamed or not) goes back to the client as it comes. Anything else is
passed to an LLM instance as is (``GET /v1/models``, text-only chats, ``/v1/completions``, ...); ``GET
/health`` and ``GET /metrics`` are the router's own.

Failures, each answered with vLLM's error body ``{"error": {"message", "type", "param", "code"}}``:

- an encoder instance refuses, times out (``encoder_timeout_s``), answers 408/429/5xx or garbage: the next one
  is tried (the failed one goes last for ``encoder_cooldown_s``); when none answers, ``fallback=local`` sends
  the request on without params (it carries the media: the LLM instance encodes it), ``fallback=fail``
  answers 503 naming every instance tried and why;
- an encoder instance answers another 4xx: the request itself is refused, that answer goes to the client;
- an LLM instance refuses the connection: the next one is tried; one that times out or breaks after the
  request went out is not retried (it may have run): 504 or 502. A streamed answer that stalls for
  ``llm_timeout_s`` is cut off.

Every answer carries ``X-Request-Id`` (the client's, else a new one, also sent to the instances) and
``X-Tensorwire-Encoder`` (the encoder instance used, ``none`` when no encoder was needed or none answered).
"""

from __future__ import annotations

import json
import logging
import threading
import time
import uuid
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any
from urllib.parse import urlsplit

from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from tensorwire.errors import ClosedError, DeadlineExceeded, PeerUnavailable, ProtocolError
from tensorwire.integrations._vllm_router import rewrite, upstream
from tensorwire.integrations._vllm_router.balance import RoundRobin
from tensorwire.integrations._vllm_router.config import RouterConfig
from tensorwire.integrations._vllm_router.metrics import RouterMetrics

log = logging.getLogger("tensorwire.integrations.vllm_router")

_FORWARDED_HEADERS = ("authorization", "accept", "user-agent")


@dataclass
class EncodeResult:
    """What the encoder step gave: ``params`` (None: none announced), or a client error to relay (``refused``)."""

    encoder: str | None = None
    params: dict[str, Any] | None = None
    refused: upstream.Answer | None = None
    errors: list[str] = field(default_factory=list)


def error_body(status: int, message: str, kind: str) -> bytes:
    return json.dumps({"error": {"message": message, "type": kind, "param": None, "code": status}}).encode()


class Router:
    """Owns the listening socket and its threads. ``start()`` serves in a background thread, ``serve_forever()``
    in the caller's; ``close()`` stops accepting, lets running requests end on their own timeouts, and is
    idempotent. Thread-safety: requests are handled on a thread each; ``close()`` may run on any thread."""

    def __init__(self, config: RouterConfig) -> None:
        self.config = config
        self.metrics = RouterMetrics()
        self._encoders = RoundRobin(config.encoders, config.encoder_cooldown_s)
        self.llm_ring = RoundRobin(config.llms, config.encoder_cooldown_s)
        self._httpd = _HTTPServer((config.host, config.port), _Handler)
        self._httpd.router = self
        self._thread: threading.Thread | None = None
        self._closed = False
        self._lock = threading.Lock()
        log.info("vLLM EPD router on %s: encoder instances %s, LLM instances %s, fallback %s", self.address,
                 ", ".join(config.encoders), ", ".join(config.llms), config.fallback)

    @property
    def port(self) -> int:
        return int(self._httpd.server_address[1])

    @property
    def address(self) -> str:
        host = self.config.host if ":" not in self.config.host else f"[{self.config.host}]"
        return f"http://{host}:{self.port}"

    def start(self) -> Router:
        with self._lock:
            if self._closed:
                raise ClosedError("the router is closed")
            if self._thread is None:
                self._thread = threading.Thread(target=self._httpd.serve_forever, name="tensorwire-router",
                                                daemon=True)
                self._thread.start()
        return self

    def serve_forever(self) -> None:
        self._httpd.serve_forever()

    def close(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
            thread = self._thread
        if thread is not None:
            self._httpd.shutdown()
            thread.join(timeout=10)
        self._httpd.server_close()

    def __enter__(self) -> Router:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- the two steps -----------------------------------------------------------------------------------------

    def encode(self, path: str, body: dict[str, Any], headers: dict[str, str]) -> EncodeResult:
        """Asks the encoder instances in turn until one answers; see the module docstring for what counts."""
        payload = json.dumps(rewrite.encoder_body(body)).encode()
        result = EncodeResult()
        for i in self._encoders.order():
            url = self.config.encoders[i]
            t0 = time.monotonic()
            try:
                answer = upstream.post(url, "POST", path, payload, headers,
                                       connect_timeout_s=self.config.connect_timeout_s,
                                       timeout_s=self.config.encoder_timeout_s)
            except (PeerUnavailable, DeadlineExceeded, ProtocolError) as exc:
                outcome = {PeerUnavailable: "unavailable", DeadlineExceeded: "timeout"}.get(type(exc), "bad_answer")
                self._encoder_failed(i, outcome, str(exc), result)
                continue
            if answer.status == 200:
                try:
                    data = json.loads(answer.body)
                    params = data.get(rewrite.PARAMS_FIELD) if isinstance(data, dict) else None
                except ValueError:
                    self._encoder_failed(i, "bad_answer", f"{url}: the answer is not JSON", result)
                    continue
                self._encoders.ok(i)
                result.encoder = url
                if isinstance(params, dict) and params:
                    self.metrics.encoder_calls.labels(url, "ok").inc()
                    self.metrics.encoder_seconds.observe(time.monotonic() - t0)
                    result.params = params
                else:
                    self.metrics.encoder_calls.labels(url, "not_announced").inc()
                    log.warning("encoder instance %s answered without ec_transfer_params (request %s): is it "
                                "started with the tensorwire connector as ec_producer? The LLM instance encodes",
                                url, headers.get("X-Request-Id"))
                return result
            if answer.status in (408, 429) or answer.status >= 500:
                detail = answer.body[:200].decode("utf-8", "replace")
                self._encoder_failed(i, "error_status", f"{url}: HTTP {answer.status} {detail}", result)
                continue
            self.metrics.encoder_calls.labels(url, "rejected").inc()
            result.encoder, result.refused = url, answer
            return result
        return result

    def _encoder_failed(self, index: int, outcome: str, message: str, result: EncodeResult) -> None:
        self._encoders.failed(index)
        self.metrics.encoder_calls.labels(self.config.encoders[index], outcome).inc()
        result.errors.append(message)
        log.warning("encoder instance failed (%s): %s", outcome, message)


class _HTTPServer(ThreadingHTTPServer):
    daemon_threads = True
    router: Router


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server: _HTTPServer
    _rid = ""

    def log_message(self, format: str, *args: Any) -> None:
        log.debug("%s %s", self.address_string(), format % args)

    # -- entry points ------------------------------------------------------------------------------------------

    def do_GET(self) -> None:
        self._begin()
        path = urlsplit(self.path).path
        if path == "/health":
            self._send(200, json.dumps({"status": "ok"}).encode(), "application/json")
        elif path == "/metrics":
            self._send(200, generate_latest(self.server.router.metrics.registry), CONTENT_TYPE_LATEST)
        else:
            self._to_llm("GET", None, stream=False, encoder=None)

    def do_POST(self) -> None:
        self._begin()
        router = self.server.router
        raw = self._read_body()
        if raw is None:
            return
        path = urlsplit(self.path).path
        if path not in rewrite.CHAT_PATHS:
            self._to_llm("POST", raw, stream=False, encoder=None, passthrough=True)
            return
        try:
            body = json.loads(raw)
        except ValueError as exc:
            self._refuse(400, f"the request body is not JSON: {exc}")
            return
        if not isinstance(body, dict):
            self._refuse(400, "the request body must be a JSON object")
            return
        body, dropped = rewrite.client_body(body)
        if dropped:
            router.metrics.client_params_dropped.inc()
        stream = rewrite.wants_stream(body)
        if not rewrite.has_media(body):
            router.metrics.requests.labels("text").inc()
            self._to_llm("POST", json.dumps(body).encode(), stream=stream, encoder=None)
            return
        result = router.encode(self.path, body, self._upstream_headers())
        if result.refused is not None:
            router.metrics.requests.labels("encoder_rejected").inc()
            self._send(result.refused.status, result.refused.body, _content_type(result.refused.headers),
                       encoder=result.encoder)
            return
        if result.encoder is None:
            if router.config.fallback == "fail":
                router.metrics.requests.labels("no_encoder").inc()
                self._send(503, error_body(503, "no encoder instance answered: " + "; ".join(result.errors),
                                           "ServiceUnavailable"), "application/json")
                return
            router.metrics.requests.labels("fallback_local").inc()
        else:
            router.metrics.requests.labels("encoded" if result.params else "not_announced").inc()
        self._to_llm("POST", json.dumps(rewrite.llm_body(body, result.params)).encode(), stream=stream,
                     encoder=result.encoder)

    # -- the LLM step ------------------------------------------------------------------------------------------

    def _to_llm(self, method: str, payload: bytes | None, *, stream: bool, encoder: str | None,
                passthrough: bool = False) -> None:
        router = self.server.router
        headers = self._upstream_headers(json_body=payload is not None and not passthrough)
        if passthrough and self.headers.get("Content-Type"):
            headers["Content-Type"] = self.headers["Content-Type"]
        cfg = router.config
        failures: list[str] = []
        for i in router.llm_ring.order():
            url = cfg.llms[i]
            try:
                if stream and payload is not None:
                    relay = upstream.open_stream(url, self.path, payload, headers,
                                                 connect_timeout_s=cfg.connect_timeout_s,
                                                 idle_timeout_s=cfg.llm_timeout_s)
                    router.llm_ring.ok(i)
                    self._relay(relay, encoder)
                    return
                answer = upstream.post(url, method, self.path, payload, headers,
                                       connect_timeout_s=cfg.connect_timeout_s, timeout_s=cfg.llm_timeout_s)
            except PeerUnavailable as exc:
                router.llm_ring.failed(i)
                failures.append(str(exc))
                continue
            except DeadlineExceeded as exc:
                router.metrics.requests.labels("llm_failed").inc()
                self._send(504, error_body(504, str(exc), "GatewayTimeout"), "application/json", encoder=encoder)
                return
            except ProtocolError as exc:
                router.metrics.requests.labels("llm_failed").inc()
                self._send(502, error_body(502, str(exc), "BadGateway"), "application/json", encoder=encoder)
                return
            router.llm_ring.ok(i)
            self._send(answer.status, answer.body, _content_type(answer.headers), encoder=encoder)
            return
        router.metrics.requests.labels("llm_failed").inc()
        self._send(503, error_body(503, "no LLM instance answered: " + "; ".join(failures), "ServiceUnavailable"),
                   "application/json", encoder=encoder)

    def _relay(self, relay: upstream.Stream, encoder: str | None) -> None:
        """Streams the LLM instance's answer to the client in chunks as they come; a stall or a broken upstream
        ends the answer without its last chunk (the client sees a truncated stream, never a hang)."""
        try:
            self.send_response(relay.status)
            for k, v in relay.headers:
                if k.lower() not in ("x-request-id",):
                    self.send_header(k, v)
            self._common_headers(encoder)
            self.send_header("Transfer-Encoding", "chunked")
            self.end_headers()
            while True:
                try:
                    chunk = relay.read()
                except (DeadlineExceeded, ProtocolError) as exc:
                    log.warning("streamed answer cut off: %s", exc)
                    self.close_connection = True
                    return
                if not chunk:
                    break
                self.wfile.write(b"%x\r\n%s\r\n" % (len(chunk), chunk))
                self.wfile.flush()
            self.wfile.write(b"0\r\n\r\n")
            self.wfile.flush()
        except OSError:  # the client went away: closing the upstream connection aborts the request in vLLM
            self.close_connection = True
        finally:
            relay.close()

    # -- helpers -----------------------------------------------------------------------------------------------

    def _read_body(self) -> bytes | None:
        if "chunked" in self.headers.get("Transfer-Encoding", "").lower():
            self._refuse(411, "chunked request bodies are not supported: send Content-Length")
            return None
        try:
            length = int(self.headers.get("Content-Length", "0"))
        except ValueError:
            self._refuse(400, "Content-Length is not a number")
            return None
        limit = self.server.router.config.max_body_bytes
        if length < 0 or length > limit:
            self._refuse(413, f"request body of {length} bytes; the router takes at most {limit}")
            return None
        return self.rfile.read(length)

    def _begin(self) -> None:
        """Per request (one handler serves every request of a keep-alive connection): its id."""
        given = self.headers.get("X-Request-Id", "")
        self._rid = given if given and len(given) <= 128 and given.isprintable() else uuid.uuid4().hex

    def _request_id(self) -> str:
        return self._rid

    def _upstream_headers(self, json_body: bool = True) -> dict[str, str]:
        headers = {k: v for k in _FORWARDED_HEADERS if (v := self.headers.get(k)) is not None}
        headers["X-Request-Id"] = self._request_id()
        if json_body:
            headers["Content-Type"] = "application/json"
        return headers

    def _common_headers(self, encoder: str | None) -> None:
        self.send_header("X-Request-Id", self._request_id())
        self.send_header("X-Tensorwire-Encoder", encoder or "none")

    def _send(self, status: int, body: bytes, content_type: str, encoder: str | None = None) -> None:
        try:
            self.send_response(status)
            self.send_header("Content-Type", content_type)
            self.send_header("Content-Length", str(len(body)))
            self._common_headers(encoder)
            self.end_headers()
            self.wfile.write(body)
        except OSError:
            self.close_connection = True

    def _refuse(self, status: int, message: str) -> None:
        self.server.router.metrics.requests.labels("bad_request").inc()
        self.close_connection = True
        self._send(status, error_body(status, message, "BadRequestError"), "application/json")


def _content_type(headers: list[tuple[str, str]]) -> str:
    for k, v in headers:
        if k.lower() == "content-type":
            return v
    return "application/json"
