"""LocalControlServer: the encoder's same-host control channel, a Unix socket next to its gRPC port.

The socket lives in a private directory (``_unix.ensure_private_dir``: 0700, ours), is 0600, and every accepted
peer's SO_PEERCRED uid must be ours (another uid is refused and counted). Same-host clients learn its path
over gRPC (``EncoderService.local_channel``, answered only to a client with our host token); gRPC stays the way
in and the fallback.

Per connection (one thread each, at most ``local_channel_conns``; ended after ``local_channel_idle_ms`` without a
request, or when a request frame does not arrive whole within ``REQUEST_FRAME_S``)::

    accept; SO_PEERCRED uid check (refused: closed, nothing said)
    HELLO: b"TWL1" + status (0 ok, 1 full: the client uses gRPC; nothing of it was run)
    frames: StreamRequest {id, encode}  -> exactly one StreamResponse {id, receipt | error} (the EncodeStream's
                                           messages, bytes for bytes: ``WireReceipt.to_stream_frame``)
            StreamRequest {release}     -> never answered (fire and forget, as on the EncodeStream)
            StreamRequest {offer}       -> never answered: a receive buffer (memfd passed with the frame, or a
                                           CUDA IPC handle) mapped for this connection's life; an Encode that
                                           names it (``placement``) gets its output written there (placed
                                           outputs, ``_placed``; docs/transport.md)

A request runs through ``EncoderService.run_encode``, the function both gRPC paths run, so outputs, errors (the
``wire`` status table, as ``StreamError``), metrics and the caller-went-away release are the same. The caller is
"active" while its connection is open (a caller that timed out shuts its write side) and the request's
``deadline_ms`` has not passed; an RDMA receipt made for an inactive caller, or whose send fails, has its leases
released at once (an answer that still reaches a caller after its deadline is released by that caller). A
message that does not parse ends the connection (it has no id an answer could name), as on the EncodeStream.

Stop: ``stop_accepting`` (the servers' drain step, never waits): the listener goes (its file first: new clients
use gRPC), idle connections are shut down at once, a connection in the middle of an Encode answers it and then
ends. ``close(grace_s)`` (after the gRPC server stopped) waits up to the grace for those answers, cuts what is
left and joins every thread.
"""

from __future__ import annotations

import logging
import time

import torch
from google.protobuf.message import DecodeError

from tensorwire._local import unix as _unix
from tensorwire._local.server import HELLO_FULL, HELLO_OK, Conn, UnixConnServer
from tensorwire.mm import wire
from tensorwire.mm._config import MODE_AUTO
from tensorwire.mm._proto import encoder_pb2 as pb
from tensorwire.mm.server._handler import EncodeHandler
from tensorwire.mm.wire._local import HELLO_MAGIC, MAX_BUFFERS_PER_CONN, NOT_MAPPED
from tensorwire.mm.wire._placed import MappedBuffer, Placement, PlacementRefused, map_offer
from tensorwire.mm.wire._protobuf import Buffer
from tensorwire.mm.wire._receipt import WireReceipt

log = logging.getLogger(__name__)

_THREAD = "tensorwire-mm-local"
# How long an answer may take to be taken by the client: its request's deadline plus this slack, or, for a
# request without one, ANSWER_SEND_S. A client that stops reading (hung, stopped with SIGSTOP) would otherwise
# hold this connection's thread, and the output its inline answer views, for good.
ANSWER_SLACK_S = 1.0
ANSWER_SEND_S = 60.0
# A request frame must arrive whole within this once it has started (a peer that stalls mid-frame would hold the
# thread); generous: a frame carries the item's media, up to wire.MAX_MESSAGE_BYTES.
REQUEST_FRAME_S = 10.0


class _Mapped:
    """One connection's mapped receive buffers, at most ``MAX_BUFFERS_PER_CONN`` and ``cap_bytes`` together."""

    def __init__(self, cap_bytes: int, device: torch.device) -> None:
        self._cap = cap_bytes
        self._device = device
        self._buffers: dict[int, MappedBuffer] = {}

    def take(self, offer: pb.BufferOffer, fds: list[int]) -> None:
        """Maps ``offer`` (``PlacementRefused``: not taken; ``fds`` are closed either way)."""
        try:
            if self._cap <= 0:
                raise PlacementRefused("placed outputs are off on this worker (local_placement_bytes=0, or mode grpc)")
            if offer.buffer_id in self._buffers:
                raise PlacementRefused(f"buffer {offer.buffer_id} is already mapped on this connection")
            if len(self._buffers) >= MAX_BUFFERS_PER_CONN:
                raise PlacementRefused(f"{MAX_BUFFERS_PER_CONN} buffers are mapped on this connection already")
            left = self._cap - sum(b.nbytes for b in self._buffers.values())
            buf = map_offer(offer, fds, self._device, left)
        finally:
            _unix.close_fds(fds)
        self._buffers[buf.buffer_id] = buf

    def placement_for(self, buffer_id: int) -> Placement | None:
        buf = self._buffers.get(buffer_id) if buffer_id else None
        return Placement(buf) if buf is not None else None

    def close(self) -> None:
        buffers, self._buffers = self._buffers, {}
        for buf in buffers.values():
            buf.close()


class LocalControlServer(UnixConnServer):
    """The listening socket and its connection threads; ``path`` is what clients are told. See the module doc."""

    def __init__(self, service: EncodeHandler, directory: str, max_conns: int, idle_s: float = 300.0) -> None:
        self._service = service
        self._idle_s = idle_s
        self._metrics = service.transport.metrics
        cfg = service.transport.config
        self._placement_cap = cfg.local_placement_bytes if cfg.mode == MODE_AUTO else 0  # grpc: inline only
        super().__init__(
            directory, prefix="mm", magic=HELLO_MAGIC, max_conns=max_conns, thread_name=_THREAD, on_event=self._count
        )

    def _count(self, kind: str) -> None:
        self._metrics.control_streams.labels("encoder", _EVENT_LABELS[kind]).inc()

    # -- one connection -----------------------------------------------------------------------------------

    def _serve(self, conn: Conn) -> None:
        mapped = _Mapped(self._placement_cap, torch.device(self._service.transport.config.rdma.device))
        try:
            self._serve_requests(conn, mapped)
        finally:
            mapped.close()  # this connection's placed buffers: nothing writes into them any more

    def _serve_requests(self, conn: Conn, mapped: _Mapped) -> None:
        fds: list[int] = []
        while not self.stopping:
            if not _unix.wait_readable(conn.sock, time.monotonic() + self._idle_s):
                self._count("idle")
                return
            try:
                if not self._serve_frame(conn, mapped, fds):
                    return
            finally:
                _unix.close_fds(fds)  # descriptors come only with offers, which take theirs

    def _serve_frame(self, conn: Conn, mapped: _Mapped, fds: list[int]) -> bool:
        """Reads and handles one frame; False when the connection is done."""
        try:
            raw = _unix.recv_frame(
                conn.sock, time.monotonic() + REQUEST_FRAME_S, wire.MAX_MESSAGE_BYTES, fds, expect_wait=False
            )  # wait_readable said it is there
        except (ValueError, TimeoutError) as exc:  # a length over the limit (not read), or a frame that stalls
            self._metrics.errors.labels("encoder", "invalid_request").inc()
            self._rl.log(
                logging.WARNING,
                "frame",
                "local control: %s; ending the connection",
                exc if isinstance(exc, ValueError) else "a request frame stalled",
            )
            return False
        if raw is None:
            return False
        try:
            msg = pb.StreamRequest.FromString(raw)  # type: ignore[arg-type]  # upb reads a bytearray: no copy
        except DecodeError as exc:
            self._metrics.errors.labels("encoder", "invalid_request").inc()
            self._rl.log(
                logging.WARNING, "parse", "a local control message does not parse (%s); ending the connection", exc
            )
            return False
        kind = msg.WhichOneof("body")
        if kind == "offer":
            self._take_offer(mapped, msg.offer, fds)
            return True
        if kind == "release":
            self._service.release_unanswered(msg.release)
            return True
        _unix.close_fds(fds)  # before the Encode runs: nothing of a peer's is held while it does
        return self._answer(conn, msg, kind, mapped.placement_for(msg.placement))

    def _take_offer(self, mapped: _Mapped, offer: pb.BufferOffer, fds: list[int]) -> None:
        try:
            mapped.take(offer, fds)
        except PlacementRefused as exc:
            self._metrics.control_streams.labels("encoder", "local_offer_refused").inc()
            self._rl.log(
                logging.INFO,
                "offer",
                "local control: a receive buffer was not taken (%s); that client's outputs use the other planes",
                exc,
            )
        else:
            self._metrics.control_streams.labels("encoder", "local_offer_mapped").inc()

    def _answer(self, conn: Conn, msg: pb.StreamRequest, kind: str | None, placement: Placement | None) -> bool:
        """Runs one Encode and sends its answer; False when the connection is done."""
        sock = conn.sock
        conn.set_busy(True)
        try:
            receipt: WireReceipt | None = None
            data: bytes | list[Buffer]
            deadline: float | None = None
            if kind != "encode":
                unknown = NotImplementedError(f"StreamRequest {msg.id} has no body this encoder knows")
                data = pb.StreamResponse(id=msg.id, error=wire.stream_error_for(unknown)).SerializeToString()
            else:
                budget_s = msg.encode.deadline_ms / 1000.0 if msg.encode.deadline_ms > 0 else None
                deadline = None if budget_s is None else time.monotonic() + budget_s

                def is_active() -> bool:
                    return not _unix.is_gone(sock) and (deadline is None or time.monotonic() < deadline)

                try:
                    receipt = self._service.run_encode(msg.encode, is_active, placement=placement)
                    if receipt.message.rdma_slots and not is_active():
                        # Gone or past its deadline while the answer was made: the caller will not read it (a
                        # caller that times out shuts its write side, and releases what still reaches it).
                        self._service.discard_for_gone_caller(receipt, "before its local-channel answer was sent")
                        return False
                    if msg.placement and placement is None:  # named a buffer we did not map (refused, unknown)
                        receipt.message.placed.buffer_id = msg.placement
                        receipt.message.placed.declined = NOT_MAPPED
                    # Sent from the payloads' own memory (no join); the send below finishes before the receipt
                    # (and the output it views) goes out of scope, on this thread.
                    data = receipt.to_stream_pieces(msg.id)
                except Exception as exc:
                    receipt = None
                    data = wire.stream_frame(
                        msg.id, wire.STREAM_ERROR_FIELD, wire.stream_error_for(exc).SerializeToString()
                    )
            try:
                _unix.send_frame(
                    sock, data, time.monotonic() + ANSWER_SEND_S if deadline is None else deadline + ANSWER_SLACK_S
                )
            except OSError:  # TimeoutError included: the client did not take the answer in time
                if receipt is not None and receipt.message.rdma_slots:
                    self._service.discard_for_gone_caller(receipt, "while its local-channel answer was being sent")
                return False
            return True
        finally:
            conn.set_busy(False)


_EVENT_LABELS = {
    "refused_uid": "local_refused_uid",
    "refused_full": "local_refused",
    "opened": "local_opened",
    "ended": "local_ended",
    "idle": "local_idle",
}


def start_local_server(
    service: EncodeHandler, directory: str, max_conns: int, idle_s: float = 300.0
) -> LocalControlServer | None:
    """A LocalControlServer, or None (logged) when the directory or the socket cannot be made safely."""
    try:
        return LocalControlServer(service, directory or _unix.default_runtime_dir(), max_conns, idle_s)
    except (OSError, _unix.InsecurePath) as exc:
        log.warning("no same-host control channel: %s; clients use gRPC", exc)
        return None


__all__ = ["HELLO_FULL", "HELLO_MAGIC", "HELLO_OK", "NOT_MAPPED", "LocalControlServer", "start_local_server"]
