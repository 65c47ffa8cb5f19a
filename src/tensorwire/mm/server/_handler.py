"""EncodeHandler: what a control-channel server needs from the encoder to serve one connection.

The gRPC servicer (``EncoderService``) implements it, and the local server (``LocalControlServer``'s
connections) calls it, so both paths run the same encode, the same lease release and the same cleanup for a
caller that went away; neither server module imports the other's class.

Contract: ``run_encode`` runs the encode function then ``transfer`` and returns the receipt, or raises the error
the caller should get (already counted). ``release_unanswered`` applies a fire-and-forget release and never
raises. ``discard_for_gone_caller`` releases a receipt's leases exactly once. All three may run on many
connection threads at once.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

from tensorwire.mm._proto import encoder_pb2 as pb
from tensorwire.mm.server._output import OutputTransport
from tensorwire.mm.wire._placed import Placement
from tensorwire.mm.wire._receipt import WireReceipt


class EncodeHandler(Protocol):
    @property
    def transport(self) -> OutputTransport: ...

    def run_encode(
        self, request: pb.EncodeRequest, is_active: Callable[[], bool], *, placement: Placement | None = None
    ) -> WireReceipt: ...

    def release_unanswered(self, request: pb.ReleaseLeasesRequest) -> None: ...

    def discard_for_gone_caller(self, receipt: WireReceipt, when: str) -> None: ...
