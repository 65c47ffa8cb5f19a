"""Ctrl-C in the first moments of a ``tensorwire`` process: once tensorwire's code runs, one line (``interrupted``)
and exit code 130, never a traceback; before it (Python's own start-up) whatever Python does, which never mentions
tensorwire. Real subprocesses (``python -m tensorwire`` and the console script) interrupted at fixed delays after
they were started, and once while ``import torch`` is under way."""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

import tensorwire
from tensorwire.encoder import sample_paths

IMAGE = str(sample_paths()[0])
# Where a SIGINT sent this long after the start lands depends on the host's load: in the interpreter's own start-up,
# in tensorwire's imports, the parser, the command's imports or its wait. Every one must end in an allowed way.
DELAYS_MS = (0, 20, 50, 75, 100, 150, 200, 300)
SCRIPT = Path(sys.executable).with_name("tensorwire")


@pytest.fixture
def silent_endpoint() -> Iterator[str]:
    """A TCP listener that never answers: the fetch waits until it is interrupted."""
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen(64)
    try:
        yield f"127.0.0.1:{sock.getsockname()[1]}"
    finally:
        sock.close()


def _as_from_a_terminal() -> None:
    """A child's SIGINT as a shell at a terminal hands it over. A suite started as a background job (``make test &``,
    nohup) runs with SIGINT ignored, which children inherit and Python then leaves alone."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def _start(launcher: list[str], endpoint: str) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [*launcher, "fetch", "--endpoint", endpoint, "--mode", "grpc", "--timeout-ms", "200000", IMAGE],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        stdin=subprocess.DEVNULL,
        preexec_fn=_as_from_a_terminal,
    )


def _interrupt(proc: subprocess.Popen[str]) -> tuple[int, str, str]:
    try:
        proc.send_signal(signal.SIGINT)
        out, err = proc.communicate(timeout=120)
    finally:
        proc.kill()
        proc.wait()
    return proc.returncode, out, err


_FRAME = re.compile(r'^\s*File "(?P<path>[^"]+)", line (?P<line>\d+), in \S+$')
_PACKAGE = Path(tensorwire.__file__).resolve().parent
# ``import tensorwire`` runs these statements before its SIGINT handler is installed: loading ``_startup`` and
# ``arm()`` up to the moment the handler takes over (the window the ``_startup`` docstring names).
_ARM_LINE = next(
    n for n, text in enumerate((_PACKAGE / "__init__.py").read_text().splitlines(), 1) if text == "_startup.arm()"
)


def _mentions_tensorwire_after_arm(err: str) -> bool:
    """A line of ``err`` names the package (the console script is pip's: ``bin/tensorwire``, no separator after it)
    and is not one of the frames that run before the handler is installed: ``__init__.py`` up to its
    ``_startup.arm()`` line, ``_startup.py`` itself."""
    for text in err.splitlines():
        if f"{os.sep}tensorwire{os.sep}" not in text:
            continue
        frame = _FRAME.match(text)
        if frame is None:
            return True
        path = Path(frame["path"]).resolve()
        if path == _PACKAGE / "_startup.py":
            continue
        if path == _PACKAGE / "__init__.py" and int(frame["line"]) <= _ARM_LINE:
            continue
        return True
    return False


def _outcome(rc: int, out: str, err: str) -> str:
    """``tensorwire`` (the one-line exit), ``python`` (before tensorwire's handler: Python's own start-up, or the
    statements that install the handler), or what went wrong."""
    lines = [line for line in err.splitlines() if line.strip()]
    if rc == 130 and lines == ["interrupted"] and out == "":
        return "tensorwire"
    ours = _mentions_tensorwire_after_arm(err)
    if not ours and out == "" and (rc == -signal.SIGINT or (rc == 1 and err.rstrip().endswith("KeyboardInterrupt"))):
        # Killed before the interpreter installed its handler (-2), or a KeyboardInterrupt in Python's own start-up:
        # `site` ("Fatal Python error: init_import_site", 1), importing `runpy` ("Could not import runpy module", 1),
        # `runpy` finding the module or the console script's `import re` (a traceback, then killed by SIGINT).
        return "python"
    return f"rc={rc} stdout={out!r} stderr={err[-2000:]!r}"


def _launchers() -> list[list[str]]:
    out = [[sys.executable, "-m", "tensorwire"]]
    if SCRIPT.exists():
        out.append([str(SCRIPT)])
    return out


@pytest.mark.timeout(400)
@pytest.mark.parametrize("launcher", _launchers(), ids=lambda a: "script" if len(a) == 1 else "python-m")
def test_ctrl_c_in_the_first_moments_is_one_line_and_130(silent_endpoint: str, launcher: list[str]) -> None:
    outcomes = {}
    for delay_ms in DELAYS_MS:
        proc = _start(launcher, silent_endpoint)
        time.sleep(delay_ms / 1000)  # not synchronisation: the point is to land anywhere
        outcomes[delay_ms] = _outcome(*_interrupt(proc))
    wrong = {d: o for d, o in outcomes.items() if o not in ("tensorwire", "python")}
    assert not wrong, f"Ctrl-C at these delays (ms) did not end in one line and 130: {wrong}; all: {outcomes}"


def _loading_torch(pid: int) -> bool:
    try:
        return "libtorch" in Path(f"/proc/{pid}/maps").read_text()
    except OSError:
        return False


@pytest.mark.timeout(600)
def test_ctrl_c_during_import_torch_is_one_line_and_130(silent_endpoint: str) -> None:
    """Every 25 ms for 0.6 s after libtorch is mapped: a KeyboardInterrupt raised inside torch's C initialisation
    can be swallowed there (on this box 225-275 ms after the mapping, when the command imported torch after the
    start-up handler was gone: the fetch then ran on until its connection attempt gave up, 20 s later)."""
    outcomes = {}
    for after_ms in range(0, 600, 25):
        proc = _start([sys.executable, "-m", "tensorwire"], silent_endpoint)
        deadline = time.monotonic() + 200
        while not _loading_torch(proc.pid) and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.001)
        assert _loading_torch(proc.pid), "the fetch never started importing torch"
        time.sleep(after_ms / 1000)
        outcomes[after_ms] = _outcome(*_interrupt(proc))
    assert set(outcomes.values()) == {"tensorwire"}, outcomes


def test_importing_tensorwire_as_a_library_leaves_sigint_alone() -> None:
    """Only a process started as the command gets the start-up handler; a host process (vLLM, a test) keeps its
    own, including after ``tensorwire.cli.main`` is imported."""
    code = (
        "import signal, tensorwire, tensorwire.cli.main\n"
        "assert signal.getsignal(signal.SIGINT) is signal.default_int_handler, signal.getsignal(signal.SIGINT)\n"
    )
    r = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        timeout=120,
        env=os.environ,
        preexec_fn=_as_from_a_terminal,
    )
    assert r.returncode == 0, r.stderr


_INTERRUPTED_IN_EXEC = """
import argparse, sys, types
from tensorwire.cli.main import run_command

def run(args):
    try:
        exec("raise KeyboardInterrupt")  # as a Ctrl-C landing while dataclasses builds a class during an import
    except KeyboardInterrupt:
        return 130  # the command cleaned up and says so

command = types.SimpleNamespace(run=run)
sys.exit(run_command(command, argparse.Namespace()) if sys.argv[1] == "tensorwire" else run(None))
"""


def test_an_interrupted_command_ends_with_130_even_after_a_keyboardinterrupt_left_exec(tmp_path: Path) -> None:
    """CPython ends a process started with ``-m`` by SIGINT at exit once a KeyboardInterrupt has left ``exec()`` of
    a string, even a caught one; ``run_command`` ends an interrupted command before that can happen."""
    (tmp_path / "interrupted_in_exec.py").write_text(_INTERRUPTED_IN_EXEC)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(tmp_path), *sys.path]))
    rcs = {
        how: subprocess.run(
            [sys.executable, "-m", "interrupted_in_exec", how], capture_output=True, text=True, timeout=120, env=env
        ).returncode
        for how in ("plain", "tensorwire")
    }
    assert rcs["tensorwire"] == 130, f"exit codes: {rcs} (plain: the interpreter's own exit, for comparison)"
