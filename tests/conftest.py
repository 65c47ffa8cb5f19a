"""Shared pytest set-up for every tensorwire test (others may append fixtures below; keep it small).

Environment: UCX stays on loopback (this machine has an eth0 that tests must not use) and NIXL stays quiet.
These are set before any test imports NIXL; spawned child processes inherit them. The library itself never
forces loopback (see tensorwire/rdma/providers/_ucx_env.py).
"""

from __future__ import annotations

import os

import pytest

os.environ.setdefault("UCX_NET_DEVICES", "lo")
os.environ.setdefault("NIXL_LOG_LEVEL", "WARN")
os.environ.setdefault("UCX_WARN_UNUSED_ENV_VARS", "n")


def _cuda_available() -> bool:
    try:
        import torch

        return torch.cuda.is_available()
    except ImportError:
        return False


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if _cuda_available():
        return
    skip_gpu = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip_gpu)


@pytest.fixture(scope="session")
def nixl_available() -> bool:
    from tensorwire.rdma import available_providers

    return "nixl" in available_providers()


@pytest.fixture
def require_nixl(nixl_available: bool) -> None:
    if not nixl_available:
        pytest.skip("NIXL is not installed")
