"""An EPD router for ``vllm serve``: multimodal chat requests go to an encoder instance, then to an LLM instance.

    python -m tensorwire.integrations.vllm_router --port 8000 \\
        --encoder http://10.0.0.5:8001 --encoder http://10.0.0.6:8001 --llm http://10.0.0.7:8100

The encoder instances run ``vllm serve`` with the tensorwire connector as ``ec_producer``, the LLM instances
with it as ``ec_consumer`` (docs/vllm.md has the commands). For each chat request with media, the router asks an
encoder instance (round-robin) for a one-token answer, takes its ``ec_transfer_params`` and sends the client's
request to an LLM instance with them, so the LLM instance reads the embeddings over ``tensorwire.rdma`` instead
of encoding. Everything else goes straight to an LLM instance. The behaviour on failures, the headers, the
metrics and the stop sequence: ``tensorwire.integrations._vllm_router.server``.

Built on aiohttp (server and client; ``pip install tensorwire[router]``; vLLM depends on it too) and
prometheus_client; vLLM is not imported. Public API: ``Router``, ``RouterConfig``, ``main``.

Exit codes (as ``tensorwire serve-encoder``): 0 after a stop by SIGTERM/SIGINT (drained or not), 2 for bad
arguments or configuration (a plaintext non-loopback ``--host`` without ``--insecure``, a missing file), 3 when
it cannot listen (port in use, address not on this host). A second signal ends the grace period at once.
"""

from __future__ import annotations

import argparse
import logging
import resource
import sys
from collections.abc import Sequence

from tensorwire.errors import ConfigError, Reason
from tensorwire.integrations._vllm_router.config import FALLBACKS, LOOPS, RouterConfig

try:
    import aiohttp  # noqa: F401
except ImportError as _exc:  # pragma: no cover - the extra is missing
    raise ImportError("the EPD router needs aiohttp: pip install 'tensorwire[router]' (vLLM installs it too)") from _exc

from tensorwire.integrations._vllm_router.server import Router

__all__ = ["Router", "RouterConfig", "main"]

EXIT_OK, EXIT_USAGE, EXIT_BIND = 0, 2, 3

_DEFAULTS = RouterConfig(encoders=("http://127.0.0.1:1",), llms=("http://127.0.0.1:1",))

_SECONDS_HELP = {
    "connect_timeout_s": "one TCP (and TLS) connect to an instance",
    "encoder_first_byte_timeout_s": "an encoder instance's answer must start within this (its answer is one "
    "token); a silent one is out until its /health probe passes",
    "encoder_timeout_s": "a whole encoder call",
    "llm_timeout_s": "each wait for the next bytes of an LLM instance's answer (status line, then every chunk)",
    "probe_interval_s": "GET /health of every instance this often",
    "probe_timeout_s": "one /health probe",
    "idle_timeout_s": "a client connection without a complete request head for this long is closed (idle "
    "keep-alive, or headers sent too slowly)",
    "body_timeout_s": "reading one request body",
    "write_timeout_s": "each write to a client that stopped reading",
    "upstream_keepalive_s": "an idle pooled connection to an instance is closed after this (keep it below the "
    "instances' own keep-alive timeout: uvicorn's is 5 s)",
    "drain_s": "on SIGTERM/SIGINT, /health answers 503 this long while requests are still served",
    "grace_s": "then the listener closes and running requests and streams get this long to finish",
}


def _parser() -> argparse.ArgumentParser:
    d = _DEFAULTS
    ap = argparse.ArgumentParser(
        prog="python -m tensorwire.integrations.vllm_router",
        description="EPD router: encoder instances, then LLM instances (docs/vllm.md)",
    )
    ap.add_argument(
        "--encoder",
        action="append",
        required=True,
        metavar="URL",
        help="an encoder instance (vllm serve ... ec_producer), http(s)://host:port; repeat for several (round-robin)",
    )
    ap.add_argument(
        "--llm",
        action="append",
        required=True,
        metavar="URL",
        help="an LLM instance (vllm serve ... ec_consumer); repeat for several (round-robin)",
    )
    ap.add_argument(
        "--host",
        default=d.host,
        help=f"listen address (default {d.host}; elsewhere it needs --tls-cert/--tls-key or --insecure)",
    )
    ap.add_argument("--port", type=int, default=d.port, help=f"listen port (default {d.port}; 0: any)")
    for name, text in _SECONDS_HELP.items():
        ap.add_argument(
            "--" + name.replace("_", "-"),
            type=float,
            default=getattr(d, name),
            help=f"{text} (default {getattr(d, name):g})",
        )
    ap.add_argument(
        "--fallback",
        choices=FALLBACKS,
        default=d.fallback,
        help="no encoder instance answered: 'local' sends the request on (the LLM instance encodes), "
        f"'fail' answers 503 (default {d.fallback})",
    )
    ap.add_argument(
        "--max-body-bytes",
        type=int,
        default=d.max_body_bytes,
        help=f"largest client request body (default {d.max_body_bytes})",
    )
    ap.add_argument(
        "--max-connections",
        type=int,
        default=d.max_connections,
        help=f"open client connections; one more is answered 503 and closed (default {d.max_connections})",
    )
    ap.add_argument(
        "--backlog",
        type=int,
        default=d.backlog,
        help=f"listen queue (default {d.backlog}; the kernel caps it at net.core.somaxconn)",
    )
    ap.add_argument(
        "--upstream-connections",
        type=int,
        default=d.upstream_connections,
        help=f"pooled connections per instance (default {d.upstream_connections})",
    )
    ap.add_argument(
        "--upstream-ca",
        default="",
        metavar="PEM",
        help="CA bundle that verifies https instances (default: the system CAs)",
    )
    ap.add_argument("--upstream-cert", default="", metavar="PEM", help="client certificate for https instances")
    ap.add_argument("--upstream-key", default="", metavar="PEM", help="key of --upstream-cert")
    ap.add_argument("--tls-cert", default="", metavar="PEM", help="serve HTTPS with this certificate chain")
    ap.add_argument("--tls-key", default="", metavar="PEM", help="key of --tls-cert")
    ap.add_argument(
        "--insecure", action="store_true", help="allow plaintext on a non-loopback --host (a network you trust)"
    )
    ap.add_argument("--loop", choices=LOOPS, default=d.loop, help="event loop (default auto: uvloop when installed)")
    ap.add_argument("--log-level", default="INFO")
    return ap


def _raise_fd_limit() -> None:
    """Every client connection and every pooled upstream one is a file descriptor: the soft limit to the hard."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < hard:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
        except (ValueError, OSError):
            pass


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    seconds = {name: getattr(args, name) for name in _SECONDS_HELP}
    try:
        config = RouterConfig(
            encoders=tuple(args.encoder),
            llms=tuple(args.llm),
            host=args.host,
            port=args.port,
            fallback=args.fallback,
            max_body_bytes=args.max_body_bytes,
            max_connections=args.max_connections,
            backlog=args.backlog,
            upstream_connections=args.upstream_connections,
            upstream_ca=args.upstream_ca,
            upstream_cert=args.upstream_cert,
            upstream_key=args.upstream_key,
            tls_cert=args.tls_cert,
            tls_key=args.tls_key,
            insecure=args.insecure,
            loop=args.loop,
            **seconds,
        )
        _raise_fd_limit()
        router = Router(config)
    except ConfigError as exc:
        print(f"vllm_router: {exc}", file=sys.stderr)
        return EXIT_BIND if exc.reason is Reason.BIND_FAILED else EXIT_USAGE
    try:
        router.run(on_ready=lambda: print(f"vllm_router listening on {router.address}", flush=True), signals=True)
    finally:
        router.close()
    return EXIT_OK


if __name__ == "__main__":
    sys.exit(main())
