"""Which encoder instances an LLM instance reads from: the producer allow-list and the compatibility hash.

The params that name an encoder instance come from outside the LLM instance (a router, a client). Two checks run
on the scheduler, when a request's params are admitted, before anything is dialed or read:

- **Trust** (:class:`ProducerTrust`, ``trusted_producers`` in ``ec_connector_extra_config``): the endpoint must
  match the allow-list. A refused grant is never dialed, not even to release it (reason ``untrusted_producer``).
  Entries (comma- or space-separated, or a JSON list): ``loopback`` (127.0.0.0/8, ::1 and the name
  ``localhost``), an address or network (``10.0.0.5``, ``10.0.0.0/8``, ``fd00::/64``), an endpoint
  (``10.0.0.5:41234``, ``[fd00::5]:41234``), a host name or ``name:port`` (compared as written, case-insensitive;
  never resolved here), and ``*`` (any endpoint: the check is off). Addresses match IP literals only: an endpoint
  written as a name matches name entries (and ``localhost`` matches ``loopback``), never a network.
  Default (key unset or empty): ``loopback``; with ``tls_ca`` set (the store's certificate is verified against
  it on every connection) any endpoint, since a certificate that chains to the configured CA, for the
  endpoint's host, is then what is trusted.
- **Compatibility** (:func:`compat_hash`): each instance hashes what decides the layout of the encoder output it
  exchanges (tensorwire's params version, vLLM's version, the model identity and revision, dtype,
  quantization). The encoder instance announces its hash in every item's params; the LLM instance refuses an
  item whose hash differs from its own, or that carries none, with reason ``incompatible``, and gives the grant
  back.

Either refusal makes the item fall back to a local encode when the request carries its media (else the request
fails through vLLM), and counts in ``refusals_total{reason}``.
"""

from __future__ import annotations

import hashlib
import ipaddress
import json
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from tensorwire.errors import ConfigError, Reason, TensorwireError
from tensorwire.integrations._vllm_ec.params import VERSION, ItemGrant, parse_params

IPNetwork = ipaddress.IPv4Network | ipaddress.IPv6Network
_LOOPBACK: tuple[IPNetwork, ...] = (ipaddress.ip_network("127.0.0.0/8"), ipaddress.ip_network("::1/128"))
_NAME = re.compile(r"^[A-Za-z0-9_.-]{1,253}$")
_ENTRY_SPLIT = re.compile(r"[,\s]+")
_ANSWERS_KEPT = 1024


@dataclass(frozen=True)
class _Rule:
    """One allow-list entry: ``network`` (IP literals inside it), or ``name`` (a host name as written), with
    ``port`` None for any port."""

    network: IPNetwork | None = None
    name: str | None = None
    port: int | None = None


def _host_ip(host: str) -> ipaddress.IPv4Address | ipaddress.IPv6Address | None:
    text = host[1:-1] if host.startswith("[") and host.endswith("]") else host
    try:
        ip = ipaddress.ip_address(text)
    except ValueError:
        return None
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        return ip.ipv4_mapped
    return ip


def _split_endpoint(endpoint: str) -> tuple[str, int] | None:
    host, sep, port = endpoint.rpartition(":")
    if not sep or not host or not port.isdigit():
        return None
    return host, int(port)


def _parse_rule(entry: str) -> list[_Rule]:
    text = entry.strip()
    low = text.lower()
    if low == "loopback":
        return [*(_Rule(network=n) for n in _LOOPBACK), _Rule(name="localhost")]
    if "/" in text:
        try:
            return [_Rule(network=ipaddress.ip_network(text.strip("[]"), strict=False))]
        except ValueError as exc:
            raise ConfigError(f"trusted_producers entry {entry!r} is not a network ({exc})") from exc
    if _host_ip(text) is not None:  # an address (an IPv6 address has colons: no port without brackets)
        return [_Rule(network=ipaddress.ip_network(str(_host_ip(text))))]
    split = _split_endpoint(text)
    host, port = split if split is not None else (text, None)
    if port is not None and not 0 < port < 65536:
        raise ConfigError(f"trusted_producers entry {entry!r}: port {port} is not in 1..65535")
    ip = _host_ip(host)
    if ip is not None:
        return [_Rule(network=ipaddress.ip_network(str(ip)), port=port)]
    if host.startswith("[") or not _NAME.match(host):
        raise ConfigError(
            f"trusted_producers entry {entry!r} is not loopback, *, an address, a network, a host "
            "name, or one of those with :port"
        )
    return [_Rule(name=host.lower(), port=port)]


def parse_trusted(value: Any) -> tuple[_Rule, ...] | None:
    """The allow-list of ``trusted_producers`` (a string or a list of strings); None for ``*`` (anything goes).
    ConfigError names a malformed entry."""
    if isinstance(value, (list, tuple)):
        entries = [str(v) for v in value]
    else:
        text = str(value or "").strip()
        if text.startswith("["):
            try:
                loaded = json.loads(text)
            except ValueError as exc:
                raise ConfigError(f"trusted_producers={text[:80]!r}: not a JSON list ({exc})") from exc
            entries = [str(v) for v in loaded] if isinstance(loaded, list) else [text]
        else:
            entries = [e for e in _ENTRY_SPLIT.split(text) if e]
    if any(e.strip() == "*" for e in entries):
        return None
    rules: list[_Rule] = []
    for e in entries:
        rules.extend(_parse_rule(e))
    return tuple(rules)


class ProducerTrust:
    """Decides whether an endpoint (``host:port`` from the params) may be dialed. ``rules`` None: any."""

    def __init__(self, rules: tuple[_Rule, ...] | None, description: str) -> None:
        self._rules = rules
        self.description = description
        self._answers: dict[str, bool] = {}  # by endpoint as written: the rules never change

    def admits(self, endpoint: str) -> bool:
        """Whether ``endpoint`` matches the allow-list (the module docstring says how); remembered for the last
        ``_ANSWERS_KEPT`` endpoints asked about (each request asks once per item, on the scheduler's thread)."""
        known = self._answers.get(endpoint)
        if known is None:
            known = self._admits(endpoint)
            if len(self._answers) >= _ANSWERS_KEPT:
                self._answers.clear()
            self._answers[endpoint] = known
        return known

    @classmethod
    def from_config(cls, trusted_producers: str, *, tls_ca: str = "") -> ProducerTrust:
        """The allow-list of the ``trusted_producers`` key; its default is described in the module docstring."""
        if str(trusted_producers).strip():
            rules = parse_trusted(trusted_producers)
            return cls(rules, "*" if rules is None else str(trusted_producers))
        if tls_ca:
            return cls(None, "any endpoint whose certificate verifies against tls_ca")
        return cls(parse_trusted("loopback"), "loopback (default)")

    def _admits(self, endpoint: str) -> bool:
        if self._rules is None:
            return True
        split = _split_endpoint(endpoint)
        if split is None:
            return False
        host, port = split
        ip = _host_ip(host)
        name = host.lower()
        for r in self._rules:
            if r.port is not None and r.port != port:
                continue
            if r.network is not None and ip is not None and ip.version == r.network.version and ip in r.network:
                return True
            if r.name is not None and ip is None and r.name == name:
                return True
        return False


def compat_hash(*, vllm_version: str, model: str, revision: str | None, dtype: str, quantization: str | None) -> str:
    """The compatibility hash of one instance (64 hex characters): equal on two instances when the encoder
    output one hands out is laid out as the other expects it."""
    factors = json.dumps(
        ["tensorwire-ec", VERSION, vllm_version, model, revision or "", dtype, quantization or ""],
        separators=(",", ":"),
    )
    return hashlib.sha256(factors.encode()).hexdigest()


class ProducerGate:
    """The consumer's admission of params: :meth:`parse` applies the allow-list (an untrusted grant becomes a
    refusal and is never handed to anything that dials), :meth:`compat_refusal` the compatibility hash."""

    def __init__(
        self,
        trust: ProducerTrust,
        compat: str | None,
        parse: Callable[[Any], Mapping[str, ItemGrant | TensorwireError]] = parse_params,
    ) -> None:
        self.trust = trust
        self.compat = compat
        self._parse = parse

    def parse(self, params: Any) -> dict[str, ItemGrant | TensorwireError]:
        out: dict[str, ItemGrant | TensorwireError] = {}
        for mm_hash, g in self._parse(params).items():
            if isinstance(g, ItemGrant) and not self.trust.admits(g.endpoint):
                g = TensorwireError(
                    f"ec_transfer_params[{mm_hash[:64]!r}]: endpoint {g.endpoint[:80]!r} is not a "
                    f"trusted producer (trusted_producers: {self.trust.description})",
                    reason=Reason.UNTRUSTED_PRODUCER,
                )
            out[mm_hash] = g
        return out

    def compat_refusal(self, grant: ItemGrant) -> TensorwireError | None:
        if self.compat is None or grant.compat == self.compat:
            return None
        what = (
            "announces no compatibility hash"
            if grant.compat is None
            else (f"has compatibility hash {grant.compat[:12]}..., this instance {self.compat[:12]}...")
        )
        return TensorwireError(
            f"the encoder instance at {grant.endpoint[:80]} {what} (vLLM version, model, dtype "
            "or tensorwire version differ)",
            reason=Reason.INCOMPATIBLE,
        )


__all__ = ["ProducerTrust", "ProducerGate", "compat_hash", "parse_trusted"]
