"""Encoder-output transport: a vision encoder hands its output to an LLM process.

Business code calls only ``OutputTransport.transfer(request, output)`` (through ``EncoderService`` /
``serve_encoder``) on the encoder side and ``RemoteOutputTransport.fetch(inputs)`` on the LLM side. Everything
else (plane choice, capability negotiation, receipts, deadlines, the one inline fallback, lease release,
circuit breakers, metrics) lives here. gRPC is the control plane; ``tensorwire.rdma`` is the bulk data plane;
inline gRPC bytes are the terminal plane. Protocol and tables: ``docs/transport.md``.

Encoder::

    server = serve_encoder(encode_fn, TransportConfig.from_env(), "0.0.0.0:0")   # server.port

LLM::

    with RemoteOutputTransport(f"{host}:{port}", TransportConfig.from_env()) as t:
        out = t.fetch([MultimodalInput(jpeg_bytes)])     # out.embeddings, out.plane, out.stage_ms
"""

from __future__ import annotations

from tensorwire.mm.breaker import BreakerBoard, BreakerState
from tensorwire.mm.client import RemoteOutputTransport, resolve_rpc_timeout_ms
from tensorwire.mm.config import MODES, TransportConfig
from tensorwire.mm.encoder_side import OutputBuffers, OutputTransport
from tensorwire.mm.metrics import TransportMetrics, metrics_for
from tensorwire.mm.release import ReleaseQueue
from tensorwire.mm.service import EncoderServer, EncoderService, serve_encoder
from tensorwire.mm._staging import Expect, StagingArea
from tensorwire.mm._store import HeldItem, HeldStore, StoreStats, new_secret
from tensorwire.mm._store_rpc import HeldStoreClient, LookupOutcome, StagingClient, StoreServer, serve_store
from tensorwire.mm.types import EncoderOutput, MultimodalInput, MultimodalOutput, Plane

__all__ = [
    "EncoderOutput",
    "MultimodalOutput",
    "MultimodalInput",
    "Plane",
    "TransportConfig",
    "MODES",
    "OutputTransport",
    "OutputBuffers",
    "EncoderService",
    "EncoderServer",
    "serve_encoder",
    "RemoteOutputTransport",
    "resolve_rpc_timeout_ms",
    "BreakerBoard",
    "BreakerState",
    "ReleaseQueue",
    "TransportMetrics",
    "metrics_for",
    "HeldStore",
    "HeldItem",
    "StoreStats",
    "new_secret",
    "StagingArea",
    "Expect",
    "StoreServer",
    "serve_store",
    "HeldStoreClient",
    "StagingClient",
    "LookupOutcome",
]
