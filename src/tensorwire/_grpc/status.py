"""Errors across gRPC: one table from ``Reason`` to status code and back, both directions.

A server ends a failed call with :func:`abort_with`: the status :func:`status_for` picks, plus a
``tensorwire-reason`` trailing-metadata entry carrying the :class:`~tensorwire.errors.Reason` value. A client
rebuilds the exception with :func:`error_from_rpc` (or :func:`error_from_status` for a status that came another
way), so it raises the class and reason the server raised. ``grpc.RpcError`` never leaves the caller's layer.
"""

from __future__ import annotations

from collections.abc import Iterable

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

REASON_METADATA_KEY = "tensorwire-reason"
# Set (with RESOURCE_EXHAUSTED) when a server refuses a new stream because it has its cap of open streams. The
# refusal happens before any message is read, so the caller may send that request over unary.
STREAM_REFUSED_METADATA = ("tensorwire-stream", "refused")

_STATUS_BY_VALUE: dict[int, grpc.StatusCode] = {code.value[0]: code for code in grpc.StatusCode}


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


def error_from_status(
    code: grpc.StatusCode | None, details: str | None, reason: Reason | None, what: str
) -> TensorwireError:
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
