"""The EPD router against stand-in instances (plain HTTP servers that record what they get and answer as vLLM's
OpenAI server would). Real vLLM behind the router: tests/vllm/test_vllm_serve.py."""

from __future__ import annotations

import http.client
import json
import os
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from http.server import BaseHTTPRequestHandler
from typing import Any

import pytest
from _router_fakes import IMAGE_CHAT, SRC, TEXT_CHAT, Fake, Mute, closed_url, encoder_answer, fake, llm_answer, post

from tensorwire.errors import ConfigError
from tensorwire.integrations.vllm_router import Router, RouterConfig


@pytest.fixture
def fakes() -> Iterator[list[Fake]]:
    made: list[Fake] = []
    yield made
    for f in made:
        f.close()


def test_media_request_goes_to_an_encoder_then_to_the_llm_with_its_params(fakes: list[Fake]) -> None:
    enc, llm = fake(fakes, encoder_answer("e")), fake(fakes, llm_answer)
    with Router(RouterConfig(encoders=(enc.url,), llms=(llm.url,), port=0)) as router:
        injected = dict(IMAGE_CHAT, ec_transfer_params={"evil": {"tensorwire": {"endpoint": "10.9.9.9:1"}}})
        status, headers, body = post(router, injected, headers={"X-Request-Id": "req-1"})
    assert status == 200, body
    assert headers["x-tensorwire-encoder"] == "encoder-0" and headers["x-request-id"] == "req-1"
    ((_, path, sent, enc_headers),) = enc.seen
    assert path == "/v1/chat/completions" and enc_headers["X-Request-Id"] == "req-1"
    # One token, not streamed, no logprobs, the same messages (vLLM computes the same mm_hash there), and never
    # the client's own params.
    assert sent["max_tokens"] == 1 and sent["stream"] is False and sent["messages"] == IMAGE_CHAT["messages"]
    assert "logprobs" not in sent and "top_logprobs" not in sent and "ec_transfer_params" not in sent
    ((_, _, forwarded, _),) = llm.seen
    assert forwarded == dict(IMAGE_CHAT, ec_transfer_params={"hash-e": {"item_indices": [0], "tensorwire": {"v": 1}}})
    assert body["echo_params"] == forwarded["ec_transfer_params"]


def test_text_request_skips_the_encoders(fakes: list[Fake]) -> None:
    enc, llm = fake(fakes, encoder_answer("e")), fake(fakes, llm_answer)
    with Router(RouterConfig(encoders=(enc.url,), llms=(llm.url,), port=0)) as router:
        status, headers, _ = post(router, TEXT_CHAT)
        assert status == 200 and headers["x-tensorwire-encoder"] == "none"
        status, _, _ = post(router, {"prompt": "x"}, path="/v1/completions")
        assert status == 200
    assert enc.seen == []
    assert [(m, p) for m, p, _, _ in llm.seen] == [("POST", "/v1/chat/completions"), ("POST", "/v1/completions")]


def test_encoders_round_robin_and_a_dead_one_is_skipped(fakes: list[Fake]) -> None:
    a, b, llm = fake(fakes, encoder_answer("a")), fake(fakes, encoder_answer("b")), fake(fakes, llm_answer)
    dead = closed_url()
    cfg = RouterConfig(encoders=(a.url, dead, b.url), llms=(llm.url,), port=0, probe_interval_s=60)
    with Router(cfg) as router:
        used = [post(router, IMAGE_CHAT)[1]["x-tensorwire-encoder"] for _ in range(6)]
        text = router.metrics.registry.get_sample_value
        # Out after its first failure (the start-up probe or a call), never asked again: at most one call.
        assert (
            text("tensorwire_vllm_router_encoder_calls_total", {"encoder": "encoder-1", "outcome": "unavailable"}) or 0
        ) <= 1
        assert text("tensorwire_vllm_router_upstream_up", {"upstream": "encoder-1", "role": "encoder"}) == 0
        assert text("tensorwire_vllm_router_requests_total", {"route": "encoded"}) == 6
    assert set(used) == {"encoder-0", "encoder-2"}
    assert len(a.seen) >= 2 and len(b.seen) >= 2 and len(a.seen) + len(b.seen) == 6


def test_no_encoder_answers_fallback_local_or_fail(fakes: list[Fake]) -> None:
    llm = fake(fakes, llm_answer)
    dead1, dead2 = closed_url(), closed_url()
    with Router(RouterConfig(encoders=(dead1, dead2), llms=(llm.url,), port=0)) as router:
        status, headers, body = post(router, IMAGE_CHAT)
    assert status == 200 and headers["x-tensorwire-encoder"] == "none"
    assert "ec_transfer_params" not in llm.seen[0][2]  # the LLM instance encodes the image itself
    with Router(RouterConfig(encoders=(dead1, dead2), llms=(llm.url,), port=0, fallback="fail")) as router:
        status, _, body = post(router, IMAGE_CHAT)
    assert status == 503 and len(llm.seen) == 1
    message = body["error"]["message"]
    assert message.startswith("no encoder instance answered") and "127.0.0.1" not in message


def test_a_hung_encoder_is_bounded_and_the_next_one_answers(fakes: list[Fake]) -> None:
    good, llm = fake(fakes, encoder_answer("g")), fake(fakes, llm_answer)
    mute = Mute()  # accepts connections, never answers (its /health probes hang too)
    try:
        with Router(
            RouterConfig(
                encoders=(mute.url, good.url),
                llms=(llm.url,),
                port=0,
                encoder_first_byte_timeout_s=1.0,
                probe_timeout_s=1.0,
            )
        ) as router:
            answers = [post(router, IMAGE_CHAT) for _ in range(4)]
            timeouts = router.metrics.registry.get_sample_value(
                "tensorwire_vllm_router_encoder_calls_total", {"encoder": "encoder-0", "outcome": "timeout"}
            )
    finally:
        mute.close()
    assert all(status == 200 and h["x-tensorwire-encoder"] == "encoder-1" for status, h, _ in answers)
    # Out after its first timeout (or its first probe): no second request waits for it.
    assert (timeouts or 0) <= 1 and len(good.seen) == 4


def test_encoder_5xx_is_retried_elsewhere_and_4xx_goes_back_to_the_client(fakes: list[Fake]) -> None:
    broken = fake(fakes, lambda p, b: (500, {"error": {"message": "engine dead"}}))
    refusing = fake(fakes, lambda p, b: (400, {"error": {"message": "image too large", "code": 400}}))
    good, llm = fake(fakes, encoder_answer("g")), fake(fakes, llm_answer)
    with Router(RouterConfig(encoders=(broken.url, good.url), llms=(llm.url,), port=0)) as router:
        status, headers, _ = post(router, IMAGE_CHAT)
    assert status == 200 and headers["x-tensorwire-encoder"] == "encoder-1"
    with Router(RouterConfig(encoders=(refusing.url, good.url), llms=(llm.url,), port=0)) as router:
        status, _, body = post(router, IMAGE_CHAT)
    assert status == 400 and body["error"]["message"] == "image too large"
    assert len(good.seen) == 1 and len(llm.seen) == 1  # neither asked again for the refused request


def test_encoder_without_params_lets_the_llm_encode(fakes: list[Fake]) -> None:
    plain = fake(fakes, lambda p, b: (200, {"id": "x", "choices": []}))  # a vLLM without the connector
    llm = fake(fakes, llm_answer)
    with Router(RouterConfig(encoders=(plain.url,), llms=(llm.url,), port=0)) as router:
        status, _, _ = post(router, IMAGE_CHAT)
        route = router.metrics.registry.get_sample_value(
            "tensorwire_vllm_router_requests_total", {"route": "not_announced"}
        )
    assert status == 200 and route == 1 and "ec_transfer_params" not in llm.seen[0][2]


def _sse(chunks: list[bytes], stall_s: float = 0.0) -> Callable[[BaseHTTPRequestHandler], None]:
    def write(h: BaseHTTPRequestHandler) -> None:
        h.send_response(200)
        h.send_header("Content-Type", "text/event-stream")
        h.send_header("Transfer-Encoding", "chunked")
        h.end_headers()
        for c in chunks:
            h.wfile.write(b"%x\r\n%s\r\n" % (len(c), c))
            h.wfile.flush()
        if stall_s:
            time.sleep(stall_s)  # a stalled instance, not a synchronisation
            return
        h.wfile.write(b"0\r\n\r\n")

    return write


def test_streamed_answer_is_relayed_and_a_stall_is_cut_off(fakes: list[Fake]) -> None:
    events = [b'data: {"n": 1}\n\n', b'data: {"n": 2}\n\n', b"data: [DONE]\n\n"]
    enc = fake(fakes, encoder_answer("e"))
    llm = fake(fakes, lambda p, b: (200, _sse(events)))
    with Router(RouterConfig(encoders=(enc.url,), llms=(llm.url,), port=0)) as router:
        conn = http.client.HTTPConnection("127.0.0.1", router.port, timeout=30)
        conn.request(
            "POST",
            "/v1/chat/completions",
            json.dumps(dict(IMAGE_CHAT, stream=True)).encode(),
            {"Content-Type": "application/json"},
        )
        resp = conn.getresponse()
        assert resp.status == 200 and resp.getheader("Content-Type") == "text/event-stream"
        assert resp.read() == b"".join(events)
        conn.close()
    assert llm.seen[0][2]["stream"] is True and "ec_transfer_params" in llm.seen[0][2]
    assert enc.seen[0][2]["stream"] is False
    stalled = fake(fakes, lambda p, b: (200, _sse(events[:1], stall_s=8)))
    with Router(RouterConfig(encoders=(enc.url,), llms=(stalled.url,), port=0, llm_timeout_s=1.0)) as router:
        conn = http.client.HTTPConnection("127.0.0.1", router.port, timeout=30)
        conn.request(
            "POST",
            "/v1/chat/completions",
            json.dumps(dict(TEXT_CHAT, stream=True)).encode(),
            {"Content-Type": "application/json"},
        )
        resp = conn.getresponse()
        t0 = time.monotonic()
        with pytest.raises(http.client.IncompleteRead) as info:
            resp.read()
        assert info.value.partial == events[0] and time.monotonic() - t0 < 7  # cut, not waiting for the 8 s
        conn.close()


def test_a_stream_the_instance_sent_whole_reaches_the_client_in_one_send(
    fakes: list[Fake], monkeypatch: pytest.MonkeyPatch
) -> None:
    # Each send to the client wakes it once more (a scheduling delay each on a busy box): status line, headers,
    # events and end go in one when the instance's answer is all there. Counted at aiohttp's writer, on the
    # router's client connections only (its upstream requests use the same writer class).
    from aiohttp.http_writer import StreamWriter
    from aiohttp.web_protocol import RequestHandler

    sends: list[bytes] = []
    write, writelines = StreamWriter._write, StreamWriter._writelines

    def counted_write(self: StreamWriter, chunk: Any) -> None:
        if isinstance(self.protocol, RequestHandler):
            sends.append(bytes(chunk))
        write(self, chunk)

    def counted_writelines(self: StreamWriter, chunks: Any) -> None:
        chunks = tuple(chunks)
        if isinstance(self.protocol, RequestHandler):
            sends.append(b"".join(bytes(c) for c in chunks))
        writelines(self, chunks)

    monkeypatch.setattr(StreamWriter, "_write", counted_write)
    monkeypatch.setattr(StreamWriter, "_writelines", counted_writelines)
    events = [b'data: {"n": 1}\n\n', b'data: {"n": 2}\n\n', b"data: [DONE]\n\n"]

    def whole(h: BaseHTTPRequestHandler) -> None:  # the answer in one write, as a fast instance's arrives
        body = b"".join(b"%x\r\n%s\r\n" % (len(e), e) for e in events) + b"0\r\n\r\n"
        h.wfile.write(
            b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n\r\n" + body
        )

    llm = fake(fakes, lambda p, b: (200, whole))
    with Router(RouterConfig(encoders=(closed_url(),), llms=(llm.url,), port=0)) as router:
        conn = http.client.HTTPConnection("127.0.0.1", router.port, timeout=30)
        conn.request(
            "POST",
            "/v1/chat/completions",
            json.dumps(dict(TEXT_CHAT, stream=True)).encode(),
            {"Content-Type": "application/json"},
        )
        resp = conn.getresponse()
        assert resp.status == 200 and resp.read() == b"".join(events)
        conn.close()
    assert len(sends) == 1, sends
    assert sends[0].startswith(b"HTTP/1.1 200 ") and sends[0].endswith(b"data: [DONE]\n\n\r\n0\r\n\r\n")


def test_llm_down_or_hung_gives_a_clear_error(fakes: list[Fake]) -> None:
    enc = fake(fakes, encoder_answer("e"))
    dead = closed_url()
    with Router(RouterConfig(encoders=(enc.url,), llms=(dead,), port=0)) as router:
        status, _, body = post(router, TEXT_CHAT)
    assert status == 503 and "llm-0" in body["error"]["message"] and dead not in body["error"]["message"]
    mute = Mute()
    try:
        with Router(RouterConfig(encoders=(enc.url,), llms=(mute.url,), port=0, llm_timeout_s=1.0)) as router:
            status, _, body = post(router, TEXT_CHAT)
            assert status == 504 and "llm-0" in body["error"]["message"], body
            assert "127.0.0.1" not in json.dumps(body)
    finally:
        mute.close()


def test_bad_requests_and_own_endpoints(fakes: list[Fake]) -> None:
    enc, llm = fake(fakes, encoder_answer("e")), fake(fakes, llm_answer)
    with Router(RouterConfig(encoders=(enc.url,), llms=(llm.url,), port=0, max_body_bytes=1000)) as router:
        conn = http.client.HTTPConnection("127.0.0.1", router.port, timeout=30)
        conn.request("POST", "/v1/chat/completions", b"{not json", {"Content-Type": "application/json"})
        resp = conn.getresponse()
        assert resp.status == 400 and b"not JSON" in resp.read()
        conn.close()
        status, _, body = post(router, dict(TEXT_CHAT, pad="x" * 2000))
        assert status == 413, body
        conn = http.client.HTTPConnection("127.0.0.1", router.port, timeout=30)
        for path, want in (
            ("/health", b'"ok"'),
            ("/metrics", b"tensorwire_vllm_router_requests_total"),
            ("/v1/models", b"fine"),
        ):
            conn.request("GET", path)
            resp = conn.getresponse()
            assert resp.status == 200 and want in resp.read(), path
        conn.close()
    assert enc.seen == [] and [p for _, p, _, _ in llm.seen] == ["/v1/models"]


@pytest.mark.parametrize(
    "kw",
    [
        dict(encoders=()),
        dict(llms=()),
        dict(encoders=("ftp://h:1",)),
        dict(llms=("http://h",)),
        dict(encoders=("http://h:1/v1",)),
        dict(fallback="retry"),
        dict(encoder_timeout_s=0),
        dict(llm_timeout_s=float("nan")),
        dict(host="0.0.0.0"),
        dict(tls_cert="/nonexistent.pem", tls_key="/x.key"),
        dict(max_connections=0),
        dict(grace_s=-1),
    ],
)
def test_config_is_checked(kw: dict[str, Any]) -> None:
    base: dict[str, Any] = dict(encoders=("http://127.0.0.1:1",), llms=("http://127.0.0.1:2",))
    with pytest.raises(ConfigError):
        RouterConfig(**{**base, **kw})


def test_the_module_runs_as_a_process(fakes: list[Fake]) -> None:
    enc, llm = fake(fakes, encoder_answer("e")), fake(fakes, llm_answer)
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "tensorwire.integrations.vllm_router",
            "--port",
            "0",
            "--encoder",
            enc.url,
            "--llm",
            llm.url,
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=dict(os.environ, PYTHONPATH=f"{SRC}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"),
    )
    try:
        assert proc.stdout is not None
        line = ""
        deadline = time.monotonic() + 60
        while "listening on" not in line and time.monotonic() < deadline:
            line = proc.stdout.readline()
            assert line or proc.poll() is None, "the router exited"
        url = line.rsplit(" ", 1)[-1].strip()
        host, port = url.removeprefix("http://").rsplit(":", 1)
        conn = http.client.HTTPConnection(host, int(port), timeout=30)
        conn.request(
            "POST", "/v1/chat/completions", json.dumps(IMAGE_CHAT).encode(), {"Content-Type": "application/json"}
        )
        resp = conn.getresponse()
        assert resp.status == 200 and json.loads(resp.read())["echo_params"]
        conn.close()
    finally:
        proc.terminate()
        proc.communicate(timeout=30)  # reaps it and closes our end of its stdout
    assert proc.returncode == 0
    bad = subprocess.run(
        [sys.executable, "-m", "tensorwire.integrations.vllm_router", "--encoder", "x", "--llm", llm.url],
        capture_output=True,
        text=True,
        timeout=60,
        env=dict(os.environ, PYTHONPATH=str(SRC)),
    )
    assert bad.returncode == 2 and "expected http(s)://host:port" in bad.stderr
