"""Lazy package exports: a package names its public objects and the modules that define them, and each module
is imported on first attribute access, so importing the package stays cheap (no torch or grpc)."""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Any


def lazy_exports(package: str, names: dict[str, str], namespace: dict[str, Any]) -> Callable[[str], Any]:
    """The module-level ``__getattr__`` for ``package``: ``names`` maps a public name to its defining module."""

    def __getattr__(name: str) -> Any:
        module = names.get(name)
        if module is None:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(module), name)
        namespace[name] = value  # cached: the next access does not come here
        return value

    return __getattr__
