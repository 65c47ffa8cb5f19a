"""TransportConfig: every knob of the encoder-output transport, with its default, in one place.

Precedence: argument > CLI flag > environment > default. ``from_env`` reads ``MM_TRANSPORT_MODE`` (the rollback
switch), ``TENSORWIRE_MM_<FIELD>`` and the nested ``TENSORWIRE_MM_RDMA_<FIELD>`` / ``TENSORWIRE_MM_TLS_<FIELD>``.
The CLI builds its flags from :func:`fields_for_cli`.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Literal, cast

from tensorwire._grpc.limits import ENV_LIMITS_PREFIX, ServerLimits
from tensorwire._grpc.tls import ENV_TLS_PREFIX, TlsConfig
from tensorwire.errors import ConfigError
from tensorwire.rdma import RdmaConfig

MODE_AUTO = "auto"
MODE_GRPC = "grpc"
MODES: tuple[str, ...] = (MODE_AUTO, MODE_GRPC)
Mode = Literal["auto", "grpc"]
LOCAL_CHANNELS: tuple[str, ...] = ("auto", "on", "off")
LocalChannel = Literal["auto", "on", "off"]

ENV_MODE = "MM_TRANSPORT_MODE"
ENV_PREFIX = "TENSORWIRE_MM_"
ENV_RDMA_PREFIX = "TENSORWIRE_MM_RDMA_"
# The nested dataclasses and the environment prefix of their fields.
NESTED: dict[str, tuple[type, str]] = {
    "rdma": (RdmaConfig, ENV_RDMA_PREFIX),
    "tls": (TlsConfig, ENV_TLS_PREFIX),
    "limits": (ServerLimits, ENV_LIMITS_PREFIX),
}
DEFAULT_STREAM_CAP = 64


@dataclass(frozen=True)
class TransportConfig:
    """Settings of both ends of the transport (each end reads the fields it needs).

    mode: ``auto`` (the client advertises RDMA, the encoder prefers it, inline is the fallback) or ``grpc``
    (always inline; works when set on either side alone).
    """

    mode: Mode = "auto"
    rdma: RdmaConfig = field(default_factory=RdmaConfig)
    # Both sides: TLS / mTLS of the control plane (docs/security.md), and the server's limits (the client reads
    # its keepalive and stream idle settings from the same object).
    tls: TlsConfig = field(default_factory=TlsConfig)
    limits: ServerLimits = field(default_factory=ServerLimits)
    # Deadlines. A fetch's budget is max over items of (item timeout_ms or worker_timeout_ms) plus the margin.
    worker_timeout_ms: int = 120_000
    rpc_timeout_margin_ms: int = 5_000
    # Kept back from the RDMA read for the synchronous release and the one inline fallback.
    fallback_reserve_ms: int = 2_000
    # Below this remaining budget the inline fallback is not tried (it would only time out); the original
    # error is returned instead.
    min_fallback_ms: int = 500
    # Lease release (client side).
    release_timeout_ms: int = 1_000
    release_queue_max: int = 1_024
    release_shutdown_ms: int = 1_000
    # Circuit breaker per endpoint and per worker (client side).
    failures_to_open: int = 3
    open_seconds: float = 30.0
    # Control plane (client side): Encode (and the success-path release) over a pool of open EncodeStream calls
    # instead of one unary RPC each; at most control_stream_pool streams per transport, unary beyond that.
    # False: unary Encode and ReleaseLeases RPCs only. An encoder without EncodeStream is detected and
    # remembered; one that refuses a stream (over its cap) is not asked again for open_seconds.
    control_stream: bool = True
    control_stream_pool: int = 8
    # Encoder side: exporter start-up retries back off from init_backoff_ms, doubling up to init_backoff_max_ms.
    init_backoff_ms: int = 200
    init_backoff_max_ms: int = 30_000
    # Encoder side: Encode calls (unary or on a stream) that run at once; the rest wait for one within their
    # deadline. ReleaseLeases, WorkerInfo and health never wait for these (GrpcHost lanes).
    server_threads: int = 8
    # Encoder side: EncodeStream calls open at once. Each holds a server thread (of limits.max_inflight_calls)
    # while open, not a work slot; a stream over the cap is refused with RESOURCE_EXHAUSTED and its client uses
    # unary. 0: DEFAULT_STREAM_CAP (64), at most half of limits.max_inflight_calls.
    server_stream_cap: int = 0
    # Encoder side: bytes of exported slots one peer may hold leased at once; over it, its outputs come inline
    # until it releases (one client cannot pin the pool). 0: half of rdma.pool_cap_bytes.
    peer_leased_bytes: int = 0
    worker_id: str = ""  # empty: "<hostname>-<pid>"
    # Same-host control channel: "auto" on the worker listens on a Unix socket in a private directory
    # (0700, socket 0600, peers of another uid refused) and tells same-host clients its path over gRPC, unless its
    # gRPC listener requires client certificates (mTLS): the socket's trust is "same uid", and an operator who
    # asked for certificates gets them everywhere; "on" listens with mTLS too. "auto"/"on" on the client asks once
    # and then sends Encodes and success-path releases there (gRPC stays the way in, the cross-host path and the
    # fallback). "off" on either side: gRPC only.
    local_channel: LocalChannel = "auto"
    local_channel_dir: str = ""  # empty: $XDG_RUNTIME_DIR/tensorwire, else $TMPDIR or /tmp /tensorwire-<uid>
    local_channel_conns: int = 64  # worker: connections open at once (each holds a thread); one more is refused
    # Worker: a connection with no request for this long is ended (it held a thread and one of the conns); the
    # client's pool sees it gone and opens a new one for its next fetch.
    local_channel_idle_ms: int = 300_000
    # Client: how long the first fetch waits for the channel's discovery (one LocalChannel RPC), and how long
    # opening a connection (connect + the worker's hello) may take; past either, that fetch uses gRPC.
    local_channel_wait_ms: int = 1_000
    # Placed outputs on the same-host channel (docs/transport.md, "Placed outputs"): the client lends the worker
    # receive buffers (a sealed memfd, or a dedicated CUDA allocation shared by IPC) and the worker writes its
    # output there. Client: at most this many bytes of receive buffers per transport (allocated as fetches need
    # them); worker: at most this many bytes mapped per connection. 0 on either side: off.
    local_placement_bytes: int = 1 << 30

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise ConfigError(f"mode={self.mode!r} is not one of {list(MODES)} (set {ENV_MODE} or the CLI's --mode)")
        for name, (cls, _) in NESTED.items():
            if not isinstance(getattr(self, name), cls):
                raise ConfigError(f"{name} must be a {cls.__name__}, got {type(getattr(self, name)).__name__}")
        positive = (
            "worker_timeout_ms",
            "release_timeout_ms",
            "release_queue_max",
            "failures_to_open",
            "init_backoff_ms",
            "init_backoff_max_ms",
            "server_threads",
            "release_shutdown_ms",
            "control_stream_pool",
            "local_channel_conns",
            "local_channel_idle_ms",
            "local_channel_wait_ms",
        )
        for name in positive:
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise ConfigError(f"{name}={value!r} must be a positive integer")
        for name in (
            "rpc_timeout_margin_ms",
            "fallback_reserve_ms",
            "min_fallback_ms",
            "server_stream_cap",
            "peer_leased_bytes",
            "local_placement_bytes",
        ):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ConfigError(f"{name}={value!r} must be a non-negative integer")
        if (
            not isinstance(self.open_seconds, (int, float))
            or isinstance(self.open_seconds, bool)
            or self.open_seconds <= 0
        ):
            raise ConfigError(f"open_seconds={self.open_seconds!r} must be a positive number")
        if self.local_channel not in LOCAL_CHANNELS:
            raise ConfigError(f"local_channel={self.local_channel!r} is not one of {list(LOCAL_CHANNELS)}")
        if not isinstance(self.control_stream, bool):
            raise ConfigError(f"control_stream={self.control_stream!r} must be a bool")
        if self.server_stream_cap > self.limits.max_inflight_calls // 2:
            raise ConfigError(
                f"server_stream_cap={self.server_stream_cap} must be <= half of max_inflight_calls="
                f"{self.limits.max_inflight_calls}: every open stream holds a server thread, and unary "
                "calls, releases and health need theirs"
            )
        if self.init_backoff_max_ms < self.init_backoff_ms:
            raise ConfigError(
                f"init_backoff_max_ms={self.init_backoff_max_ms} must be >= init_backoff_ms={self.init_backoff_ms}"
            )

    @property
    def default_rpc_timeout_ms(self) -> int:
        """The client deadline when no item names its own budget (120 s + 5 s by default)."""
        return self.worker_timeout_ms + self.rpc_timeout_margin_ms

    @property
    def effective_server_stream_cap(self) -> int:
        """How many EncodeStream calls an encoder keeps open at once (server_stream_cap, or the default)."""
        return self.server_stream_cap or min(DEFAULT_STREAM_CAP, self.limits.max_inflight_calls // 2)

    @property
    def effective_peer_leased_bytes(self) -> int:
        """The per-peer lease quota in bytes (peer_leased_bytes, or half of the pool)."""
        return self.peer_leased_bytes or int(self.rdma.pool_cap_bytes) // 2

    def with_mode(self, mode: str) -> TransportConfig:
        """This config with ``mode`` (a CLI or environment string: ``__post_init__`` raises ConfigError unless it
        is one of ``MODES``)."""
        return dataclasses.replace(self, mode=cast(Mode, mode))

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None, **overrides: Any) -> TransportConfig:
        """Builds a config from the environment; keyword ``overrides`` win over it."""
        env = os.environ if environ is None else environ
        values: dict[str, Any] = {}
        if ENV_MODE in env:
            values["mode"] = env[ENV_MODE].strip().lower()
        for f in dataclasses.fields(cls):
            if f.name == "mode" or f.name in NESTED:
                continue
            key = ENV_PREFIX + f.name.upper()
            if key in env:
                values[f.name] = _convert(key, env[key], _default_of(cls, f))
        for name, (nested_cls, prefix) in NESTED.items():
            base = overrides.get(name) or nested_cls()
            nested = dataclass_from_env(nested_cls, prefix, env, base=base)
            if nested != base:
                values[name] = nested
        values.update(overrides)
        return cls(**values)


def dataclass_from_env(
    cls: type[Any], prefix: str, environ: Mapping[str, str] | None = None, *, base: Any = None
) -> Any:
    """``base`` (default: ``cls()``) with every scalar field that ``<prefix><FIELD>`` sets in the environment."""
    env = os.environ if environ is None else environ
    base = base if base is not None else cls()
    values: dict[str, Any] = {}
    for f in dataclasses.fields(base):
        key = prefix + f.name.upper()
        if key in env:
            values[f.name] = _convert(key, env[key], getattr(base, f.name))
    if not values:
        return base
    try:
        return dataclasses.replace(base, **values)
    except ConfigError:
        raise
    except (TypeError, ValueError) as exc:
        raise ConfigError(f"invalid {prefix}* setting: {exc}") from exc


def _default_of(cls: type, f: dataclasses.Field[Any]) -> Any:
    if f.default is not dataclasses.MISSING:
        return f.default
    if f.default_factory is not dataclasses.MISSING:
        return f.default_factory()
    return None


def _convert(key: str, raw: str, default: Any) -> Any:
    try:
        if isinstance(default, bool):
            if raw.strip().lower() in ("1", "true", "yes", "on"):
                return True
            if raw.strip().lower() in ("0", "false", "no", "off"):
                return False
            raise ValueError(raw)
        if isinstance(default, int):
            return int(raw, 0)
        if isinstance(default, float):
            return float(raw)
    except ValueError as exc:
        raise ConfigError(f"{key}={raw!r} is not a valid {type(default).__name__}") from exc
    return raw


def fields_for_cli() -> list[tuple[str, Any, str]]:
    """(field name, default, type name) of every scalar field, for building CLI flags from the dataclass."""
    out = []
    for f in dataclasses.fields(TransportConfig):
        if f.name in NESTED:
            continue
        default = _default_of(TransportConfig, f)
        out.append((f.name, default, type(default).__name__))
    return out


__all__ = [
    "TransportConfig",
    "MODES",
    "MODE_AUTO",
    "MODE_GRPC",
    "ENV_MODE",
    "NESTED",
    "dataclass_from_env",
    "fields_for_cli",
]
