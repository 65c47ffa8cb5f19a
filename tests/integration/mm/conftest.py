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


@pytest.fixture
def env() -> Iterator[Env]:
    e = Env(FakeFabric(), CollectorRegistry())
    try:
        yield e
    finally:
        for c in e.clients:
            c.close()
        for s in e.servers:
            s.stop(0)
