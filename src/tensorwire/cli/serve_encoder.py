"""``tensorwire serve-encoder``: a vision-encoder worker (EncoderService + health + WorkerInfo + /metrics).

Transport flags come from ``TransportConfig``'s fields and RDMA flags (``--rdma-*``) from ``RdmaConfig``'s, so
defaults live in the dataclasses; precedence is flag > environment (``MM_TRANSPORT_MODE``,
``TENSORWIRE_MM_*``, ``TENSORWIRE_MM_RDMA_*``) > default. Prints ``READY grpc=HOST:PORT metrics=HOST:PORT
worker_id=ID mode=MODE`` once serving; SIGTERM/SIGINT stop accepting, finish in-flight calls within
``--grace-s``, then close the exporter.
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import os
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from tensorwire.mm import TransportConfig

HELP = "run a vision-encoder worker (gRPC EncoderService, health, Prometheus /metrics)"

log = logging.getLogger(__name__)

# TransportConfig fields only the LLM side reads; an encoder flag for them would do nothing.
_CLIENT_ONLY = ("rpc_timeout_margin_ms", "fallback_reserve_ms", "min_fallback_ms", "release_timeout_ms",
                "release_queue_max", "release_shutdown_ms", "failures_to_open", "open_seconds", "control_stream",
                "control_stream_pool")

_RDMA_HELP = {
    "port": "RDMA metadata listener port; 0 lets the OS pick. Behind a proxy every worker on a host needs its "
            "own port (the proxy refuses a shared fixed port at start-up)",
    "device": "device of the exported slots (default: --device)",
    "bind_ip": "RDMA metadata listener address; '' follows --host (a wildcard --host: this host's detected "
               "address); 0.0.0.0 listens on all interfaces (docs/deployment.md, Addresses)",
    "advertise_host": "host written into descriptors, which readers connect to; '' = the listener's address, "
                      "else --host, else this host's detected address",
    "provider": "auto | nixl | none",
}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from tensorwire.mm import MODES, TransportConfig
    from tensorwire.rdma import RdmaConfig
    from tensorwire.service._flags import add_flags

    parser.add_argument("--host", default="127.0.0.1", help="gRPC bind address (default: 127.0.0.1; 0.0.0.0 for all)")
    parser.add_argument("--port", type=int, default=0, help="gRPC port; 0 picks a free one (default: 0)")
    parser.add_argument("--metrics-port", type=int, default=0,
                        help="Prometheus /metrics port; 0 picks a free one, -1 disables (default: 0)")
    parser.add_argument("--metrics-host", default=None, help="/metrics bind address (default: --host)")
    parser.add_argument("--device", default="cpu", help="encoder device: cpu or cuda:N (default: cpu)")
    parser.add_argument("--model", default="builtin",
                        help="'builtin' (seeded small ViT) or a local Hugging Face model directory (default: builtin)")
    parser.add_argument("--grace-s", type=float, default=10.0,
                        help="seconds in-flight requests get to finish on SIGTERM (default: 10)")
    parser.add_argument("--wait-exporter-s", type=float, default=0.0,
                        help="before READY, wait this long for the RDMA exporter (default: 0, build in background)")
    transport = parser.add_argument_group("transport (TransportConfig)")
    add_flags(transport, TransportConfig, skip=("rdma", *_CLIENT_ONLY), choices={"mode": MODES},
              help_extra={"mode": "auto: RDMA when the client can read it, else inline; grpc: always inline "
                                  "(the one-switch rollback)"})
    rdma = parser.add_argument_group("RDMA data plane (RdmaConfig)")
    # control_host is not a flag: the worker sets it to --host (where the metadata endpoint follows).
    add_flags(rdma, RdmaConfig, prefix="rdma_", skip=("control_host",), help_extra=_RDMA_HELP)


def build_config(args: argparse.Namespace) -> TransportConfig:
    """TransportConfig from flags over the environment over defaults."""
    from tensorwire.mm import TransportConfig
    from tensorwire.rdma import RdmaConfig
    from tensorwire.service._flags import flag_values

    base = TransportConfig.from_env(os.environ)
    rdma_flags = flag_values(args, RdmaConfig, prefix="rdma_")
    if "device" not in rdma_flags and not os.environ.get("TENSORWIRE_MM_RDMA_DEVICE"):
        rdma_flags["device"] = args.device  # slots live where the encoder writes its output
    transport_flags = flag_values(args, TransportConfig)
    transport_flags.pop("rdma", None)
    return dataclasses.replace(base, **transport_flags, rdma=base.rdma.replace(**rdma_flags))


def run(args: argparse.Namespace) -> int:
    from tensorwire.encoder import load_encoder
    from tensorwire.errors import TensorwireError
    from tensorwire.service._runtime import MetricsServer, fail, print_ready, wait_for_signal
    from tensorwire.service._worker import EncoderWorker

    try:
        config = build_config(args)
        encoder = load_encoder(args.model, device=args.device)
    except (TensorwireError, ValueError) as exc:
        return fail(str(exc), 2)
    log.info("effective config: %s", config)
    # What the RDMA plane advertises (and the warnings when other hosts could not reach it) is shown by default.
    endpoint_log = logging.getLogger("tensorwire.rdma.endpoint")
    if endpoint_log.getEffectiveLevel() > logging.INFO:
        endpoint_log.setLevel(logging.INFO)
    metrics = None
    worker = EncoderWorker(encoder, config, model=args.model)
    try:
        try:
            worker.start(f"{args.host}:{args.port}")
            if args.metrics_port >= 0:
                metrics = MetricsServer(args.metrics_port, args.metrics_host or args.host)
        except (TensorwireError, OSError) as exc:
            return fail(str(exc), 1)
        if args.wait_exporter_s > 0 and not worker.wait_ready(args.wait_exporter_s):
            log.warning("RDMA exporter not ready after %.1f s; serving inline until it is", args.wait_exporter_s)
        print_ready(grpc=worker.address, metrics=metrics.address if metrics else "off",
                    worker_id=worker.worker_id, mode=config.mode, model=args.model)
        got = wait_for_signal()
        log.info("%s: stopping (grace %.1f s)", got, args.grace_s)
    finally:
        worker.stop(args.grace_s)
        if metrics is not None:
            metrics.close()
    return 0
