"""Where the rendezvous socket lives: per-user private directory, session sanitizing, sun_path limit."""

from __future__ import annotations

import hashlib
import os
import re
import stat
from dataclasses import dataclass

from tensorwire.errors import BootstrapError, ConfigError, Reason

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


def default_base_dir() -> str:
    explicit = os.environ.get(ENV_DIR)
    if explicit:
        return explicit
    return os.path.join(os.environ.get("TMPDIR") or "/tmp", f"tensorwire-{effective_uid()}")


def ensure_private_dir(path: str) -> str:
    """Create ``path`` (mode 0700) if missing; refuse a symlink, a non-directory, a foreign owner or a
    group/world-writable directory. Returns the absolute path."""
    path = os.path.abspath(path)
    try:
        os.makedirs(path, mode=0o700, exist_ok=True)
        st = os.lstat(path)
    except OSError as exc:
        raise BootstrapError(
            f"cannot create broadcaster directory {path}: {exc}", reason=Reason.INSECURE_PATH
        ) from exc
    if stat.S_ISLNK(st.st_mode) or not stat.S_ISDIR(st.st_mode):
        raise BootstrapError(
            f"broadcaster directory {path} is not a plain directory (symlink or file); refusing it",
            reason=Reason.INSECURE_PATH,
        )
    uid = effective_uid()
    if st.st_uid != uid:
        raise BootstrapError(
            f"broadcaster directory {path} is owned by uid {st.st_uid}, not by us (uid {uid}); refusing it. "
            f"Pass base_dir= or set {ENV_DIR} to a directory you own",
            reason=Reason.INSECURE_PATH,
        )
    if st.st_mode & 0o022:
        raise BootstrapError(
            f"broadcaster directory {path} is group/world-writable (mode {stat.S_IMODE(st.st_mode):04o}); "
            f"refusing it: another user could plant a socket there. chmod 700 it or pick another base_dir",
            reason=Reason.INSECURE_PATH,
        )
    if stat.S_IMODE(st.st_mode) != 0o700:
        os.chmod(path, 0o700)  # ours and not writable by others: tighten readable bits quietly
    return path


@dataclass(frozen=True)
class Endpoint:
    """The rendezvous address: a socket file under a private directory, or an abstract name."""

    address: str | bytes  # str path, or bytes starting with NUL for the abstract namespace
    display: str
    is_abstract: bool

    @property
    def path(self) -> str | None:
        return None if self.is_abstract else str(self.address)


def make_endpoint(session: str, base_dir: str | None, abstract: bool) -> Endpoint:
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
        return Endpoint(name, "@" + name[1:].decode(), True)
    directory = os.path.abspath(base_dir if base_dir is not None else default_base_dir())
    path = os.path.join(directory, f"tw-{token}.sock")
    n = len(os.fsencode(path))
    if n >= SUN_PATH_LIMIT:
        # Checked before touching the file system so every rank fails the same way, with the numbers.
        raise BootstrapError(
            f"UDS path too long ({n} bytes, limit {SUN_PATH_LIMIT - 1}): {path}; "
            f"use a shorter base_dir/TMPDIR or session id, or abstract=True",
            reason=Reason.PATH_TOO_LONG,
        )
    ensure_private_dir(directory)
    return Endpoint(path, path, False)
