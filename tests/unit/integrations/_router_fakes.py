"""Stand-in vLLM instances for the router's tests: plain HTTP servers that record what they get and answer as
vLLM's OpenAI server would, plus a client that speaks raw HTTP."""

from __future__ import annotations

import http.client
import json
import socket
import threading
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

IMAGE_CHAT = {
    "model": "m",
    "max_tokens": 8,
    "logprobs": True,
    "top_logprobs": 3,
    "messages": [
        {
            "role": "user",
            "content": [
                {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}},
                {"type": "text", "text": "describe"},
            ],
        }
    ],
}
TEXT_CHAT = {"model": "m", "max_tokens": 8, "messages": [{"role": "user", "content": "hello"}]}
SRC = Path(__file__).resolve().parents[3] / "src"


class Fake:
    """A stand-in instance: ``answer(path, body) -> (status, body dict | bytes)``; records every request."""

    def __init__(self, answer: Callable[[str, Any], tuple[int, Any]]) -> None:
        self.seen: list[tuple[str, str, Any, dict[str, str]]] = []
        self.probes = 0  # GET /health (the router's probes), answered by health() and not recorded in seen
        self.record_health = False
        self.health: Callable[[], tuple[int, Any]] = lambda: (200, {"status": "ok"})
        fake = self

        class H(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *a: Any) -> None:
                pass

            def _handle(self, method: str) -> None:
                n = int(self.headers.get("Content-Length", "0"))
                raw = self.rfile.read(n) if n else b""
                if method == "GET" and self.path == "/health" and not fake.record_health:
                    fake.probes += 1
                    status, out = fake.health()
                else:
                    try:
                        body = json.loads(raw) if raw else None
                    except ValueError:
                        body = raw
                    fake.seen.append((method, self.path, body, dict(self.headers)))
                    status, out = answer(self.path, body)
                if callable(out):  # a streamer: writes the answer itself
                    out(self)
                    return
                data = out if isinstance(out, bytes) else json.dumps(out).encode()
                self.wfile.write(
                    b"HTTP/1.1 %d X\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n%s"
                    % (status, len(data), data)
                )  # one send: no Nagle wait

            def do_POST(self) -> None:
                self._handle("POST")

            def do_GET(self) -> None:
                self._handle("GET")

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), H)
        self.httpd.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        self._t = threading.Thread(target=self.httpd.serve_forever, daemon=True)
        self._t.start()

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()


def encoder_answer(tag: str) -> Callable[[str, Any], tuple[int, Any]]:
    def answer(path: str, body: Any) -> tuple[int, Any]:
        return 200, {
            "id": "x",
            "choices": [{"index": 0, "message": {"content": "a"}}],
            "ec_transfer_params": {"hash-" + tag: {"item_indices": [0], "tensorwire": {"v": 1}}},
        }

    return answer


def llm_answer(path: str, body: Any) -> tuple[int, Any]:
    return 200, {
        "id": "y",
        "choices": [{"index": 0, "message": {"content": "fine"}}],
        "echo_params": (body or {}).get("ec_transfer_params"),
    }


def fake(fakes: list[Fake], answer: Callable[[str, Any], tuple[int, Any]]) -> Fake:
    f = Fake(answer)
    fakes.append(f)
    return f


def closed_url() -> str:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"http://127.0.0.1:{s.getsockname()[1]}"  # closed when the block ends: connecting is refused


def post(
    router: Any,
    body: Any,
    path: str = "/v1/chat/completions",
    timeout_s: float = 30.0,
    headers: dict[str, str] | None = None,
) -> tuple[int, dict[str, str], Any]:
    conn = http.client.HTTPConnection("127.0.0.1", router.port, timeout=timeout_s)
    try:
        conn.request("POST", path, json.dumps(body).encode(), {"Content-Type": "application/json", **(headers or {})})
        resp = conn.getresponse()
        raw = resp.read()
        return resp.status, {k.lower(): v for k, v in resp.getheaders()}, json.loads(raw) if raw else None
    finally:
        conn.close()


def raw_exchange(port: int, data: bytes, timeout_s: float = 30.0) -> bytes:
    """Sends ``data`` as is on a new connection and reads until the router closes it."""
    with socket.create_connection(("127.0.0.1", port), timeout=timeout_s) as s:
        s.sendall(data)
        out = b""
        while chunk := s.recv(65536):
            out += chunk
        return out


class Mute:
    """A listener that accepts connections and never answers (a hung instance)."""

    def __init__(self) -> None:
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(64)
        self.url = f"http://127.0.0.1:{self.sock.getsockname()[1]}"

    def close(self) -> None:
        self.sock.close()
