"""The two hand-off paths ``bench vllm_ec`` times, and the processes that run their two sides.

An item is one encoder output (bf16 ``[rows, cols]``). Its content depends on its index: rows 1.. are the
bench's fixed random embedding (``_plain_grpc.embedding``), row 0 is filled with :func:`mark` of the index, so a
stale item (the previous index), a zeroed or a truncated one fails :func:`matches`, and a reader checks an item
without building a second copy of it.

- **tensorwire** (``TensorwireECConnector``'s path, not a re-implementation): the encoder process runs the
  connector's producer halves (``ProducerScheduler`` mints the grant and builds the ``ec_transfer_params``,
  ``ProducerWorker`` exports into the ``HeldStore`` of a ``ProducerRuntime``, served over gRPC); the LLM
  process parses the params (``parse_params``) and runs the connector's ``Fetcher``: one Lookup RPC, the read
  into a staging area, the Release RPC after the last rank. The staging area is in the LLM process
  (``LocalStager``: vLLM's uniproc executor, GPU TP=1) or in a third process behind a unix socket
  (``RemoteStager``: the multiprocess executor, vLLM's default on CPU). :class:`CheckedArea` compares each item
  where it lands, inside the stage, so the fetch answers only for an equal tensor.
- **file** (``ECExampleConnector``'s path, the same library calls, not its code): the encoder process creates
  ``<root>/<mm_hash>/`` (``os.makedirs(exist_ok=True)``) and writes ``{"ec_cache": tensor.detach().cpu()}``
  with ``safetensors.torch.save_file`` to ``encoder_cache.safetensors`` in it; the LLM process builds the same
  name (again through ``makedirs``), checks ``os.path.exists`` (``has_cache_item``) and reads it with
  ``safetensors.torch.load_file(name, device=device)["ec_cache"]``. vLLM's connector never deletes its files;
  the bench deletes each after the check (timed apart as ``cleanup``), or the 1,000-item series alone would
  leave 10 GB behind.
"""

from __future__ import annotations

import ctypes
import hashlib
import json
import os
import shutil
import time
from collections.abc import Callable
from dataclasses import asdict
from types import SimpleNamespace
from typing import Any

import torch

from tensorwire.errors import ProtocolError, Reason
from tensorwire.mm._proto import encoder_pb2 as pb
from tensorwire.mm.held._staging import Expect, StagingArea

FILE_NAME = "encoder_cache.safetensors"  # what the example connector names every item's file
TENSOR_NAME = "ec_cache"
DTYPE = torch.bfloat16
PRODUCER_NAME = "bench-encoder-dp0"
CONSUMER_NAME = "bench-llm-dp0"

_memcmp = ctypes.CDLL(None).memcmp  # libc's, for the check on host memory (_same_bytes)
_memcmp.restype = ctypes.c_int
_memcmp.argtypes = (ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t)


def mark(index: int) -> float:
    """Row 0 of item ``index``: an integer in [-128, 127], exact in bf16, different for consecutive items."""
    return float(index % 256 - 128)


def make_item(base: torch.Tensor, index: int, rows: int) -> torch.Tensor:
    """A fresh tensor, as an encoder's output is: ``base[:rows]`` with row 0 set to ``mark(index)``."""
    item = base[:rows].clone()
    item[0].fill_(mark(index))
    return item


def _same_bytes(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bit-exact equality of two tensors of one shape and dtype. Host memory: ``memcmp`` (torch.equal on bf16
    takes ~5x a memcpy on a CPU, which would swamp the hand-off being timed); a GPU: ``torch.equal`` on integer
    views (synchronizes)."""
    if a.device.type == "cpu" and b.device.type == "cpu" and a.is_contiguous() and b.is_contiguous():
        n = a.numel() * a.element_size()
        return n == 0 or _memcmp(ctypes.c_void_p(a.data_ptr()), ctypes.c_void_p(b.data_ptr()), n) == 0
    return torch.equal(a.view(torch.int16), b.view(torch.int16))


def matches(got: torch.Tensor, base: torch.Tensor, index: int, rows: int) -> bool:
    """Is ``got`` exactly item ``index`` of ``rows`` rows (shape, dtype, device kind and every bit)?"""
    if tuple(got.shape) != (rows, base.shape[1]) or got.dtype != base.dtype or got.device.type != base.device.type:
        return False
    if not _same_bytes(got[1:], base[1:rows]):
        return False
    return bool((got[0] == mark(index)).all())


def mm_hash_of(run_id: str, path: str, rows: int, index: int) -> str:
    """A content-hash-like identifier (vLLM's mm_hash is a sha256 hex digest), unique per run, path and item."""
    return hashlib.sha256(f"{run_id}/{path}/{rows}/{index}".encode()).hexdigest()


def staging_key(index: int, mm_hash: str) -> str:
    return f"{index}/{mm_hash}"


def index_of(key: str) -> int:
    return int(key.split("/", 1)[0])


# -- the file path (ECExampleConnector's library calls) --


def file_name(root: str, mm_hash: str) -> str:
    """``<root>/<mm_hash>/encoder_cache.safetensors``; creates the folder, as the example connector's helper
    does on every call (the save, ``has_cache_item`` and the load all go through it)."""
    folder = os.path.join(root, mm_hash)
    os.makedirs(folder, exist_ok=True)
    return os.path.join(folder, FILE_NAME)


def file_save(root: str, mm_hash: str, tensor: torch.Tensor) -> None:
    from safetensors.torch import save_file

    save_file({TENSOR_NAME: tensor.detach().cpu()}, file_name(root, mm_hash))


def file_load(root: str, mm_hash: str, device: str) -> torch.Tensor | None:
    """None when the file is not there (``has_cache_item`` False)."""
    from safetensors.torch import load_file

    name = file_name(root, mm_hash)
    if not os.path.exists(name):
        return None
    return load_file(name, device=device)[TENSOR_NAME]


def file_remove(root: str, mm_hash: str) -> None:
    folder = os.path.join(root, mm_hash)
    os.remove(os.path.join(folder, FILE_NAME))
    os.rmdir(folder)


def files_left(root: str) -> int:
    """Files (not folders) under ``root``; 0 when it does not exist."""
    return sum(len(files) for _, _, files in os.walk(root))


def fs_type(path: str) -> str:
    """The file system type of the mount that holds ``path`` (``/proc/mounts``), e.g. ``tmpfs`` or ``ext4``."""
    best, kind = "", "unknown"
    real = os.path.realpath(path)
    try:
        with open("/proc/mounts") as f:
            for line in f:
                parts = line.split()
                if len(parts) >= 3:
                    mount = parts[1]
                    inside = real == mount or real.startswith(mount.rstrip("/") + "/")
                    if inside and len(mount) >= len(best):
                        best, kind = mount, parts[2]
    except OSError:
        pass
    return kind


# -- the tensorwire path's reader side --


class CheckedArea(StagingArea):
    """A StagingArea that compares each staged item with what it must be (the bench's equality check, done where
    the tensor lands; a mismatch fails the stage, so the fetch reports it and nothing is kept). ``provider``
    ``none``: inline receipts only."""

    def __init__(self, base: torch.Tensor, device: str, provider: str) -> None:
        from tensorwire.rdma import RdmaConfig, TensorReader

        rdma = RdmaConfig(provider=provider, device=device)
        self.reader: TensorReader | None = None

        def factory() -> TensorReader:
            self.reader = TensorReader(rdma)
            return self.reader

        super().__init__(None if provider == "none" else factory, device=device)
        self._base = base
        self.checked = 0
        self.last_check_ns = 0  # how long the last item's check took (the file path pays the same check)

    def stage(
        self,
        key: str,
        receipt: pb.EncodeResponse,
        *,
        timeout_ms: int,
        expect: Expect | None = None,
        into: Callable[[int], torch.Tensor] | None = None,
    ) -> int:
        nbytes = super().stage(key, receipt, timeout_ms=timeout_ms, expect=expect, into=into)
        t = time.monotonic_ns()
        got = self.get(key)
        rows = expect.shape[0] if expect is not None and expect.shape else -1
        equal = got is not None and matches(got[0], self._base, index_of(key), rows)
        self.last_check_ns = time.monotonic_ns() - t
        if not equal:
            self.drop([key])
            raise ProtocolError(
                f"staged item {key[:24]!r} is not the item the encoder held", reason=Reason.RESULT_MISMATCH
            )
        self.checked += 1
        return nbytes

    def leftovers(self) -> dict[str, Any]:
        """What the area still holds, and its reader's lent-out buffers (0 after every drop)."""
        st = self.stats()
        out: dict[str, Any] = {
            "staged_items": st.staged_items,
            "staged_bytes": st.staged_bytes,
            "stages": st.stages,
            "stage_failures": st.stage_failures,
            "rdma_stages": st.rdma_stages,
            "checked": self.checked,
        }
        if self.reader is not None:
            rs = self.reader.stats()
            out.update(
                reader_loaned_slots=rs.loans.busy_slots,
                reader_quarantine_live=rs.quarantine_live,
                reader_transport=self.reader.transport(),
            )
        return out


def serve_staging(base_rows: int, cols: int, device: str, provider: str, address: str, conn: Any) -> None:
    """Third process (vLLM's multiprocess executor: the LLM instance's worker): a CheckedArea served over
    ``address``; answers ``("stats",)`` and ``("stop",)`` on ``conn``."""
    os.environ.setdefault("NIXL_LOG_LEVEL", "WARN")
    from tensorwire.bench._plain_grpc import embedding
    from tensorwire.integrations._vllm_ec.runtime import staging_local_path
    from tensorwire.mm.held._rpc import serve_staging_local, serve_store

    base = embedding(base_rows, cols).to(device)
    area = CheckedArea(base, device, provider)
    server = serve_store(address, staging=area, threads=4)
    local = serve_staging_local(staging_local_path(address), area)  # as StagingRuntime serves it
    area.warm_up()
    conn.send(("ready", os.getpid()))
    try:
        while True:
            msg = conn.recv()
            if msg[0] == "stats":
                conn.send(area.leftovers())
            elif msg[0] == "stop":
                break
    finally:
        local.close(0.5)
        server.stop(0.5)
        area.close()
        conn.send(("stopped",))


# -- the encoder instance (both paths' producer side) --


def _request(mm_hash: str, rows: int) -> SimpleNamespace:
    """The duck-typed vLLM request the connector's producer scheduler reads (one image item)."""
    feat = SimpleNamespace(
        identifier=mm_hash, modality="image", mm_position=SimpleNamespace(get_num_embeds=lambda: rows)
    )
    return SimpleNamespace(req_id=f"req-{mm_hash[:16]}", request_id=f"req-{mm_hash[:16]}", mm_features=[feat])


def _producer_stats(rt: Any) -> dict[str, Any]:
    st = asdict(rt.store.stats())
    if rt.exporter is not None:
        ex = rt.exporter.stats()
        st.update(
            exporter_live_leases=ex.live_leases,
            pool_busy_slots=ex.pool.busy_slots,
            pool_idle_slots=ex.pool.idle_slots,
            pool_bytes=ex.pool.pool_bytes,
            exports=ex.exports,
            exporter_releases=ex.releases,
            gc_reclaims=ex.gc_reclaims,
            provider=ex.provider,
        )
    return st


def run_producer(
    base_rows: int, cols: int, device: str, cfg_kwargs: dict[str, Any], roots: dict[str, str], run_id: str, conn: Any
) -> None:
    """Encoder process. Commands on ``conn``: ``("item", path, index, rows)`` -> ``(t0_ns, t_saved_ns, payload)``
    (t0: the encoder output exists; payload: the params JSON for ``tensorwire``, the mm_hash for a file path, or
    ``error: ...`` when the save failed);
    ``("stats",)``; ``("stop",)``. Times are ``time.monotonic_ns()``: CLOCK_MONOTONIC, one clock for every
    process of the host."""
    os.environ.setdefault("NIXL_LOG_LEVEL", "WARN")
    from prometheus_client import CollectorRegistry

    from tensorwire.bench._plain_grpc import embedding
    from tensorwire.integrations._vllm_ec.config import ECConfig
    from tensorwire.integrations._vllm_ec.metrics import ECMetrics
    from tensorwire.integrations._vllm_ec.producer import ProducerScheduler, ProducerWorker
    from tensorwire.integrations._vllm_ec.runtime import ProducerRuntime

    cuda = device.startswith("cuda")
    cfg = ECConfig(**cfg_kwargs)
    metrics = ECMetrics(CollectorRegistry())
    base = embedding(base_rows, cols).to(device)
    rt = ProducerRuntime(cfg, PRODUCER_NAME, device)
    assert rt.store is not None
    sched = ProducerScheduler(lambda: rt.endpoint, metrics, dtype=DTYPE, width=lambda _m: cols, ttl_ms=cfg.lease_ttl_ms)
    worker = ProducerWorker(rt.store, metrics)
    conn.send(("ready", rt.endpoint, "rdma" if rt.exporter is not None else "inline", os.getpid()))
    try:
        while True:
            msg = conn.recv()
            if msg[0] == "stop":
                break
            if msg[0] == "stats":
                conn.send(_producer_stats(rt))
                continue
            _, path, index, rows = msg
            mm_hash = mm_hash_of(run_id, path, rows, index)
            emb = make_item(base, index, rows)
            if path == "tensorwire":
                # Before the encoder runs, as in vLLM: the scheduler mints the grant (build_connector_meta), the
                # worker adds it to the store (start_save_caches). Not part of the hand-off.
                req = _request(mm_hash, rows)
                worker.start_save_caches(None, sched.build_step([req]))
            if cuda:
                torch.cuda.current_stream(device).synchronize()
            t0 = time.monotonic_ns()
            if path == "tensorwire":
                worker.save_caches({mm_hash: emb}, mm_hash)  # the export into the held store
                params = sched.request_finished(req, finished_ok=True)
                payload = json.dumps(params)  # what the router carries to the LLM instance
            else:
                try:
                    file_save(roots[path], mm_hash, emb)
                except OSError as exc:  # a full tmpfs, say: that item failed, the run goes on
                    shutil.rmtree(os.path.join(roots[path], mm_hash), ignore_errors=True)
                    conn.send((t0, time.monotonic_ns(), f"error: {exc}"))
                    continue
                payload = mm_hash
            conn.send((t0, time.monotonic_ns(), payload))
            del emb
    finally:
        final = _producer_stats(rt)
        rt.close()
        conn.send(("stopped", final))


def expect_for(rows: int, cols: int) -> Expect:
    """What the LLM instance expects (its own placeholder count by the model's width), not what the params say."""
    return Expect((rows, cols), DTYPE)


__all__ = [
    "mark",
    "make_item",
    "matches",
    "mm_hash_of",
    "staging_key",
    "index_of",
    "file_name",
    "file_save",
    "file_load",
    "file_remove",
    "files_left",
    "fs_type",
    "CheckedArea",
    "serve_staging",
    "run_producer",
    "expect_for",
    "FILE_NAME",
    "TENSOR_NAME",
    "DTYPE",
]
