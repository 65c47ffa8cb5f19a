"""An EPD router for ``vllm serve``: multimodal chat requests go to an encoder instance, then to an LLM instance.

    python -m tensorwire.integrations.vllm_router --port 8000 \\
        --encoder http://10.0.0.5:8001 --encoder http://10.0.0.6:8001 --llm http://10.0.0.7:8100

The encoder instances run ``vllm serve`` with the tensorwire connector as ``ec_producer``, the LLM instances
with it as ``ec_consumer`` (docs/vllm.md has the commands). For each chat request with media, the router asks an
encoder instance (round-robin) for a one-token answer, takes its ``ec_transfer_params`` and sends the client's
request to an LLM instance with them, so the LLM instance reads the embeddings over ``tensorwire.rdma`` instead
of encoding. Everything else goes straight to an LLM instance. The behaviour on failures, the headers and the
metrics: ``tensorwire.integrations._vllm_router.server``.

Standard library only (plus prometheus_client, a tensorwire dependency); vLLM is not imported.
Public API: ``Router``, ``RouterConfig``, ``main``.
"""

from __future__ import annotations

import argparse
import logging
import signal
import sys
import threading
from collections.abc import Sequence
from types import FrameType

from tensorwire.errors import ConfigError
from tensorwire.integrations._vllm_router.config import FALLBACKS, RouterConfig
from tensorwire.integrations._vllm_router.server import Router

__all__ = ["Router", "RouterConfig", "main"]

_DEFAULTS = RouterConfig(encoders=("http://127.0.0.1:1",), llms=("http://127.0.0.1:1",))


def _parser() -> argparse.ArgumentParser:
    d = _DEFAULTS
    ap = argparse.ArgumentParser(prog="python -m tensorwire.integrations.vllm_router",
                                 description="EPD router: encoder instances, then LLM instances (docs/vllm.md)")
    ap.add_argument("--encoder", action="append", required=True, metavar="URL",
                    help="an encoder instance (vllm serve ... ec_producer), http://host:port; repeat for several "
                         "(round-robin)")
    ap.add_argument("--llm", action="append", required=True, metavar="URL",
                    help="an LLM instance (vllm serve ... ec_consumer); repeat for several (round-robin)")
    ap.add_argument("--host", default=d.host, help=f"listen address (default {d.host}; 0.0.0.0 for all)")
    ap.add_argument("--port", type=int, default=d.port, help=f"listen port (default {d.port}; 0: any)")
    ap.add_argument("--connect-timeout-s", type=float, default=d.connect_timeout_s,
                    help=f"one TCP connect to an instance (default {d.connect_timeout_s:g})")
    ap.add_argument("--encoder-timeout-s", type=float, default=d.encoder_timeout_s,
                    help=f"a whole encoder call (default {d.encoder_timeout_s:g})")
    ap.add_argument("--llm-timeout-s", type=float, default=d.llm_timeout_s,
                    help=f"a non-streamed LLM answer, or each chunk of a streamed one (default {d.llm_timeout_s:g})")
    ap.add_argument("--encoder-cooldown-s", type=float, default=d.encoder_cooldown_s,
                    help=f"a failed instance is tried last for this long (default {d.encoder_cooldown_s:g})")
    ap.add_argument("--fallback", choices=FALLBACKS, default=d.fallback,
                    help="no encoder instance answered: 'local' sends the request on (the LLM instance encodes), "
                         f"'fail' answers 503 (default {d.fallback})")
    ap.add_argument("--max-body-bytes", type=int, default=d.max_body_bytes,
                    help=f"largest client request body (default {d.max_body_bytes})")
    ap.add_argument("--log-level", default="INFO")
    return ap


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        config = RouterConfig(encoders=tuple(args.encoder), llms=tuple(args.llm), host=args.host, port=args.port,
                              connect_timeout_s=args.connect_timeout_s, encoder_timeout_s=args.encoder_timeout_s,
                              llm_timeout_s=args.llm_timeout_s, encoder_cooldown_s=args.encoder_cooldown_s,
                              fallback=args.fallback, max_body_bytes=args.max_body_bytes)
        router = Router(config)
    except ConfigError as exc:
        print(f"vllm_router: {exc}", file=sys.stderr)
        return 2
    except OSError as exc:
        print(f"vllm_router: cannot listen on {args.host}:{args.port}: {exc}", file=sys.stderr)
        return 1
    stop = threading.Event()

    def _on_signal(signum: int, frame: FrameType | None) -> None:
        stop.set()

    signal.signal(signal.SIGTERM, _on_signal)
    signal.signal(signal.SIGINT, _on_signal)
    with router:
        print(f"vllm_router listening on {router.address}", flush=True)
        stop.wait()
    return 0


if __name__ == "__main__":
    sys.exit(main())
