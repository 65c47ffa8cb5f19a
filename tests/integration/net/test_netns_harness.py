"""The namespace harness itself: hosts reach each other and nothing else, partitions cut and heal, nothing is left."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Callable, Sequence

import pytest

from tensorwire.testing import netns

# Listens on (ip, port) inside a host, prints the port, answers one connection with "pong".
SERVER = """
import socket, sys
s = socket.socket(); s.bind((sys.argv[1], 0)); s.listen(1)
print(s.getsockname()[1], flush=True)
s.settimeout(30)
c, _ = s.accept(); c.sendall(b"pong"); c.close()
"""
# Connects to (ip, port) with a timeout; prints what came back or the error's class.
CLIENT = """
import socket, sys
try:
    with socket.create_connection((sys.argv[1], int(sys.argv[2])), timeout=float(sys.argv[3])) as c:
        print(c.recv(10).decode())
except OSError as exc:
    print(type(exc).__name__, exc.errno)
"""
# What rdma._endpoint detects inside a host (no default route there: the interface rule).
DETECT = "from tensorwire.rdma import _endpoint as e; print(e.route_address(), e.detect()[0])"


def _server(host: netns.Host) -> tuple[subprocess.Popen[bytes], int]:
    proc = host.spawn([sys.executable, "-c", SERVER, host.ip])
    assert proc.stdout is not None
    return proc, int(proc.stdout.readline())


@pytest.mark.timeout(120)
def test_hosts_reach_each_other_and_nothing_else(fabric: Callable[[Sequence[str]], netns.Fabric]) -> None:
    net = fabric(["a", "b"])
    a, b = net["a"], net["b"]
    assert a.ip != b.ip and a.ip.startswith("10.233.") and b.ip.startswith("10.233.")
    proc, port = _server(a)
    got = b.run([sys.executable, "-c", CLIENT, a.ip, str(port), "10"]).stdout.strip()
    assert got == "pong"
    proc.wait(10)
    # No route out of a host: the outside is unreachable without a packet leaving (the lookup fails locally).
    out = b.run([sys.executable, "-c", DETECT], env=b.env()).stdout.split()
    assert out == ["None", b.ip]
    # Loopback is per host: a's loopback listener is not b's.
    lo = a.spawn([sys.executable, "-c", SERVER, "127.0.0.1"])
    assert lo.stdout is not None
    lo_port = int(lo.stdout.readline())
    assert b.run([sys.executable, "-c", CLIENT, "127.0.0.1", str(lo_port), "5"]).stdout.startswith(
        "ConnectionRefusedError"
    )
    lo.kill()


@pytest.mark.timeout(120)
def test_partition_cuts_and_heals(fabric: Callable[[Sequence[str]], netns.Fabric]) -> None:
    net = fabric(["a", "b"])
    a, b = net["a"], net["b"]
    proc, port = _server(a)
    net.partition("b")
    got = b.run([sys.executable, "-c", CLIENT, a.ip, str(port), "1.5"]).stdout.strip()
    assert got.startswith(("TimeoutError", "OSError")), got  # dropped: no refusal, no reset
    net.heal("b")
    assert b.run([sys.executable, "-c", CLIENT, a.ip, str(port), "10"]).stdout.strip() == "pong"
    proc.wait(10)


@pytest.mark.timeout(120)
def test_close_leaves_nothing_and_stale_namespaces_are_swept() -> None:
    net = netns.Fabric(["a", "b", "c"])
    names = [h.netns for h in net.hosts.values()] + [net.switch]
    proc = net["a"].spawn([sys.executable, "-c", "import time; time.sleep(600)"])
    net.close()
    net.close()  # idempotent
    assert proc.poll() is not None
    left = set(os.listdir("/run/netns")) & set(names)
    assert not left, left
    assert "tw0" not in subprocess.run(["ip", "-o", "link"], capture_output=True, text=True).stdout
    # A fabric whose creator died (pid 2**22 + 1 is above pid_max's default ceiling, so never alive).
    stale = f"tw-{2**22 + 1}-deadbeef-0"
    subprocess.run(["ip", "netns", "add", stale], check=True)
    assert stale in netns.sweep_stale()
    assert stale not in os.listdir("/run/netns")
