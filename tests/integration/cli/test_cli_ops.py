"""Operating the CLI (issue 16): ports in use, endpoint validation, ``fetch --json`` errors, no orphans after the
parent dies (SIGKILL included), Ctrl-C of the demo on a busy host. Real processes throughout."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tensorwire.service._child import Child

CLI = [sys.executable, "-m", "tensorwire.cli.main"]


def _cli(*argv: str, timeout: float = 90) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*CLI, *argv], capture_output=True, text=True, timeout=timeout, stdin=subprocess.DEVNULL)


def _alive(pid: int) -> bool:
    """True while ``pid`` runs (a zombie waiting for its new parent to reap it counts as dead)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def _descendants(pid: int) -> list[int]:
    out: list[int] = []
    todo = [pid]
    while todo:
        p = todo.pop()
        for task in Path(f"/proc/{p}/task").glob("*"):
            try:
                kids = [int(k) for k in (task / "children").read_text().split()]
            except OSError:
                continue
            out += kids
            todo += kids
    return out


def _survivors(pids: list[int], within_s: float) -> list[int]:
    deadline = time.monotonic() + within_s
    while time.monotonic() < deadline:
        left = [p for p in pids if _alive(p)]
        if not left:
            return []
        time.sleep(0.05)
    return [p for p in pids if _alive(p)]


def _kill_all(pids: list[int]) -> None:
    for p in pids:
        try:
            os.kill(p, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass


@pytest.fixture
def busy_cpu() -> Iterator[None]:
    """One process spinning on a core beside the test, as on a shared CI machine."""
    burner = subprocess.Popen([sys.executable, "-c", "while True: pass"], stdin=subprocess.DEVNULL)
    try:
        yield
    finally:
        burner.kill()
        burner.wait(10)


def _wait_line(stream, prefix: bytes, timeout_s: float) -> bytes:
    """The first line of ``stream`` starting with ``prefix``; a reader thread keeps the deadline honest."""
    import queue
    import threading

    lines: queue.Queue[bytes | None] = queue.Queue()

    def pump() -> None:
        for raw in stream:
            lines.put(raw)
        lines.put(None)

    threading.Thread(target=pump, daemon=True).start()
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            raw = lines.get(timeout=0.5)
        except queue.Empty:
            continue
        if raw is None:
            break
        if raw.startswith(prefix):
            return raw
    raise AssertionError(f"no line starting with {prefix!r} within {timeout_s:.0f} s")


# ---- ports


@pytest.mark.timeout(300)
def test_a_port_in_use_is_a_clear_error_with_exit_code_3_for_every_server(tmp_path: Path) -> None:
    first = Child("first", ["serve-encoder", "--port", "0", "--metrics-port", "-1", "--drain-s", "0"], tmp_path)
    try:
        port = first.ready(120)["grpc"].rsplit(":", 1)[1]
        # The old encoder printed READY and shared the port (gRPC's SO_REUSEPORT): requests were split between them.
        r = _cli("serve-encoder", "--port", port, "--metrics-port", "-1")
        assert r.returncode == 3, (r.returncode, r.stderr[-2000:])
        assert "READY" not in r.stdout and f"port {port} is in use" in r.stderr
        # The old proxy died with a traceback.
        r = _cli("serve-proxy", "--port", port, "--worker", "127.0.0.1:1", "--no-check-workers", "--metrics-port", "-1")
        assert r.returncode == 3 and f"port {port} is in use" in r.stderr and "Traceback" not in r.stderr, r.stderr
        # /metrics on a port in use: the same.
        r = _cli("serve-proxy", "--metrics-port", port, "--worker", "127.0.0.1:1", "--no-check-workers")
        assert r.returncode == 3 and "for /metrics: the port is in use" in r.stderr and "Traceback" not in r.stderr
        # Messages carry no object reprs (was: "cannot identify image file <_io.BytesIO object at 0x7f..>").
        bad = tmp_path / "bad.jpg"
        bad.write_bytes(b"not an image at all")
        r = _cli("fetch", "--endpoint", f"127.0.0.1:{port}", "--mode", "grpc", str(bad))
        assert r.returncode == 1 and "cannot decode" in r.stderr and " object at 0x" not in r.stderr, r.stderr
    finally:
        first.terminate(grace_s=10)


# ---- fetch: endpoint validation, --json on failure


@pytest.mark.timeout(120)
@pytest.mark.parametrize(
    "endpoint,why",
    [
        ("localhost", "the port is missing"),  # gRPC would have used port 443
        ("127.0.0.1:99999", "'99999' is not a port"),  # and this some other port
        ("127.0.0.1:0", "'0' is not a port"),
        ("dns:///localhost:7001", "target schemes"),
        ("::1:7001", "brackets"),
    ],
)
def test_fetch_refuses_an_endpoint_that_is_not_host_port(endpoint: str, why: str) -> None:
    r = _cli("fetch", "--endpoint", endpoint, "--json", "image.jpg")
    assert r.returncode == 2
    doc = json.loads(r.stdout)
    assert doc["schema"] == "tensorwire.fetch" and doc["schema_version"] == 1 and doc["ok"] is False
    assert doc["error"]["type"] == "ConfigError" and doc["error"]["reason"] == "invalid_config"
    assert why in doc["error"]["message"] and doc["error"]["exit_code"] == 2


@pytest.mark.timeout(120)
def test_fetch_json_prints_an_error_object_when_the_fetch_fails(tmp_path: Path) -> None:
    from tensorwire.encoder import sample_paths

    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    r = _cli(
        "fetch",
        "--endpoint",
        f"127.0.0.1:{port}",
        "--json",
        "--timeout-ms",
        "3000",
        "--wait-reader-s",
        "0",
        str(sample_paths()[0]),
    )
    assert r.returncode == 1
    doc = json.loads(r.stdout)  # the old fetch printed nothing on stdout
    assert doc["ok"] is False and doc["endpoint"] == f"127.0.0.1:{port}"
    assert doc["error"]["type"] == "PeerUnavailable" and doc["error"]["reason"] == "peer_unavailable"
    missing = tmp_path / "missing.png"
    r = _cli("fetch", "--endpoint", "127.0.0.1:7001", "--json", str(missing))
    doc = json.loads(r.stdout)
    assert r.returncode == 2 and doc["error"]["exit_code"] == 2 and str(missing) in doc["error"]["message"]
    # The keys are documented where a user looks: --help.
    help_text = _cli("fetch", "--help").stdout
    assert 'schema "tensorwire.fetch" version 1' in help_text and "ok=false" in help_text


# ---- no orphans


def _sigkill_leaves_no_child(argv: list[str], ready_line: bytes, env: dict[str, str] | None = None) -> None:
    """Start ``tensorwire *argv``, wait for ``ready_line`` on its stderr, SIGKILL it (no finally, no atexit: only
    the children's lifeline can stop them) and require every descendant gone within 5 s."""
    proc = subprocess.Popen(
        [*CLI, *argv], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, stdin=subprocess.DEVNULL, env=env
    )
    pids: list[int] = []
    try:
        assert proc.stderr is not None
        _wait_line(proc.stderr, ready_line, 240)
        pids = _descendants(proc.pid)
        assert len(pids) >= 3 and all(_alive(p) for p in pids), pids
        proc.kill()
        proc.wait(10)
        survivors = _survivors(pids, 5.0)
        assert survivors == [], f"children still running 5 s after {argv[0]} was SIGKILLed: {survivors}"
    finally:
        if proc.poll() is None:
            proc.kill()
        _kill_all(pids)
        proc.communicate(timeout=60)  # reaps it and closes our end of its stderr


@pytest.mark.timeout(300)
def test_sigkill_of_the_demo_leaves_no_child_running() -> None:
    _sigkill_leaves_no_child(["demo", "--rounds", "500", "--no-progress"], b"ready after")  # 2 workers, a proxy


@pytest.mark.timeout(300)
def test_sigkill_of_the_soak_leaves_no_child_running() -> None:
    env = dict(os.environ, UCX_NET_DEVICES="lo", NIXL_LOG_LEVEL="WARN")
    _sigkill_leaves_no_child(
        ["soak", "--duration", "300", "--concurrency", "2", "--faults", "none", "--progress-s", "60"],
        b"soak running",
        env,
    )  # 2 workers, 2 clients


@pytest.mark.timeout(300)
@pytest.mark.parametrize("when", ["starting", "ready after"])
def test_ctrl_c_stops_the_demo_and_its_children_on_a_busy_host(busy_cpu: None, when: str) -> None:
    proc = subprocess.Popen(
        [*CLI, "demo", "--rounds", "500", "--no-progress"],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        stdin=subprocess.DEVNULL,
    )
    pids: list[int] = []
    try:
        assert proc.stderr is not None
        line = _wait_line(proc.stderr, when.encode(), 240)
        if when == "starting":
            deadline = time.monotonic() + 60  # a child started: Ctrl-C in the middle of the start-up
            while not _descendants(proc.pid) and time.monotonic() < deadline:
                time.sleep(0.05)
        else:
            pids = [int(p) for p in line.decode().rsplit("(pids ", 1)[1].rstrip(")\n").split()]
        pids = sorted(set(pids) | set(_descendants(proc.pid)))
        assert pids
        proc.send_signal(signal.SIGINT)  # what Ctrl-C sends; the children sit in their own sessions
        proc.send_signal(signal.SIGINT)  # an impatient second one must not cut the clean-up short
        # The children get SIGTERM together, then SIGKILL: bounded by their grace + 10 s, however busy the host.
        assert proc.wait(60) == 130
        assert _survivors(pids, 5.0) == []
    finally:
        if proc.poll() is None:
            proc.kill()
        _kill_all(pids)
        proc.communicate(timeout=60)  # reaps it and closes our end of its stderr
