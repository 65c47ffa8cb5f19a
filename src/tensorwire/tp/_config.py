"""BroadcastConfig: every tunable of the CPU TP broadcaster, with its default, in one place."""

from __future__ import annotations

import dataclasses
import enum
import math
import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from tensorwire.errors import ConfigError

_ENV_PREFIX = "TENSORWIRE_BROADCAST_"


class Unset(enum.Enum):
    """Type of :data:`UNSET`: "this keyword was not passed", distinct from ``None`` (which means "no limit")."""

    UNSET = "unset"

    def __repr__(self) -> str:
        return "UNSET"


# Default of keywords that override a BroadcastConfig field only when passed (httpx's UseClientDefault): the value
# then comes from the config object, or from the environment when no config was given.
UNSET = Unset.UNSET


@dataclass(frozen=True)
class BroadcastConfig:
    """Settings shared by every rank of one broadcaster group.

    Fields that change the wire or the shared-memory layout (``slot_bytes``, ``n_slots``, ``arena_bytes``) are
    hashed into the handshake: ranks that disagree fail at bootstrap with ``Reason.PARAMS_MISMATCH``.
    """

    init_timeout_s: float = 120.0  # bootstrap: connect retries on peers, accept + handshake on rank 0
    timeout_s: float | None = None  # per broadcast; None waits forever (idle TP workers legitimately wait)
    stall_warn_s: float = 30.0  # while waiting without a limit, warn this often
    connect_retry_s: float = 0.05  # sleep between connect attempts during bootstrap
    spin_s: float = 100e-6  # readers busy-poll at least this long for a message before sleeping
    # ... and up to spin_gap_factor x the median of their recent waits, at most spin_max_s (see tp/_spin.py);
    # 0 (or <= spin_s) keeps the fixed spin_s. The CPU of an idle reader is spin_max_s once per silence.
    spin_max_s: float = 5e-3
    spin_gap_factor: float = 2.0
    futex: bool = True  # shm readers sleep on a futex on the ring's PUB word (Linux), else on their socket
    wait_poll_s: float = 0.1  # a sleeping waiter re-checks shared state (abort word, lost wake-up) this often
    slot_bytes: int = 256 * 1024  # shm ring slot, frame header included; larger frames go to the arena
    n_slots: int = 8
    arena_bytes: int = 1 << 30  # shm arena for large frames (sparse: only touched pages cost memory)
    socket_buffer_bytes: int = 4 * 1024 * 1024  # SO_SNDBUF/SO_RCVBUF request (the kernel caps it)
    abstract: bool = False  # Linux abstract-namespace socket instead of a socket file
    check_peer_uid: bool = True  # SO_PEERCRED: peers must run as our effective uid

    def __post_init__(self) -> None:
        def positive(name: str, value: float) -> None:
            if not (isinstance(value, (int, float)) and math.isfinite(value) and value > 0):
                raise ConfigError(f"BroadcastConfig.{name} must be a positive finite number, got {value!r}")

        for name in ("init_timeout_s", "stall_warn_s", "connect_retry_s", "wait_poll_s"):
            positive(name, getattr(self, name))
        if self.timeout_s is not None:
            positive("timeout_s", self.timeout_s)
        if not (isinstance(self.spin_s, (int, float)) and 0 <= self.spin_s <= 1.0):
            raise ConfigError(f"BroadcastConfig.spin_s must be in [0, 1] seconds, got {self.spin_s!r}")
        if not (isinstance(self.spin_max_s, (int, float)) and 0 <= self.spin_max_s <= 1.0):
            raise ConfigError(f"BroadcastConfig.spin_max_s must be in [0, 1] seconds, got {self.spin_max_s!r}")
        if not (isinstance(self.spin_gap_factor, (int, float)) and 1.0 <= self.spin_gap_factor <= 100.0):
            raise ConfigError(f"BroadcastConfig.spin_gap_factor must be in [1, 100], got {self.spin_gap_factor!r}")
        slot_ok = isinstance(self.slot_bytes, int) and 4096 <= self.slot_bytes <= (1 << 30)
        if not (slot_ok and self.slot_bytes % 64 == 0):
            raise ConfigError(
                f"BroadcastConfig.slot_bytes must be a multiple of 64 in [4096, 2**30], got {self.slot_bytes!r}"
            )
        if not (isinstance(self.n_slots, int) and 2 <= self.n_slots <= 4096):
            raise ConfigError(f"BroadcastConfig.n_slots must be in [2, 4096], got {self.n_slots!r}")
        arena_ok = isinstance(self.arena_bytes, int) and 0 <= self.arena_bytes <= (1 << 40)
        if not (arena_ok and self.arena_bytes % 64 == 0):
            raise ConfigError(
                f"BroadcastConfig.arena_bytes must be a multiple of 64 in [0, 2**40], got {self.arena_bytes!r}"
            )
        if not (isinstance(self.socket_buffer_bytes, int) and self.socket_buffer_bytes >= 0):
            raise ConfigError(f"BroadcastConfig.socket_buffer_bytes must be >= 0, got {self.socket_buffer_bytes!r}")

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None, **overrides: Any) -> BroadcastConfig:
        """Build from ``TENSORWIRE_BROADCAST_<FIELD>`` variables; keyword overrides win over the environment."""
        env = os.environ if environ is None else environ
        values: dict[str, Any] = {}
        for f in dataclasses.fields(cls):
            raw = env.get(_ENV_PREFIX + f.name.upper())
            if raw is None or raw == "":
                continue
            values[f.name] = _parse(f.name, f.type, raw)
        values.update(overrides)
        return cls(**values)

    @classmethod
    def resolve(cls, config: BroadcastConfig | None, **overrides: Any) -> BroadcastConfig:
        """``config`` (or, when None, :meth:`from_env`) with the ``overrides`` that are not :data:`UNSET`.

        Precedence: a passed keyword > ``config`` > ``TENSORWIRE_BROADCAST_*`` (read only when ``config`` is None)
        > the field default.
        """
        base = config if config is not None else cls.from_env()
        given = {k: v for k, v in overrides.items() if v is not UNSET}
        return dataclasses.replace(base, **given) if given else base


def _parse(name: str, type_name: Any, raw: str) -> Any:
    t = str(type_name)
    try:
        if t == "bool":
            if raw.lower() in ("1", "true", "yes", "on"):
                return True
            if raw.lower() in ("0", "false", "no", "off"):
                return False
            raise ValueError(raw)
        if t == "int":
            return int(raw, 0)
        if "None" in t:
            return None if raw.lower() in ("none", "inf", "0") else float(raw)
        return float(raw)
    except ValueError as exc:
        raise ConfigError(f"{_ENV_PREFIX}{name.upper()}={raw!r} is not a valid {t}") from exc
