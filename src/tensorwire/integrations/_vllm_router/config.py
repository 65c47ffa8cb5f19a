"""The EPD router's settings: one dataclass, the defaults in one place, checked at construction."""

from __future__ import annotations

import math
from dataclasses import dataclass
from urllib.parse import urlsplit

from tensorwire.errors import ConfigError

FALLBACKS = ("local", "fail")


@dataclass(frozen=True)
class RouterConfig:
    """Where the router listens, which instances it sends to, and how long it waits for them.

    ``encoders``: base URLs (``http://host:port``) of the encoder instances (``vllm serve`` with the connector as
    ``ec_producer``), tried round-robin; ``llms``: the LLM instances (``ec_consumer``), round-robin too.
    ``connect_timeout_s`` bounds one TCP connect; ``encoder_timeout_s`` bounds a whole encoder call (connect to the
    last byte of its answer); ``llm_timeout_s`` bounds a non-streamed LLM answer as a whole and, for a streamed
    one, the wait for each next chunk. ``encoder_cooldown_s``: an encoder instance that failed (refused,
    timed out, answered 5xx) is tried after the others for this long. ``fallback``: what to do when no encoder
    instance answered: ``local`` forwards the request to the LLM instance without ``ec_transfer_params`` (it
    still carries the media, so the LLM instance encodes it), ``fail`` answers 503. ``max_body_bytes`` caps a
    client's request body (413 above it).
    """

    encoders: tuple[str, ...]
    llms: tuple[str, ...]
    host: str = "127.0.0.1"
    port: int = 8000
    connect_timeout_s: float = 5.0
    encoder_timeout_s: float = 120.0
    llm_timeout_s: float = 600.0
    encoder_cooldown_s: float = 10.0
    fallback: str = "local"
    max_body_bytes: int = 64 * 1024 * 1024
    threads: int = 64

    def __post_init__(self) -> None:
        object.__setattr__(self, "encoders", tuple(self.encoders))
        object.__setattr__(self, "llms", tuple(self.llms))
        if not self.llms:
            raise ConfigError("the router needs at least one LLM instance (--llm http://host:port)")
        if not self.encoders:
            raise ConfigError("the router needs at least one encoder instance (--encoder http://host:port)")
        for url in (*self.encoders, *self.llms):
            check_url(url)
        for name in ("connect_timeout_s", "encoder_timeout_s", "llm_timeout_s", "encoder_cooldown_s"):
            value = getattr(self, name)
            if not isinstance(value, (int, float)) or not math.isfinite(value) or value < 0 or (
                    value == 0 and name != "encoder_cooldown_s"):
                raise ConfigError(f"RouterConfig.{name}={value!r}: expected a positive number of seconds")
        if self.fallback not in FALLBACKS:
            raise ConfigError(f"RouterConfig.fallback={self.fallback!r}: expected one of {', '.join(FALLBACKS)}")
        if not isinstance(self.port, int) or not 0 <= self.port <= 65535:
            raise ConfigError(f"RouterConfig.port={self.port!r}: expected 0..65535 (0: any free port)")
        if not isinstance(self.max_body_bytes, int) or self.max_body_bytes < 1:
            raise ConfigError(f"RouterConfig.max_body_bytes={self.max_body_bytes!r}: expected a positive integer")
        if not isinstance(self.threads, int) or not 1 <= self.threads <= 4096:
            raise ConfigError(f"RouterConfig.threads={self.threads!r}: expected 1..4096")


def check_url(url: str) -> None:
    """An instance's base URL: ``http(s)://host:port`` with no path beyond ``/``, no query, no credentials."""
    parts = urlsplit(url)
    try:
        port = parts.port
    except ValueError as exc:
        raise ConfigError(f"instance URL {url!r}: {exc}") from exc
    if parts.scheme not in ("http", "https") or not parts.hostname or parts.path not in ("", "/") or parts.query \
            or parts.fragment or parts.username is not None or port is None:
        raise ConfigError(f"instance URL {url!r}: expected http://host:port (the address `vllm serve` listens on)")
