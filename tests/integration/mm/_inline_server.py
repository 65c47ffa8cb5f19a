"""A spawned encoder process for the inline-copy tests: serves ``_plain_grpc.embedding(rows, cols)`` inline, the
same bytes the plain gRPC baseline server (``tensorwire.bench._plain_grpc.serve``) holds."""

from __future__ import annotations

import os
from typing import Any


def serve(rows: int, cols: int, q: Any, stop: Any) -> None:
    from tensorwire.bench._plain_grpc import embedding
    from tensorwire.mm import EncoderOutput, TransportConfig, serve_encoder

    emb = embedding(rows, cols)
    server = serve_encoder(lambda inputs: EncoderOutput(embeddings=emb), TransportConfig(mode="grpc"), "127.0.0.1:0")
    try:
        q.put((server.port, os.getpid()))
        stop.wait(300)
    finally:
        server.stop(0)
