"""Fixtures shared by the multi-process broadcaster tests."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import tp_helpers as H


@pytest.fixture
def base() -> Iterator[str]:
    """A short private rendezvous directory (sun_path is only 108 bytes), removed afterwards."""
    d = H.short_dir()
    yield d
    H.rmtree(d)
