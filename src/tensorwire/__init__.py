"""tensorwire: move tensors between the processes of a disaggregated LLM inference deployment.

Layers (imports point down only)::

    cli  ->  service (worker, proxy)  ->  mm (encoder-output transport, gRPC)  ->  rdma (NIXL)  ->  errors
    cli  ->  tp (CPU tensor-parallel broadcaster)                                                 ->  errors
    service  ->  encoder (reference vision encoders)                                              ->  errors
    cli  ->  bench, soak (measurements, fault injection: they drive the layers above)
    integrations (vLLM connector)  ->  mm  ->  rdma  ->  errors; only integrations/vllm.py imports vLLM

``import tensorwire`` is cheap: torch, grpc and nixl are imported only by the subpackages that need them. Its first
statement makes Ctrl-C one line and exit code 130 in a process started as the ``tensorwire`` command, and does
nothing otherwise (``tensorwire._startup``).
"""

from tensorwire import _startup

_startup.arm()

from tensorwire._version import __version__  # noqa: E402
from tensorwire.errors import Reason, TensorwireError  # noqa: E402

__all__ = ["Reason", "TensorwireError", "__version__"]
