"""``tensorwire serve-encoder``: a vision-encoder worker (EncoderService + health + WorkerInfo + /metrics).

Transport flags come from ``TransportConfig``'s fields, RDMA flags (``--rdma-*``) from ``RdmaConfig``'s, TLS flags
(``--tls-*``) from ``TlsConfig``'s, limit flags from ``ServerLimits``' and ``ImageLimits``' fields, so defaults
live in the dataclasses; precedence is flag > environment (``MM_TRANSPORT_MODE``, ``TENSORWIRE_MM_*``,
``TENSORWIRE_MM_RDMA_*``, ``TENSORWIRE_MM_TLS_*``, ``TENSORWIRE_WORKER_*``) > default.

Start-up: the port is bound first (a port in use is exit code 3 before any model is loaded), health answers
NOT_SERVING while the model loads, then SERVING, and ``READY grpc=HOST:PORT metrics=HOST:PORT worker_id=ID
mode=MODE`` is printed. SIGTERM/SIGINT: NOT_SERVING for ``--drain-s``, then new Encodes are refused, in-flight ones
finish and their exported leases are released (readers can still read them) within ``--grace-s``, then the exporter
closes. A second signal ends the process at once. Exit codes: ``tensorwire.service._runtime``.

Security (docs/security.md): without a certificate the gRPC listener and ``/metrics`` stay on loopback unless
``--insecure`` is given; ``/metrics`` binds 127.0.0.1 unless ``--metrics-host`` says otherwise, and is served
with the gRPC certificate (client certificates required under mTLS) when it leaves the loopback.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from tensorwire.mm import TransportConfig
    from tensorwire.service._images import ImageLimits

HELP = "run a vision-encoder worker (gRPC EncoderService, health, Prometheus /metrics)"

FAST_EXIT = True  # once stopped, exit without the seconds of native teardown (service._runtime.exit_now)

# TransportConfig fields only the LLM side reads; an encoder flag for them would do nothing.
_CLIENT_ONLY = (
    "rpc_timeout_margin_ms",
    "fallback_reserve_ms",
    "min_fallback_ms",
    "release_timeout_ms",
    "release_queue_max",
    "release_shutdown_ms",
    "failures_to_open",
    "open_seconds",
    "control_stream",
    "control_stream_pool",
    "local_channel_wait_ms",
)


def add_security_arguments(parser: argparse.ArgumentParser) -> None:
    """``--tls-*`` (TlsConfig) and ``--insecure``; shared by serve-encoder, serve-proxy and fetch."""
    from tensorwire._grpc.tls import TlsConfig
    from tensorwire.cli import _help
    from tensorwire.service._flags import add_flags

    tls = parser.add_argument_group("TLS (TlsConfig; docs/security.md)")
    add_flags(tls, TlsConfig, prefix="tls_", help_extra=_help.TLS)
    tls.add_argument(
        "--insecure",
        action="store_true",
        help="allow a plaintext listener on a non-loopback address (a network you trust)",
    )


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from tensorwire._grpc.limits import ServerLimits
    from tensorwire.cli import _help
    from tensorwire.cli._args import device, metrics_port, port
    from tensorwire.mm import MODES, TransportConfig
    from tensorwire.rdma import RdmaConfig
    from tensorwire.service._flags import add_flags, add_stop_flags
    from tensorwire.service._images import ImageLimits

    parser.add_argument("--host", default="127.0.0.1", help="gRPC bind address (default: 127.0.0.1; 0.0.0.0 for all)")
    parser.add_argument("--port", type=port, default=0, help="gRPC port; 0 picks a free one (default: 0)")
    parser.add_argument(
        "--metrics-port",
        type=metrics_port,
        default=0,
        help="Prometheus /metrics port; 0 picks a free one, -1 disables (default: 0)",
    )
    parser.add_argument(
        "--metrics-host",
        default="127.0.0.1",
        help="/metrics bind address (default: 127.0.0.1; elsewhere it needs TLS or --insecure)",
    )
    parser.add_argument(
        "--device",
        type=device,
        default="cpu",
        help="where the encoder runs and its output is exported from: cpu or cuda:N (default: cpu)",
    )
    parser.add_argument(
        "--model",
        default="builtin",
        help="'builtin' (seeded small ViT) or a local Hugging Face model directory: safetensors "
        "weights and its preprocessor_config.json, never downloaded (default: builtin)",
    )
    add_stop_flags(parser)
    parser.add_argument(
        "--wait-exporter-s",
        type=float,
        default=0.0,
        help="before READY, wait this long for the RDMA exporter (default: 0, build in background)",
    )
    add_security_arguments(parser)
    limits = parser.add_argument_group("limits (ServerLimits, ImageLimits)")
    add_flags(limits, ServerLimits, help_extra=_help.LIMITS)
    add_flags(limits, ImageLimits, help_extra=_help.IMAGES)
    transport = parser.add_argument_group("transport (TransportConfig)")
    add_flags(
        transport, TransportConfig, skip=("rdma", *_CLIENT_ONLY), choices={"mode": MODES}, help_extra=_help.TRANSPORT
    )
    rdma = parser.add_argument_group("RDMA data plane (RdmaConfig)")
    # control_host is not a flag: the worker sets it to --host (where the metadata endpoint follows).
    add_flags(
        rdma,
        RdmaConfig,
        prefix="rdma_",
        skip=("control_host",),
        help_extra=_help.RDMA,
        types={"port": port, "device": device},
    )


def build_config(args: argparse.Namespace) -> TransportConfig:
    """TransportConfig from flags over the environment over defaults."""
    from tensorwire._grpc.limits import ServerLimits
    from tensorwire._grpc.tls import TlsConfig
    from tensorwire.mm import TransportConfig
    from tensorwire.mm._config import NESTED
    from tensorwire.rdma import RdmaConfig
    from tensorwire.service._flags import flag_values

    base = TransportConfig.from_env(os.environ)
    rdma_flags = flag_values(args, RdmaConfig, prefix="rdma_")
    if "device" not in rdma_flags and not os.environ.get("TENSORWIRE_MM_RDMA_DEVICE"):
        rdma_flags["device"] = args.device  # slots live where the encoder writes its output
    transport_flags = flag_values(args, TransportConfig)
    for name in NESTED:
        transport_flags.pop(name, None)
    return dataclasses.replace(
        base,
        **transport_flags,
        rdma=base.rdma.replace(**rdma_flags),
        tls=dataclasses.replace(base.tls, **flag_values(args, TlsConfig, prefix="tls_")),
        limits=dataclasses.replace(base.limits, **flag_values(args, ServerLimits)),
    )


def build_image_limits(args: argparse.Namespace) -> ImageLimits:
    """ImageLimits from flags over ``TENSORWIRE_WORKER_*`` over defaults."""
    from tensorwire.mm._config import dataclass_from_env
    from tensorwire.service._flags import flag_values
    from tensorwire.service._images import ENV_IMAGE_PREFIX, ImageLimits

    base: ImageLimits = dataclass_from_env(ImageLimits, ENV_IMAGE_PREFIX, os.environ)
    return dataclasses.replace(base, **flag_values(args, ImageLimits))


def run(args: argparse.Namespace) -> int:
    import logging

    log = logging.getLogger(__name__)
    from tensorwire.cli._args import device_problem
    from tensorwire.encoder import load_encoder
    from tensorwire.errors import TensorwireError
    from tensorwire.mm._metrics import LLM_ONLY
    from tensorwire.service._flags import stop_config
    from tensorwire.service._runtime import (
        EXIT_USAGE,
        MetricsServer,
        exit_code_for,
        fail,
        print_ready,
        serve_metrics,
        wait_for_signal,
    )
    from tensorwire.service._worker import EncoderWorker

    try:
        config = build_config(args)
        image_limits = build_image_limits(args)
        stop = stop_config(args)
    except (TensorwireError, ValueError) as exc:
        return fail(str(exc), EXIT_USAGE)
    # A device this process lacks is an error before the port is bound or a model loaded, never a CPU run.
    for flag, name in (("--device", args.device), ("--rdma-device", config.rdma.device)):
        problem = device_problem(name)
        if problem:
            return fail(f"{flag}: {problem}", EXIT_USAGE)
    log.info("effective config: %s; %s", config, image_limits)
    # What the RDMA plane advertises (and the warnings when other hosts could not reach it) is shown by default.
    endpoint_log = logging.getLogger("tensorwire.rdma.endpoint")
    if endpoint_log.getEffectiveLevel() > logging.INFO:
        endpoint_log.setLevel(logging.INFO)
    metrics: MetricsServer | None = None
    served = False  # the drain period is for peers that saw us SERVING; a failed start has none
    worker = EncoderWorker.loading(
        lambda: load_encoder(args.model, device=args.device),
        config,
        device=args.device,
        model=args.model,
        reuse_port=args.reuse_port,
        image_limits=image_limits,
    )
    try:
        try:
            worker.start(f"{args.host}:{args.port}", insecure=args.insecure)
            if args.metrics_port >= 0:
                metrics = serve_metrics(
                    args.metrics_port, args.metrics_host, tls=config.tls, insecure=args.insecure, exclude=LLM_ONLY
                )
            log.info("listening on %s, NOT_SERVING while model %s loads", worker.address, args.model)
            worker.load()
        except (TensorwireError, ValueError, OSError) as exc:
            return fail(str(exc), exit_code_for(exc))
        if args.wait_exporter_s > 0 and not worker.wait_ready(args.wait_exporter_s):
            log.warning("RDMA exporter not ready after %.1f s; serving inline until it is", args.wait_exporter_s)
        print_ready(
            grpc=worker.address,
            metrics=metrics.address if metrics else "off",
            worker_id=worker.worker_id,
            mode=config.mode,
            model=args.model,
            tls=config.tls.describe(),
        )
        served = True
        got = wait_for_signal()
        log.info("%s: stopping (drain %.1f s, grace %.1f s)", got, stop.drain_s, stop.grace_s)
    finally:
        worker.stop(stop.grace_s, drain_s=stop.drain_s if served else 0.0)
        if metrics is not None:
            metrics.close()
    return 0
