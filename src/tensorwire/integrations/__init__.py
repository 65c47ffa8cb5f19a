"""Adapters that plug tensorwire into serving engines. Each lives in its own subpackage and imports its engine
only there, so ``import tensorwire`` (and every other subpackage) works without any engine installed.

- ``tensorwire.integrations.vllm``: ``TensorwireECConnector``, a vLLM encoder-cache connector (docs/vllm.md).
"""
