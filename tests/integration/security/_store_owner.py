"""A real encoder-side process of the vLLM connector for the store TLS tests: a ``ProducerRuntime`` (HeldStore
and its gRPC server, inline items: no RDMA provider) built from ``ec_connector_extra_config``, driven over a pipe.
Spawned (never forked)."""

from __future__ import annotations

from typing import Any


def owner_main(conn: Any, extra: dict[str, Any]) -> None:
    import torch

    from tensorwire.integrations._vllm_ec.config import ECConfig
    from tensorwire.integrations._vllm_ec.runtime import ProducerRuntime

    try:
        rt = ProducerRuntime(ECConfig.from_extra(extra, environ={}), "storetls-dp0", "cpu")
    except Exception as exc:  # the parent checks what refused
        conn.send(("error", type(exc).__name__, str(exc)))
        return
    assert rt.store is not None
    conn.send(("ready", rt.endpoint))
    while True:
        msg = conn.recv()
        if msg[0] == "hold":
            _, key, secret, seed = msg
            t = torch.randn(4, 8, generator=torch.Generator().manual_seed(seed))
            rt.store.grant(key, secret)
            rt.store.hold(key, [t])
            conn.send(t)
        else:
            break
    rt.close()
