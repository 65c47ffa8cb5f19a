"""The ``none`` provider: never available, so callers see PROVIDER_UNAVAILABLE and fall back (inline bytes)."""

from __future__ import annotations

from typing import NoReturn

from tensorwire.errors import ExportError, ReadError, Reason
from tensorwire.rdma._config import RdmaConfig
from tensorwire.rdma.providers.base import ROLE_EXPORTER, Provider


class NoneProvider(Provider):
    """Constructing it always raises: ``ExportError`` for exporters, ``ReadError`` for readers."""

    name = "none"

    def __init__(self, config: RdmaConfig, *, role: str) -> None:  # noqa: D107
        msg = "rdma provider 'none' is never available; use the inline path"
        if role == ROLE_EXPORTER:
            raise ExportError(msg, reason=Reason.PROVIDER_UNAVAILABLE)
        raise ReadError(msg, reason=Reason.PROVIDER_UNAVAILABLE)

    @classmethod
    def available(cls) -> bool:
        return False

    # Unreachable: construction always raises. Present so the class is concrete like any other provider.
    agent_name = property(lambda self: _unreachable())  # type: ignore[assignment]
    registration_epoch = property(lambda self: _unreachable())  # type: ignore[assignment]

    def register(self, addr, nbytes, mem_type, device_id):  # type: ignore[no-untyped-def]
        _unreachable()

    def deregister(self, reg):  # type: ignore[no-untyped-def]
        _unreachable()

    def serve(self):  # type: ignore[no-untyped-def]
        _unreachable()

    def read(self, owner, local_mem, local, remote_mem, remote, *, deadline):  # type: ignore[no-untyped-def]
        _unreachable()

    def close(self) -> None:
        return None


def _unreachable() -> NoReturn:
    raise AssertionError("NoneProvider is never constructed")
