"""``tensorwire serve-proxy --worker HOST:PORT ...``: one EncoderService endpoint in front of encoder workers.

At start-up the proxy asks every worker for ``WorkerInfo`` (waiting up to ``--worker-wait-s``) and refuses to
start when two workers on one host share a fixed ``--rdma-port`` (only one could bind it); the route TTL is
the workers' largest ``slot_gc_timeout_ms`` + 5 s. ``--no-check-workers`` skips this (TTL from
``--slot-gc-timeout-ms``). Prints ``READY grpc=HOST:PORT metrics=HOST:PORT workers=N``.

Health: SERVING while at least one worker answers its health probe with SERVING (``--probe-*``); per-worker
state in ``tensorwire_proxy_worker_up``. SIGTERM/SIGINT: NOT_SERVING for ``--drain-s``, then new Encodes are
refused while ReleaseLeases is still routed, in-flight calls finish within ``--grace-s``. Exit codes:
``tensorwire.service._runtime`` (3: the port is in use).

TLS (``--tls-*``, ``TENSORWIRE_MM_TLS_*``) applies to both sides: the listener (mTLS by default) and the channels to
the workers (the proxy's certificate is its client certificate there). Limits as serve-encoder's (``ServerLimits``).
A plaintext listener on a non-loopback address needs ``--insecure``; ``/metrics`` stays on loopback unless
``--metrics-host`` says otherwise (then TLS or ``--insecure``).
"""

from __future__ import annotations

import argparse
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from tensorwire.service._proxy_config import ProxyConfig

HELP = "run a proxy that spreads Encode over encoder workers and routes lease releases to their owners"

FAST_EXIT = True  # once stopped, exit without the seconds of native teardown (service._runtime.exit_now)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from tensorwire.cli import _help
    from tensorwire.cli._args import metrics_port, port
    from tensorwire.service._flags import add_flags, add_stop_flags
    from tensorwire.service._proxy_config import ProxyConfig

    parser.add_argument(
        "--worker",
        action="append",
        required=True,
        metavar="HOST:PORT",
        help="an encoder worker (repeat for each); each needs its own RDMA port, or port 0",
    )
    parser.add_argument(
        "--host",
        default="127.0.0.1",
        help="gRPC bind address (default: 127.0.0.1; 0.0.0.0 for all, then TLS or --insecure)",
    )
    parser.add_argument("--port", type=port, default=0, help="gRPC port; 0 picks a free one (default: 0)")
    parser.add_argument(
        "--metrics-port",
        type=metrics_port,
        default=0,
        help="Prometheus /metrics port; 0 picks one, -1 disables (default: 0)",
    )
    parser.add_argument(
        "--metrics-host",
        default="127.0.0.1",
        help="/metrics bind address (default: 127.0.0.1; elsewhere it needs TLS or --insecure)",
    )
    from tensorwire._grpc.limits import ServerLimits
    from tensorwire.cli.serve_encoder import add_security_arguments

    add_security_arguments(parser)
    add_flags(parser.add_argument_group("limits (ServerLimits)"), ServerLimits, help_extra=_help.LIMITS)
    add_stop_flags(parser)
    add_flags(parser, ProxyConfig, skip=("workers",), help_extra=_help.PROXY)


def build_config(args: argparse.Namespace) -> ProxyConfig:
    """ProxyConfig from flags; its TLS and limits from flags over ``TENSORWIRE_MM_TLS_*`` / ``TENSORWIRE_MM_*``."""
    import dataclasses
    import os

    from tensorwire._grpc.limits import ENV_LIMITS_PREFIX, ServerLimits
    from tensorwire._grpc.tls import ENV_TLS_PREFIX, TlsConfig
    from tensorwire.mm._config import dataclass_from_env
    from tensorwire.service._flags import flag_values
    from tensorwire.service._proxy_config import ProxyConfig

    tls = dataclasses.replace(
        dataclass_from_env(TlsConfig, ENV_TLS_PREFIX, os.environ), **flag_values(args, TlsConfig, prefix="tls_")
    )
    limits = dataclasses.replace(
        dataclass_from_env(ServerLimits, ENV_LIMITS_PREFIX, os.environ), **flag_values(args, ServerLimits)
    )
    return ProxyConfig(workers=tuple(args.worker), tls=tls, limits=limits, **flag_values(args, ProxyConfig))


def run(args: argparse.Namespace) -> int:
    import logging

    log = logging.getLogger(__name__)
    from tensorwire.errors import TensorwireError
    from tensorwire.service._flags import stop_config
    from tensorwire.service._proxy import EncoderProxy
    from tensorwire.service._runtime import (
        EXIT_USAGE,
        MetricsServer,
        exit_code_for,
        fail,
        print_ready,
        serve_metrics,
        wait_for_signal,
    )

    try:
        config = build_config(args)
        stop = stop_config(args)
    except (TensorwireError, ValueError, TypeError) as exc:
        return fail(str(exc), EXIT_USAGE)
    proxy = EncoderProxy(config, reuse_port=args.reuse_port)
    metrics: MetricsServer | None = None
    served = False  # the drain period is for peers that saw us SERVING; a failed start has none
    from tensorwire.cli._progress import Ticker, on_terminal

    try:
        try:
            with Ticker(on_terminal()) as ticker:
                if config.check_workers:
                    ticker.phase(
                        f"waiting for {len(config.workers)} worker(s) to answer WorkerInfo "
                        f"(up to {config.worker_wait_s:g} s each: {', '.join(config.workers)})"
                    )
                proxy.start(f"{args.host}:{args.port}", insecure=args.insecure)
            if args.metrics_port >= 0:
                metrics = serve_metrics(args.metrics_port, args.metrics_host, tls=config.tls, insecure=args.insecure)
        except (TensorwireError, OSError) as exc:
            return fail(str(exc), exit_code_for(exc))
        print_ready(
            grpc=f"{args.host}:{proxy.port}",
            metrics=metrics.address if metrics else "off",
            workers=len(config.workers),
            tls=config.tls.describe(),
        )
        served = True
        got = wait_for_signal()
        log.info("%s: stopping proxy (drain %.1f s, grace %.1f s)", got, stop.drain_s, stop.grace_s)
    finally:
        proxy.stop(stop.grace_s, drain_s=stop.drain_s if served else 0.0)
        if metrics is not None:
            metrics.close()
    return 0
