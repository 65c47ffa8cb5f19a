"""The exact public surface of the top-level ``tensorwire`` package (each subpackage pins its own)."""

from __future__ import annotations

import subprocess
import sys

import tensorwire


def test_all_is_exactly_the_top_level_names() -> None:
    assert tensorwire.__all__ == ["Reason", "TensorwireError", "__version__"]
    assert tensorwire.Reason is tensorwire.errors.Reason
    assert tensorwire.TensorwireError is tensorwire.errors.TensorwireError
    assert isinstance(tensorwire.__version__, str) and tensorwire.__version__


def test_importing_tensorwire_stays_cheap() -> None:
    # Layering promise of the package docstring: torch, grpc and nixl load only with the subpackages that need them.
    code = "import sys, tensorwire; print(sorted(m for m in ('torch', 'grpc', 'nixl') if m in sys.modules))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True)
    assert out.stdout.strip() == "[]"
