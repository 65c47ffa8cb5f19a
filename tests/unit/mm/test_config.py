from __future__ import annotations

import dataclasses

import pytest

from tensorwire._grpc.limits import ServerLimits
from tensorwire._grpc.tls import TlsConfig
from tensorwire.errors import ConfigError
from tensorwire.mm import MODES, TransportConfig
from tensorwire.mm._config import DEFAULT_STREAM_CAP, NESTED, fields_for_cli
from tensorwire.rdma import RdmaConfig


def test_defaults_live_in_one_place() -> None:
    cfg = TransportConfig()
    assert cfg.mode == "auto"
    assert isinstance(cfg.rdma, RdmaConfig)
    assert cfg.rdma.qp_count == 8 and cfg.rdma.max_slot_bytes == 1024**3 and cfg.rdma.read_timeout_ms == 3000
    assert (cfg.worker_timeout_ms, cfg.rpc_timeout_margin_ms) == (120_000, 5_000)
    assert cfg.default_rpc_timeout_ms == cfg.worker_timeout_ms + cfg.rpc_timeout_margin_ms == 125_000
    assert (cfg.release_timeout_ms, cfg.release_queue_max) == (1000, 1024)
    assert (cfg.failures_to_open, cfg.open_seconds) == (3, 30.0)
    assert (cfg.control_stream, cfg.control_stream_pool, cfg.server_stream_cap) == (True, 8, 0)
    # Streams hold a server thread (of limits.max_inflight_calls), not a work slot (server_threads).
    assert cfg.effective_server_stream_cap == DEFAULT_STREAM_CAP == 64 <= cfg.limits.max_inflight_calls // 2
    assert cfg.effective_peer_leased_bytes == cfg.rdma.pool_cap_bytes // 2
    assert isinstance(cfg.tls, TlsConfig) and cfg.tls.describe() == "plaintext"
    assert isinstance(cfg.limits, ServerLimits)
    assert MODES == ("auto", "grpc")
    # The CLI builds its flags from the dataclass, so its defaults cannot drift.
    cli = {name: default for name, default, _ in fields_for_cli()}
    for f in dataclasses.fields(TransportConfig):
        if f.name not in NESTED:
            assert cli[f.name] == getattr(cfg, f.name)


@pytest.mark.parametrize("mode", ["", "rdma", "GRPC ", "inline", None])
def test_invalid_mode_rejected_at_construction(mode: object) -> None:
    with pytest.raises(ConfigError, match="mode"):
        TransportConfig(mode=mode)  # type: ignore[arg-type]


def test_mode_from_env_and_precedence() -> None:
    assert TransportConfig.from_env({"MM_TRANSPORT_MODE": "grpc"}).mode == "grpc"
    assert TransportConfig.from_env({"MM_TRANSPORT_MODE": " GRPC "}).mode == "grpc"
    assert TransportConfig.from_env({}).mode == "auto"
    assert TransportConfig.from_env({"MM_TRANSPORT_MODE": "grpc"}, mode="auto").mode == "auto"
    with pytest.raises(ConfigError, match="mode"):
        TransportConfig.from_env({"MM_TRANSPORT_MODE": "rdma-only"})


def test_fields_and_rdma_fields_from_env() -> None:
    cfg = TransportConfig.from_env(
        {
            "TENSORWIRE_MM_RELEASE_QUEUE_MAX": "16",
            "TENSORWIRE_MM_OPEN_SECONDS": "2.5",
            "TENSORWIRE_MM_WORKER_ID": "w7",
            "TENSORWIRE_MM_RDMA_MAX_SLOT_BYTES": "65536",
            "TENSORWIRE_MM_RDMA_DEVICE": "cpu",
        }
    )
    assert cfg.release_queue_max == 16 and cfg.open_seconds == 2.5 and cfg.worker_id == "w7"
    assert cfg.rdma.max_slot_bytes == 65536
    with pytest.raises(ConfigError, match="TENSORWIRE_MM_RELEASE_QUEUE_MAX"):
        TransportConfig.from_env({"TENSORWIRE_MM_RELEASE_QUEUE_MAX": "many"})
    with pytest.raises(ConfigError):
        TransportConfig.from_env({"TENSORWIRE_MM_RDMA_MAX_SLOT_BYTES": "0"})
    with pytest.raises(ConfigError):
        TransportConfig.from_env({"TENSORWIRE_MM_RDMA_PORT": "65536"})


def test_control_stream_fields_from_env_and_their_bounds() -> None:
    cfg = TransportConfig.from_env(
        {
            "TENSORWIRE_MM_CONTROL_STREAM": "off",
            "TENSORWIRE_MM_CONTROL_STREAM_POOL": "2",
            "TENSORWIRE_MM_SERVER_STREAM_CAP": "3",
        }
    )
    assert (cfg.control_stream, cfg.control_stream_pool, cfg.effective_server_stream_cap) == (False, 2, 3)
    assert TransportConfig.from_env({"TENSORWIRE_MM_CONTROL_STREAM": "1"}).control_stream is True
    with pytest.raises(ConfigError, match="TENSORWIRE_MM_CONTROL_STREAM"):
        TransportConfig.from_env({"TENSORWIRE_MM_CONTROL_STREAM": "sometimes"})
    # Every open stream holds a server thread: the cap leaves at least half of them for unary calls and health.
    with pytest.raises(ConfigError, match="server_stream_cap"):
        TransportConfig(server_stream_cap=257)
    assert TransportConfig(server_threads=4, server_stream_cap=3).effective_server_stream_cap == 3
    small = TransportConfig(limits=ServerLimits(max_inflight_calls=8, max_inflight_per_peer=8, max_streams_per_peer=4))
    assert small.effective_server_stream_cap == 4


def test_tls_and_limits_from_env() -> None:
    cfg = TransportConfig.from_env(
        {
            "TENSORWIRE_MM_TLS_CA": "/etc/ca.pem",
            "TENSORWIRE_MM_TLS_CLIENT_AUTH": "off",
            "TENSORWIRE_MM_MAX_INFLIGHT_PER_PEER": "7",
            "TENSORWIRE_MM_TRUSTED_FORWARDERS": "cn:proxy",
        }
    )
    assert cfg.tls == TlsConfig(ca="/etc/ca.pem", client_auth=False) and cfg.tls.client_enabled
    assert not cfg.tls.server_enabled
    assert cfg.limits.max_inflight_per_peer == 7 and cfg.limits.forwarders == {"cn:proxy"}
    with pytest.raises(ConfigError, match="cert and tls.key"):
        TransportConfig.from_env({"TENSORWIRE_MM_TLS_CERT": "/etc/c.pem"})
    with pytest.raises(ConfigError, match="max_inflight_per_peer"):
        TransportConfig.from_env({"TENSORWIRE_MM_MAX_INFLIGHT_PER_PEER": "0"})
    # The request limit is derived from the item limits, and stays far below protobuf's 2 GiB.
    limits = ServerLimits()
    assert limits.max_request_bytes >= limits.max_request_items * limits.max_item_bytes
    assert limits.max_request_bytes < 256 << 20


@pytest.mark.parametrize(
    "field,value",
    [
        ("control_stream_pool", 0),
        ("server_stream_cap", -1),
        ("control_stream", "yes"),
        ("control_stream", 1),
        ("worker_timeout_ms", 0),
        ("release_timeout_ms", -1),
        ("release_queue_max", 0),
        ("failures_to_open", 0),
        ("open_seconds", 0),
        ("fallback_reserve_ms", -1),
        ("rpc_timeout_margin_ms", -5),
        ("server_threads", 0),
        ("release_queue_max", True),
        ("init_backoff_max_ms", 1),
    ],
)
def test_out_of_range_values_rejected(field: str, value: object) -> None:
    with pytest.raises(ConfigError, match=field):
        TransportConfig(**{field: value})  # type: ignore[arg-type]


def test_rdma_must_be_rdma_config() -> None:
    with pytest.raises(ConfigError, match="rdma"):
        TransportConfig(rdma={"device": "cpu"})  # type: ignore[arg-type]
