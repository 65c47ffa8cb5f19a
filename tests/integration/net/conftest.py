"""Hosts as network namespaces (tensorwire.testing.netns): fixtures shared by the cross-host tests.

Every test here makes its own fabric (namespaces named per run, addresses from 10.233.0.0/16 that exist only
inside it), sends traffic only to loopback or those addresses, and deletes everything at the end, also on
failure. Skipped, with the reason, where namespaces cannot be made (not root, no iproute2) or NIXL is missing.
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))

from tensorwire.service._child import Child
from tensorwire.testing import netns


def skip_unless_possible(nixl_available: bool) -> None:
    """Skip (with the reason) where namespaces cannot be made or NIXL is missing. Module-scoped fixtures call it
    themselves: they are set up before the autouse check below runs."""
    reason = netns.unavailable_reason()
    if reason is not None:
        pytest.skip(f"cross-host tests need network namespaces: {reason}")
    if not nixl_available:
        pytest.skip("NIXL is not installed")


@pytest.fixture(autouse=True)
def _needs_namespaces_and_nixl(nixl_available: bool) -> None:
    skip_unless_possible(nixl_available)


@pytest.fixture
def fabric() -> Iterator[Callable[[Sequence[str]], netns.Fabric]]:
    """``fabric(["a", "b"])`` -> a Fabric, closed (processes killed, namespaces deleted) after the test."""
    made: list[netns.Fabric] = []

    def make(names: Sequence[str]) -> netns.Fabric:
        f = netns.Fabric(names)
        made.append(f)
        return f

    try:
        yield make
    finally:
        for f in made:
            f.close()


class Children:
    """``start(host, name, argv)`` -> a tensorwire CLI process in ``host`` (READY-line aware); ``stop()`` ends all."""

    def __init__(self, log_dir: Path) -> None:
        self.log_dir = log_dir
        self.made: list[Child] = []

    def start(self, host: netns.Host, name: str, argv: Sequence[str], env: dict[str, str] | None = None) -> Child:
        c = Child(name, argv, self.log_dir, prefix=host.exec_prefix, env=env or host.env())
        host.fabric.track(c.proc)
        self.made.append(c)
        return c

    def stop(self) -> None:
        for c in self.made:  # SIGTERM to all first, so that their graceful stops overlap
            if c.proc.poll() is None:
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.killpg(c.proc.pid, signal.SIGTERM)
        for c in self.made:
            c.terminate(grace_s=5)


@pytest.fixture(scope="session")
def corpus() -> Any:
    """Images and the digests of their outputs, computed here by the same seeded ViT the workers run."""
    from tensorwire.soak._corpus import build_corpus

    return build_corpus(3)
