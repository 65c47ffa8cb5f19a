"""Server processes for the vLLM tests: each in its own session (vLLM starts EngineCore and worker processes
under it, and ``kill()`` takes them all), its output in a log file whose tail goes into every failure message."""

from __future__ import annotations

import os
import signal
import subprocess
import time
from collections.abc import Callable, Sequence
from pathlib import Path

START_TIMEOUT_S = float(os.environ.get("TW_VLLM_START_TIMEOUT_S", "900"))


class Spawned:
    def __init__(self, name: str, cmd: list[str], log_path: Path, env: dict[str, str]) -> None:
        self.role = name
        self.log_path = log_path
        self._log = open(log_path, "w")
        self.proc = subprocess.Popen(cmd, stdout=self._log, stderr=subprocess.STDOUT, env=env, start_new_session=True)

    def check_alive(self) -> None:
        if self.proc.poll() is not None:
            raise RuntimeError(f"{self.role} exited with {self.proc.returncode}:\n{self.tail()}")

    def tail(self, n: int = 60) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-n:])
        except OSError:
            return ""

    def kill(self) -> None:
        if self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            self.proc.wait(timeout=30)

    def close(self) -> None:
        self.kill()
        self._log.close()


def wait_ready(procs: Sequence[Spawned], ready: Callable[[Spawned], bool], poll_s: float = 0.5) -> None:
    """Until ``ready(p)`` for every one (each checked alive first), or TimeoutError with their log tails."""
    deadline = time.monotonic() + START_TIMEOUT_S
    starting = list(procs)
    while starting:
        for p in starting:
            p.check_alive()
        starting = [p for p in starting if not ready(p)]
        if starting and time.monotonic() > deadline:
            raise TimeoutError(
                f"{[p.role for p in starting]} not ready after {START_TIMEOUT_S:.0f} s:\n"
                + "\n".join(p.tail() for p in starting)
            )
        time.sleep(poll_s)
