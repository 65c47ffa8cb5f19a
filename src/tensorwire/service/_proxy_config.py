"""``ProxyConfig``: the settings of ``serve-proxy``, apart from the proxy so that the CLI builds its flags without
importing gRPC servers or torch."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from tensorwire._grpc.limits import ServerLimits
from tensorwire._grpc.tls import TlsConfig
from tensorwire.errors import ConfigError
from tensorwire.mm._config import TransportConfig
from tensorwire.rdma import RdmaConfig
from tensorwire.service._endpoint import parse_endpoint


def _default(cls: type, name: str) -> Any:
    """A field's default, read without building the dataclass (RdmaConfig's checks import the providers)."""
    return cls.__dataclass_fields__[name].default  # type: ignore[attr-defined]


# Default rounds over the workers per Encode: a request can outlive one worker's fault and meet the next one
# (the worker it retried on dies while the first is back), so later rounds ask the recovered one again; and with
# one worker left, a transient fault on its path (a broken receipt) can hit twice in a row.
ROUNDS = 3


@dataclass(frozen=True)
class ProxyConfig:
    """Settings of ``serve-proxy``. Timeouts default to the transport's, so proxy and workers agree."""

    workers: tuple[str, ...] = ()
    # Attempts per Encode, in rounds over the workers (UP ones first); 0: three rounds of every worker. Attempts
    # also stop when the caller's deadline is spent.
    max_attempts: int = 0
    worker_timeout_ms: int = _default(TransportConfig, "worker_timeout_ms")
    rpc_timeout_margin_ms: int = _default(TransportConfig, "rpc_timeout_margin_ms")
    release_timeout_ms: int = _default(TransportConfig, "release_timeout_ms")
    # Used for the route TTL when workers are not asked (check_workers=False); else the workers' largest.
    slot_gc_timeout_ms: int = _default(RdmaConfig, "slot_gc_timeout_ms")
    # Ask every worker for WorkerInfo at start-up (RDMA port check, route TTL); wait this long for each.
    check_workers: bool = True
    worker_wait_s: float = 30.0
    # Encode forwards in flight at once (the rest wait within their deadline); releases never wait for these.
    server_threads: int = 16
    # Worker health probes (grpc.health.v1 Check): period, per-probe timeout, unanswered probes before DOWN.
    probe_interval_s: float = 1.0
    probe_timeout_s: float = 1.0
    probe_failures: int = 2
    # Check every receipt as a reader would before forwarding it; a broken one is retried on another worker.
    check_receipts: bool = True
    tls: TlsConfig = field(default_factory=TlsConfig)
    limits: ServerLimits = field(default_factory=ServerLimits)

    def __post_init__(self) -> None:
        if not self.workers:
            raise ConfigError("the proxy needs at least one --worker HOST:PORT")
        if len(set(self.workers)) != len(self.workers):
            raise ConfigError(f"--worker lists a worker twice: {list(self.workers)}")
        for w in self.workers:
            parse_endpoint(w, "--worker")
        for name in ("max_attempts",):
            if getattr(self, name) < 0:
                raise ConfigError(f"{name}={getattr(self, name)} must be >= 0")
        for name in ("worker_timeout_ms", "release_timeout_ms", "slot_gc_timeout_ms", "server_threads"):
            if getattr(self, name) <= 0:
                raise ConfigError(f"{name}={getattr(self, name)} must be > 0")
        for name in ("worker_wait_s", "probe_interval_s", "probe_timeout_s"):
            if getattr(self, name) <= 0:
                raise ConfigError(f"{name}={getattr(self, name)} must be > 0")
        if self.probe_failures < 1:
            raise ConfigError(f"probe_failures={self.probe_failures} must be >= 1")
        if not isinstance(self.tls, TlsConfig) or not isinstance(self.limits, ServerLimits):
            raise ConfigError("tls must be a TlsConfig and limits a ServerLimits")

    @property
    def attempts(self) -> int:
        return self.max_attempts or ROUNDS * len(self.workers)


__all__ = ["ROUNDS", "ProxyConfig"]
