"""What every peer of the EncoderService agrees on: method paths, message limits, and the status table.

The proxy (``tensorwire.service``) and the encoder client both import these names, so a path or a status
mapping is written once. gRPC methods are registered through generic handlers with explicit serializers (no
generated ``*_pb2_grpc.py``), which keeps tensorwire free of grpcio version checks.

Errors cross the wire as a gRPC status code plus a ``tensorwire-reason`` trailing-metadata entry carrying the
:class:`~tensorwire.errors.Reason` value, so the client rebuilds the exact exception the server raised.
``grpc.RpcError`` never leaves ``tensorwire.mm``.
"""

from __future__ import annotations

from typing import Any

import grpc

from tensorwire.errors import (
    ClosedError,
    ConfigError,
    ControlPlaneError,
    DeadlineExceeded,
    InvalidPayload,
    PeerUnavailable,
    ProtocolError,
    Reason,
    TensorwireError,
)
from tensorwire.mm._proto import encoder_pb2

PACKAGE = "tensorwire.mm.v1"
SERVICE_NAME = f"{PACKAGE}.EncoderService"
ENCODE_METHOD = f"/{SERVICE_NAME}/Encode"
RELEASE_METHOD = f"/{SERVICE_NAME}/ReleaseLeases"
REASON_METADATA_KEY = "tensorwire-reason"

# Inline receipts carry whole embeddings (the seed's output is 112.7 MB); gRPC's 4 MiB default would refuse
# them. 2 GiB - 1 is protobuf's hard limit for one message.
MAX_MESSAGE_BYTES = 2**31 - 1

EncodeRequest = encoder_pb2.EncodeRequest
EncodeResponse = encoder_pb2.EncodeResponse
ReleaseLeasesRequest = encoder_pb2.ReleaseLeasesRequest
ReleaseLeasesResponse = encoder_pb2.ReleaseLeasesResponse


def channel_options(max_message_bytes: int = MAX_MESSAGE_BYTES) -> list[tuple[str, Any]]:
    """Options for a channel or server that carries inline receipts."""
    return [
        ("grpc.max_send_message_length", max_message_bytes),
        ("grpc.max_receive_message_length", max_message_bytes),
    ]


# One table, both directions. Reasons not listed map by exception class (see status_for).
_REASON_TO_STATUS: dict[Reason, grpc.StatusCode] = {
    Reason.INVALID_PAYLOAD: grpc.StatusCode.INVALID_ARGUMENT,
    Reason.INVALID_REQUEST: grpc.StatusCode.INVALID_ARGUMENT,
    Reason.INVALID_CONFIG: grpc.StatusCode.INVALID_ARGUMENT,
    Reason.UNSUPPORTED_DTYPE: grpc.StatusCode.INVALID_ARGUMENT,
    Reason.NEGATIVE_DIM: grpc.StatusCode.INVALID_ARGUMENT,
    Reason.SIZE_OVERFLOW: grpc.StatusCode.INVALID_ARGUMENT,
    Reason.NBYTES_MISMATCH: grpc.StatusCode.INVALID_ARGUMENT,
    Reason.ASSEMBLY_MISMATCH: grpc.StatusCode.INVALID_ARGUMENT,
    Reason.UNIMPLEMENTED: grpc.StatusCode.UNIMPLEMENTED,
    Reason.DEADLINE_EXCEEDED: grpc.StatusCode.DEADLINE_EXCEEDED,
    Reason.BUDGET_EXHAUSTED: grpc.StatusCode.DEADLINE_EXCEEDED,
    Reason.PEER_UNAVAILABLE: grpc.StatusCode.UNAVAILABLE,
    Reason.CLOSED: grpc.StatusCode.UNAVAILABLE,
    Reason.POOL_EXHAUSTED: grpc.StatusCode.RESOURCE_EXHAUSTED,
    Reason.PROTOCOL_ERROR: grpc.StatusCode.INTERNAL,
    Reason.UNKNOWN: grpc.StatusCode.INTERNAL,
}

_STATUS_TO_CLASS: dict[grpc.StatusCode, type[TensorwireError]] = {
    grpc.StatusCode.INVALID_ARGUMENT: InvalidPayload,
    grpc.StatusCode.UNIMPLEMENTED: ControlPlaneError,
    grpc.StatusCode.DEADLINE_EXCEEDED: DeadlineExceeded,
    grpc.StatusCode.UNAVAILABLE: PeerUnavailable,
    grpc.StatusCode.CANCELLED: PeerUnavailable,
    grpc.StatusCode.RESOURCE_EXHAUSTED: PeerUnavailable,
}

_STATUS_DEFAULT_REASON: dict[grpc.StatusCode, Reason] = {
    grpc.StatusCode.INVALID_ARGUMENT: Reason.INVALID_PAYLOAD,
    grpc.StatusCode.UNIMPLEMENTED: Reason.UNIMPLEMENTED,
    grpc.StatusCode.DEADLINE_EXCEEDED: Reason.DEADLINE_EXCEEDED,
    grpc.StatusCode.UNAVAILABLE: Reason.PEER_UNAVAILABLE,
    grpc.StatusCode.CANCELLED: Reason.PEER_UNAVAILABLE,
    grpc.StatusCode.RESOURCE_EXHAUSTED: Reason.PEER_UNAVAILABLE,
}


def status_for(exc: BaseException) -> tuple[grpc.StatusCode, Reason]:
    """The status code and reason a server answers for ``exc``."""
    if isinstance(exc, TensorwireError):
        reason = exc.reason
        code = _REASON_TO_STATUS.get(reason)
        if code is None:
            if isinstance(exc, (InvalidPayload, ConfigError, ValueError)):
                code = grpc.StatusCode.INVALID_ARGUMENT
            elif isinstance(exc, (PeerUnavailable, ClosedError)):
                code = grpc.StatusCode.UNAVAILABLE
            elif isinstance(exc, (DeadlineExceeded, TimeoutError)):
                code = grpc.StatusCode.DEADLINE_EXCEEDED
            else:
                code = grpc.StatusCode.INTERNAL
        return code, reason
    if isinstance(exc, NotImplementedError):
        return grpc.StatusCode.UNIMPLEMENTED, Reason.UNIMPLEMENTED
    if isinstance(exc, TimeoutError):
        return grpc.StatusCode.DEADLINE_EXCEEDED, Reason.DEADLINE_EXCEEDED
    if isinstance(exc, ValueError):
        return grpc.StatusCode.INVALID_ARGUMENT, Reason.INVALID_REQUEST
    return grpc.StatusCode.INTERNAL, Reason.UNKNOWN


def abort_with(context: grpc.ServicerContext, exc: BaseException) -> None:
    """Ends the RPC with the status for ``exc`` (raises, as ``context.abort`` does)."""
    code, reason = status_for(exc)
    context.set_trailing_metadata(((REASON_METADATA_KEY, reason.value),))
    context.abort(code, f"{type(exc).__name__}: {exc}")


def error_from_rpc(exc: grpc.RpcError, what: str) -> TensorwireError:
    """Translates a failed call into the tensorwire exception the server meant (keep ``from exc`` at the caller)."""
    code = exc.code() if hasattr(exc, "code") else grpc.StatusCode.UNKNOWN
    details = exc.details() if hasattr(exc, "details") else str(exc)
    reason: Reason | None = None
    try:
        for key, value in exc.trailing_metadata() or ():  # type: ignore[attr-defined]
            if key == REASON_METADATA_KEY:
                reason = Reason(value)
    except (AttributeError, ValueError):
        reason = None
    cls = _STATUS_TO_CLASS.get(code, ProtocolError if code == grpc.StatusCode.INTERNAL else ControlPlaneError)
    if reason is None:
        reason = _STATUS_DEFAULT_REASON.get(code, Reason.PROTOCOL_ERROR if cls is ProtocolError else Reason.UNKNOWN)
    name = code.name if code is not None else "UNKNOWN"
    return cls(f"{what} failed with {name}: {details}", reason=reason)


__all__ = [
    "PACKAGE",
    "SERVICE_NAME",
    "ENCODE_METHOD",
    "RELEASE_METHOD",
    "REASON_METADATA_KEY",
    "MAX_MESSAGE_BYTES",
    "EncodeRequest",
    "EncodeResponse",
    "ReleaseLeasesRequest",
    "ReleaseLeasesResponse",
    "channel_options",
    "status_for",
    "abort_with",
    "error_from_rpc",
]
