"""Argument types and checks shared by the commands: each turns a mistake into one line that says what was
expected, before anything starts.

``port`` / ``metrics_port`` / ``device`` / ``log_level`` are argparse ``type=`` callables (argparse prints
``argument --port: ...`` and exits 2). ``device_problem(device)`` says why a device that parses cannot be used
here (no CUDA in this torch, no such GPU); it imports torch, so commands call it in ``run``, never while the
parser is built.
"""

from __future__ import annotations

import argparse
import re

LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")
_DEVICE = re.compile(r"^(cpu|cuda:(\d+))$")


def _int(text: str, what: str) -> int:
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not {what}") from None


def port(text: str) -> int:
    """A TCP port to listen on: 1..65535, or 0 for one the OS picks."""
    value = _int(text, "a port number")
    if not 0 <= value <= 65535:
        raise argparse.ArgumentTypeError(f"{value} is not a port: give 1..65535, or 0 to let the OS pick one")
    return value


def metrics_port(text: str) -> int:
    """``port``, or -1 for no /metrics endpoint."""
    value = _int(text, "a port number")
    if not -1 <= value <= 65535:
        raise argparse.ArgumentTypeError(
            f"{value} is not a port: give 1..65535, 0 to let the OS pick one, or -1 for no /metrics"
        )
    return value


def device(text: str) -> str:
    """``cpu`` or ``cuda:N`` (an explicit index: never an implicit GPU 0)."""
    if not _DEVICE.match(text):
        raise argparse.ArgumentTypeError(f"{text!r} is not a device: give cpu or cuda:N (e.g. cuda:0)")
    return text


def log_level(text: str) -> str:
    """A logging level name, any case."""
    if text.upper() not in LOG_LEVELS:
        raise argparse.ArgumentTypeError(f"{text!r} is not a log level: give one of {', '.join(LOG_LEVELS)}")
    return text.upper()


def device_problem(name: str) -> str | None:
    """Why ``name`` (already ``cpu``/``cuda:N``) cannot be used in this process, or None when it can."""
    m = _DEVICE.match(name)
    if m is None:
        return f"{name!r} is not a device: give cpu or cuda:N"
    if m.group(2) is None:
        return None
    import torch

    if not torch.cuda.is_available():
        build = "a CPU-only build of torch" if torch.version.cuda is None else "no usable GPU or driver"
        return f"device {name} asked for, but this process has {build} ({torch.__version__}): use --device cpu"
    count = torch.cuda.device_count()
    if int(m.group(2)) >= count:
        return f"device {name} asked for, but this host has {count} GPU(s) (cuda:0..cuda:{count - 1})"
    return None


__all__ = ["LOG_LEVELS", "device", "device_problem", "log_level", "metrics_port", "port"]
