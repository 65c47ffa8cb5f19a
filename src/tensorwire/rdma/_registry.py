"""The provider names: which provider class each name loads, as ``"module:Class"`` or a factory.

A leaf (it imports only ``tensorwire.errors``), so ``RdmaConfig`` can check a name and the providers package can
load a class without either importing the other. Entries are resolved only when a provider is chosen, so
``tensorwire.rdma`` never imports NIXL unless it is used.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from tensorwire.errors import ConfigError

# name -> "module:Class" or a zero-argument factory returning the class. register_provider() adds third-party ones.
_REGISTRY: dict[str, str | Callable[[], type[Any]]] = {
    "nixl": "tensorwire.rdma.providers._nixl:NixlProvider",
    "none": "tensorwire.rdma.providers._none:NoneProvider",
}


def register_provider(name: str, target: str | Callable[[], type[Any]]) -> None:
    """Add a provider under ``name`` ("module:Class" or a zero-argument factory returning the class)."""
    if not name or name == "auto":
        raise ConfigError(f"provider name {name!r} is reserved or empty")
    _REGISTRY[name] = target


def known_providers() -> list[str]:
    return sorted(_REGISTRY)
