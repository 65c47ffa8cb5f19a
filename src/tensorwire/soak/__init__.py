"""Reliability tooling: a fault-injecting soak / load runner and a high-volume fuzz driver (docs/reliability.md).

- ``run_soak(SoakConfig(...))``: encoder workers behind the proxy, LLM-side client processes, faults injected
  at random (``FAULT_KINDS``), every output checked bit for bit, leases/fds/threads accounted; returns a dict.
  ``tensorwire soak`` is its CLI (``--load`` for the closed-loop load run).
- ``python -m tensorwire.soak.fuzz --inputs N``: every untrusted decoder and a live server, counting crashes.

Heavy imports (torch, grpc, the encoder) happen when a name is first used.
"""

from __future__ import annotations

from tensorwire._lazy import lazy_exports

_LAZY = {
    "SoakConfig": "tensorwire.soak._config",
    "FAULT_KINDS": "tensorwire.soak._config",
    "parse_faults": "tensorwire.soak._config",
    "run_soak": "tensorwire.soak._runner",
    "SoakRunner": "tensorwire.soak._runner",
    "FaultRelay": "tensorwire.soak._relay",
    "format_report": "tensorwire.soak._report",
}

__all__ = sorted(_LAZY)


__getattr__ = lazy_exports("tensorwire.soak", _LAZY, globals())
