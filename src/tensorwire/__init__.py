"""tensorwire: move tensors between the processes of a disaggregated LLM inference deployment.

Layers (imports point down only)::

    cli  ->  service (worker, proxy)  ->  mm (encoder-output transport, gRPC)  ->  rdma (NIXL)  ->  errors
    cli  ->  tp (CPU tensor-parallel broadcaster)                                                 ->  errors
    service  ->  encoder (reference vision encoders)                                              ->  errors
    cli  ->  bench, soak (measurements, fault injection: they drive the layers above)
    integrations (vLLM connector)  ->  mm  ->  rdma  ->  errors; only integrations/vllm.py imports vLLM

``import tensorwire`` is cheap: torch, grpc and nixl are imported only by the subpackages that need them.
"""

from importlib.metadata import PackageNotFoundError, version

from tensorwire.errors import Reason, TensorwireError

try:
    __version__ = version("tensorwire")  # the one place it is written is pyproject.toml's [project] version
except PackageNotFoundError:  # sources on sys.path without an install
    __version__ = "0+unknown"

__all__ = ["Reason", "TensorwireError", "__version__"]
