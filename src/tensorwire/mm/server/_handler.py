"""EncodeHandler: what a control-channel server needs from the encoder to serve one connection.

``EncoderService`` implements it and the local server calls it, so both run the same encode, release and
cleanup. ``run_encode`` returns the receipt or raises the caller's error (counted); ``release_unanswered`` never
raises; ``discard_for_gone_caller`` releases once. All three are safe on many threads at once.
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
