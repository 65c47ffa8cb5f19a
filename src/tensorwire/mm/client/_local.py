"""LocalControlChannel: the same-host control channel, with gRPC as the way in and the fallback.

Discovery: at construction (in the background) the channel asks the endpoint over gRPC for its same-host
channel (``LocalChannel``, with this host's token: the kernel's boot id). It uses the answer only when the
worker's token is ours and the path is a socket of ours, 0600 at most, in a private directory of ours; a
connection is used only when the listener's SO_PEERCRED uid is ours and it said hello (``server._local``). A proxy
has no ``LocalChannel`` (UNIMPLEMENTED): clients of a proxy stay on gRPC, so its routing is never bypassed. The
first fetch waits for that first answer (at most ``local_channel_wait_ms``); a "no" (other host, channel off,
not listening, UNIMPLEMENTED, a failed check) is asked again after ``open_seconds``, an endpoint that did not
answer (not up yet) after a second, in the background, when a fetch finds it due.

Per fetch (``session``): an idle connection of the pool (at most ``control_stream_pool``), or a new one; with none
(pool full, not discovered, connect or hello failed) the fetch uses the gRPC channel's session, unchanged. On
the connection an Encode is a ``StreamRequest`` frame answered by one ``StreamResponse`` frame: the EncodeStream's
messages, so errors come back through the same ``wire`` table with the same class, reason and text.

=====================================================  ===============================================
situation                                              what the fetch gets
=====================================================  ===============================================
connect/hello fails, pool full, not discovered         the gRPC session (nothing was sent)
the request could not be written (peer gone)           the gRPC session, same budget (never executed)
no answer within the budget                            DeadlineExceeded(DEADLINE_EXCEEDED); write side
                                                       shut (the worker sees the caller gone and releases
                                                       what it exported); an answer still on its way
                                                       within LATE_ANSWER_S has its leases requeued
connection ends after the request was written          PeerUnavailable(PEER_UNAVAILABLE), never resent
  (worker killed, stopped under the request)
answer that does not parse / names another request     ProtocolError; connection closed
=====================================================  ===============================================

Placed outputs (``_placed``, docs/transport.md "Placed outputs"): each connection lends the worker receive buffers
(``_Conn._pick``; offered once per connection) and names one in each Encode; a placed answer's tensors view it
(``take_placed``). ``_Placements`` holds the channel's buffer budget, the size hint and the buffers whose request was
in flight when their connection broke (freed once the worker closed its end).

Releases: the success-path release is a fire-and-forget frame on the fetch's connection (written without
blocking; False when it cannot be written whole: the caller queues it). Answered releases (failure path, the
release queue) go over gRPC's ReleaseLeases.
"""

from __future__ import annotations

import itertools
import logging
import socket
import threading
import time
from dataclasses import dataclass

import torch

from tensorwire._local import unix as _unix
from tensorwire._local.server import ChannelBusy, ChannelGone, connect
from tensorwire._ratelog import RateLimitedLog
from tensorwire.errors import DeadlineExceeded, PeerUnavailable, ProtocolError, Reason, TensorwireError
from tensorwire.mm import wire
from tensorwire.mm._config import MODE_AUTO, TransportConfig
from tensorwire.mm._metrics import TransportMetrics, metrics_for
from tensorwire.mm._proto import encoder_pb2 as pb
from tensorwire.mm.client._channel import Budget, ControlChannel, ControlSession, Requeue
from tensorwire.mm.client._grpc import GrpcControlChannel
from tensorwire.mm.client._rdma_receipt import lease_ids, parse_slots
from tensorwire.mm.wire._local import HELLO_MAGIC, NOT_MAPPED
from tensorwire.mm.wire._local import MAX_BUFFERS_PER_CONN as WORKER_MAX_BUFFERS
from tensorwire.mm.wire._placed import MIN_BUFFER_BYTES, RecvBuffer, buffer_bytes, placed_views
from tensorwire.mm.wire._receipt import WireReceipt, read_stream_response
from tensorwire.rdma import Descriptor

log = logging.getLogger(__name__)

PATH_LABEL = "local"
MAX_BUFFERS_PER_CONN = 4  # receive buffers of the size wanted now one connection lends (the worker maps up to 8)
_PLACEMENT_OFF_S = 60.0  # a worker that did not map our buffer (or allocation failed): no offers for this long
_TRANSIENT_RETRY_S = 1.0  # discovery that found no endpoint (not up yet, restarting) is retried this soon


class _NotSent(Exception):
    """The request was never written whole: the worker cannot have run it."""


class _Unusable(Exception):
    """The advertised channel cannot be used (gone, refused, fails a check): forget it until rediscovery."""


# How long a connection whose request timed out is kept for its late answer: the worker gives up sending an
# answer its deadline plus ANSWER_SLACK_S (server._local) after it got the request.
LATE_ANSWER_S = 5.0


def _late_answer_leases(sock: socket.socket, rid: int) -> list[str]:
    """The lease ids of request ``rid``'s answer if it is readable on ``sock`` now (a short wait for the rest of a
    frame that has begun), else []. Anything else read (EOF, another id, an error answer) yields []."""
    try:
        raw = _unix.recv_frame(sock, time.monotonic() + 0.05, wire.MAX_MESSAGE_BYTES)
        if raw is None:
            return []
        answer_id, value = read_stream_response(raw)
    except Exception:  # a partial or malformed frame: the connection is dropped either way
        return []
    if answer_id != rid or not isinstance(value, WireReceipt):
        return []
    return lease_ids(parse_slots(value.message, Descriptor.from_bytes))


@dataclass
class _Grave:
    """A broken connection kept until its worker is done with it: ``bufs`` it may still write into, and the id of
    a request whose answer may still come (``awaiting``, until ``until``)."""

    sock: socket.socket
    bufs: list[RecvBuffer]
    awaiting: int | None = None
    until: float = 0.0


class _Placements:
    """The channel's receive buffers (``_placed``): bytes in use against ``cap_bytes``, the size the next buffer
    should have (``hint``: the largest output a worker could not place), and the broken connections whose worker
    may still write into a buffer or still answer (``bury``; ``reap`` frees them once the worker closed its end or
    answered, and hands the leases of a late answer to the release queue). Thread-safe."""

    def __init__(self, cap_bytes: int, device: str, rl: RateLimitedLog) -> None:
        self.cap_bytes = cap_bytes
        self.device = torch.device(device)
        self.hint = 0
        self._rl = rl
        self._ids = itertools.count(1)
        self._lock = threading.Lock()
        self._bytes = 0
        self._off_until = 0.0
        self._graves: list[_Grave] = []

    def enabled(self) -> bool:
        return self.cap_bytes > 0 and time.monotonic() >= self._off_until

    @property
    def bytes_in_use(self) -> int:
        """Receive-buffer bytes allocated now (lent, idle or waiting for their worker)."""
        return self._bytes

    @property
    def buried(self) -> int:
        """Buffers waiting for their worker to close its end of a broken connection."""
        with self._lock:
            return sum(len(g.bufs) for g in self._graves)

    def off(self, why: str) -> None:
        self._off_until = time.monotonic() + _PLACEMENT_OFF_S
        self._rl.log(logging.INFO, "placement-off", "placed outputs off for %.0f s: %s", _PLACEMENT_OFF_S, why)

    def new_buffer(self, needed: int) -> RecvBuffer | None:
        nbytes = buffer_bytes(max(needed, MIN_BUFFER_BYTES))
        with self._lock:
            if self._bytes + nbytes > self.cap_bytes:
                return None
            self._bytes += nbytes
        try:
            return RecvBuffer(next(self._ids), nbytes, self.device)
        except Exception as exc:  # out of memory, no driver: the other planes still work
            with self._lock:
                self._bytes -= nbytes
            self.off(f"a {nbytes}-byte receive buffer could not be allocated: {exc!r}")
            return None

    def loan_ended(self, buf: RecvBuffer) -> None:
        buf.busy = False
        if buf.retired:
            self._free(buf)

    def retire(self, bufs: list[RecvBuffer]) -> None:
        """Nothing writes into these any more: free them now, or when their loans end."""
        for buf in bufs:
            buf.retired = True
            if not buf.busy:
                self._free(buf)

    def bury(
        self, sock: socket.socket, inflight: RecvBuffer | None, others: list[RecvBuffer], awaiting: int | None = None
    ) -> None:
        """The connection broke with a request in flight: the worker may still write ``inflight`` and still send
        request ``awaiting``'s answer (after its deadline: the caller gave up). The connection's write side is
        shut (the worker sees the caller gone), the buffer is freed once the worker closed its end or answered,
        and an answer that comes within ``LATE_ANSWER_S`` has its leases released (``reap``)."""
        if inflight is not None:
            inflight.retired = True
        self.retire(others)
        try:
            sock.shutdown(socket.SHUT_WR)
        except OSError:
            pass
        grave = _Grave(sock, [inflight] if inflight is not None else [], awaiting, time.monotonic() + LATE_ANSWER_S)
        with self._lock:
            self._graves.append(grave)

    def reap(self, requeue: Requeue | None = None) -> None:
        """Frees what the workers are done with; the leases of a late answer go to ``requeue`` (never blocks
        long: only what is already readable is read)."""
        if not self._graves:
            return
        with self._lock:
            graves, self._graves = self._graves, []
        keep = []
        now = time.monotonic()
        for g in graves:
            if g.awaiting is not None and not _unix.is_quiet(g.sock):
                ids = _late_answer_leases(g.sock, g.awaiting)
                if ids and requeue is not None:
                    requeue(ids)
                g.awaiting = None  # answered (or the connection ended): nothing more will be written
                done = True
            else:
                done = _unix.is_gone(g.sock) or (not g.bufs and now >= g.until)
            if done:
                g.sock.close()
                for buf in g.bufs:
                    buf.busy = False
                    self._free(buf)
            else:
                keep.append(g)
        with self._lock:
            self._graves.extend(keep)

    def close(self, requeue: Requeue | None = None) -> None:
        """At the channel's close: graves whose worker is gone or answered are freed; the rest are left allocated
        (a worker that never ends its connection could still write into them)."""
        self.reap(requeue)
        with self._lock:
            kept = [g for g in self._graves if g.bufs]
            ended, self._graves = [g for g in self._graves if not g.bufs], kept
            left = sum(len(g.bufs) for g in kept)
        for g in ended:  # only an answer was awaited: nobody is left to release it (the worker's TTL GC is)
            g.sock.close()
        if left:
            log.warning("%d receive buffer(s) stay allocated: their worker may still write into them", left)

    def _free(self, buf: RecvBuffer) -> None:
        with self._lock:  # once: a loan ending on another thread may race the connection's close
            nbytes, buf.nbytes = buf.nbytes, 0
            if nbytes <= 0:
                return
            self._bytes -= nbytes
        buf.close()


class _Conn:
    """One connection to the worker's socket; used by one fetch at a time. ``broken`` is final."""

    def __init__(self, sock: socket.socket, placements: _Placements | None = None) -> None:
        self.sock = sock
        self.broken = False
        self.renew = False  # its buffers are all too small for what the worker sends: end it at give-back
        self.idle_since = time.monotonic()
        self._next_id = 0
        self._placements = placements
        self.buffers: list[RecvBuffer] = []  # lent to the worker on this connection (mapped there)
        self.inflight: RecvBuffer | None = None  # named by the request on the wire
        self.answered: RecvBuffer | None = None  # named by the last request, whose answer says it is filled
        self.awaiting: int | None = None  # a request written whose answer did not come in time

    @classmethod
    def open(cls, path: str, timeout_s: float, placements: _Placements | None = None) -> _Conn:
        """Connects, checks the listener's uid and reads its hello. ``_Unusable``: the channel is not there or not
        ours; ``_NotSent``: it is, but will not take this connection now (full, slow)."""
        try:
            sock = connect(path, HELLO_MAGIC, timeout_s)
        except ChannelGone as exc:
            raise _Unusable(str(exc)) from exc
        except ChannelBusy as exc:
            raise _NotSent(str(exc)) from exc
        return cls(sock, placements)

    def _pick(self) -> tuple[RecvBuffer | None, bool]:
        """(a free receive buffer for the next output, whether it still has to be offered), or (None, False)."""
        mgr = self._placements
        if mgr is None or not mgr.enabled():
            return None, False
        need = buffer_bytes(mgr.hint) if mgr.hint else 0
        usable = [b for b in self.buffers if not b.retired and b.nbytes >= need]
        free = [b for b in usable if not b.busy]
        if free:
            return min(free, key=lambda b: b.nbytes), False
        # Buffers too small for what the worker now sends stay mapped there until the connection ends, and count
        # against its cap: at that cap with none busy, the connection is renewed (a new one lends larger ones).
        if len(usable) >= MAX_BUFFERS_PER_CONN or len(self.buffers) >= WORKER_MAX_BUFFERS:
            if len(self.buffers) >= WORKER_MAX_BUFFERS and not any(b.busy for b in self.buffers):
                self.renew = True
            log.debug(
                "no receive buffer for this fetch: %d of %d lent on this connection are in use",
                len(usable),
                len(self.buffers),
            )
            return None, False
        buf = mgr.new_buffer(need)
        if buf is None:
            log.debug("no receive buffer for this fetch: %d of %d bytes in use", mgr.bytes_in_use, mgr.cap_bytes)
            return None, False
        self.buffers.append(buf)
        return buf, True

    def usable(self, max_idle_s: float) -> bool:
        """Not broken, nothing unread (a hang-up shows as readable), and idle for less than ``max_idle_s``."""
        return not self.broken and time.monotonic() - self.idle_since < max_idle_s and _unix.is_quiet(self.sock)

    def encode(
        self, request: pb.EncodeRequest, budget: Budget, endpoint: str, metrics: TransportMetrics
    ) -> WireReceipt:
        timeout_s = budget.remaining_ms() / 1000.0
        if timeout_s <= 0:
            raise DeadlineExceeded("fetch budget exhausted before the Encode call", reason=Reason.BUDGET_EXHAUSTED)
        deadline = time.monotonic() + timeout_s
        self._next_id += 1
        rid = self._next_id
        # Pieces, sent back to back: appending the placement to the frame would copy the request's media again.
        data = [wire.stream_frame(rid, wire.STREAM_ENCODE_FIELD, request.SerializeToString())]
        buf, offer = self._pick()
        try:
            if buf is not None:
                buf.wait_ready()  # the previous tensors' queued readers are done with it
                if offer:
                    body, fds = buf.offer()
                    _unix.send_frame(
                        self.sock,
                        wire.stream_frame(0, wire.STREAM_OFFER_FIELD, body.SerializeToString()),
                        deadline,
                        fds,
                    )
                data.append(wire.placement_field(buf.buffer_id))
                buf.busy = True
            try:
                _unix.send_frame(self.sock, data, deadline)
            except BaseException:
                if buf is not None:
                    buf.busy = False  # not written whole: never run, so never written into
                raise
            if buf is not None:
                self.inflight = buf
        except TimeoutError as exc:  # not written whole: never run; but the budget is gone
            self.broken = True
            raise DeadlineExceeded(
                f"Encode on {endpoint} failed with DEADLINE_EXCEEDED: the local control channel "
                f"did not take the request within {timeout_s:.3f} s",
                reason=Reason.DEADLINE_EXCEEDED,
            ) from exc
        except OSError as exc:
            self.broken = True
            raise _NotSent(str(exc)) from exc
        metrics.child(metrics.control_rpcs, PATH_LABEL).inc()
        try:
            raw = _unix.recv_frame(self.sock, deadline, wire.MAX_MESSAGE_BYTES)
        except TimeoutError as exc:
            self.broken = True
            self.awaiting = rid  # its answer may still come: close() keeps the connection to release it
            metrics.control_streams.labels("llm", "local_deadline").inc()
            raise DeadlineExceeded(
                f"Encode on {endpoint} failed with DEADLINE_EXCEEDED: no answer on the local "
                f"control channel within {timeout_s:.3f} s",
                reason=Reason.DEADLINE_EXCEEDED,
            ) from exc
        except (OSError, ValueError) as exc:
            self.broken = True
            metrics.control_streams.labels("llm", "local_broken").inc()
            raise PeerUnavailable(
                f"Encode on {endpoint}: the local control connection failed after the request was sent ({exc})",
                reason=Reason.PEER_UNAVAILABLE,
            ) from exc
        if raw is None:
            self.broken = True
            metrics.control_streams.labels("llm", "local_broken").inc()
            raise PeerUnavailable(
                f"Encode on {endpoint}: the worker closed the local control connection before answering",
                reason=Reason.PEER_UNAVAILABLE,
            )
        try:
            answer_id, value = read_stream_response(raw)  # a large inline receipt views ``raw``, held by nothing else
        except Exception as exc:
            self.broken = True
            raise ProtocolError(f"receipt from {endpoint} does not parse: {exc}") from exc
        if answer_id != rid:
            self.broken = True
            raise ProtocolError(f"{endpoint} answered request {answer_id} on a local connection awaiting {rid}")
        self.inflight = None  # answered: the worker is done with the buffer
        self.answered = None
        if buf is not None and isinstance(value, WireReceipt) and value.message.placed.tensors:
            self.answered = buf  # this request's buffer, for the session to check the answer against
        elif buf is not None:
            buf.busy = False
            if isinstance(value, WireReceipt):
                self._learn(value.message.placed)
        if isinstance(value, WireReceipt):
            return value
        if isinstance(value, pb.StreamError):
            raise wire.error_from_stream(value, f"Encode on {endpoint}")
        self.broken = True
        raise ProtocolError(f"{endpoint} answered request {rid} with neither a receipt nor an error")

    def _learn(self, placed: pb.PlacedOutput) -> None:
        """What a declined placement says: a larger buffer next time, or no offers for a while."""
        mgr = self._placements
        if mgr is None or not placed.declined:
            return
        if placed.declined == "too_large" and placed.needed_bytes:
            if placed.needed_bytes > mgr.cap_bytes:
                mgr.off(f"an output of {placed.needed_bytes} bytes exceeds local_placement_bytes={mgr.cap_bytes}")
            else:
                mgr.hint = max(mgr.hint, int(placed.needed_bytes))
        elif placed.declined == NOT_MAPPED:
            mgr.off("the worker did not map our receive buffer (see its log: local_offer_refused)")

    def send_release(self, lease_ids: list[str], metrics: TransportMetrics) -> bool:
        if self.broken:
            return False
        if not lease_ids:
            return True
        body = wire.stream_frame(
            0, wire.STREAM_RELEASE_FIELD, pb.ReleaseLeasesRequest(lease_ids=lease_ids).SerializeToString()
        )
        frame = _unix.FRAME_HEADER.pack(len(body)) + body
        try:
            self.sock.setblocking(False)
            sent = self.sock.send(frame)
        except OSError:
            sent = -1
        if sent != len(frame):  # a partial frame is never run: the ids go to the caller's queue
            self.broken = True
            return False
        metrics.child(metrics.releases, PATH_LABEL, "sent").inc(len(lease_ids))
        return True

    def close(self) -> None:
        self.broken = True
        bufs, self.buffers = self.buffers, []
        inflight, self.inflight = self.inflight, None
        awaiting, self.awaiting = self.awaiting, None
        if self._placements is not None and (inflight is not None or awaiting is not None):
            self._placements.bury(self.sock, inflight, [b for b in bufs if b is not inflight], awaiting)
            return  # the socket goes with the grave
        if self._placements is not None:
            self._placements.retire(bufs)
        self.sock.close()


class _ConnPool:
    """Idle connections to one path, at most ``cap`` open; LIFO (the warmest first). A connection idle for
    ``max_idle_s`` or more is closed instead of reused: the worker ends connections idle for its
    ``local_channel_idle_ms``, and one it ends just as a request goes out would fail that fetch, so the client
    lets go first (at half that time, by the same setting)."""

    def __init__(self, cap: int, max_idle_s: float = 150.0) -> None:
        self._cap = cap
        self._max_idle_s = max_idle_s
        self._lock = threading.Lock()
        self._idle: list[_Conn] = []
        self._open = 0
        self._closed = False

    def take(self) -> tuple[_Conn | None, bool]:
        """(an idle usable connection or None, whether a new one may be opened)."""
        stale: list[_Conn] = []
        try:
            with self._lock:
                if self._closed:
                    return None, False
                while self._idle:
                    conn = self._idle.pop()
                    if conn.usable(self._max_idle_s):
                        return conn, False
                    stale.append(conn)
                    self._open -= 1
                if self._open >= self._cap:
                    return None, False
                self._open += 1
                return None, True
        finally:
            for conn in stale:
                conn.close()

    def opened_failed(self) -> None:
        with self._lock:
            self._open -= 1

    def give_back(self, conn: _Conn) -> None:
        with self._lock:
            keep = not self._closed and not conn.broken and not conn.renew
            if keep:
                conn.idle_since = time.monotonic()
                self._idle.append(conn)
            else:
                self._open -= 1
        if not keep:
            conn.close()

    def close(self) -> None:
        with self._lock:
            self._closed = True
            idle, self._idle = self._idle, []
            self._open -= len(idle)
        for conn in idle:
            conn.close()

    def reset(self) -> None:
        """Drops the idle connections (the path they went to is forgotten); open ones end at give_back."""
        with self._lock:
            idle, self._idle = self._idle, []
            self._open -= len(idle)
        for conn in idle:
            conn.close()


class LocalControlChannel(ControlChannel):
    """The ``ControlChannel`` of a same-host client: the worker's Unix socket when discovered (module docstring),
    else (and for answered releases) the ``GrpcControlChannel`` to ``endpoint``, which this channel owns.

    ``grpc_channel``: the gRPC control channel to use (tests); ``local_path`` / ``wait_discovered`` are views for
    tests and benchmarks.
    """

    def __init__(
        self,
        endpoint: str,
        config: TransportConfig | None = None,
        metrics: TransportMetrics | None = None,
        *,
        grpc_channel: GrpcControlChannel | None = None,
    ) -> None:
        self.endpoint = endpoint
        self._config = config if config is not None else TransportConfig()
        self._metrics = metrics if metrics is not None else metrics_for(None)
        self.grpc = (
            grpc_channel if grpc_channel is not None else GrpcControlChannel(endpoint, self._config, self._metrics)
        )
        self._wait_s = self._config.local_channel_wait_ms / 1000.0
        self._pool = _ConnPool(self._config.control_stream_pool, self._config.local_channel_idle_ms / 2000.0)
        self._token = _unix.host_token()
        self._lock = threading.Lock()
        self._path: str | None = None
        self._retry_at = 0.0
        self._first = threading.Event()
        self._asking: threading.Thread | None = None
        self._closed = False
        self._rl = RateLimitedLog(log)
        self._requeue: Requeue | None = None
        # mode grpc: every output inline, so no receive buffers either
        self.placements = _Placements(
            self._config.local_placement_bytes if self._config.mode == MODE_AUTO else 0,
            self._config.rdma.device,
            self._rl,
        )
        self._ask()

    # -- discovery ----------------------------------------------------------------------------------------

    @property
    def local_path(self) -> str | None:
        return self._path

    def wait_discovered(self, timeout_s: float) -> bool:
        """Waits for the first discovery; True when it found a channel."""
        self._first.wait(timeout_s)
        return self._path is not None

    def _ask(self) -> None:
        """Starts one discovery in the background (caller: construction, or a due retry)."""
        with self._lock:
            if self._closed or (self._asking is not None and self._asking.is_alive()):
                return
            self._retry_at = float("inf")  # until this one answers
            self._asking = threading.Thread(target=self._discover, name="tensorwire-mm-local-discovery", daemon=True)
            self._asking.start()

    def _discover(self) -> None:
        path: str | None = None
        why = ""
        retry_s = self._config.open_seconds
        try:
            if not self._token:
                why = "no host token (cannot read the kernel's boot id)"
            else:
                info = self.grpc.local_channel_info(self._token, self._wait_s)
                if not info.path:
                    why = "the endpoint has no same-host channel for us"
                elif info.host_token != self._token:
                    why = "the worker runs on another host"
                else:
                    _unix.check_socket_path(info.path)
                    path = info.path
        except (PeerUnavailable, DeadlineExceeded) as exc:  # the endpoint is not up (yet): ask again soon
            why = f"LocalChannel: {exc}"
            retry_s = min(_TRANSIENT_RETRY_S, retry_s)
        except TensorwireError as exc:
            why = f"LocalChannel: {exc}"
        except (OSError, _unix.InsecurePath) as exc:
            why = f"the advertised socket fails its checks: {exc}"
        except ValueError as exc:  # grpc: the channel was closed under the call (the transport is closing)
            why = f"LocalChannel: {exc}"
        with self._lock:
            self._path = path
            self._retry_at = 0.0 if path is not None else time.monotonic() + retry_s
        if path is not None:
            self._metrics.control_streams.labels("llm", "local_discovered").inc()
            log.info("same-host control channel for %s: %s", self.endpoint, path)
        else:
            self._rl.log(
                logging.INFO,
                "nolocal",
                "no same-host control channel for %s (%s); using gRPC, asking again in %.0f s",
                self.endpoint,
                why,
                retry_s,
            )
        self._first.set()

    def _forget(self, path: str, why: str) -> None:
        with self._lock:
            if self._path != path:
                return
            self._path = None
            self._retry_at = time.monotonic() + self._config.open_seconds
        self._pool.reset()
        self._metrics.control_streams.labels("llm", "local_unavailable").inc()
        self._rl.log(
            logging.WARNING,
            "forget",
            "same-host control channel %s of %s unusable (%s); using gRPC, asking again in %.0f s",
            path,
            self.endpoint,
            why,
            self._config.open_seconds,
        )

    # -- ControlChannel -----------------------------------------------------------------------------------

    def bind_requeue(self, requeue: Requeue) -> None:
        self._requeue = requeue  # also where the leases of a late local answer go (_Placements.reap)
        self.grpc.bind_requeue(requeue)

    def session(self) -> ControlSession:
        if not self._first.is_set():
            self._first.wait(self._wait_s)
        path = self._path
        if path is None:
            if time.monotonic() >= self._retry_at:
                self._ask()
            return self.grpc.session()
        self.placements.reap(self._requeue)
        conn, may_open = self._pool.take()
        if conn is None and may_open:
            try:
                conn = _Conn.open(path, self._wait_s, self.placements)
                self._metrics.control_streams.labels("llm", "local_opened").inc()
            except _Unusable as exc:
                self._pool.opened_failed()
                self._forget(path, str(exc))
            except (_NotSent, OSError) as exc:
                self._pool.opened_failed()
                self._rl.log(
                    logging.INFO,
                    "open",
                    "could not open a local control connection to %s (%s); this fetch uses gRPC",
                    path,
                    exc,
                )
        if conn is None:
            return self.grpc.session()
        return _LocalSession(self, conn)

    def release(self, lease_ids: list[str], timeout_s: float) -> int:
        return self.grpc.release(lease_ids, timeout_s)

    def drain(self, timeout_s: float) -> None:
        self._pool.close()
        self.grpc.drain(timeout_s)

    def close(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
            asking = self._asking
        try:
            self._pool.close()
            self.placements.close(self._requeue)
            if asking is not None:
                asking.join(self._wait_s + 1.0)
        finally:
            self.grpc.close()

    # -- for sessions -------------------------------------------------------------------------------------

    def _give_back(self, conn: _Conn) -> None:
        self._pool.give_back(conn)


class _LocalSession(ControlSession):
    """One fetch on one local connection; after a request that was never written, the rest of the fetch (its
    inline fallback included) uses a gRPC session."""

    def __init__(self, channel: LocalControlChannel, conn: _Conn) -> None:
        self._channel = channel
        self._conn: _Conn | None = conn
        self._grpc: ControlSession | None = None
        self._placed: RecvBuffer | None = None  # holds the output of the last answer, until take_placed

    @property
    def path(self) -> str:
        return PATH_LABEL if self._grpc is None else self._grpc.path

    def encode(self, request: pb.EncodeRequest, budget: Budget) -> WireReceipt:
        conn = self._conn
        self._drop_placed()
        if self._grpc is None and conn is not None:
            try:
                receipt = conn.encode(request, budget, self._channel.endpoint, self._channel._metrics)
                if receipt.message.placed.tensors:
                    lent, conn.answered = conn.answered, None
                    if lent is None or lent.buffer_id != receipt.message.placed.buffer_id:
                        if lent is not None:
                            self._channel.placements.loan_ended(lent)  # not what the answer names: free again
                        conn.broken = True
                        raise ProtocolError(
                            f"{self._channel.endpoint} placed its output in buffer "
                            f"{receipt.message.placed.buffer_id}, which this request did not lend",
                            reason=Reason.RESULT_MISMATCH,
                        )
                    self._placed = lent
                return receipt
            except _NotSent:
                self._channel._metrics.control_streams.labels("llm", "local_not_sent").inc()
            finally:
                if conn.broken:
                    self._drop()
        if self._grpc is None:
            self._grpc = self._channel.grpc.session()
        return self._grpc.encode(request, budget)

    def release_after_read(self, lease_ids: list[str]) -> bool:
        if self._grpc is not None:
            return self._grpc.release_after_read(lease_ids)
        conn = self._conn
        return conn is not None and conn.send_release(lease_ids, self._channel._metrics)

    def take_placed(self, receipt: WireReceipt) -> tuple[list[torch.Tensor], list[int], int]:
        buf, self._placed = self._placed, None
        if buf is None or buf.buffer_id != receipt.message.placed.buffer_id:
            if buf is not None:
                self._channel.placements.loan_ended(buf)
            return super().take_placed(receipt)
        try:
            return placed_views(receipt.message.placed, buf, self._channel.placements.loan_ended)
        except BaseException:
            self._channel.placements.loan_ended(buf)  # nothing was lent: the buffer is free again
            raise

    def _drop_placed(self) -> None:
        """A placed answer nobody took (the fetch failed before): its buffer is free again."""
        buf, self._placed = self._placed, None
        if buf is not None:
            self._channel.placements.loan_ended(buf)

    def _drop(self) -> None:
        conn, self._conn = self._conn, None
        if conn is not None:
            self._channel._give_back(conn)

    def close(self) -> None:
        self._drop_placed()
        self._drop()
        if self._grpc is not None:
            self._grpc.close()


def control_channel_for(endpoint: str, config: TransportConfig, metrics: TransportMetrics) -> ControlChannel:
    """The default control channel of a ``RemoteOutputTransport``: same-host first unless ``local_channel`` is off."""
    if config.local_channel == "off":
        return GrpcControlChannel(endpoint, config, metrics)
    return LocalControlChannel(endpoint, config, metrics)


__all__ = ["PATH_LABEL", "LocalControlChannel", "control_channel_for"]
