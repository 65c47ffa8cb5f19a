from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

# The in-memory exporter/reader fakes live with the unit tests.
sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "unit" / "mm"))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from _env import Env
from fakes import FakeFabric
from prometheus_client import CollectorRegistry


def _env(local: str, placed: bool = False) -> Iterator[Env]:
    e = Env(FakeFabric(), CollectorRegistry(), local, placed)
    try:
        yield e
    finally:
        for c in e.clients:
            c.close()
        for s in e.servers:
            s.stop(0)


@pytest.fixture
def env() -> Iterator[Env]:
    """Clients on the gRPC control plane (local_channel off)."""
    yield from _env("off")


@pytest.fixture(params=["grpc", "local"])
def any_env(request: pytest.FixtureRequest) -> Iterator[Env]:
    """The same test once with clients on gRPC and once on the same-host channel (``env.local`` says which)."""
    yield from _env("off" if request.param == "grpc" else "auto")


@pytest.fixture
def local_env() -> Iterator[Env]:
    """Clients on the same-host channel only (its own faults and checks)."""
    yield from _env("auto")


@pytest.fixture
def placed_env() -> Iterator[Env]:
    """Clients on the same-host channel that lend receive buffers (placed outputs)."""
    yield from _env("auto", placed=True)
