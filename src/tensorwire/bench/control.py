"""Benchmark: the control plane's round trip, unary RPCs against an open bidirectional stream, hot and after idling.

    python -m tensorwire.bench control [--n 300] [--gaps-ms 0,1.5] [--tls] [--out PATH]

Two measurements, each across two processes on loopback, in one run so their ratios share the machine's state:

1. ``echo``: a 200-byte message through a unary method and through a stream-stream method of a plain sync
   ``grpc.server``, and (``local``) as one frame each way on a Unix socket with the same-host channel's framing
   (``tensorwire._local.unix``, a thread blocked in ``recv`` on each side): the floor each control path pays;
2. ``fetch``: ``RemoteOutputTransport.fetch`` of a small inline output (mode ``grpc``: no data plane) with the
   EncodeStream (``control_stream=True``), with unary Encode RPCs (``control_stream=False``), both with
   ``local_channel="off"``, and over the same-host channel (``local``): the same floor plus tensorwire's client,
   service and codec.

Each runs back to back (gap 0) and with a sleep between calls: on virtual machines a thread that slept wakes up
slowly and runs cold for a while, which a hot loop never shows. Writes benchmarks/results/control-<machine>.json.

``--tls``: both servers and every client over mTLS (a throwaway CA made at run time), to see what TLS adds to a
small request's round trip; writes control-tls-<machine>.json.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import queue
import sys
import time
from collections.abc import Callable
from concurrent import futures
from typing import Any

_ECHO_SERVICE = "tensorwire.bench.Echo"


def _echo_server(q: Any, tls: Any = None) -> None:
    import grpc

    def unary(req: bytes, ctx: Any) -> bytes:
        return req

    def bidi(requests: Any, ctx: Any) -> Any:
        yield from requests

    handler = grpc.method_handlers_generic_handler(
        _ECHO_SERVICE,
        {
            "Unary": grpc.unary_unary_rpc_method_handler(unary),
            "Stream": grpc.stream_stream_rpc_method_handler(bidi),
        },
    )
    server = grpc.server(futures.ThreadPoolExecutor(8))
    server.add_generic_rpc_handlers((handler,))
    if tls is not None:
        from tensorwire._grpc.tls import server_credentials

        q.put(server.add_secure_port("127.0.0.1:0", server_credentials(tls)[0]))
    else:
        q.put(server.add_insecure_port("127.0.0.1:0"))
    server.start()
    server.wait_for_termination()


def _encoder(q: Any, tls: Any = None) -> None:
    import dataclasses

    import torch

    from tensorwire.mm import EncoderOutput, TransportConfig, serve_encoder

    out = EncoderOutput(embeddings=torch.ones(8, 64, dtype=torch.bfloat16), split_sizes=[8])
    cfg = TransportConfig(mode="grpc", worker_id="bench-control")
    server = serve_encoder(lambda inputs: out, cfg if tls is None else dataclasses.replace(cfg, tls=tls), "127.0.0.1:0")
    q.put(server.port)
    server.wait()


def _uds_echo_server(q: Any) -> None:
    import socket
    import tempfile
    import threading

    from tensorwire._local import unix as _unix

    path = os.path.join(_unix.ensure_private_dir(tempfile.mkdtemp(prefix="tw-bench-")), "echo.sock")
    listener = _unix.listen(path)
    q.put(path)

    def serve(conn: socket.socket) -> None:
        while (frame := _unix.recv_frame(conn, None, 1 << 20)) is not None:
            _unix.send_frame(conn, frame, None)

    while True:
        conn, _ = listener.accept()
        threading.Thread(target=serve, args=(conn,), daemon=True).start()


def _timed(fn: Callable[[], Any], n: int, gap_s: float, warmup: int = 30) -> dict[str, float]:
    from tensorwire.bench._common import summarize

    for _ in range(warmup):
        fn()
    samples = []
    for _ in range(n):
        if gap_s:
            time.sleep(gap_s)
        t0 = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - t0)
    return summarize(samples)


def _spawn(target: Callable[..., None], *extra: Any) -> tuple[Any, Any]:
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    proc = ctx.Process(target=target, args=(q, *extra), daemon=True)
    proc.start()
    return proc, q.get(timeout=120)


def _echo(port: int, uds_path: str, n: int, gaps: list[float], tls: Any = None) -> dict[str, Any]:
    import socket

    import grpc

    from tensorwire._local import unix as _unix

    if tls is not None:
        from tensorwire._grpc.tls import channel_credentials

        channel = grpc.secure_channel(f"localhost:{port}", channel_credentials(tls))
    else:
        channel = grpc.insecure_channel(f"127.0.0.1:{port}")
    unary: grpc.UnaryUnaryMultiCallable[bytes, bytes] = channel.unary_unary(f"/{_ECHO_SERVICE}/Unary")
    outbox: queue.Queue[bytes | None] = queue.Queue()

    def requests() -> Any:
        while (item := outbox.get()) is not None:
            yield item

    stream: grpc.StreamStreamMultiCallable[bytes, bytes] = channel.stream_stream(f"/{_ECHO_SERVICE}/Stream")
    call = stream(requests())
    msg = b"x" * 200

    def on_stream() -> None:
        outbox.put(msg)
        next(call)

    uds = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    uds.connect(uds_path)

    def on_local() -> None:
        deadline = time.monotonic() + 10.0  # a deadline on every call, as the channel has
        _unix.send_frame(uds, msg, deadline)
        _unix.recv_frame(uds, deadline, 1 << 20)

    out: dict[str, Any] = {"unary": {}, "stream": {}, "local": {}}
    for gap in gaps:  # the paths alternate per gap so all see the same background
        out["unary"][f"{gap * 1e3:g}ms"] = _timed(lambda: unary(msg), n, gap)
        out["stream"][f"{gap * 1e3:g}ms"] = _timed(on_stream, n, gap)
        out["local"][f"{gap * 1e3:g}ms"] = _timed(on_local, n, gap)
    outbox.put(None)
    channel.close()
    uds.close()
    return out


def _fetch(port: int, n: int, gaps: list[float], tls: Any = None) -> dict[str, Any]:
    import dataclasses

    from tensorwire.mm import MultimodalInput, Plane, RemoteOutputTransport, TransportConfig

    cfg = TransportConfig(mode="grpc", local_channel="off")
    if tls is not None:
        cfg = dataclasses.replace(cfg, tls=tls)
    inputs = [MultimodalInput(b"image")]
    out: dict[str, Any] = {"unary": {}, "stream": {}, "local": {}}
    address = f"127.0.0.1:{port}"
    with (
        RemoteOutputTransport(address, dataclasses.replace(cfg, control_stream=False)) as unary,
        RemoteOutputTransport(address, cfg) as stream,
        RemoteOutputTransport(address, dataclasses.replace(cfg, local_channel="auto")) as local,
    ):
        for t in (unary, stream, local):
            if t.fetch(inputs).plane is not Plane.INLINE:
                raise SystemExit("expected the inline plane")
        for gap in gaps:
            out["unary"][f"{gap * 1e3:g}ms"] = _timed(lambda: unary.fetch(inputs), n, gap)
            out["stream"][f"{gap * 1e3:g}ms"] = _timed(lambda: stream.fetch(inputs), n, gap)
            out["local"][f"{gap * 1e3:g}ms"] = _timed(lambda: local.fetch(inputs), n, gap)
        paths = _counter_values(stream.metrics.control_rpcs)
    out["control_rpcs_of_both_transports"] = paths  # one registry: the three transports share it
    return out


def _counter_values(counter: Any) -> dict[str, float]:
    values: dict[str, float] = {}
    for metric in counter.collect():
        for sample in metric.samples:
            if sample.name.endswith("_total"):
                values[",".join(f"{k}={v}" for k, v in sorted(sample.labels.items()))] = sample.value
    return values


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m tensorwire.bench control", description=__doc__.split("\n\n")[0])
    ap.add_argument("--n", type=int, default=300, help="timed calls per path and gap")
    ap.add_argument("--gaps-ms", default="0,1.5", help="sleeps between calls, comma-separated")
    ap.add_argument("--tls", action="store_true", help="everything over mTLS (certificates made at run time)")
    ap.add_argument("--out", default=None, help="JSON path (default benchmarks/results/control[-tls]-<machine>.json)")
    args = ap.parse_args(argv)
    os.environ.setdefault("NIXL_LOG_LEVEL", "WARN")
    import tempfile

    from tensorwire.bench._common import bench_tls, write_result

    tmp = tempfile.TemporaryDirectory(prefix="tensorwire-bench-tls-")
    server_tls, client_tls = bench_tls(tmp.name) if args.tls else (None, None)

    gaps = [float(g) / 1e3 for g in args.gaps_ms.split(",") if g]
    procs = []
    try:
        echo_proc, echo_port = _spawn(_echo_server, server_tls)
        procs.append(echo_proc)
        uds_proc, uds_path = _spawn(_uds_echo_server)  # the same-host channel has no TLS: a Unix socket, 0600
        procs.append(uds_proc)
        enc_proc, enc_port = _spawn(_encoder, server_tls)
        procs.append(enc_proc)
        echo = _echo(int(echo_port), str(uds_path), args.n, gaps, client_tls)
        fetch = _fetch(int(enc_port), args.n, gaps, client_tls)
    finally:
        for p in procs:
            p.kill()
            p.join(10)
        tmp.cleanup()
    print(f"{'ms, median / p99':28}" + "".join(f"{'gap ' + k:>20}" for k in echo["unary"]))
    for name, table in (("echo", echo), ("fetch (inline, tiny)", fetch)):
        for path in ("unary", "stream", "local"):
            cells = "".join(f"{v['median_ms']:>11.3f} / {v['p99_ms']:6.3f}" for v in table[path].values())
            print(f"{name + ' ' + path:28}{cells}")
    ratios = {
        f"{name}_unary_over_stream_gap_{k}": table["unary"][k]["median_ms"] / table["stream"][k]["median_ms"]
        for name, table in (("echo", echo), ("fetch", fetch))
        for k in table["unary"]
    }
    ratios.update(
        {
            f"{name}_stream_over_local_gap_{k}": table["stream"][k]["median_ms"] / table["local"][k]["median_ms"]
            for name, table in (("echo", echo), ("fetch", fetch))
            for k in table["stream"]
        }
    )
    print("ratios:", {k: round(v, 2) for k, v in ratios.items()})
    load = os.getloadavg()
    print(f"load average at the end: {load[0]:.2f} {load[1]:.2f} {load[2]:.2f} on {os.cpu_count()} cores")
    written = write_result(
        "control-tls" if args.tls else "control",
        {
            "n": args.n,
            "loadavg": list(load),
            "gaps_ms": [g * 1e3 for g in gaps],
            "tls": "mtls" if args.tls else "plaintext",
            "echo": echo,
            "fetch": fetch,
            "ratios": ratios,
        },
        args.out,
    )
    print(f"wrote {written}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
