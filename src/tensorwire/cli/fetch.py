"""``tensorwire fetch --endpoint HOST:PORT [--json] IMAGE...``: the LLM side, for trying a deployment by hand.

Sends all images in one request through ``RemoteOutputTransport`` (RDMA when both sides can, inline otherwise)
and prints, per image, the embedding shape and dtype, then the plane used and the stage times. ``--json``
prints one object: ``plane``, ``fallback_reason``, ``worker_id``, ``items`` (shapes, dtypes), ``encoder_ms``,
``transfer_ms`` (total minus the encoder's forward), ``total_ms``, ``stage_ms``, ``payload_bytes``.
Exit codes: 0 ok, 1 the fetch failed, 2 bad arguments or unreadable files.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
from pathlib import Path

HELP = "fetch encoder output for images from an encoder or proxy (the LLM side)"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from tensorwire.mm import MODES

    parser.add_argument("--endpoint", required=True, help="HOST:PORT of a serve-encoder or serve-proxy")
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of text")
    parser.add_argument("--mode", choices=MODES, default=None,
                        help="auto (RDMA when possible) or grpc (inline only); default: MM_TRANSPORT_MODE or auto")
    parser.add_argument("--device", default=None, help="where RDMA reads land: cpu or cuda:N (default: cpu)")
    parser.add_argument("--timeout-ms", type=int, default=None,
                        help="request budget (default: worker budget + margin from TransportConfig)")
    parser.add_argument("--wait-reader-s", type=float, default=10.0,
                        help="wait this long for the RDMA reader before the request (default: 10)")
    parser.add_argument("images", nargs="+", metavar="IMAGE", help="image files (JPEG, PNG, ...)")


def run(args: argparse.Namespace) -> int:
    from tensorwire.bench._e2e import fetch_lines, fetch_result
    from tensorwire.errors import TensorwireError
    from tensorwire.mm import MultimodalInput, RemoteOutputTransport, TransportConfig
    from tensorwire.service._runtime import drain_releases, stdout_to_stderr

    try:
        data = [Path(p).read_bytes() for p in args.images]
    except OSError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    try:
        cfg = TransportConfig.from_env(os.environ)
        if args.mode:
            cfg = cfg.with_mode(args.mode)
        if args.device:
            cfg = dataclasses.replace(cfg, rdma=cfg.rdma.replace(device=args.device))
    except (TensorwireError, ValueError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    names = [os.path.basename(p) for p in args.images]
    try:
        with stdout_to_stderr(), RemoteOutputTransport(args.endpoint, cfg) as transport:
            if cfg.mode == "auto" and not transport.wait_ready(args.wait_reader_s):
                print(f"warning: RDMA reader not ready after {args.wait_reader_s:.0f} s; fetching inline",
                      file=sys.stderr)
            out = transport.fetch([MultimodalInput(d) for d in data], timeout_ms=args.timeout_ms)
            drain_releases(transport, cfg.release_timeout_ms / 1000.0 + 1.0)
    except TensorwireError as exc:
        print(f"error: {type(exc).__name__} ({exc.reason.value}): {exc}", file=sys.stderr)
        return 1
    result = fetch_result(out, names)
    print(json.dumps(result) if args.json else "\n".join(fetch_lines(result)))
    return 0
