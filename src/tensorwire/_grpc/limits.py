"""ServerLimits: what one gRPC server (an encoder worker or the proxy) lets its callers hold, and for how long.

Every field is enforced by ``GrpcHost``:

- size: a request is at most ``max_request_bytes`` = ``max_request_items`` x (``max_item_bytes`` + per-item
  framing) + request framing; gRPC refuses a larger message from its length prefix, before buffering it, and the
  service refuses more items or a larger item than configured (INVALID_ARGUMENT);
- calls: at most ``max_inflight_calls`` calls in progress on the server (each holds one server thread; one more
  is refused by gRPC with RESOURCE_EXHAUSTED) and ``max_inflight_per_peer`` per peer (``_scope`` peer keys), at
  most ``max_streams_per_peer`` of them EncodeStreams (a stream is an in-flight call too);
- time: a call whose request message has not arrived ``request_timeout_ms`` after its headers is cancelled; an
  EncodeStream that carries nothing for ``stream_idle_timeout_ms`` is ended (its client opens a new one, and
  does not reuse a stream idle for half of that); a connection without calls is closed after
  ``max_connection_idle_ms``, one whose TLS handshake takes over ``handshake_timeout_ms`` is dropped, and the
  server pings every ``keepalive_time_ms`` to find dead peers;
- per connection: at most ``max_streams_per_connection`` concurrent HTTP/2 streams (gRPC calls).

``trusted_forwarders`` lists peer keys (a proxy's ``cn:<name>`` or ``ip:<address>``) whose ``tensorwire-peer``
metadata is believed: calls they forward count against the named caller, not against the forwarder.

Environment: ``TENSORWIRE_MM_<FIELD>``; flags ``--<field>``.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from tensorwire.errors import ConfigError

# Protobuf framing around one item's bytes (MultimodalInput: tag + length varints, kind, params) and around the
# request (support_rdma, deadline, excluded workers); generous, so the limit is about the payload.
ITEM_FRAMING_BYTES = 4096
REQUEST_FRAMING_BYTES = 64 * 1024
# Inline receipts carry whole embeddings (a ViT output is 112.7 MB): what a server sends stays at protobuf's limit.
MAX_SEND_BYTES = 2**31 - 1


@dataclass(frozen=True)
class ServerLimits:
    """Per-server limits; see the module docstring for what each bounds and how."""

    max_request_items: int = 16
    max_item_bytes: int = 8 * 1024 * 1024
    # Generous per peer: every plaintext caller of one host (and everything behind a proxy) is one peer.
    max_inflight_calls: int = 512
    max_inflight_per_peer: int = 128
    max_streams_per_peer: int = 32
    request_timeout_ms: int = 2_000
    stream_idle_timeout_ms: int = 120_000
    keepalive_time_ms: int = 30_000
    keepalive_timeout_ms: int = 10_000
    max_connection_idle_ms: int = 600_000
    handshake_timeout_ms: int = 10_000
    max_streams_per_connection: int = 128
    trusted_forwarders: str = ""  # comma-separated peer keys

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if f.name == "trusted_forwarders":
                if not isinstance(value, str):
                    raise ConfigError(f"trusted_forwarders={value!r} must be a comma-separated string")
                continue
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise ConfigError(f"{f.name}={value!r} must be a positive integer")
        if self.max_inflight_per_peer > self.max_inflight_calls:
            raise ConfigError(
                f"max_inflight_per_peer={self.max_inflight_per_peer} must be <= max_inflight_calls="
                f"{self.max_inflight_calls}"
            )
        if self.max_request_bytes > MAX_SEND_BYTES:
            raise ConfigError(
                f"max_request_items x max_item_bytes = {self.max_request_bytes} bytes is over "
                f"protobuf's {MAX_SEND_BYTES}-byte message limit"
            )

    @property
    def max_request_bytes(self) -> int:
        """The largest request message a server accepts."""
        return self.max_request_items * (self.max_item_bytes + ITEM_FRAMING_BYTES) + REQUEST_FRAMING_BYTES

    @property
    def forwarders(self) -> frozenset[str]:
        return frozenset(k.strip() for k in self.trusted_forwarders.split(",") if k.strip())

    def server_options(self) -> list[tuple[str, Any]]:
        """gRPC server arguments for these limits."""
        return [
            ("grpc.max_receive_message_length", self.max_request_bytes),
            ("grpc.max_send_message_length", MAX_SEND_BYTES),
            ("grpc.max_concurrent_streams", self.max_streams_per_connection),
            ("grpc.keepalive_time_ms", self.keepalive_time_ms),
            ("grpc.keepalive_timeout_ms", self.keepalive_timeout_ms),
            # Clients ping every keepalive_time_ms (client_options); half of it is allowed, faster is a strike.
            ("grpc.http2.min_recv_ping_interval_without_data_ms", max(1, self.keepalive_time_ms // 2)),
            ("grpc.max_connection_idle_ms", self.max_connection_idle_ms),
            ("grpc.server_handshake_timeout_ms", self.handshake_timeout_ms),
        ]

    def client_options(self) -> list[tuple[str, Any]]:
        """gRPC channel arguments of a client that talks to a server with these limits."""
        return [
            ("grpc.max_receive_message_length", MAX_SEND_BYTES),
            ("grpc.max_send_message_length", MAX_SEND_BYTES),
            ("grpc.keepalive_time_ms", self.keepalive_time_ms),
            ("grpc.keepalive_timeout_ms", self.keepalive_timeout_ms),
            ("grpc.keepalive_permit_without_calls", 0),
        ]


ENV_LIMITS_PREFIX = "TENSORWIRE_MM_"

__all__ = ["ENV_LIMITS_PREFIX", "MAX_SEND_BYTES", "ServerLimits"]
