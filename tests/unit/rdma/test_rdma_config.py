from __future__ import annotations

import dataclasses

import pytest

from tensorwire.errors import ConfigError
from tensorwire.rdma import RdmaConfig


def test_defaults_match_the_issue() -> None:
    c = RdmaConfig()
    assert (c.provider, c.device, c.port, c.qp_count) == ("auto", "cpu", 0, 8)
    assert (c.connect_timeout_ms, c.read_timeout_ms, c.slot_gc_timeout_ms) == (250, 3000, 60000)
    assert (c.max_slot_bytes, c.pool_cap_bytes, c.slot_align) == (1 << 30, 8 << 30, 4096)


def test_frozen() -> None:
    with pytest.raises(dataclasses.FrozenInstanceError):
        RdmaConfig().port = 1  # type: ignore[misc]


@pytest.mark.parametrize(
    "field,value",
    [
        ("provider", "mooncake"),
        ("device", "cuda"),
        ("device", "cuda:x"),
        ("device", "gpu:0"),
        ("bind_ip", "not-an-ip"),
        ("port", -1),
        ("port", 65536),
        ("qp_count", 0),
        ("connect_timeout_ms", 0),
        ("read_timeout_ms", 0),
        ("slot_gc_timeout_ms", 0),
        ("max_slot_bytes", 0),
        ("pool_cap_bytes", 0),
        ("slot_align", 3000),
        ("slot_align", 4),
        ("port", True),
        ("progress_delay_us", -1),
    ],
)
def test_invalid_values_raise_config_error_naming_the_field(field: str, value: object) -> None:
    with pytest.raises(ConfigError, match=field) as info:
        RdmaConfig(**{field: value})
    assert info.value.reason.value == "invalid_config"


def test_max_slot_above_cap_rejected() -> None:
    with pytest.raises(ConfigError, match="max_slot_bytes"):
        RdmaConfig(max_slot_bytes=2 << 20, pool_cap_bytes=1 << 20)


@pytest.mark.parametrize("port", [0, 65535])
def test_port_bounds_accepted(port: int) -> None:
    assert RdmaConfig(port=port).port == port


def test_device_index() -> None:
    assert RdmaConfig(device="cuda:3").device_index == 3
    assert RdmaConfig(device="cuda:3").is_cuda
    assert not RdmaConfig().is_cuda


def test_from_env() -> None:
    c = RdmaConfig.from_env({"TENSORWIRE_RDMA_PORT": "1234", "TENSORWIRE_RDMA_PROVIDER": "none", "OTHER": "x"})
    assert (c.port, c.provider, c.qp_count) == (1234, "none", 8)
    with pytest.raises(ConfigError, match="TENSORWIRE_RDMA_PORT"):
        RdmaConfig.from_env({"TENSORWIRE_RDMA_PORT": "abc"})
