"""Who is calling and until when: ``Peer`` (the caller's identity as the server sees it) and ``CallScope`` (one
call's peer, deadline and liveness, visible to the code that serves it through ``current_call()``).

``GrpcHost`` opens a scope around every handler it runs, on the handler's thread; ``EncoderService`` narrows it
to the request's worker budget around the encode function. An encode function that works item by item calls
``current_call().check()`` between items, so a caller that cancelled or a deadline that passed stops the work.
Code that runs outside any call (tests, an in-process channel) sees ``NO_CALL``, which is
never cancelled and has no deadline.

Peer keys (the unit of per-peer limits and quotas) are bounded strings: ``cn:<common name>`` for a caller that
presented a client certificate the server verified (mTLS), ``ip:<address>`` otherwise (every plaintext caller
on one host shares a key), ``local`` for in-process callers. A trusted forwarder (a proxy) may name the caller
it forwards for in ``FORWARDED_PEER_METADATA``; the host believes it only from peers listed in
``ServerLimits.trusted_forwarders``.
"""

from __future__ import annotations

import ipaddress
import math
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager, nullcontext
from dataclasses import dataclass
from typing import Any

from tensorwire.errors import DeadlineExceeded, PeerUnavailable, Reason

FORWARDED_PEER_METADATA = "tensorwire-peer"
MAX_PEER_KEY_CHARS = 256


@dataclass(frozen=True)
class Peer:
    """The caller of one call. ``key`` is what limits count by; ``authenticated``: it showed a verified certificate."""

    key: str
    ip: str = ""
    authenticated: bool = False
    loopback: bool = False


LOCAL_PEER = Peer(key="local", loopback=True)


def is_loopback_host(host: str) -> bool:
    """True for ``localhost`` and loopback IP literals (127.0.0.0/8, ::1); False for wildcards and other names."""
    host = host.strip().strip("[]")
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def _ip_of(peer: str) -> str:
    """The address part of a gRPC peer string: ``ipv4:1.2.3.4:5``, ``ipv6:[::1]:5``, ``unix:/path``."""
    kind, _, rest = peer.partition(":")
    if kind == "ipv4":
        return rest.rsplit(":", 1)[0]
    if kind == "ipv6":
        return rest.rsplit(":", 1)[0].strip("[]")
    if kind in ("unix", "unix-abstract"):
        return "unix"
    return peer


def peer_of(context: Any, *, tls: bool) -> Peer:
    """The ``Peer`` of a server-side gRPC context. ``tls``: the listener is TLS, so a verified client certificate
    may be present (reading the auth context costs a little, so plaintext listeners skip it)."""
    ip = _ip_of(str(context.peer() or ""))
    loopback = ip == "unix" or is_loopback_host(ip)
    if tls:
        auth = context.auth_context() or {}
        names = auth.get("x509_common_name") or auth.get("x509_subject_alternative_name") or ()
        if names:
            name = names[0].decode("utf-8", "replace")[:MAX_PEER_KEY_CHARS]
            return Peer(key=f"cn:{name}", ip=ip, authenticated=True, loopback=loopback)
    return Peer(key=f"ip:{ip}", ip=ip, loopback=loopback)


def forwarded_peer(context: Any, via: Peer) -> Peer:
    """The caller a trusted forwarder names in its metadata, or ``via`` itself when it names none."""
    for key, value in context.invocation_metadata() or ():
        if key == FORWARDED_PEER_METADATA and value:
            return Peer(key=str(value)[:MAX_PEER_KEY_CHARS], ip=via.ip, authenticated=via.authenticated, loopback=False)
    return via


class CallScope:
    """One call as its handler sees it: ``peer``, ``deadline`` (``time.monotonic()``; inf: none) and whether the
    caller is still there (``active()``). ``check()`` raises when the work should stop. Thread-safe to read."""

    def __init__(
        self,
        peer: Peer,
        *,
        deadline: float = math.inf,
        is_active: Callable[[], bool] | None = None,
        placement: Any = None,
    ) -> None:
        self.peer = peer
        self.deadline = deadline
        self._is_active = is_active
        # The caller's receive buffer this call may write its output into (``_placed.Placement``; same-host
        # channel only), else None.
        self.placement = placement

    def active(self) -> bool:
        return self._is_active is None or bool(self._is_active())

    def remaining_s(self) -> float:
        return self.deadline - time.monotonic()

    def expired(self) -> bool:
        return time.monotonic() >= self.deadline

    def check(self, what: str = "the request") -> None:
        """Raises ``PeerUnavailable(CANCELLED)`` when the caller went away, ``DeadlineExceeded`` when the deadline
        passed; otherwise returns."""
        if not self.active():
            raise PeerUnavailable(f"the caller cancelled {what}; work stopped", reason=Reason.CANCELLED)
        if self.expired():
            raise DeadlineExceeded(
                f"the worker deadline of {what} passed; work stopped", reason=Reason.DEADLINE_EXCEEDED
            )

    def narrowed(self, budget_s: float) -> CallScope:
        """The same call with its deadline at most ``budget_s`` from now."""
        return CallScope(
            self.peer,
            deadline=min(self.deadline, time.monotonic() + budget_s),
            is_active=self._is_active,
            placement=self.placement,
        )

    def work_slot(self) -> AbstractContextManager[None]:
        """Holds one of the server's work slots for the block (a stream takes one per Encode it runs); outside a
        server there are none to take."""
        return nullcontext()


NO_CALL = CallScope(LOCAL_PEER)

_local = threading.local()


def current_call() -> CallScope:
    """The scope of the call this thread serves (``NO_CALL`` outside any)."""
    scope: CallScope | None = getattr(_local, "scope", None)
    return scope if scope is not None else NO_CALL


@contextmanager
def call_scope(scope: CallScope) -> Iterator[CallScope]:
    """Makes ``scope`` this thread's current call for the block (nests: the outer one comes back after)."""
    outer = getattr(_local, "scope", None)
    _local.scope = scope
    try:
        yield scope
    finally:
        _local.scope = outer


__all__ = [
    "CallScope",
    "FORWARDED_PEER_METADATA",
    "LOCAL_PEER",
    "NO_CALL",
    "Peer",
    "call_scope",
    "current_call",
    "forwarded_peer",
    "is_loopback_host",
    "peer_of",
]
