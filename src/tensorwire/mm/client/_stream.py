"""StreamCall: one open EncodeStream on the client, used by one fetch at a time (see ``_grpc_channel``).

Message contract (encoder.proto, docs/transport.md "Control stream"): a ``StreamRequest{id, encode}`` is answered
by exactly one ``StreamResponse`` with the same id (a receipt or a ``StreamError``); a ``StreamRequest{release}``
is never answered. ``encode`` raises ``NotExecuted`` when the encoder cannot have run the request (the caller may
send it over unary in the same budget), and otherwise raises what the unary call would raise.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from typing import Any, NamedTuple

import grpc

from tensorwire._grpc.watchdog import DeadlineWatchdog
from tensorwire.errors import DeadlineExceeded, ProtocolError, Reason
from tensorwire.mm import wire
from tensorwire.mm._metrics import TransportMetrics
from tensorwire.mm._proto import encoder_pb2 as pb
from tensorwire.mm.client._channel import Requeue
from tensorwire.mm.wire._receipt import WireReceipt, read_stream_response

log = logging.getLogger(__name__)


class NotExecuted(Exception):
    """The stream ended before the encoder handled this request (refused, no such method, or never sent)."""

    def __init__(self, kind: str) -> None:
        super().__init__(kind)
        self.kind = kind  # "refused", "unimplemented" or "not_sent"


class _Outgoing(NamedTuple):
    data: bytes  # the serialized StreamRequest
    encode_id: int  # the Encode's request id; 0 for a release
    release_ids: list[str] | None  # the lease ids of a release (requeued if it is never sent)


class StreamCall:
    """One open EncodeStream. Used by one fetch at a time; answers are read on that fetch's thread.

    Requests wait in ``_outbox`` until gRPC's sender thread takes them through ``_requests()``; that thread
    blocks there while the stream is idle and leaves when the stream is half-closed or the call ends (the done
    callback wakes it). Releases still in the outbox when the call ends were never sent: they go to the
    transport's unary release queue. ``broken`` (the call ended, was cancelled or misbehaved) is final.
    """

    def __init__(
        self, method: Any, endpoint: str, metrics: TransportMetrics, watchdog: DeadlineWatchdog, requeue: Requeue
    ) -> None:
        self._endpoint = endpoint
        self._metrics = metrics
        self._watchdog = watchdog
        self._requeue = requeue
        self._cv = threading.Condition()
        self._outbox: deque[_Outgoing] = deque()
        self._half_closed = False
        self._done = False
        self.broken = False
        self._next_id = 0
        self._waiting_id = 0  # the request whose answer is awaited (0: none); the watchdog reads it
        self._sent_id = 0  # the last Encode handed to gRPC
        self._deadline_hit = False
        self._ended = threading.Event()
        self.last_used = time.monotonic()  # when a request was last handed to it (the pool's reuse limit)
        self._call = method(self._requests())
        self._call.add_done_callback(self._on_done)

    def usable(self) -> bool:
        return not self.broken and not self._done and not self._call.done()

    def encode(self, request: pb.EncodeRequest, timeout_s: float) -> WireReceipt:
        endpoint = self._endpoint
        self._next_id += 1
        rid = self._next_id
        data = wire.stream_frame(rid, wire.STREAM_ENCODE_FIELD, request.SerializeToString())
        deadline = time.monotonic() + timeout_s
        with self._cv:
            if self._done or self._call.done():
                self.broken = True
                raise NotExecuted(self._why_ended(self._call))
            self._outbox.append(_Outgoing(data, rid, None))
            self._waiting_id = rid
            self.last_used = time.monotonic()
            self._cv.notify()
        self._watchdog.watch(deadline, self, rid)
        raw: bytes | None = None
        failure: grpc.RpcError | None = None
        try:
            raw = next(self._call)
        except StopIteration:
            pass
        except grpc.RpcError as exc:
            failure = exc
        with self._cv:
            self._waiting_id = 0
            deadline_hit = self._deadline_hit
            sent = self._sent_id >= rid
            if raw is None and not sent:
                self._outbox = deque(item for item in self._outbox if item.encode_id != rid)
        metrics = self._metrics
        if raw is None:
            self.broken = True
            if deadline_hit:
                if sent:
                    metrics.child(metrics.control_rpcs, "stream").inc()
                raise DeadlineExceeded(
                    f"Encode on {endpoint} failed with DEADLINE_EXCEEDED: no answer on the "
                    f"EncodeStream within {timeout_s:.3f} s",
                    reason=Reason.DEADLINE_EXCEEDED,
                )
            why = self._why_ended(failure)
            if why != "not_sent" or not sent or failure is None:
                # failure None: the encoder ended the stream cleanly without answering, and it answers every
                # Encode it takes before it ends a stream (it does so when it stops): this one never ran.
                raise NotExecuted(why)
            # It may have run on the encoder: raised as the unary path would raise it, never sent again.
            metrics.child(metrics.control_rpcs, "stream").inc()
            metrics.control_streams.labels("llm", "broken").inc()
            raise wire.error_from_rpc(failure, f"Encode on {endpoint}") from failure
        metrics.child(metrics.control_rpcs, "stream").inc()
        if deadline_hit:
            self.broken = True  # answered, but the watchdog cancelled the call as the answer came in
        try:
            answer_id, value = read_stream_response(raw)  # a large inline receipt views ``raw``
        except Exception as exc:
            self._fail(f"an EncodeStream answer from {endpoint} does not parse: {exc}")
            raise ProtocolError(f"receipt from {endpoint} does not parse: {exc}") from exc
        if answer_id != rid:
            self._fail(f"answer {answer_id} on the EncodeStream of {endpoint} for request {rid}")
            raise ProtocolError(f"{endpoint} answered request {answer_id} on an EncodeStream awaiting {rid}")
        if isinstance(value, WireReceipt):
            return value
        if isinstance(value, pb.StreamError):
            raise wire.error_from_stream(value, f"Encode on {endpoint}")
        self._fail(f"an EncodeStream answer from {endpoint} has no body")
        raise ProtocolError(f"{endpoint} answered request {rid} with neither a receipt nor an error")

    @staticmethod
    def _why_ended(failure: Any) -> str:
        """How an ended call (an RpcError, or the done call itself) ended, when that means nothing ran."""
        if failure is None:
            return "not_sent"
        if failure.code() == grpc.StatusCode.UNIMPLEMENTED:
            return "unimplemented"  # no such method: the encoder never looked at a message
        if wire.is_stream_refusal(failure):
            return "refused"  # refused before any message was read
        return "not_sent"

    def send_release(self, lease_ids: list[str]) -> bool:
        """Queues a Release (never answered). False when the stream cannot take it (the caller uses unary)."""
        if not lease_ids:
            return True
        data = wire.stream_frame(
            0, wire.STREAM_RELEASE_FIELD, pb.ReleaseLeasesRequest(lease_ids=lease_ids).SerializeToString()
        )
        with self._cv:
            if self.broken or self._done or self._half_closed:
                return False
            self._outbox.append(_Outgoing(data, 0, lease_ids))
            self.last_used = time.monotonic()
            self._cv.notify()
        return True

    def expire(self, rid: int) -> None:
        """The watchdog's cancel: only if ``rid`` is still awaited (an answered request is left alone)."""
        with self._cv:
            if self._waiting_id != rid:
                return
            self._deadline_hit = True
            self.broken = True
            self._metrics.control_streams.labels("llm", "deadline").inc()
            self._call.cancel()

    def waiting_for(self, rid: int) -> bool:
        return self._waiting_id == rid

    def half_close(self) -> None:
        with self._cv:
            self._half_closed = True
            self._cv.notify_all()

    def end(self, timeout_s: float = 0.0) -> None:
        """Half-closes, waits up to ``timeout_s`` for the call to end, then cancels it (its threads then leave)."""
        self.half_close()
        if timeout_s > 0:
            self._ended.wait(timeout_s)
        if not self._ended.is_set():
            self._call.cancel()

    def _fail(self, why: str) -> None:
        self.broken = True
        self._metrics.control_streams.labels("llm", "protocol_error").inc()
        log.warning("%s; dropping the stream", why)
        self._call.cancel()

    def _requests(self) -> Any:
        metrics = self._metrics
        while True:
            with self._cv:
                while not self._outbox and not self._half_closed and not self._done:
                    self._cv.wait()
                if self._done or not self._outbox:
                    return
                data, rid, release_ids = self._outbox.popleft()
                if rid:
                    self._sent_id = rid
            if release_ids is not None:
                metrics.child(metrics.releases, "stream", "sent").inc(len(release_ids))
            yield data

    def _on_done(self, call: Any) -> None:
        with self._cv:
            self._done = True
            self.broken = True
            orphans = [item.release_ids for item in self._outbox if item.release_ids is not None]
            self._outbox.clear()
            self._cv.notify_all()
        metrics = self._metrics
        metrics.control_streams.labels("llm", "closed").inc()
        for ids in orphans:
            # Never handed to gRPC, so never seen by the encoder: the unary queue sends them instead.
            metrics.releases.labels("stream", "requeued").inc(len(ids))
            self._requeue(ids)
        self._ended.set()


__all__ = ["NotExecuted", "StreamCall"]
