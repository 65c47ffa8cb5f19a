"""Encoder-output transport: a vision encoder hands its output to an LLM process.

Business code calls only ``OutputTransport.transfer(request, output)`` (through ``EncoderService`` /
``serve_encoder``) on the encoder side and ``RemoteOutputTransport.fetch(inputs)`` on the LLM side. Everything
else (plane choice, capability negotiation, receipts, deadlines, the one inline fallback, lease release,
circuit breakers, metrics) lives here. gRPC is the control plane; ``tensorwire.rdma`` is the bulk data plane;
inline gRPC bytes are the terminal plane. Protocol and tables: ``docs/transport.md``.

Encoder::

    server = serve_encoder(encode_fn, TransportConfig.from_env(), "0.0.0.0:0")   # TLS from TENSORWIRE_MM_TLS_*

LLM::

    with RemoteOutputTransport(f"{host}:{port}", TransportConfig.from_env()) as t:
        out = t.fetch([MultimodalInput(jpeg_bytes)])     # out.embeddings, out.plane, out.stage_ms

Public names (``__all__``, pinned by tests/unit/mm/test_mm_public_api.py):

- encoder side: ``serve_encoder``, ``EncoderServer``, ``EncoderService``, ``EncodeFn``, ``EncoderOutput``,
  ``OutputTransport``, ``OutputBuffers`` (zero-copy outputs);
- LLM side: ``RemoteOutputTransport``, ``MultimodalInput``, ``MultimodalOutput``, ``Plane``;
- both: ``TransportConfig``, ``MODES``, ``TransportMetrics``, ``metrics_for``.

``tensorwire.mm.wire`` is public too: the protocol every peer of the EncoderService shares (method paths, message
limits, the status table, the budget formula), used by the proxy. Every other module is private. Sibling packages
import the few internals they need explicitly from their module: ``_host.GrpcHost``/``Service``/``Method``,
``_service.encoder_host``, ``_scope.current_call``, ``_tls.TlsConfig``, ``_limits.ServerLimits``,
``_receipt.check_receipt`` and ``_ratelog.RateLimitedLog`` (``tensorwire.service``, the CLI),
``_grpc_channel.GrpcControlChannel`` (``tensorwire.bench``, the fuzz harness).

Security (docs/security.md): ``TransportConfig.tls`` turns TLS / mTLS on for both ends,
``TransportConfig.limits`` bounds what a caller may hold on a server; a plaintext server binds a non-loopback
address only with ``serve_encoder(..., insecure=True)``.
"""

from __future__ import annotations

import typing as _typing

from tensorwire._lazy import lazy_exports as _lazy_exports

if _typing.TYPE_CHECKING:
    from tensorwire.mm._config import MODES, TransportConfig
    from tensorwire.mm._metrics import TransportMetrics, metrics_for
    from tensorwire.mm._types import EncoderOutput, MultimodalInput, MultimodalOutput, Plane
    from tensorwire.mm.client._transport import RemoteOutputTransport
    from tensorwire.mm.server._output import OutputBuffers, OutputTransport
    from tensorwire.mm.server._service import EncodeFn, EncoderServer, EncoderService, serve_encoder

# Each name is imported from its module on first use, so ``import tensorwire.mm`` and its configuration (which
# the CLI needs to build its flags) import neither torch nor the servers.
_LAZY = {
    "MODES": "tensorwire.mm._config",
    "TransportConfig": "tensorwire.mm._config",
    "TransportMetrics": "tensorwire.mm._metrics",
    "metrics_for": "tensorwire.mm._metrics",
    "EncoderOutput": "tensorwire.mm._types",
    "MultimodalInput": "tensorwire.mm._types",
    "MultimodalOutput": "tensorwire.mm._types",
    "Plane": "tensorwire.mm._types",
    "RemoteOutputTransport": "tensorwire.mm.client._transport",
    "OutputBuffers": "tensorwire.mm.server._output",
    "OutputTransport": "tensorwire.mm.server._output",
    "EncodeFn": "tensorwire.mm.server._service",
    "EncoderServer": "tensorwire.mm.server._service",
    "EncoderService": "tensorwire.mm.server._service",
    "serve_encoder": "tensorwire.mm.server._service",
}

__all__ = [
    # encoder side
    "serve_encoder",
    "EncoderServer",
    "EncoderService",
    "EncodeFn",
    "EncoderOutput",
    "OutputTransport",
    "OutputBuffers",
    # LLM side
    "RemoteOutputTransport",
    "MultimodalInput",
    "MultimodalOutput",
    "Plane",
    # both
    "TransportConfig",
    "MODES",
    "TransportMetrics",
    "metrics_for",
]

__getattr__ = _lazy_exports("tensorwire.mm", _LAZY, globals())
