"""The EPD router against hostile clients and broken instances: a regression test for each way the router built on
``http.server`` could be misused (params smuggled past it by path spelling or body framing, connections that
hold threads, a stop that cuts streams, a buffered stream, URLs shown to clients). No timing assertions: every
wait is a generous deadline on an outcome."""

from __future__ import annotations

import http.client
import json
import logging
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler
from typing import Any

import pytest
from _router_fakes import IMAGE_CHAT, SRC, TEXT_CHAT, Fake, encoder_answer, fake, llm_answer, post, raw_exchange

from tensorwire.integrations.vllm_router import Router, RouterConfig

EVIL = {"evil": {"tensorwire": {"endpoint": "10.9.9.9:1"}}}


@pytest.fixture
def fakes() -> Iterator[list[Fake]]:
    made: list[Fake] = []
    yield made
    for f in made:
        f.close()


def _params_seen(llm: Fake) -> list[Any]:
    """Every transfer param the LLM instance got, wherever vLLM would read it."""
    out = []
    for _, _, body, _ in llm.seen:
        if not isinstance(body, dict):
            continue
        out += [body[k] for k in ("ec_transfer_params", "kv_transfer_params") if k in body]
        for nest in (body.get("vllm_xargs"), (body.get("sampling_params") or {}).get("extra_args")):
            if isinstance(nest, dict):
                out += [nest[k] for k in ("ec_transfer_params", "kv_transfer_params") if k in nest]
    return out


@pytest.mark.parametrize(
    "path",
    [
        "/v1/chat/%63ompletions",
        "/v1/chat/completions/",
        "/v1/./chat/completions",
        "/v1//chat/completions",
        "/v1/completions",
        "/v1/chat/completions?x=1",
        "/v1/messages",
        "/inference/v1/generate",
    ],
)
def test_client_params_never_reach_an_llm_instance_whatever_the_path(fakes: list[Fake], path: str) -> None:
    enc, llm = fake(fakes, encoder_answer("e")), fake(fakes, llm_answer)
    bodies = [
        dict(TEXT_CHAT, ec_transfer_params=EVIL),
        dict(TEXT_CHAT, kv_transfer_params=EVIL),
        dict(TEXT_CHAT, vllm_xargs={"ec_transfer_params": "x", "kv_transfer_params": "y", "keep": 1}),
        {"prompt": [1, 2], "sampling_params": {"extra_args": {"ec_transfer_params": EVIL}}},
    ]
    with Router(RouterConfig(encoders=(enc.url,), llms=(llm.url,), port=0)) as router:
        for body in bodies:
            status, _, _ = post(router, body, path=path)
            assert status in (200, 400), (path, status)
    assert _params_seen(llm) == [], path
    kept = [b["vllm_xargs"] for _, _, b, _ in llm.seen if isinstance(b, dict) and "vllm_xargs" in b]
    assert all(x == {"keep": 1} for x in kept)  # the rest of vllm_xargs is the client's to send


@pytest.mark.parametrize(
    "path",
    [
        "/v1/chat/%63ompletions",
        "/v1/chat/completions/",
        "/v1/../v1/chat/completions",
        "http://evil/v1/chat/completions",
    ],
)
def test_non_canonical_paths_are_refused(fakes: list[Fake], path: str) -> None:
    enc, llm = fake(fakes, encoder_answer("e")), fake(fakes, llm_answer)
    with Router(RouterConfig(encoders=(enc.url,), llms=(llm.url,), port=0)) as router:
        body = json.dumps(TEXT_CHAT).encode()
        answer = raw_exchange(
            router.port,
            b"POST %s HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            b"Content-Length: %d\r\nConnection: close\r\n\r\n%s" % (path.encode(), len(body), body),
        )
    assert answer.startswith(b"HTTP/1.1 400"), answer[:200]
    assert llm.seen == [] and enc.seen == []


@pytest.mark.parametrize(
    "framing",
    [
        b"Content-Length: 2\r\nContent-Length: 120",
        b"Content-Length: 0_2",
        b"Content-Length: +2",
        b"Transfer-Encoding: gzip, chunked",
        b"Transfer-Encoding: chunked\r\nContent-Length: 2",
    ],
)
def test_smuggled_requests_never_run_upstream(fakes: list[Fake], framing: bytes) -> None:
    enc, llm = fake(fakes, encoder_answer("e")), fake(fakes, llm_answer)
    smuggled = json.dumps(dict(TEXT_CHAT, ec_transfer_params=EVIL)).encode()
    tail = b"POST /v1/smuggled HTTP/1.1\r\nHost: x\r\nContent-Length: %d\r\n\r\n%s" % (len(smuggled), smuggled)
    body = b"{}" if b"chunked" not in framing else b"2\r\n{}\r\n0\r\n\r\n"
    with Router(RouterConfig(encoders=(enc.url,), llms=(llm.url,), port=0)) as router:
        answer = raw_exchange(
            router.port, b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n%s\r\n\r\n%s%s" % (framing, body, tail)
        )
    assert answer.startswith((b"HTTP/1.0 400", b"HTTP/1.1 400")), answer[:300]
    assert [p for _, p, _, _ in llm.seen if "smuggled" in p] == [] and _params_seen(llm) == []


def _sse_gated(first: bytes, rest: list[bytes], gate: threading.Event) -> Any:
    """A streamed answer: ``first``, then waits for ``gate`` (set once the client got ``first``), then ``rest``."""

    def write(h: BaseHTTPRequestHandler) -> None:
        h.wfile.write(b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n\r\n")
        for i, c in enumerate([first, *rest]):
            if i == 1:
                gate.wait(20)
            h.wfile.write(b"%x\r\n%s\r\n" % (len(c), c))
            h.wfile.flush()
        h.wfile.write(b"0\r\n\r\n")

    return write


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_streams_are_relayed_as_they_come_on_every_path(fakes: list[Fake], path: str) -> None:
    gate = threading.Event()
    events = [b'data: {"n": 1}\n\n', b"data: [DONE]\n\n"]
    enc = fake(fakes, encoder_answer("e"))
    llm = fake(fakes, lambda p, b: (200, _sse_gated(events[0], events[1:], gate)))
    with Router(RouterConfig(encoders=(enc.url,), llms=(llm.url,), port=0)) as router:
        conn = http.client.HTTPConnection("127.0.0.1", router.port, timeout=10)
        conn.request(
            "POST",
            path,
            json.dumps({"model": "m", "prompt": "hi", "stream": True, "messages": TEXT_CHAT["messages"]}).encode(),
            {"Content-Type": "application/json"},
        )
        resp = conn.getresponse()
        # The first event arrives while the instance still holds the rest back: a buffering router times out here.
        assert resp.read1(len(events[0])) == events[0]
        gate.set()
        assert resp.read() == events[1]
        conn.close()


def test_idle_slow_and_half_sent_connections_are_closed_and_hold_no_thread(fakes: list[Fake]) -> None:
    enc, llm = fake(fakes, encoder_answer("e")), fake(fakes, llm_answer)
    threads_before = threading.active_count()
    cfg = RouterConfig(encoders=(enc.url,), llms=(llm.url,), port=0, idle_timeout_s=1.0, body_timeout_s=1.0)
    with Router(cfg) as router:
        socks = []
        try:
            for i in range(60):
                s = socket.create_connection(("127.0.0.1", router.port), timeout=30)
                if i % 3 == 0:
                    s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n")  # headers never finished
                elif i % 3 == 1:
                    s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 1000000\r\n\r\n{}")
                socks.append(s)
            status, _, _ = post(router, TEXT_CHAT)  # still served
            assert status == 200
            assert threading.active_count() - threads_before < 10  # not a thread per connection
            answers = []
            for s in socks:  # each one is closed by the router (EOF), a short body after a 408
                data = b""
                while chunk := s.recv(65536):
                    data += chunk
                answers.append(data)
        finally:
            for s in socks:
                s.close()
    assert all(a == b"" for a in answers[0::3]) and all(a == b"" for a in answers[2::3])
    assert all(a.startswith(b"HTTP/1.1 408") for a in answers[1::3])
    assert [p for _, p, _, _ in llm.seen] == ["/v1/chat/completions"]


def test_upstream_connections_are_pooled_and_tracing_headers_forwarded(fakes: list[Fake]) -> None:
    enc, llm = fake(fakes, encoder_answer("e")), fake(fakes, llm_answer)
    ports: list[int] = []
    orig = llm.httpd.RequestHandlerClass.handle_one_request

    def record(h: Any) -> None:
        ports.append(h.client_address[1])
        orig(h)

    llm.httpd.RequestHandlerClass.handle_one_request = record  # type: ignore[method-assign]
    trace = {"traceparent": "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01", "tracestate": "k=v"}
    with Router(RouterConfig(encoders=(enc.url,), llms=(llm.url,), port=0)) as router:
        for _ in range(6):
            assert post(router, TEXT_CHAT, headers=trace)[0] == 200
    assert len({p for p in ports}) < 6, ports  # a new connection per call would use 6 ports
    assert all(h.get("traceparent") == trace["traceparent"] and h.get("tracestate") == "k=v" for _, _, _, h in llm.seen)


def test_operator_metrics_and_502_504_logged_with_the_request_id(
    fakes: list[Fake], caplog: pytest.LogCaptureFixture
) -> None:
    enc, llm = fake(fakes, encoder_answer("e")), fake(fakes, llm_answer)
    broken = fake(fakes, lambda p, b: (200, b"x"))
    broken.httpd.RequestHandlerClass.do_POST = lambda h: h.wfile.write(b"garbage\r\n\r\n")  # type: ignore[attr-defined, method-assign]
    with Router(RouterConfig(encoders=(enc.url,), llms=(llm.url,), port=0)) as router:
        assert post(router, IMAGE_CHAT)[0] == 200
        conn = http.client.HTTPConnection("127.0.0.1", router.port, timeout=30)
        conn.request("GET", "/metrics")
        text = conn.getresponse().read().decode()
        conn.close()
    for name in (
        "tensorwire_vllm_router_request_seconds_bucket",
        "tensorwire_vllm_router_in_flight_requests",
        'tensorwire_vllm_router_upstream_calls_total{outcome="ok",role="llm",upstream="llm-0"}',
        'tensorwire_vllm_router_upstream_calls_total{outcome="ok",role="encoder",upstream="encoder-0"}',
        "process_resident_memory_bytes",
    ):
        assert name in text, name
    assert enc.url not in text and llm.url not in text
    caplog.set_level(logging.WARNING, logger="tensorwire.integrations.vllm_router")
    with Router(RouterConfig(encoders=(enc.url,), llms=(broken.url,), port=0)) as router:
        status, _, body = post(router, TEXT_CHAT, headers={"X-Request-Id": "rid-502"})
    assert status == 502 and broken.url not in json.dumps(body)
    assert any("rid-502" in r.getMessage() and "502" in r.getMessage() for r in caplog.records)


def _spawn(*argv: str) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "-m", "tensorwire.integrations.vllm_router", *argv],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=dict(os.environ, PYTHONPATH=f"{SRC}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"),
    )


def _port_of(proc: subprocess.Popen[str]) -> int:
    assert proc.stdout is not None
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        line = proc.stdout.readline()
        assert line or proc.poll() is None, "the router exited"
        if "listening on" in line:
            return int(line.rsplit(":", 1)[1])
    raise AssertionError("no 'listening on' line within 60 s")


def test_sigterm_lets_running_streams_finish_then_exits_0(fakes: list[Fake]) -> None:
    gate = threading.Event()
    events = [b'data: {"n": %d}\n\n' % i for i in range(5)] + [b"data: [DONE]\n\n"]
    enc = fake(fakes, encoder_answer("e"))
    llm = fake(fakes, lambda p, b: (200, _sse_gated(events[0], events[1:], gate)))
    proc = _spawn("--port", "0", "--encoder", enc.url, "--llm", llm.url, "--drain-s", "0", "--grace-s", "60")
    try:
        port = _port_of(proc)
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
        conn.request(
            "POST",
            "/v1/completions",
            json.dumps({"model": "m", "prompt": "x", "stream": True}).encode(),
            {"Content-Type": "application/json"},
        )
        resp = conn.getresponse()
        assert resp.read1(len(events[0])) == events[0]
        proc.send_signal(signal.SIGTERM)
        # The listener closes; the stream in flight goes on.
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            try:
                socket.create_connection(("127.0.0.1", port), timeout=5).close()
            except OSError:
                break
            time.sleep(0.05)
        else:
            raise AssertionError("still accepting connections 30 s after SIGTERM")
        gate.set()
        assert resp.read() == b"".join(events[1:])  # not cut
        conn.close()
        assert proc.wait(timeout=60) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.stdout is not None
    out = proc.stdout.read()
    proc.stdout.close()
    assert "waiting up to 60.0 s for 1 request(s) in flight (1 streamed" in out and "drained" in out, out


def test_health_answers_503_while_draining(fakes: list[Fake]) -> None:
    enc, llm = fake(fakes, encoder_answer("e")), fake(fakes, llm_answer)
    proc = _spawn("--port", "0", "--encoder", enc.url, "--llm", llm.url, "--drain-s", "30")
    try:
        port = _port_of(proc)
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
        conn.request("GET", "/health")
        assert conn.getresponse().read() and True
        proc.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + 30
        status = 200
        while status == 200 and time.monotonic() < deadline:
            conn.request("GET", "/health")
            resp = conn.getresponse()
            resp.read()
            status = resp.status
        assert status == 503
        conn.close()
        assert post(type("R", (), {"port": port})(), TEXT_CHAT)[0] == 200  # still served meanwhile
        proc.send_signal(signal.SIGTERM)  # a second signal: stop now
        assert proc.wait(timeout=60) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        assert proc.stdout is not None
        proc.stdout.close()


def test_exit_codes_port_in_use_and_plaintext_off_loopback(fakes: list[Fake]) -> None:
    llm = fake(fakes, llm_answer)
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen(1)
        proc = _spawn("--port", str(taken.getsockname()[1]), "--encoder", llm.url, "--llm", llm.url)
        out, _ = proc.communicate(timeout=60)
    assert proc.returncode == 3 and "in use" in out, out
    proc = _spawn("--host", "0.0.0.0", "--port", "0", "--encoder", llm.url, "--llm", llm.url)
    out, _ = proc.communicate(timeout=60)
    assert proc.returncode == 2 and "--insecure" in out, out
