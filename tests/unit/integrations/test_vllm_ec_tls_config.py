"""The connector's TLS keys (``tls_*``, ``insecure``): parsed like the CLI's flags, falling back to
``TENSORWIRE_VLLM_EC_TLS_*`` and then to tensorwire's ``TENSORWIRE_MM_TLS_*``; inconsistent keys are a ConfigError."""

from __future__ import annotations

import pytest

from tensorwire._grpc.tls import TlsConfig
from tensorwire.errors import ConfigError
from tensorwire.integrations._vllm_ec.config import ECConfig


def test_defaults_are_a_loopback_plaintext_store() -> None:
    cfg = ECConfig.from_extra({}, environ={})
    assert cfg.host == "127.0.0.1" and not cfg.insecure
    assert cfg.tls == TlsConfig() and cfg.tls.describe() == "plaintext"


def test_tls_keys_mirror_the_cli_names() -> None:
    cfg = ECConfig.from_extra(
        {
            "tls_cert": "c.pem",
            "tls_key": "k.pem",
            "tls_ca": "ca.pem",
            "tls_server_name": "enc-1",
            "tls_client_auth": "false",
            "insecure": "yes",
        },
        environ={},
    )
    assert cfg.tls == TlsConfig(cert="c.pem", key="k.pem", ca="ca.pem", server_name="enc-1", client_auth=False)
    assert cfg.insecure is True


def test_tls_falls_back_to_the_connector_then_tensorwires_environment() -> None:
    env = {
        "TENSORWIRE_MM_TLS_CA": "mm-ca.pem",
        "TENSORWIRE_MM_TLS_CERT": "mm.pem",
        "TENSORWIRE_MM_TLS_KEY": "mm.key",
        "TENSORWIRE_VLLM_EC_TLS_CA": "ec-ca.pem",
        "TENSORWIRE_MM_TLS_CLIENT_AUTH": "0",
    }
    cfg = ECConfig.from_extra({"tls_cert": "x.pem", "tls_key": "x.key"}, environ=env)
    assert cfg.tls == TlsConfig(cert="x.pem", key="x.key", ca="ec-ca.pem", client_auth=False)
    assert ECConfig.from_extra({}, environ=env).tls.cert == "mm.pem"


@pytest.mark.parametrize(
    "extra", [{"tls_cert": "c.pem"}, {"tls_key": "k.pem"}, {"insecure": "maybe"}, {"tls_client_auth": "sometimes"}]
)
def test_inconsistent_tls_keys_are_a_config_error(extra: dict[str, object]) -> None:
    with pytest.raises(ConfigError):
        ECConfig.from_extra(extra, environ={})
