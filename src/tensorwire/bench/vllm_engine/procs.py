"""The driver's side of the vLLM instances: server processes in their own sessions, and the client of ``instance``.

``Spawned`` runs a command in its own session (vLLM starts its engine-core and worker processes under it, and
``kill()`` takes them all), its output in a log file whose tail goes into every error. ``Instance`` is a
``python -m tensorwire.bench.vllm_engine.instance`` process and the connection to its socket; ``wait_ready``
waits for a set of them. The engine benchmark's driver and the vLLM tests (tests/vllm) both use these.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from multiprocessing.connection import Client
from pathlib import Path
from typing import Any

START_TIMEOUT_S = float(os.environ.get("TW_VLLM_START_TIMEOUT_S", "900"))
CALL_TIMEOUT_S = 600.0
INSTANCE_MODULE = "tensorwire.bench.vllm_engine.instance"
# vLLM applies this in every process it starts (engine core, workers) when VLLM_LOGGING_CONFIG_PATH names it: its
# own logs at WARNING, tensorwire's at INFO, into the instance's log file.
LOGGING = {
    "version": 1,
    "disable_existing_loggers": False,
    "formatters": {"f": {"format": "%(asctime)s %(process)d %(levelname)s %(name)s: %(message)s"}},
    "handlers": {"out": {"class": "logging.StreamHandler", "formatter": "f", "stream": "ext://sys.stdout"}},
    "loggers": {
        "vllm": {"handlers": ["out"], "level": "WARNING", "propagate": False},
        "tensorwire": {"handlers": ["out"], "level": "INFO", "propagate": False},
    },
}


def logging_config(directory: Path) -> Path:
    """``LOGGING`` as a file in ``directory`` (written once), for ``VLLM_LOGGING_CONFIG_PATH``."""
    path = directory / "logging.json"
    if not path.exists():
        path.write_text(json.dumps(LOGGING))
    return path


class Spawned:
    """A server process in its own session, its stdout and stderr in ``log_path``."""

    def __init__(self, name: str, cmd: list[str], log_path: Path, env: dict[str, str]) -> None:
        self.role = name
        self.log_path = log_path
        self._log = open(log_path, "w")
        self.proc = subprocess.Popen(cmd, stdout=self._log, stderr=subprocess.STDOUT, env=env, start_new_session=True)

    @property
    def name(self) -> str:
        return self.role

    def check_alive(self) -> None:
        if self.proc.poll() is not None:
            raise RuntimeError(f"{self.role} exited with {self.proc.returncode}:\n{self.tail()}")

    def tail(self, n: int = 60) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-n:])
        except OSError:
            return ""

    def log_count(self, needle: str) -> int:
        """How many lines of the log contain ``needle``."""
        try:
            return sum(needle in line for line in self.log_path.read_text(errors="replace").splitlines())
        except OSError:
            return 0

    def kill(self) -> None:
        """SIGKILL to the whole session, and wait for the process."""
        if self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            self.proc.wait(timeout=30)

    def close(self) -> None:
        self.kill()
        self._log.close()


def wait_ready(procs: Sequence[Spawned], ready: Callable[[Any], bool], poll_s: float = 0.5) -> None:
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
        if starting:
            time.sleep(poll_s)


class Instance(Spawned):
    """One ``instance`` process (``python -m tensorwire.bench.vllm_engine.instance``) and its socket.

    ``work`` holds its socket, log and prometheus multiprocess directory (``<name>.sock``, ``<name>.log``,
    ``<name>-prom``); ``args`` follow ``--role``, ``--model`` and ``--socket`` on its command line; ``env`` is the
    whole environment, to which the socket's authkey and ``PROMETHEUS_MULTIPROC_DIR`` are added.
    """

    def __init__(
        self, name: str, role: str, work: Path, model: Path, env: dict[str, str], args: Sequence[str] = ()
    ) -> None:
        self.sock = str(work / f"{name}.sock")
        prom = work / f"{name}-prom"
        prom.mkdir()
        self.authkey = os.urandom(16).hex()
        full_env = dict(env, TW_INSTANCE_AUTHKEY=self.authkey, PROMETHEUS_MULTIPROC_DIR=str(prom))
        cmd = [sys.executable, "-m", INSTANCE_MODULE, "--role", role, "--model", str(model), "--socket", self.sock]
        super().__init__(name, [*cmd, *args], work / f"{name}.log", full_env)
        self._conn: Any = None

    def try_connect(self) -> bool:
        """True once the instance listens (and this end is connected)."""
        if os.path.exists(self.sock):
            try:
                self._conn = Client(self.sock, family="AF_UNIX", authkey=self.authkey.encode())
                return True
            except (ConnectionRefusedError, FileNotFoundError):
                pass
        return False

    def call(self, msg: dict[str, Any], timeout_s: float = CALL_TIMEOUT_S) -> dict[str, Any]:
        """One message and its answer; TimeoutError past ``timeout_s``, RuntimeError on the instance's error."""
        self._conn.send(msg)
        if not self._conn.poll(timeout_s):
            raise TimeoutError(f"{self.role} did not answer {msg.get('op')} within {timeout_s:.0f} s:\n{self.tail()}")
        answer: dict[str, Any] = self._conn.recv()
        if "error" in answer:
            raise RuntimeError(f"{self.role}: {answer['error']}\n{answer.get('traceback', '')}")
        return answer

    def generate(self, requests: list[dict[str, Any]], op: str = "generate") -> list[dict[str, Any]]:
        """The results of ``requests``, run one after the other (see ``instance``)."""
        results: list[dict[str, Any]] = self.call({"op": op, "requests": requests})["results"]
        return results

    def metrics(self) -> dict[str, float]:
        return dict(self.call({"op": "metrics"})["metrics"])

    def stop(self) -> None:
        """Ask the instance to quit (bounded), then kill whatever is left of its session."""
        if self.proc.poll() is None and self._conn is not None:
            try:
                self.call({"op": "quit"}, timeout_s=30)
                self.proc.wait(timeout=60)
            except Exception:
                pass
        if self._conn is not None:
            self._conn.close()
            self._conn = None
        self.close()


def metric(m: dict[str, float], name: str, **labels: str) -> float:
    """The sum of ``name``'s samples in ``Instance.metrics()``'s answer, with exactly ``labels`` when given."""
    want = ",".join(f"{k}={v}" for k, v in sorted(labels.items()))
    return sum(v for k, v in m.items() if k.split("{")[0] == name and (not labels or k.endswith("{" + want + "}")))


def same(got: dict[str, Any], want: dict[str, Any]) -> bool:
    """Two results with the same greedy tokens and top logprobs, bit for bit."""
    return bool(got["token_ids"] == want["token_ids"] and got["logprobs"] == want["logprobs"])


def session_schedstat(sid: int) -> dict[str, tuple[int, int]]:
    """Nanoseconds on a CPU and waiting for one, summed over every thread of every process in session ``sid``,
    by process name (``/proc/PID/comm``: vLLM names its engine core and workers ``VLLM::...``) and thread name,
    as ``"process/thread": (run_ns, wait_ns)`` (``/proc/PID/task/TID/schedstat``; Linux with schedstats)."""
    out: dict[str, tuple[int, int]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                if int(f.read().rsplit(")", 1)[1].split()[3]) != sid:
                    continue
            with open(f"/proc/{entry}/comm") as f:
                proc = f.read().strip()
            tids = os.listdir(f"/proc/{entry}/task")
        except (OSError, ValueError, IndexError):
            continue  # gone meanwhile
        for tid in tids:
            try:
                with open(f"/proc/{entry}/task/{tid}/comm") as f:
                    key = f"{proc}/{f.read().strip()}"
                with open(f"/proc/{entry}/task/{tid}/schedstat") as f:
                    run, wait = (int(x) for x in f.read().split()[:2])
            except (OSError, ValueError):
                continue
            r0, w0 = out.get(key, (0, 0))
            out[key] = (r0 + run, w0 + wait)
    return out


def schedstat_delta(before: dict[str, tuple[int, int]], after: dict[str, tuple[int, int]]) -> dict[str, Any]:
    """``after - before`` in ms, ``{"run_ms", "wait_ms", "by_thread": {key: [run_ms, wait_ms]}}``; threads that
    started meanwhile count from zero, threads that ended are lost (their time is not in ``after``)."""
    by: dict[str, list[float]] = {}
    for key, (run, wait) in after.items():
        r0, w0 = before.get(key, (0, 0))
        d = [max(0, run - r0) / 1e6, max(0, wait - w0) / 1e6]
        if d[0] or d[1]:
            by[key] = [round(d[0], 3), round(d[1], 3)]
    return {
        "run_ms": round(sum(v[0] for v in by.values()), 3),
        "wait_ms": round(sum(v[1] for v in by.values()), 3),
        "by_thread": by,
    }
