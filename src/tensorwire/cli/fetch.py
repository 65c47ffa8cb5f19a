"""``tensorwire fetch --endpoint HOST:PORT [--json] IMAGE...``: the LLM side, for trying a deployment by hand.

Sends all images in one request through ``RemoteOutputTransport`` (RDMA when both sides can, inline otherwise)
and prints, per image, the embedding shape and dtype, then the plane used and the stage times. ``--json`` prints
one object, also on failure; its keys are in ``EPILOG`` (``tensorwire fetch --help``), in
``tensorwire.cli._measure`` (which builds it) and in docs/deployment.md.
Exit codes: 0 ok, 1 the fetch failed, 2 bad arguments or unreadable files.

TLS: ``--tls-ca`` (verify the server), ``--tls-cert``/``--tls-key`` (mTLS), ``--tls-server-name``, or the same
``TENSORWIRE_MM_TLS_*`` variables the servers read.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
from pathlib import Path

from tensorwire.cli._measure import FETCH_JSON_HELP

HELP = "fetch encoder output for images from an encoder or proxy (the LLM side)"
EPILOG = FETCH_JSON_HELP + "exit codes: 0 ok, 1 the fetch failed, 2 bad arguments or unreadable files\n"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from tensorwire.mm import MODES

    parser.add_argument("--endpoint", required=True,
                        help="HOST:PORT of a serve-encoder or serve-proxy (the port is required)")
    parser.add_argument("--json", action="store_true",
                        help="print one JSON object instead of text, also on failure (keys below)")
    parser.add_argument("--mode", choices=MODES, default=None,
                        help="auto (RDMA when possible) or grpc (inline only); default: MM_TRANSPORT_MODE or auto")
    parser.add_argument("--device", default=None, help="where RDMA reads land: cpu or cuda:N (default: cpu)")
    parser.add_argument("--timeout-ms", type=int, default=None,
                        help="request budget (default: worker budget + margin from TransportConfig)")
    parser.add_argument("--wait-reader-s", type=float, default=10.0,
                        help="wait this long for the RDMA reader before the request (default: 10)")
    from tensorwire._grpc.tls import TlsConfig
    from tensorwire.cli.serve_encoder import _TLS_HELP
    from tensorwire.service._flags import add_flags

    add_flags(parser.add_argument_group("TLS (TlsConfig; docs/security.md)"), TlsConfig, prefix="tls_",
              skip=("client_auth",), help_extra=_TLS_HELP)
    parser.add_argument("images", nargs="+", metavar="IMAGE", help="image files (JPEG, PNG, ...)")


def _error(args: argparse.Namespace, exc: BaseException, code: int) -> int:
    """Reports a failure: one JSON object with ``--json``, else one ``error:`` line on stderr."""
    from tensorwire.cli._measure import fetch_error_document
    from tensorwire.errors import TensorwireError

    doc = fetch_error_document(exc, code, args.endpoint)
    if args.json:
        print(json.dumps(doc))
        return code
    err = doc["error"]
    what = f"{err['type']} ({err['reason']}): " if isinstance(exc, TensorwireError) else ""
    print(f"error: {what}{err['message']}", file=sys.stderr)
    return code


def run(args: argparse.Namespace) -> int:
    from tensorwire._grpc.tls import TlsConfig
    from tensorwire.cli._measure import fetch_document, fetch_lines, fetch_result
    from tensorwire.errors import TensorwireError
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
    except (TensorwireError, ValueError, OSError) as exc:
        return _error(args, exc, 2)
    names = [os.path.basename(p) for p in args.images]
    try:
        with stdout_to_stderr(), RemoteOutputTransport(endpoint, cfg) as transport:
            if cfg.mode == "auto" and not transport.wait_ready(args.wait_reader_s):
                print(f"warning: RDMA reader not ready after {args.wait_reader_s:.0f} s; fetching inline",
                      file=sys.stderr)
            out = transport.fetch([MultimodalInput(d) for d in data], timeout_ms=args.timeout_ms)
            drain_releases(transport, cfg.release_timeout_ms / 1000.0 + 1.0)
    except TensorwireError as exc:
        return _error(args, exc, 1)
    result = fetch_result(out, names)
    print(json.dumps(fetch_document(result, endpoint)) if args.json else "\n".join(fetch_lines(result)))
    return 0
