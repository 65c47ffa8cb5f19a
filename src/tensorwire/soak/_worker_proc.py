"""An encoder worker in a spawned child process, answering the soak's questions over a pipe.

The worker is ``tensorwire.service.EncoderWorker`` with the built-in ViT, exactly what ``serve-encoder``
runs; the pipe adds what the soak needs and a network peer never gets: the exporter's ``stats()`` (live
leases, busy slots, pool bytes) and the process's fds and threads.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import signal
from typing import Any

from tensorwire.soak._sample import sample, thread_names


def _child(conn: Any, config: Any, env: dict[str, str], netns: str = "", host: str = "127.0.0.1") -> None:
    if netns:  # first, before any thread or socket exists (tensorwire.testing.netns)
        from tensorwire.testing.netns import enter

        enter(netns)
    os.environ.update(env)
    from tensorwire._lifeline import follow_parent

    follow_parent()  # a SIGKILLed soak leaves no worker behind
    os.dup2(2, 1)  # native code (UCX protocol tables) writes to fd 1; the soak's stdout is its report
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the soak's Ctrl-C is handled by the parent
    import logging

    logging.getLogger("tensorwire").setLevel(env.get("TENSORWIRE_SOAK_CHILD_LOG_LEVEL", "ERROR"))
    from tensorwire.encoder import load_encoder
    from tensorwire.service._worker import EncoderWorker

    worker = EncoderWorker(load_encoder("builtin", device="cpu"), config)
    try:
        # In a namespace the address exists only inside the soak's own fabric: plaintext there is allowed.
        worker.start(f"{host}:0", insecure=bool(netns))
        ready = worker.wait_ready(60.0)
        conn.send(("ready", worker.address, ready, os.getpid()))
        while True:
            if not conn.poll(1.0):
                continue
            cmd = conn.recv()
            if cmd == "stats":
                exporter = worker.transport._holder.get()  # the soak's view into the worker; not an API
                stats = exporter.stats().as_dict() if exporter is not None else {}
                import torch

                stats["torch_threads"] = torch.get_num_threads()
                conn.send(("stats", stats, sample(), thread_names()))
            elif cmd == "stop":
                break
    except (EOFError, OSError, KeyboardInterrupt):
        pass
    finally:
        worker.stop(2.0)
        try:
            conn.send(("stopped",))
        except (OSError, ValueError):
            pass


class WorkerProcess:
    """``start`` spawns and waits for READY; ``stats()``; ``kill()`` (SIGKILL); ``stop()`` (clean, idempotent).

    ``netns``/``host``: the child enters that network namespace and serves on ``host`` (default: loopback here)."""

    def __init__(
        self,
        config: Any,
        env: dict[str, str],
        start_timeout_s: float = 90.0,
        *,
        netns: str = "",
        host: str = "127.0.0.1",
    ) -> None:
        from tensorwire._lifeline import parent_lifeline

        ctx = mp.get_context("spawn")
        self._conn, child = ctx.Pipe()
        env = {**env, **parent_lifeline().child_env()}  # here: child_env asks which thread spawns
        self.proc = ctx.Process(target=_child, args=(child, config, env, netns, host), daemon=True, name="soak-worker")
        self.proc.start()
        child.close()
        if not self._conn.poll(start_timeout_s):
            self.kill()
            raise RuntimeError(f"soak worker did not start within {start_timeout_s:.0f} s")
        msg = self._conn.recv()
        _, self.address, self.rdma_ready, self.pid = msg

    def stats(self, timeout_s: float = 10.0) -> dict[str, Any]:
        self._conn.send("stats")
        if not self._conn.poll(timeout_s):
            raise TimeoutError("soak worker did not answer stats")
        _, stats, proc, names = self._conn.recv()
        return {"exporter": stats, "process": proc, "thread_names": names}

    def alive(self) -> bool:
        try:
            return self.proc.is_alive()
        except ValueError:  # closed
            return False

    def kill(self) -> None:
        """SIGKILL (when still running), then close the pipe and the process handle. Idempotent."""
        if self.alive():
            self.proc.kill()
            self.proc.join(10)
        try:
            if not self.proc.is_alive():
                self.proc.close()  # its sentinel fd
        except ValueError:
            pass
        if not self._conn.closed:
            self._conn.close()

    def stop(self, timeout_s: float = 15.0) -> None:
        if self.alive():
            try:
                self._conn.send("stop")
            except (OSError, ValueError):
                pass
            self.proc.join(timeout_s)
        self.kill()


__all__ = ["WorkerProcess"]
