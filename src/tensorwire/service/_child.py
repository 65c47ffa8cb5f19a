"""``tensorwire`` CLI subprocesses (``serve-encoder``, ``serve-proxy``) as the demo and the tests run them.

``Child`` runs the CLI in its own process group; ``ready()`` waits for the READY line; ``terminate()`` stops the
whole group (SIGTERM, grace, SIGKILL of stragglers). Every child holds this process's lifeline: it dies with
its parent. ``LoopbackDeployment``: encoder workers and a proxy, ports from the OS.
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

from tensorwire._lifeline import parent_lifeline
from tensorwire.service._runtime import parse_ready

CHILD_GRACE_S = 5.0  # the deployment's children get --grace-s this; stop() waits that + 5 s before SIGKILL


class Child:
    """A CLI subprocess in its own process group; ``ready()`` waits for its READY line.

    ``prefix`` goes before the command (``ip netns exec NS``: tests run hosts as network namespaces); ``env``
    replaces this process's environment."""

    def __init__(
        self,
        name: str,
        argv: Sequence[str],
        log_dir: Path,
        *,
        prefix: Sequence[str] = (),
        env: Mapping[str, str] | None = None,
    ) -> None:
        self.name = name
        self.log_path = log_dir / f"{name}.log"
        self._log = open(self.log_path, "wb")  # the child writes it until terminate() closes it
        child_env = dict(os.environ if env is None else env)
        child_env.setdefault("NIXL_LOG_LEVEL", "WARN")
        child_env["PYTHONUNBUFFERED"] = "1"
        # start_new_session: the terminal's Ctrl-C reaches only the parent, which stops its children in order; the
        # lifeline kills them when the parent dies without that chance (SIGKILL). A prefix (``ip netns exec``)
        # execs the command in the same process, so the lifeline reaches it.
        self.proc = subprocess.Popen(
            [*prefix, sys.executable, "-m", "tensorwire.cli.main", *argv],
            stdout=subprocess.PIPE,
            stderr=self._log,
            stdin=subprocess.DEVNULL,
            start_new_session=True,
            **parent_lifeline().popen_kwargs(child_env),
        )
        self._lines: queue.Queue[str | None] = queue.Queue()
        threading.Thread(target=self._pump, name=f"child-{name}-stdout", daemon=True).start()

    def _pump(self) -> None:
        assert self.proc.stdout is not None
        with self.proc.stdout:  # closed at EOF (the child exited), so no pipe outlives the child
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
        return stop_children([self], grace_s)[self.name]


def stop_children(children: Sequence[Child], grace_s: float) -> dict[str, int | None]:
    """SIGTERM every child's group at once, wait up to ``grace_s`` for all of them together, SIGKILL the rest.

    At most ``grace_s`` + 5 s however many children there are (one after the other, a busy host made that add up).
    Returns each child's exit code (None: it did not even die of SIGKILL within 5 s).
    """
    for c in children:
        if c.proc.poll() is None:
            _signal_group(c.proc.pid, signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    for c in children:
        try:
            c.proc.wait(max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            pass
    for c in children:
        _signal_group(c.proc.pid, signal.SIGKILL)  # stragglers in the group, even if the leader exited
    codes: dict[str, int | None] = {}
    kill_deadline = time.monotonic() + 5.0
    for c in children:
        try:
            codes[c.name] = c.proc.wait(max(0.0, kill_deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            codes[c.name] = None
        c._log.close()
    return codes


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
        # --drain-s 0: only this process talks to them, so they need no NOT_SERVING period before they stop.
        stop_flags = ["--drain-s", "0", "--grace-s", str(CHILD_GRACE_S)]
        encoders = []
        for i in range(self.workers):  # appended one by one: a failed start still stops what did start
            encoders.append(
                Child(
                    f"encoder-{i}",
                    [
                        "serve-encoder",
                        "--port",
                        "0",
                        "--metrics-port",
                        "-1",
                        "--worker-id",
                        f"{self.worker_id_prefix}-{i}",
                        "--wait-exporter-s",
                        "20",
                        "--device",
                        self.device,
                        *stop_flags,
                    ],
                    self.log_dir,
                )
            )
            self.children.append(encoders[-1])
        self.worker_addresses = [c.ready(startup_timeout_s)["grpc"] for c in encoders]
        proxy = Child(
            "proxy",
            [
                "serve-proxy",
                "--metrics-port",
                "-1",
                *stop_flags,
                *[a for addr in self.worker_addresses for a in ("--worker", addr)],
            ],
            self.log_dir,
        )
        self.children.append(proxy)
        self.proxy_address = proxy.ready(startup_timeout_s)["grpc"]

    def stop(self, grace_s: float = CHILD_GRACE_S + 5.0) -> dict[str, int | None]:
        """Stops every child at once (``stop_children``), the proxy listed first."""
        return stop_children(list(reversed(self.children)), grace_s)


__all__ = ["CHILD_GRACE_S", "Child", "LoopbackDeployment", "stop_children"]
