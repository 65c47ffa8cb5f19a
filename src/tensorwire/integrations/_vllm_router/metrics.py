"""The router's Prometheus metrics, in a registry of its own (served on its ``/metrics``), with process metrics.

Labels are bounded: ``route``, ``role`` and ``outcome`` are fixed sets, ``encoder`` and ``upstream`` are instance
names (``encoder-N``, ``llm-N``: positions in the configuration, never URLs).
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, ProcessCollector

ROUTES = (
    "encoded",
    "text",
    "fallback_local",
    "not_announced",
    "encoder_rejected",
    "no_encoder",
    "llm_failed",
    "bad_request",
    "passthrough",
    "own",
)
ENCODER_OUTCOMES = ("ok", "not_announced", "rejected", "unavailable", "timeout", "error_status", "bad_answer")
UPSTREAM_OUTCOMES = ("ok", "error_status", "unavailable", "timeout", "bad_answer", "cut")


class RouterMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        ProcessCollector(registry=self.registry)
        self.requests = Counter(
            "tensorwire_vllm_router_requests_total",
            "Client requests by how they were routed: encoded (LLM instance got ec_transfer_params), text (no "
            "media), passthrough (another path), fallback_local (no encoder instance answered: the LLM instance "
            "encodes), not_announced (the encoder instance answered without params), encoder_rejected (the request "
            "was refused as invalid), no_encoder (none answered, fallback=fail: 503), llm_failed, bad_request, own "
            "(/health, /metrics)",
            ["route"],
            registry=self.registry,
        )
        self.request_seconds = Histogram(
            "tensorwire_vllm_router_request_seconds",
            "Whole client requests, from the head read to the last byte written (streams: to their end), by route",
            ["route"],
            registry=self.registry,
            buckets=(0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600),
        )
        self.in_flight = Gauge(
            "tensorwire_vllm_router_in_flight_requests",
            "Client requests being handled now (streams included)",
            registry=self.registry,
        )
        self.connections = Gauge(
            "tensorwire_vllm_router_client_connections", "Open client connections", registry=self.registry
        )
        self.connections_refused = Counter(
            "tensorwire_vllm_router_refused_connections_total",
            "Client connections answered 503 and closed: over --max-connections, or arriving while stopping",
            registry=self.registry,
        )
        self.upstream_calls = Counter(
            "tensorwire_vllm_router_upstream_calls_total",
            "Calls to instances by role (encoder, llm) and outcome: ok, error_status (an encoder 408/429/5xx; "
            "an LLM instance's own error statuses count as ok, they go to the client), unavailable (nothing sent), "
            "timeout, bad_answer, cut (a streamed answer broke or stalled after it started)",
            ["upstream", "role", "outcome"],
            registry=self.registry,
        )
        self.upstream_up = Gauge(
            "tensorwire_vllm_router_upstream_up",
            "1 while an instance is in rotation, 0 from a failed call or /health probe until a probe passes",
            ["upstream", "role"],
            registry=self.registry,
        )
        self.encoder_calls = Counter(
            "tensorwire_vllm_router_encoder_calls_total",
            "Calls to encoder instances by outcome",
            ["encoder", "outcome"],
            registry=self.registry,
        )
        self.encoder_seconds = Histogram(
            "tensorwire_vllm_router_encoder_seconds",
            "Time of one successful encoder call (request to params)",
            registry=self.registry,
            buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60),
        )
        self.client_params_dropped = Counter(
            "tensorwire_vllm_router_requests_with_client_params_total",
            "Client requests that carried their own ec_transfer_params or kv_transfer_params, on any path (removed: "
            "only encoder instances set them)",
            registry=self.registry,
        )
