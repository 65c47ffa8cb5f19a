"""GrpcControlChannel: the control plane over gRPC, unary RPCs plus a pool of open EncodeStreams.

A session uses a pooled EncodeStream for its Encode(s) and its release, else unary Encode and the release queue.
Both raise the same exceptions; a request goes again over unary only when the encoder cannot have run it.
``grpc.RpcError`` stays here. Table of situations: docs/transport.md, "Control stream".
"""

from __future__ import annotations

import logging
import threading
import time

import grpc

from tensorwire._grpc.tls import secure_or_insecure_channel
from tensorwire._grpc.watchdog import DeadlineWatchdog
from tensorwire._ratelog import RateLimitedLog
from tensorwire.errors import DeadlineExceeded, ProtocolError, Reason
from tensorwire.mm import wire
from tensorwire.mm._config import TransportConfig
from tensorwire.mm._metrics import TransportMetrics, metrics_for
from tensorwire.mm._proto import encoder_pb2 as pb
from tensorwire.mm.client._channel import Budget, ControlChannel, ControlSession, Requeue
from tensorwire.mm.client._stream import NotExecuted, StreamCall
from tensorwire.mm.wire._receipt import WireReceipt, parse_receipt

log = logging.getLogger(__name__)

_STREAM_THREAD = "tensorwire-mm-control"


def _no_requeue(lease_ids: list[str]) -> None:
    log.warning(
        "%d stream release id(s) were not sent and no requeue is bound; the encoder's TTL GC reclaims them",
        len(lease_ids),
    )


class GrpcControlChannel(ControlChannel):
    """The ``ControlChannel`` over one gRPC channel to ``endpoint``: unary Encode and ReleaseLeases, and the pool
    of EncodeStreams on the same channel.

    The gRPC channel is TLS when ``config.tls`` says so (``_tls``: the server verified against ``tls.ca``, this
    process's ``tls.cert`` presented for mTLS), plaintext otherwise, with the keepalive of ``config.limits``.
    ``grpc_channel``: a channel to use instead (tests); the control channel owns it and closes it.
    ``open_streams`` and ``watchdog`` are read-only views for tests and benchmarks.
    """

    def __init__(
        self,
        endpoint: str,
        config: TransportConfig | None = None,
        metrics: TransportMetrics | None = None,
        *,
        grpc_channel: grpc.Channel | None = None,
    ) -> None:
        self.endpoint = endpoint
        config = config if config is not None else TransportConfig()
        self._metrics = metrics if metrics is not None else metrics_for(None)
        self._requeue: Requeue = _no_requeue
        self._channel = (
            grpc_channel
            if grpc_channel is not None
            else secure_or_insecure_channel(endpoint, config.tls, config.limits.client_options())
        )
        self._encode: grpc.UnaryUnaryMultiCallable[pb.EncodeRequest, bytes] = self._channel.unary_unary(
            wire.ENCODE_METHOD, request_serializer=pb.EncodeRequest.SerializeToString, response_deserializer=None
        )
        self._release = self._channel.unary_unary(
            wire.RELEASE_METHOD,
            request_serializer=pb.ReleaseLeasesRequest.SerializeToString,
            response_deserializer=pb.ReleaseLeasesResponse.FromString,
        )
        self._local_info = self._channel.unary_unary(
            wire.LOCAL_CHANNEL_METHOD,
            request_serializer=pb.LocalChannelRequest.SerializeToString,
            response_deserializer=pb.LocalChannelInfo.FromString,
        )
        self._streams = _StreamPool(self._channel, endpoint, config, self._metrics, lambda ids: self._requeue(ids))
        self._closed = False

    @property
    def open_streams(self) -> int:
        return self._streams.open_streams

    @property
    def watchdog(self) -> DeadlineWatchdog:
        return self._streams.watchdog

    def bind_requeue(self, requeue: Requeue) -> None:
        self._requeue = requeue

    def session(self) -> ControlSession:
        return _GrpcSession(self, self._streams, self._metrics)

    def encode_unary(self, request: pb.EncodeRequest, timeout_s: float) -> WireReceipt:
        if timeout_s <= 0:
            raise DeadlineExceeded("fetch budget exhausted before the Encode call", reason=Reason.BUDGET_EXHAUSTED)
        try:
            raw = self._encode(request, timeout=timeout_s)
        except grpc.RpcError as exc:
            raise wire.error_from_rpc(exc, f"Encode on {self.endpoint}") from exc
        try:
            return parse_receipt(raw)  # the inline tensors view ``raw``, which nothing else holds
        except Exception as exc:
            raise ProtocolError(f"receipt from {self.endpoint} does not parse: {exc}") from exc

    def release(self, lease_ids: list[str], timeout_s: float) -> int:
        try:
            resp = self._release(pb.ReleaseLeasesRequest(lease_ids=lease_ids), timeout=timeout_s)
        except grpc.RpcError as exc:
            raise wire.error_from_rpc(exc, f"ReleaseLeases on {self.endpoint}") from exc
        return int(resp.released)

    def local_channel_info(self, host_token: str, timeout_s: float) -> pb.LocalChannelInfo:
        """Asks the encoder for its same-host control channel (``client._local``); ``TensorwireError`` (an encoder
        or proxy without the method: ``ControlPlaneError(UNIMPLEMENTED)``)."""
        try:
            info: pb.LocalChannelInfo = self._local_info(
                pb.LocalChannelRequest(host_token=host_token), timeout=timeout_s
            )
        except grpc.RpcError as exc:
            raise wire.error_from_rpc(exc, f"LocalChannel on {self.endpoint}") from exc
        return info

    def drain(self, timeout_s: float) -> None:
        self._streams.close(timeout_s)

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        try:
            self._streams.close(0.0)
        finally:
            self._channel.close()


class _GrpcSession(ControlSession):
    """One fetch's control path: the stream it checked out (or None: unary), given back by ``close``.

    ``encode`` sends over the stream when there is one. When the encoder refused the stream or has no
    EncodeStream, nothing was executed, so the same request goes over unary within the same budget; when the
    stream broke after the request may have been sent, the error is raised as the unary path would raise it
    (never sent twice). After a broken stream the rest of the fetch (its inline fallback) uses unary.
    ``release_after_read`` puts the success-path release on the stream (False: no stream; use the queue).
    """

    def __init__(self, channel: GrpcControlChannel, pool: _StreamPool, metrics: TransportMetrics) -> None:
        self._channel = channel
        self._pool = pool
        self._metrics = metrics
        self._stream = pool.checkout()

    @property
    def path(self) -> str:
        return "stream" if self._stream is not None else "unary"

    def encode(self, request: pb.EncodeRequest, budget: Budget) -> WireReceipt:
        stream = self._stream
        if stream is not None:
            timeout_s = budget.remaining_ms() / 1000.0
            if timeout_s <= 0:
                raise DeadlineExceeded("fetch budget exhausted before the Encode call", reason=Reason.BUDGET_EXHAUSTED)
            try:
                return stream.encode(request, timeout_s)
            except NotExecuted as exc:
                self._pool.not_usable(exc.kind)
                self._give_back()
            finally:
                if stream.broken:
                    self._give_back()
        timeout_s = budget.remaining_ms() / 1000.0
        if timeout_s > 0:
            self._metrics.control_rpcs.labels("unary").inc()
        return self._channel.encode_unary(request, timeout_s)

    def release_after_read(self, lease_ids: list[str]) -> bool:
        return self._stream is not None and self._stream.send_release(lease_ids)

    def _give_back(self) -> None:
        stream, self._stream = self._stream, None
        if stream is not None:
            self._pool.checkin(stream)

    def close(self) -> None:
        self._give_back()


class _StreamPool:
    """The open EncodeStreams of one transport: at most ``control_stream_pool``; one fetch uses one at a time.

    ``checkout`` returns an idle stream, opens one below the cap, or returns None (use unary): beyond the cap,
    (a stream idle for half the server's ``stream_idle_timeout_ms`` is ended instead of reused: the server ends
    idle streams, and a request must not race that)
    after the encoder answered UNIMPLEMENTED (remembered for the transport's life), for ``open_seconds`` after
    it refused a stream, with ``control_stream`` off, and after ``close``. ``checkin`` keeps a healthy stream
    and ends a broken one (a broken stream is never reused). One watchdog thread enforces every waiting
    request's deadline.
    """

    def __init__(
        self, channel: grpc.Channel, endpoint: str, config: TransportConfig, metrics: TransportMetrics, requeue: Requeue
    ) -> None:
        self._method: grpc.StreamStreamMultiCallable[bytes, bytes] = channel.stream_stream(
            wire.ENCODE_STREAM_METHOD, request_serializer=None, response_deserializer=None
        )
        self.endpoint = endpoint
        self.metrics = metrics
        self._requeue = requeue
        self._cap = config.control_stream_pool
        self._enabled = config.control_stream
        self._refusal_s = float(config.open_seconds)
        self._reuse_s = config.limits.stream_idle_timeout_ms / 2000.0
        self._lock = threading.Lock()
        self._idle: list[StreamCall] = []
        self._open = 0
        self._unimplemented = False
        self._refused_until = 0.0
        self._closed = False
        self.watchdog = DeadlineWatchdog(_STREAM_THREAD + "-watchdog")
        self._rl = RateLimitedLog(log)

    @property
    def open_streams(self) -> int:
        with self._lock:
            return self._open

    def checkout(self) -> StreamCall | None:
        if not self._enabled:
            return None
        stale: list[StreamCall] = []
        try:
            with self._lock:
                if self._closed or self._unimplemented:
                    return None
                now = time.monotonic()
                while self._idle:
                    stream = self._idle.pop()  # LIFO: the most recently used stream is the warmest
                    if stream.usable() and now - stream.last_used < self._reuse_s:
                        return stream
                    stale.append(stream)
                    self._open -= 1
                if self._open >= self._cap or time.monotonic() < self._refused_until:
                    return None
                self._open += 1
        finally:
            for stream in stale:
                stream.end()
        try:
            stream = StreamCall(self._method, self.endpoint, self.metrics, self.watchdog, self._requeue)
        except Exception:
            with self._lock:
                self._open -= 1
            raise
        self.metrics.control_streams.labels("llm", "opened").inc()
        return stream

    def checkin(self, stream: StreamCall) -> None:
        with self._lock:
            keep = not self._closed and stream.usable()
            if keep:
                self._idle.append(stream)
            else:
                self._open -= 1
        if not keep:
            stream.end()

    def not_usable(self, kind: str) -> None:
        self.metrics.control_streams.labels("llm", kind).inc()
        with self._lock:
            if kind == "unimplemented":
                self._unimplemented = True
            elif kind == "refused":
                self._refused_until = time.monotonic() + self._refusal_s
        if kind == "unimplemented":
            self._rl.log(
                logging.INFO,
                "unimplemented",
                "%s has no EncodeStream (an older encoder or a proxy); using the unary Encode for this transport",
                self.endpoint,
            )
        elif kind == "refused":
            self._rl.log(
                logging.INFO,
                "refused",
                "%s refused another EncodeStream (its server_stream_cap); using "
                "the unary Encode beyond the streams already open for %.0f s",
                self.endpoint,
                self._refusal_s,
            )

    def close(self, timeout_s: float) -> None:
        """Half-closes the idle streams (queued releases still go out) and waits up to ``timeout_s`` for them to
        end, then cancels what is left. Streams still checked out end at their checkin. Idempotent."""
        with self._lock:
            self._closed = True
            idle, self._idle = self._idle, []
            self._open -= len(idle)
        for stream in idle:
            stream.half_close()
        deadline = time.monotonic() + timeout_s
        for stream in idle:
            stream.end(max(0.0, deadline - time.monotonic()))
        self.watchdog.close()


__all__ = ["GrpcControlChannel"]
