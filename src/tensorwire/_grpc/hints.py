"""What to do about a connection that failed for a reason gRPC describes in its own words.

A TLS mismatch surfaces as a transport error that never says "TLS" (a closed socket, ``WRONG_VERSION_NUMBER``).
``tls_hint`` turns such a message, with this side's configuration, into a sentence naming TLS and the flags (the
same ``--tls-*`` flags on every command: ``fetch``, and ``serve-proxy`` towards its workers).
"""

from __future__ import annotations

from typing import Any

_FLAGS_CLIENT = "--tls-ca CA.pem (and --tls-cert/--tls-key when the server requires client certificates)"


def tls_hint(message: str, tls: Any) -> str | None:
    """A hint for the failure ``message`` of a connection made with ``tls`` (a ``TlsConfig``), or None."""
    text = message.lower()
    uses_tls = bool(getattr(tls, "client_enabled", False) or getattr(tls, "ca", ""))
    has_cert = bool(getattr(tls, "cert", ""))
    if "wrong_version_number" in text or (
        "handshake" in text and "tls" in text and "certificate" not in text and "verify" not in text
    ):
        return (
            "TLS mismatch: this side speaks TLS but the server answered in plaintext; drop --tls-* here "
            "(and TENSORWIRE_MM_TLS_*), or start the server with --tls-cert/--tls-key"
        )
    if any(
        k in text
        for k in (
            "certificate_verify_failed",
            "certificate verify failed",
            "bad_certificate",
            "verification check failed",
        )
    ):
        return (
            "TLS: a certificate was refused; the server's must be signed by --tls-ca and name the host you "
            "connect to (or --tls-server-name), and under mTLS this side's --tls-cert must be signed by the "
            "server's CA"
        )
    if "socket closed" in text or "connection reset" in text or "end of file" in text:
        if not uses_tls:
            return "the server closed the connection during set-up: it probably requires TLS; give " + _FLAGS_CLIENT
        if not has_cert:
            return (
                "the server closed the TLS connection during set-up: it probably requires a client "
                "certificate (mTLS); give --tls-cert and --tls-key signed by its CA"
            )
    return None


__all__ = ["tls_hint"]
