"""``parse_endpoint("host:port")``: the one check of a HOST:PORT the operator typed (``--endpoint``, ``--worker``).

gRPC takes almost any string as a target and guesses the rest: ``localhost`` silently means port 443, and
``127.0.0.1:99999`` some other port. An operator's typo should be an error that says what was expected, so the
CLI and ``ProxyConfig`` accept only ``HOST:PORT`` with a port in 1..65535 (IPv6 hosts in brackets,
``[::1]:7001``), and no gRPC target schemes (``dns:``, ``unix:``, ...).
"""

from __future__ import annotations

import re
from typing import NamedTuple

from tensorwire.errors import ConfigError

_HOST = re.compile(r"^(\[[0-9A-Fa-f:.%a-zA-Z]+\]|[A-Za-z0-9]([A-Za-z0-9.\-_]*[A-Za-z0-9])?)$")


class HostPort(NamedTuple):
    host: str  # as given (IPv6 keeps its brackets)
    port: int

    def __str__(self) -> str:
        return f"{self.host}:{self.port}"


def parse_endpoint(text: str, what: str = "endpoint") -> HostPort:
    """``HostPort(host, port)``, or ``ConfigError`` naming ``what`` and the expected form."""
    expected = f"{what} {text!r}: expected HOST:PORT with a port in 1..65535 (e.g. 127.0.0.1:7001 or [::1]:7001)"
    host, sep, port = text.strip().rpartition(":")
    if not sep or not host or not port:
        raise ConfigError(expected + ("; the port is missing" if not sep else ""))
    if "://" in text or host.lower() in ("dns", "unix", "ipv4", "ipv6", "unix-abstract", "vsock"):
        raise ConfigError(expected + "; gRPC target schemes are not accepted here")
    if not port.isdigit() or not 0 < int(port) < 65536:
        raise ConfigError(expected + f"; {port!r} is not a port")
    if ":" in host and not host.startswith("["):
        raise ConfigError(expected + "; put an IPv6 address in brackets")
    if not _HOST.match(host):
        raise ConfigError(expected + f"; {host!r} is not a host name or address")
    return HostPort(host, int(port))


__all__ = ["HostPort", "parse_endpoint"]
