"""Shared set-up of the issue-15 regression tests: real ``tensorwire`` CLI processes, a throwaway CA, and what the
tests read about a process from /proc (its RSS and CPU time)."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from tensorwire._grpc.tls import TlsConfig
from tensorwire.service._child import Child
from tensorwire.testing.pki import Pki, PkiUnavailable, make_pki

CLIENT_NAMES = ("worker", "proxy", "llm", "attacker")


def pki_or_skip(directory: Path) -> Pki:
    try:
        return make_pki(directory, CLIENT_NAMES)
    except PkiUnavailable as exc:
        pytest.skip(str(exc))


def tls_of(pki: Pki, name: str, **kw: Any) -> TlsConfig:
    return TlsConfig(cert=str(pki[name].cert), key=str(pki[name].key), ca=str(pki.ca), **kw)


def tls_flags(pki: Pki, name: str) -> list[str]:
    return ["--tls-cert", str(pki[name].cert), "--tls-key", str(pki[name].key), "--tls-ca", str(pki.ca)]


def serve(tmp: Path, name: str, *argv: str, ready_s: float = 150.0) -> tuple[Child, dict[str, str]]:
    """A ``tensorwire serve-encoder`` (or ``serve-proxy`` when argv starts with it) child and its READY fields."""
    args = list(argv) if argv and argv[0] == "serve-proxy" else ["serve-encoder", *argv]
    child = Child(name, args, tmp)
    try:
        return child, child.ready(ready_s)
    except BaseException:
        child.terminate(grace_s=2)
        raise


def cli(*argv: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "tensorwire.cli.main", *argv],
        capture_output=True,
        text=True,
        timeout=timeout,
        stdin=subprocess.DEVNULL,
    )


def non_loopback_ip() -> str:
    """This machine's address on its default route (no packet is sent), or skip."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            s.connect(("10.255.255.255", 1))
            ip = s.getsockname()[0]
        except OSError:
            pytest.skip("no non-loopback IPv4 address on this machine")
    if ip.startswith("127."):
        pytest.skip("no non-loopback IPv4 address on this machine")
    return str(ip)


def rss_bytes(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise AssertionError(f"no VmRSS for pid {pid}")


def cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def wait_until(pred: Callable[[], bool], timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not pred():
        assert time.monotonic() < deadline, f"{what} not reached within {timeout_s:.0f} s"
        time.sleep(0.02)
