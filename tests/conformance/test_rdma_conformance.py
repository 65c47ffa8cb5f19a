"""Every known provider passes the conformance suite (tensorwire.testing.conformance)."""

from __future__ import annotations

import pytest

from tensorwire.rdma import RdmaConfig, known_providers
from tensorwire.testing.conformance import CHECKS, ConformanceSkip, run_check


@pytest.mark.timeout(120)
@pytest.mark.parametrize("check", sorted(CHECKS))
@pytest.mark.parametrize("provider", known_providers())
def test_provider_conformance(provider: str, check: str) -> None:
    try:
        run_check(check, RdmaConfig(provider=provider, bind_ip="127.0.0.1", read_timeout_ms=5000))
    except ConformanceSkip as exc:
        pytest.skip(str(exc))


def test_the_suite_can_fail() -> None:
    """A provider whose READ returns wrong bytes is caught (the suite is not vacuous)."""
    import ctypes

    from tensorwire.rdma import register_provider
    from tensorwire.rdma.providers import _REGISTRY, provider_class

    base = provider_class("nixl")
    if not base.available():
        pytest.skip("needs NIXL for the broken subclass")

    class Corrupting(base):  # type: ignore[misc, valid-type]
        name = "corrupting"

        def read(self, owner, local_mem, local, remote_mem, remote, *, deadline):  # type: ignore[no-untyped-def]
            super().read(owner, local_mem, local, remote_mem, remote, deadline=deadline)
            if local[0][1] > 8:  # leave the 8-byte generation word alone, corrupt payloads
                ctypes.memset(local[0][0], 0x5A, 1)

    register_provider("corrupting", lambda: Corrupting)
    try:
        with pytest.raises(AssertionError):
            run_check("round_trip_every_dtype", RdmaConfig(provider="corrupting", bind_ip="127.0.0.1"))
    finally:
        _REGISTRY.pop("corrupting", None)
