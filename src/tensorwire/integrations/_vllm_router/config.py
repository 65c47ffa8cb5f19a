"""The EPD router's settings: one dataclass, the defaults in one place, checked at construction."""

from __future__ import annotations

import ipaddress
import math
import os
from dataclasses import dataclass
from urllib.parse import urlsplit

from tensorwire.errors import ConfigError

FALLBACKS = ("local", "fail")
LOOPS = ("auto", "asyncio", "uvloop")

_SECONDS = (
    "connect_timeout_s",
    "encoder_first_byte_timeout_s",
    "encoder_timeout_s",
    "llm_timeout_s",
    "probe_interval_s",
    "probe_timeout_s",
    "idle_timeout_s",
    "body_timeout_s",
    "write_timeout_s",
    "upstream_keepalive_s",
)


@dataclass(frozen=True)
class RouterConfig:
    """Where the router listens, which instances it sends to, how long it waits, and how it stops.

    Instances: ``encoders`` are base URLs (``http(s)://host:port``) of the encoder instances (``vllm serve`` with
    the connector as ``ec_producer``), ``llms`` those of the LLM instances (``ec_consumer``); both round-robin over
    the instances that are up. Each is called ``encoder-N`` / ``llm-N`` (its position) in answers, error bodies and
    metric labels, so clients never see an internal address; the log maps names to URLs at start-up.

    Upstream waits: ``connect_timeout_s`` bounds one TCP (and TLS) connect; ``encoder_first_byte_timeout_s`` the
    wait for an encoder instance's answer to start (its answer is one token: a healthy instance starts it within
    its encode time), ``encoder_timeout_s`` a whole encoder call; ``llm_timeout_s`` each wait for the next bytes of
    an LLM instance's answer (the status line, then every chunk). ``probe_interval_s`` / ``probe_timeout_s``: every
    instance's ``GET /health`` is probed this often, each probe bounded; an instance that failed a probe or a call
    is kept out until a probe passes. ``upstream_connections`` caps the pooled keep-alive connections per instance;
    ``upstream_keepalive_s`` closes an idle pooled one (below the instances' own keep-alive: uvicorn's is 5 s).
    ``upstream_ca`` verifies https instances (default: the system CAs); ``upstream_cert``/``upstream_key`` are a
    client certificate for instances that require one.

    Client side: ``max_connections`` caps open client connections (one over it is answered 503 and closed);
    ``backlog`` is the listen queue; ``idle_timeout_s`` closes a connection with no complete request head for
    that long (an idle keep-alive connection, or one sending its headers too slowly); ``body_timeout_s`` bounds
    reading one request body; ``write_timeout_s`` each write to a client that stopped reading; ``max_body_bytes``
    caps a body (413 above it). ``tls_cert``/``tls_key``: serve HTTPS; without them a non-loopback ``host`` needs
    ``insecure``.

    Stopping (SIGTERM/SIGINT): ``/health`` answers 503 for ``drain_s`` while requests are still served, then the
    listener closes and running requests and streams get ``grace_s`` to finish.

    ``loop``: the event loop, ``uvloop`` or ``asyncio`` (``auto``: uvloop when installed, as in vLLM's
    environment).

    ``fallback``: when no encoder instance answered, ``local`` forwards the request to the LLM instance without
    ``ec_transfer_params`` (it still carries the media, so the LLM instance encodes it), ``fail`` answers 503.
    """

    encoders: tuple[str, ...]
    llms: tuple[str, ...]
    host: str = "127.0.0.1"
    port: int = 8000
    connect_timeout_s: float = 5.0
    encoder_first_byte_timeout_s: float = 30.0
    encoder_timeout_s: float = 120.0
    llm_timeout_s: float = 600.0
    probe_interval_s: float = 2.0
    probe_timeout_s: float = 2.0
    upstream_connections: int = 1024
    upstream_keepalive_s: float = 4.0
    upstream_ca: str = ""
    upstream_cert: str = ""
    upstream_key: str = ""
    fallback: str = "local"
    max_body_bytes: int = 64 * 1024 * 1024
    max_connections: int = 8192
    backlog: int = 4096
    idle_timeout_s: float = 30.0
    body_timeout_s: float = 60.0
    write_timeout_s: float = 60.0
    drain_s: float = 2.0
    grace_s: float = 30.0
    tls_cert: str = ""
    tls_key: str = ""
    insecure: bool = False
    loop: str = "auto"

    def __post_init__(self) -> None:
        object.__setattr__(self, "encoders", tuple(self.encoders))
        object.__setattr__(self, "llms", tuple(self.llms))
        if not self.llms:
            raise ConfigError("the router needs at least one LLM instance (--llm http://host:port)")
        if not self.encoders:
            raise ConfigError("the router needs at least one encoder instance (--encoder http://host:port)")
        for url in (*self.encoders, *self.llms):
            check_url(url)
        for name in _SECONDS:
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
                raise ConfigError(f"RouterConfig.{name}={value!r}: expected a positive number of seconds")
        for name in ("drain_s", "grace_s"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value < 0:
                raise ConfigError(f"RouterConfig.{name}={value!r}: expected seconds >= 0")
        if self.loop not in LOOPS:
            raise ConfigError(f"RouterConfig.loop={self.loop!r}: expected one of {', '.join(LOOPS)}")
        if self.fallback not in FALLBACKS:
            raise ConfigError(f"RouterConfig.fallback={self.fallback!r}: expected one of {', '.join(FALLBACKS)}")
        if not isinstance(self.port, int) or not 0 <= self.port <= 65535:
            raise ConfigError(f"RouterConfig.port={self.port!r}: expected 0..65535 (0: any free port)")
        for name, low in (("max_body_bytes", 1), ("max_connections", 1), ("backlog", 1), ("upstream_connections", 1)):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < low:
                raise ConfigError(f"RouterConfig.{name}={value!r}: expected a positive integer")
        if bool(self.tls_cert) != bool(self.tls_key):
            raise ConfigError("RouterConfig: tls_cert and tls_key go together (the listener's certificate and key)")
        if bool(self.upstream_cert) != bool(self.upstream_key):
            raise ConfigError("RouterConfig: upstream_cert and upstream_key go together (a client certificate)")
        for name in ("tls_cert", "tls_key", "upstream_ca", "upstream_cert", "upstream_key"):
            path = getattr(self, name)
            if path and not os.path.isfile(path):
                raise ConfigError(f"RouterConfig.{name}={path!r}: no such file")
        if not self.tls_cert and not self.insecure and not is_loopback_host(self.host):
            raise ConfigError(
                f"refusing a plaintext router on {self.host!r} (not loopback): give it a certificate "
                "(--tls-cert, --tls-key) or pass --insecure (a network you trust)"
            )

    def name_of(self, role: str, index: int) -> str:
        """``encoder-N`` / ``llm-N``: what answers, errors and metrics call an instance (never its URL)."""
        return f"{role}-{index}"


def is_loopback_host(host: str) -> bool:
    """True for ``localhost`` and loopback IP literals (127.0.0.0/8, ::1); False for wildcards and other names."""
    host = host.strip().strip("[]")
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def check_url(url: str) -> None:
    """An instance's base URL: ``http(s)://host:port`` with no path beyond ``/``, no query, no credentials."""
    parts = urlsplit(url)
    try:
        port = parts.port
    except ValueError as exc:
        raise ConfigError(f"instance URL {url!r}: {exc}") from exc
    if (
        parts.scheme not in ("http", "https")
        or not parts.hostname
        or parts.path not in ("", "/")
        or parts.query
        or parts.fragment
        or parts.username is not None
        or port is None
    ):
        raise ConfigError(f"instance URL {url!r}: expected http(s)://host:port (the address `vllm serve` listens on)")
