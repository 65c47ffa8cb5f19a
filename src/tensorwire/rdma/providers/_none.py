"""The ``none`` provider: never available, so callers see PROVIDER_UNAVAILABLE and fall back (inline bytes)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import NoReturn

from tensorwire.errors import ExportError, ReadError, Reason
from tensorwire.rdma._config import RdmaConfig
from tensorwire.rdma._descriptor import Owner
from tensorwire.rdma.providers.base import ROLE_EXPORTER, Provider, Range, Registration


class NoneProvider(Provider):
    """Constructing it always raises: ``ExportError`` for exporters, ``ReadError`` for readers."""

    name = "none"

    def __init__(self, config: RdmaConfig, *, role: str) -> None:
        msg = "rdma provider 'none' is never available; use the inline path"
        if role == ROLE_EXPORTER:
            raise ExportError(msg, reason=Reason.PROVIDER_UNAVAILABLE)
        raise ReadError(msg, reason=Reason.PROVIDER_UNAVAILABLE)

    @classmethod
    def available(cls) -> bool:
        return False

    # Unreachable: construction always raises. Present so the class is concrete like any other provider.
    @property
    def agent_name(self) -> str:
        _unreachable()

    @property
    def registration_epoch(self) -> int:
        _unreachable()

    def register(self, addr: int, nbytes: int, mem_type: str, device_id: int) -> Registration:
        _unreachable()

    def deregister(self, reg: Registration) -> None:
        _unreachable()

    def serve(self) -> Owner:
        _unreachable()

    def read(
        self,
        owner: Owner,
        local_mem: str,
        local: Sequence[Range],
        remote_mem: str,
        remote: Sequence[Range],
        *,
        deadline: float,
    ) -> None:
        _unreachable()

    def close(self) -> None:
        return None


def _unreachable() -> NoReturn:
    raise AssertionError("NoneProvider is never constructed")
