"""``ECConfig``: every setting of the vLLM connector and its default, from ``ec_connector_extra_config``.

Precedence: the ``ec_connector_extra_config`` key > ``TENSORWIRE_VLLM_EC_<KEY>`` in the environment > the default
here. vLLM does not coerce extra-config values, so strings from a CLI ("5000", "true") are accepted for numbers
and booleans. An unknown key is a ConfigError naming the known ones (a typo must not silently keep a default).
No vLLM import: the settings are testable without vLLM.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from tensorwire._grpc.tls import ENV_TLS_PREFIX, TlsConfig
from tensorwire._local import unix as _unix
from tensorwire.errors import ConfigError
from tensorwire.integrations._vllm_ec.trust import parse_trusted

ENV_PREFIX = "TENSORWIRE_VLLM_EC_"
FALLBACKS = ("local", "fail")
LOCAL_CHANNELS = ("auto", "on", "off")


@dataclass(frozen=True)
class ECConfig:
    """Connector settings (both roles read the same keys; each uses its own).

    Producer (encoder instance): ``host``/``port`` bind the held-outputs gRPC service (``host`` defaults to the
    loopback address, as every tensorwire listener does, docs/security.md "No wildcard listener by default": an
    LLM instance on another host needs ``host`` set to an address it can reach, or ``0.0.0.0``; port 0: the OS picks;
    needs no fixed port, the scheduler learns it from a file under ``runtime_dir``); ``rdma_port`` is the RDMA
    metadata endpoint's port (0: any; fix it to open one port in a firewall); ``advertise_host`` is the
    host written into ``ec_transfer_params`` and into the RDMA descriptors (default: ``host`` when it is a specific
    address, else this host's detected address; the RDMA metadata endpoint follows ``host``); ``lease_ttl_ms`` is
    how long an item stays exported without being released (the rdma slot GC);
    ``pool_cap_bytes`` bounds the exported memory (a save that does not fit is not announced); ``receipts``
    (default true) puts each item's slot descriptor in the params, so that an LLM instance reads it without a
    Lookup (``receipts``; false: every item is looked up). ``same_host_map`` (default true, both roles): the
    producer also copies each host-memory item into a memfd of its own that an LLM instance on the same host maps
    instead of reading (one more copy on the save path and the item's bytes twice while held, none on the fetch
    path; the pages are shared until the LLM instance's encoder cache drops the item); the consumer maps such an
    item when its producer is on this host.

    Consumer (LLM instance): ``fetch_timeout_ms`` is the budget of one item, from the request's arrival to every
    rank holding the tensors (lookup, reads, the hold on the request); ``lookup_timeout_ms`` and
    ``release_timeout_ms`` bound the two control RPCs; ``fetch_threads`` items are fetched at once;
    ``failures_to_open`` consecutive endpoint faults open an endpoint's breaker for ``open_seconds``;
    ``fallback``: ``local`` encodes an item locally when the request still carries its media (else the request
    fails), ``fail`` always fails the request. ``trusted_producers``: the encoder instances' store endpoints this
    instance may dial (``tensorwire.integrations._vllm_ec.trust``: ``loopback``, addresses, networks, ``host:port``,
    host names, ``*``; comma-separated or a list; default loopback, or with ``tls_ca`` any endpoint whose
    certificate verifies); any other endpoint in a request's params is refused before it is dialed.

    Both: ``model_identity`` is the model name folded into the compatibility hash (default: vLLM's ``model``, which
    may be a local path: set the same name on both instances when their paths differ).

    Both: ``device`` (``auto``: the worker's device; ``cpu`` or ``cuda:N``), ``rdma_provider`` (``auto``, ``nixl``,
    ``none``: no RDMA, items travel inline over gRPC), ``runtime_dir`` (sockets and rendezvous files; default
    ``vllm`` under tensorwire's per-user directory: ``$XDG_RUNTIME_DIR/tensorwire`` when it is a private
    directory of ours, else ``$TMPDIR/tensorwire-<uid>``), ``local_channel`` (``auto``: the producer's store also
    serves Lookup/Release on a Unix socket under ``runtime_dir`` unless it requires client certificates, and a
    consumer on the same host uses it; ``on``: open it even with mTLS (same uid is then trusted as much as a
    certificate); ``off``: gRPC only),
    ``metrics_port`` (0: none; N: serve this process's Prometheus metrics on N, a
    worker of TP rank r on N + 1 + r).

    Transport security of the held-outputs store (docs/security.md, the CLI's ``--tls-*`` / ``--insecure``):
    ``tls_cert``/``tls_key`` make the producer's store listen with TLS, with ``tls_ca`` (and ``tls_client_auth``,
    on by default) requiring client certificates signed by it (mTLS); the consumer speaks TLS to the stores when
    ``tls_ca`` or ``tls_cert`` is set, presents ``tls_cert`` and checks the store's certificate for the endpoint's
    host (or ``tls_server_name``). Unset keys fall back to ``TENSORWIRE_VLLM_EC_TLS_*``, then to the rest of
    tensorwire's ``TENSORWIRE_MM_TLS_*``. Without a certificate the store binds a non-loopback ``host`` only with
    ``insecure: true``. The consumer's staging sockets are unix sockets (no TLS; the 0700 ``runtime_dir`` guards
    them).
    """

    host: str = "127.0.0.1"
    port: int = 0
    rdma_port: int = 0
    advertise_host: str = ""
    lease_ttl_ms: int = 60000
    pool_cap_bytes: int = 8 * 1024**3
    fetch_timeout_ms: int = 10000
    lookup_timeout_ms: int = 2000
    release_timeout_ms: int = 1000
    fetch_threads: int = 4
    failures_to_open: int = 3
    open_seconds: float = 30.0
    fallback: str = "local"
    trusted_producers: str = ""
    model_identity: str = ""
    device: str = "auto"
    rdma_provider: str = "auto"
    runtime_dir: str = ""
    local_channel: str = "auto"
    metrics_port: int = 0
    tls_cert: str = ""
    tls_key: str = ""
    tls_ca: str = ""
    tls_server_name: str = ""
    tls_client_auth: bool = True
    insecure: bool = False
    receipts: bool = True
    same_host_map: bool = True

    def __post_init__(self) -> None:
        _int("port", self.port, 0, 65535)
        _int("rdma_port", self.rdma_port, 0, 65535)
        _int("lease_ttl_ms", self.lease_ttl_ms, 1, 86_400_000)
        _int("pool_cap_bytes", self.pool_cap_bytes, 1, 1 << 52)
        _int("fetch_timeout_ms", self.fetch_timeout_ms, 1, 3_600_000)
        _int("lookup_timeout_ms", self.lookup_timeout_ms, 1, 3_600_000)
        _int("release_timeout_ms", self.release_timeout_ms, 1, 3_600_000)
        _int("fetch_threads", self.fetch_threads, 1, 256)
        _int("failures_to_open", self.failures_to_open, 1, 1_000_000)
        _int("metrics_port", self.metrics_port, 0, 65535)
        if not isinstance(self.open_seconds, (int, float)) or not 0 < self.open_seconds <= 86_400:
            raise ConfigError(f"ec_connector_extra_config.open_seconds={self.open_seconds!r}: expected (0, 86400]")
        if self.fallback not in FALLBACKS:
            raise ConfigError(f"ec_connector_extra_config.fallback={self.fallback!r}: expected one of {FALLBACKS}")
        if not isinstance(self.trusted_producers, str):
            raise ConfigError(
                f"ec_connector_extra_config.trusted_producers={self.trusted_producers!r}: expected a "
                "string or a list of strings"
            )
        parse_trusted(self.trusted_producers)  # ConfigError names a malformed entry
        if self.local_channel not in LOCAL_CHANNELS:
            raise ConfigError(
                f"ec_connector_extra_config.local_channel={self.local_channel!r}: expected one of {LOCAL_CHANNELS}"
            )
        if not isinstance(self.host, str) or not self.host:
            raise ConfigError(f"ec_connector_extra_config.host={self.host!r}: expected an address to bind")
        if self.device != "auto" and not (self.device == "cpu" or self.device.startswith("cuda:")):
            raise ConfigError(f"ec_connector_extra_config.device={self.device!r}: expected auto, cpu or cuda:N")
        if not isinstance(self.insecure, bool):
            raise ConfigError(f"ec_connector_extra_config.insecure={self.insecure!r}: expected a boolean")
        if not isinstance(self.receipts, bool):
            raise ConfigError(f"ec_connector_extra_config.receipts={self.receipts!r}: expected a boolean")
        if not isinstance(self.same_host_map, bool):
            raise ConfigError(f"ec_connector_extra_config.same_host_map={self.same_host_map!r}: expected a boolean")
        try:
            self.tls  # noqa: B018 (validates the TLS keys together)
        except ConfigError as exc:
            raise ConfigError(f"ec_connector_extra_config tls_*: {exc}") from exc

    @property
    def tls(self) -> TlsConfig:
        """The store's TLS settings (server side in the producer, client side in the consumer)."""
        return TlsConfig(
            cert=self.tls_cert,
            key=self.tls_key,
            ca=self.tls_ca,
            server_name=self.tls_server_name,
            client_auth=self.tls_client_auth,
        )

    @property
    def serves_local_channel(self) -> bool:
        """Producer: open the store's same-host socket (``auto`` keeps it closed for an mTLS store)."""
        return self.local_channel == "on" or (self.local_channel == "auto" and not self.tls.mutual)

    @property
    def effective_runtime_dir(self) -> str:
        # Per user, as the broadcaster's and the same-host channel's: one shared /tmp/tensorwire-vllm made a
        # second user on the host fail with "must be owned by uid ...".
        return self.runtime_dir or os.path.join(_unix.default_runtime_dir(), "vllm")

    @classmethod
    def known_keys(cls) -> tuple[str, ...]:
        return tuple(f.name for f in dataclasses.fields(cls))

    @classmethod
    def from_extra(cls, extra: Mapping[str, Any] | None, environ: Mapping[str, str] | None = None) -> ECConfig:
        """Build from ``ec_connector_extra_config`` (plus ``TENSORWIRE_VLLM_EC_*``); ConfigError on a bad key."""
        extra = dict(extra or {})
        environ = os.environ if environ is None else environ
        known = {f.name: f for f in dataclasses.fields(cls)}
        unknown = sorted(set(extra) - set(known))
        if unknown:
            raise ConfigError(f"ec_connector_extra_config: unknown key(s) {unknown}; known: {sorted(known)}")
        kwargs: dict[str, Any] = {}
        for name, f in known.items():
            if name in extra:
                raw, where = extra[name], f"ec_connector_extra_config.{name}"
            elif ENV_PREFIX + name.upper() in environ:
                raw, where = environ[ENV_PREFIX + name.upper()], ENV_PREFIX + name.upper()
            elif name.startswith("tls_") and ENV_TLS_PREFIX + name[4:].upper() in environ:
                # the rest of tensorwire's TLS settings (TransportConfig.from_env, the CLI's environment)
                raw, where = environ[ENV_TLS_PREFIX + name[4:].upper()], ENV_TLS_PREFIX + name[4:].upper()
            else:
                continue
            kwargs[name] = _coerce(raw, f.type, where)
        return cls(**kwargs)

    def as_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def _coerce(raw: Any, typ: Any, where: str) -> Any:
    typ = typ if isinstance(typ, str) else getattr(typ, "__name__", str(typ))
    try:
        if typ == "int":
            if isinstance(raw, bool):
                raise ValueError("a boolean is not an integer")
            return int(raw, 0) if isinstance(raw, str) else int(raw)
        if typ == "float":
            return float(raw)
        if typ == "bool":
            if isinstance(raw, bool):
                return raw
            text = str(raw).strip().lower()
            if text in ("1", "true", "yes", "on"):
                return True
            if text in ("0", "false", "no", "off"):
                return False
            raise ValueError(f"{raw!r} is not a boolean")
        if isinstance(raw, (list, tuple)):  # a JSON list (trusted_producers)
            return ",".join(str(v) for v in raw)
        return str(raw)
    except (TypeError, ValueError) as exc:
        raise ConfigError(f"{where}={raw!r}: expected {typ} ({exc})") from exc


def _int(name: str, value: object, lo: int, hi: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or not lo <= value <= hi:
        raise ConfigError(f"ec_connector_extra_config.{name}={value!r}: expected an integer in [{lo}, {hi}]")


__all__ = ["ECConfig", "ENV_PREFIX", "FALLBACKS", "LOCAL_CHANNELS"]
