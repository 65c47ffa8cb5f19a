"""Runnable services around ``tensorwire.mm``: an encoder worker and a proxy in front of several workers.

``EncoderWorker`` (``tensorwire serve-encoder``): EncoderService, health and WorkerInfo on one port.
``EncoderProxy`` (``tensorwire serve-proxy``): Encode over workers with retry, releases to the lease's owner.
``_runtime``, ``_child``: process plumbing. grpc, torch and the encoders are imported on first use.
"""

from __future__ import annotations

from tensorwire._lazy import lazy_exports

_LAZY = {
    "EncoderWorker": "tensorwire.service._worker",
    "make_encode_fn": "tensorwire.service._worker",
    "EncoderProxy": "tensorwire.service._proxy",
    "ProxyConfig": "tensorwire.service._proxy_config",
    "RouteTable": "tensorwire.service._routes",
    "route_ttl_s": "tensorwire.service._routes",
    "WorkerInfo": "tensorwire.service._info",
    "check_workers": "tensorwire.service._info",
    "MetricsServer": "tensorwire.service._runtime",
    "print_ready": "tensorwire.service._runtime",
    "parse_ready": "tensorwire.service._runtime",
    "wait_for_signal": "tensorwire.service._runtime",
}

__all__ = sorted(_LAZY)


__getattr__ = lazy_exports("tensorwire.service", _LAZY, globals())
