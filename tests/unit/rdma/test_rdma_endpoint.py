"""The rules that pick the metadata endpoint's bind address and the advertised host (rdma/_endpoint.py).

The real detection inside network namespaces is covered by tests/integration/net/test_cross_host.py; here the
detected address is fixed so that each rule is checked on its own.
"""

from __future__ import annotations

import logging

import pytest

from tensorwire.rdma import _endpoint
from tensorwire.rdma._endpoint import resolve

DETECTED = "10.233.77.5"


@pytest.fixture(autouse=True)
def _fixed_detection(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(_endpoint, "detect", lambda: (DETECTED, "detected"))


@pytest.mark.parametrize(
    "bind, advertise, control, want_bind, want_adv",
    [
        ("", "", "", DETECTED, DETECTED),  # a bare exporter: this host's address, no wildcard
        ("", "", "127.0.0.1", "127.0.0.1", "127.0.0.1"),  # serve-encoder's default --host
        ("", "", "localhost", "127.0.0.1", "127.0.0.1"),  # a name is resolved
        ("", "", "10.9.8.7", "10.9.8.7", "10.9.8.7"),  # follows a specific control-plane address
        ("", "", "[::1]", "::1", "::1"),
        ("", "", "0.0.0.0", DETECTED, DETECTED),  # wildcard control plane: one detected address
        ("", "", "[::]", DETECTED, DETECTED),
        ("0.0.0.0", "", "10.9.8.7", "0.0.0.0", "10.9.8.7"),  # explicit wildcard: advertise the control plane's
        ("0.0.0.0", "", "0.0.0.0", "0.0.0.0", DETECTED),
        ("10.1.1.1", "", "127.0.0.1", "10.1.1.1", "10.1.1.1"),  # an explicit bind wins and is advertised
        ("", "encoder-7.example", "0.0.0.0", DETECTED, "encoder-7.example"),  # NAT / DNS name: advertise only
        ("", "127.0.0.1", "0.0.0.0", "127.0.0.1", "127.0.0.1"),  # a local advertised address is also bound
    ],
)
def test_rules(bind: str, advertise: str, control: str, want_bind: str, want_adv: str) -> None:
    ep = resolve(bind, advertise, control)
    assert (ep.bind_ip, ep.advertise_host) == (want_bind, want_adv), ep
    assert not _endpoint.is_wildcard(ep.advertise_host)


def test_nothing_listens_on_a_wildcard_unless_asked() -> None:
    for control in ("", "127.0.0.1", "0.0.0.0", "::", "10.0.0.1"):
        assert not _endpoint.is_wildcard(resolve("", "", control).bind_ip)


def test_loopback_advertised_while_serving_elsewhere_is_loud(
    caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("UCX_NET_DEVICES", raising=False)
    caplog.set_level(logging.INFO, logger="tensorwire.rdma.endpoint")
    ep = resolve("", "127.0.0.1", "0.0.0.0")
    warnings = _endpoint.announce(ep, 4242, "tw-exporter-x", "0.0.0.0")
    assert len(warnings) == 1 and "loopback address 127.0.0.1" in warnings[0] and "0.0.0.0" in warnings[0]
    info = [r for r in caplog.records if r.levelno == logging.INFO]
    assert info and "listening on 127.0.0.1:4242" in info[0].getMessage()
    assert "advertise 127.0.0.1" in info[0].getMessage()
    # Loopback everywhere (one host) is not worth a warning.
    assert _endpoint.announce(resolve("", "", "127.0.0.1"), 4242, "tw-exporter-x", "127.0.0.1") == []


def test_ucx_on_loopback_while_advertising_a_network_address_is_loud(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("UCX_NET_DEVICES", "lo")
    warnings = _endpoint.announce(resolve("", "", "10.9.8.7"), 1, "a", "10.9.8.7")
    assert len(warnings) == 1 and "UCX_NET_DEVICES=lo" in warnings[0]
    monkeypatch.setenv("UCX_NET_DEVICES", "lo,eth1")
    assert _endpoint.announce(resolve("", "", "10.9.8.7"), 1, "a", "10.9.8.7") == []


def test_helpers() -> None:
    assert _endpoint.bare("[fe80::1]") == "fe80::1" and _endpoint.bare(" 10.0.0.1 ") == "10.0.0.1"
    assert _endpoint.is_loopback("localhost") and _endpoint.is_loopback("::1") and not _endpoint.is_loopback("::")
    assert _endpoint.is_local("127.0.0.1") and not _endpoint.is_local("192.0.2.254")
    assert _endpoint.to_ip("no-such-host.invalid") is None
