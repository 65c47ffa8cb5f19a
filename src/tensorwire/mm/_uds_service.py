"""LocalControlServer: the encoder's same-host control channel, a Unix socket next to its gRPC port (issue 18).

The socket lives in a private directory (``_unix.ensure_private_dir``: 0700, ours), is 0600, and every accepted
peer's SO_PEERCRED uid must be ours (another uid is refused and counted). Same-host clients learn its path
over gRPC (``EncoderService.local_channel``, answered only to a client with our host token); gRPC stays the way
in and the fallback.

Per connection (one thread each, at most ``local_channel_conns``)::

    accept; SO_PEERCRED uid check (refused: closed, nothing said)
    HELLO: b"TWL1" + status (0 ok, 1 full: the client uses gRPC; nothing of it was run)
    frames: StreamRequest {id, encode}  -> exactly one StreamResponse {id, receipt | error} (the EncodeStream's
                                           messages, bytes for bytes: ``WireReceipt.to_stream_frame``)
            StreamRequest {release}     -> never answered (fire and forget, as on the EncodeStream)

A request runs through ``EncoderService.run_encode``, the function both gRPC paths run, so outputs, errors (the
``wire`` status table, as ``StreamError``), metrics and the caller-went-away release are the same. The caller is
"active" while its connection is open and the request's ``deadline_ms`` has not passed. A receipt whose send
fails has its leases released at once. A message that does not parse ends the connection (it has no id an
answer could name), as on the EncodeStream.

Stop: ``stop_accepting`` (the servers' drain step, never waits): the listener goes (its file first: new clients
use gRPC), idle connections are shut down at once, a connection in the middle of an Encode answers it and then
ends. ``close(grace_s)`` (after the gRPC server stopped) waits up to the grace for those answers, cuts what is
left and joins every thread.
"""

from __future__ import annotations

import logging
import os
import secrets
import socket
import threading
import time
from typing import TYPE_CHECKING

from google.protobuf.message import DecodeError

from tensorwire import _unix
from tensorwire.mm import wire
from tensorwire.mm._pbwire import Buffer
from tensorwire.mm._proto import encoder_pb2 as pb
from tensorwire.mm._ratelog import RateLimitedLog
from tensorwire.mm._wire_receipt import WireReceipt

if TYPE_CHECKING:
    from tensorwire.mm._service import EncoderService

log = logging.getLogger(__name__)

HELLO_MAGIC = b"TWL1"
HELLO_OK, HELLO_FULL = 0, 1
_THREAD = "tensorwire-mm-local"
_JOIN_S = 5.0  # a cut connection's thread unwinds at once; this only bounds a bug


class _Conn:
    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.lock = threading.Lock()
        self.busy = False
        self.thread: threading.Thread | None = None


class LocalControlServer:
    """The listening socket and its connection threads; ``path`` is what clients are told. See the module doc."""

    def __init__(self, service: EncoderService, directory: str, max_conns: int) -> None:
        self._service = service
        self._max_conns = max_conns
        self.directory = _unix.ensure_private_dir(directory)
        self.path = os.path.join(self.directory, f"mm-{os.getpid()}-{secrets.token_hex(4)}.sock")
        self.host_token = _unix.host_token()
        self._listener = _unix.listen(self.path)
        self._lock = threading.Lock()
        self._conns: set[_Conn] = set()
        self._stopping = False
        self._rl = RateLimitedLog(log)
        self._metrics = service.transport.metrics
        self._acceptor = threading.Thread(target=self._accept_loop, name=_THREAD + "-accept", daemon=True)
        self._acceptor.start()

    @property
    def open_connections(self) -> int:
        with self._lock:
            return len(self._conns)

    def info_for(self, request: pb.LocalChannelRequest) -> pb.LocalChannelInfo:
        """The path for a client on this host (its token is ours), else an empty answer."""
        if self._stopping or not self.host_token or request.host_token != self.host_token:
            return pb.LocalChannelInfo()
        return pb.LocalChannelInfo(path=self.path, host_token=self.host_token)

    # -- accept -------------------------------------------------------------------------------------------

    def _accept_loop(self) -> None:
        while True:
            try:
                sock, _ = self._listener.accept()
            except OSError:
                return  # shut down by close()
            try:
                self._admit(sock)
            except OSError as exc:
                sock.close()
                self._rl.log(logging.INFO, "accept", "local control connection failed at accept: %s", exc)

    def _admit(self, sock: socket.socket) -> None:
        pid, uid = _unix.peer_uid(sock)
        if uid != os.geteuid():
            sock.close()
            self._metrics.control_streams.labels("encoder", "local_refused_uid").inc()
            self._rl.log(logging.WARNING, "uid", "refused a local control connection from pid %d running as uid "
                         "%d (we run as uid %d; SO_PEERCRED)", pid, uid, os.geteuid())
            return
        conn = _Conn(sock)
        with self._lock:
            full = self._stopping or len(self._conns) >= self._max_conns
            if not full:
                self._conns.add(conn)
        if full:
            self._metrics.control_streams.labels("encoder", "local_refused").inc()
            try:
                _unix.send_frame(sock, HELLO_MAGIC + bytes((HELLO_FULL,)), time.monotonic() + 1.0)
            finally:
                sock.close()
            return
        conn.thread = threading.Thread(target=self._serve, args=(conn,), name=_THREAD, daemon=True)
        conn.thread.start()

    # -- one connection -----------------------------------------------------------------------------------

    def _serve(self, conn: _Conn) -> None:
        metrics = self._metrics
        metrics.control_streams.labels("encoder", "local_opened").inc()
        sock = conn.sock
        try:
            _unix.send_frame(sock, HELLO_MAGIC + bytes((HELLO_OK,)), time.monotonic() + 5.0)
            while not self._stopping:
                raw = _unix.recv_frame(sock, None, wire.MAX_MESSAGE_BYTES)
                if raw is None:
                    return
                try:
                    msg = pb.StreamRequest.FromString(bytes(raw))
                except DecodeError as exc:
                    metrics.errors.labels("encoder", "invalid_request").inc()
                    self._rl.log(logging.WARNING, "parse", "a local control message does not parse (%s); "
                                 "ending the connection", exc)
                    return
                kind = msg.WhichOneof("body")
                if kind == "release":
                    self._service.release_unanswered(msg.release)
                    continue
                if not self._answer(conn, msg, kind):
                    return
        except OSError:
            return  # the client went away, or close() shut the connection down
        finally:
            with self._lock:
                self._conns.discard(conn)
            sock.close()
            metrics.control_streams.labels("encoder", "local_ended").inc()

    def _answer(self, conn: _Conn, msg: pb.StreamRequest, kind: str | None) -> bool:
        """Runs one Encode and sends its answer; False when the connection is done."""
        sock = conn.sock
        with conn.lock:
            conn.busy = True
        try:
            receipt: WireReceipt | None = None
            data: bytes | list[Buffer]
            if kind != "encode":
                unknown = NotImplementedError(f"StreamRequest {msg.id} has no body this encoder knows")
                data = pb.StreamResponse(id=msg.id, error=wire.stream_error_for(unknown)).SerializeToString()
            else:
                budget_s = msg.encode.deadline_ms / 1000.0 if msg.encode.deadline_ms > 0 else None
                deadline = None if budget_s is None else time.monotonic() + budget_s

                def is_active() -> bool:
                    return not _unix.is_gone(sock) and (deadline is None or time.monotonic() < deadline)

                try:
                    receipt = self._service.run_encode(msg.encode, is_active)
                    # Sent from the payloads' own memory (no join); the send below finishes before the receipt
                    # (and the output it views) goes out of scope, on this thread.
                    data = receipt.to_stream_pieces(msg.id)
                except Exception as exc:
                    receipt = None
                    data = wire.stream_frame(msg.id, wire.STREAM_ERROR_FIELD,
                                             wire.stream_error_for(exc).SerializeToString())
            try:
                _unix.send_frame(sock, data, None)
            except OSError:
                if receipt is not None and receipt.message.rdma_slots:
                    released = self._service.transport.discard(receipt)
                    log.info("local control connection ended while its receipt was being sent; released %d "
                             "lease(s) at once", released)
                return False
            return True
        finally:
            with conn.lock:
                conn.busy = False

    # -- stop ---------------------------------------------------------------------------------------------

    def stop_accepting(self) -> None:
        """The listener goes (its file first: new clients use gRPC), idle connections end now, busy ones after
        their answer. Never waits. Idempotent."""
        with self._lock:
            if self._stopping:
                return
            self._stopping = True
            conns = list(self._conns)
        try:
            os.unlink(self.path)
        except OSError:
            pass
        try:
            self._listener.shutdown(socket.SHUT_RDWR)  # wakes accept()
        except OSError:
            pass
        self._listener.close()
        for conn in conns:
            with conn.lock:
                if not conn.busy:
                    _shutdown(conn.sock)  # wakes the thread waiting for the next request

    def close(self, grace_s: float | None = 0.0) -> None:
        """``stop_accepting``, then up to ``grace_s`` (None: no limit) for busy connections to answer; what is
        left is cut (its clients get PeerUnavailable) and every thread is joined. Idempotent."""
        self.stop_accepting()
        with self._lock:
            conns = list(self._conns)
        deadline = None if grace_s is None else time.monotonic() + grace_s
        for conn in conns:
            if conn.thread is not None:
                conn.thread.join(None if deadline is None else max(0.0, deadline - time.monotonic()))
        for conn in conns:
            _shutdown(conn.sock)
        for conn in conns:
            if conn.thread is not None:
                conn.thread.join(_JOIN_S)
        self._acceptor.join(_JOIN_S)


def _shutdown(sock: socket.socket) -> None:
    try:
        sock.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass


def start_local_server(service: EncoderService, directory: str, max_conns: int) -> LocalControlServer | None:
    """A LocalControlServer, or None (logged) when the directory or the socket cannot be made safely."""
    try:
        return LocalControlServer(service, directory or _unix.default_runtime_dir(), max_conns)
    except (OSError, _unix.InsecurePath) as exc:
        log.warning("no same-host control channel: %s; clients use gRPC", exc)
        return None


__all__ = ["HELLO_FULL", "HELLO_MAGIC", "HELLO_OK", "LocalControlServer", "start_local_server"]
