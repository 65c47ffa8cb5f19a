"""Process plumbing: READY lines, native stdout kept off the result stream, /metrics server."""

from __future__ import annotations

import subprocess
import sys
import urllib.request

from prometheus_client import CollectorRegistry, Counter

from tensorwire.service._runtime import MetricsServer, parse_ready


def test_ready_line_round_trip(capsys) -> None:
    from tensorwire.service._runtime import print_ready

    print_ready(grpc="127.0.0.1:5", metrics="off")
    line = capsys.readouterr().out
    assert line == "READY grpc=127.0.0.1:5 metrics=off\n"
    assert parse_ready(line.strip()) == {"grpc": "127.0.0.1:5", "metrics": "off"}
    assert parse_ready("[1795] UCX table | cma/memory") is None


def test_native_stdout_goes_to_stderr_meanwhile() -> None:
    code = (
        "import os, ctypes\n"
        "from tensorwire.service._runtime import stdout_to_stderr\n"
        "print('before', flush=True)\n"
        "with stdout_to_stderr():\n"
        "    os.write(1, b'fd-one\\n')\n"
        "    ctypes.CDLL(None).printf(b'c-stdio\\n')\n"
        "    print('python-print')\n"
        "print('after')\n"
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    assert r.stdout.split() == ["before", "after"]
    assert "fd-one" in r.stderr and "c-stdio" in r.stderr and "python-print" in r.stderr


def test_metrics_server_serves_its_registry() -> None:
    reg = CollectorRegistry()
    Counter("tw_test_things_total", "things", registry=reg).inc(3)
    m = MetricsServer(0, registry=reg)
    try:
        with urllib.request.urlopen(f"http://{m.address}/metrics", timeout=10) as resp:
            assert "tw_test_things_total 3.0" in resp.read().decode()
    finally:
        m.close()
        m.close()
