"""``tensorwire serve-proxy --worker HOST:PORT ...``: one EncoderService endpoint in front of encoder workers.

At start-up the proxy asks every worker for ``WorkerInfo`` (waiting up to ``--worker-wait-s``) and refuses to
start when two workers on one host share a fixed ``--rdma-port`` (only one could bind it); the route TTL is
the workers' largest ``slot_gc_timeout_ms`` + 5 s. ``--no-check-workers`` skips this (TTL from
``--slot-gc-timeout-ms``). Prints ``READY grpc=HOST:PORT metrics=HOST:PORT workers=N``.
"""

from __future__ import annotations

import argparse
import logging

HELP = "run a proxy that spreads Encode over encoder workers and routes lease releases to their owners"

log = logging.getLogger(__name__)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from tensorwire.service._flags import add_flags
    from tensorwire.service._proxy import ProxyConfig

    parser.add_argument("--worker", action="append", required=True, metavar="HOST:PORT",
                        help="an encoder worker (repeat for each); each needs its own RDMA port, or port 0")
    parser.add_argument("--host", default="127.0.0.1", help="bind address (default: 127.0.0.1)")
    parser.add_argument("--port", type=int, default=0, help="gRPC port; 0 picks a free one (default: 0)")
    parser.add_argument("--metrics-port", type=int, default=0,
                        help="Prometheus /metrics port; 0 picks one, -1 disables (default: 0)")
    parser.add_argument("--grace-s", type=float, default=10.0, help="drain time on SIGTERM (default: 10)")
    add_flags(parser, ProxyConfig, skip=("workers",), help_extra={
        "max_attempts": "workers tried per Encode; 0 = every worker once",
        "check_workers": "ask workers for WorkerInfo at start-up (RDMA port check, route TTL)",
        "slot_gc_timeout_ms": "workers' lease GC timeout, for the route TTL when workers are not asked",
    })


def run(args: argparse.Namespace) -> int:
    from tensorwire.errors import TensorwireError
    from tensorwire.service._flags import flag_values
    from tensorwire.service._proxy import EncoderProxy, ProxyConfig
    from tensorwire.service._runtime import MetricsServer, fail, print_ready, wait_for_signal

    try:
        config = ProxyConfig(workers=tuple(args.worker), **flag_values(args, ProxyConfig))
    except (TensorwireError, ValueError, TypeError) as exc:
        return fail(str(exc), 2)
    proxy = EncoderProxy(config)
    metrics = None
    try:
        try:
            proxy.start(f"{args.host}:{args.port}")
            if args.metrics_port >= 0:
                metrics = MetricsServer(args.metrics_port, args.host)
        except (TensorwireError, OSError) as exc:
            return fail(str(exc), 1)
        print_ready(grpc=f"{args.host}:{proxy.port}", metrics=metrics.address if metrics else "off",
                    workers=len(config.workers))
        got = wait_for_signal()
        log.info("%s: stopping proxy (grace %.1f s)", got, args.grace_s)
    finally:
        proxy.stop(args.grace_s)
        if metrics is not None:
            metrics.close()
    return 0
