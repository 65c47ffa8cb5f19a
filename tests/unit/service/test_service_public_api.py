"""The exact public surface of ``tensorwire.service`` (its names resolve lazily; see its docstring)."""

from __future__ import annotations

import tensorwire.service as svc

EXPECTED = sorted(
    [
        "EncoderWorker",
        "make_encode_fn",
        "EncoderProxy",
        "ProxyConfig",
        "RouteTable",
        "route_ttl_s",
        "WorkerInfo",
        "check_workers",
        "MetricsServer",
        "print_ready",
        "parse_ready",
        "wait_for_signal",
    ]
)


def test_all_is_exactly_the_service_names() -> None:
    assert svc.__all__ == EXPECTED
