"""Where one ``bench vllm_ec`` tensorwire item's time goes, in both processes (diagnostic, not a bench).

    PYTHONPATH=src python scripts/probe_ec.py [--device cpu|cuda:0] [--rows 1280] [--iters 40] [--stager local]

Runs the bench's own processes (``tensorwire.bench.vllm_ec._Run``: the encoder process with the connector's
producer halves, this process with its ``Fetcher``) for the tensorwire path only, with the functions in LLM and
ENCODER wrapped to record enter/exit (CLOCK_MONOTONIC, one clock for both processes). Prints, per item size, each
function's median start offset from the item's t0 (the encoder output exists) and its median duration. Each
wrapper adds ~1-2 us. The file path is not run: ``bench vllm_ec`` compares the paths.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import statistics
import sys
import tempfile
import time
from typing import Any

sys.path.insert(0, os.path.dirname(__file__))
from probe_timeline import EVENTS, _wrap, per_function, print_table  # the transfer probe's wrappers and table

LLM = [
    "tensorwire.integrations._vllm_ec.fetch:Fetcher._run",
    "tensorwire.integrations._vllm_ec.fetch:Fetcher._lookup",
    "tensorwire.mm.held._rpc:HeldStoreClient.lookup",
    "tensorwire.mm.held._local:LocalRpcClient.call",
    "tensorwire.integrations._vllm_ec.fetch:Fetcher._stage_everywhere",
    "tensorwire.mm.held._staging:StagingArea.stage",
    "tensorwire.mm.held._staging:StagingArea._read_rdma",
    "tensorwire.rdma._descriptor:Descriptor.from_bytes",
    "tensorwire.rdma._reader:TensorReader.read",
    "tensorwire.rdma._reader:TensorReader._validate",
    "tensorwire.rdma._reader:TensorReader._read_batch",
    "tensorwire.rdma._reader:TensorReader._destination",
    "tensorwire.rdma._reader:TensorReader._loan_tensor",
    "tensorwire.rdma._reader:_check_results",
    "tensorwire.rdma.providers._nixl:NixlProvider.read",
    "tensorwire.rdma.providers._nixl:NixlProvider._remote",
    "tensorwire.rdma.providers._nixl:NixlProvider._transfer",
    "tensorwire.bench._vllm.ec_paths:matches",
]
ENCODER = [
    "tensorwire.integrations._vllm_ec.producer:ProducerWorker.save_caches",
    "tensorwire.integrations._vllm_ec.producer:ProducerScheduler.request_finished",
    "tensorwire.mm.held._store:HeldStore.hold",
    "tensorwire.mm.held._store:HeldStore.lookup",
    "tensorwire.mm.held._store:HeldStore.release",
    "tensorwire.rdma._exporter:TensorExporter.export",
    "tensorwire.rdma._exporter:TensorExporter._check_inputs",
    "tensorwire.rdma._exporter:TensorExporter.allocate",
    "tensorwire.rdma._exporter:TensorExporter._copy_in",
    "tensorwire.rdma._exporter:TensorExporter._publish",
    "tensorwire.mm.held._local:LocalRpcServer._answer",
    "tensorwire.mm.held._rpc:HeldStoreServicer.lookup",
]
T0 = "t0"


def _producer_main(*args: Any) -> None:
    """The bench's encoder process with ENCODER wrapped and each item's t0 recorded; dumps the events at exit."""
    import tensorwire.bench._vllm.ec_paths as paths

    for spec in ENCODER:
        try:
            _wrap(spec, "E")
        except AttributeError as exc:
            print(f"probe: cannot wrap {spec}: {exc}", file=sys.stderr)
    orig_make = paths.make_item

    def make_item(base: Any, index: int, rows: int) -> Any:
        out = orig_make(base, index, rows)
        EVENTS.append((T0, index, time.monotonic_ns(), time.monotonic_ns()))
        return out

    paths.make_item = make_item
    try:
        paths.run_producer(*args[:-1])
    finally:
        with open(args[-1], "w") as f:
            json.dump(EVENTS, f)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--rows", type=int, nargs="+", default=[1280])
    ap.add_argument("--iters", type=int, default=40)
    ap.add_argument("--stager", choices=("local", "remote"), default="local")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    os.environ.setdefault("NIXL_LOG_LEVEL", "WARN")
    import tensorwire.bench._vllm.ec_paths as paths
    from tensorwire.bench import vllm_ec

    for spec in LLM:
        try:
            _wrap(spec, "L")
        except AttributeError as exc:
            print(f"probe: cannot wrap {spec}: {exc}", file=sys.stderr)
    dump = tempfile.mktemp(suffix=".json")
    orig_run = paths.run_producer
    # _Run reads the attribute at construction and hands it to a spawned Process: the target must be importable.
    paths.run_producer = functools.partial(_producer_main_entry, dump=dump)  # type: ignore[assignment]
    bench_args = argparse.Namespace(
        device=args.device,
        rows=args.rows,
        cols=vllm_ec.COLS,
        iters=args.iters,
        warmup=5,
        series=0,
        series_rows=1280,
        stager=args.stager,
        tmpfs_dir="",
        disk_dir="",
        rdma_provider="auto",
        quick=False,
        out=None,
    )
    work = tempfile.mkdtemp(prefix="tw-probe-ec-")
    run = vllm_ec._Run(bench_args, "probe", {}, work)
    paths.run_producer = orig_run
    windows: dict[int, list[tuple[int, int, int]]] = {}
    try:
        index = 0
        for rows in args.rows:
            for i in range(args.iters + 5):
                index += 1
                a = time.monotonic_ns()
                row = run.item("tensorwire", index, rows)
                b = time.monotonic_ns()
                assert row is not None, run.failures
                if i >= 5:
                    windows.setdefault(rows, []).append((index, a, b))
    finally:
        run.close()
    with open(dump) as f:
        enc = [tuple(e) for e in json.load(f)]
    os.unlink(dump)
    t0_of = {e[1]: e[2] for e in enc if e[0] == T0}
    events = sorted([e for e in EVENTS + enc if e[0] != T0], key=lambda e: e[2])
    from tensorwire.bench._common import machine_info

    report: dict[str, Any] = {
        "machine": machine_info(),
        "device": args.device,
        "stager": args.stager,
        "loadavg": os.getloadavg(),
    }
    for rows, wins in windows.items():
        spans = [(t0_of[index], b) for index, _a, b in wins]  # from the encoder output's existence
        totals, rows_out = per_function(events, spans)
        print(
            f"\n== rows {rows} ({rows * vllm_ec.COLS * 2 / 1e6:.2f} MB), {len(wins)} items, t0 -> checked and "
            f"answered median {statistics.median(totals):.0f} us, load {os.getloadavg()[0]:.1f}"
        )
        report[str(rows)] = print_table(totals, rows_out, 62)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1)
    return 0


def _producer_main_entry(*args: Any, dump: str) -> None:
    _producer_main(*args, dump)


if __name__ == "__main__":
    sys.exit(main())
