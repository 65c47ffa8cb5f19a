"""Issue 15, deliverable 1 for the vLLM connector's held-outputs store (``serve_store``, ``HeldStoreClient``,
``StagingClient``): TLS / mTLS from the connector's extra config (or ``TENSORWIRE_MM_TLS_*``), and a plaintext
store on a non-loopback address only with ``insecure: true``.

The store runs in its own process (``_store_owner``: the connector's ``ProducerRuntime``), certificates come from
a CA made at run time. Before this change the store listened in plaintext wherever it was told (``0.0.0.0`` by
default) and the connector had no TLS keys: an unknown ``tls_cert`` key was a ConfigError, so the mTLS tests
fail at start-up, and the bind tests fail because the bind succeeded.
"""

from __future__ import annotations

import multiprocessing as mp
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from _sec import pki_or_skip, tls_of
from _store_owner import owner_main
from prometheus_client import CollectorRegistry

from tensorwire._grpc.tls import TlsConfig
from tensorwire.errors import ConfigError, PeerUnavailable, Reason
from tensorwire.integrations._vllm_ec.config import ECConfig
from tensorwire.integrations._vllm_ec.fetch import Fetcher, LocalStager
from tensorwire.integrations._vllm_ec.metrics import ECMetrics
from tensorwire.integrations._vllm_ec.params import ItemGrant
from tensorwire.mm.held._rpc import HeldStoreClient, StagingClient, serve_store
from tensorwire.mm.held._staging import Expect, StagingArea
from tensorwire.mm.held._store import HeldStore, new_secret
from tensorwire.mm.wire._codec import decode_tensor
from tensorwire.testing.pki import Pki, make_pki

pytestmark = [pytest.mark.timeout(240)]


class Owner:
    """The store process: ``endpoint`` once ready; ``hold`` puts an item in its store."""

    def __init__(self, extra: dict[str, Any]) -> None:
        ctx = mp.get_context("spawn")
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=owner_main, args=(child, extra), daemon=True)
        self.proc.start()
        assert self.conn.poll(120), "the store process did not start"
        self.first = self.conn.recv()
        self.endpoint = self.first[1] if self.first[0] == "ready" else ""

    def hold(self, key: str, secret: bytes, seed: int) -> torch.Tensor:
        self.conn.send(("hold", key, secret, seed))
        assert self.conn.poll(60), "no answer to hold"
        got: torch.Tensor = self.conn.recv()
        return got

    def close(self) -> None:
        try:
            self.conn.send(("quit",))
        except (OSError, BrokenPipeError):
            pass
        self.proc.join(30)
        if self.proc.is_alive():
            self.proc.kill()
            self.proc.join(5)


@pytest.fixture
def pki(tmp_path: Path) -> Pki:
    return pki_or_skip(tmp_path / "pki")


def _tls_extra(pki: Pki, name: str) -> dict[str, Any]:
    return {"tls_cert": str(pki[name].cert), "tls_key": str(pki[name].key), "tls_ca": str(pki.ca)}


@pytest.fixture
def mtls_owner(pki: Pki, tmp_path: Path) -> Iterator[Owner]:
    owner = Owner(
        {"host": "127.0.0.1", "rdma_provider": "none", "runtime_dir": str(tmp_path / "rt"), **_tls_extra(pki, "worker")}
    )
    assert owner.first[0] == "ready", owner.first
    yield owner
    owner.close()


def test_a_client_with_a_certificate_of_the_ca_reads_from_an_mtls_store(mtls_owner: Owner, pki: Pki) -> None:
    secret = new_secret()
    want = mtls_owner.hold("item-1", secret, 3)
    with HeldStoreClient(mtls_owner.endpoint, tls=tls_of(pki, "llm")) as c:
        (out,) = c.lookup([("item-1", secret)], timeout_s=30, support_rdma=False)
    assert out.error is None and out.receipt is not None, out
    assert torch.equal(decode_tensor(out.receipt.embedding), want)


def test_the_connectors_fetcher_reads_over_mtls_from_its_extra_config(
    mtls_owner: Owner, pki: Pki, tmp_path: Path
) -> None:
    secret = new_secret()
    want = mtls_owner.hold("item-2", secret, 4)
    cfg = ECConfig.from_extra(
        {"fetch_timeout_ms": 60000, "lookup_timeout_ms": 30000, "rdma_provider": "none", **_tls_extra(pki, "llm")},
        environ={},
    )
    area = StagingArea(None)
    fetcher = Fetcher(cfg, [LocalStager(area)], ECMetrics(CollectorRegistry()), support_rdma=False)
    try:
        grant = ItemGrant(mtls_owner.endpoint, "item-2", secret, tuple(want.shape), "float32")
        res = fetcher.start(grant, "k", Expect(tuple(want.shape), torch.float32)).result(timeout=90)
        assert res.ok, res
        got = area.get("k")
        assert got is not None and torch.equal(got[0], want)
    finally:
        fetcher.close()
        area.close()
    # The same connector without a client certificate (only the CA): the store refuses it, the fetch says why.
    certless = ECConfig.from_extra(
        {"fetch_timeout_ms": 30000, "lookup_timeout_ms": 15000, "rdma_provider": "none", "tls_ca": str(pki.ca)},
        environ={},
    )
    secret = new_secret()
    want = mtls_owner.hold("item-2b", secret, 5)  # held: only the handshake can make this fetch fail
    area = StagingArea(None)
    fetcher = Fetcher(certless, [LocalStager(area)], ECMetrics(CollectorRegistry()), support_rdma=False)
    try:
        grant = ItemGrant(mtls_owner.endpoint, "item-2b", secret, tuple(want.shape), "float32")
        res = fetcher.start(grant, "k2", Expect(tuple(want.shape), torch.float32)).result(timeout=90)
        assert not res.ok and res.reason is Reason.PEER_UNAVAILABLE, res
        assert area.get("k2") is None
    finally:
        fetcher.close()
        area.close()


@pytest.mark.parametrize("who", ["plaintext", "no certificate", "another CA"])
def test_a_client_without_a_certificate_of_the_ca_is_refused(
    mtls_owner: Owner, pki: Pki, tmp_path: Path, who: str
) -> None:
    secret = new_secret()
    mtls_owner.hold("item-3", secret, 5)
    if who == "plaintext":
        tls = TlsConfig()
    elif who == "no certificate":
        tls = TlsConfig(ca=str(pki.ca))  # verifies the server, presents nothing
    else:
        other = make_pki(tmp_path / "other", ["llm"], ca_name="another-ca")
        # trusts the store's CA (so only the store's check can refuse it), presents a certificate of another CA
        tls = TlsConfig(cert=str(other["llm"].cert), key=str(other["llm"].key), ca=str(pki.ca))
    with HeldStoreClient(mtls_owner.endpoint, tls=tls) as c, pytest.raises(PeerUnavailable):
        c.lookup([("item-3", secret)], timeout_s=15, support_rdma=False)
    # The store is still serving the right client afterwards.
    with HeldStoreClient(mtls_owner.endpoint, tls=tls_of(pki, "llm")) as c:
        (out,) = c.lookup([("item-3", secret)], timeout_s=30, support_rdma=False)
    assert out.error is None, out


def test_a_plaintext_store_off_the_loopback_needs_insecure(tmp_path: Path) -> None:
    extra = {"host": "0.0.0.0", "rdma_provider": "none", "runtime_dir": str(tmp_path / "rt")}
    refused = Owner(extra)
    try:
        assert refused.first[0] == "error" and refused.first[1] == "ConfigError", refused.first
        assert "insecure: true" in refused.first[2] and "tls_cert" in refused.first[2], refused.first
    finally:
        refused.close()
    with HeldStore(None) as store, pytest.raises(ConfigError, match="not a loopback address"):
        serve_store("0.0.0.0:0", store=store)
    allowed = Owner({**extra, "insecure": "true"})
    try:
        assert allowed.first[0] == "ready", allowed.first
        secret = new_secret()
        want = allowed.hold("item-4", secret, 6)
        with HeldStoreClient(allowed.endpoint) as c:
            (out,) = c.lookup([("item-4", secret)], timeout_s=30, support_rdma=False)
        assert out.receipt is not None and torch.equal(decode_tensor(out.receipt.embedding), want)
    finally:
        allowed.close()


def test_a_staging_server_and_client_speak_mtls(pki: Pki) -> None:
    with StagingArea(None) as area:
        server = serve_store("127.0.0.1:0", staging=area, tls=tls_of(pki, "llm"))
        try:
            with StagingClient(server.address, tls=TlsConfig(ca=str(pki.ca))) as c, pytest.raises(PeerUnavailable):
                c.drop(["x"], timeout_s=15)
            with StagingClient(server.address, tls=tls_of(pki, "worker")) as c:
                assert c.drop(["x"], timeout_s=30) == 0
        finally:
            server.stop(0)
