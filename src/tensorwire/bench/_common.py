"""Shared helpers for benchmark scripts: statistics, throwaway TLS identities; the machine description and the
JSON output are ``tensorwire._results``'s (re-exported here)."""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from tensorwire._results import RESULTS_DIR, cuda_mps_active, machine_info, machine_tag, write_result


def summarize(samples_s: Sequence[float]) -> dict[str, float]:
    """Median, p99, mean, sd, min and max of a list of durations, in milliseconds."""
    ms = sorted(s * 1e3 for s in samples_s)
    if not ms:
        return {}
    p99 = ms[min(len(ms) - 1, int(round(0.99 * (len(ms) - 1))))]
    return {
        "n": len(ms),
        "median_ms": statistics.median(ms),
        "p99_ms": p99,
        "mean_ms": statistics.fmean(ms),
        "sd_ms": statistics.stdev(ms) if len(ms) > 1 else 0.0,
        "min_ms": ms[0],
        "max_ms": ms[-1],
    }


def bench_tls(directory: str | Path) -> tuple[Any, Any]:
    """(server, client) ``TlsConfig`` for an mTLS benchmark: a throwaway CA and two identities made under
    ``directory`` at run time (``tensorwire.testing.pki``)."""
    from tensorwire._grpc.tls import TlsConfig
    from tensorwire.testing.pki import make_pki

    pki = make_pki(directory, ["bench-encoder", "bench-llm"])
    server, client = pki["bench-encoder"], pki["bench-llm"]
    return (
        TlsConfig(cert=str(server.cert), key=str(server.key), ca=str(pki.ca)),
        TlsConfig(cert=str(client.cert), key=str(client.key), ca=str(pki.ca)),
    )


__all__ = ["RESULTS_DIR", "bench_tls", "cuda_mps_active", "machine_info", "machine_tag", "summarize", "write_result"]
