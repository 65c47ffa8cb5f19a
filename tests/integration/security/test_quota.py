"""Issue 15, deliverable 6 and finding 6: a per-peer quota of leased bytes, so one client that never releases
cannot pin the whole slot pool.

A real ``serve-encoder`` with a 64 MiB pool; the attacker runs in a network namespace of its own (a veth pair with
addresses from 10.233.0.0/16 that exist only here), so it is a different plaintext peer (``ip:<address>``) from
the victim on 127.0.0.1. Before issue 15 the attacker's unreleased leases took every slot and the victim's
fetches fell back to inline until the GC window passed.
"""

from __future__ import annotations

import inspect
import os
import secrets
import shutil
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path

import pytest
from _sec import serve
from prometheus_client import CollectorRegistry

from tensorwire.encoder import sample_paths
from tensorwire.mm import MultimodalInput, Plane, RemoteOutputTransport, TransportConfig, metrics_for

POOL_BYTES = 64 << 20

ATTACKER = textwrap.dedent("""
    import sys
    from tensorwire.mm import wire
    from tensorwire.testing import hostile
    target, n, image = sys.argv[1], int(sys.argv[2]), open(sys.argv[3], "rb").read()
    rdma = 0
    with hostile.channel(target) as ch:
        for _ in range(n):
            raw = ch.unary_unary(wire.ENCODE_METHOD)(hostile.encode_request([image], support_rdma=True), timeout=120)
            rdma += bool(wire.EncodeResponse.FromString(raw).rdma_slots)  # never released
    print(rdma)
""")


def _ip(*argv: str) -> None:
    subprocess.run(["ip", *argv], check=True, capture_output=True, timeout=30)


@pytest.fixture
def netns() -> Iterator[tuple[str, str, str]]:
    """(namespace, the host side's address, the namespace side's address); removed afterwards, also on failure."""
    if os.geteuid() != 0 or shutil.which("ip") is None:
        pytest.skip("needs root and the ip tool for a network namespace")
    tag = secrets.token_hex(3)
    ns, host_if, ns_if = f"tw15q-{tag}", f"tw15a{tag}", f"tw15b{tag}"
    octet = int(tag[:2], 16) % 250 + 1
    host_ip, ns_ip = f"10.233.{octet}.1", f"10.233.{octet}.2"
    try:
        _ip("netns", "add", ns)
    except (subprocess.CalledProcessError, OSError) as exc:
        pytest.skip(f"ip netns is not available here: {exc}")
    try:
        _ip("link", "add", host_if, "type", "veth", "peer", "name", ns_if)
        _ip("link", "set", ns_if, "netns", ns)
        _ip("addr", "add", f"{host_ip}/30", "dev", host_if)
        _ip("link", "set", host_if, "up")
        _ip("netns", "exec", ns, "ip", "addr", "add", f"{ns_ip}/30", "dev", ns_if)
        _ip("netns", "exec", ns, "ip", "link", "set", ns_if, "up")
        _ip("netns", "exec", ns, "ip", "link", "set", "lo", "up")
        yield ns, host_ip, ns_ip
    finally:
        subprocess.run(["ip", "link", "del", host_if], capture_output=True, timeout=30)
        subprocess.run(["ip", "netns", "del", ns], capture_output=True, timeout=30)


def _insecure() -> list[str]:
    """``--insecure`` where the listener needs it to bind a non-loopback address (it did not exist before)."""
    try:
        from tensorwire._grpc.host import GrpcHost
    except ImportError:  # older trees had no GrpcHost, and no such rule
        return []
    return ["--insecure"] if "insecure" in inspect.signature(GrpcHost.bind).parameters else []


@pytest.mark.timeout(300)
def test_one_peer_that_never_releases_cannot_pin_the_pool(
    tmp_path: Path, netns: tuple[str, str, str], require_nixl: None
) -> None:
    ns, host_ip, _ = netns
    image = sample_paths()[1]  # 448 x 448: a 2 MiB embedding, in a 4 MiB slot
    worker, ready = serve(
        tmp_path,
        "worker",
        "--host",
        "0.0.0.0",
        *_insecure(),
        "--port",
        "0",
        "--metrics-port",
        "-1",
        "--wait-exporter-s",
        "60",
        "--rdma-pool-cap-bytes",
        str(POOL_BYTES),
        "--rdma-slot-gc-timeout-ms",
        "600000",
        "--rdma-max-slot-bytes",
        str(16 << 20),
    )
    try:
        port = ready["grpc"].rsplit(":", 1)[1]
        attacker = subprocess.run(
            ["ip", "netns", "exec", ns, sys.executable, "-c", ATTACKER, f"{host_ip}:{port}", "24", str(image)],
            capture_output=True,
            text=True,
            timeout=240,
            env=dict(os.environ),
        )
        assert attacker.returncode == 0, attacker.stderr[-3000:]
        pinned = int(attacker.stdout.strip().splitlines()[-1])
        assert 0 < pinned < 24  # its first outputs came over RDMA, the rest inline once it held its quota
        cfg = TransportConfig(local_placement_bytes=0)  # the slots quota: RDMA plane
        with RemoteOutputTransport(f"127.0.0.1:{port}", cfg, metrics=metrics_for(CollectorRegistry())) as victim:
            assert victim.wait_ready(30)
            for _ in range(6):
                out = victim.fetch([MultimodalInput(image.read_bytes())], timeout_ms=60_000)
                assert out.plane is Plane.RDMA, f"the victim fell back to inline ({out.fallback_reason})"
    finally:
        worker.terminate(grace_s=5)
