"""Provider registry and the provider interface (SPI), public for third-party providers.

Public: ``__all__`` and ``base`` (the ``Provider`` contract, checked by ``tensorwire.testing.conformance``).
Private: the built-ins ``_nixl`` and ``_none`` and their helpers. ``auto`` picks nixl when importable; more
providers with ``register_provider``. A provider is imported only when chosen.
"""

from __future__ import annotations

import importlib

from tensorwire.errors import ConfigError, ExportError, ReadError, Reason
from tensorwire.rdma._config import RdmaConfig
from tensorwire.rdma._registry import _REGISTRY, known_providers, register_provider
from tensorwire.rdma.providers.base import (
    ROLE_EXPORTER,
    ROLE_READER,
    PendingTransfer,
    Provider,
    ProviderStats,
    Range,
    Registration,
)

_AUTO_ORDER = ("nixl",)


def provider_class(name: str) -> type[Provider]:
    """The class registered as ``name``; ``ConfigError`` naming the known providers otherwise."""
    target = _REGISTRY.get(name)
    if target is None:
        raise ConfigError(f"unknown rdma provider {name!r}; known: {', '.join(['auto', *known_providers()])}")
    if callable(target):
        return target()
    module, _, attr = target.partition(":")
    cls: type[Provider] = getattr(importlib.import_module(module), attr)
    return cls


def _is_available(name: str) -> bool:
    try:
        return provider_class(name).available()
    except ImportError:
        return False


def available_providers() -> list[str]:
    """Names of the registered providers that can work in this process (``none`` never can)."""
    return [n for n in known_providers() if _is_available(n)]


def has_rdma(config: RdmaConfig | None = None) -> bool:
    """Whether ``config.provider`` (default ``auto``) resolves to a working provider."""
    name = (config or RdmaConfig()).provider
    if name == "auto":
        return any(_is_available(n) for n in _AUTO_ORDER)
    return _is_available(name)


def resolve_name(config: RdmaConfig) -> str:
    if config.provider != "auto":
        provider_class(config.provider)  # ConfigError for unknown names
        return config.provider
    for name in _AUTO_ORDER:
        if _is_available(name):
            return name
    return "none"


def create_provider(config: RdmaConfig, *, role: str) -> Provider:
    """Build the configured provider for ``role``; raises PROVIDER_UNAVAILABLE (ExportError/ReadError by role)."""
    name = resolve_name(config)
    cls = provider_class(name)
    if not cls.available():
        msg = f"rdma provider {name!r} is not available in this process (requested {config.provider!r})"
        err = ExportError if role == ROLE_EXPORTER else ReadError
        raise err(msg, reason=Reason.PROVIDER_UNAVAILABLE)
    return cls(config, role=role)


__all__ = [
    "ROLE_EXPORTER",
    "ROLE_READER",
    "PendingTransfer",
    "Provider",
    "ProviderStats",
    "Range",
    "Registration",
    "available_providers",
    "create_provider",
    "has_rdma",
    "known_providers",
    "provider_class",
    "register_provider",
    "resolve_name",
]
