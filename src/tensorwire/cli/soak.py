"""``tensorwire soak``: the fault-injection soak (and, with ``--load``, the closed-loop load run) on loopback.

Exit code 0 when every check passed (0 wrong outputs, 0 hung requests, 0 untyped errors, 0 leases or busy
slots after the GC window, fds and threads back), 1 otherwise, 2 on bad arguments. Progress on stderr every
``--progress-s``; the report on stdout (``--json``: one JSON object). See docs/reliability.md.
"""

from __future__ import annotations

import argparse
import sys

HELP = "fault-injection soak / closed-loop load run on loopback; checks outputs bit for bit and accounts leaks"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--duration", type=float, default=60.0, help="seconds of traffic (default: 60)")
    parser.add_argument("--concurrency", type=int, default=8, help="fetch threads in total (default: 8)")
    parser.add_argument(
        "--client-processes", type=int, default=0, help="client processes (default: min(4, concurrency))"
    )
    parser.add_argument(
        "--faults",
        default="all",
        help="all, none, or a comma list of reader_kill, worker_restart, release_drop, release_delay, "
        "unavailable, pool, corrupt (default: all)",
    )
    parser.add_argument("--seed", type=int, default=1, help="seed of the fault schedule and the inputs (default: 1)")
    parser.add_argument(
        "--load",
        action="store_true",
        help="closed-loop load run: no faults, clients split over the rdma and inline planes",
    )
    parser.add_argument(
        "--planes", default=None, help="client modes, comma list of auto, grpc (default: auto; with --load: auto,grpc)"
    )
    parser.add_argument(
        "--gc-timeout-ms",
        type=int,
        default=3000,
        help="how long the workers keep an unreleased lease before reclaiming it "
        "(their --rdma-slot-gc-timeout-ms) (default: 3000)",
    )
    parser.add_argument("--progress-s", type=float, default=5.0, help="progress line period (default: 5)")
    parser.add_argument(
        "--verbose",
        action="store_true",
        help="keep tensorwire's warnings (every fallback, GC reclaim, relay fault) on stderr",
    )
    parser.add_argument("--json", action="store_true", help="print the report as one JSON object")
    parser.add_argument(
        "--save",
        nargs="?",
        const="",
        default=None,
        metavar="PATH",
        help="also write the JSON under benchmarks/results/ (soak-<machine>.json or load-...)",
    )


def run(args: argparse.Namespace) -> int:
    import json

    from tensorwire.errors import ConfigError
    from tensorwire.soak._config import SoakConfig, parse_faults
    from tensorwire.soak._report import format_report
    from tensorwire.soak._runner import run_soak

    try:
        faults = () if args.load else parse_faults(args.faults)
        planes_text = args.planes or ("auto,grpc" if args.load else "auto")
        planes = tuple(p.strip() for p in planes_text.split(",") if p.strip())
        cfg = SoakConfig(
            duration_s=args.duration,
            concurrency=args.concurrency,
            client_processes=args.client_processes,
            faults=faults,
            seed=args.seed,
            planes=planes,
            slot_gc_timeout_ms=args.gc_timeout_ms,
            progress_s=args.progress_s,
        )
    except ConfigError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    import logging
    import os

    if not args.verbose:  # under injected faults every degrade logs a warning; the report counts them instead
        logging.getLogger("tensorwire").setLevel(logging.ERROR)
    else:
        os.environ["TENSORWIRE_SOAK_CHILD_LOG_LEVEL"] = "WARNING"

    def say(message: str) -> None:
        print(message, file=sys.stderr, flush=True)

    try:
        report = run_soak(cfg, say=say)
    except KeyboardInterrupt:
        say("interrupted; children stopped")
        return 130
    report["mode"] = "load" if args.load else "soak"
    if args.save is not None:
        from tensorwire._results import write_result

        path = write_result(report["mode"], report, out=args.save or None)
        say(f"wrote {path}")
    if args.json:
        print(json.dumps(report, default=str))
    else:
        print(format_report(report))
    return 0 if report["passed"] else 1
