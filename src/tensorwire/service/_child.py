"""``tensorwire`` CLI subprocesses (``serve-encoder``, ``serve-proxy``) as the demo and the tests run them.

``Child`` starts ``python -m tensorwire.cli.main ARGV`` in its own process group (stdout piped for the READY
line, stderr to ``<log_dir>/<name>.log``); ``ready()`` waits for the READY line and ``terminate()`` stops the
whole group: SIGTERM, a grace period, then SIGKILL of every straggler, even when the leader already exited.
``LoopbackDeployment`` is the demo's layout: encoder workers and a proxy in front of them, ports from the OS.
"""

from __future__ import annotations

import os
import queue
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Mapping, Sequence
from pathlib import Path

from tensorwire.service._runtime import parse_ready


class Child:
    """A CLI subprocess in its own process group; ``ready()`` waits for its READY line.

    ``prefix`` goes before the command (``ip netns exec NS``: tests run hosts as network namespaces); ``env``
    replaces this process's environment."""

    def __init__(self, name: str, argv: Sequence[str], log_dir: Path, *, prefix: Sequence[str] = (),
                 env: Mapping[str, str] | None = None) -> None:
        self.name = name
        self.log_path = log_dir / f"{name}.log"
        self._log = open(self.log_path, "wb")  # the child writes it until terminate() closes it
        child_env = dict(os.environ if env is None else env)
        child_env.setdefault("NIXL_LOG_LEVEL", "WARN")
        child_env["PYTHONUNBUFFERED"] = "1"
        self.proc = subprocess.Popen([*prefix, sys.executable, "-m", "tensorwire.cli.main", *argv],
                                     stdout=subprocess.PIPE, stderr=self._log, stdin=subprocess.DEVNULL,
                                     env=child_env, start_new_session=True)
        self._lines: queue.Queue[str | None] = queue.Queue()
        threading.Thread(target=self._pump, name=f"child-{name}-stdout", daemon=True).start()

    def _pump(self) -> None:
        assert self.proc.stdout is not None
        for raw in self.proc.stdout:
            self._lines.put(raw.decode(errors="replace").strip())
        self._lines.put(None)

    def ready(self, timeout_s: float) -> dict[str, str]:
        """The fields of the child's READY line; RuntimeError (naming the log) if it exits or is late."""
        deadline = time.monotonic() + timeout_s
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                raise RuntimeError(f"{self.name} did not print READY within {timeout_s:.0f} s; see {self.log_path}")
            try:
                line = self._lines.get(timeout=min(left, 0.5))
            except queue.Empty:
                continue
            if line is None:
                raise RuntimeError(f"{self.name} exited with {self.proc.wait()} before READY:\n{self.tail()}")
            fields = parse_ready(line)
            if fields is not None:
                return fields

    def tail(self, n: int = 15) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-n:])
        except OSError:
            return ""

    def terminate(self, grace_s: float) -> int | None:
        """SIGTERM the group, wait up to grace_s, then SIGKILL it. Returns the exit code."""
        if self.proc.poll() is None:
            _signal_group(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(grace_s)
            except subprocess.TimeoutExpired:
                pass
        _signal_group(self.proc.pid, signal.SIGKILL)  # stragglers in the group, even if the leader exited
        try:
            code = self.proc.wait(5)
        except subprocess.TimeoutExpired:
            code = None
        self._log.close()
        return code


def _signal_group(pgid: int, sig: int) -> None:
    try:
        os.killpg(pgid, sig)
    except (ProcessLookupError, PermissionError):
        pass


class LoopbackDeployment:
    """``workers`` serve-encoder children and a serve-proxy in front of them on 127.0.0.1, ports from the OS.

    ``start()`` returns once every child printed READY (RuntimeError naming the child and its log otherwise).
    ``children`` lists what was started so far, also after a failed start; ``stop()`` ends them all, the proxy
    first, and returns their exit codes by name. Call ``stop()`` in a ``finally``.
    """

    def __init__(self, workers: int, device: str, log_dir: Path, *, worker_id_prefix: str = "demo-worker") -> None:
        self.workers, self.device, self.log_dir = workers, device, log_dir
        self.worker_id_prefix = worker_id_prefix
        self.children: list[Child] = []
        self.worker_addresses: list[str] = []
        self.proxy_address = ""

    def start(self, startup_timeout_s: float) -> None:
        encoders = [Child(f"encoder-{i}", ["serve-encoder", "--port", "0", "--metrics-port", "-1",
                                           "--worker-id", f"{self.worker_id_prefix}-{i}", "--wait-exporter-s", "20",
                                           "--device", self.device], self.log_dir)
                    for i in range(self.workers)]
        self.children += encoders
        self.worker_addresses = [c.ready(startup_timeout_s)["grpc"] for c in encoders]
        proxy = Child("proxy", ["serve-proxy", "--metrics-port", "-1",
                                *[a for addr in self.worker_addresses for a in ("--worker", addr)]], self.log_dir)
        self.children.append(proxy)
        self.proxy_address = proxy.ready(startup_timeout_s)["grpc"]

    def stop(self, grace_s: float) -> dict[str, int | None]:
        return {c.name: c.terminate(grace_s=grace_s) for c in reversed(self.children)}


__all__ = ["Child", "LoopbackDeployment"]
