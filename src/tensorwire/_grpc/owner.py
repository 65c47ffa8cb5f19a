"""The same-user rule of plaintext gRPC on one host, on both ends of a call (``tensorwire._loopback`` reads the
socket owners).

- Server (:class:`CallerCheck`, used by ``GrpcHost`` for every method but health on a plaintext listener): a
  caller whose socket is on this host must belong to a trusted uid (``_loopback.trusted_uids``: the server's own,
  root, ``TENSORWIRE_TRUSTED_UIDS``); otherwise the call ends with PERMISSION_DENIED before its request is read,
  so it learns nothing but that. A caller whose socket is not on this host is a remote peer: a loopback listener
  refuses it (nothing remote can reach loopback, so it is a socket that vanished or that the lookup could not
  place), an ``--insecure`` listener admits it (that mode trusts its network, docs/security.md).
- Client (:func:`guard_channel`, applied by ``secure_or_insecure_channel`` to every plaintext channel to a
  loopback address or another address of this host): before each call, the socket that would accept the
  connection must belong to a trusted uid; otherwise the call fails at once, nothing sent, with UNAVAILABLE and
  reason ``untrusted_listener`` (callers translate it into ``PeerUnavailable``). Each call checks again: a
  connection that broke is re-opened by gRPC on the next call, possibly to whoever bound the port since.

Where the host exposes no socket owners (not Linux), neither side checks (a warning, once).
"""

from __future__ import annotations

import logging
import types
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

import grpc

from tensorwire import _loopback
from tensorwire._grpc import status
from tensorwire._grpc.scope import is_loopback_host
from tensorwire.errors import Reason

log = logging.getLogger(__name__)

_warned: set[str] = set()


def _warn_unavailable(side: str) -> None:
    if side in _warned:
        return
    _warned.add(side)
    log.warning(
        "this host does not expose the owners of TCP sockets (no sock_diag, no /proc/net/tcp): plaintext "
        "gRPC on loopback cannot check that the %s belongs to the same user; use TLS or a unix socket",
        "caller" if side == "server" else "listener",
    )


def _addresses(host: str) -> tuple[str, ...]:
    """The IP addresses a host name of a listener or target stands for, as far as the owner checks go."""
    host = host.strip().strip("[]")
    if host in ("localhost", ""):
        return ("127.0.0.1", "::1")
    return (host,)


class CallerCheck:
    """``allowed(peer) -> str | None``: None when the caller (a gRPC peer string) may call this listener, else
    why not (for the log; the caller is told only PERMISSION_DENIED). ``host``/``port``: the listener's."""

    def __init__(self, host: str, port: int) -> None:
        self.port = port
        self.loopback = is_loopback_host(host or "127.0.0.1")
        self.local_ips = tuple(ip for ip in _addresses(host) if ip not in ("0.0.0.0", "::"))
        self.trusted = _loopback.trusted_uids()
        self.enabled = _loopback.available()
        if not self.enabled:
            _warn_unavailable("server")

    def allowed(self, peer: str) -> str | None:
        if not self.enabled:
            return None
        parsed = _loopback.parse_peer(peer)
        if parsed is None:
            return None if peer.startswith("unix:") else f"unrecognised peer {peer!r}"
        ip, port = parsed
        if not self.loopback and not _loopback.is_local_address(ip):
            return None  # a remote peer of an --insecure listener: not a process of this host
        try:
            uid = _loopback.connection_uid(ip, port, self.port, self.local_ips)
        except (OSError, ValueError) as exc:
            return f"cannot tell who owns {peer}: {exc}"
        if uid is None:
            return f"{peer} is not a socket on this host" if self.loopback else None
        if uid not in self.trusted:
            return f"{peer} belongs to uid {uid}, not to a trusted user ({sorted(self.trusted)})"
        return None


if TYPE_CHECKING:
    _Future = grpc.Future[Any]
else:
    _Future = grpc.Future  # not subscriptable at run time


class _Refused(grpc.RpcError, _Future, grpc.Call):
    """A call that never went out: the port's listener is not ours. It behaves as a failed call of every kind
    (``result()`` and iteration raise it; ``code()`` is UNAVAILABLE with reason ``untrusted_listener``)."""

    def __init__(self, details: str) -> None:
        super().__init__()
        self._details = details

    def code(self) -> grpc.StatusCode:
        return grpc.StatusCode.UNAVAILABLE

    def details(self) -> str:
        return self._details

    def initial_metadata(self) -> Any:
        return ()

    def trailing_metadata(self) -> Any:
        return ((status.REASON_METADATA_KEY, Reason.UNTRUSTED_LISTENER.value),)

    def cancel(self) -> bool:
        return False

    def cancelled(self) -> bool:
        return False

    def is_active(self) -> bool:
        return False

    def time_remaining(self) -> Any:
        return None

    def running(self) -> bool:
        return False

    def done(self) -> bool:
        return True

    def result(self, timeout: float | None = None) -> Any:
        raise self

    def exception(self, timeout: float | None = None) -> Exception | None:
        return self

    def traceback(self, timeout: float | None = None) -> types.TracebackType | None:
        return None

    def add_callback(self, callback: Callable[[], None]) -> bool:
        return False

    def add_done_callback(self, fn: Callable[[Any], None]) -> None:
        fn(self)

    def __iter__(self) -> Iterator[Any]:
        return self

    def __next__(self) -> Any:
        raise self

    def __str__(self) -> str:
        return f"untrusted_listener: {self._details}"


class _ListenerCheck(
    grpc.UnaryUnaryClientInterceptor,
    grpc.UnaryStreamClientInterceptor,
    grpc.StreamUnaryClientInterceptor,
    grpc.StreamStreamClientInterceptor,
):
    """Checks the owner of the target's listener before every call (see the module docstring)."""

    def __init__(self, target: str, host: str, port: int) -> None:
        self.target = target
        self.port = port
        self.addresses = _addresses(host)
        self.trusted = _loopback.trusted_uids()

    def refusal(self) -> _Refused | None:
        for ip in self.addresses:
            try:
                uids = _loopback.listener_uids(ip, self.port)
            except (OSError, ValueError) as exc:
                return _Refused(
                    f"{self.target}: cannot tell who owns the listener on {ip}:{self.port} ({exc}); nothing was sent"
                )
            for uid in uids - self.trusted:
                return _Refused(
                    f"{self.target}: the port is held by a process of uid {uid}, not of a trusted user "
                    f"({sorted(self.trusted)}; {_loopback.ENV_TRUSTED_UIDS} adds more): nothing was sent. Another "
                    "user may have bound the port after the worker stopped"
                )
        return None

    def intercept_unary_unary(self, continuation: Any, details: Any, request: Any) -> Any:
        return self.refusal() or continuation(details, request)

    def intercept_unary_stream(self, continuation: Any, details: Any, request: Any) -> Any:
        return self.refusal() or continuation(details, request)

    def intercept_stream_unary(self, continuation: Any, details: Any, request_iterator: Any) -> Any:
        return self.refusal() or continuation(details, request_iterator)

    def intercept_stream_stream(self, continuation: Any, details: Any, request_iterator: Any) -> Any:
        return self.refusal() or continuation(details, request_iterator)


def guard_channel(channel: grpc.Channel, target: str) -> grpc.Channel:
    """``channel`` (plaintext, to ``target``) with the listener check when ``target`` is a ``host:port`` on this
    host (loopback, or an IP address of this host's); unchanged otherwise (a remote host, a host name other than
    ``localhost``, a ``unix:`` socket, or no socket owners on this host)."""
    if target.startswith("unix:") or ":" not in target:
        return channel
    host, _, port = target.rpartition(":")
    if not port.isdigit() or not (is_loopback_host(host) or _loopback.is_local_address(host.strip("[]"))):
        return channel
    if not _loopback.available():
        _warn_unavailable("client")
        return channel
    return grpc.intercept_channel(channel, _ListenerCheck(target, host, int(port)))


__all__ = ["CallerCheck", "guard_channel"]
