"""The owner's metadata endpoint: a tiny TCP service a reader asks for the owner's NIXL agent metadata.

The metadata (the owner's UCX worker addresses and the remote keys of every registered region) is what a peer needs
to READ or WRITE the owner's registered memory, so it is handed out only to a peer that proves it got a
descriptor of this owner over the control plane: every descriptor carries the owner's ``metadata_token`` (random,
per provider instance) and a request must present it. Threat model and limits: docs/security.md "Data plane".

Wire format (big endian, no pickle)::

    request v2 : b"TWMD" | u8 version=2 | u16 name_len | u16 token_len | agent name (utf-8) | token
    response v2: b"TWMD" | u8 version=2 | u8 status (0 ok, 2 refused) | u64 registration epoch | u32 md_len | md

A refused request (wrong agent name or token) gets status 2, epoch 0 and no metadata: the answer says nothing about
which of the two was wrong, and never names the agent. Version 1 (no token; the response echoed the agent name) is
still spoken to owners that predate tokens (their descriptors carry none); this server answers a version-1 request
with a version-1 "wrong agent" response that names nobody, so a reader that predates tokens falls back inline.

Server: one thread and one ``selectors`` loop for every connection (no thread per connection). A connection must
deliver its whole request within ``request_timeout_s`` of being accepted and take its answer within
``io_timeout_s``; at most ``max_connections`` are open at once, and when a new one would exceed that, the oldest
connection still waiting for its request is closed first. Idle sockets therefore cannot lock readers out: a
reader sends its request with its first packet and is answered within one loop pass.
"""

from __future__ import annotations

import collections
import hmac
import ipaddress
import logging
import selectors
import socket
import struct
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from tensorwire.errors import ReadError, Reason
from tensorwire.rdma._stats import Tally

log = logging.getLogger(__name__)

MAGIC = b"TWMD"
VERSION = 2
LEGACY_VERSION = 1
MAX_NAME = 256
MAX_TOKEN = 64
MAX_METADATA = 16 << 20
MAX_CONNECTIONS = 256
REQUEST_TIMEOUT_S = 1.0
_ACCEPTS_PER_PASS = 64  # accept() calls per loop pass, so a connect flood cannot starve pending reads
_V1_REQ = struct.Struct(">4sBH")
_V2_REQ = struct.Struct(">4sBHH")
_V1_RESP = struct.Struct(">4sBBQH")
_V2_RESP = struct.Struct(">4sBBQI")
_U32 = struct.Struct(">I")
STATUS_OK = 0
STATUS_WRONG_AGENT = 1  # version 1 only
STATUS_REFUSED = 2

#: Returns (agent name, registration epoch, metadata) atomically.
Snapshot = Callable[[], tuple[str, int, bytes]]


@dataclass
class ServerStats:
    served: int = 0  # metadata handed out (answer fully written)
    refused: int = 0  # requests with a wrong agent name or token, or without a token (version 1)
    rejected: int = 0  # connections dropped: a malformed request, an I/O error, a timeout or over the cap
    evicted: int = 0  # of those, connections closed to make room for a new one (oldest still waiting)


class _Conn:
    __slots__ = ("sock", "inbuf", "outbuf", "deadline", "ok")

    def __init__(self, sock: socket.socket, deadline: float) -> None:
        self.sock = sock
        self.inbuf = bytearray()
        self.outbuf = b""  # set once the request is complete: the connection then only writes
        self.deadline = deadline
        self.ok = False  # the answer carries metadata (counted as served once written)


class MetadataServer:
    """Serves ``snapshot()`` on (bind_ip, port) to requests that present ``token``; see the module docstring.

    A daemon thread blocked in ``select`` when idle (no polling). ``close`` is idempotent.
    """

    def __init__(
        self,
        bind_ip: str,
        port: int,
        snapshot: Snapshot,
        *,
        token: bytes,
        request_timeout_s: float = REQUEST_TIMEOUT_S,
        io_timeout_s: float = 2.0,
        max_connections: int = MAX_CONNECTIONS,
    ) -> None:
        if not token or len(token) > MAX_TOKEN:
            raise ValueError(f"metadata token must be 1..{MAX_TOKEN} bytes")
        family = socket.AF_INET6 if ":" in bind_ip else socket.AF_INET
        self._sock = socket.socket(family, socket.SOCK_STREAM)
        self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            self._sock.bind((bind_ip, port))
            self._sock.listen(256)
            self._sock.setblocking(False)
        except OSError:
            self._sock.close()
            raise
        self.bind_ip = bind_ip
        self.port: int = self._sock.getsockname()[1]
        self._snapshot = snapshot
        self._token = bytes(token)
        self._request_timeout_s = request_timeout_s
        self._io_timeout_s = io_timeout_s
        self._max = max_connections
        self._stop = threading.Event()
        self._tally = Tally(ServerStats())
        self._conns: dict[socket.socket, _Conn] = {}
        # Connections still waiting for their request, oldest first: the ones evicted when the cap is reached.
        self._waiting: collections.OrderedDict[socket.socket, None] = collections.OrderedDict()
        self._sel = selectors.DefaultSelector()
        # close() writes one byte to this pair so that shutdown is immediate.
        self._wake_r, self._wake_w = socket.socketpair()
        self._wake_r.setblocking(False)
        self._sel.register(self._sock, selectors.EVENT_READ, "listen")
        self._sel.register(self._wake_r, selectors.EVENT_READ, "wake")
        self._thread = threading.Thread(target=self._loop, name="tensorwire-rdma-md", daemon=True)
        self._thread.start()

    # -- loop --

    def _loop(self) -> None:
        try:
            while not self._stop.is_set():
                timeout = None
                if self._conns:
                    timeout = max(0.0, min(c.deadline for c in self._conns.values()) - time.monotonic())
                for key, mask in self._sel.select(timeout):
                    if key.data == "listen":
                        self._accept()
                    elif key.data == "wake":
                        return
                    else:
                        self._on_event(key.data, mask)
                self._expire(time.monotonic())
        except Exception:  # a bug here must not take the process down; readers then fall back inline
            log.exception("rdma metadata endpoint loop failed; metadata is no longer served")
        finally:
            for c in list(self._conns.values()):
                self._drop(c, counted=False)

    def _accept(self) -> None:
        for _ in range(_ACCEPTS_PER_PASS):
            try:
                sock, _ = self._sock.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError as exc:  # EMFILE and friends: the pending connection stays in the backlog
                log.debug("metadata accept failed: %s", exc)
                return
            if len(self._conns) >= self._max and not self._evict_oldest_waiting():
                with self._tally.locked() as c:
                    c.rejected += 1
                sock.close()
                continue
            sock.setblocking(False)
            conn = _Conn(sock, time.monotonic() + self._request_timeout_s)
            self._conns[sock] = conn
            self._waiting[sock] = None
            self._sel.register(sock, selectors.EVENT_READ, conn)

    def _evict_oldest_waiting(self) -> bool:
        if not self._waiting:
            return False
        oldest = next(iter(self._waiting))
        with self._tally.locked() as c:
            c.evicted += 1
        self._drop(self._conns[oldest])
        return True

    def _on_event(self, conn: _Conn, mask: int) -> None:
        try:
            if conn.outbuf:
                if mask & selectors.EVENT_WRITE:
                    self._write(conn)
                return
            try:
                chunk = conn.sock.recv(4096)
            except BlockingIOError:
                return
            if not chunk:
                raise ConnectionError("closed before the request was complete")
            conn.inbuf += chunk
            answer = self._answer(conn)
            if answer is not None:
                self._waiting.pop(conn.sock, None)
                conn.outbuf = answer
                conn.deadline = time.monotonic() + self._io_timeout_s
                self._sel.modify(conn.sock, selectors.EVENT_WRITE, conn)
                self._write(conn)
        except Exception as exc:
            log.debug("metadata request failed: %r", exc)
            self._drop(conn)

    def _write(self, conn: _Conn) -> None:
        try:
            sent = conn.sock.send(conn.outbuf)
        except BlockingIOError:  # the socket buffer is full: wait for EVENT_WRITE
            return
        conn.outbuf = conn.outbuf[sent:]
        if not conn.outbuf:
            if conn.ok:
                with self._tally.locked() as c:
                    c.served += 1
            self._drop(conn, counted=False)

    def _answer(self, conn: _Conn) -> bytes | None:
        """The answer once ``conn.inbuf`` holds a whole request; None while incomplete; ValueError if malformed."""
        buf = conn.inbuf
        if len(buf) < 5:
            return None
        magic, version = bytes(buf[:4]), buf[4]
        if magic != MAGIC or version not in (LEGACY_VERSION, VERSION):
            raise ValueError("bad metadata request header")
        if version == LEGACY_VERSION:
            if len(buf) < _V1_REQ.size:
                return None
            _, _, name_len = _V1_REQ.unpack_from(buf)
            if name_len > MAX_NAME:
                raise ValueError("agent name over the cap")
            if len(buf) < _V1_REQ.size + name_len:
                return None
            # No token: never metadata, never the agent's name (an old reader then falls back inline).
            with self._tally.locked() as c:
                c.refused += 1
            return _V1_RESP.pack(MAGIC, LEGACY_VERSION, STATUS_WRONG_AGENT, 0, 0) + _U32.pack(0)
        if len(buf) < _V2_REQ.size:
            return None
        _, _, name_len, token_len = _V2_REQ.unpack_from(buf)
        if name_len > MAX_NAME or token_len > MAX_TOKEN:
            raise ValueError("agent name or token over the cap")
        end = _V2_REQ.size + name_len + token_len
        if len(buf) < end:
            return None
        if len(buf) > end:
            raise ValueError("bytes after the request")
        wanted = bytes(buf[_V2_REQ.size : _V2_REQ.size + name_len])
        token = bytes(buf[_V2_REQ.size + name_len : end])
        token_ok = hmac.compare_digest(token, self._token)  # checked before the snapshot is taken
        if token_ok:
            name, epoch, md = self._snapshot()
            if hmac.compare_digest(wanted, name.encode()):
                conn.ok = True
                return _V2_RESP.pack(MAGIC, VERSION, STATUS_OK, epoch, len(md)) + md
        with self._tally.locked() as c:
            c.refused += 1
        return _V2_RESP.pack(MAGIC, VERSION, STATUS_REFUSED, 0, 0)

    def _expire(self, now: float) -> None:
        for conn in [c for c in self._conns.values() if c.deadline <= now]:
            self._drop(conn)

    def _drop(self, conn: _Conn, *, counted: bool = True) -> None:
        if self._conns.pop(conn.sock, None) is None:
            return
        self._waiting.pop(conn.sock, None)
        if counted:  # before the close, so that a peer that sees the close also sees the count
            with self._tally.locked() as c:
                c.rejected += 1
        try:
            self._sel.unregister(conn.sock)
        except (KeyError, ValueError):
            pass
        conn.sock.close()

    # -- public --

    def stats(self) -> ServerStats:
        return self._tally.snapshot()

    def close(self) -> None:
        if self._stop.is_set():
            return
        self._stop.set()
        try:
            self._wake_w.send(b"x")
        except OSError:
            pass
        if self._thread is not threading.current_thread():
            self._thread.join(timeout=2.0)
        for s in (self._sock, self._wake_r, self._wake_w):
            try:
                s.close()
            except OSError:
                pass
        self._sel.close()


def fetch(
    host: str,
    port: int,
    agent_name: str,
    *,
    token: bytes = b"",
    timeout_s: float,
    connect_timeout_s: float | None = None,
) -> tuple[int, bytes]:
    """(epoch, metadata) of ``agent_name`` at host:port; ``ReadError(METADATA_UNAVAILABLE)`` on any failure.

    ``token`` is the descriptor's ``metadata_token``; an empty one (an owner that predates tokens) speaks version 1.
    ``connect_timeout_s`` bounds name resolution and the TCP connect (a dead or unreachable owner fails fast);
    ``timeout_s`` bounds the whole exchange. They differ on purpose: once connected, a live owner's answer may
    wait for its serving thread to be scheduled, which on a loaded host can take longer than a connect timeout
    sized for the network (seen: 250 ms exceeded on a 2-core machine at load 8).
    """
    end = time.monotonic() + max(timeout_s, 0.001)
    connect_s = timeout_s if connect_timeout_s is None else min(connect_timeout_s, timeout_s)
    raw = agent_name.encode()
    if len(raw) > MAX_NAME or len(token) > MAX_TOKEN:
        raise ReadError(
            f"agent name or metadata token of {agent_name!r} is over the cap", reason=Reason.METADATA_UNAVAILABLE
        )
    try:
        addr = _resolve(host, port, connect_s)
        with socket.create_connection(addr, timeout=max(min(connect_s, end - time.monotonic()), 0.001)) as conn:
            if token:
                conn.sendall(_V2_REQ.pack(MAGIC, VERSION, len(raw), len(token)) + raw + token)
            else:
                conn.sendall(_V1_REQ.pack(MAGIC, LEGACY_VERSION, len(raw)) + raw)
            conn.settimeout(max(end - time.monotonic(), 0.001))
            status, epoch, name, md = _read_answer(conn, host, port, legacy=not token)
    except OSError as exc:
        raise ReadError(
            f"owner metadata endpoint {host}:{port} unreachable within {timeout_s * 1000:.0f} ms: {exc}",
            reason=Reason.METADATA_UNAVAILABLE,
        ) from exc
    if status == STATUS_OK and (token or name == agent_name):
        return epoch, md
    if token:
        raise ReadError(
            f"{host}:{port} refused the metadata request for {agent_name!r}: it is not that agent or the "
            "descriptor's token is not its own (owner restarted?)",
            reason=Reason.METADATA_UNAVAILABLE,
        )
    raise ReadError(
        f"{host}:{port} serves agent {name!r}, not {agent_name!r} (owner restarted, or it requires a "
        "metadata token this descriptor lacks)",
        reason=Reason.METADATA_UNAVAILABLE,
    )


def _read_answer(conn: socket.socket, host: str, port: int, *, legacy: bool) -> tuple[int, int, str, bytes]:
    """(status, epoch, echoed agent name (version 1 only), metadata) of one answer."""
    name = ""
    if legacy:
        magic, version, status, epoch, name_len = _V1_RESP.unpack(_recv_exact(conn, _V1_RESP.size))
        if magic != MAGIC or version != LEGACY_VERSION or name_len > MAX_NAME:
            raise ReadError(
                f"metadata endpoint {host}:{port} answered with a bad header", reason=Reason.METADATA_UNAVAILABLE
            )
        name = _recv_exact(conn, name_len).decode("utf-8", "replace")
        (md_len,) = _U32.unpack(_recv_exact(conn, _U32.size))
    else:
        magic, version, status, epoch, md_len = _V2_RESP.unpack(_recv_exact(conn, _V2_RESP.size))
        if magic != MAGIC or version != VERSION:
            raise ReadError(
                f"metadata endpoint {host}:{port} answered with a bad header", reason=Reason.METADATA_UNAVAILABLE
            )
    if md_len > MAX_METADATA:
        raise ReadError(
            f"metadata from {host}:{port} is {md_len} bytes, over {MAX_METADATA}", reason=Reason.METADATA_UNAVAILABLE
        )
    return status, epoch, name, _recv_exact(conn, md_len)


def _resolve(host: str, port: int, timeout_s: float) -> tuple[str, int]:
    """(address, port), resolving a host name within ``timeout_s`` (getaddrinfo itself has no timeout)."""
    try:
        ipaddress.ip_address(host)
        return host, port
    except ValueError:
        pass
    result: list[Any] = []

    def lookup() -> None:
        try:
            result.append(socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0][4][:2])
        except OSError as exc:
            result.append(exc)

    t = threading.Thread(target=lookup, name="tensorwire-rdma-resolve", daemon=True)
    t.start()
    t.join(max(timeout_s, 0.001))
    if not result:
        raise TimeoutError(f"resolving {host!r} took over {timeout_s * 1000:.0f} ms")
    if isinstance(result[0], OSError):
        raise result[0]
    return result[0][0], result[0][1]


def _recv_exact(conn: socket.socket, n: int) -> bytes:
    buf = bytearray()
    while len(buf) < n:
        chunk = conn.recv(n - len(buf))
        if not chunk:
            raise ConnectionError(f"connection closed after {len(buf)} of {n} bytes")
        buf += chunk
    return bytes(buf)
