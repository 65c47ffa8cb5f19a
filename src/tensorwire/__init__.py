"""tensorwire: move tensors between the processes of a disaggregated LLM inference deployment.

Layers (imports point down only)::

    cli  ->  mm (encoder-output transport, gRPC)  ->  rdma (export/read/release over NIXL)  ->  errors
    cli  ->  tp (CPU tensor-parallel broadcaster)                                              ->  errors
    cli  ->  encoder (reference vision encoders)

``import tensorwire`` is cheap: torch, grpc and nixl are imported only by the subpackages that need them.
"""

from tensorwire.errors import Reason, TensorwireError

__version__ = "0.1.0"

__all__ = ["Reason", "TensorwireError", "__version__"]
