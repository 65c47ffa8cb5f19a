"""The baseline a user would pick instead of tensorwire's inline plane: one plain unary gRPC call returning the bytes.

Same process layout as the tensorwire planes in ``bench transfer``: :func:`serve` runs in a spawned server process,
:class:`PlainClient` in the bench process, over loopback. The server holds the output ready, as tensorwire's
encoder holds its embedding: ``Prepare(rows)`` (untimed) turns the first ``rows`` rows of :func:`embedding` into
one ``bytes`` object, and every ``Fetch(rows)`` returns that object as the whole response (no protobuf, no
framing, no validation). The client turns the response into a tensor: a zero-copy view on the host, plus one
host-to-device copy when the output must end on a GPU (as tensorwire's inline plane must deliver it there). What
is left is gRPC's own cost of moving the bytes, i.e. transport against transport.

A second variant, ``FetchCopy``, holds the tensor instead and turns it into ``bytes`` in every call (one host
copy): what a plain handler that keeps the model's output as a tensor, as tensorwire's encoder does, must add.

Methods (raw bytes in and out; the request is the row count in ASCII):
``/tensorwire.bench.Plain/Prepare`` -> the payload's byte count in ASCII; ``/tensorwire.bench.Plain/Fetch`` and
``/tensorwire.bench.Plain/FetchCopy`` -> the payload, or FAILED_PRECONDITION when ``rows`` is not the prepared count
(only the last prepared size is held, so a 1 GiB sweep does not hold every size at once).
"""

from __future__ import annotations

import time
import warnings
from concurrent import futures
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import grpc
    import torch

SERVICE = "tensorwire.bench.Plain"
PREPARE = f"/{SERVICE}/Prepare"
FETCH = f"/{SERVICE}/Fetch"
FETCH_COPY = f"/{SERVICE}/FetchCopy"
# No size limit either way: the payload is one message of up to 1 GiB (gRPC's default receive limit is 4 MiB).
CHANNEL_OPTIONS = [("grpc.max_send_message_length", -1), ("grpc.max_receive_message_length", -1)]
SERVER_THREADS = 8  # tensorwire's encoder default (TransportConfig.server_threads)


def embedding(rows: int, cols: int) -> torch.Tensor:
    """The bench's encoder output, bf16 ``[rows, cols]`` from seed 0: the encoder process and the plain server
    both build it with this function, so the two carry the same bytes."""
    import torch

    g = torch.Generator().manual_seed(0)
    return torch.randn(rows, cols, generator=g).to(torch.bfloat16)


def serve(max_rows: int, cols: int, q: Any, stop: Any) -> None:
    """Server process: put the bound port on ``q``, serve until ``stop`` is set."""
    import grpc
    import torch

    emb = embedding(max_rows, cols)
    held: dict[int, tuple[bytes, torch.Tensor]] = {}

    def prepare(request: bytes, ctx: grpc.ServicerContext) -> bytes:
        rows = int(request)
        held.clear()  # drop the previous size first: at 1 GiB two payloads would double the footprint
        flat = emb[:rows].contiguous().view(-1).view(torch.uint8)
        held[rows] = (flat.numpy().tobytes(), flat)
        return str(len(held[rows][0])).encode()

    def _held(request: bytes, ctx: grpc.ServicerContext) -> tuple[bytes, torch.Tensor]:
        entry = held.get(int(request))
        if entry is None:
            ctx.abort(grpc.StatusCode.FAILED_PRECONDITION, f"rows={int(request)} not prepared (held: {list(held)})")
        return entry

    def fetch(request: bytes, ctx: grpc.ServicerContext) -> bytes:
        return _held(request, ctx)[0]

    def fetch_copy(request: bytes, ctx: grpc.ServicerContext) -> bytes:
        return _held(request, ctx)[1].numpy().tobytes()

    handler = grpc.method_handlers_generic_handler(
        SERVICE,
        {
            "Prepare": grpc.unary_unary_rpc_method_handler(prepare),
            "Fetch": grpc.unary_unary_rpc_method_handler(fetch),
            "FetchCopy": grpc.unary_unary_rpc_method_handler(fetch_copy),
        },
    )
    server = grpc.server(
        futures.ThreadPoolExecutor(SERVER_THREADS, thread_name_prefix="bench-plain"), options=CHANNEL_OPTIONS
    )
    server.add_generic_rpc_handlers((handler,))
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    q.put(port)
    try:
        stop.wait(3600)
    finally:
        server.stop(0)


class PlainClient:
    """One channel to a :func:`serve` process. ``fetch`` is the timed call; ``prepare`` must come first per size.

    Not thread-safe (one bench loop). ``close()`` is idempotent.
    """

    def __init__(self, endpoint: str, cols: int) -> None:
        import grpc

        self.cols = cols
        self._channel = grpc.insecure_channel(endpoint, options=CHANNEL_OPTIONS)
        self._prepare: grpc.UnaryUnaryMultiCallable[bytes, bytes] = self._channel.unary_unary(PREPARE)
        self._fetch: grpc.UnaryUnaryMultiCallable[bytes, bytes] = self._channel.unary_unary(FETCH)
        self._fetch_copy: grpc.UnaryUnaryMultiCallable[bytes, bytes] = self._channel.unary_unary(FETCH_COPY)
        self._nbytes: dict[int, int] = {}

    def prepare(self, rows: int, timeout_s: float = 120.0) -> int:
        """Have the server build the payload for ``rows`` (untimed); returns its byte count."""
        nbytes = int(self._prepare(str(rows).encode(), timeout=timeout_s))
        self._nbytes = {rows: nbytes}
        return nbytes

    def fetch(
        self, rows: int, device: str = "cpu", timeout_s: float = 600.0, *, server_copy: bool = False
    ) -> tuple[Any, dict[str, float]]:
        """One unary call (``server_copy``: ``FetchCopy``); returns the bf16 ``[rows, cols]`` tensor on ``device``
        and its stages in ms (``rpc``: the call; ``to_device``: the tensor view, plus on CUDA the synchronized copy
        to the device; ``total``)."""
        import torch

        call = self._fetch_copy if server_copy else self._fetch
        t0 = time.perf_counter()
        data = call(str(rows).encode(), timeout=timeout_s)
        t1 = time.perf_counter()
        if len(data) != self._nbytes.get(rows, -1):
            raise RuntimeError(
                f"plain gRPC returned {len(data)} bytes for rows={rows}, expected "
                f"{self._nbytes.get(rows)} (prepare first)"
            )
        with warnings.catch_warnings():  # the response is immutable bytes; the view is only read
            warnings.simplefilter("ignore", UserWarning)
            out = torch.frombuffer(data, dtype=torch.bfloat16).view(rows, self.cols)
        if device.startswith("cuda"):
            out = out.to(device)
            torch.cuda.current_stream(device).synchronize()
        t2 = time.perf_counter()
        return out, {"rpc": (t1 - t0) * 1e3, "to_device": (t2 - t1) * 1e3, "total": (t2 - t0) * 1e3}

    def close(self) -> None:
        self._channel.close()

    def __enter__(self) -> PlainClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
