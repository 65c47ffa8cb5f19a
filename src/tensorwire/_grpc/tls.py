"""TLS and mTLS for every gRPC hop: ``TlsConfig`` and the credentials built from it.

One ``TlsConfig`` serves both ends of a hop (and both sides of a proxy):

- a server listens with TLS when ``cert`` and ``key`` are set; with ``client_auth`` (the default) it also requires
  a client certificate signed by ``ca`` (mTLS) and refuses the handshake otherwise;
- a client speaks TLS when ``ca`` (or ``cert``) is set: it verifies the server's certificate against ``ca`` (the
  system roots when empty) for the endpoint's host name, or ``server_name`` when set, and presents ``cert`` /
  ``key`` as its client certificate when they are set.

Reload: a server re-reads the three files when any of them changed (checked at most once a second, at a new
connection's handshake: gRPC's certificate-config fetcher), once the new key matches the new certificate, so
rotated certificates take effect for new connections without a restart; connections already open keep theirs.
A client's credentials are fixed when its channel is built: replace them by restarting the client.

Environment: ``TENSORWIRE_MM_TLS_<FIELD>`` (``TENSORWIRE_MM_TLS_CERT``, ``..._KEY``, ``..._CA``,
``..._SERVER_NAME``, ``..._CLIENT_AUTH``); flags ``--tls-<field>``.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from tensorwire.errors import ConfigError

if TYPE_CHECKING:
    import grpc


def _log() -> Any:
    """This module's logger (logging is imported on first use: the CLI's --help builds TLS flags without it)."""
    import logging

    return logging.getLogger(__name__)


ENV_TLS_PREFIX = "TENSORWIRE_MM_TLS_"
RELOAD_CHECK_S = 1.0  # how often a handshake may stat the certificate files


@dataclass(frozen=True)
class TlsConfig:
    """Certificate files of one process (PEM). Empty strings: unset. See the module docstring for who uses what."""

    cert: str = ""  # this process's certificate chain: the server's, or the client's for mTLS
    key: str = ""  # the private key of ``cert``
    ca: str = ""  # CA bundle that signs the peers: a server verifies clients with it, a client the server
    server_name: str = ""  # client: the name expected in the server's certificate ('' = the endpoint's host)
    client_auth: bool = True  # server: require a client certificate signed by ``ca`` (mTLS)

    def __post_init__(self) -> None:
        for name in ("cert", "key", "ca", "server_name"):
            if not isinstance(getattr(self, name), str):
                raise ConfigError(f"tls.{name}={getattr(self, name)!r} must be a string (a file path)")
        if not isinstance(self.client_auth, bool):
            raise ConfigError(f"tls.client_auth={self.client_auth!r} must be a bool")
        if bool(self.cert) != bool(self.key):
            raise ConfigError("tls.cert and tls.key come together (--tls-cert and --tls-key): one is missing")

    @property
    def server_enabled(self) -> bool:
        """A server with this config listens with TLS."""
        return bool(self.cert)

    @property
    def client_enabled(self) -> bool:
        """A client with this config speaks TLS."""
        return bool(self.ca or self.cert)

    @property
    def mutual(self) -> bool:
        """A server with this config requires verified client certificates."""
        return self.server_enabled and self.client_auth

    def describe(self) -> str:
        if not self.server_enabled and not self.client_enabled:
            return "plaintext"
        return "mtls" if self.mutual else "tls"


def _read(path: str, what: str) -> bytes:
    try:
        with open(path, "rb") as f:
            return f.read()
    except OSError as exc:
        raise ConfigError(f"cannot read the TLS {what} {path!r}: {exc.strerror or exc}") from exc


def _check_pair(cert: str, key: str) -> None:
    """Raises ConfigError unless ``key`` is the private key of ``cert`` (a half-rotated pair would fail handshakes)."""
    import ssl  # here, not at import: the CLI's --help builds TLS flags and never loads OpenSSL

    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    try:
        ctx.load_cert_chain(cert, key)
    except (ssl.SSLError, OSError) as exc:
        raise ConfigError(f"TLS key {key!r} does not load with certificate {cert!r}: {exc}") from exc


class _ServerCertificates:
    """The server's certificate configuration and gRPC's fetcher for it (called at handshakes, any thread)."""

    def __init__(self, tls: TlsConfig) -> None:
        self._tls = tls
        self._paths = [p for p in (tls.cert, tls.key, tls.ca) if p]
        import threading

        self._lock = threading.Lock()
        self._next_check = 0.0
        self._stamp = self._stamps()
        self.initial = self._build()
        self.reloads = 0

    def _stamps(self) -> tuple[tuple[int, int, int], ...]:
        out = []
        for p in self._paths:
            try:
                st = os.stat(p)
                out.append((st.st_mtime_ns, st.st_size, st.st_ino))
            except OSError:
                out.append((0, 0, 0))
        return tuple(out)

    def _build(self) -> Any:
        import grpc

        tls = self._tls
        _check_pair(tls.cert, tls.key)
        key, cert = _read(tls.key, "key"), _read(tls.cert, "certificate")
        ca = _read(tls.ca, "CA bundle") if tls.ca else None
        return grpc.ssl_server_certificate_configuration([(key, cert)], root_certificates=ca)

    def fetch(self) -> Any:
        now = time.monotonic()
        with self._lock:
            if now < self._next_check:
                return None
            self._next_check = now + RELOAD_CHECK_S
            stamp = self._stamps()
            if stamp == self._stamp:
                return None
            try:
                config = self._build()
            except ConfigError as exc:  # mid-rotation (key and certificate disagree) or unreadable: keep the old
                _log().warning("TLS certificate files changed but do not load (%s); serving the previous ones", exc)
                return None
            self._stamp = stamp
            self.reloads += 1
        _log().info("TLS certificate files changed; new connections use the new certificate (reload %d)", self.reloads)
        return config


def server_credentials(tls: TlsConfig) -> tuple[grpc.ServerCredentials, _ServerCertificates]:
    """Credentials for a TLS listener (mTLS when ``tls.client_auth``), reloading changed files; ConfigError when
    the files are missing, unreadable or inconsistent."""
    import grpc

    if not tls.server_enabled:
        raise ConfigError("a TLS listener needs tls.cert and tls.key (--tls-cert, --tls-key)")
    if tls.client_auth and not tls.ca:
        raise ConfigError(
            "mTLS (tls.client_auth, the default) needs tls.ca (--tls-ca) to verify client "
            "certificates; pass --no-tls-client-auth for server-only TLS"
        )
    certs = _ServerCertificates(tls)
    creds = grpc.dynamic_ssl_server_credentials(
        certs.initial, certs.fetch, require_client_authentication=tls.client_auth
    )
    return creds, certs


def channel_credentials(tls: TlsConfig) -> grpc.ChannelCredentials:
    """Credentials for a TLS client channel (presenting ``cert`` when set); ConfigError on unreadable files."""
    import grpc

    if tls.cert:
        _check_pair(tls.cert, tls.key)
    return grpc.ssl_channel_credentials(
        root_certificates=_read(tls.ca, "CA bundle") if tls.ca else None,
        private_key=_read(tls.key, "key") if tls.key else None,
        certificate_chain=_read(tls.cert, "certificate") if tls.cert else None,
    )


def channel_options(tls: TlsConfig) -> list[tuple[str, Any]]:
    """Channel arguments TLS adds (the expected server name)."""
    return [("grpc.ssl_target_name_override", tls.server_name)] if tls.client_enabled and tls.server_name else []


def secure_or_insecure_channel(target: str, tls: TlsConfig, options: list[tuple[str, Any]]) -> grpc.Channel:
    """A channel to ``target``: TLS when ``tls.client_enabled``, else plaintext (a WARNING once per process for a
    plaintext channel to a non-loopback host; ``unix:`` sockets stay on the host). A plaintext channel to a
    port on this host checks before every call that the port's listener is a trusted user's (``owner``)."""
    import grpc

    if tls.client_enabled:
        return grpc.secure_channel(target, channel_credentials(tls), options=options + channel_options(tls))
    from tensorwire._grpc.owner import guard_channel
    from tensorwire._grpc.scope import is_loopback_host

    if not target.startswith("unix:") and not is_loopback_host(target.rsplit(":", 1)[0]):
        _warn_plaintext(target)
    return guard_channel(grpc.insecure_channel(target, options=options), target)


_warned: set[str] = set()


def _warn_plaintext(target: str) -> None:
    if "plaintext" in _warned:
        return
    _warned.add("plaintext")
    _log().warning(
        "plaintext gRPC channel to %s (not loopback): anyone on the path can read and change requests and "
        "receipts; set --tls-ca (TENSORWIRE_MM_TLS_CA) to use TLS",
        target,
    )


__all__ = [
    "ENV_TLS_PREFIX",
    "TlsConfig",
    "channel_credentials",
    "channel_options",
    "secure_or_insecure_channel",
    "server_credentials",
]
