"""The router's Prometheus metrics, in a registry of its own (served on its ``/metrics``).

Labels are bounded: ``route`` and ``outcome`` are fixed sets, ``encoder`` is one of the configured URLs.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Histogram

ROUTES = ("encoded", "text", "fallback_local", "not_announced", "encoder_rejected", "no_encoder", "llm_failed",
          "bad_request")
ENCODER_OUTCOMES = ("ok", "not_announced", "rejected", "unavailable", "timeout", "error_status", "bad_answer")


class RouterMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self.requests = Counter(
            "tensorwire_vllm_router_requests_total",
            "Client requests by how they were routed: encoded (LLM instance got ec_transfer_params), text (no "
            "media), fallback_local (no encoder instance answered: the LLM instance encodes), not_announced (the "
            "encoder instance answered without params), encoder_rejected (the request was refused as invalid), "
            "no_encoder (none answered, fallback=fail: 503), llm_failed, bad_request",
            ["route"], registry=self.registry)
        self.encoder_calls = Counter(
            "tensorwire_vllm_router_encoder_calls_total", "Calls to encoder instances by outcome",
            ["encoder", "outcome"], registry=self.registry)
        self.encoder_seconds = Histogram(
            "tensorwire_vllm_router_encoder_seconds", "Time of one successful encoder call (request to params)",
            registry=self.registry, buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60))
        self.client_params_dropped = Counter(
            "tensorwire_vllm_router_client_params_dropped_total",
            "Client requests that carried their own ec_transfer_params (removed: only encoder instances set them)",
            registry=self.registry)
