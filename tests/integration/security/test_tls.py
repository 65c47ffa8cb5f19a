"""Issue 15, deliverable 1 and finding 2: TLS / mTLS on every gRPC hop, plaintext only on loopback unless
``--insecure``, ``/metrics`` and ``WorkerInfo`` on loopback by default, certificates replaced without a restart.

Real ``serve-encoder`` / ``serve-proxy`` processes and a CA made at run time. On the code before issue 15 every
test here fails: there are no TLS flags (the servers do not start), a plaintext listener binds 0.0.0.0 without
complaint, /metrics follows ``--host`` and WorkerInfo answers anyone.
"""

from __future__ import annotations

import os
import shutil
import signal
import time
import urllib.error
import urllib.request
from pathlib import Path

import grpc
import pytest
import torch
from _sec import cli, non_loopback_ip, pki_or_skip, serve, tls_flags, tls_of, wait_until
from prometheus_client import CollectorRegistry

from tensorwire._grpc.tls import TlsConfig, channel_credentials, channel_options
from tensorwire.encoder import sample_paths
from tensorwire.errors import PeerUnavailable
from tensorwire.mm import (
    EncoderOutput,
    MultimodalInput,
    RemoteOutputTransport,
    TransportConfig,
    metrics_for,
    serve_encoder,
)
from tensorwire.rdma import RdmaConfig
from tensorwire.service._child import Child
from tensorwire.service._info import INFO_METHOD
from tensorwire.service._proto import service_pb2
from tensorwire.testing.pki import make_pki

IMAGE = sample_paths()[1]  # checker_448.png: quick to encode


def _client(endpoint: str, tls: object = None, **kw: object) -> RemoteOutputTransport:
    cfg = TransportConfig(**({"tls": tls} if tls is not None else {}), **kw)  # type: ignore[arg-type]
    return RemoteOutputTransport(endpoint, cfg, metrics=metrics_for(CollectorRegistry()))


def _worker_info(target: str, tls: object = None) -> grpc.StatusCode:
    if tls is not None:
        ch = grpc.secure_channel(target, channel_credentials(tls))  # type: ignore[arg-type]
    else:
        ch = grpc.insecure_channel(target)
    with ch:
        call = ch.unary_unary(
            INFO_METHOD,
            request_serializer=service_pb2.WorkerInfoRequest.SerializeToString,
            response_deserializer=service_pb2.WorkerInfoResponse.FromString,
        )
        try:
            call(service_pb2.WorkerInfoRequest(), timeout=20)
            return grpc.StatusCode.OK
        except grpc.RpcError as exc:
            return exc.code()


@pytest.mark.timeout(300)
def test_mtls_on_every_hop_encoder_proxy_client_and_fetch(tmp_path: Path) -> None:
    pki = pki_or_skip(tmp_path / "pki")
    worker = proxy = None
    try:
        worker, w = serve(
            tmp_path,
            "worker",
            "--port",
            "0",
            "--metrics-port",
            "-1",
            "--worker-id",
            "tls-w0",
            *tls_flags(pki, "worker"),
        )
        assert w["tls"] == "mtls"
        proxy, p = serve(
            tmp_path,
            "proxy",
            "serve-proxy",
            "--worker",
            w["grpc"],
            "--metrics-port",
            "-1",
            "--worker-wait-s",
            "60",
            *tls_flags(pki, "proxy"),
        )
        assert p["tls"] == "mtls"  # the proxy also asked the worker for WorkerInfo over mTLS to get here
        image = IMAGE.read_bytes()
        for endpoint in (w["grpc"], p["grpc"]):
            with _client(endpoint, tls_of(pki, "llm")) as c:
                c.wait_ready(20)
                out = c.fetch([MultimodalInput(image)], timeout_ms=60_000)
                assert out.worker_id == "tls-w0" and out.embeddings[0].shape[1] == 2048
            # No certificate, or no TLS at all: the handshake is refused, nothing is served.
            for tls in (None, TlsConfig(ca=str(pki.ca))):
                with _client(endpoint, tls, mode="grpc") as c, pytest.raises(PeerUnavailable):
                    c.fetch([MultimodalInput(image)], timeout_ms=10_000)
        # The fetch command speaks mTLS from its flags.
        r = cli("fetch", "--endpoint", p["grpc"], "--json", "--mode", "grpc", *tls_flags(pki, "llm"), str(IMAGE))
        assert r.returncode == 0, r.stderr[-2000:]
        r = cli("fetch", "--endpoint", p["grpc"], "--mode", "grpc", "--tls-ca", str(pki.ca), str(IMAGE))
        assert r.returncode == 1 and "PeerUnavailable" in r.stderr
    finally:
        for child in (proxy, worker):
            if child is not None:
                child.terminate(grace_s=5)


def _exits_or_ready(child: Child, timeout_s: float) -> int | None:
    """The exit code when the child exits first; None when it printed READY (it serves)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        rc = child.proc.poll()
        if rc is not None:
            return rc
        try:
            child.ready(0.2)
            return None
        except Exception:
            continue
    raise AssertionError(f"{child.name} neither exited nor served within {timeout_s:.0f} s")


@pytest.mark.timeout(300)
def test_a_plaintext_listener_leaves_the_loopback_only_with_insecure(tmp_path: Path) -> None:
    for argv in (["--host", "0.0.0.0"], ["--host", "127.0.0.1", "--metrics-host", "0.0.0.0"]):
        child = Child("plain", ["serve-encoder", "--port", "0", *argv], tmp_path)
        try:
            rc = _exits_or_ready(child, 150)
        finally:
            child.terminate(grace_s=2)
        assert rc == 2, f"{argv}: a plaintext non-loopback listener started"  # a refused configuration
        assert "--insecure" in child.log_path.read_text()
    r = cli("serve-proxy", "--worker", "127.0.0.1:9", "--no-check-workers", "--host", "0.0.0.0")
    assert r.returncode == 2 and "--insecure" in r.stderr


@pytest.mark.timeout(300)
def test_metrics_and_worker_info_stay_on_loopback_by_default(tmp_path: Path) -> None:
    outside = non_loopback_ip()
    pki = pki_or_skip(tmp_path / "pki")
    plain = tls = None
    try:
        plain, r = serve(tmp_path, "plain", "--host", "0.0.0.0", "--insecure", "--port", "0", "--metrics-port", "0")
        metrics_host, metrics_port = r["metrics"].rsplit(":", 1)
        assert metrics_host == "127.0.0.1"  # not --host
        with pytest.raises((urllib.error.URLError, ConnectionError, OSError)):
            urllib.request.urlopen(f"http://{outside}:{metrics_port}/metrics", timeout=5)
        with urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics", timeout=10) as resp:
            assert b"tensorwire_mm_" in resp.read()
        port = r["grpc"].rsplit(":", 1)[1]
        assert _worker_info(f"127.0.0.1:{port}") is grpc.StatusCode.OK
        assert _worker_info(f"{outside}:{port}") is grpc.StatusCode.PERMISSION_DENIED
        # With mTLS, a peer that presented a certificate the worker verified may ask from anywhere.
        tls, t = serve(
            tmp_path, "tls", "--host", "0.0.0.0", "--port", "0", "--metrics-port", "-1", *tls_flags(pki, "worker")
        )
        tport = t["grpc"].rsplit(":", 1)[1]
        assert _worker_info(f"localhost:{tport}", tls_of(pki, "proxy")) is grpc.StatusCode.OK
        override = tls_of(pki, "proxy", server_name="localhost")  # the certificate names localhost, not this IP
        with grpc.secure_channel(
            f"{outside}:{tport}", channel_credentials(override), options=channel_options(override)
        ) as ch:
            call = ch.unary_unary(
                INFO_METHOD,
                request_serializer=service_pb2.WorkerInfoRequest.SerializeToString,
                response_deserializer=service_pb2.WorkerInfoResponse.FromString,
            )
            assert call(service_pb2.WorkerInfoRequest(), timeout=20).worker_id
    finally:
        for child in (tls, plain):
            if child is not None:
                child.proc.send_signal(signal.SIGTERM)
                child.terminate(grace_s=5)


@pytest.mark.timeout(180)
def test_new_connections_get_replaced_certificates_without_a_restart(tmp_path: Path) -> None:
    old = pki_or_skip(tmp_path / "old")
    new = make_pki(tmp_path / "new", ["worker", "llm"], ca_name="rotated-ca")
    live = tmp_path / "live"
    live.mkdir()
    for src, name in ((old["worker"].cert, "cert.pem"), (old["worker"].key, "key.pem"), (old.ca, "ca.pem")):
        shutil.copy(src, live / name)
    server_tls = TlsConfig(cert=str(live / "cert.pem"), key=str(live / "key.pem"), ca=str(live / "ca.pem"))
    emb = torch.ones(4, 8)
    server = serve_encoder(
        lambda inputs: EncoderOutput(embeddings=[emb], split_sizes=[4]),
        TransportConfig(tls=server_tls, rdma=RdmaConfig(provider="none")),
        "127.0.0.1:0",
    )
    try:

        def fetch_with(tls: object) -> bool:
            with _client(server.address, tls, mode="grpc") as c:
                try:
                    return bool(c.fetch([MultimodalInput(b"x")], timeout_ms=5_000).embeddings)
                except PeerUnavailable:
                    return False

        assert fetch_with(tls_of(old, "llm")) and not fetch_with(tls_of(new, "llm"))
        # Rotate: the new key first, then the certificate, then the CA (a half-done rotation keeps the old pair).
        for src, name in ((new["worker"].key, "key.pem"), (new["worker"].cert, "cert.pem"), (new.ca, "ca.pem")):
            shutil.copy(src, live / f".{name}")
            os.replace(live / f".{name}", live / name)
        wait_until(lambda: fetch_with(tls_of(new, "llm")), 20, "a handshake with the rotated certificate")
        assert not fetch_with(tls_of(old, "llm"))  # the old CA's clients are no longer accepted
        assert server._host.certificates.reloads >= 1
    finally:
        server.stop(0)


@pytest.mark.timeout(120)
def test_the_same_host_channel_stays_closed_under_mtls_unless_asked_for(tmp_path: Path) -> None:
    """The Unix-socket channel authenticates by uid, not by certificate: a worker whose gRPC listener requires
    client certificates does not open it under ``local_channel="auto"``; ``"on"`` opens it; plaintext opens it."""
    pki = pki_or_skip(tmp_path / "pki")
    emb = torch.ones(4, 8)

    def opened(**kw: object) -> bool:
        cfg = TransportConfig(rdma=RdmaConfig(provider="none"), local_channel_dir=str(tmp_path / "run"), **kw)  # type: ignore[arg-type]
        server = serve_encoder(lambda inputs: EncoderOutput(embeddings=[emb], split_sizes=[4]), cfg, "127.0.0.1:0")
        try:
            return server.service.local is not None
        finally:
            server.stop(0)

    assert opened()  # plaintext on loopback
    assert not opened(tls=tls_of(pki, "worker"))
    assert opened(tls=tls_of(pki, "worker"), local_channel="on")
    assert opened(tls=tls_of(pki, "worker", client_auth=False))  # TLS without client certificates: uid is as good
    assert not opened(local_channel="off")
