"""From "rank r of world w in session s" to a connected Transport: backend choice, bootstrap, ring set-up.

The broadcaster calls ``open_transport`` once; everything that happens before the first frame (the rendezvous
path, the handshake in ``_star``, creating or attaching the ring, passing its fd) lives here or below, so
bootstrap changes never touch the broadcaster class.
"""

from __future__ import annotations

import hashlib
import os

from tensorwire.errors import ConfigError

from . import _fence
from ._config import BroadcastConfig
from ._link import Link
from ._paths import Rendezvous, make_endpoint, session_digest
from ._ring import Ring
from ._shm import ShmReader, ShmRoot
from ._star import Hello, RootBootstrap, peer_bootstrap
from ._transport import Transport
from ._uds import UdsReader, UdsRoot

BACKENDS = ("auto", "uds", "shm")


def shm_available() -> bool:
    """True when this machine has what the shared-memory ring needs (memfd and a trustworthy fence)."""
    return _fence.AVAILABLE and hasattr(os, "memfd_create")


def resolve_backend(backend: str) -> str:
    """``"uds"`` or ``"shm"`` for a requested backend; ConfigError for an unknown one or shm without support."""
    if backend not in BACKENDS:
        raise ConfigError(f"backend must be one of {BACKENDS}, got {backend!r}")
    if backend == "auto":
        return "shm" if shm_available() else "uds"
    if backend == "shm" and not shm_available():
        raise ConfigError(
            f"backend='shm' needs os.memfd_create and a memory fence (libatomic, or x86-64); "
            f"this machine has fence={_fence.KIND!r}; use backend='uds'"
        )
    return backend


def params_digest(backend: str, config: BroadcastConfig) -> bytes:
    """What ranks must agree on beyond the session (hashed into HELLO): backend and the layout-relevant fields."""
    c = config
    text = f"{backend}|{c.slot_bytes}|{c.n_slots}|{c.arena_bytes}|{c.abstract}|frame1"
    return hashlib.blake2b(text.encode(), digest_size=16).digest()


def open_transport(
    rank: int, world: int, session: str, backend: str, base_dir: str | None, config: BroadcastConfig
) -> Transport:
    """Bootstrap the group (blocks up to ``config.init_timeout_s``) and return this rank's transport.

    ``backend`` is ``"uds"`` or ``"shm"`` (see ``resolve_backend``); ``world`` >= 2. Raises BootstrapError /
    BootstrapTimeout naming the rank and the cause; on failure everything opened here is closed again.
    """
    cfg = config
    endpoint = make_endpoint(session, base_dir, cfg.abstract)

    def private() -> Rendezvous:  # where an abstract group meets when its name is squatted (_star)
        return make_endpoint(session, base_dir, False)

    fallback = private if cfg.abstract else None
    hello = Hello(rank, world, backend, session_digest(session), params_digest(backend, cfg))
    if rank == 0:
        ring: Ring | None = None
        links: list[Link | None] = []
        fd = -1
        try:
            extra, fds = 0, []
            if backend == "shm":
                ring, fd = Ring.create(world, cfg.n_slots, cfg.slot_bytes, cfg.arena_bytes)
                extra, fds = ring.size, [fd]
            root = RootBootstrap(
                endpoint, world, hello, cfg.init_timeout_s, cfg.socket_buffer_bytes, cfg.check_peer_uid, fallback
            )
            links = root.run(fds, extra)
            if ring is not None:
                return ShmRoot(ring, links, root.endpoint, cfg, session)
            return UdsRoot(links, root.endpoint, cfg, session)
        except BaseException:
            for lk in links:
                if lk is not None:
                    lk.close()
            if ring is not None:
                ring.release()
            raise
        finally:
            if fd >= 0:
                os.close(fd)  # peers received their own copy; our mapping keeps the memory
    link, extra, fds, endpoint = peer_bootstrap(
        endpoint,
        rank,
        hello,
        cfg.init_timeout_s,
        cfg.connect_retry_s,
        cfg.socket_buffer_bytes,
        cfg.check_peer_uid,
        1 if backend == "shm" else 0,
        fallback,
    )
    try:
        if backend == "shm":
            ring = Ring.attach(fds[0], extra, rank, world, cfg.n_slots, cfg.slot_bytes, cfg.arena_bytes)
            return ShmReader(ring, link, rank, endpoint, cfg)
        return UdsReader(link, rank, endpoint, cfg, world)
    except BaseException:
        link.close()
        raise
