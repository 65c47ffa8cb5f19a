"""One exception hierarchy for all of tensorwire; every exception carries a machine-readable ``reason``.

Grouped by what the caller does next::

    TensorwireError                      base; .reason is a Reason (its value doubles as a metric label)
    ├── ConfigError (ValueError)         a setting is invalid; fix the configuration
    │   └── UnsafeWeights                a model directory holds only pickled weights; convert to safetensors
    ├── ClosedError                      the object was closed; build a new one
    ├── InvalidDescriptor (ValueError)   untrusted descriptor bytes or fields failed validation
    ├── ExportError                      the owner could not export (bad input, registration failure)
    │   └── PoolExhausted                no slot memory left after the shrink sequence
    ├── ReadError                        the reader could not fetch a descriptor's bytes
    │   ├── ReadTimeout (TimeoutError)   the read missed its deadline
    │   └── LeaseExpired                 the slot was released, reclaimed or reused (stale generation)
    ├── ControlPlaneError                the gRPC control plane failed
    │   ├── PeerUnavailable              the peer is down or unreachable (transient)
    │   ├── ProtocolError                the peer broke the protocol (unrequested RDMA receipt, bad receipt)
    │   └── InvalidPayload (ValueError)  a request or inline payload is malformed (INVALID_ARGUMENT)
    ├── DeadlineExceeded (TimeoutError)  the caller's own budget ran out (not the peer's fault)
    └── BroadcastError                   the CPU TP broadcaster failed
        ├── BootstrapError               set-up failed: handshake, permissions, path, parameters
        │   └── BootstrapTimeout (TimeoutError)
        ├── PeerClosed                   a peer died or closed its end
        ├── FrameMismatch                a frame did not match what the receiver expected
        └── BroadcastTimeout (TimeoutError)

Foreign exceptions (NIXL, gRPC, OSError) are translated once, at the layer edge, with ``raise ... from exc``.
Messages say what happened, with numbers, and what to try; keep their substrings stable (alerts grep them).
"""

from __future__ import annotations

import enum
from typing import Any


class Reason(str, enum.Enum):
    """Why an operation failed. Values are stable and used as low-cardinality metric labels."""

    UNKNOWN = "unknown"
    # configuration and lifecycle
    INVALID_CONFIG = "invalid_config"
    UNSAFE_WEIGHTS = "unsafe_weights"
    CLOSED = "closed"
    PROVIDER_UNAVAILABLE = "provider_unavailable"
    BIND_FAILED = "bind_failed"
    # descriptor validation
    DESCRIPTOR_MALFORMED = "descriptor_malformed"
    UNSUPPORTED_DTYPE = "unsupported_dtype"
    NEGATIVE_DIM = "negative_dim"
    SIZE_OVERFLOW = "size_overflow"
    NBYTES_MISMATCH = "nbytes_mismatch"
    MISALIGNED_OFFSET = "misaligned_offset"
    OUT_OF_BOUNDS = "out_of_bounds"
    SLOT_TOO_LARGE = "slot_too_large"
    EMPTY_LEASE_ID = "empty_lease_id"
    EMPTY_MANIFEST = "empty_manifest"
    OVERLAPPING_TENSORS = "overlapping_tensors"
    # export
    NOT_CONTIGUOUS = "not_contiguous"
    MIXED_DEVICES = "mixed_devices"
    WRONG_DEVICE = "wrong_device"
    EMPTY_EXPORT = "empty_export"
    REGISTRATION_FAILED = "registration_failed"
    POOL_EXHAUSTED = "pool_exhausted"
    EXPORT_FAILED = "export_failed"
    # read
    RDMA_READ_ERROR = "rdma_read_error"
    READ_TIMEOUT = "read_timeout"
    LEASE_EXPIRED = "lease_expired"
    STALE_GENERATION = "stale_generation"
    NOT_HELD = "not_held"  # a held-output store has no item under this grant (never held, released, expired)
    NOT_READY = "not_ready"  # the grant is known but its item is not held yet (being encoded): retry
    INCOMPATIBLE = "incompatible"  # the peer's encoder output layout differs (vLLM version, model, dtype, wire)
    UNTRUSTED_PRODUCER = "untrusted_producer"  # the endpoint is not on the reader's allow-list: never dialed
    PEER_DISCONNECTED = "peer_disconnected"
    METADATA_UNAVAILABLE = "metadata_unavailable"
    RESULT_MISMATCH = "result_mismatch"
    # control plane
    PEER_UNAVAILABLE = "peer_unavailable"
    PROTOCOL_ERROR = "protocol_error"
    UNREQUESTED_RDMA = "unrequested_rdma"
    INVALID_PAYLOAD = "invalid_payload"
    INVALID_REQUEST = "invalid_request"
    UNIMPLEMENTED = "unimplemented"
    DEADLINE_EXCEEDED = "deadline_exceeded"
    BUDGET_EXHAUSTED = "budget_exhausted"
    BREAKER_OPEN = "breaker_open"
    ASSEMBLY_MISMATCH = "assembly_mismatch"
    # service boundary
    CANCELLED = "cancelled"  # the caller cancelled or went away; the work stopped
    PEER_LIMIT = "peer_limit"  # a peer is over its share of in-flight calls or streams
    PEER_QUOTA = "peer_quota"  # a peer holds its quota of leased bytes: answered inline
    PERMISSION_DENIED = "permission_denied"  # the peer may not call this (not loopback, not authenticated)
    UNTRUSTED_LISTENER = "untrusted_listener"  # a plaintext loopback port is held by another user's process
    # broadcaster
    BOOTSTRAP_FAILED = "bootstrap_failed"
    BOOTSTRAP_TIMEOUT = "bootstrap_timeout"
    HANDSHAKE_FAILED = "handshake_failed"
    BAD_RANK = "bad_rank"
    DUPLICATE_RANK = "duplicate_rank"
    SESSION_MISMATCH = "session_mismatch"
    PARAMS_MISMATCH = "params_mismatch"
    INSECURE_PATH = "insecure_path"
    PATH_TOO_LONG = "path_too_long"
    PEER_CLOSED = "peer_closed"
    FRAME_MISMATCH = "frame_mismatch"
    BROADCAST_TIMEOUT = "broadcast_timeout"
    PATH_DISAGREEMENT = "path_disagreement"


class TensorwireError(Exception):
    """Base of every tensorwire exception. ``reason`` is a :class:`Reason`."""

    default_reason: Reason = Reason.UNKNOWN

    def __init__(self, message: str = "", *, reason: Reason | None = None) -> None:
        super().__init__(message)
        self.reason: Reason = reason if reason is not None else self.default_reason

    def __reduce__(self) -> tuple[Any, ...]:
        # The keyword-only reason is lost by default exception pickling (ranks, spawned workers need it).
        return (_rebuild, (type(self), str(self), self.reason.value))

    def __repr__(self) -> str:
        return f"{type(self).__name__}({str(self)!r}, reason={self.reason.value!r})"


def _rebuild(cls: type[TensorwireError], message: str, reason: str) -> TensorwireError:
    return cls(message, reason=Reason(reason))


class ConfigError(TensorwireError, ValueError):
    """A configuration value is invalid; the message names the field and the accepted range."""

    default_reason = Reason.INVALID_CONFIG


class UnsafeWeights(ConfigError):
    """A model directory offers only pickled weights (``pytorch_model.bin``, ...); only safetensors are loaded."""

    default_reason = Reason.UNSAFE_WEIGHTS


class ClosedError(TensorwireError):
    """A method was called on an object after close()."""

    default_reason = Reason.CLOSED


class InvalidDescriptor(TensorwireError, ValueError):
    """Descriptor bytes or fields failed validation before any memory was touched."""

    default_reason = Reason.DESCRIPTOR_MALFORMED


class ExportError(TensorwireError):
    """The owner could not export the given tensors; nothing stays leased."""

    default_reason = Reason.EXPORT_FAILED


class PoolExhausted(ExportError):
    """No slot could be allocated within pool_cap_bytes, even after shrinking every idle slot."""

    default_reason = Reason.POOL_EXHAUSTED


class ReadError(TensorwireError):
    """The reader could not fetch the bytes a descriptor names."""

    default_reason = Reason.RDMA_READ_ERROR


class ReadTimeout(ReadError, TimeoutError):
    """A read did not complete before its deadline.

    ``pending``: set by a provider whose transfer may still write the destination (a
    ``tensorwire.rdma.providers.base.PendingTransfer``); the reader quarantines the destination until it reports
    done. In-process only: it is not pickled.
    """

    default_reason = Reason.READ_TIMEOUT
    pending: object | None = None


class LeaseExpired(ReadError):
    """The lease was released or reclaimed, or the slot was reused (stale generation)."""

    default_reason = Reason.LEASE_EXPIRED


class ControlPlaneError(TensorwireError):
    """The gRPC control plane failed."""

    default_reason = Reason.PEER_UNAVAILABLE


class PeerUnavailable(ControlPlaneError):
    """The peer is down or unreachable; transient, may be retried elsewhere."""

    default_reason = Reason.PEER_UNAVAILABLE


class ProtocolError(ControlPlaneError):
    """The peer broke the protocol (for example an RDMA receipt that was never asked for)."""

    default_reason = Reason.PROTOCOL_ERROR


class InvalidPayload(ControlPlaneError, ValueError):
    """A request or inline tensor payload is malformed; maps to INVALID_ARGUMENT."""

    default_reason = Reason.INVALID_PAYLOAD


class DeadlineExceeded(TensorwireError, TimeoutError):
    """The caller's own time budget ran out; reported apart from endpoint faults."""

    default_reason = Reason.DEADLINE_EXCEEDED


class BroadcastError(TensorwireError):
    """The CPU tensor-parallel broadcaster failed; the message names the rank and the cause."""

    default_reason = Reason.BOOTSTRAP_FAILED


class BootstrapError(BroadcastError):
    """Broadcaster set-up failed (handshake, permissions, path length, parameter mismatch)."""

    default_reason = Reason.BOOTSTRAP_FAILED


class BootstrapTimeout(BootstrapError, TimeoutError):
    """Peers did not all connect within init_timeout_s."""

    default_reason = Reason.BOOTSTRAP_TIMEOUT


class PeerClosed(BroadcastError):
    """A peer died or closed its end of the link."""

    default_reason = Reason.PEER_CLOSED


class FrameMismatch(BroadcastError):
    """A received frame did not match what was expected (sequence, shape, dtype, size)."""

    default_reason = Reason.FRAME_MISMATCH


class BroadcastTimeout(BroadcastError, TimeoutError):
    """A broadcast stalled longer than timeout_s."""

    default_reason = Reason.BROADCAST_TIMEOUT


__all__ = [
    "Reason",
    "TensorwireError",
    "ConfigError",
    "UnsafeWeights",
    "ClosedError",
    "InvalidDescriptor",
    "ExportError",
    "PoolExhausted",
    "ReadError",
    "ReadTimeout",
    "LeaseExpired",
    "ControlPlaneError",
    "PeerUnavailable",
    "ProtocolError",
    "InvalidPayload",
    "DeadlineExceeded",
    "BroadcastError",
    "BootstrapError",
    "BootstrapTimeout",
    "PeerClosed",
    "FrameMismatch",
    "BroadcastTimeout",
]
