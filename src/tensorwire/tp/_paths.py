"""Where the rendezvous socket lives: per-user private directory, session sanitizing, sun_path limit.

First that applies: ``base_dir=``; ``$TENSORWIRE_BROADCAST_DIR``; ``$XDG_RUNTIME_DIR/tensorwire`` (if private);
``$TMPDIR/tensorwire-<uid>``. An explicit one failing ``ensure_private_dir`` is an error; a default one is
skipped with a warning for ``~/.cache/tensorwire/<host>``, so ranks still meet.
"""

from __future__ import annotations

import hashlib
import logging
import os
import re
import socket
from dataclasses import dataclass

from tensorwire._local import unix as _unix
from tensorwire.errors import BootstrapError, ConfigError, Reason

log = logging.getLogger(__name__)

SUN_PATH_LIMIT = 108  # sizeof(sockaddr_un.sun_path) on Linux; one byte is the terminating NUL
_UNSAFE = re.compile(r"[^A-Za-z0-9._-]")
ENV_DIR = "TENSORWIRE_BROADCAST_DIR"


def effective_uid() -> int:
    """The uid peers and directories must match (a function so tests can pretend to be someone else)."""
    return os.geteuid()


def sanitize_session(session: str) -> str:
    """Map a session id to a file-name-safe token (the raw id is still compared in the handshake)."""
    if not isinstance(session, str) or not session:
        raise ConfigError(f"session must be a non-empty str, got {session!r}")
    return _UNSAFE.sub("_", session)


def session_digest(session: str) -> bytes:
    """16-byte digest of the raw session id: two ids that sanitize alike still differ here."""
    return hashlib.blake2b(session.encode("utf-8", "surrogatepass"), digest_size=16).digest()


def _xdg_runtime_dir() -> str | None:
    """``$XDG_RUNTIME_DIR`` when ``_unix.xdg_runtime_dir`` accepts it for us (else None, with a warning)."""
    xdg, why = _unix.xdg_runtime_dir(effective_uid())
    if why:
        log.warning(
            "ignoring XDG_RUNTIME_DIR=%s for the broadcaster socket: %s", os.environ.get("XDG_RUNTIME_DIR"), why
        )
    return xdg


def _default_dirs() -> list[str]:
    """The default directories in order of preference (see the module docstring)."""
    out = []
    xdg = _xdg_runtime_dir()
    if xdg is not None:
        out.append(os.path.join(xdg, "tensorwire"))
    out.append(os.path.join(os.environ.get("TMPDIR") or "/tmp", f"tensorwire-{effective_uid()}"))
    # Last resort, a directory no other user can create. Per host: a home on NFS is shared between hosts, and one
    # host's socket file is only a stale file to another.
    out.append(os.path.join(os.path.expanduser("~"), ".cache", "tensorwire", _UNSAFE.sub("_", socket.gethostname())))
    return out


def default_base_dir(leaf: str = "") -> str:
    """The directory the socket goes in when no ``base_dir`` is given, created and checked by
    ``ensure_private_dir``. ``leaf``: the socket's file name, whose path must fit ``sun_path`` (checked before
    anything is created, so every rank fails the same way)."""
    explicit = os.environ.get(ENV_DIR)
    if explicit:
        _check_length(os.path.join(os.path.abspath(explicit), leaf))
        return ensure_private_dir(explicit)
    refused = []
    for candidate in _default_dirs():
        _check_length(os.path.join(os.path.abspath(candidate), leaf))
        try:
            return ensure_private_dir(candidate)
        except BootstrapError as exc:
            log.warning("broadcaster directory skipped: %s", exc)
            refused.append(str(exc))
    raise BootstrapError(
        f"no private directory for the broadcaster socket: {'; '.join(refused)}", reason=Reason.INSECURE_PATH
    )


def ensure_private_dir(path: str) -> str:
    """Create ``path`` (mode 0700) if missing; refuse a symlink, a non-directory, a foreign owner or a
    group/world-writable directory (``_unix.ensure_private_dir``'s checks, against ``effective_uid()``): another
    user could plant a socket there. Returns the absolute path."""
    try:
        return _unix.ensure_private_dir(path, uid=effective_uid())
    except _unix.InsecurePath as exc:
        raise BootstrapError(
            f"broadcaster directory refused: {exc}. Pass base_dir= or set {ENV_DIR} to a private (0700) "
            "directory you own",
            reason=Reason.INSECURE_PATH,
        ) from exc


@dataclass(frozen=True)
class Rendezvous:
    """The rendezvous address: a socket file under a private directory, or an abstract name."""

    address: str | bytes  # str path, or bytes starting with NUL for the abstract namespace
    display: str
    is_abstract: bool

    @property
    def path(self) -> str | None:
        return None if self.is_abstract else str(self.address)


def make_endpoint(session: str, base_dir: str | None, abstract: bool) -> Rendezvous:
    """Resolve the rank-0 socket address for ``session`` and check it against the sun_path limit."""
    token = sanitize_session(session)
    if abstract:
        name = f"\0tensorwire-{effective_uid()}-{token}".encode()
        if len(name) >= SUN_PATH_LIMIT:
            raise BootstrapError(
                f"abstract socket name too long ({len(name)} bytes, limit {SUN_PATH_LIMIT - 1}); "
                f"use a shorter session id",
                reason=Reason.PATH_TOO_LONG,
            )
        return Rendezvous(name, "@" + name[1:].decode(), True)
    leaf = f"tw-{token}.sock"
    if base_dir is not None:
        directory = os.path.abspath(base_dir)
        # Checked before touching the file system so every rank fails the same way, with the numbers.
        _check_length(os.path.join(directory, leaf))
        ensure_private_dir(directory)
    else:
        directory = default_base_dir(leaf)
    path = os.path.join(directory, leaf)
    return Rendezvous(path, path, False)


def _check_length(path: str) -> None:
    n = len(os.fsencode(path))
    if n >= SUN_PATH_LIMIT:
        raise BootstrapError(
            f"UDS path too long ({n} bytes, limit {SUN_PATH_LIMIT - 1}): {path}; "
            f"use a shorter base_dir/TMPDIR or session id, or abstract=True",
            reason=Reason.PATH_TOO_LONG,
        )
