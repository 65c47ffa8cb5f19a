"""Encoder workers, the proxy and LLM-side clients on different hosts (network namespaces), default RDMA flags.

Issue 16 finding 1: an encoder in one namespace and a client in another fell back to inline on every fetch,
because descriptors advertised the metadata endpoint as 127.0.0.1 unless --rdma-advertise-host was given. Here
no --rdma-* flag is given: the endpoint follows --host (or, for a wildcard --host, the host's detected address).
UCX runs over the hosts' veths with UCX_TLS=tcp (Host.env), so the bytes cross the "network".
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Sequence

import pytest
from _llm import LlmClient

from tensorwire.testing import netns

KEYS = [(0,), (3,), (5,), (1, 2)]


def _serve_encoder(children: Callable[..., Any], host: netns.Host, grpc_host: str, name: str,
                   *extra: str) -> tuple[str, Any]:
    """Starts `tensorwire serve-encoder --host grpc_host` in ``host``; (the address clients use, the child)."""
    child = children(host, name, ["serve-encoder", "--host", grpc_host, "--port", "0", "--metrics-port", "-1",
                                  "--worker-id", name, "--wait-exporter-s", "60", *extra])
    port = child.ready(120)["grpc"].rsplit(":", 1)[1]
    return f"{host.ip}:{port}", child


def _ok_over_rdma(results: list[dict[str, Any]]) -> None:
    assert [r["outcome"] for r in results] == ["ok"] * len(results), results
    assert {r["plane"] for r in results} == {"rdma"}, [(r["plane"], r["fallback"]) for r in results]


@pytest.mark.timeout(300)
@pytest.mark.parametrize("bind", ["host-ip", "0.0.0.0"])
def test_rdma_across_hosts_with_default_flags(fabric: Callable[[Sequence[str]], netns.Fabric],
                                              children: Callable[..., Any], corpus: Any, bind: str) -> None:
    net = fabric(["encoder", "llm"])
    enc = net["encoder"]
    address, child = _serve_encoder(children, enc, enc.ip if bind == "host-ip" else bind, "enc")
    llm = LlmClient(net["llm"], address, list(corpus.images), corpus.digests)
    try:
        assert llm.rdma_ready
        _ok_over_rdma(llm.fetch(KEYS))
    finally:
        llm.close()
    log = child.log_path.read_text()  # the startup line is shown at serve-encoder's default log level
    assert f"descriptors advertise {enc.ip}" in log, log[-3000:]
    assert "WARNING tensorwire.rdma.endpoint" not in log


@pytest.mark.timeout(300)
def test_proxy_on_a_third_host(fabric: Callable[[Sequence[str]], netns.Fabric], children: Callable[..., Any],
                               corpus: Any) -> None:
    net = fabric(["w0", "w1", "proxy", "llm"])
    workers = [_serve_encoder(children, net[w], net[w].ip, w)[0] for w in ("w0", "w1")]
    proxy = net["proxy"]
    child = children(proxy, "proxy", ["serve-proxy", "--host", proxy.ip, "--port", "0", "--metrics-port", "-1",
                                      *[a for w in workers for a in ("--worker", w)]])
    port = child.ready(120)["grpc"].rsplit(":", 1)[1]
    llm = LlmClient(net["llm"], f"{proxy.ip}:{port}", list(corpus.images), corpus.digests)
    try:
        results = llm.fetch(KEYS * 2)
        _ok_over_rdma(results)
        assert {r["worker"] for r in results} == {"w0", "w1"}  # the proxy spread them; reads went to each worker
    finally:
        llm.close()


@pytest.mark.timeout(300)
def test_advertising_loopback_while_serving_a_network_address_is_loud(
        fabric: Callable[[Sequence[str]], netns.Fabric], children: Callable[..., Any]) -> None:
    net = fabric(["encoder"])
    _, child = _serve_encoder(children, net["encoder"], "0.0.0.0", "enc", "--rdma-advertise-host", "127.0.0.1")
    log = child.log_path.read_text()
    assert "WARNING tensorwire.rdma.endpoint: RDMA descriptors advertise the loopback address 127.0.0.1" in log, \
        log[-3000:]
