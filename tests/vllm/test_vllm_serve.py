"""Online serving end to end: ``vllm serve`` (OpenAI-compatible HTTP) as an encoder instance and an LLM instance
joined by the tensorwire connector, with ``python -m tensorwire.integrations.vllm_router`` in front, each its own
process tree (vLLM adds its EngineCore and worker processes to each instance).

The baseline is the LLM instance on its own: the same chat request sent to it directly, with the image under a
client-given ``uuid`` so that vLLM keys it differently, encodes it locally and does not reuse the routed item.
The routed answer (greedy tokens, top-3 logprobs) must equal it, with the RDMA plane having delivered the item
(the LLM instance's metrics, served by vLLM's own ``/metrics``), nothing left held on the encoder instance, and a
dead encoder instance listed first in the router, which must skip it.
"""

from __future__ import annotations

import base64
import http.client
import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from images import png

from tensorwire.bench.vllm_engine.procs import Spawned, wait_ready

HERE = Path(__file__).resolve().parent
SRC = HERE.parents[1] / "src"
CALL_TIMEOUT_S = 180.0
CHAT_TEMPLATE = (
    "{% for m in messages %}{% if m['role'] == 'user' %}USER: {{ m['content'] }} {% else %}"
    "ASSISTANT: {{ m['content'] }} {% endif %}{% endfor %}{% if add_generation_prompt %}ASSISTANT:"
    "{% endif %}"
)
BUDGETS = {"fetch_timeout_ms": 90000, "lookup_timeout_ms": 20000, "release_timeout_ms": 10000}

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(1500)]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _png_b64(seed: int) -> str:
    return base64.b64encode(png(seed)).decode()


def _http(
    port: int, method: str, path: str, body: Any = None, timeout_s: float = CALL_TIMEOUT_S
) -> tuple[int, dict[str, str], bytes]:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout_s)
    try:
        data = json.dumps(body).encode() if body is not None else None
        conn.request(method, path, data, {"Content-Type": "application/json"} if data else {})
        resp = conn.getresponse()
        return resp.status, {k.lower(): v for k, v in resp.getheaders()}, resp.read()
    finally:
        conn.close()


class Proc(Spawned):
    """A server with an HTTP port; ``stop()`` asks it to end (SIGTERM) before it kills the whole session."""

    def __init__(self, name: str, cmd: list[str], workdir: Path, env: dict[str, str], port: int) -> None:
        super().__init__(name, cmd, workdir / f"{name}.log", env)
        self.port = port

    def ready(self) -> bool:
        try:
            return _http(self.port, "GET", "/health", timeout_s=5)[0] == 200
        except OSError:
            return False

    def stop(self) -> None:
        if self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, signal.SIGTERM)
                self.proc.wait(timeout=30)
            except (ProcessLookupError, subprocess.TimeoutExpired):
                pass
        self.close()


def _vllm_serve(name: str, model: Path, template: Path, workdir: Path, role: str, extra: dict[str, Any]) -> Proc:
    port = _free_port()
    ec = {
        "ec_connector": "TensorwireECConnector",
        "ec_connector_module_path": "tensorwire.integrations.vllm",
        "ec_role": role,
        "ec_connector_extra_config": extra,
    }
    cmd = [
        sys.executable,
        str(HERE / "vllm_cli.py"),
        "serve",
        str(model),
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--enforce-eager",
        "--max-model-len",
        "256",
        "--max-num-seqs",
        "4",
        "--dtype",
        "float32",
        "--seed",
        "0",
        "--limit-mm-per-prompt",
        json.dumps({"image": 2}),
        "--chat-template",
        str(template),
        "--chat-template-content-format",
        "string",
        "--ec-transfer-config",
        json.dumps(ec),
    ]
    # As in test_vllm_ec: unpinned, one OpenMP thread per instance on this 2-core box (bit-identical kernels).
    # vllm serve (one API server) collects the other processes' metrics (the connector lives in the EngineCore
    # and worker processes) on /metrics only in prometheus_client's multiprocess mode: a fresh directory each.
    prom = workdir / f"{name}-prom"
    prom.mkdir()
    env = dict(
        os.environ,
        PYTHONPATH=f"{SRC}{os.pathsep}{HERE}",
        VLLM_CPU_KVCACHE_SPACE="1",
        VLLM_CPU_OMP_THREADS_BIND="nobind",
        OMP_NUM_THREADS="1",
        PROMETHEUS_MULTIPROC_DIR=str(prom),
    )
    return Proc(name, cmd, workdir, env, port)


@pytest.fixture(scope="module")
def serving(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    sys.path.insert(0, str(HERE))
    from tiny_llava import build

    work = tmp_path_factory.mktemp("vllm-serve")
    model = build(work / "model")
    template = work / "chat.jinja"
    template.write_text(CHAT_TEMPLATE)
    runtime = tmp_path_factory.mktemp("rt-serve")
    common = {"runtime_dir": str(runtime)}  # the store binds the default host, 127.0.0.1
    t0 = time.monotonic()
    encoder = _vllm_serve("encoder", model, template, work, "ec_producer", dict(common, lease_ttl_ms=120000))
    llm = _vllm_serve("llm", model, template, work, "ec_consumer", dict(common, **BUDGETS))
    dead = f"http://127.0.0.1:{_free_port()}"  # nothing listens there: the router must skip it
    router_port = _free_port()
    router = Proc(
        "router",
        [
            sys.executable,
            "-m",
            "tensorwire.integrations.vllm_router",
            "--port",
            str(router_port),
            "--encoder",
            dead,
            "--encoder",
            f"http://127.0.0.1:{encoder.port}",
            "--llm",
            f"http://127.0.0.1:{llm.port}",
            "--encoder-timeout-s",
            "120",
            "--fallback",
            "fail",
        ],
        work,
        dict(os.environ, PYTHONPATH=str(SRC)),
        router_port,
    )
    procs = [encoder, llm, router]
    try:
        wait_ready(procs, lambda p: p.ready(), poll_s=1.0)
        # The router probes /health every 2 s: the instances it saw starting are back in rotation after a probe.
        deadline = time.monotonic() + 60
        while any(
            _metrics(router_port).get(f"tensorwire_vllm_router_upstream_up{{role={role},upstream={name}}}") != 1
            for role, name in (("encoder", "encoder-1"), ("llm", "llm-0"))
        ):
            assert time.monotonic() < deadline, "the router did not take the instances into rotation within 60 s"
            time.sleep(0.5)
        print(f"vllm serve instances and router ready in {time.monotonic() - t0:.0f} s", flush=True)
        yield {"encoder": encoder, "llm": llm, "router": router, "model": str(model), "dead": dead}
    finally:
        for p in procs:
            p.stop()


def _chat(model: str, seed: int, uuid: str | None = None, stream: bool = False) -> dict[str, Any]:
    image: dict[str, Any] = {"type": "image_url", "image_url": {"url": f"data:image/png;base64,{_png_b64(seed)}"}}
    if uuid is not None:
        image["uuid"] = uuid
    body: dict[str, Any] = {
        "model": model,
        "max_tokens": 8,
        "temperature": 0.0,
        "logprobs": True,
        "top_logprobs": 3,
        "messages": [{"role": "user", "content": [image, {"type": "text", "text": "describe the image"}]}],
    }
    if stream:
        body["stream"] = True
    return body


def _answer(raw: bytes) -> tuple[str, list[Any]]:
    choice = json.loads(raw)["choices"][0]
    return choice["message"]["content"], choice["logprobs"]["content"]


def _streamed(raw: bytes) -> tuple[str, list[Any]]:
    text, logprobs = "", []
    for line in raw.decode().splitlines():
        if not line.startswith("data: ") or line == "data: [DONE]":
            continue
        for choice in json.loads(line[6:]).get("choices", []):
            text += choice.get("delta", {}).get("content") or ""
            logprobs += (choice.get("logprobs") or {}).get("content") or []
    return text, logprobs


_SAMPLE = re.compile(r"^(tensorwire_[a-z_]+)(?:\{([^}]*)\})? ([0-9.e+-]+)$")


def _metrics(port: int) -> dict[str, float]:
    status, _, raw = _http(port, "GET", "/metrics", timeout_s=30)
    assert status == 200
    out: dict[str, float] = {}
    for line in raw.decode().splitlines():
        m = _SAMPLE.match(line)
        if m:
            labels = ",".join(
                sorted(x.replace('"', "") for x in (m.group(2) or "").split(",") if x and not x.startswith("pid="))
            )
            key = f"{m.group(1)}{{{labels}}}"
            out[key] = out.get(key, 0.0) + float(m.group(3))
    return out


def _delta(before: dict[str, float], after: dict[str, float], key: str) -> float:
    return after.get(key, 0.0) - before.get(key, 0.0)


def _wait_nothing_held(encoder: Proc, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while True:
        m = _metrics(encoder.port)
        items, nbytes = m.get("tensorwire_vllm_ec_held_items{}", 0.0), m.get("tensorwire_vllm_ec_held_bytes{}", 0.0)
        if items == 0 and nbytes == 0:
            return
        if time.monotonic() > deadline:
            raise AssertionError(f"the encoder instance still holds {items} item(s), {nbytes} bytes")
        time.sleep(0.5)


def test_chat_with_an_image_through_the_router_matches_the_llm_instance_alone(serving: dict[str, Any]) -> None:
    llm, router, model = serving["llm"], serving["router"], serving["model"]
    status, _, raw = _http(llm.port, "POST", "/v1/chat/completions", _chat(model, 60, uuid="baseline-60"))
    assert status == 200, raw[:500]
    baseline = _answer(raw)
    serving["answers"] = {60: baseline}
    before = _metrics(llm.port)
    status, headers, raw = _http(router.port, "POST", "/v1/chat/completions", _chat(model, 60))
    after = _metrics(llm.port)
    assert status == 200, raw[:500]
    assert headers["x-tensorwire-encoder"] == "encoder-1"  # the live one (encoder-0 is the dead URL)
    got = _answer(raw)
    assert got == baseline, f"routed {got[0]!r} {got[1][:1]} != LLM instance alone {baseline[0]!r} {baseline[1][:1]}"
    assert len(got[1]) == 8 and all(len(step["top_logprobs"]) == 3 for step in got[1])
    assert _delta(before, after, "tensorwire_vllm_ec_delivered_items_total{plane=map}") == 1, (before, after)
    assert _delta(before, after, "tensorwire_vllm_ec_placed_items_total{}") == 1
    assert not any(k.startswith("tensorwire_vllm_ec_fallbacks_total") and _delta(before, after, k) for k in after)
    rm = _metrics(router.port)
    # The dead one is out after its first failure (its start-up /health probe, or one call), never asked again.
    assert rm.get("tensorwire_vllm_router_encoder_calls_total{encoder=encoder-0,outcome=unavailable}", 0.0) <= 1
    assert rm.get("tensorwire_vllm_router_upstream_up{role=encoder,upstream=encoder-0}") == 0
    _wait_nothing_held(serving["encoder"])


def test_streamed_chat_through_the_router(serving: dict[str, Any]) -> None:
    llm, router, model = serving["llm"], serving["router"], serving["model"]
    status, _, raw = _http(llm.port, "POST", "/v1/chat/completions", _chat(model, 61, uuid="baseline-61"))
    assert status == 200, raw[:500]
    baseline = _answer(raw)
    if 60 in serving.get("answers", {}):  # another image answers otherwise: the equality checks are not vacuous
        assert baseline[1] != serving["answers"][60][1]
    before = _metrics(llm.port)
    status, headers, raw = _http(router.port, "POST", "/v1/chat/completions", _chat(model, 61, stream=True))
    after = _metrics(llm.port)
    assert status == 200 and headers["content-type"].startswith("text/event-stream"), raw[:500]
    assert _streamed(raw) == baseline
    assert _delta(before, after, "tensorwire_vllm_ec_delivered_items_total{plane=map}") == 1
    _wait_nothing_held(serving["encoder"])
