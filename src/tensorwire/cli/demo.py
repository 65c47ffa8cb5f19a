"""``tensorwire demo`` (what ``make demo`` runs): the EPD experiment on loopback, end to end.

Starts two ``serve-encoder`` workers and a ``serve-proxy`` in front of them as subprocesses (ports from the
OS), then sends the sample images shipped in the package through the proxy twice per round: once on the RDMA
plane (``mode=auto``) and once inline (``mode=grpc``). Prints the stage table (encoder compute, output
transfer, total; mean ± sd per plane) for the 2048x1365 image, a line per other image, and checks that both
planes delivered the same tensors. ``--json`` prints the numbers instead; ``--save`` also writes them under
benchmarks/results/. Every child runs in its own process group and is stopped in ``finally`` (also on Ctrl-C or
SIGTERM: all at once, SIGTERM then SIGKILL after a bounded wait; a second Ctrl-C does not cut that short); a demo
killed without that chance (SIGKILL) takes its children with it through their lifeline (``tensorwire._lifeline``).

The children are ``tensorwire.service._child.LoopbackDeployment``; what is measured and how the table reads
(the stage definitions) is ``tensorwire.cli._measure``. Exit codes: 0 done, 1 the demo failed (the children's last
log lines on stderr), 2 bad arguments, 130 interrupted.
"""

from __future__ import annotations

import argparse
import signal
import sys
import time

HELP = "run the encoder -> LLM demo on loopback: two encoder workers, a proxy, both planes, a table"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from tensorwire.cli._args import device

    parser.add_argument("--rounds", type=int, default=8, help="measured rounds over all images (default: 8)")
    parser.add_argument("--warmup", type=int, default=2, help="unmeasured rounds first (default: 2)")
    parser.add_argument("--workers", type=int, default=2, help="encoder workers behind the proxy (default: 2)")
    parser.add_argument(
        "--device",
        type=device,
        default="cpu",
        help="encoder device of the workers and where RDMA reads land: cpu or cuda:N (default: cpu)",
    )
    parser.add_argument(
        "--images",
        nargs="*",
        default=None,
        help="image files to send through the proxy (default: the sample images shipped in the package)",
    )
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of the table")
    parser.add_argument(
        "--save",
        nargs="?",
        const="",
        default=None,
        metavar="PATH",
        help="also write the JSON result (default path: benchmarks/results/demo-<machine>.json)",
    )
    parser.add_argument(
        "--startup-timeout-s",
        type=float,
        default=90.0,
        help="how long each child may take to print READY (default: 90)",
    )
    parser.add_argument("--no-progress", action="store_true", help="no progress bar on stderr")


def run(args: argparse.Namespace) -> int:
    import json
    import tempfile
    from pathlib import Path

    from tensorwire.cli._args import device_problem
    from tensorwire.cli._measure import measure, table
    from tensorwire.encoder import sample_paths
    from tensorwire.service._child import LoopbackDeployment
    from tensorwire.service._runtime import stdout_to_stderr

    if args.rounds < 1 or args.warmup < 0 or args.workers < 1:
        print("error: --rounds >= 1, --warmup >= 0, --workers >= 1", file=sys.stderr)
        return 2
    problem = device_problem(args.device)  # before any child starts: never a silent CPU run
    if problem:
        print(f"error: --device: {problem}", file=sys.stderr)
        return 2
    images = [Path(p) for p in args.images] if args.images else sample_paths()
    missing = [str(p) for p in images if not p.is_file()]
    if missing:
        print(f"error: not files: {missing}", file=sys.stderr)
        return 2
    t_start = time.monotonic()
    stops = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)

    def interrupted(signum: int, _frame: object) -> None:
        for sig in stops:  # one interruption: a second Ctrl-C must not cut the clean-up short
            signal.signal(sig, signal.SIG_IGN)
        raise KeyboardInterrupt(signal.Signals(signum).name)

    # SIGTERM/SIGHUP take the same path as Ctrl-C, so the finally below still stops the children.
    previous = {s: signal.signal(s, interrupted) for s in stops}
    interrupted_once = False
    log_dir = Path(tempfile.mkdtemp(prefix="tensorwire-demo-"))
    deployment = LoopbackDeployment(args.workers, args.device, log_dir)

    def say(message: str) -> None:  # progress on stderr; --json keeps both streams quiet but for the result
        if not args.json:
            print(message, file=sys.stderr, flush=True)

    try:
        say(f"starting {args.workers} encoder workers and a proxy (logs in {log_dir}) ...")
        deployment.start(args.startup_timeout_s)
        startup_s = time.monotonic() - t_start
        say(
            f"ready after {startup_s:.1f} s: proxy {deployment.proxy_address} -> workers "
            f"{', '.join(deployment.worker_addresses)} (pids {' '.join(str(c.proc.pid) for c in deployment.children)})"
        )
        with stdout_to_stderr():
            result = measure(
                deployment.proxy_address,
                images,
                args.rounds,
                args.warmup,
                progress=not args.no_progress and not args.json,
                device=args.device,
            )
        result.update(
            workers=args.workers, rounds=args.rounds, warmup=args.warmup, startup_s=startup_s, device=args.device
        )
    except KeyboardInterrupt:
        say("interrupted; stopping children")
        interrupted_once = True
        return 130
    except Exception as exc:  # report, then clean up the children
        print(f"error: demo failed: {type(exc).__name__}: {exc}", file=sys.stderr)
        for c in deployment.children:
            print(f"--- last lines of {c.name} ({c.log_path}):\n{c.tail()}", file=sys.stderr)
        return 1
    finally:
        for sig in stops:
            signal.signal(sig, signal.SIG_IGN)
        codes = deployment.stop()
        if not interrupted_once:
            # After an interruption the stop signals stay ignored until the process ends: a second Ctrl-C that
            # lands after the clean-up would otherwise raise KeyboardInterrupt on the way out, and the process
            # would end by SIGINT instead of exit code 130.
            for sig, handler in previous.items():
                signal.signal(sig, handler)
    result["child_exit_codes"] = codes
    result["child_pids"] = {c.name: c.proc.pid for c in deployment.children}
    result["wall_s"] = time.monotonic() - t_start
    if args.save is not None:
        from tensorwire._results import write_result

        path = write_result("demo", result, out=args.save or None)
        say(f"wrote {path}")
    if args.json:
        print(json.dumps(result))
    else:
        print(table(result))
        print(f"(wall time {result['wall_s']:.1f} s including start-up; children exited {codes})")
    return 0 if result["outputs_match"] else 1
