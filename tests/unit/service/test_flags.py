"""serve-encoder's flags come from the config dataclasses: flag > environment > default."""

from __future__ import annotations

import argparse
import dataclasses

import pytest

from tensorwire.cli import serve_encoder
from tensorwire.mm import TransportConfig
from tensorwire.rdma import RdmaConfig
from tensorwire.service._flags import add_flags, flag_values


def _parse(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    serve_encoder.add_arguments(p)
    return p.parse_args(argv)


def test_every_rdma_field_has_a_flag() -> None:
    p = argparse.ArgumentParser()
    serve_encoder.add_arguments(p)
    flags = {a.dest for a in p._actions}
    for f in dataclasses.fields(RdmaConfig):
        if f.name != "control_host":  # set by the worker from --host, never a flag
            assert f"rdma_{f.name}" in flags
    assert "rdma_control_host" not in flags
    assert "mode" in flags and "worker_timeout_ms" in flags
    assert "release_queue_max" not in flags  # client-only knobs are not offered to the encoder
    assert "control_stream" not in flags and "control_stream_pool" not in flags
    assert "server_stream_cap" in flags


def test_defaults_come_from_the_dataclasses(monkeypatch: pytest.MonkeyPatch) -> None:
    for key in ("MM_TRANSPORT_MODE", "TENSORWIRE_MM_RDMA_PORT", "TENSORWIRE_MM_WORKER_TIMEOUT_MS"):
        monkeypatch.delenv(key, raising=False)
    cfg = serve_encoder.build_config(_parse([]))
    assert cfg == dataclasses.replace(TransportConfig(), rdma=RdmaConfig(device="cpu"))


def test_precedence_flag_over_env_over_default(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MM_TRANSPORT_MODE", "grpc")
    monkeypatch.setenv("TENSORWIRE_MM_RDMA_PORT", "7100")
    monkeypatch.setenv("TENSORWIRE_MM_RDMA_QP_COUNT", "4")
    cfg = serve_encoder.build_config(_parse(["--rdma-port", "7200", "--worker-timeout-ms", "5000"]))
    assert cfg.mode == "grpc"  # env over default
    assert cfg.rdma.port == 7200  # flag over env
    assert cfg.rdma.qp_count == 4  # env over default
    assert cfg.worker_timeout_ms == 5000
    assert serve_encoder.build_config(_parse(["--mode", "auto"])).mode == "auto"


def test_device_flag_sets_the_rdma_device_unless_given() -> None:
    assert serve_encoder.build_config(_parse(["--device", "cuda:1"])).rdma.device == "cuda:1"
    cfg = serve_encoder.build_config(_parse(["--device", "cuda:1", "--rdma-device", "cpu"]))
    assert cfg.rdma.device == "cpu"


def test_bad_values_are_rejected() -> None:
    with pytest.raises(SystemExit):
        _parse(["--mode", "rdma"])
    with pytest.raises(SystemExit):  # the parser refuses it (one line, exit 2), before any config is built
        _parse(["--rdma-port", "70000"])
    with pytest.raises(ValueError):
        serve_encoder.build_config(_parse(["--rdma-qp-count", "0"]))


def test_bool_fields_become_optional_flags() -> None:
    @dataclasses.dataclass(frozen=True)
    class C:
        on: bool = True
        n: int = 3

    p = argparse.ArgumentParser()
    add_flags(p, C)
    assert flag_values(p.parse_args([]), C) == {}
    assert flag_values(p.parse_args(["--no-on", "--n", "5"]), C) == {"on": False, "n": 5}
