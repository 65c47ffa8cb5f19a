from __future__ import annotations

import pickle

import pytest

import tensorwire.rdma as rdma
from tensorwire.errors import ConfigError, ExportError, ReadError, Reason


def test_all_lists_the_contract_names() -> None:
    expected = {
        "RdmaConfig", "Descriptor", "TensorMeta", "Owner", "Lease", "TensorExporter", "TensorReader",
        "SUPPORTED_DTYPES", "available_providers", "has_rdma", "known_providers", "register_provider", "Reason",
        "TensorwireError", "ConfigError", "ClosedError", "InvalidDescriptor", "ExportError", "PoolExhausted",
        "ReadError", "ReadTimeout", "LeaseExpired", "is_staged_gpu_transport", "ExporterStats", "ReaderStats",
        "PoolStats", "ProviderStats",
    }
    assert set(rdma.__all__) == expected
    for name in rdma.__all__:
        assert getattr(rdma, name) is not None


def test_exceptions_are_the_shared_hierarchy() -> None:
    import tensorwire.errors as errors

    for name in ("InvalidDescriptor", "ExportError", "ReadError", "ReadTimeout", "PoolExhausted", "LeaseExpired"):
        assert getattr(rdma, name) is getattr(errors, name)
        assert issubclass(getattr(rdma, name), errors.TensorwireError)


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
