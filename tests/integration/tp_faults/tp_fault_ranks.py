"""Rank bodies for the broadcaster fault tests (module-level so spawned processes can import them).

Each rank reports over its own pipe (one writer per pipe: a SIGKILLed rank cannot wedge a shared lock):
("up",), ("step", i) every few steps, then ("error", class name, reason, message) or ("done", steps).
``role`` changes what the rank does: "normal", "slow" (a reader that stops reading for ``stall_s``).
"""

from __future__ import annotations

import os
import time
from typing import Any

FRAME_ELEMS = 1 << 20  # 4 MiB float32 frames: a broadcast takes long enough to be killed in the middle


def rank_main(
    rank: int,
    world: int,
    session: str,
    base: str,
    backend: str,
    timeout_s: float | None,
    role: str,
    stall_s: float,
    conn: Any,
) -> None:
    import torch

    from tensorwire.errors import TensorwireError
    from tensorwire.tp import BroadcastConfig, CpuTpBroadcaster

    def send(*msg: Any) -> None:
        try:
            conn.send(msg)
        except (BrokenPipeError, OSError):
            pass

    step = 0
    try:
        with CpuTpBroadcaster(
            rank,
            world,
            session,
            backend=backend,
            base_dir=base,
            init_timeout_s=30.0,
            timeout_s=timeout_s,
            config=BroadcastConfig(stall_warn_s=1.0),
        ) as b:
            send("up", os.getpid())
            buf = torch.empty(FRAME_ELEMS, dtype=torch.float32)
            deadline = time.monotonic() + 60.0
            while time.monotonic() < deadline:
                if rank == 0:
                    buf.fill_(float(step))
                    b.broadcast_(buf)
                else:
                    if role == "slow" and step == 5:
                        time.sleep(stall_s)  # stop reading: rank 0's socket / ring fills up
                    b.broadcast_(buf)
                    if buf[0].item() != float(step) or buf[-1].item() != float(step):
                        send("error", "WrongData", "wrong_data", f"rank {rank} step {step} got {buf[0].item()}")
                        return
                step += 1
                if step % 5 == 0:
                    send("step", step)
            send("done", step)
    except TensorwireError as exc:
        send("error", type(exc).__name__, exc.reason.value, str(exc))
    except BaseException as exc:  # an untyped failure is a test failure; report it
        import traceback

        send("error", type(exc).__name__, "untyped", repr(exc) + "\n" + traceback.format_exc()[-2000:])
