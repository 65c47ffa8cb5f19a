"""``nixl_stats``: the nixl provider's typed stats of a reader or exporter (tests that check NIXL counters)."""

from __future__ import annotations

from tensorwire.rdma import TensorExporter, TensorReader
from tensorwire.rdma.providers._nixl import NixlStats


def nixl_stats(side: TensorReader | TensorExporter) -> NixlStats:
    stats = side.stats().provider_stats
    assert isinstance(stats, NixlStats), type(stats)
    return stats
