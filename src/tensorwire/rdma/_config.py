"""``RdmaConfig``: every setting of the rdma layer and its default, in one frozen dataclass."""

from __future__ import annotations

import dataclasses
import ipaddress
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from tensorwire.errors import ConfigError
from tensorwire.rdma._registry import known_providers

KIB = 1024
MIB = 1024 * KIB
GIB = 1024 * MIB

_DEVICE_RE = re.compile(r"^(cpu|cuda:(\d+))$")


@dataclass(frozen=True)
class RdmaConfig:
    """Settings shared by :class:`TensorExporter` and :class:`TensorReader`; validated on construction.

    ``provider``: ``"auto"`` (nixl when importable, else none), ``"nixl"``, ``"none"`` (never available, so
    callers fall back), or a name added with ``register_provider``. ``device``: ``"cpu"`` or ``"cuda:N"``; a bare
    ``"cuda"`` is refused so no process silently lands on GPU 0. ``bind_ip``/``port``: the owner's metadata
    listener (port 0 = any); ``advertise_host`` is the host written into descriptors; ``control_host`` is the
    address the caller's control plane is bound to (``tensorwire.mm`` sets it from its gRPC server). Left empty,
    ``bind_ip`` and ``advertise_host`` follow the control plane, else this host's detected address; never a
    wildcard unless ``bind_ip`` says so (the rules: ``tensorwire.rdma._endpoint``). ``read_timeout_ms`` caps one
    ``read()`` when the call gives no timeout.
    ``slot_gc_timeout_ms``: leases not released within this are reclaimed. ``max_slot_bytes`` bounds one slot on
    export and every descriptor on read; ``pool_cap_bytes`` bounds all pool-owned memory of one exporter (and,
    separately, one reader's pooled read buffers); ``slot_align`` is the manifest offset alignment (a power of 2).
    ``qp_count`` is the provider's transfer concurrency (NIXL: UCX workers of the agent).
    ``progress_delay_us`` is how long an idle NIXL progress thread sleeps in poll(); 0 busy-spins a core.
    ``same_host_copy`` (1): a host reader copies host slots of an owner on its own host with one
    ``process_vm_readv`` instead of a READ through the provider (``tensorwire.rdma._local``); 0 always READs.
    """

    provider: str = "auto"
    device: str = "cpu"
    bind_ip: str = ""
    port: int = 0
    advertise_host: str = ""
    control_host: str = ""
    qp_count: int = 8
    connect_timeout_ms: int = 250
    read_timeout_ms: int = 3000
    slot_gc_timeout_ms: int = 60000
    max_slot_bytes: int = 1 * GIB
    pool_cap_bytes: int = 8 * GIB
    slot_align: int = 4096
    progress_delay_us: int = 1000
    same_host_copy: int = 1

    def __post_init__(self) -> None:
        known = ("auto", *known_providers())
        if self.provider not in known:
            raise ConfigError(
                f"RdmaConfig.provider={self.provider!r}: unknown rdma provider; known: {', '.join(known)}"
            )
        if not isinstance(self.device, str) or not _DEVICE_RE.match(self.device):
            raise ConfigError(
                f"RdmaConfig.device={self.device!r}: expected 'cpu' or 'cuda:N' "
                "(an explicit index; never implicit cuda:0)"
            )
        if self.bind_ip:
            _check_ip("bind_ip", self.bind_ip)
        _check_int("port", self.port, 0, 65535)
        for name in ("advertise_host", "control_host"):
            value = getattr(self, name)
            if not isinstance(value, str) or len(value) > 255 or any(c.isspace() for c in value):
                raise ConfigError(f"RdmaConfig.{name}={value!r}: expected a host name or address without spaces")
        _check_int("qp_count", self.qp_count, 1, 1024)
        _check_int("connect_timeout_ms", self.connect_timeout_ms, 1, 3_600_000)
        _check_int("read_timeout_ms", self.read_timeout_ms, 1, 86_400_000)
        _check_int("slot_gc_timeout_ms", self.slot_gc_timeout_ms, 1, 86_400_000)
        _check_int("slot_align", self.slot_align, 8, 1 * GIB)
        if self.slot_align & (self.slot_align - 1):
            raise ConfigError(f"RdmaConfig.slot_align={self.slot_align}: must be a power of two")
        _check_int("max_slot_bytes", self.max_slot_bytes, 1, 1 << 48)
        _check_int("pool_cap_bytes", self.pool_cap_bytes, 1, 1 << 52)
        if self.max_slot_bytes > self.pool_cap_bytes:
            raise ConfigError(
                f"RdmaConfig.max_slot_bytes={self.max_slot_bytes} exceeds pool_cap_bytes={self.pool_cap_bytes}; "
                "a slot of the maximum size could never be allocated"
            )
        _check_int("progress_delay_us", self.progress_delay_us, 0, 1_000_000)
        _check_int("same_host_copy", self.same_host_copy, 0, 1)

    @property
    def is_cuda(self) -> bool:
        return self.device.startswith("cuda:")

    @property
    def device_index(self) -> int:
        """The CUDA device index (0 for cpu, where it is the NIXL devId of host memory)."""
        m = _DEVICE_RE.match(self.device)
        return int(m.group(2)) if m and m.group(2) is not None else 0

    def replace(self, **changes: Any) -> RdmaConfig:
        """A copy with ``changes`` applied (validated again)."""
        return dataclasses.replace(self, **changes)

    @classmethod
    def from_env(cls, environ: Mapping[str, str]) -> RdmaConfig:
        """Build from ``TENSORWIRE_RDMA_<FIELD>`` variables (upper case); unset fields keep their defaults."""
        kwargs: dict[str, Any] = {}
        for f in dataclasses.fields(cls):
            raw = environ.get(f"TENSORWIRE_RDMA_{f.name.upper()}")
            if raw is None:
                continue
            if f.type in ("int", int):
                try:
                    kwargs[f.name] = int(raw, 0)
                except ValueError as exc:
                    raise ConfigError(f"TENSORWIRE_RDMA_{f.name.upper()}={raw!r}: not an integer") from exc
            else:
                kwargs[f.name] = raw
        return cls(**kwargs)


def _check_int(name: str, value: object, lo: int, hi: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or not lo <= value <= hi:
        raise ConfigError(f"RdmaConfig.{name}={value!r}: expected an integer in [{lo}, {hi}]")


def _check_ip(name: str, value: str) -> None:
    try:
        ipaddress.ip_address(value)
    except ValueError as exc:
        raise ConfigError(
            f"RdmaConfig.{name}={value!r}: expected an IP address ('0.0.0.0' for all interfaces) "
            "or '' (follow the control plane)"
        ) from exc
