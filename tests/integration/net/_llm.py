"""An LLM-side client in a host of a ``Fabric``: a spawned child that enters the host's namespace, then fetches.

Driven over a pipe: ``fetch(keys)`` runs fetches one after the other and returns their results (from another
endpoint when given one: the child keeps one RemoteOutputTransport per endpoint); ``start_loop()``
/ ``stop_loop()`` fetch continuously (the partition test cuts the link meanwhile). Each result is a dict:
``outcome`` (ok, wrong, error, untyped), ``plane``, ``fallback``, ``worker``, ``latency_ms``, and for errors
``kind`` and ``reason``. Outputs are checked against digests computed by the test process (``soak._corpus``).
"""

from __future__ import annotations

import multiprocessing as mp
import os
import threading
import time
from typing import Any

from tensorwire.testing import netns

TIMEOUT_S = 120.0


def _child(
    conn: Any,
    netns_name: str,
    env: dict[str, str],
    endpoint: str,
    images: list[bytes],
    digests: dict[tuple[int, ...], str],
    budget_ms: int,
) -> None:
    netns.enter(netns_name)  # first: every socket and thread of this process lives in the host
    os.environ.update(env)
    os.dup2(2, 1)  # UCX protocol tables go to fd 1; keep the pipe protocol clean of them
    from tensorwire.errors import TensorwireError
    from tensorwire.mm import MultimodalInput, RemoteOutputTransport, TransportConfig
    from tensorwire.soak._corpus import output_digest

    transports: dict[str, Any] = {}

    def transport_for(ep: str) -> Any:
        if ep not in transports:
            transports[ep] = RemoteOutputTransport(ep, TransportConfig.from_env(os.environ))
            transports[ep].wait_ready(60.0)
        return transports[ep]

    transport = transport_for(endpoint)
    conn.send(("ready", transport.wait_ready(0)))
    stop = threading.Event()
    loop_results: list[dict[str, Any]] = []

    def one(key: tuple[int, ...], via: Any = transport) -> dict[str, Any]:
        t0 = time.perf_counter()
        res: dict[str, Any] = {"key": list(key), "t": time.monotonic()}
        try:
            out = via.fetch([MultimodalInput(images[i]) for i in key], timeout_ms=budget_ms)
        except TensorwireError as exc:
            res.update(outcome="error", kind=type(exc).__name__, reason=exc.reason.value, msg=str(exc)[:300])
        except Exception as exc:
            res.update(outcome="untyped", kind=type(exc).__name__, reason="untyped", msg=repr(exc)[:300])
        else:
            ok = output_digest(out.embeddings, out.position_ids) == digests[key]
            res.update(
                outcome="ok" if ok else "wrong",
                plane=out.plane.value,
                worker=out.worker_id,
                fallback=out.fallback_reason.value if out.fallback_reason else None,
            )
        res["latency_ms"] = (time.perf_counter() - t0) * 1e3
        return res

    def loop(keys: list[tuple[int, ...]]) -> None:
        i = 0
        while not stop.is_set():
            res = one(keys[i % len(keys)])
            loop_results.append(res)
            i += 1
            if res["outcome"] != "ok":
                time.sleep(0.05)  # as a serving loop would back off

    worker: threading.Thread | None = None
    try:
        while True:
            cmd, arg = conn.recv()
            if cmd == "fetch":
                keys, ep = arg
                via = transport_for(ep or endpoint)
                conn.send(("ok", [one(tuple(k), via) for k in keys]))
            elif cmd == "start_loop":
                stop.clear()
                loop_results.clear()
                worker = threading.Thread(target=loop, args=([tuple(k) for k in arg],), daemon=True)
                worker.start()
                conn.send(("ok", None))
            elif cmd == "loop_count":
                conn.send(("ok", [(r["outcome"], r.get("plane")) for r in loop_results]))
            elif cmd == "stop_loop":
                stop.set()
                if worker is not None:
                    worker.join(arg)
                conn.send(("ok", {"results": list(loop_results), "hung": worker is not None and worker.is_alive()}))
            elif cmd == "stats":
                conn.send(("ok", {"release_pending": transport.release_queue.pending}))
            elif cmd == "close":
                break
    except (EOFError, OSError):
        pass
    finally:
        stop.set()
        for t in transports.values():
            t.close()


class LlmClient:
    """The parent's handle on ``_child``; ``close`` ends it (killed if it does not exit in time)."""

    def __init__(
        self,
        host: Any,
        endpoint: str,
        images: list[bytes],
        digests: dict[tuple[int, ...], str],
        *,
        budget_ms: int = 20000,
        env: dict[str, str] | None = None,
    ) -> None:
        ctx = mp.get_context("spawn")
        self._conn, child = ctx.Pipe()
        self.proc = ctx.Process(
            target=_child,
            daemon=True,
            name=f"llm-{host.name}",
            args=(child, host.netns, env or host.env(), endpoint, images, digests, budget_ms),
        )
        self.proc.start()
        child.close()
        self.rdma_ready = self._recv("ready", TIMEOUT_S)

    def _recv(self, want: str, timeout_s: float) -> Any:
        if not self._conn.poll(timeout_s):
            raise TimeoutError(f"llm client did not answer within {timeout_s:.0f} s")
        kind, value = self._conn.recv()
        assert kind == want, (kind, value)
        return value

    def _call(self, cmd: str, arg: Any = None, timeout_s: float = TIMEOUT_S) -> Any:
        self._conn.send((cmd, arg))
        return self._recv("ok", timeout_s)

    def fetch(
        self, keys: list[tuple[int, ...]], endpoint: str = "", timeout_s: float = TIMEOUT_S
    ) -> list[dict[str, Any]]:
        return self._call("fetch", ([list(k) for k in keys], endpoint), timeout_s)  # type: ignore[no-any-return]

    def start_loop(self, keys: list[tuple[int, ...]]) -> None:
        self._call("start_loop", [list(k) for k in keys])

    def loop_outcomes(self) -> list[tuple[str, str | None]]:
        """(outcome, plane) of every fetch of the running loop so far."""
        return [tuple(x) for x in self._call("loop_count")]  # type: ignore[misc]

    def stop_loop(self, join_s: float) -> dict[str, Any]:
        return self._call("stop_loop", join_s, timeout_s=join_s + 30)  # type: ignore[no-any-return]

    def release_pending(self) -> int:
        return int(self._call("stats")["release_pending"])

    def close(self) -> None:
        try:
            self._conn.send(("close", None))
        except (OSError, ValueError):
            pass
        self.proc.join(20)
        if self.proc.is_alive():
            self.proc.kill()
            self.proc.join(5)
        self._conn.close()
