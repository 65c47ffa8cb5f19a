"""One rank's end of a rank-0 broadcast, one class per implementation ``bench broadcast`` compares.

``shm``/``uds``: tensorwire's ``CpuTpBroadcaster``; ``gloo``: ``dist.broadcast``; ``gloo_obj``:
``dist.broadcast_object_list``; ``vllm``: vLLM's shared-memory ``MessageQueue`` (loaded by ``_vllm_loader``, run as
its file defines it). Each does what a user of that implementation would write for the case:

========  ==========================================  ===================================  ====================
kind      tensorwire (shm, uds)                       vllm                                 gloo / gloo_obj
========  ==========================================  ===================================  ====================
tensor    ``broadcast_(t)`` (in place; ``fresh``:      ``enqueue(t)`` / ``dequeue()``        ``broadcast`` /
          ``broadcast(t)``, new tensors)                                                    object list of bytes
dict      ``broadcast(d)``                            ``enqueue(d)`` / ``dequeue()``        - / object list
sched     ``broadcast_object(obj, schema=T)``         ``enqueue(obj)`` / ``dequeue()``      - / object list
          (``--object-codec pickle``: no schema)
========  ==========================================  ===================================  ====================

Opt-in variants of ``shm`` (``--backends shm,shm_fixed,...``; not in the default set) run the same ring with other
reader waits, to show what each part of the wait is worth in one run: ``shm_fixed`` is the wait before the futex wake-up
(fixed ``spin_s``, then sleep on the socket), ``shm_socket`` the adaptive spin with socket wake-ups, ``shm_nospin``
fixed ``spin_s`` with futex wake-ups. ``shm_pickle`` is ``shm`` with the pickled ``broadcast_object`` (no schema)
whatever ``--object-codec`` says, so one run shows both object paths next to vLLM's (which always pickles).
"""

from __future__ import annotations

import abc
import dataclasses
import gc
import os
import pickle
import time
from typing import Any

from tensorwire.bench._payloads import KINDS, SchedulerStep
from tensorwire.bench._vllm.loader import VllmSource

NAMES = ("shm", "uds", "gloo", "gloo_obj", "vllm")
# shm with other reader waits (BroadcastConfig overrides); opt-in, see the module docstring.
SHM_VARIANTS: dict[str, dict[str, Any]] = {
    "shm_fixed": {"spin_max_s": 0.0, "futex": False},
    "shm_socket": {"futex": False},
    "shm_nospin": {"spin_max_s": 0.0},
    "shm_pickle": {},  # the same ring and wait; sched is pickled (no schema)
}


@dataclasses.dataclass(frozen=True)
class Options:
    tensor_api: str = "inplace"  # tensorwire's tensor cases: "inplace" (broadcast_) or "fresh" (broadcast)
    object_codec: str = "typed"  # tensorwire's sched case: "typed" (schema=SchedulerStep, msgspec) or "pickle"
    vllm_source: VllmSource | None = None
    # vLLM's TP-group broadcaster (GroupCoordinator.mq_broadcaster) uses 4 MiB x 6 chunks.
    vllm_chunk_bytes: int = 4 << 20
    vllm_chunks: int = 6
    init_timeout_s: float = 60.0
    pin: tuple[int, ...] | None = None  # --pin: rank i runs on CPU pin[i] (the same CPUs for every backend)


class BroadcastEndpoint(abc.ABC):
    """One rank's end of a broadcast group.

    Every rank of a group constructs it with the same arguments; construction returns once the group is connected
    (or raises). Then every rank calls :meth:`send` the same number of times with the same kinds, in the same order:
    rank 0 passes the value and gets it back, readers pass the case's template (what :func:`_payloads.build`
    returns) and get what arrived, a new object or the template filled in. One thread per endpoint.
    :meth:`close` once, on every rank, after the last call.
    """

    kinds: frozenset[str] = frozenset(KINDS)

    @abc.abstractmethod
    def send(self, kind: str, value: Any) -> Any: ...

    def close(self) -> None:  # noqa: B027 - optional: a documented no-op for endpoints that hold nothing
        """Release what the endpoint holds (sockets, shared memory, process group)."""


class TensorwireEndpoint(BroadcastEndpoint):
    def __init__(self, rank: int, world: int, backend: str, opts: Options) -> None:
        from tensorwire.tp import BroadcastConfig, CpuTpBroadcaster

        self.rank = rank
        self._inplace = opts.tensor_api == "inplace"
        self._schema = SchedulerStep if opts.object_codec == "typed" and backend != "shm_pickle" else None
        overrides = SHM_VARIANTS.get(backend, {})
        config = BroadcastConfig.from_env(**overrides)  # as a user's ranks would: the environment, then ours
        self._b = CpuTpBroadcaster(
            rank,
            world,
            f"bench-{os.getppid()}-{backend}-{world}",
            backend="shm" if backend in SHM_VARIANTS else backend,
            init_timeout_s=opts.init_timeout_s,
            config=config,
        )

    def send(self, kind: str, value: Any) -> Any:
        b, root = self._b, self.rank == 0
        if kind == "tensor" and self._inplace:
            return b.broadcast_(value)
        if kind in ("tensor", "dict"):
            return b.broadcast(value if root else None)
        return b.broadcast_object(value if root else None, schema=self._schema)

    def close(self) -> None:
        self._b.close()


class GlooEndpoint(BroadcastEndpoint):
    kinds = frozenset({"tensor"})

    def __init__(self, rank: int, world: int, store: str) -> None:
        import torch.distributed as dist

        dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)

    def send(self, kind: str, value: Any) -> Any:
        import torch.distributed as dist

        dist.broadcast(value, src=0)
        return value

    def close(self) -> None:
        import torch.distributed as dist

        dist.destroy_process_group()


class GlooObjEndpoint(GlooEndpoint):
    kinds = frozenset(KINDS)

    def __init__(self, rank: int, world: int, store: str) -> None:
        super().__init__(rank, world, store)
        self.rank = rank

    def send(self, kind: str, value: Any) -> Any:
        import torch
        import torch.distributed as dist

        root = self.rank == 0
        if kind == "tensor":  # the bytes, as the earlier runs of this benchmark sent them
            obj: list[bytes | None] = [value.numpy().tobytes()] if root else [None]
            dist.broadcast_object_list(obj, src=0)
            if not root:
                received = obj[0]
                assert received is not None, "broadcast_object_list filled every rank's list"
                value.copy_(torch.frombuffer(bytearray(received), dtype=torch.uint8))
            return value
        obj = [value if root else None]
        dist.broadcast_object_list(obj, src=0)
        return obj[0]


class VllmEndpoint(BroadcastEndpoint):
    """vLLM's ``MessageQueue`` with one writer (rank 0) and ``world - 1`` local readers, as
    ``MessageQueue.create_from_process_group`` sets it up; the handle travels through a file in the group's
    scratch directory instead of a torch.distributed broadcast."""

    def __init__(self, rank: int, world: int, store: str, opts: Options) -> None:
        from tensorwire.bench._vllm import loader as _vllm_loader

        if opts.vllm_source is None:
            raise RuntimeError("the vllm backend needs Options.vllm_source")
        mod, _ = _vllm_loader.load(opts.vllm_source)
        self.rank = rank
        os.environ.setdefault("VLLM_RPC_BASE_PATH", os.path.dirname(store))  # its zmq ipc sockets, removed with it
        path = f"{store}.vllm-handle"
        if rank == 0:
            self._mq = mod.MessageQueue(
                world - 1,
                world - 1,
                list(range(1, world)),
                max_chunk_bytes=opts.vllm_chunk_bytes,
                max_chunks=opts.vllm_chunks,
            )
            with open(f"{path}.tmp", "wb") as f:
                pickle.dump(self._mq.export_handle(), f)
            os.replace(f"{path}.tmp", path)
        else:
            deadline = time.monotonic() + opts.init_timeout_s
            while not os.path.exists(path):
                if time.monotonic() > deadline:
                    raise TimeoutError(
                        f"rank {rank}: no vLLM MessageQueue handle from rank 0 after {opts.init_timeout_s:.0f} s"
                    )
                time.sleep(0.001)
            with open(path, "rb") as f:
                self._mq = mod.MessageQueue.create_from_handle(pickle.load(f), rank)
        self._mq.wait_until_ready()

    def send(self, kind: str, value: Any) -> Any:
        if self.rank == 0:
            self._mq.enqueue(value)
            return value
        return self._mq.dequeue()

    def close(self) -> None:
        # vLLM's own lifecycle: the writer's ShmRingBuffer unlinks its segment when collected, and a finalizer
        # closes the zmq sockets and context. Drop our reference and collect now rather than at exit.
        self.__dict__.pop("_mq", None)
        gc.collect()


def kinds_of(name: str) -> frozenset[str]:
    """The case kinds backend ``name`` carries (gloo: tensors only)."""
    return GlooEndpoint.kinds if name == "gloo" else BroadcastEndpoint.kinds


def make(name: str, rank: int, world: int, store: str, opts: Options) -> BroadcastEndpoint:
    if name in ("shm", "uds") or name in SHM_VARIANTS:
        return TensorwireEndpoint(rank, world, name, opts)
    if name == "gloo":
        return GlooEndpoint(rank, world, store)
    if name == "gloo_obj":
        return GlooObjEndpoint(rank, world, store)
    if name == "vllm":
        return VllmEndpoint(rank, world, store, opts)
    raise ValueError(f"unknown backend {name!r}; expected one of {NAMES}")
