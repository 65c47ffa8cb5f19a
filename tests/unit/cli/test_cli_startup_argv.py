"""Which processes get the start-up SIGINT handler: those started as the ``tensorwire`` command, by their
interpreter's own command line (``sys.orig_argv``), and no other."""

from __future__ import annotations

import pytest

from tensorwire._startup import started_as_command

PY = "/venv/bin/python"


@pytest.mark.parametrize(
    "orig_argv",
    [
        [PY, "/venv/bin/tensorwire", "fetch", "--endpoint", "h:1"],
        [PY, "-m", "tensorwire", "serve-encoder"],
        [PY, "-mtensorwire", "--help"],
        [PY, "-m", "tensorwire.cli.main", "demo"],
        [PY, "-X", "importtime", "-u", "-m", "tensorwire", "--help"],
        [PY, "-W", "error", "-m", "tensorwire.__main__"],
    ],
)
def test_the_command_is_recognised(orig_argv: list[str]) -> None:
    assert started_as_command(orig_argv)


@pytest.mark.parametrize(
    "orig_argv",
    [
        [PY, "-m", "pytest", "tests/unit"],
        [PY, "-m", "vllm.entrypoints.openai.api_server"],
        [PY, "/venv/bin/vllm", "serve", "model"],
        [PY, "-c", "import tensorwire", "-m", "tensorwire"],
        [PY, "-m", "tensorwire.bench", "transfer"],
        [PY, "-m", "tensorwire.integrations.vllm_router"],
        [PY, "/home/me/tensorwire.py"],
        [PY, "-X", "tensorwire"],
        [PY],
    ],
)
def test_other_processes_are_left_alone(orig_argv: list[str]) -> None:
    assert not started_as_command(orig_argv)


def test_the_command_leaves_an_ignored_sigint_ignored() -> None:
    # The demo, once interrupted, ignores the stop signals until the process ends; re-enabling SIGINT on the way out
    # of main() let a second Ctrl-C end the process by SIGINT (-2) instead of exit code 130.
    import signal

    from tensorwire import _startup

    before = signal.getsignal(signal.SIGINT)
    try:
        signal.signal(signal.SIGINT, signal.default_int_handler)  # as Python sets it up, unless started ignored
        previous = _startup.arm(force=True)
        signal.signal(signal.SIGINT, signal.SIG_IGN)  # what the interrupted command did
        _startup.disarm(previous, keep_ignored=True)
        assert signal.getsignal(signal.SIGINT) == signal.SIG_IGN
        _startup.arm(force=True)  # not ignored: handed back as before
        _startup.disarm(previous, keep_ignored=True)
        assert signal.getsignal(signal.SIGINT) is previous
    finally:
        signal.signal(signal.SIGINT, before)
