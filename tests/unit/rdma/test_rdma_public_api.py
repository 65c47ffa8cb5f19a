from __future__ import annotations

import importlib
import inspect
import pickle
import pkgutil

import pytest

import tensorwire.rdma as rdma
from tensorwire.errors import ConfigError, ExportError, ReadError, Reason

RDMA_ALL = [
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
PROVIDERS_ALL = [
    "ROLE_EXPORTER",
    "ROLE_READER",
    "PendingTransfer",
    "Provider",
    "ProviderStats",
    "Range",
    "Registration",
    "available_providers",
    "create_provider",
    "has_rdma",
    "known_providers",
    "provider_class",
    "register_provider",
    "resolve_name",
]
BASE_ALL = ["ROLE_EXPORTER", "ROLE_READER", "PendingTransfer", "Provider", "ProviderStats", "Range", "Registration"]


@pytest.mark.parametrize(
    ("module", "expected"),
    [
        ("tensorwire.rdma", RDMA_ALL),
        ("tensorwire.rdma.providers", PROVIDERS_ALL),
        ("tensorwire.rdma.providers.base", BASE_ALL),
    ],
)
def test_all_is_exactly_the_public_api(module: str, expected: list[str]) -> None:
    mod = importlib.import_module(module)
    assert sorted(mod.__all__) == sorted(expected)
    assert len(set(mod.__all__)) == len(mod.__all__)
    for name in mod.__all__:
        assert getattr(mod, name) is not None


def test_only_the_provider_interface_is_a_public_module() -> None:
    """Every module of tensorwire.rdma starts with ``_`` but the provider SPI (``providers``, ``providers.base``)."""
    public = {
        info.name
        for info in pkgutil.walk_packages(rdma.__path__, "tensorwire.rdma.")
        if not any(part.startswith("_") for part in info.name.split(".")[2:])
    }
    assert public == {"tensorwire.rdma.providers", "tensorwire.rdma.providers.base"}


def test_errors_are_not_re_exported() -> None:
    """One home for exceptions: tensorwire.errors (tensorwire.mm and tensorwire.tp do the same)."""
    import tensorwire.errors as errors

    for name in errors.__all__:
        assert not hasattr(rdma, name) or name in RDMA_ALL, name


@pytest.mark.parametrize(
    ("protocol", "cls"),
    [
        (rdma.Exporter, rdma.TensorExporter),
        (rdma.Reader, rdma.TensorReader),
    ],
)
def test_the_real_classes_implement_the_protocols(protocol: type, cls: type) -> None:
    """Same methods, same parameter names and kinds (mypy checks the types where the classes are used)."""
    members = [n for n in vars(protocol) if not n.startswith("_") and callable(getattr(protocol, n))]
    assert members
    for name in members:
        want = inspect.signature(getattr(protocol, name)).parameters
        got = inspect.signature(getattr(cls, name)).parameters
        assert [(p.name, p.kind) for p in got.values()] == [(p.name, p.kind) for p in want.values()], name


def test_none_provider_is_never_available() -> None:
    cfg = rdma.RdmaConfig(provider="none")
    assert not rdma.has_rdma(cfg)
    assert "none" not in rdma.available_providers()
    with pytest.raises(ExportError) as e1:
        rdma.TensorExporter(cfg)
    assert e1.value.reason is Reason.PROVIDER_UNAVAILABLE
    with pytest.raises(ReadError) as e2:
        rdma.TensorReader(cfg)
    assert e2.value.reason is Reason.PROVIDER_UNAVAILABLE
    # Survives pickling with its reason (spawned workers report it).
    assert pickle.loads(pickle.dumps(e2.value)).reason is Reason.PROVIDER_UNAVAILABLE


def test_unknown_provider_lists_known_names() -> None:
    from tensorwire.rdma.providers import provider_class

    with pytest.raises(ConfigError, match="nixl") as info:
        provider_class("mooncake")
    assert "none" in str(info.value)


def test_known_providers() -> None:
    assert {"nixl", "none"} <= set(rdma.known_providers())


def test_auto_resolves_to_nixl_when_importable(nixl_available: bool) -> None:
    from tensorwire.rdma.providers import resolve_name

    assert resolve_name(rdma.RdmaConfig()) == ("nixl" if nixl_available else "none")
    assert rdma.has_rdma() == nixl_available


def test_import_tensorwire_does_not_import_nixl() -> None:
    import subprocess
    import sys

    code = "import sys, tensorwire.rdma; print('nixl' in sys.modules, 'nixl_cu13' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    assert out.stdout.strip() == "False False"
