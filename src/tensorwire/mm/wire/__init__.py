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

from tensorwire._grpc.status import (
    _STATUS_BY_VALUE,
    REASON_METADATA_KEY,
    STREAM_REFUSED_METADATA,
    _details_for,
    abort_with,
    error_from_rpc,
    error_from_status,
    is_stream_refusal,
    reason_from_rpc,
    status_for,
    trailing_pairs,
)
from tensorwire.errors import Reason, TensorwireError
from tensorwire.mm._proto import encoder_pb2
from tensorwire.mm.wire._protobuf import varint as _varint

PACKAGE = "tensorwire.mm.v1"
SERVICE_NAME = f"{PACKAGE}.EncoderService"
ENCODE_METHOD = f"/{SERVICE_NAME}/Encode"
RELEASE_METHOD = f"/{SERVICE_NAME}/ReleaseLeases"
ENCODE_STREAM_METHOD = f"/{SERVICE_NAME}/EncodeStream"
LOCAL_CHANNEL_METHOD = f"/{SERVICE_NAME}/LocalChannel"

# Inline receipts carry whole embeddings (a ViT output is 112.7 MB); gRPC's 4 MiB default would refuse
# them. 2 GiB - 1 is protobuf's hard limit for one message.
MAX_MESSAGE_BYTES = 2**31 - 1

EncodeRequest = encoder_pb2.EncodeRequest
EncodeResponse = encoder_pb2.EncodeResponse
ReleaseLeasesRequest = encoder_pb2.ReleaseLeasesRequest
ReleaseLeasesResponse = encoder_pb2.ReleaseLeasesResponse
StreamRequest = encoder_pb2.StreamRequest
StreamResponse = encoder_pb2.StreamResponse
StreamError = encoder_pb2.StreamError

# StreamRequest/StreamResponse field numbers of their bodies (encoder.proto).
STREAM_ENCODE_FIELD = 2  # StreamRequest.encode
STREAM_RELEASE_FIELD = 3  # StreamRequest.release
STREAM_OFFER_FIELD = 4  # StreamRequest.offer
STREAM_PLACEMENT_FIELD = 5  # StreamRequest.placement (a varint)
STREAM_RECEIPT_FIELD = 2  # StreamResponse.receipt
STREAM_ERROR_FIELD = 3  # StreamResponse.error


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


def stream_error_for(exc: BaseException) -> encoder_pb2.StreamError:
    """The StreamError a server answers on the EncodeStream for ``exc`` (the unary path's status, as a message)."""
    code, reason = status_for(exc)
    return StreamError(code=code.value[0], reason=reason.value, message=_details_for(exc))


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
