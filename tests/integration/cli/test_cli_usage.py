"""The CLI as a newcomer meets it: every mistake is one line on stderr and the documented exit code (no
traceback), a device this process lacks is refused before anything starts, ``--help`` imports no torch, Ctrl-C at
any point is one line and 130, TLS mismatches name TLS and the flags, progress shows on a terminal only.
Real ``tensorwire`` subprocesses throughout; the peers that are not tensorwire servers (a listener that never
answers, a plaintext or an mTLS gRPC server) run in this process."""

from __future__ import annotations

import os
import pty
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from concurrent import futures
from pathlib import Path

import grpc
import pytest
import torch

from tensorwire.encoder import sample_paths

CLI = [sys.executable, "-m", "tensorwire.cli.main"]
IMAGE = str(sample_paths()[0])
MISSING_GPU = f"cuda:{torch.cuda.device_count()}"  # a device index this host does not have, GPUs or not


def _cli(*argv: str, env: dict[str, str] | None = None, timeout: float = 300) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [*CLI, *argv],
        capture_output=True,
        text=True,
        timeout=timeout,
        stdin=subprocess.DEVNULL,
        env={**os.environ, **(env or {})},
    )


def _lines(text: str) -> list[str]:
    return [line for line in text.splitlines() if line.strip()]


@pytest.fixture
def silent_endpoint() -> Iterator[str]:
    """A TCP listener that never answers: the kernel completes connections, nobody speaks HTTP/2."""
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen(16)
    try:
        yield f"127.0.0.1:{sock.getsockname()[1]}"
    finally:
        sock.close()


BAD_USAGE = [
    (["serve-encoder", "--port", "70000"], "70000 is not a port"),
    (["serve-encoder", "--metrics-port", "99999"], "99999 is not a port"),
    (["serve-encoder", "--rdma-port", "70000"], "70000 is not a port"),
    (["serve-proxy", "--worker", "127.0.0.1:7001", "--port", "70000"], "70000 is not a port"),
    (["serve-proxy", "--worker", "127.0.0.1:7001", "--metrics-port", "-2"], "-2 is not a port"),
    (["serve-encoder", "--device", "gpu"], "'gpu' is not a device"),
    (["fetch", "--endpoint", "127.0.0.1:7001", "--device", "cuda", IMAGE], "'cuda' is not a device"),
    (["demo", "--device", "cuda"], "'cuda' is not a device"),
    (["rdma-demo", "--device", "gpu0"], "'gpu0' is not a device"),
    (["fetch", "--log-level", "LOUD", "--endpoint", "127.0.0.1:7001", IMAGE], "'LOUD' is not a log level"),
    (["--log-level", "LOUD", "soak"], "'LOUD' is not a log level"),
    # --log-level after the command is the command's flag, not an image: the next mistake is the one reported.
    (["serve-encoder", "--log-level", "info", "--port", "70000"], "70000 is not a port"),
    (["fetch", "--endpoint", "127.0.0.1:7001"], "required: IMAGE"),
    (["bogus"], "invalid choice: 'bogus'"),
    (["soak", "--duration", "soon"], "invalid float value: 'soon'"),
    (["serve-encoder", "--tls-cert", "/nonexistent.pem"], "--tls-key"),
    (["rdma-demo", "--rows", "0"], "--rows >= 1"),
    # A device that parses but is not on this host: refused before a port is bound, a model loaded or a child
    # started, never a silent CPU or inline run.
    (["serve-encoder", "--device", MISSING_GPU], f"device {MISSING_GPU} asked for"),
    (["serve-encoder", "--rdma-device", MISSING_GPU], f"device {MISSING_GPU} asked for"),
    (["fetch", "--endpoint", "127.0.0.1:7001", "--device", MISSING_GPU, IMAGE], f"device {MISSING_GPU} asked for"),
    (["demo", "--device", MISSING_GPU], f"device {MISSING_GPU} asked for"),
    (["rdma-demo", "--device", MISSING_GPU], f"device {MISSING_GPU} asked for"),
    # The environment's mistakes name the flag that overrides them (the flag is --mode, not --mm-transport-mode).
    (["fetch", "--endpoint", "127.0.0.1:7001", IMAGE, "ENV:MM_TRANSPORT_MODE=rdma"], "or the CLI's --mode"),
]


# Runs each argv through ``main`` in one process (torch is imported once, not once per case), recording the exit
# code, stderr and stdout; an exception escaping ``main`` is recorded with its traceback, and a command that
# starts instead of refusing is stopped by an alarm.
_RUNNER = """
import contextlib, io, json, signal, sys, traceback
import tensorwire.service._runtime as runtime
from tensorwire.cli.main import main

def exit_now(code):  # the servers' os._exit after run() would end this runner
    raise SystemExit(code)

runtime.exit_now = exit_now

class Started(Exception):
    pass

def alarm(signum, frame):
    raise Started("the command started instead of refusing its arguments")

signal.signal(signal.SIGALRM, alarm)
results = []
import os
for argv in json.loads(sys.argv[1]):
    env = dict(a[4:].split("=", 1) for a in argv if a.startswith("ENV:"))
    argv = [a for a in argv if not a.startswith("ENV:")]
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    err, out = io.StringIO(), io.StringIO()
    signal.alarm(60)
    try:
        with contextlib.redirect_stderr(err), contextlib.redirect_stdout(out):
            try:
                code = main(argv)
            except SystemExit as exc:
                code = exc.code
    except BaseException:
        code = None
        err.write(traceback.format_exc())
    finally:
        signal.alarm(0)
        for k, v in saved.items():
            os.environ.pop(k) if v is None else os.environ.__setitem__(k, v)
    results.append([code, err.getvalue(), out.getvalue()])
sys.__stdout__.write(json.dumps(results))
"""


@pytest.mark.timeout(600)
def test_every_usage_mistake_is_one_line_and_exit_code_2() -> None:
    import json

    r = subprocess.run(
        [sys.executable, "-c", _RUNNER, json.dumps([argv for argv, _ in BAD_USAGE])],
        capture_output=True,
        text=True,
        timeout=560,
        stdin=subprocess.DEVNULL,
    )
    assert r.returncode == 0, r.stderr[-3000:]
    wrong = []
    for (argv, says), (code, err, out) in zip(BAD_USAGE, json.loads(r.stdout), strict=True):
        if code != 2 or "Traceback" in err or len(_lines(err)) != 1 or says not in err or out:
            wrong.append(f"tensorwire {' '.join(argv)}: exit {code}, stderr {err[-600:]!r}, stdout {out[-200:]!r}")
    assert not wrong, "\n".join(wrong)


@pytest.mark.timeout(400)
@pytest.mark.parametrize(
    "argv",
    [["serve-encoder", "--port", "70000"], ["fetch", "--endpoint", "127.0.0.1:7001", "--device", MISSING_GPU, IMAGE]],
)
def test_the_entry_point_itself_exits_2_with_one_line(argv: list[str]) -> None:
    r = _cli(*argv)
    assert r.returncode == 2 and len(_lines(r.stderr)) == 1 and "Traceback" not in r.stderr, r.stderr


HEAVY = ("torch", "grpc", "nixl", "numpy", "PIL", "ssl")  # what a --help never needs (start-up time)


@pytest.mark.timeout(120)
def test_help_of_every_command_imports_nothing_heavy() -> None:
    """``--help`` builds only the asked command's flags, and building them imports none of ``HEAVY`` (each run in a
    fresh interpreter, as a user's would be)."""
    code = (
        "import contextlib, io, sys\n"
        "from tensorwire.cli.main import main\n"
        "with contextlib.redirect_stdout(io.StringIO()), contextlib.suppress(SystemExit):\n"
        "    main(sys.argv[1:])\n"
        f"print(' '.join(m for m in {HEAVY!r} if m in sys.modules))\n"
    )
    from tensorwire.cli.main import COMMANDS

    loaded = {}
    for argv in [["--help"], *[[c, "--help"] for c in COMMANDS]]:
        r = subprocess.run([sys.executable, "-c", code, *argv], capture_output=True, text=True, timeout=100)
        assert r.returncode == 0, r.stderr
        if r.stdout.strip():
            loaded["tensorwire " + " ".join(argv)] = r.stdout.strip()
    assert not loaded, f"--help imported: {loaded}"


def _loading_torch(pid: int) -> bool:
    """True once the process maps torch's library: the CLI's own code runs (only a command imports torch), and
    the import is under way."""
    try:
        return "libtorch" in Path(f"/proc/{pid}/maps").read_text()
    except OSError:
        return False


@pytest.mark.timeout(400)
@pytest.mark.parametrize("after_s", [0.0, 1.0, 3.0])
def test_ctrl_c_at_any_point_is_one_line_and_exit_130(silent_endpoint: str, after_s: float) -> None:
    """Ctrl-C while torch is being imported, while the transport starts, or while the request waits: one line,
    exit code 130."""
    proc = subprocess.Popen(
        [*CLI, "fetch", "--endpoint", silent_endpoint, "--mode", "grpc", "--timeout-ms", "200000", IMAGE],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        stdin=subprocess.DEVNULL,
    )
    try:
        deadline = time.monotonic() + 200
        while not _loading_torch(proc.pid) and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.001)
        time.sleep(after_s)  # where the interruption lands; every point must give the same outcome
        proc.send_signal(signal.SIGINT)
        out, err = proc.communicate(timeout=200)
    finally:
        proc.kill()
        proc.wait()
    assert proc.returncode == 130, (proc.returncode, err)
    assert "Traceback" not in err and _lines(err) == ["interrupted"], err
    assert out == ""


@pytest.fixture
def pki(tmp_path: Path):  # type: ignore[no-untyped-def]
    from tensorwire.testing.pki import PkiUnavailable, make_pki

    try:
        return make_pki(tmp_path / "pki", ["server", "client"])
    except PkiUnavailable as exc:
        pytest.skip(str(exc))


def _grpc_server(credentials: grpc.ServerCredentials | None) -> tuple[grpc.Server, str]:
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    port = (
        server.add_secure_port("127.0.0.1:0", credentials)
        if credentials is not None
        else server.add_insecure_port("127.0.0.1:0")
    )
    server.start()
    return server, f"127.0.0.1:{port}"


@pytest.mark.timeout(900)
def test_tls_mismatches_name_tls_and_the_flags_that_fix_them(pki) -> None:  # type: ignore[no-untyped-def]
    plain, plain_ep = _grpc_server(None)
    creds = grpc.ssl_server_credentials(
        [(pki["server"].key.read_bytes(), pki["server"].cert.read_bytes())],
        root_certificates=pki.ca.read_bytes(),
        require_client_auth=True,
    )
    mtls, mtls_ep = _grpc_server(creds)
    fetch = ["fetch", "--mode", "grpc", "--timeout-ms", "20000", "--json"]
    try:
        cases = [
            ([*fetch, "--endpoint", plain_ep, "--tls-ca", str(pki.ca)], ["TLS mismatch", "plaintext", "--tls-"]),
            ([*fetch, "--endpoint", mtls_ep], ["requires TLS", "--tls-ca"]),
            ([*fetch, "--endpoint", mtls_ep, "--tls-ca", str(pki.ca)], ["client certificate", "--tls-cert"]),
        ]
        for argv, words in cases:
            r = _cli(*argv, IMAGE)
            assert r.returncode == 1, (argv, r.stderr)
            import json

            hint = json.loads(r.stdout)["error"].get("hint", "")
            assert all(w in hint for w in words), (argv, hint)
            # Text mode: the hint on the error line, and gRPC's own log lines stay out of stderr.
            r = _cli(*[a for a in argv if a != "--json"], IMAGE)
            assert r.returncode == 1 and len(_lines(r.stderr)) == 1, r.stderr
            assert all(w in r.stderr for w in words), r.stderr
    finally:
        plain.stop(None)
        mtls.stop(None)


@pytest.mark.timeout(900)
def test_serve_proxy_names_tls_when_its_workers_speak_otherwise(pki) -> None:  # type: ignore[no-untyped-def]
    """The proxy's wait for a worker's WorkerInfo ends with the TLS mismatch and the flags, not a silent wait and a
    timeout (the worker never answers until the flags change)."""
    plain, plain_ep = _grpc_server(None)
    creds = grpc.ssl_server_credentials(
        [(pki["server"].key.read_bytes(), pki["server"].cert.read_bytes())],
        root_certificates=pki.ca.read_bytes(),
        require_client_auth=True,
    )
    mtls, mtls_ep = _grpc_server(creds)
    proxy = ["serve-proxy", "--worker-wait-s", "120", "--metrics-port", "-1"]
    own_tls = ["--tls-cert", str(pki["client"].cert), "--tls-key", str(pki["client"].key), "--tls-ca", str(pki.ca)]
    try:
        cases = [
            ([*proxy, "--worker", mtls_ep], ["requires TLS", "--tls-ca"]),
            ([*proxy, "--worker", plain_ep, *own_tls], ["TLS mismatch", "plaintext", "--tls-"]),
            ([*proxy, "--worker", mtls_ep, "--tls-ca", str(pki.ca)], ["client certificate", "--tls-cert"]),
        ]
        for argv, words in cases:
            r = _cli(*argv)
            assert r.returncode == 1 and len(_lines(r.stderr)) == 1, (argv, r.stderr)
            assert all(w in r.stderr for w in words) and "within 120.0 s" not in r.stderr, (argv, r.stderr)
    finally:
        plain.stop(None)
        mtls.stop(None)


def _on_tty(argv: list[str], timeout: float = 300) -> tuple[int, str]:
    """Runs the CLI with stderr on a pseudo-terminal; (exit code, what the terminal showed)."""
    master, slave = pty.openpty()
    proc = subprocess.Popen([*CLI, *argv], stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=slave)
    os.close(slave)
    shown = bytearray()

    def pump() -> None:
        while True:
            try:
                chunk = os.read(master, 4096)
            except OSError:  # EIO: every writer of the terminal is gone
                return
            if not chunk:
                return
            shown.extend(chunk)

    reader = threading.Thread(target=pump, daemon=True)
    reader.start()
    try:
        code = proc.wait(timeout)
    finally:
        proc.kill()
        reader.join(10)
        os.close(master)
    return code, shown.decode(errors="replace")


@pytest.mark.timeout(900)
def test_long_waits_show_progress_on_a_terminal_and_nothing_when_piped(silent_endpoint: str) -> None:
    fetch = ["fetch", "--endpoint", silent_endpoint, "--mode", "grpc", "--timeout-ms", "3000", IMAGE, IMAGE]
    code, shown = _on_tty(fetch)
    assert code == 1 and f"fetching 2 images from {silent_endpoint}" in shown, shown
    piped = _cli(*fetch)
    assert piped.returncode == 1 and "fetching" not in piped.stderr and "\r" not in piped.stderr, piped.stderr

    proxy = ["serve-proxy", "--worker", silent_endpoint, "--worker-wait-s", "2", "--metrics-port", "-1"]
    code, shown = _on_tty(proxy)
    assert code == 1 and "waiting for 1 worker(s) to answer WorkerInfo" in shown, shown
    piped = _cli(*proxy)
    assert piped.returncode == 1 and "waiting for" not in piped.stderr, piped.stderr
