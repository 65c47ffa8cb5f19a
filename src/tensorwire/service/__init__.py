"""Runnable services around ``tensorwire.mm``: an encoder worker and a proxy in front of several workers.

- ``EncoderWorker(encoder, TransportConfig)``: EncoderService + gRPC health + WorkerInfo on one port
  (``tensorwire serve-encoder``);
- ``EncoderProxy(ProxyConfig)``: spreads Encode over workers with retry, routes ReleaseLeases to the lease's
  owner (``tensorwire serve-proxy``); ``RouteTable`` is its pure routing logic;
- ``MetricsServer``, ``print_ready``/``parse_ready``, ``wait_for_signal``: the process plumbing the CLI uses
  (``_runtime``, also ``stdout_to_stderr`` and ``drain_releases``); ``_child``: the CLI subprocesses the demo and
  the integration tests start (``Child``, ``LoopbackDeployment``).

grpc, torch and the encoders are imported when a name is first used, so ``import tensorwire.service`` is cheap.
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
