"""Benchmark: encoder on one GPU, LLM side on another GPU of the same host, both planes, against a P2P copy.

    python -m tensorwire.bench multigpu [--pairs 0:1,1:0] [--rows 13760] [--iters 20] [--inline-iters 5]
    python -m tensorwire.bench multigpu --dry-run      # cpu for both sides: tests the plumbing without GPUs

For each (encoder device, reader device) pair three spawned processes run, one after the other:

* the **encoder**: ``serve_encoder`` on a real gRPC server (127.0.0.1, OS port) with
  ``TransportConfig(rdma=RdmaConfig(device=<encoder device>))``; its output is a bf16 ``[rows, 4096]`` tensor
  built on the encoder device (a 112.7 MB ViT output at 13760 rows);
* the **LLM side**: ``RemoteOutputTransport`` with ``RdmaConfig(device=<reader device>)`` (RDMA plane, mode auto)
  and a mode ``grpc`` transport (inline plane); it checks the bytes (bf16, bitwise) of the first and last fetch of
  each plane, the device of every returned embedding (RDMA: the reader device; inline: the host, then moved to the
  reader device as a separate ``to_device`` stage), and the UCX transport the reader reports;
* the **baseline**: a plain peer-to-peer copy ``dst.copy_(src)`` from the encoder device to the reader device
  (both devices synchronized, median of N), plus a same-device copy on the reader device.

Device hygiene: neither the encoder nor the LLM process calls ``torch.cuda.set_device``, so any library code that
silently uses the current device (cuda:0) shows up in the reverse pair (encoder or reader on cuda:1). Each process
records, after its work, ``torch.cuda.memory_allocated``/``max_memory_allocated`` per device (a fresh process starts
at zero), and which devices have an active CUDA primary context before and after (driver
``cuDevicePrimaryCtxGetState``, which creates none). Torch allocations on a device
other than the process's own fail the check; a context on the other device is reported, not judged (UCX's
cuda_ipc transport may retain the peer device's context by itself).

Stages per fetch (client wall clock, medians), as in ``tensorwire.bench.transfer``: ``export`` (encoder copy into
the slot), ``control`` (Encode round trip, contains the export), ``read`` (RDMA READ), ``release`` (enqueueing the
async release), ``transfer`` (fetch total after a device synchronize, minus the encoder's compute). Writes
``benchmarks/results/multigpu-<machine>x<gpus>.json``. Exits 0 with a message when fewer than 2 GPUs are visible.
"""

from __future__ import annotations

import argparse
import ctypes
import multiprocessing as mp
import os
import queue as queue_mod
import sys
import time
from collections.abc import Sequence
from typing import Any

from tensorwire.bench._common import RESULTS_DIR, machine_tag, summarize, write_result
from tensorwire.bench.transfer import stage_row

SEED_SHAPE = (13760, 4096)  # bf16: 112,721,920 bytes, a 112.7 MB ViT output (same as tensorwire.bench.transfer)
DATA_SEED = 8
DRY_RUN_ROWS = 1024  # 8 MiB: enough for the RDMA path's large-read branch on host memory, fast on 2 cores


# -- pure helpers (unit-tested) ---------------------------------------------------------------------------------


def parse_pairs(spec: str, n_gpus: int) -> list[tuple[str, str]]:
    """``"0:1,1:0"`` -> ``[("cuda:0", "cuda:1"), ("cuda:1", "cuda:0")]``; each index must be < ``n_gpus``."""
    pairs: list[tuple[str, str]] = []
    for item in (s.strip() for s in spec.split(",")):
        if not item:
            continue
        parts = item.split(":")
        if len(parts) != 2 or not all(p.isdigit() for p in parts):
            raise ValueError(f"pair {item!r}: expected ENC:READER GPU indexes such as 0:1")
        enc, rd = (int(p) for p in parts)
        for i in (enc, rd):
            if i >= n_gpus:
                raise ValueError(f"pair {item!r}: GPU {i} does not exist ({n_gpus} visible)")
        pairs.append((f"cuda:{enc}", f"cuda:{rd}"))
    if not pairs:
        raise ValueError("no device pairs given")
    return pairs


def parse_rows(spec: str) -> list[int]:
    rows = [int(s) for s in spec.split(",") if s.strip()]
    if not rows or any(r <= 0 for r in rows):
        raise ValueError(f"--rows {spec!r}: expected positive integers")
    return rows


def foreign_allocations(own: str, mem: dict[str, dict[str, int]]) -> dict[str, int]:
    """Devices other than ``own`` on which this process allocated torch memory: ``{device: peak bytes}``.

    ``mem`` maps a device name to ``{"allocated": .., "max_allocated": ..}`` as recorded by ``_memory_by_device``.
    """
    return {
        d: max(m.get("allocated", 0), m.get("max_allocated", 0))
        for d, m in mem.items()
        if d != own and max(m.get("allocated", 0), m.get("max_allocated", 0)) > 0
    }


def gbps(nbytes: int, ms: float) -> float:
    return nbytes / (ms / 1e3) / 1e9 if ms > 0 else float("inf")


def result_tag(n_gpus: int, dry_run: bool) -> str:
    """File tag: ``h200x2`` on two H200s; ``cpu2-dryrun`` for a dry run on a 2-core machine."""
    if dry_run:
        return f"cpu{os.cpu_count()}-dryrun"
    return f"{machine_tag()}x{n_gpus}"


# -- per-process device bookkeeping -----------------------------------------------------------------------------


def _memory_by_device(n_gpus: int) -> dict[str, dict[str, int]]:
    import torch

    out: dict[str, dict[str, int]] = {}
    for d in range(n_gpus):
        # Reading the allocator's counters creates no context on the device.
        out[f"cuda:{d}"] = {
            "allocated": int(torch.cuda.memory_allocated(d)),
            "max_allocated": int(torch.cuda.max_memory_allocated(d)),
        }
    return out


def _active_contexts(n_gpus: int) -> list[int] | None:
    """Devices with an active CUDA primary context in this process (driver API), or None if unknown."""
    if n_gpus == 0:
        return []
    try:
        cuda = ctypes.CDLL("libcuda.so.1")
    except OSError:
        return None
    if cuda.cuInit(0) != 0:
        return None
    active: list[int] = []
    for i in range(n_gpus):
        dev, flags, state = ctypes.c_int(), ctypes.c_uint(), ctypes.c_int()
        if cuda.cuDeviceGet(ctypes.byref(dev), i) != 0:
            return None
        if cuda.cuDevicePrimaryCtxGetState(dev, ctypes.byref(flags), ctypes.byref(state)) != 0:
            return None
        if state.value:
            active.append(i)
    return active


def _device_report(own: str, n_gpus: int, contexts_before: list[int] | None) -> dict[str, Any]:
    contexts = _active_contexts(n_gpus)  # before the allocator queries below, so they cannot be the cause
    after = _memory_by_device(n_gpus)
    foreign = foreign_allocations(own, after)
    own_idx = int(own.split(":")[1]) if own.startswith("cuda:") else None
    return {
        "device": own,
        "contexts_before": contexts_before,
        "memory_after": after,
        "foreign_allocations": foreign,
        "no_foreign_allocations": not foreign,
        "active_contexts": contexts,
        "contexts_on_other_devices": None if contexts is None else [c for c in contexts if c != own_idx],
    }


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        import torch

        torch.cuda.synchronize(device)  # explicit device: the current device may be another GPU


def _expected(rows: int, cols: int) -> Any:
    from tensorwire.testing import make_tensor

    return make_tensor((rows, cols), "bfloat16", DATA_SEED)


# -- processes --------------------------------------------------------------------------------------------------


def _encoder_proc(device: str, rows: int, cols: int, n_gpus: int, q: Any, stop: Any, life_s: float) -> None:
    try:
        import torch

        from tensorwire.mm import EncoderOutput, TransportConfig, serve_encoder
        from tensorwire.rdma import RdmaConfig

        # A fresh process has allocated nothing; only the contexts are read (driver API: creates none).
        before = _active_contexts(n_gpus)
        emb = _expected(rows, cols).to(device)
        seen_devices: set[str] = set()

        def encode_fn(inputs: list[Any]) -> Any:
            n = int(inputs[0].params.get("rows", rows))
            seen_devices.add(str(emb.device))
            return EncoderOutput(embeddings=emb[:n], split_sizes=[n])

        cfg = TransportConfig(worker_id=f"multigpu-encoder-{device.replace(':', '')}", rdma=RdmaConfig(device=device))
        server = serve_encoder(encode_fn, cfg, "127.0.0.1:0")
        try:
            q.put(("ready", server.port, server.transport.wait_ready(60)))
            stop.wait(life_s)
            report = _device_report(device, n_gpus, before)
            report["output_devices"] = sorted(seen_devices)
            report["output_on_device"] = seen_devices <= {str(torch.device(device))}
            q.put(("encoder", report))
        finally:
            server.stop(0)
    except BaseException as exc:  # report, never leave the parent waiting
        q.put(("error", f"encoder: {type(exc).__name__}: {exc}"))


def _stage_row(s: dict[str, float], synced_total_ms: float, to_device_ms: float) -> dict[str, float]:
    row = stage_row(s, synced_total_ms)
    row["to_device"] = to_device_ms
    row["delivered"] = row["transfer"] + to_device_ms
    return row


def _run_plane(
    transport: Any, rows: int, iters: int, warmup: int, plane: str, device: str, expected: Any
) -> dict[str, Any]:
    from tensorwire.mm import MultimodalInput
    from tensorwire.testing import same_bytes

    want_device = device if plane == "rdma" else "cpu"  # the inline plane delivers on the host (MultimodalOutput)
    inputs = [MultimodalInput(b"image", params={"rows": str(rows)})]
    stages: dict[str, list[float]] = {}
    planes: set[str] = set()
    devices: set[str] = set()
    checks: list[bool] = []
    last = warmup + iters - 1
    for i in range(warmup + iters):
        t0 = time.perf_counter()
        out = transport.fetch(inputs)
        _sync(device)  # device copies queued by the read count too
        synced_ms = (time.perf_counter() - t0) * 1e3
        emb = out.embeddings[0]
        to_device_ms = 0.0
        if str(emb.device) != str(device):
            t1 = time.perf_counter()
            emb = emb.to(device)
            _sync(device)
            to_device_ms = (time.perf_counter() - t1) * 1e3
        planes.add(out.plane.value)
        devices.update(str(e.device) for e in out.embeddings)
        if i in (0, last):
            checks.append(len(out.embeddings) == 1 and same_bytes(emb, expected[:rows]))
        if i >= warmup:
            for k, v in _stage_row(out.stage_ms, synced_ms, to_device_ms).items():
                stages.setdefault(k, []).append(v / 1e3)
        del out, emb
    return {
        "planes_seen": sorted(planes),
        "plane_ok": planes == {plane},
        "devices_seen": sorted(devices),
        "expected_device": str(want_device),
        "device_ok": devices == {str(want_device)},
        "bytes_ok": bool(checks) and all(checks),
        "stages": {k: summarize(v) for k, v in stages.items()},
    }


def _llm_proc(
    endpoint: str, device: str, rows_list: list[int], cols: int, iters: int, inline_iters: int, n_gpus: int, q: Any
) -> None:
    try:
        import torch

        from tensorwire.mm import RemoteOutputTransport, TransportConfig
        from tensorwire.rdma import RdmaConfig

        before = _active_contexts(n_gpus)
        expected = _expected(max(rows_list), cols).to(device)
        cfg = TransportConfig(
            rdma=RdmaConfig(device=device), rpc_timeout_margin_ms=5000, local_placement_bytes=0
        )  # the RDMA plane across GPUs (placed outputs: bench transfer)
        report: dict[str, Any] = {"sizes": []}
        with (
            RemoteOutputTransport(endpoint, cfg) as rdma_t,
            RemoteOutputTransport(endpoint, cfg.with_mode("grpc")) as inline_t,
        ):
            rdma_ready = rdma_t.wait_ready(60)
            report["rdma_ready"] = rdma_ready
            for rows in rows_list:
                row: dict[str, Any] = {"rows": rows, "cols": cols, "dtype": "bfloat16", "bytes": rows * cols * 2}
                if rdma_ready:
                    row["rdma"] = _run_plane(rdma_t, rows, iters, 2, "rdma", device, expected)
                else:
                    row["rdma"] = {"error": "RDMA reader did not become ready (is NIXL installed?)"}
                row["inline"] = _run_plane(inline_t, rows, inline_iters, 1, "inline", device, expected)
                report["sizes"].append(row)
            reader = rdma_t._reader.get() if rdma_ready else None  # the benchmark reads the reader's own stats
            if reader is not None:
                stats = reader.stats().as_dict()
                report["ucx_transport"] = reader.transport()
                report["reader_stats"] = {k: v for k, v in stats.items() if isinstance(v, (int, float, str, bool))}
            else:
                report["ucx_transport"] = "n/a"
        del expected
        if device.startswith("cuda"):
            torch.cuda.synchronize(device)
        report.update(_device_report(device, n_gpus, before))
        q.put(("llm", report))
    except BaseException as exc:
        q.put(("error", f"llm: {type(exc).__name__}: {exc}"))


def _copy_samples(src: Any, dst: Any, iters: int, devices: Sequence[str]) -> list[float]:
    samples = []
    for _ in range(iters + 2):
        for d in devices:
            _sync(d)
        t = time.perf_counter()
        dst.copy_(src)
        for d in devices:
            _sync(d)
        samples.append(time.perf_counter() - t)
    return samples[2:]


def _p2p_proc(src_dev: str, dst_dev: str, nbytes: int, iters: int, q: Any) -> None:
    try:
        import torch

        out: dict[str, Any] = {"src": src_dev, "dst": dst_dev, "bytes": nbytes}
        if src_dev.startswith("cuda") and dst_dev.startswith("cuda"):
            out["can_access_peer"] = bool(
                torch.cuda.can_device_access_peer(torch.device(src_dev).index, torch.device(dst_dev).index)
            )
        src = torch.ones(nbytes, dtype=torch.uint8, device=src_dev)
        dst = torch.empty(nbytes, dtype=torch.uint8, device=dst_dev)
        p2p = summarize(_copy_samples(src, dst, iters, sorted({src_dev, dst_dev})))
        same = torch.empty(nbytes, dtype=torch.uint8, device=dst_dev)
        local = summarize(_copy_samples(dst, same, iters, [dst_dev]))
        out["p2p_copy"] = {**p2p, "gbps": gbps(nbytes, p2p["median_ms"])}
        out["same_device_copy"] = {**local, "gbps": gbps(nbytes, local["median_ms"])}
        q.put(("p2p", out))
    except BaseException as exc:
        q.put(("error", f"p2p: {type(exc).__name__}: {exc}"))


class _Collector:
    """Waits for tagged messages from child processes, with one deadline and a liveness check."""

    def __init__(self, q: Any, procs: list[Any]) -> None:
        self.q = q
        self.procs = procs

    def get(self, tag: str, deadline: float) -> Any:
        while True:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise TimeoutError(f"no {tag!r} message before the deadline")
            try:
                msg = self.q.get(timeout=min(remaining, 2.0))
            except queue_mod.Empty:
                dead = [p.exitcode for p in self.procs if p.exitcode not in (None, 0)]
                if dead:
                    raise RuntimeError(f"a child process died (exit codes {dead}) before sending {tag!r}") from None
                continue
            if msg[0] == "error":
                raise RuntimeError(msg[1])
            if msg[0] == tag:
                return msg[1:] if len(msg) > 2 else msg[1]


def _stop(procs: list[Any]) -> None:
    for p in procs:
        p.join(timeout=20)
        if p.is_alive():
            p.kill()
            p.join(timeout=5)


def run_pair(
    enc_dev: str,
    rd_dev: str,
    rows_list: list[int],
    cols: int,
    iters: int,
    inline_iters: int,
    p2p_iters: int,
    n_gpus: int,
    timeout_s: float,
) -> dict[str, Any]:
    ctx = mp.get_context("spawn")
    q, stop = ctx.Queue(), ctx.Event()
    deadline = time.monotonic() + timeout_s
    enc = ctx.Process(
        target=_encoder_proc, args=(enc_dev, max(rows_list), cols, n_gpus, q, stop, timeout_s), daemon=True
    )
    procs = [enc]
    enc.start()
    result: dict[str, Any] = {"encoder_device": enc_dev, "reader_device": rd_dev}
    try:
        col = _Collector(q, procs)
        port, exporter_ready = col.get("ready", deadline)
        result["exporter_ready"] = exporter_ready
        llm = ctx.Process(
            target=_llm_proc,
            args=(f"127.0.0.1:{port}", rd_dev, rows_list, cols, iters, inline_iters, n_gpus, q),
            daemon=True,
        )
        procs.append(llm)
        llm.start()
        result["llm"] = col.get("llm", deadline)
        stop.set()
        result["encoder"] = col.get("encoder", deadline)
    finally:
        stop.set()
        _stop(procs)
    p2p = ctx.Process(target=_p2p_proc, args=(enc_dev, rd_dev, max(rows_list) * cols * 2, p2p_iters, q), daemon=True)
    p2p.start()
    try:
        result["baseline"] = _Collector(q, [p2p]).get("p2p", time.monotonic() + 120)
    finally:
        _stop([p2p])
    return result


def _judge(pair: dict[str, Any]) -> dict[str, Any]:
    """Per size: ratios against the same run's P2P copy, and the pass/fail checks of the pair."""
    llm, enc, base = pair["llm"], pair["encoder"], pair["baseline"]
    p2p_ms = base["p2p_copy"]["median_ms"]
    full_bytes = base["bytes"]
    sizes = []
    for s in llm["sizes"]:
        r, i = s.get("rdma", {}), s["inline"]
        row: dict[str, Any] = {"rows": s["rows"], "bytes": s["bytes"]}
        if "stages" in r:
            rt, rr = r["stages"]["transfer"]["median_ms"], r["stages"]["read"]["median_ms"]
            row.update(
                {
                    "rdma_transfer_ms": rt,
                    "rdma_read_ms": rr,
                    "rdma_read_gbps": gbps(s["bytes"], rr),
                    "inline_delivered_ms": i["stages"]["delivered"]["median_ms"],
                    "inline_over_rdma_transfer": i["stages"]["delivered"]["median_ms"] / rt,
                }
            )
            if s["bytes"] == full_bytes:  # the baseline copies the largest size
                row["rdma_transfer_over_p2p_copy"] = rt / p2p_ms
                row["rdma_read_over_p2p_copy"] = rr / p2p_ms
                row["rdma_read_gbps_over_p2p_gbps"] = row["rdma_read_gbps"] / base["p2p_copy"]["gbps"]
        sizes.append(row)
    planes = [s[p] for s in llm["sizes"] for p in ("rdma", "inline") if "stages" in s.get(p, {})]
    checks = {
        "bytes_ok": bool(planes) and all(p["bytes_ok"] for p in planes),
        "returned_on_expected_device": bool(planes) and all(p["device_ok"] for p in planes),
        "planes_as_requested": bool(planes) and all(p["plane_ok"] for p in planes),
        "rdma_ran": all("stages" in s.get("rdma", {}) for s in llm["sizes"]),
        "encoder_output_on_device": enc.get("output_on_device", False),
        "no_foreign_allocations_encoder": enc["no_foreign_allocations"],
        "no_foreign_allocations_llm": llm["no_foreign_allocations"],
    }
    checks["all_ok"] = all(checks.values())
    return {"sizes": sizes, "checks": checks}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m tensorwire.bench multigpu", description=__doc__.split("\n\n")[0])
    ap.add_argument("--pairs", default="0:1,1:0", help="ENC:READER GPU index pairs (default 0:1,1:0)")
    ap.add_argument(
        "--rows",
        default=None,
        help=f"comma-separated row counts x {SEED_SHAPE[1]} bf16 (default {SEED_SHAPE[0]}; --dry-run {DRY_RUN_ROWS})",
    )
    ap.add_argument("--iters", type=int, default=20, help="timed RDMA fetches per size")
    ap.add_argument("--inline-iters", type=int, default=5, help="timed inline fetches per size")
    ap.add_argument("--p2p-iters", type=int, default=20, help="timed P2P copies")
    ap.add_argument("--timeout-s", type=float, default=240.0, help="limit per device pair")
    ap.add_argument("--dry-run", action="store_true", help="cpu for both sides (plumbing check without GPUs)")
    ap.add_argument("--out", default=None, help="JSON path (default benchmarks/results/multigpu-<machine>x<N>.json)")
    args = ap.parse_args(argv)
    for name in ("iters", "inline_iters", "p2p_iters"):
        if getattr(args, name) < 1:
            ap.error(f"--{name.replace('_', '-')} must be >= 1")
    try:
        rows_list = parse_rows(args.rows or str(DRY_RUN_ROWS if args.dry_run else SEED_SHAPE[0]))
    except ValueError as exc:
        ap.error(str(exc))
    os.environ.setdefault("NIXL_LOG_LEVEL", "WARN")
    # Both sides share one host: keep UCX's TCP wire-up lane on loopback (an operator's value wins).
    os.environ.setdefault("UCX_NET_DEVICES", "lo")

    import torch

    n_gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if args.dry_run:
        pairs = [("cpu", "cpu")]
    else:
        if n_gpus < 2:
            print(
                f"multigpu: needs at least 2 CUDA devices, found {n_gpus}; nothing measured "
                f"(use --dry-run to check the plumbing on cpu)"
            )
            return 0
        try:
            pairs = parse_pairs(args.pairs, n_gpus)
        except ValueError as exc:
            ap.error(str(exc))
    t_start = time.monotonic()
    results: list[dict[str, Any]] = []
    failed = False
    tag = result_tag(n_gpus, args.dry_run)
    out_path = args.out or RESULTS_DIR / f"multigpu-{tag}.json"

    def save() -> Any:  # after every pair, so a run cut short still leaves what it measured
        return write_result(
            "multigpu",
            {
                "config": {
                    "pairs": [list(p) for p in pairs],
                    "rows": rows_list,
                    "cols": SEED_SHAPE[1],
                    "dtype": "bfloat16",
                    "iters": args.iters,
                    "inline_iters": args.inline_iters,
                    "p2p_iters": args.p2p_iters,
                    "dry_run": args.dry_run,
                    "n_gpus": n_gpus,
                    "wall_s": round(time.monotonic() - t_start, 1),
                    "env": {k: v for k, v in os.environ.items() if k.startswith(("UCX_", "NCCL_", "CUDA_VISIBLE"))},
                },
                "pairs": results,
                "notes": "stage times are client wall clock (after a synchronize of the reader device); "
                "transfer = fetch total - encoder compute; inline 'delivered' adds the host-to-reader-device copy; "
                "the baseline is dst.copy_(src) encoder device -> reader device in a separate process, both devices "
                "synchronized",
            },
            out_path,
        )

    for enc_dev, rd_dev in pairs:
        t0 = time.monotonic()
        try:
            pair = run_pair(
                enc_dev,
                rd_dev,
                rows_list,
                SEED_SHAPE[1],
                args.iters,
                args.inline_iters,
                args.p2p_iters,
                n_gpus,
                args.timeout_s,
            )
        except (RuntimeError, TimeoutError) as exc:
            print(f"{enc_dev} -> {rd_dev}: FAILED {exc}", file=sys.stderr)
            results.append({"encoder_device": enc_dev, "reader_device": rd_dev, "error": str(exc)})
            failed = True
            save()
            continue
        pair["summary"] = _judge(pair)
        results.append(pair)
        base = pair["baseline"]
        print(
            f"{enc_dev} -> {rd_dev}  ({time.monotonic() - t0:.1f} s)  UCX transport: {pair['llm']['ucx_transport']}"
            f"  P2P copy {base['p2p_copy']['median_ms']:.3f} ms ({base['p2p_copy']['gbps']:.1f} GB/s, peer access "
            f"{base.get('can_access_peer', 'n/a')})  same-device copy {base['same_device_copy']['median_ms']:.3f} ms",
            flush=True,
        )
        for s in pair["summary"]["sizes"]:
            if "rdma_transfer_ms" not in s:
                print(f"  {s['bytes'] / 1e6:9.3f} MB  rdma: not run")
                continue
            line = (
                f"  {s['bytes'] / 1e6:9.3f} MB  rdma transfer {s['rdma_transfer_ms']:8.3f} ms (read "
                f"{s['rdma_read_ms']:7.3f} ms, {s['rdma_read_gbps']:7.1f} GB/s)  inline+to_device "
                f"{s['inline_delivered_ms']:8.2f} ms  inline/rdma {s['inline_over_rdma_transfer']:7.1f}x"
            )
            if "rdma_transfer_over_p2p_copy" in s:
                line += (
                    f"  rdma/p2p: transfer {s['rdma_transfer_over_p2p_copy']:5.2f}x, read "
                    f"{s['rdma_read_over_p2p_copy']:5.2f}x"
                )
            print(line, flush=True)
        checks = pair["summary"]["checks"]
        print(f"  checks: {checks}", flush=True)
        llm, enc = pair["llm"], pair["encoder"]
        print(
            f"  contexts: encoder {enc['active_contexts']}, llm {llm['active_contexts']}; foreign torch "
            f"allocations: encoder {enc['foreign_allocations']}, llm {llm['foreign_allocations']}",
            flush=True,
        )
        failed = failed or not checks["all_ok"]
        save()
    path = save()
    print(f"wrote {path}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
