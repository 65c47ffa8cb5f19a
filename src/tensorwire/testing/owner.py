"""``OwnerProcess``: a ``TensorExporter`` in a separate spawned OS process, driven over a pipe.

Used by the integration tests, the benchmark and the demo, so every "two processes" claim crosses a real process
boundary. Commands are plain tuples; results come back as ``("ok", value)`` or ``("err", exception)``.
Every call has a deadline; ``close`` terminates and finally kills the child.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import time
from collections.abc import Sequence
from typing import Any

from tensorwire.rdma._config import RdmaConfig
from tensorwire.rdma._stats import ExporterStats

Spec = tuple[Sequence[int], str, int]  # (shape, dtype name, seed) -> tensorwire.testing.make_tensor


def cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of every thread of ``pid`` so far (Linux /proc)."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    ticks = os.sysconf("SC_CLK_TCK")
    return (int(fields[11]) + int(fields[12])) / ticks


def _child(conn: Any, config: RdmaConfig, env: dict[str, str]) -> None:
    os.environ.update(env)
    from tensorwire._lifeline import follow_parent

    follow_parent()  # a SIGKILLed parent leaves no exporter behind
    import torch

    from tensorwire.rdma import TensorExporter
    from tensorwire.testing.data import make_tensor

    if config.is_cuda:  # CUDA context before the NIXL agent (nixl-on-cpu.md §6)
        torch.empty(1, device=config.device)
    try:
        exp = TensorExporter(config)
    except BaseException as exc:  # report construction failures instead of dying silently
        conn.send(("err", exc))
        return
    conn.send(("ok", {"pid": os.getpid(), "owner": exp.owner}))
    with exp:
        while True:
            try:
                cmd, *args = conn.recv()
            except EOFError:
                return
            try:
                if cmd == "stop":
                    conn.send(("ok", None))
                    return
                if cmd == "exit_now":
                    os._exit(0)
                if cmd == "export":
                    tensors = [make_tensor(s, d, seed, config.device) for s, d, seed in args[0]]
                    t0 = time.perf_counter()
                    desc = exp.export(tensors)
                    dt = time.perf_counter() - t0
                    conn.send(("ok", (desc.to_bytes(), dt)))
                elif cmd == "export_batch":
                    groups = [[make_tensor(s, d, seed, config.device) for s, d, seed in g] for g in args[0]]
                    conn.send(("ok", [d.to_bytes() for d in exp.export_batch(groups)]))
                elif cmd == "release":
                    exp.release(args[0])
                    conn.send(("ok", None))
                elif cmd == "stats":
                    conn.send(("ok", exp.stats()))
                elif cmd == "gc":
                    conn.send(("ok", exp.collect_garbage()))
                elif cmd == "shrink":
                    conn.send(("ok", exp._pool.shrink(args[0]) if exp._pool else 0))  # test hook
                elif cmd == "overwrite":
                    # Scribble over a leased slot in place (tests: a reader must never see a new tenant's bytes).
                    lease = exp._leases[args[0]]  # test hook
                    lease.slot.tensor.fill_(args[1])
                    conn.send(("ok", None))
                else:
                    conn.send(("err", ValueError(f"unknown command {cmd!r}")))
            except Exception as exc:
                conn.send(("err", exc))


class OwnerProcess:
    """A spawned exporter process. Use as a context manager; every call waits at most ``timeout_s``."""

    def __init__(self, config: RdmaConfig, *, env: dict[str, str] | None = None, start_timeout_s: float = 60.0) -> None:
        ctx = mp.get_context("spawn")
        self._conn, child_conn = ctx.Pipe()
        from tensorwire._lifeline import parent_lifeline

        child_env = {**(env or {}), **parent_lifeline().child_env()}
        self._proc = ctx.Process(target=_child, args=(child_conn, config, child_env), daemon=True)
        self._proc.start()
        child_conn.close()
        info = self._call_result(start_timeout_s)
        self.pid: int = info["pid"]
        self.owner = info["owner"]

    def call(self, cmd: str, *args: Any, timeout_s: float = 60.0) -> Any:
        self._conn.send((cmd, *args))
        return self._call_result(timeout_s)

    def _call_result(self, timeout_s: float) -> Any:
        if not self._conn.poll(timeout_s):
            raise TimeoutError(f"owner process did not answer within {timeout_s} s")
        status, value = self._conn.recv()
        if status == "err":
            raise value
        return value

    def export(self, specs: Sequence[Spec]) -> tuple[bytes, float]:
        raw_and_seconds: tuple[bytes, float] = self.call("export", list(specs))
        return raw_and_seconds

    def export_batch(self, groups: Sequence[Sequence[Spec]]) -> list[bytes]:
        raws: list[bytes] = self.call("export_batch", [list(g) for g in groups])
        return raws

    def release(self, lease_ids: Sequence[str]) -> None:
        self.call("release", list(lease_ids))

    def stats(self) -> ExporterStats:
        stats: ExporterStats = self.call("stats")
        return stats

    def idle_cpu(self, seconds: float) -> float:
        """Fraction of one core the owner used while idle for ``seconds``."""
        c0, t0 = cpu_seconds(self.pid), time.monotonic()
        time.sleep(seconds)
        return (cpu_seconds(self.pid) - c0) / (time.monotonic() - t0)

    def kill(self) -> None:
        if self._proc.is_alive():
            self._proc.kill()  # SIGKILL
        self._proc.join(timeout=10)

    @property
    def alive(self) -> bool:
        return self._proc.is_alive()

    def close(self) -> None:
        try:
            if self._proc.is_alive():
                try:
                    self.call("stop", timeout_s=10)
                except (OSError, EOFError, TimeoutError):
                    pass
            self._proc.join(timeout=10)
        finally:
            if self._proc.is_alive():
                self.kill()
            self._conn.close()

    def __enter__(self) -> OwnerProcess:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def read_forever(conn: Any, config: RdmaConfig, env: dict[str, str]) -> None:
    """Child process body: say "ready", receive descriptor bytes, read them in a loop (tests kill it mid-read)."""
    os.environ.update(env)
    from tensorwire.rdma import TensorReader

    with TensorReader(config) as rd:
        conn.send("ready")
        descriptor = conn.recv()
        rd.read([descriptor])
        conn.send("reading")
        while True:
            rd.read([descriptor])
