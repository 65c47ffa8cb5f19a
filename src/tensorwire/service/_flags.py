"""CLI flags built from config dataclasses, so every default lives only in the dataclass.

``add_flags(parser, cls, prefix)`` adds ``--<prefix><field-name>`` for each scalar field with
``default=argparse.SUPPRESS``: a flag the user did not give is absent from ``args``, so the environment and
then the dataclass default apply (precedence: flag > environment > default). ``flag_values(args, cls, prefix)``
collects the given ones.
"""

from __future__ import annotations

import argparse
import dataclasses
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from tensorwire.errors import ConfigError

_TYPES = {int: int, float: float, str: str}


def _default(f: dataclasses.Field[Any]) -> Any:
    """The field's plain default; None for a factory (nested configs: building one may import a lot, and no
    factory-made value is a scalar flag)."""
    return f.default if f.default is not dataclasses.MISSING else None


def _dest(prefix: str, name: str) -> str:
    return f"{prefix}{name}".replace("-", "_")


def add_flags(
    parser: argparse.ArgumentParser | Any,
    cls: type,
    prefix: str = "",
    *,
    skip: Iterable[str] = (),
    help_extra: Mapping[str, str] | None = None,
    choices: Mapping[str, Iterable[str]] | None = None,
    types: Mapping[str, Callable[[str], Any]] | None = None,
) -> None:
    """Adds one flag per scalar (bool, int, float, str) field of dataclass ``cls``; ``types`` overrides a field's
    argparse type (e.g. a port check), ``choices`` limits its values."""
    skip = set(skip)
    help_extra = help_extra or {}
    choices = choices or {}
    types = types or {}
    for f in dataclasses.fields(cls):
        default = _default(f)
        if f.name in skip or not isinstance(default, (bool, int, float, str)):
            continue
        flag = "--" + f"{prefix}{f.name}".replace("_", "-")
        text = (help_extra.get(f.name, "") + f" (default: {default!r})").strip()
        kwargs: dict[str, Any] = {"dest": _dest(prefix, f.name), "default": argparse.SUPPRESS, "help": text}
        if isinstance(default, bool):
            kwargs["action"] = argparse.BooleanOptionalAction
        else:
            kwargs["type"] = types.get(f.name, _TYPES[type(default)])
            kwargs["metavar"] = type(default).__name__.upper()
            if f.name in choices:
                kwargs["choices"] = list(choices[f.name])
        parser.add_argument(flag, **kwargs)


def flag_values(args: argparse.Namespace, cls: type, prefix: str = "") -> dict[str, Any]:
    """The fields of ``cls`` given on the command line, by field name."""
    out = {}
    for f in dataclasses.fields(cls):
        dest = _dest(prefix, f.name)
        if hasattr(args, dest):
            out[f.name] = getattr(args, dest)
    return out


@dataclass(frozen=True)
class StopConfig:
    """How a server stops on SIGTERM/SIGINT (the ``GrpcHost`` stop sequence); flags ``--drain-s``, ``--grace-s``."""

    # Health says NOT_SERVING this long before new work is refused, so proxies and load balancers move away
    # (the proxy probes every second by default).
    drain_s: float = 2.0
    # Then in-flight calls get this long to finish and their exported leases to be released.
    grace_s: float = 10.0

    def __post_init__(self) -> None:
        for name in ("drain_s", "grace_s"):
            if getattr(self, name) < 0:
                raise ConfigError(f"{name}={getattr(self, name)} must be >= 0")


def add_stop_flags(parser: argparse.ArgumentParser | Any) -> None:
    """``--drain-s``, ``--grace-s`` (``StopConfig``) and ``--reuse-port`` for a serve command."""
    add_flags(
        parser,
        StopConfig,
        help_extra={
            "drain_s": "on SIGTERM, seconds health says NOT_SERVING before new requests are refused",
            "grace_s": "then, seconds in-flight requests (and leases they exported) get to finish",
        },
    )
    parser.add_argument(
        "--reuse-port",
        action="store_true",
        help="let other processes listen on the same port (SO_REUSEPORT; they split the "
        "connections). Off: a port in use is an error (exit code 3)",
    )


def stop_config(args: argparse.Namespace) -> Any:
    """The ``StopConfig`` of the parsed flags."""
    return StopConfig(**flag_values(args, StopConfig))


__all__ = ["StopConfig", "add_flags", "add_stop_flags", "flag_values", "stop_config"]
