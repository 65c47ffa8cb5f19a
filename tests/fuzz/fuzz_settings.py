"""Hypothesis settings for the fuzz tests: a modest example count in CI, more with TENSORWIRE_FUZZ_EXAMPLES.

``make fuzz`` runs these with TENSORWIRE_FUZZ_EXAMPLES=5000 and then the high-volume driver
(``python -m tensorwire.soak.fuzz --inputs 1000000``).
"""

from __future__ import annotations

import os

from hypothesis import HealthCheck, settings

SCALE = max(1, int(os.environ.get("TENSORWIRE_FUZZ_EXAMPLES", "0") or 0))

settings.register_profile(
    "tensorwire-fuzz",
    deadline=None,
    derandomize=not bool(SCALE),
    print_blob=True,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.function_scoped_fixture],
)
settings.load_profile("tensorwire-fuzz")


def examples(ci: int) -> int:
    """``ci`` examples by default; TENSORWIRE_FUZZ_EXAMPLES overrides (scaled down for the slow live targets)."""
    return ci if SCALE <= 1 else max(ci, SCALE * ci // 300)
