"""Rank bodies for the broadcaster tests (module-level so spawned processes can import them)."""

from __future__ import annotations

import os
import random
import signal
import socket
import threading
import time
from typing import Any

import torch

from tensorwire.errors import BroadcastError
from tensorwire.tp import BroadcastConfig, CpuTpBroadcaster, _star
from tensorwire.tp._connect import params_digest
from tensorwire.tp._paths import make_endpoint, session_digest

DTYPES = [
    torch.float32,
    torch.float64,
    torch.float16,
    torch.bfloat16,
    torch.int8,
    torch.int16,
    torch.int32,
    torch.int64,
    torch.uint8,
    torch.bool,
    torch.complex64,
]


def _tensor(g: torch.Generator, rng: random.Random, big: bool = False) -> torch.Tensor:
    dtype = rng.choice(DTYPES)
    if big:
        shape: tuple[int, ...] = (rng.randint(200_000, 400_000),)
    else:
        ndim = rng.randint(0, 3)
        shape = tuple(rng.choice([0, 1, 2, 3, 7, 16, 33]) for _ in range(ndim))
    raw = torch.randint(
        0,
        256,
        (int(torch.Size(shape).numel()) * torch.empty((), dtype=dtype).element_size(),),
        generator=g,
        dtype=torch.uint8,
    )
    if dtype == torch.bool:
        raw = raw % 2
    return raw.view(dtype).reshape(shape)


def message(seed: int, i: int) -> Any:
    """The i-th test message: every rank can compute it, so every rank can check what it received."""
    rng = random.Random(seed * 100_003 + i)
    g = torch.Generator().manual_seed(seed * 100_003 + i)
    kind = rng.choice(["tensor", "list", "tuple", "dict"])
    big = i % 17 == 5  # a frame larger than a shm slot: goes through the arena
    if kind == "tensor":
        return _tensor(g, rng, big)
    items = [_tensor(g, rng, big and j == 0) for j in range(rng.randint(0, 4))]
    if kind == "list":
        return items
    if kind == "tuple":
        return tuple(items)
    return {f"k{j}-ü": t for j, t in enumerate(items)}


def same(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor):
        return (
            isinstance(b, torch.Tensor)
            and a.dtype == b.dtype
            and a.shape == b.shape
            and a.contiguous().reshape(-1).view(torch.uint8).equal(b.contiguous().reshape(-1).view(torch.uint8))
        )
    if isinstance(a, dict):
        return isinstance(b, dict) and list(a) == list(b) and all(same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(same(x, y) for x, y in zip(a, b, strict=True))
    return False


def happy(rank: int, world: int, base: str, backend: str, rounds: int, seed: int, session: str = "happy") -> dict:
    cfg = BroadcastConfig(slot_bytes=64 * 1024, n_slots=4, arena_bytes=16 << 20)
    with CpuTpBroadcaster(rank, world, session, backend=backend, base_dir=base, init_timeout_s=60, config=cfg) as b:
        for i in range(rounds):
            want = message(seed, i)
            if isinstance(want, torch.Tensor) and want.dim() >= 2 and i % 3 == 0:
                want = want.transpose(0, 1)  # rank 0 sends a non-contiguous view
            if rank == 0:
                got = b.broadcast(want)
            else:
                got = b.broadcast(None)
            if not same(want, got):
                raise AssertionError(f"rank {rank} round {i}: mismatch {want!r} vs {got!r}")
        # In-place form, fixed shape, many rounds; includes a non-contiguous target on readers.
        t = torch.zeros(4, 6, dtype=torch.int32)
        for i in range(50):
            target = t if i % 2 else t.t()
            if rank == 0:
                target.copy_(torch.arange(24, dtype=torch.int32).reshape(target.shape) + i)
            b.broadcast_(target)
            if not target.equal(torch.arange(24, dtype=torch.int32).reshape(target.shape) + i):
                raise AssertionError(f"rank {rank}: broadcast_ round {i} wrong")
        # A payload larger than the socket buffers and the slots.
        big = torch.arange(5 << 18, dtype=torch.int32) if rank == 0 else torch.empty(5 << 18, dtype=torch.int32)
        b.broadcast_(big)
        if not big.equal(torch.arange(5 << 18, dtype=torch.int32)):
            raise AssertionError(f"rank {rank}: 5 MiB broadcast_ wrong")
        return {"backend": b.backend, "rounds": rounds}


def reinit(rank: int, world: int, base: str, backend: str) -> list[int]:
    seen = []
    for gen in range(3):
        with CpuTpBroadcaster(rank, world, "again", backend=backend, base_dir=base, init_timeout_s=60) as b:
            t = torch.tensor([gen * 10 + 1]) if rank == 0 else None
            seen.append(int(b.broadcast(t)[0]))
    return seen


def fake_peer(
    rank: int,
    world: int,
    base: str,
    claimed_rank: int,
    claimed_world: int,
    echo: bytes | None,
    session: str = "s",
    backend: str = "uds",
) -> tuple[int, str]:
    """Speaks the handshake by hand: HELLO with the given claims, then (optionally) a probe echo."""
    del rank
    ep = make_endpoint(session, base, False)
    deadline = time.monotonic() + 60
    while True:
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            s.connect(ep.address)
            break
        except OSError:
            s.close()
            if time.monotonic() > deadline:
                raise
            time.sleep(0.02)
    s.settimeout(60)
    s.sendall(
        _star.HELLO.pack(
            _star.HELLO_MAGIC,
            _star.PROTO_VERSION,
            _star.BACKEND_CODES[backend],
            0,
            claimed_rank,
            claimed_world,
            session_digest(session),
            params_digest(backend, BroadcastConfig()),
        )
    )
    data = b""
    while len(data) < _star.REPLY.size:
        chunk = s.recv(_star.REPLY.size - len(data))
        if not chunk:
            return -1, "eof"
        data += chunk
    magic, status, reason_idx, msg_len, nonce = _star.REPLY.unpack(data)
    if status != 0:
        msg = s.recv(msg_len).decode()
        s.close()
        return status, msg
    if echo is not None:
        s.sendall(echo)
        rest = s.recv(4096)  # the reject that follows a bad echo
        s.close()
        return 0, rest[_star.REPLY.size :].decode("utf-8", "replace")
    # Wait until rank 0 gives up on the group (it fails on another peer and rejects us too).
    rest = s.recv(4096)
    s.close()
    return 0, rest.decode("utf-8", "replace")


def fake_root_bad_ready(rank: int, world: int, base: str) -> str:
    """A server that completes the handshake but sends READY with the wrong probe token."""
    ep = make_endpoint("s", base, False)
    srv = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    srv.bind(ep.address)
    srv.listen(1)
    srv.settimeout(60)
    conn, _ = srv.accept()
    conn.settimeout(60)
    hello = b""
    while len(hello) < _star.HELLO.size:
        hello += conn.recv(_star.HELLO.size - len(hello))
    conn.sendall(_star.REPLY.pack(_star.REPLY_MAGIC, 0, 0, 0, b"N" * 8))
    echo = b""
    while len(echo) < 8:
        echo += conn.recv(8 - len(echo))
    conn.sendall(_star.READY.pack(_star.READY_MAGIC, b"X" * 8, 0))
    time.sleep(1.0)
    conn.close()
    srv.close()
    os.unlink(ep.address)
    return echo.decode()


def real(
    rank: int,
    world: int,
    base: str,
    session: str = "s",
    backend: str = "uds",
    init_timeout_s: float = 60,
    patch_uid: int | None = None,
) -> str:
    if patch_uid is not None:
        _star.effective_uid = lambda: patch_uid  # type: ignore[assignment]
    with CpuTpBroadcaster(rank, world, session, backend=backend, base_dir=base, init_timeout_s=init_timeout_s) as b:
        t = torch.tensor([42]) if rank == 0 else None
        return str(int(b.broadcast(t)[0]))


def kill_mid_broadcast(rank: int, world: int, base: str, backend: str, victim: int, stamp: str) -> dict:
    """Everyone broadcasts in a loop; ``victim`` SIGKILLs itself after 20 rounds (rank 0 waits a little first,
    so the readers are inside a broadcast when it dies)."""
    with CpuTpBroadcaster(rank, world, "kill", backend=backend, base_dir=base, init_timeout_s=60) as b:
        t = torch.zeros(256, dtype=torch.float32)
        i = 0
        try:
            while True:
                if rank == victim and i == 20:
                    with open(stamp, "w") as f:
                        f.write(repr(time.monotonic()))
                    os.kill(os.getpid(), signal.SIGKILL)
                if rank == 0:
                    t.fill_(i)
                    if i >= 20:
                        time.sleep(0.01)
                b.broadcast_(t)
                if t[0].item() != i:
                    raise AssertionError(f"rank {rank}: round {i} carried {t[0].item()}")
                i += 1
                if i > 100_000:
                    raise AssertionError("no error after 100000 rounds")
        except BroadcastError as exc:
            return {
                "type": type(exc).__name__,
                "msg": str(exc),
                "reason": exc.reason.value,
                "t": time.monotonic(),
                "round": i,
            }
    raise AssertionError("unreachable")


def stall(rank: int, world: int, base: str, backend: str) -> dict:
    with CpuTpBroadcaster(
        rank, world, "stall", backend=backend, base_dir=base, init_timeout_s=60, timeout_s=0.3 if rank else None
    ) as b:
        t = torch.zeros(4)
        b.broadcast_(t)
        if rank == 0:
            time.sleep(1.5)  # rank 1 times out meanwhile and hangs up; our next call must fail
            try:
                b.broadcast_(t)
                b.broadcast_(t)
            except BroadcastError as exc:
                return {"type": type(exc).__name__, "msg": str(exc)}
            return {"type": None}
        t0 = time.monotonic()
        try:
            b.broadcast_(t)
        except BroadcastError as exc:
            return {"type": type(exc).__name__, "msg": str(exc), "elapsed": time.monotonic() - t0}
        return {"type": None}


def dist_bcast(rank: int, world: int, store: str, env: dict[str, str], rounds: int) -> dict:
    import torch.distributed as dist

    from tensorwire.tp import _dist, broadcast_cpu, shutdown_broadcast_cpu

    os.environ.update(env)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
    try:
        for i in range(rounds):
            want = message(7, i)
            got = broadcast_cpu(want if rank == 0 else None)
            if not same(want, got):
                raise AssertionError(f"rank {rank} round {i}: mismatch")
        route = next(iter(_dist._routes.values()))[0]
        return {"route": route}
    except BroadcastError as exc:
        return {"error": type(exc).__name__, "reason": exc.reason.value, "msg": str(exc)}
    finally:
        shutdown_broadcast_cpu()
        dist.destroy_process_group()


def dist_config(rank: int, world: int, store: str, env: dict[str, str]) -> dict:
    """broadcast_cpu inside a node: which timeouts did the broadcaster it created end up with?"""
    import torch.distributed as dist

    from tensorwire.tp import _dist, broadcast_cpu, shutdown_broadcast_cpu

    os.environ.update(env)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
    try:
        broadcast_cpu(torch.arange(3) if rank == 0 else None)
        route, bcast = next(iter(_dist._routes.values()))
        assert bcast is not None, route
        return {"init_timeout_s": bcast.config.init_timeout_s, "timeout_s": bcast.config.timeout_s}
    finally:
        shutdown_broadcast_cpu()
        dist.destroy_process_group()


def eintr(rank: int, world: int, base: str, backend: str) -> int:
    """Signals every 0.5 ms interrupt the blocking calls of large transfers; data must still arrive intact."""
    hits = [0]

    def on_alarm(signum: int, frame: Any) -> None:
        hits[0] += 1

    signal.signal(signal.SIGALRM, on_alarm)
    signal.setitimer(signal.ITIMER_REAL, 0.0005, 0.0005)
    try:
        with CpuTpBroadcaster(rank, world, "eintr", backend=backend, base_dir=base, init_timeout_s=60) as b:
            for i in range(10):
                t = (
                    torch.arange(3 << 20, dtype=torch.int32) + i
                    if rank == 0
                    else torch.empty(3 << 20, dtype=torch.int32)
                )
                b.broadcast_(t)
                if not t.equal(torch.arange(3 << 20, dtype=torch.int32) + i):
                    raise AssertionError(f"rank {rank}: round {i} corrupted")
                if rank == 0:
                    time.sleep(0.02)  # readers block (and get interrupted) while waiting
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0, 0)
    return hits[0]


# ---- close() from another thread (issue 13) ---------------------------------------------------------------------


def _open_fds() -> dict[int, str]:
    out = {}
    for name in os.listdir("/proc/self/fd"):
        try:
            out[int(name)] = os.readlink(f"/proc/self/fd/{name}")
        except OSError:
            pass  # the fd of the listdir itself
    return out


def _ring_mapped() -> bool:
    with open("/proc/self/maps") as f:
        return "tensorwire-tp-ring" in f.read()


def _wait_asleep(native_id: int, timeout_s: float = 20.0) -> bool:
    """True once thread ``native_id`` is seen sleeping (state S) on three samples in a row: blocked in poll() or
    in the writer's back-off sleep. Only makes the blocked case likely; the test holds whatever the timing."""
    deadline = time.monotonic() + timeout_s
    streak = 0
    while time.monotonic() < deadline:
        try:
            with open(f"/proc/self/task/{native_id}/stat") as f:
                state = f.read().rsplit(")", 1)[1].split()[0]
        except OSError:
            return False  # the thread is gone
        streak = streak + 1 if state == "S" else 0
        if streak >= 3:
            return True
        time.sleep(0.02)
    return False


def _error_of(fn: Any) -> dict:
    try:
        fn()
    except BaseException as exc:  # the test wants to see whatever was raised
        reason = getattr(getattr(exc, "reason", None), "value", None)
        return {"type": type(exc).__name__, "msg": str(exc), "reason": reason}
    return {"type": None}


def close_while_blocked(rank: int, world: int, base: str, backend: str, closer: int, mode: str, done: Any) -> dict:
    """Rank ``closer`` gets a call blocked (a reader waiting for a message; rank 0 waiting for readers that stopped
    reading), then closes the broadcaster from another thread (``mode="thread"``), from a signal handler on the
    blocked thread itself (``"signal"``) or right after starting the call (``"at_once"``). ``done`` (an Event) is
    set once the closer is finished; the other ranks then make one more call and report what it raised."""
    fds_before = _open_fds()
    cfg = BroadcastConfig(n_slots=4, timeout_s=60.0)
    b = CpuTpBroadcaster(rank, world, "closing", backend=backend, base_dir=base, init_timeout_s=60, config=cfg)
    t = torch.zeros(16, dtype=torch.int64)
    if rank == 0:
        t.fill_(1)
    b.broadcast_(t)  # everyone is up and in step
    if rank != closer:
        if not done.wait(60):
            raise AssertionError(f"rank {rank}: the closer never finished")
        big = torch.zeros(8 << 20, dtype=torch.uint8)  # rank 0's blocked sends were this size
        report = {"first": int(t[0])}
        errors = []
        for _ in range(16):  # readers first drain what rank 0 published before it closed
            e = _error_of(lambda: b.broadcast_(big if closer == 0 else t))
            if e["type"] is not None:
                errors.append(e)
                break
        report["error"] = errors[0] if errors else {"type": None}
        b.close()
        return report
    # The closer.
    big = torch.ones(8 << 20, dtype=torch.uint8)  # 8 MiB: more than a socket buffer, fills the arena fast
    result: dict[str, Any] = {}

    def blocked_call() -> None:
        if rank == 0:

            def send_until_blocked() -> None:
                for _ in range(64):
                    b.broadcast_(big)

            result["call"] = _error_of(send_until_blocked)
        else:
            result["call"] = _error_of(lambda: b.broadcast_(t))

    if mode == "signal":

        def on_alarm(signum: int, frame: Any) -> None:
            result["close_s"] = _timed(b.close)

        signal.signal(signal.SIGALRM, on_alarm)
        signal.setitimer(signal.ITIMER_REAL, 0.5)  # fires while this thread is blocked below
        try:
            blocked_call()
        finally:
            signal.setitimer(signal.ITIMER_REAL, 0)
        result["was_blocked"] = True
    else:
        th = threading.Thread(target=blocked_call, name="blocked-call")
        th.start()
        if mode == "thread":
            while th.native_id is None:
                time.sleep(0.001)
            result["was_blocked"] = _wait_asleep(th.native_id)
        result["close_s"] = _timed(b.close)
        th.join(30)
        result["call_returned"] = not th.is_alive()
    result["second_close"] = _error_of(b.close)
    result["after_close"] = _error_of(lambda: b.broadcast_(t))
    result["ring_mapped"] = _ring_mapped()
    leaked = {fd: target for fd, target in _open_fds().items() if fds_before.get(fd) != target}
    result["leaked_fds"] = leaked
    result["socket_files"] = os.listdir(base)
    done.set()
    return result


def _timed(fn: Any) -> float:
    t0 = time.monotonic()
    fn()
    return time.monotonic() - t0


def real_where(rank: int, world: int, base: str | None, session: str = "s", init_timeout_s: float = 60) -> list[str]:
    """One broadcast; returns [the value, where the group met] (``base=None``: the default directory rules)."""
    with CpuTpBroadcaster(rank, world, session, backend="uds", base_dir=base, init_timeout_s=init_timeout_s) as b:
        t = torch.tensor([42]) if rank == 0 else None
        value = str(int(b.broadcast(t)[0]))
        assert b.endpoint is not None
        return [value, b.endpoint.display]
