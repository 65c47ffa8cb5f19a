"""Process plumbing: READY lines, native stdout kept off the result stream, /metrics server."""

from __future__ import annotations

import subprocess
import sys
import urllib.request

from prometheus_client import CollectorRegistry, Counter, Histogram

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
    Histogram("tw_test_wait_seconds", "waits", registry=reg).observe(0.1)
    m = MetricsServer(0, registry=reg)
    try:
        with urllib.request.urlopen(f"http://{m.address}/metrics", timeout=10) as resp:
            text = resp.read().decode()
        assert "tw_test_things_total 3.0" in text and "tw_test_wait_seconds_count 1.0" in text
        # No *_created series (one more per counter and histogram), a build-info gauge with the version.
        assert "_created" not in text
        from tensorwire import __version__

        assert 'tensorwire_build_info{python="' in text and f'version="{__version__}"}} 1.0' in text
        with urllib.request.urlopen(f"http://{m.address}/metrics?name[]=tw_test_things_total", timeout=10) as resp:
            only = resp.read().decode()
        assert "tw_test_things_total 3.0" in only and "tw_test_wait_seconds" not in only and "_created" not in only
        # The registry itself is left alone (the library may share prometheus_client with vLLM).
        assert reg.get_sample_value("tw_test_things_created") is not None
    finally:
        m.close()
        m.close()
