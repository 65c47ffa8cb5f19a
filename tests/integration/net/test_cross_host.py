"""Encoder workers, the proxy and LLM-side clients on different hosts (network namespaces), default RDMA flags.

Issue 16 finding 1: an encoder in one namespace and a client in another fell back to inline on every fetch,
because descriptors advertised the metadata endpoint as 127.0.0.1 unless --rdma-advertise-host was given. Here
no --rdma-* flag is given: the endpoint follows --host (or, for a wildcard --host, the host's detected address).
UCX runs over the hosts' veths with UCX_TLS=tcp (Host.env), so the bytes cross the "network".

One deployment for the module (starting workers is the slow part on a small machine): worker w0 serves on its
host's address, w1 on 0.0.0.0, a proxy on a third host in front of both, an LLM client on a fourth; a fifth
host runs a worker that advertises loopback while serving 0.0.0.0 (the warning).
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from _llm import LlmClient

from conftest import Children, skip_unless_possible
from tensorwire.testing import netns

KEYS = [(0,), (3,), (5,), (1, 2)]
START_S = 180


@dataclass
class Deployment:
    net: netns.Fabric
    workers: dict[str, str]  # name -> address clients use
    logs: dict[str, Path]
    proxy: str
    llm: LlmClient


def _encoder_argv(name: str, grpc_host: str, *extra: str) -> list[str]:
    # --insecure: plaintext off loopback, on a fabric that exists only inside this test (docs/security.md).
    return [
        "serve-encoder",
        "--host",
        grpc_host,
        "--insecure",
        "--port",
        "0",
        "--metrics-port",
        "-1",
        "--worker-id",
        name,
        "--wait-exporter-s",
        "60",
        *extra,
    ]


@pytest.fixture(scope="module")
def deployment(tmp_path_factory: pytest.TempPathFactory, nixl_available: bool, corpus: Any) -> Iterator[Deployment]:
    skip_unless_possible(nixl_available)
    net = netns.Fabric(["w0", "w1", "proxy", "llm", "loud"])
    kids = Children(tmp_path_factory.mktemp("hosts"))
    llm: LlmClient | None = None
    try:
        started = {  # all at once: they load in parallel
            "w0": kids.start(net["w0"], "w0", _encoder_argv("w0", net["w0"].ip)),
            "w1": kids.start(net["w1"], "w1", _encoder_argv("w1", "0.0.0.0")),
            "loud": kids.start(
                net["loud"], "loud", _encoder_argv("loud", "0.0.0.0", "--rdma-advertise-host", "127.0.0.1")
            ),
        }
        workers = {name: f"{net[name].ip}:{c.ready(START_S)['grpc'].rsplit(':', 1)[1]}" for name, c in started.items()}
        proxy_host = net["proxy"]
        proxy = kids.start(
            proxy_host,
            "proxy",
            [
                "serve-proxy",
                "--host",
                proxy_host.ip,
                "--insecure",
                "--port",
                "0",
                "--no-check-workers",  # WorkerInfo: loopback or mTLS only
                "--metrics-port",
                "-1",
                "--worker",
                workers["w0"],
                "--worker",
                workers["w1"],
            ],
        )
        proxy_address = f"{proxy_host.ip}:{proxy.ready(START_S)['grpc'].rsplit(':', 1)[1]}"
        llm = LlmClient(net["llm"], proxy_address, list(corpus.images), corpus.digests)
        yield Deployment(net, workers, {name: c.log_path for name, c in started.items()}, proxy_address, llm)
    finally:
        if llm is not None:
            llm.close()
        kids.stop()
        net.close()


def _ok_over_rdma(results: list[dict[str, Any]]) -> None:
    assert [r["outcome"] for r in results] == ["ok"] * len(results), results
    assert {r["plane"] for r in results} == {"rdma"}, [(r["plane"], r["fallback"]) for r in results]


@pytest.mark.timeout(420)
@pytest.mark.parametrize("worker", ["w0", "w1"])  # --host <its address> / --host 0.0.0.0
def test_rdma_across_hosts_with_default_flags(deployment: Deployment, worker: str) -> None:
    assert deployment.llm.rdma_ready
    _ok_over_rdma(deployment.llm.fetch(KEYS, endpoint=deployment.workers[worker]))
    log = deployment.logs[worker].read_text()  # the startup line is shown at serve-encoder's default log level
    ip = deployment.net[worker].ip
    assert f"descriptors advertise {ip}" in log and f"listening on {ip}:" in log, log[-3000:]
    assert "WARNING tensorwire.rdma.endpoint" not in log


@pytest.mark.timeout(420)
def test_proxy_on_a_third_host(deployment: Deployment) -> None:
    results = deployment.llm.fetch(KEYS * 2)  # the client's default endpoint is the proxy
    _ok_over_rdma(results)
    assert {r["worker"] for r in results} == {"w0", "w1"}  # the proxy spread them; reads went to each worker


@pytest.mark.timeout(420)
def test_advertising_loopback_while_serving_a_network_address_is_loud(deployment: Deployment) -> None:
    log = deployment.logs["loud"].read_text()
    assert "WARNING tensorwire.rdma.endpoint: RDMA descriptors advertise the loopback address 127.0.0.1" in log, log[
        -3000:
    ]
    # It still works: a remote reader cannot reach 127.0.0.1, fetches once over RDMA, and falls back inline.
    results = deployment.llm.fetch([(0,)], endpoint=deployment.workers["loud"])
    assert results[0]["outcome"] == "ok" and results[0]["plane"] == "inline", results
    assert results[0]["fallback"] == "metadata_unavailable", results
