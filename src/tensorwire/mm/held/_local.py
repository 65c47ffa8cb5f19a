"""Unary calls over a same-host Unix socket for the held-outputs services: the lookup path without gRPC.

Why: a gRPC unary call that follows a pause wakes gRPC's poller, completion-queue and handler threads, and the
vLLM connector's Lookup follows exactly such a pause, once per item. This module serves the same raw-bytes
servicer methods (``HeldStoreServicer.lookup``/``release``: one implementation of the semantics, errors
included) on a Unix socket, and calls them; gRPC stays the way in (discovery), the cross-host path and the
fallback.

Access control (as the encoder's same-host channel, ``server._local``): the socket lives in a private directory
(``_unix.ensure_private_dir``: 0700, ours), is 0600, and every accepted peer's SO_PEERCRED uid must be ours
(another uid is closed at once, counted, nothing said); the client checks the advertised path
(``_unix.check_socket_path``) and the listener's uid before it sends anything. Same uid is the trust: a store
whose gRPC side requires client certificates does not open this socket unless asked (``serve_store``).

Wire (stream socket, ``_unix`` frames)::

    server -> client   HELLO: b"TWR1" + status (0 ok, 1 full: use gRPC; nothing was run)
    client -> server   request:  <I deadline_ms (0: none)> <B len(method)> method(ascii) body(the gRPC request)
    server -> client   answer:   b"\x00" + the gRPC response bytes, or b"\x01" + StreamError bytes

One request at a time per connection, answered in order; a frame that does not parse ends the connection. A
request over ``max_request_bytes`` ends it too (the frame is not read), as does one that does not arrive whole
within ``REQUEST_DEADLINE_S`` or no request for ``idle_timeout_s``. The handler sees a context with
``abort``/``set_trailing_metadata``/``time_remaining``/``is_active``, so ``wire.abort_with`` produces the same
status, reason and text as over gRPC (``wire.error_from_stream`` rebuilds the same error class).

Client failures: :class:`LocalUnavailable` when the call did not get an answer (no socket, refused, full, peer
gone, broken frame); ``sent`` says whether the request may have run. Every method served here is idempotent
(a second Lookup answers the same; a second Release releases nothing), so the caller retries over gRPC.
"""

from __future__ import annotations

import logging
import select
import socket
import struct
import threading
import time
from collections.abc import Callable, Mapping
from typing import Any, NoReturn

import grpc

from tensorwire._local import unix as _unix
from tensorwire._local.server import ChannelBusy, ChannelGone, Conn, UnixConnServer, connect
from tensorwire.errors import DeadlineExceeded, Reason
from tensorwire.mm import wire
from tensorwire.mm._proto import encoder_pb2 as pb

log = logging.getLogger(__name__)

HELLO_MAGIC = b"TWR1"
ANSWER_OK, ANSWER_ERROR = 0, 1
REQUEST_HEAD = struct.Struct("<IB")
MAX_REQUEST_BYTES = 1 << 20  # Lookup/Release of MAX_GRANTS_PER_CALL grants fit well under this
REQUEST_DEADLINE_S = 2.0  # a request without a deadline gets the gRPC servers' own request deadline
# A connection with no request for this long is ended (the client's pool drops it and connects again on its next
# call), so clients that went quiet cannot hold the server's max_conns; a request frame must then arrive whole
# within REQUEST_DEADLINE_S.
IDLE_TIMEOUT_S = 300.0
_THREAD = "tensorwire-local-rpc"

Handler = Callable[[bytes, Any], bytes]


class LocalUnavailable(Exception):
    """No answer over the local socket; ``sent``: the request was written (it may have run)."""

    def __init__(self, message: str, *, sent: bool) -> None:
        super().__init__(message)
        self.sent = sent


# -- server ---------------------------------------------------------------------------------------------------


class _Abort(Exception):
    def __init__(self, code: grpc.StatusCode, details: str, reason: str) -> None:
        super().__init__(details)
        self.code, self.details, self.reason = code, details, reason


class _Context:
    """What the raw-bytes servicer methods use of a ``grpc.ServicerContext``."""

    def __init__(self, sock: socket.socket, deadline: float) -> None:
        self._sock = sock
        self._deadline = deadline
        self._reason = ""

    def time_remaining(self) -> float:
        return max(0.0, self._deadline - time.monotonic())

    def is_active(self) -> bool:
        return time.monotonic() < self._deadline and not _unix.is_gone(self._sock)

    def set_trailing_metadata(self, metadata: Any) -> None:
        for key, value in metadata:
            if key == wire.REASON_METADATA_KEY:
                self._reason = value

    def abort(self, code: grpc.StatusCode, details: str) -> NoReturn:
        raise _Abort(code, details, self._reason)


class LocalRpcServer(UnixConnServer):
    """Serves ``methods`` (name -> raw-bytes handler) on a Unix socket in ``directory`` (at ``path`` when given,
    which must be in it; else a fresh name); see the module doc. A request's deadline is the caller's, at most
    ``max_deadline_s``.

    ``on_event(kind)`` counts connections: ``opened``, ``ended``, ``refused_uid``, ``refused_full``,
    ``bad_frame`` (also a request frame not whole within ``REQUEST_DEADLINE_S``), ``idle`` (no request for
    ``idle_timeout_s``: ended).
    """

    def __init__(
        self,
        name: str,
        methods: Mapping[str, Handler],
        directory: str,
        *,
        path: str = "",
        max_conns: int = 64,
        max_request_bytes: int = MAX_REQUEST_BYTES,
        max_deadline_s: float = REQUEST_DEADLINE_S,
        idle_timeout_s: float = IDLE_TIMEOUT_S,
        on_event: Callable[[str], None] | None = None,
    ) -> None:
        self._methods = dict(methods)
        self._max_request = max_request_bytes
        self._max_deadline_s = max_deadline_s
        self._idle_s = idle_timeout_s
        self._event = on_event or (lambda _kind: None)
        super().__init__(
            directory,
            prefix=name,
            magic=HELLO_MAGIC,
            max_conns=max_conns,
            thread_name=_THREAD,
            path=path,
            on_event=self._event,
        )

    def _serve(self, conn: Conn) -> None:
        sock = conn.sock
        while not self.stopping:
            if not _unix.wait_readable(sock, time.monotonic() + self._idle_s):
                self._event("idle")
                return
            try:
                raw = _unix.recv_frame(sock, time.monotonic() + REQUEST_DEADLINE_S, self._max_request)
            except (ValueError, TimeoutError) as exc:  # a frame over the limit (not read), or one that stalls
                self._event("bad_frame")
                self._rl.log(
                    logging.WARNING,
                    "frame",
                    "local rpc: %s; ending the connection",
                    exc if isinstance(exc, ValueError) else "a request frame stalled",
                )
                return
            if raw is None:
                return
            conn.set_busy(True)
            try:
                answer = self._answer(sock, raw)
                if answer is None:
                    return
                _unix.send_frame(sock, answer, time.monotonic() + REQUEST_DEADLINE_S)
            finally:
                conn.set_busy(False)

    def _answer(self, sock: socket.socket, raw: bytearray) -> list[bytes | memoryview] | None:
        """The answer frame's pieces, or None when the request frame is malformed (the connection ends)."""
        view = memoryview(raw)
        if len(view) < REQUEST_HEAD.size:
            self._event("bad_frame")
            return None
        deadline_ms, n = REQUEST_HEAD.unpack_from(view)
        if len(view) < REQUEST_HEAD.size + n:
            self._event("bad_frame")
            return None
        method = bytes(view[REQUEST_HEAD.size : REQUEST_HEAD.size + n]).decode("ascii", "replace")
        body = bytes(view[REQUEST_HEAD.size + n :])
        budget_s = deadline_ms / 1000.0 if deadline_ms else REQUEST_DEADLINE_S
        ctx = _Context(sock, time.monotonic() + min(budget_s, self._max_deadline_s))
        handler = self._methods.get(method)
        try:
            if handler is None:
                ctx.abort(grpc.StatusCode.UNIMPLEMENTED, f"method {method[:64]!r} is not served here")
            return [bytes((ANSWER_OK,)), handler(body, ctx)]
        except _Abort as exc:
            err = pb.StreamError(code=exc.code.value[0], reason=exc.reason, message=exc.details)
        except Exception as exc:  # what gRPC would turn into a status: the same table
            err = wire.stream_error_for(exc)
        return [bytes((ANSWER_ERROR,)), err.SerializeToString()]


# -- client ---------------------------------------------------------------------------------------------------


class LocalRpcClient:
    """Calls a :class:`LocalRpcServer` at ``path``; keeps up to ``pool`` idle connections. Thread-safe."""

    def __init__(self, path: str, pool: int = 4, connect_timeout_s: float = 1.0) -> None:
        self.path = path
        self._pool_max = pool
        self._connect_timeout_s = connect_timeout_s
        self._idle: list[socket.socket] = []
        self._lock = threading.Lock()
        self._closed = False

    def call(self, method: str, body: bytes, timeout_s: float, what: str) -> bytes:
        """The response bytes; the server's error as the TensorwireError gRPC would have raised
        (``wire.error_from_stream``); ``DeadlineExceeded`` when ``timeout_s`` runs out (the connection is closed:
        the server sees the caller go); ``LocalUnavailable`` when no answer came for another reason."""
        return self.begin(method, body, timeout_s, what).wait()

    def begin(self, method: str, body: bytes, timeout_s: float, what: str) -> PendingCall:
        """Sends the request and returns at once: the answer is collected with ``PendingCall.poll()`` (never
        blocks while nothing has arrived) or ``wait()``. Errors as ``call``; a request that could not be written
        raises ``LocalUnavailable(sent=False)`` here."""
        if timeout_s <= 0:
            raise DeadlineExceeded(f"{what}: no time left", reason=Reason.BUDGET_EXHAUSTED)
        deadline = time.monotonic() + timeout_s
        sock = self._take(min(timeout_s, self._connect_timeout_s))
        name = method.encode("ascii")
        head = REQUEST_HEAD.pack(max(1, int(timeout_s * 1000)), len(name))
        try:
            _unix.send_frame(sock, [head, name, body], deadline)
        except OSError as exc:  # TimeoutError included: not written whole, never run
            self._give_back(sock, False)
            raise LocalUnavailable(
                f"{what} over {self.path}: the request could not be written: {exc}", sent=False
            ) from exc
        return PendingCall(self, sock, deadline, timeout_s, what)

    def close(self) -> None:
        with self._lock:
            self._closed = True
            idle, self._idle = self._idle, []
        for sock in idle:
            sock.close()

    def _take(self, timeout_s: float) -> socket.socket:
        with self._lock:
            if self._closed:
                raise LocalUnavailable(f"local rpc client for {self.path} is closed", sent=False)
            while self._idle:
                sock = self._idle.pop()
                if _unix.is_quiet(sock):
                    return sock
                sock.close()
        return self._open(timeout_s)

    def _give_back(self, sock: socket.socket, ok: bool) -> None:
        with self._lock:
            if ok and not self._closed and len(self._idle) < self._pool_max:
                self._idle.append(sock)
                return
        sock.close()

    def _open(self, timeout_s: float) -> socket.socket:
        try:
            return connect(self.path, HELLO_MAGIC, timeout_s)
        except (ChannelGone, ChannelBusy) as exc:
            raise LocalUnavailable(str(exc), sent=False) from exc


class PendingCall:
    """One request written to a :class:`LocalRpcClient` connection, its answer not yet read. Single-threaded."""

    def __init__(
        self, client: LocalRpcClient, sock: socket.socket, deadline: float, timeout_s: float, what: str
    ) -> None:
        self._client = client
        self._sock: socket.socket | None = sock
        self._deadline = deadline
        self._timeout_s = timeout_s
        self._what = what
        self._poller = select.poll()
        self._poller.register(sock, select.POLLIN | select.POLLHUP | select.POLLERR)

    def poll(self) -> bytes | None:
        """The answer if it has arrived (None: not yet; raises as ``LocalRpcClient.call`` does, and
        ``DeadlineExceeded`` once the deadline has passed without one)."""
        if self._sock is None:
            raise LocalUnavailable(f"{self._what} over {self._client.path}: the answer was already taken", sent=True)
        if not self._poller.poll(0):
            if time.monotonic() < self._deadline:
                return None
            self._finish(False)
            raise DeadlineExceeded(
                f"{self._what} over {self._client.path}: no answer within {self._timeout_s:.3f} s",
                reason=Reason.DEADLINE_EXCEEDED,
            )
        return self._read(expect_wait=False)

    def wait(self) -> bytes:
        """Blocks until the answer (or the deadline)."""
        return self._read(expect_wait=True)

    def cancel(self) -> None:
        """Gives up on the answer: the connection is closed (the server sees the caller go)."""
        if self._sock is not None:
            self._finish(False)

    def _finish(self, ok: bool) -> None:
        sock, self._sock = self._sock, None
        if sock is not None:
            self._client._give_back(sock, ok)

    def _read(self, *, expect_wait: bool) -> bytes:
        sock = self._sock
        if sock is None:
            raise LocalUnavailable(f"{self._what} over {self._client.path}: the answer was already taken", sent=True)
        ok = False
        what, path = self._what, self._client.path
        try:
            try:
                raw = _unix.recv_frame(sock, self._deadline, wire.MAX_MESSAGE_BYTES, expect_wait=expect_wait)
            except TimeoutError as exc:
                raise DeadlineExceeded(
                    f"{what} over {path}: no answer within {self._timeout_s:.3f} s", reason=Reason.DEADLINE_EXCEEDED
                ) from exc
            except (OSError, ValueError) as exc:
                raise LocalUnavailable(f"{what} over {path}: the connection failed: {exc}", sent=True) from exc
            if raw is None or len(raw) < 1 or raw[0] not in (ANSWER_OK, ANSWER_ERROR):
                raise LocalUnavailable(f"{what} over {path}: the connection ended without an answer", sent=True)
            ok = True
        finally:
            self._finish(ok)
        if raw[0] == ANSWER_OK:
            return bytes(memoryview(raw)[1:])
        try:
            error = pb.StreamError.FromString(bytes(memoryview(raw)[1:]))
        except Exception as exc:
            raise LocalUnavailable(f"{what} over {path}: an error answer that does not parse", sent=True) from exc
        raise wire.error_from_stream(error, what)


def local_channel_request() -> pb.LocalChannelRequest:
    """What a client sends over gRPC to learn a server's local socket (this host's token)."""
    return pb.LocalChannelRequest(host_token=_unix.host_token())


__all__ = [
    "HELLO_MAGIC",
    "IDLE_TIMEOUT_S",
    "LocalRpcClient",
    "LocalRpcServer",
    "LocalUnavailable",
    "MAX_REQUEST_BYTES",
    "PendingCall",
    "local_channel_request",
]
