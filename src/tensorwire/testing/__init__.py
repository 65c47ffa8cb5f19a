"""Test support shipped with tensorwire: deterministic tensors, an owner process, the provider conformance suite.

Third-party providers run ``tensorwire.testing.conformance`` against themselves (see its docstring).
"""

from __future__ import annotations

from tensorwire.testing.data import as_bytes, make_tensor, same_bytes
from tensorwire.testing.owner import OwnerProcess, cpu_seconds, read_forever

__all__ = ["OwnerProcess", "as_bytes", "cpu_seconds", "make_tensor", "read_forever", "same_bytes"]
