"""``tensorwire fetch --endpoint HOST:PORT [--json] IMAGE...``: the LLM side, for trying a deployment by hand.

Sends all images in one request through ``RemoteOutputTransport`` (RDMA when both sides can, inline otherwise)
and prints, per image, the embedding shape and dtype, then the plane used and the stage times. ``--json`` prints
one object, also on failure; its keys are in ``EPILOG`` (``tensorwire fetch --help``), in
``tensorwire.cli._measure`` (which builds it) and in docs/deployment.md.
Exit codes: 0 ok, 1 the fetch failed, 2 bad arguments, unreadable files or a device this process lacks (checked
before connecting), 130 interrupted.

On a terminal (and without ``--json``) a status line on stderr says what the command waits for (the RDMA reader,
the answer) and for how long; the text output ends with the command's wall time split into start-up, the fetch
itself (whose stage times are printed) and the release hand-off and close. A connection refused for a TLS
mismatch says so and names the flags that fix it (``tensorwire._grpc.hints.tls_hint``).

TLS: ``--tls-ca`` (verify the server), ``--tls-cert``/``--tls-key`` (mTLS), ``--tls-server-name``, or the same
``TENSORWIRE_MM_TLS_*`` variables the servers read.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

from tensorwire.cli._schema import FETCH_JSON_HELP

HELP = "fetch encoder output for images from an encoder or proxy (the LLM side)"
EPILOG = FETCH_JSON_HELP + (
    "exit codes: 0 ok, 1 the fetch failed (unreachable, refused, timed out), 2 bad arguments, unreadable files or\n"
    "  a device this process lacks, 130 interrupted (Ctrl-C); 3 (port in use) is only the serve commands'\n"
)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from tensorwire.cli._args import device
    from tensorwire.mm import MODES

    parser.add_argument(
        "--endpoint", required=True, help="HOST:PORT of a serve-encoder or serve-proxy (the port is required)"
    )
    parser.add_argument(
        "--json", action="store_true", help="print one JSON object instead of text, also on failure (keys below)"
    )
    parser.add_argument(
        "--mode",
        choices=MODES,
        default=None,
        help="auto (RDMA when possible) or grpc (inline only); default: MM_TRANSPORT_MODE or auto",
    )
    parser.add_argument(
        "--device",
        type=device,
        default=None,
        help="where the embeddings land (RDMA reads write there): cpu or cuda:N; a device this "
        "process lacks is an error (default: cpu, or TENSORWIRE_MM_RDMA_DEVICE)",
    )
    parser.add_argument(
        "--timeout-ms",
        type=int,
        default=None,
        help="give up on the request after this many ms (default: the worker's budget for the "
        "images plus a margin, from TransportConfig)",
    )
    parser.add_argument(
        "--wait-reader-s",
        type=float,
        default=10.0,
        help="with --mode auto, wait up to this long for the RDMA reader to start before sending "
        "the request (else it goes inline) (default: 10)",
    )
    from tensorwire._grpc.tls import TlsConfig
    from tensorwire.cli import _help
    from tensorwire.service._flags import add_flags

    add_flags(
        parser.add_argument_group("TLS (TlsConfig; docs/security.md)"),
        TlsConfig,
        prefix="tls_",
        skip=("client_auth",),
        help_extra=_help.TLS,
    )
    parser.add_argument("images", nargs="+", metavar="IMAGE", help="image files (JPEG, PNG, ...)")


def _error(args: argparse.Namespace, exc: BaseException, code: int, hint: str | None = None) -> int:
    """Reports a failure: one JSON object with ``--json``, else one ``error:`` line on stderr (``hint`` appended)."""
    import json

    from tensorwire.cli._measure import fetch_error_document
    from tensorwire.errors import TensorwireError

    doc = fetch_error_document(exc, code, args.endpoint)
    if hint:
        doc["error"]["hint"] = hint
    if args.json:
        print(json.dumps(doc))
        return code
    err = doc["error"]
    what = f"{err['type']} ({err['reason']}): " if isinstance(exc, TensorwireError) else ""
    print(f"error: {what}{err['message']}" + (f"; {hint}" if hint else ""), file=sys.stderr)
    return code


def run(args: argparse.Namespace) -> int:
    import dataclasses
    import json
    from pathlib import Path

    from tensorwire._grpc.hints import tls_hint
    from tensorwire._grpc.tls import TlsConfig
    from tensorwire.cli import STARTED
    from tensorwire.cli._args import device_problem
    from tensorwire.cli._measure import fetch_document, fetch_lines, fetch_result
    from tensorwire.cli._progress import Ticker, on_terminal
    from tensorwire.errors import ConfigError, TensorwireError
    from tensorwire.mm import MultimodalInput, RemoteOutputTransport, TransportConfig
    from tensorwire.service._endpoint import parse_endpoint
    from tensorwire.service._flags import flag_values
    from tensorwire.service._runtime import drain_releases, stdout_to_stderr

    try:
        endpoint = str(parse_endpoint(args.endpoint, "--endpoint"))
        data = [Path(p).read_bytes() for p in args.images]
        cfg = TransportConfig.from_env(os.environ)
        cfg = dataclasses.replace(cfg, tls=dataclasses.replace(cfg.tls, **flag_values(args, TlsConfig, prefix="tls_")))
        if args.mode:
            cfg = cfg.with_mode(args.mode)
        if args.device:
            cfg = dataclasses.replace(cfg, rdma=cfg.rdma.replace(device=args.device))
        problem = device_problem(cfg.rdma.device)
        if problem:
            raise ConfigError(problem)
    except (TensorwireError, ValueError, OSError) as exc:
        return _error(args, exc, 2)
    names = [os.path.basename(p) for p in args.images]
    what = f"{len(data)} image{'s' if len(data) != 1 else ''}"
    times: dict[str, float] = {}
    try:
        with (
            Ticker(on_terminal() and not args.json) as ticker,
            stdout_to_stderr(),
            RemoteOutputTransport(endpoint, cfg) as transport,
        ):
            if cfg.mode == "auto":
                ticker.phase(f"starting the RDMA reader (up to {args.wait_reader_s:g} s)")
                t_wait = time.monotonic()
                if not transport.wait_ready(args.wait_reader_s):
                    waited = time.monotonic() - t_wait
                    why = getattr(getattr(transport, "_reader", None), "last_error", None)
                    ticker.say(
                        f"warning: RDMA reader not ready after {waited:.1f} s"
                        + (f" ({why})" if why is not None else "")
                        + "; fetching inline"
                    )
            ticker.phase(f"fetching {what} from {endpoint}")
            times["fetch_start"] = time.monotonic()
            out = transport.fetch([MultimodalInput(d) for d in data], timeout_ms=args.timeout_ms)
            times["fetch_end"] = time.monotonic()
            ticker.phase("handing the leases back")
            drain_releases(transport, cfg.release_timeout_ms / 1000.0 + 1.0)
    except TensorwireError as exc:
        return _error(args, exc, 1, tls_hint(str(exc), cfg.tls))
    result = fetch_result(out, names)
    end = time.monotonic()
    result["wall_ms"] = {
        "total": (end - STARTED) * 1e3,
        "start_up": (times["fetch_start"] - STARTED) * 1e3,
        "fetch": (times["fetch_end"] - times["fetch_start"]) * 1e3,
        "release_and_close": (end - times["fetch_end"]) * 1e3,
    }
    print(json.dumps(fetch_document(result, endpoint)) if args.json else "\n".join(fetch_lines(result)))
    return 0
