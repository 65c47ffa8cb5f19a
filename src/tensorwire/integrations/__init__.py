"""Adapters that plug tensorwire into serving engines. Each lives in its own subpackage and imports its engine
only there, so ``import tensorwire`` (and every other subpackage) works without any engine installed.

- ``tensorwire.integrations.vllm``: ``TensorwireECConnector``, a vLLM encoder-cache connector (docs/vllm.md).
- ``tensorwire.integrations.vllm_router``: an EPD router in front of ``vllm serve`` encoder and LLM instances
  (``python -m tensorwire.integrations.vllm_router``; aiohttp, the ``router`` extra; no vLLM import).
"""
