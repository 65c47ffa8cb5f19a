"""What every peer of the EncoderService agrees on: method paths, message limits, the status table, and the
per-request budget formula (:func:`rpc_budget_ms`; the client's fetch budget and the proxy's per-attempt budget).

The proxy (``tensorwire.service``) and the encoder client both import these names, so a path or a status
mapping is written once. gRPC methods are registered through generic handlers with explicit serializers (no
generated ``*_pb2_grpc.py``), which keeps tensorwire free of grpcio version checks.

Errors cross the wire as a gRPC status code plus a ``tensorwire-reason`` trailing-metadata entry carrying the
:class:`~tensorwire.errors.Reason` value, so the client rebuilds the exact exception the server raised. On the
EncodeStream a failed Encode is a ``StreamError`` message carrying the same code and reason (the stream stays
open); :func:`stream_error_for` and :func:`error_from_stream` are the two ends of it, and both go through the
same table as the unary path, so one failure raises the same class with the same reason on either path.
``grpc.RpcError`` never leaves ``tensorwire.mm``.
"""

from __future__ import annotations

from collections.abc import Iterable
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
from tensorwire.mm.wire._protobuf import varint as _varint

PACKAGE = "tensorwire.mm.v1"
SERVICE_NAME = f"{PACKAGE}.EncoderService"
ENCODE_METHOD = f"/{SERVICE_NAME}/Encode"
RELEASE_METHOD = f"/{SERVICE_NAME}/ReleaseLeases"
ENCODE_STREAM_METHOD = f"/{SERVICE_NAME}/EncodeStream"
LOCAL_CHANNEL_METHOD = f"/{SERVICE_NAME}/LocalChannel"
REASON_METADATA_KEY = "tensorwire-reason"
# Set (with RESOURCE_EXHAUSTED) when an encoder refuses a new EncodeStream because it has its cap of open
# streams. The refusal happens before any message is read, so the caller may send that Encode over unary.
STREAM_REFUSED_METADATA = ("tensorwire-stream", "refused")

# Inline receipts carry whole embeddings (the seed's output is 112.7 MB); gRPC's 4 MiB default would refuse
# them. 2 GiB - 1 is protobuf's hard limit for one message.
MAX_MESSAGE_BYTES = 2**31 - 1

EncodeRequest = encoder_pb2.EncodeRequest
EncodeResponse = encoder_pb2.EncodeResponse
ReleaseLeasesRequest = encoder_pb2.ReleaseLeasesRequest
ReleaseLeasesResponse = encoder_pb2.ReleaseLeasesResponse
StreamRequest = encoder_pb2.StreamRequest
StreamResponse = encoder_pb2.StreamResponse
StreamError = encoder_pb2.StreamError

_STATUS_BY_VALUE: dict[int, grpc.StatusCode] = {code.value[0]: code for code in grpc.StatusCode}


# StreamRequest/StreamResponse field numbers of their bodies (encoder.proto).
STREAM_ENCODE_FIELD = 2   # StreamRequest.encode
STREAM_RELEASE_FIELD = 3  # StreamRequest.release
STREAM_OFFER_FIELD = 4    # StreamRequest.offer
STREAM_PLACEMENT_FIELD = 5  # StreamRequest.placement (a varint)
STREAM_RECEIPT_FIELD = 2  # StreamResponse.receipt
STREAM_ERROR_FIELD = 3    # StreamResponse.error


def stream_frame(message_id: int, field_number: int, body: bytes) -> bytes:
    """The serialized StreamRequest/StreamResponse ``{id: message_id, <field_number>: body}``.

    ``body`` is an already serialized message (an EncodeRequest, a receipt, ...). Writing the wrapper's two
    fields by hand (protobuf wire format: a varint, then a length-delimited field) costs one join instead of
    copying the message into a wrapper and serializing it again, which matters for inline receipts of 100+ MB.
    Parses to exactly what protobuf would have built.
    """
    return b"".join((b"\x08", _varint(message_id), _varint(field_number << 3 | 2), _varint(len(body)), body))


def placement_field(buffer_id: int) -> bytes:
    """``StreamRequest.placement = buffer_id``, to append to a ``stream_frame`` (fields may come in any order)."""
    return _varint(STREAM_PLACEMENT_FIELD << 3) + _varint(buffer_id)


def rpc_budget_ms(item_timeouts_ms: Iterable[int], *, worker_timeout_ms: int, margin_ms: int) -> int:
    """A request's budget: max over its items of (item timeout if > 0, else ``worker_timeout_ms``) + ``margin_ms``;
    ``worker_timeout_ms + margin_ms`` with no items. Python ints: no overflow."""
    worker = max((int(t) if int(t) > 0 else worker_timeout_ms for t in item_timeouts_ms), default=worker_timeout_ms)
    return worker + margin_ms


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
    context.abort(code, _details_for(exc))


def stream_error_for(exc: BaseException) -> encoder_pb2.StreamError:
    """The StreamError a server answers on the EncodeStream for ``exc`` (the unary path's status, as a message)."""
    code, reason = status_for(exc)
    return StreamError(code=code.value[0], reason=reason.value, message=_details_for(exc))


def _details_for(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}"


def trailing_pairs(exc: grpc.RpcError) -> list[tuple[str, str | bytes]]:
    """The trailing metadata of a failed call as (key, value) pairs; empty when the error carries none.

    Raises TypeError/ValueError when an entry is not a pair. grpc-stubs types ``RpcError.trailing_metadata()`` as
    objects with ``.key``/``.value``; grpc returns (key, value) tuples (namedtuples from its C core), and so do
    the errors our tests and relays build, so entries are unpacked, never read by attribute.
    """
    read = getattr(exc, "trailing_metadata", None)  # a bare RpcError (raised by hand) has none
    entries: Iterable[tuple[str, str | bytes]] = (read() if read is not None else None) or ()
    return [(key, value) for key, value in entries]


def reason_from_rpc(exc: grpc.RpcError) -> Reason | None:
    """The ``tensorwire-reason`` the server attached to a failed call, if any (and if it is a known value)."""
    try:
        for key, value in trailing_pairs(exc):
            if key == REASON_METADATA_KEY:
                return Reason(value)
    except (AttributeError, TypeError, ValueError):
        return None
    return None


def is_stream_refusal(exc: grpc.RpcError) -> bool:
    """True when the encoder refused to open an EncodeStream (over its cap): no message on it was handled."""
    try:
        if exc.code() != grpc.StatusCode.RESOURCE_EXHAUSTED:
            return False
        return any(pair == STREAM_REFUSED_METADATA for pair in trailing_pairs(exc))
    except (AttributeError, TypeError, ValueError):
        return False


def error_from_status(code: grpc.StatusCode | None, details: str | None, reason: Reason | None,
                      what: str) -> TensorwireError:
    """The tensorwire exception for a status code, its details and the server's reason (None: not sent)."""
    code = code if code is not None else grpc.StatusCode.UNKNOWN
    cls = _STATUS_TO_CLASS.get(code, ProtocolError if code == grpc.StatusCode.INTERNAL else ControlPlaneError)
    if reason is None:
        reason = _STATUS_DEFAULT_REASON.get(code, Reason.PROTOCOL_ERROR if cls is ProtocolError else Reason.UNKNOWN)
    return cls(f"{what} failed with {code.name}: {details}", reason=reason)


def error_from_rpc(exc: grpc.RpcError, what: str) -> TensorwireError:
    """Translates a failed call into the tensorwire exception the server meant (keep ``from exc`` at the caller)."""
    code = exc.code() if hasattr(exc, "code") else grpc.StatusCode.UNKNOWN
    details = exc.details() if hasattr(exc, "details") else str(exc)
    return error_from_status(code, details, reason_from_rpc(exc), what)


def error_from_stream(error: encoder_pb2.StreamError, what: str) -> TensorwireError:
    """Translates a StreamError into the exception :func:`error_from_rpc` builds for the same status and reason."""
    code = _STATUS_BY_VALUE.get(int(error.code), grpc.StatusCode.UNKNOWN)
    try:
        reason: Reason | None = Reason(error.reason) if error.reason else None
    except ValueError:
        reason = None
    return error_from_status(code, error.message, reason, what)


__all__ = [
    "PACKAGE",
    "SERVICE_NAME",
    "ENCODE_METHOD",
    "RELEASE_METHOD",
    "ENCODE_STREAM_METHOD",
    "LOCAL_CHANNEL_METHOD",
    "REASON_METADATA_KEY",
    "STREAM_REFUSED_METADATA",
    "MAX_MESSAGE_BYTES",
    "EncodeRequest",
    "EncodeResponse",
    "ReleaseLeasesRequest",
    "ReleaseLeasesResponse",
    "StreamRequest",
    "StreamResponse",
    "StreamError",
    "STREAM_ENCODE_FIELD",
    "placement_field",
    "STREAM_RELEASE_FIELD",
    "STREAM_OFFER_FIELD",
    "STREAM_PLACEMENT_FIELD",
    "STREAM_RECEIPT_FIELD",
    "STREAM_ERROR_FIELD",
    "stream_frame",
    "channel_options",
    "rpc_budget_ms",
    "status_for",
    "abort_with",
    "stream_error_for",
    "trailing_pairs",
    "reason_from_rpc",
    "is_stream_refusal",
    "error_from_status",
    "error_from_rpc",
    "error_from_stream",
]
