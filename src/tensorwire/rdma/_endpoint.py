"""Where the owner's metadata endpoint listens and which host descriptors advertise: the rules, in one place.

Nothing here assumes one host, and nothing listens on a wildcard address unless asked to. The rules (documented
in docs/deployment.md "Addresses"), with ``control_host`` the address the caller's control plane is bound to
(``tensorwire.mm`` sets it from its gRPC server; empty for a bare ``TensorExporter``):

Bind address of the metadata listener:
  1. ``bind_ip`` when set (an explicit ``0.0.0.0`` / ``::`` is honoured);
  2. ``control_host`` when it is a specific address (a host name is resolved): the endpoint follows the control
     plane;
  3. ``advertise_host`` when it is an address of this host;
  4. the detected address (below).

Advertised host (written into every descriptor):
  1. ``advertise_host`` when set;
  2. the bind address when it is specific;
  3. ``control_host`` when it is specific;
  4. the detected address.

Detected address: the source address of this host's route to the outside (a connected UDP socket: nothing is
sent); else the first non-loopback IPv4 address of an interface that is up; else 127.0.0.1, with a warning.

``announce`` logs the outcome once per owner on the ``tensorwire.rdma.endpoint`` logger (INFO; ``serve-encoder``
shows it at its default log level) and warns when the advertised host is loopback while the listener or the
control plane is not, or when ``UCX_NET_DEVICES`` keeps UCX on loopback while a non-loopback host is advertised.
"""

from __future__ import annotations

import ipaddress
import logging
import os
import socket
import struct
from dataclasses import dataclass

log = logging.getLogger("tensorwire.rdma.endpoint")

WILDCARDS = ("0.0.0.0", "::")
LOOPBACK = "127.0.0.1"
_ROUTE_PROBE = ("192.0.2.1", 9)  # TEST-NET-1: only the route lookup matters, connect() on UDP sends nothing
_SIOCGIFFLAGS = 0x8913
_SIOCGIFADDR = 0x8915
_IFF_UP = 0x1
_IFF_LOOPBACK = 0x8


@dataclass(frozen=True)
class MetadataEndpoint:
    """The resolved metadata endpoint: what to bind, what to advertise, and which rule chose each (for logs)."""

    bind_ip: str
    advertise_host: str
    bind_rule: str
    advertise_rule: str


def bare(host: str) -> str:
    """``host`` without the brackets of an IPv6 literal (``[::1]`` -> ``::1``)."""
    host = host.strip()
    return host[1:-1] if host.startswith("[") and host.endswith("]") else host


def is_wildcard(host: str) -> bool:
    return bare(host) in ("", *WILDCARDS)


def is_loopback(host: str) -> bool:
    h = bare(host)
    if h == "localhost":
        return True
    try:
        return ipaddress.ip_address(h).is_loopback
    except ValueError:
        return False


def to_ip(host: str) -> str | None:
    """The IP address ``host`` names (a literal as is, a name resolved once), or None."""
    h = bare(host)
    try:
        return str(ipaddress.ip_address(h))
    except ValueError:
        pass
    try:
        infos = socket.getaddrinfo(h, None, type=socket.SOCK_STREAM)
    except (OSError, UnicodeError):
        return None
    infos.sort(key=lambda i: i[0] != socket.AF_INET)  # IPv4 first: UCX and most deployments use it
    return str(infos[0][4][0]) if infos else None


def is_local(ip: str) -> bool:
    """Whether ``ip`` is an address of this host (binding it succeeds)."""
    try:
        family = socket.AF_INET6 if ":" in ip else socket.AF_INET
        with socket.socket(family, socket.SOCK_DGRAM) as s:
            s.bind((ip, 0))
        return True
    except (OSError, ValueError):
        return False


def route_address() -> str | None:
    """This host's source address toward the outside, or None (no route, or only loopback)."""
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.connect(_ROUTE_PROBE)
            addr = str(s.getsockname()[0])
    except OSError:
        return None
    return None if is_wildcard(addr) or is_loopback(addr) else addr


def interface_addresses() -> list[str]:
    """IPv4 addresses of the interfaces that are up and not loopback, in interface-index order (Linux ioctls)."""
    try:
        import fcntl
    except ImportError:
        return []
    out: list[str] = []
    try:
        names = [name for _, name in sorted(socket.if_nameindex())]
    except OSError:
        return []
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        for name in names:
            req = struct.pack("256s", name.encode()[:15])
            try:
                flags = struct.unpack_from("H", fcntl.ioctl(s.fileno(), _SIOCGIFFLAGS, req), 16)[0]
                if not flags & _IFF_UP or flags & _IFF_LOOPBACK:
                    continue
                addr = socket.inet_ntoa(fcntl.ioctl(s.fileno(), _SIOCGIFADDR, req)[20:24])
            except OSError:  # no IPv4 address on this interface
                continue
            if not is_loopback(addr):
                out.append(addr)
    return out


def detect() -> tuple[str, str]:
    """(address, rule): the route's source address, else the first interface address, else loopback."""
    addr = route_address()
    if addr is not None:
        return addr, "the source address of this host's default route"
    found = interface_addresses()
    if found:
        return found[0], "the first non-loopback interface address (no default route)"
    return LOOPBACK, "no non-loopback address found"


def resolve(bind_ip: str, advertise_host: str, control_host: str) -> MetadataEndpoint:
    """Apply the rules of the module docstring."""
    control = to_ip(control_host) if control_host and not is_wildcard(control_host) else None
    detected: tuple[str, str] | None = None

    def detected_once() -> tuple[str, str]:
        nonlocal detected
        if detected is None:
            detected = detect()
        return detected

    if bind_ip:
        bind, bind_rule = bare(bind_ip), "--rdma-bind-ip / RdmaConfig.bind_ip"
    elif control is not None:
        bind, bind_rule = control, f"follows the control plane's address {control_host}"
    elif advertise_host and (ip := to_ip(advertise_host)) is not None and is_local(ip):
        bind, bind_rule = ip, "the advertised host, an address of this host"
    else:
        bind, bind_rule = detected_once()
    if advertise_host:
        adv, adv_rule = bare(advertise_host), "--rdma-advertise-host / RdmaConfig.advertise_host"
    elif not is_wildcard(bind):
        adv, adv_rule = bind, "the listener's address"
    elif control is not None:
        adv, adv_rule = control, f"the control plane's address {control_host}"
    else:
        adv, adv_rule = detected_once()
    return MetadataEndpoint(bind, adv, bind_rule, adv_rule)


def announce(ep: MetadataEndpoint, port: int, agent_name: str, control_host: str = "") -> list[str]:
    """Log where the endpoint listens and what it advertises; returns the warnings it logged (for tests)."""
    log.info(
        "rdma metadata endpoint of %s: listening on %s:%d (%s); descriptors advertise %s (%s)",
        agent_name,
        ep.bind_ip,
        port,
        ep.bind_rule,
        ep.advertise_host,
        ep.advertise_rule,
    )
    warnings: list[str] = []
    serving = [h for h in (ep.bind_ip, control_host) if h and not is_loopback(h)]
    if is_loopback(ep.advertise_host) and serving:
        warnings.append(
            f"RDMA descriptors advertise the loopback address {ep.advertise_host} while this process serves "
            f"{', '.join(sorted(set(serving)))}: readers on other hosts cannot reach the metadata endpoint and fall "
            "back to the inline plane on every request. Set --rdma-advertise-host (TENSORWIRE_MM_RDMA_ADVERTISE_HOST) "
            "to an address they reach, or bind the control plane to one"
        )
    devices = os.environ.get("UCX_NET_DEVICES", "")
    if devices and not is_loopback(ep.advertise_host) and {d.strip() for d in devices.split(",")} <= {"lo"}:
        warnings.append(
            f"UCX_NET_DEVICES={devices} keeps UCX on loopback while descriptors advertise {ep.advertise_host}: "
            "readers on other hosts fetch the metadata but cannot connect over UCX. Name this host's NICs in "
            "UCX_NET_DEVICES (or unset it)"
        )
    for w in warnings:
        log.warning("%s", w)
    return warnings


__all__ = [
    "MetadataEndpoint",
    "announce",
    "bare",
    "detect",
    "interface_addresses",
    "is_local",
    "is_loopback",
    "is_wildcard",
    "resolve",
    "route_address",
    "to_ip",
]
