"""Generic tensor export / read / release over a one-sided data plane (NIXL/UCX), independent of any model.

Owner side::

    with TensorExporter(RdmaConfig(device="cpu")) as exp:
        desc = exp.export([emb, pos])            # copies into a pooled registered slot; inputs may be dropped
        wire = desc.to_bytes()                   # send to the reader (gRPC, anything)
        ...
        exp.release([desc.lease_id])             # when the reader is done (else the TTL GC reclaims it)

Reader side::

    with TensorReader(RdmaConfig()) as rd:
        emb, pos = rd.read([Descriptor.from_bytes(wire)], timeout_ms=500)

``has_rdma()`` / ``available_providers()`` say whether a real provider exists; with provider "none" (or "auto"
without NIXL) constructing an exporter/reader raises ``ExportError``/``ReadError`` with reason
``PROVIDER_UNAVAILABLE`` so callers fall back. Contracts: ``docs/rdma.md``; generation protocol: ``_pool``.

Public API: the names in ``__all__`` (pinned by tests/unit/rdma/test_rdma_public_api.py). ``Exporter`` and
``Reader`` are the protocols callers type against (``TensorExporter``/``TensorReader`` implement them);
``stats()`` returns ``ExporterStats``/``ReaderStats`` (``as_dict()`` for JSON). Exceptions live in
``tensorwire.errors`` only. Every module here starts with ``_`` except ``providers``, the provider interface for
third-party providers: ``providers.base`` (``Provider`` and its contract) and the registry in ``providers``; the
built-in providers (``providers._nixl``, ``providers._none``) are chosen by name in ``RdmaConfig.provider``, never
imported.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from tensorwire._lazy import lazy_exports

if TYPE_CHECKING:
    from tensorwire.rdma._config import RdmaConfig
    from tensorwire.rdma._descriptor import Descriptor, Owner, TensorMeta
    from tensorwire.rdma._dtypes import SUPPORTED_DTYPES, WIRE_DTYPES
    from tensorwire.rdma._exporter import Lease, TensorExporter
    from tensorwire.rdma._protocols import Exporter, Reader
    from tensorwire.rdma._reader import TensorReader
    from tensorwire.rdma._stats import ExporterStats, PoolStats, ProviderStats, ReaderStats
    from tensorwire.rdma.providers import available_providers, has_rdma, known_providers, register_provider
    from tensorwire.rdma.providers._ucx_probe import is_slow_for_gpu as is_staged_gpu_transport

# Each name is imported from its module on first use, so ``import tensorwire.rdma`` (and its config, which the
# CLI needs to build its flags) does not import torch.
_LAZY = {
    "RdmaConfig": "tensorwire.rdma._config",
    "Descriptor": "tensorwire.rdma._descriptor",
    "Owner": "tensorwire.rdma._descriptor",
    "TensorMeta": "tensorwire.rdma._descriptor",
    "SUPPORTED_DTYPES": "tensorwire.rdma._dtypes",
    "WIRE_DTYPES": "tensorwire.rdma._dtypes",
    "Lease": "tensorwire.rdma._exporter",
    "TensorExporter": "tensorwire.rdma._exporter",
    "Exporter": "tensorwire.rdma._protocols",
    "Reader": "tensorwire.rdma._protocols",
    "TensorReader": "tensorwire.rdma._reader",
    "ExporterStats": "tensorwire.rdma._stats",
    "PoolStats": "tensorwire.rdma._stats",
    "ProviderStats": "tensorwire.rdma._stats",
    "ReaderStats": "tensorwire.rdma._stats",
    "available_providers": "tensorwire.rdma.providers",
    "has_rdma": "tensorwire.rdma.providers",
    "known_providers": "tensorwire.rdma.providers",
    "register_provider": "tensorwire.rdma.providers",
}

__all__ = [
    "RdmaConfig",
    "TensorExporter",
    "TensorReader",
    "Exporter",
    "Reader",
    "Descriptor",
    "TensorMeta",
    "Owner",
    "Lease",
    "ExporterStats",
    "ReaderStats",
    "PoolStats",
    "ProviderStats",
    "SUPPORTED_DTYPES",
    "WIRE_DTYPES",
    "available_providers",
    "has_rdma",
    "known_providers",
    "register_provider",
    "is_staged_gpu_transport",
]


def __getattr__(name: str) -> object:
    if name == "is_staged_gpu_transport":
        from tensorwire.rdma.providers._ucx_probe import is_slow_for_gpu

        globals()[name] = is_slow_for_gpu
        return is_slow_for_gpu
    return _lazy(name)


_lazy = lazy_exports("tensorwire.rdma", _LAZY, globals())
