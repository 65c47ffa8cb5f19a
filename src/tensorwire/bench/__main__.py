"""Dispatcher: ``python -m tensorwire.bench NAME [args]`` runs ``tensorwire.bench.NAME.main(args)``."""

from __future__ import annotations

import importlib
import pkgutil
import sys

import tensorwire.bench as _pkg


def _names() -> list[str]:
    return sorted(m.name for m in pkgutil.iter_modules(_pkg.__path__) if not m.name.startswith("_"))


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    names = _names()
    if not argv or argv[0] in ("-h", "--help") or argv[0] not in names:
        print(f"usage: python -m tensorwire.bench {{{','.join(names)}}} [options]", file=sys.stderr)
        return 0 if argv and argv[0] in ("-h", "--help") else 2
    module = importlib.import_module(f"tensorwire.bench.{argv[0]}")
    return int(module.main(argv[1:]) or 0)


if __name__ == "__main__":
    sys.exit(main())
