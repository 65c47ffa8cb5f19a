"""A recording in-memory provider for pool/reader unit tests (never used to claim anything about NIXL)."""

from __future__ import annotations

import ctypes
import threading
from collections.abc import Sequence
from dataclasses import dataclass

from tensorwire.errors import ReadTimeout, Reason
from tensorwire.rdma import Owner, RdmaConfig
from tensorwire.rdma.providers.base import PendingTransfer, Provider, ProviderStats, Range, Registration


class FakePending(PendingTransfer):
    def __init__(self) -> None:
        self.finished = threading.Event()
        self.abandoned = False

    def poll(self) -> bool:
        return self.finished.is_set()

    def abandon(self) -> None:
        self.abandoned = True


@dataclass
class FakeStats(ProviderStats):
    live_registrations: int = 0


class FakeProvider(Provider):
    """Same-process "reads" by memmove; ``events`` records register/deregister; can fail or hang reads."""

    name = "fake"

    def __init__(self, config: RdmaConfig, *, role: str) -> None:
        super().__init__(config, role=role)
        self.events: list[tuple[str, int, int]] = []
        self.live: dict[int, Registration] = {}
        self._epoch = 0
        self.hang_next: FakePending | None = None
        self.fail_register_after: int | None = None

    @classmethod
    def available(cls) -> bool:
        return True

    @property
    def agent_name(self) -> str:
        return "fake-agent"

    @property
    def registration_epoch(self) -> int:
        return self._epoch

    def register(self, addr: int, nbytes: int, mem_type: str, device_id: int) -> Registration:
        self._epoch += 1
        self.events.append(("register", addr, nbytes))
        reg = Registration(addr, nbytes, mem_type, device_id, handle=self._epoch)
        self.live[self._epoch] = reg
        return reg

    def deregister(self, reg: Registration) -> None:
        self.events.append(("deregister", reg.addr, reg.nbytes))
        del self.live[reg.handle]

    def serve(self) -> Owner:
        return Owner("fake-agent", "127.0.0.1", 1, 0)

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
        if self.hang_next is not None:
            pending, self.hang_next = self.hang_next, None
            err = ReadTimeout("fake hang", reason=Reason.READ_TIMEOUT)
            err.pending = pending  # type: ignore[attr-defined]
            raise err
        for (laddr, n, _), (raddr, rn, _) in zip(local, remote, strict=True):
            assert n == rn
            ctypes.memmove(laddr, raddr, n)

    def close(self) -> None:
        self.events.append(("close", 0, 0))

    def stats(self) -> FakeStats:
        return FakeStats(transport=self.transport(), live_registrations=len(self.live))
