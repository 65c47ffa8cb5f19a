"""tensorwire: move tensors between the processes of a disaggregated LLM inference deployment.

Layers (imports point down only)::

    cli  ->  service (worker, proxy)  ->  mm (encoder-output transport, gRPC)  ->  rdma (NIXL)  ->  errors
    cli  ->  tp (CPU tensor-parallel broadcaster)                                                 ->  errors
    service  ->  encoder (reference vision encoders)                                              ->  errors
    cli  ->  bench, soak (measurements, fault injection: they drive the layers above)
    integrations (vLLM connector)  ->  mm  ->  rdma  ->  errors; only integrations/vllm.py imports vLLM

``import tensorwire`` is cheap: torch, grpc and nixl are imported only by the subpackages that need them.
"""

from tensorwire._version import __version__
from tensorwire.errors import Reason, TensorwireError

__all__ = ["Reason", "TensorwireError", "__version__"]
