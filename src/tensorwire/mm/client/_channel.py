"""The seam between the fetch policy and the control plane: ``ControlChannel`` and its per-fetch ``ControlSession``.

``RemoteOutputTransport`` reaches an encoder only through these and never learns which implementation it talks
to, except through ``ControlSession.path`` (a metric label). A channel opens sessions, sends releases, and is
drained then closed by its owner; a session carries one fetch's Encode(s) and its release.
"""

from __future__ import annotations

import abc
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

from tensorwire.errors import ProtocolError, Reason
from tensorwire.mm._proto import encoder_pb2 as pb
from tensorwire.mm.wire._receipt import WireReceipt

if TYPE_CHECKING:
    import torch

Requeue = Callable[[list[str]], None]
"""requeue(lease_ids): takes release ids a channel accepted but could not send (the owner queues them)."""


class Budget:
    """The one deadline of a fetch (never reset): every control and data step takes what it has left."""

    def __init__(self, total_ms: float, clock: Callable[[], float] = time.monotonic) -> None:
        self.total_ms = float(total_ms)
        self._clock = clock
        self._deadline = clock() + self.total_ms / 1000.0

    def remaining_ms(self) -> float:
        return (self._deadline - self._clock()) * 1000.0


class ControlSession(abc.ABC):
    """One fetch's control path, from ``ControlChannel.session()`` to ``close()``.

    Calls: from the fetch's thread only, in this order: ``encode`` once or twice (the first request, then at most
    its one inline fallback), ``release_after_read`` at most once after a successful read, ``close`` exactly once
    (also when something raised). ``path`` may be read at any time before ``close``.
    """

    @property
    @abc.abstractmethod
    def path(self) -> str:
        """The path the next ``encode`` takes, as a bounded label value (``"stream"``, ``"unary"``, ...)."""

    @abc.abstractmethod
    def encode(self, request: pb.EncodeRequest, budget: Budget) -> WireReceipt:
        """Sends ``request`` to the encoder and returns its receipt.

        Ownership: the receipt's inline payloads belong to it alone (the decoded tensors view them and may be
        written): bytes received for this call (``parse_receipt``), never memory the encoder still uses.

        Deadline: never waits past ``budget.remaining_ms()``. Nothing left before sending:
        ``DeadlineExceeded(BUDGET_EXHAUSTED)``; no answer in time: ``DeadlineExceeded(DEADLINE_EXCEEDED)``.
        At most once: a request the encoder may have run is never sent again. An implementation may send it over
        another path (within the same budget) only when the encoder cannot have seen it.
        Errors: ``TensorwireError`` only: the error the encoder answered, with the class and reason of the
        ``wire`` status table (the same on every path), ``PeerUnavailable`` for a peer that is gone,
        ``ProtocolError`` for an answer that does not parse or does not belong to this request.
        """

    @abc.abstractmethod
    def release_after_read(self, lease_ids: list[str]) -> bool:
        """Hands the success-path release of ``lease_ids`` to this session's path, fire and forget; never blocks.

        True: the channel owns the ids from here: it sends them, or hands those it could not send to its requeue
        callback; one handed to the peer and then lost is left to the owner's TTL GC. False: not taken (the
        caller queues them for an answered release).
        """

    def take_placed(self, receipt: WireReceipt) -> tuple[list[torch.Tensor], list[int], int]:
        """(tensors, roles, payload bytes) of a receipt whose output the encoder wrote into a receive buffer this
        session lent (``receipt.message.placed.tensors`` set): views of that buffer, which stays lent until the
        last of them is gone. ``ProtocolError`` when the manifest does not fit the buffer or the session lent none
        (the default: a path that lends no buffers)."""
        raise ProtocolError(
            f"a placed answer (buffer {receipt.message.placed.buffer_id}) on the {self.path} path, "
            "which lends no receive buffer",
            reason=Reason.RESULT_MISMATCH,
        )

    @abc.abstractmethod
    def close(self) -> None:
        """Gives back what the session holds (a pooled stream, ...); idempotent."""


class ControlChannel(abc.ABC):
    """The client's control plane to one encoder endpoint (a worker, or a proxy in front of workers).

    Ownership: the ``RemoteOutputTransport`` a channel is given owns it: it calls ``bind_requeue`` once before
    the first session, and at its own close ``drain`` then ``close``.
    Thread-safety: ``session`` and ``release`` may be called from many threads at once; a session is used by
    one thread.
    Lifecycle: after ``drain`` sessions may still be opened, but they hold nothing persistent (a gRPC channel
    answers them over unary) and ``release`` keeps working; after ``close`` nothing may be called.
    Errors: ``TensorwireError`` only; transport exceptions (``grpc.RpcError``, ``OSError``) never leave.
    """

    endpoint: str

    @abc.abstractmethod
    def session(self) -> ControlSession:
        """The control path for one fetch; the caller closes it."""

    @abc.abstractmethod
    def release(self, lease_ids: list[str], timeout_s: float) -> int:
        """Releases ``lease_ids`` on the encoder and waits up to ``timeout_s`` for its answer; returns the
        count it accepted. For failure-path releases and the release queue (both need the answer)."""

    def bind_requeue(self, requeue: Requeue) -> None:  # noqa: B027 - an optional hook, a documented no-op
        """Where releases that ``release_after_read`` took but could not send go. The default ignores it: for
        a channel that cannot leave a taken release unsent."""

    @abc.abstractmethod
    def drain(self, timeout_s: float) -> None:
        """Flushes what persistent paths hold (releases still queued on them go out) within ``timeout_s``, then
        ends those paths. Idempotent."""

    @abc.abstractmethod
    def close(self) -> None:
        """Ends everything, waits for no peer, leaves no thread behind. Idempotent; works after a failed
        construction of the owner."""


__all__ = ["Budget", "ControlChannel", "ControlSession", "Requeue"]
