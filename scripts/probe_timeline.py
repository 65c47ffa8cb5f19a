"""Where one fetch's time goes, across both processes: a timeline of wrapped functions (diagnostic, not a bench).

    PYTHONPATH=src python scripts/probe_timeline.py [--device cuda:0] [--iters 40] [--rows 8 13760] [--channel local]
        [--gap-ms 5]

Starts the transfer bench's encoder (spawned process, real gRPC server and exporter), fetches zero-copy outputs
through the EncodeStream, and records enter/exit times (CLOCK_MONOTONIC, shared by both processes) of the
functions listed in COMMON, CLIENT and SERVER, in both processes. Prints, per size, each function's median start
offset from the fetch's start and its median duration. Each wrapper adds ~1-2 us.
"""

from __future__ import annotations

import argparse
import importlib
import json
import multiprocessing as mp
import os
import statistics
import sys
import tempfile
import threading
import time
from typing import Any

EVENTS: list[tuple[str, int, int, int]] = []  # (name, thread id, enter ns, exit ns)

COMMON = [
    "grpc._channel:_MultiThreadedRendezvous.__next__",
    "grpc._server:_RequestIterator.__next__",
    "tensorwire._local.unix:recv_frame",
    "tensorwire._local.unix:send_frame",
]
CLIENT = [
    "tensorwire.mm.client._transport:RemoteOutputTransport.fetch",
    "tensorwire.mm.client._grpc:_GrpcSession.encode",
    "tensorwire.mm.client._stream:StreamCall.encode",
    "tensorwire.mm.client._transport:RemoteOutputTransport._consume_rdma",
    "tensorwire.mm.client._rdma_receipt:parse_slots",
    "tensorwire.mm.client._rdma_receipt:validate_slots",
    "tensorwire.mm.client._rdma_receipt:check_read",
    "tensorwire.mm.client._rdma_receipt:assemble_output",
    "tensorwire.mm.client._grpc:_GrpcSession.release_after_read",
    "tensorwire.mm.client._local:_LocalSession.encode",
    "tensorwire.mm.client._local:_Conn.encode",
    "tensorwire.mm.client._local:_Conn.send_release",
    "tensorwire.mm.client._local:LocalControlChannel.session",
    "tensorwire.mm.client._local:_Conn._pick",
    "tensorwire.mm.client._local:_LocalSession.take_placed",
    "tensorwire.mm.client._local:placed_views",  # names imported into a module are wrapped there
    "tensorwire.mm.wire._placed:RecvBuffer.lend",
    "tensorwire.mm.client._transport:RemoteOutputTransport._decode_terminal",
    "tensorwire.mm.wire._placed:RecvBuffer.wait_ready",
    "tensorwire.mm.client._local:read_stream_response",
    "tensorwire.mm.client._transport:_RdmaAttempt.to_pb",
    "tensorwire.rdma._reader:TensorReader.read",
    "tensorwire.rdma._reader:TensorReader._validate",
    "tensorwire.rdma._reader:TensorReader._destination",
    "tensorwire.rdma._reader:TensorReader._loan_tensor",
    "tensorwire.rdma._reader:TensorReader._mark_ready",
    "tensorwire.rdma._reader:_ready",
    "tensorwire.rdma._reader:_check_results",
    "tensorwire.rdma.providers._nixl:NixlProvider.read",
    "tensorwire.rdma.providers._nixl:NixlProvider._remote",
]
SERVER = [
    "tensorwire.mm.server._service:_parse_or_abort",
    "tensorwire.mm.server._service:EncoderService.run_encode",
    "tensorwire.mm.wire._codec:inputs_from_pb",
    "tensorwire.mm.server._output:OutputTransport.allocate_output",
    "tensorwire.mm.server._output:OutputTransport.transfer",
    "tensorwire.mm.server._output:OutputTransport._try_publish",
    "tensorwire.mm.server._output:OutputTransport._try_place",
    "tensorwire.mm.wire._placed:Placement.views",
    "tensorwire.rdma._exporter:TensorExporter.allocate",
    "tensorwire.rdma._exporter:TensorExporter.export_allocated",
    "tensorwire.rdma._exporter:TensorExporter._sync_device",
    "tensorwire.rdma._exporter:TensorExporter._publish",
    "tensorwire.rdma._descriptor:Descriptor.to_bytes",
    "tensorwire.mm.wire:stream_frame",
    "tensorwire.mm.server._local:LocalControlServer._serve_frame",
    "tensorwire.mm.server._local:LocalControlServer._answer",
]


def _wrap(spec: str, side: str) -> None:
    mod_name, attr = spec.split(":")
    mod = importlib.import_module(mod_name)
    owner: Any = mod
    parts = attr.split(".")
    for p in parts[:-1]:
        owner = getattr(owner, p, None)
    orig = getattr(owner, parts[-1], None)
    if orig is None:  # another version of the code (an A/B run against an older tree): nothing to time there
        print(f"probe_timeline: {spec} not found; not timed", file=sys.stderr)
        return
    name = f"{side}:{parts[-1] if len(parts) == 1 else '.'.join(parts[-2:])}"
    clock, ident = time.monotonic_ns, threading.get_ident

    def wrapper(*a: Any, **k: Any) -> Any:
        t0 = clock()
        try:
            return orig(*a, **k)
        finally:
            EVENTS.append((name, ident(), t0, clock()))

    wrapper.__wrapped__ = orig  # type: ignore[attr-defined]
    is_static = isinstance(owner, type) and isinstance(owner.__dict__.get(parts[-1]), staticmethod)
    setattr(owner, parts[-1], staticmethod(wrapper) if is_static else wrapper)


def _requests_hook(side: str) -> None:
    from tensorwire.mm.client import _stream as _encode_stream

    orig = _encode_stream.StreamCall._requests

    def _requests(self: Any) -> Any:
        for item in orig(self):
            EVENTS.append((f"{side}:request_yield", threading.get_ident(), time.monotonic_ns(), time.monotonic_ns()))
            yield item

    _encode_stream.StreamCall._requests = _requests


def _encoder_main(device: str, rows: int, cols: int, q: Any, stop: Any, dump: str) -> None:
    for spec in COMMON + SERVER:
        _wrap(spec, "S")
    from tensorwire.bench import transfer

    try:
        transfer._encoder(device, rows, cols, q, stop)
    finally:
        with open(dump, "w") as f:
            json.dump(EVENTS, f)


def per_function(
    events: list[tuple[Any, ...]], windows: list[tuple[int, int]]
) -> tuple[list[float], list[tuple[float, str, float, int]]]:
    """For ``windows`` (start, end ns): each one's length in us, and per function seen in at least half of them
    (the n-th call in a window is ``name#n``): (median start offset us, name, median duration us, count)."""
    per: dict[str, list[tuple[float, float]]] = {}
    totals = []
    for a, b in windows:
        totals.append((b - a) / 1e3)
        seen: dict[str, int] = {}
        for name, _tid, t0, t1 in events:
            if a <= t0 and t1 <= b:
                seen[name] = seen.get(name, 0) + 1
                key = name if seen[name] == 1 else f"{name}#{seen[name]}"
                per.setdefault(key, []).append(((t0 - a) / 1e3, (t1 - t0) / 1e3))
    out = [
        (statistics.median(x[0] for x in xs), key, statistics.median(x[1] for x in xs), len(xs))
        for key, xs in per.items()
        if len(xs) >= len(windows) // 2
    ]
    return totals, sorted(out)


def print_table(totals: list[float], rows: list[tuple[float, str, float, int]], width: int) -> dict[str, Any]:
    """Prints ``per_function``'s rows; returns them for the JSON report."""
    print(f"{'function':{width}} {'start us':>9} {'dur us':>8} {'n':>4}")
    for start, key, dur, n in rows:
        print(f"{key:{width}} {start:9.0f} {dur:8.0f} {n:4d}")
    q = statistics.quantiles(totals, n=10) if len(totals) > 1 else [totals[0]] * 9
    print(f"fetch p10 {q[0]:.0f} us, p90 {q[-1]:.0f} us")
    return {
        "total_us": statistics.median(totals),
        "total_p10_us": q[0],
        "total_p90_us": q[-1],
        "functions": {k: {"start_us": s, "dur_us": d, "n": n} for s, k, d, n in rows},
    }


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--iters", type=int, default=40)
    ap.add_argument("--rows", type=int, nargs="+", default=[8, 13760])
    ap.add_argument("--json", default=None, help="also write the timelines here")
    ap.add_argument(
        "--channel",
        choices=["grpc", "local", "placed"],
        default="grpc",
        help="the control channel: the EncodeStream, or the same-host channel (issue 18) with the RDMA "
        "plane, or with placed outputs (receive buffers)",
    )
    ap.add_argument(
        "--gap-ms",
        type=float,
        default=0.0,
        help="both processes idle this long between fetches (a fetch after a pause, not back to back)",
    )
    args = ap.parse_args()
    os.environ.setdefault("NIXL_LOG_LEVEL", "WARN")
    import torch

    from tensorwire.mm import MultimodalInput, RemoteOutputTransport, TransportConfig
    from tensorwire.rdma import RdmaConfig

    for spec in COMMON + CLIENT:
        _wrap(spec, "C")
    _requests_hook("C")
    dump = tempfile.mktemp(suffix=".json")
    ctx = mp.get_context("spawn")
    q, stop = ctx.Queue(), ctx.Event()
    proc = ctx.Process(target=_encoder_main, args=(args.device, max(args.rows), 4096, q, stop, dump), daemon=True)
    proc.start()
    windows: dict[int, list[tuple[int, int]]] = {}
    try:
        port, ready = q.get(timeout=120)
        assert ready, "exporter not ready"
        cfg = TransportConfig(
            rdma=RdmaConfig(device=args.device),
            rpc_timeout_margin_ms=5000,
            local_channel="off" if args.channel == "grpc" else "auto",
            local_placement_bytes=(1 << 30) if args.channel == "placed" else 0,
        )
        plane = "placed" if args.channel == "placed" else "rdma"
        with RemoteOutputTransport(f"127.0.0.1:{port}", cfg) as t:
            assert t.wait_ready(60)
            for rows in args.rows:
                inputs = [MultimodalInput(b"image", params={"rows": str(rows), "zero_copy": "1"})]
                for i in range(args.iters + 5):
                    a = time.monotonic_ns()
                    out = t.fetch(inputs)
                    if args.device.startswith("cuda"):
                        torch.cuda.synchronize()
                    b = time.monotonic_ns()
                    assert out.plane.value == plane or i < 5, out.plane  # placed: the first learns the size
                    del out
                    if i >= 5:
                        windows.setdefault(rows, []).append((a, b))
                    if args.gap_ms:
                        time.sleep(args.gap_ms / 1e3)
    finally:
        stop.set()
        proc.join(60)
    with open(dump) as f:
        server_events = [tuple(e) for e in json.load(f)]
    os.unlink(dump)
    events = sorted(EVENTS + server_events, key=lambda e: e[2])
    from tensorwire.bench._common import cuda_mps_active, machine_info

    report: dict[str, Any] = {"machine": machine_info(), "device": args.device, "gap_ms": args.gap_ms}
    print(f"device {args.device}, CUDA MPS {'on' if args.device != 'cpu' and cuda_mps_active() else 'off'}")
    for rows, wins in windows.items():
        totals, rows_out = per_function(events, wins)
        print(
            f"\n== rows {rows} ({rows * 4096 * 2 / 1e6:.3f} MB), {len(wins)} fetches, total median "
            f"{statistics.median(totals):.0f} us (synced)"
        )
        report[str(rows)] = print_table(totals, rows_out, 58)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
