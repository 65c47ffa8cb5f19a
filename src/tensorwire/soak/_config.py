"""SoakConfig: every knob of the soak and load runs, with its default, in one place."""

from __future__ import annotations

from dataclasses import dataclass, field

from tensorwire.errors import ConfigError

FAULT_KINDS: tuple[str, ...] = (
    "reader_kill",  # a client process SIGKILLed while one of its RDMA reads is in flight (never client 0)
    "worker_restart",  # an encoder worker SIGKILLed, a new one started, its relay pointed at it (never worker 0)
    "release_drop",  # ReleaseLeases answered "released" by a relay without reaching the worker
    "release_delay",  # ReleaseLeases held back by a relay for up to 1.5 s
    "unavailable",  # a relay answers UNAVAILABLE to every call for 0.5-3 s (front or one worker)
    "pool",  # worker 1 runs with a tiny pool_cap_bytes: exports fail with PoolExhausted
    "corrupt",  # receipts rewritten by a relay (bad descriptors, roles, split sizes, inline fields)
)


def parse_faults(text: str) -> tuple[str, ...]:
    """``all``, ``none`` or a comma list of FAULT_KINDS."""
    text = text.strip().lower()
    if text in ("all", ""):
        return FAULT_KINDS
    if text == "none":
        return ()
    kinds = tuple(k.strip() for k in text.split(",") if k.strip())
    unknown = [k for k in kinds if k not in FAULT_KINDS]
    if unknown:
        raise ConfigError(f"unknown fault kind(s) {unknown}; known: {', '.join(FAULT_KINDS)}, all, none")
    return kinds


@dataclass(frozen=True)
class Topology:
    """Hosts as network namespaces (``tensorwire.testing.netns``): where the soak's processes run.

    The soak itself (proxy and relays) runs in the host whose address is ``front_host`` (start it there, for
    example under ``ip netns exec``); the front relay binds that address. Client processes enter
    ``client_netns``; worker ``i`` enters ``worker_netns[i]`` and serves on ``worker_hosts[i]``.
    """

    front_host: str
    client_netns: str
    worker_netns: tuple[str, ...]
    worker_hosts: tuple[str, ...]


@dataclass(frozen=True)
class SoakConfig:
    duration_s: float = 60.0
    concurrency: int = 8  # fetcher threads over all client processes
    client_processes: int = 0  # 0: min(4, concurrency)
    faults: tuple[str, ...] = FAULT_KINDS
    seed: int = 1
    workers: int = 2
    # Short GC window so "no lease outstanding after the GC window" is checked within seconds.
    slot_gc_timeout_ms: int = 3_000
    tiny_pool_cap_bytes: int = 3 * 1024 * 1024  # the "pool" fault's worker: about two large outputs
    budget_ms: int = 20_000  # each fetch's total budget
    hang_grace_s: float = 10.0  # a fetch still running budget + grace after it started is hung
    release_timeout_ms: int = 1_000
    breaker_open_s: float = 2.0  # short, so an opened breaker is probed again within the soak
    fault_interval_s: tuple[float, float] = (0.5, 2.0)
    worker_restart_min_gap_s: float = 8.0
    # At most one worker faulted (restarting or cut off) at a time, so one healthy worker can always serve; the
    # availability figure (docs/reliability.md) is about that case. Client-side cuts may overlap anything.
    one_worker_fault: bool = True
    release_drop_p: float = 0.05
    release_delay_p: float = 0.05
    corrupt_p: float = 0.05
    planes: tuple[str, ...] = ("auto",)  # client modes, assigned round-robin to the client processes
    progress_s: float = 5.0
    # A worker's start (model + RDMA exporter) and the clients' warm-up, each; minutes on a crowded 2-core host.
    startup_timeout_s: float = 600.0
    sample_s: float = 1.0  # resource timeline period
    warmup: int = 18  # fetches per client process before the baseline (all shapes, both workers)
    extra: dict[str, str] = field(default_factory=dict)
    topology: Topology | None = None  # None: every process on this host's loopback

    def __post_init__(self) -> None:
        if self.duration_s <= 0 or self.concurrency < 1 or self.workers < 1:
            raise ConfigError("duration_s > 0, concurrency >= 1 and workers >= 1 are required")
        for k in self.faults:
            if k not in FAULT_KINDS:
                raise ConfigError(f"unknown fault kind {k!r}")
        if "pool" in self.faults and self.workers < 2:
            raise ConfigError("the pool fault needs two workers (one keeps a normal pool)")
        if self.topology is not None and not (
            len(self.topology.worker_netns) == len(self.topology.worker_hosts) == self.workers
        ):
            raise ConfigError("topology needs one worker namespace and one worker host per worker")
        for p in self.planes:
            if p not in ("auto", "grpc"):
                raise ConfigError(f"plane mode {p!r} is not auto or grpc")

    @property
    def processes(self) -> int:
        n = self.client_processes or min(4, self.concurrency)
        return max(1, min(n, self.concurrency))


__all__ = ["FAULT_KINDS", "SoakConfig", "Topology", "parse_faults"]
