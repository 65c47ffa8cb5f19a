"""The owner's metadata endpoint: a tiny TCP service a reader asks for the owner's NIXL agent metadata.

Wire format (big endian, no pickle)::

    request : b"TWMD" | u8 version=1 | u16 name_len | expected agent name (utf-8)
    response: b"TWMD" | u8 version=1 | u8 status (0 ok, 1 wrong agent) | u64 registration epoch
              | u16 name_len | agent name | u32 md_len | metadata bytes

The reader checks the name it asked for against the one returned, caps every length, and feeds only the
metadata blob to NIXL (never descriptor bytes). One short-lived connection per fetch.
"""

from __future__ import annotations

import ipaddress
import logging
import select
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
VERSION = 1
MAX_NAME = 256
MAX_METADATA = 16 << 20
MAX_CLIENTS = 32
_REQ_HEAD = struct.Struct(">4sBH")
_RESP_HEAD = struct.Struct(">4sBBQH")
_U32 = struct.Struct(">I")
STATUS_OK = 0
STATUS_WRONG_AGENT = 1

#: Returns (agent name, registration epoch, metadata) atomically.
Snapshot = Callable[[], tuple[str, int, bytes]]


@dataclass
class ServerStats:
    served: int = 0  # requests answered
    rejected: int = 0  # connections dropped: over MAX_CLIENTS, a bad request, or an I/O error or timeout


class MetadataServer:
    """Serves ``snapshot()`` on (bind_ip, port); a daemon thread blocked in select() when idle (no polling)."""

    def __init__(self, bind_ip: str, port: int, snapshot: Snapshot, *, io_timeout_s: float = 2.0) -> None:
        family = socket.AF_INET6 if ":" in bind_ip else socket.AF_INET
        self._sock = socket.socket(family, socket.SOCK_STREAM)
        self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            self._sock.bind((bind_ip, port))
            self._sock.listen(64)
        except OSError:
            self._sock.close()
            raise
        self.port: int = self._sock.getsockname()[1]
        self._snapshot = snapshot
        self._io_timeout_s = io_timeout_s
        self._stop = threading.Event()
        # select() sleeps on the listener and this pair; close() writes one byte so shutdown is immediate.
        self._wake_r, self._wake_w = socket.socketpair()
        self._tally = Tally(ServerStats())  # bumped by the per-connection threads
        self._slots = threading.BoundedSemaphore(MAX_CLIENTS)
        self._thread = threading.Thread(target=self._loop, name="tensorwire-rdma-md", daemon=True)
        self._thread.start()

    def _loop(self) -> None:
        while not self._stop.is_set():
            try:
                ready, _, _ = select.select([self._sock, self._wake_r], [], [])
            except (OSError, ValueError):
                return
            if self._stop.is_set() or self._sock not in ready:
                continue
            try:
                conn, _ = self._sock.accept()
            except OSError:
                continue
            # One short-lived thread per connection, at most MAX_CLIENTS at once, so a slow or silent client
            # (bounded by the io timeout) never delays the others; beyond the cap the connection is dropped.
            if not self._slots.acquire(blocking=False):
                with self._tally.locked() as c:
                    c.rejected += 1
                conn.close()
                continue
            threading.Thread(target=self._handle, args=(conn,), name="tensorwire-rdma-md-conn", daemon=True).start()

    def _handle(self, conn: socket.socket) -> None:
        try:
            with conn:
                conn.settimeout(self._io_timeout_s)
                self._serve(conn)
        except (OSError, ValueError) as exc:
            with self._tally.locked() as c:
                c.rejected += 1
            log.debug("metadata request failed: %s", exc)
        finally:
            self._slots.release()

    def _serve(self, conn: socket.socket) -> None:
        magic, version, name_len = _REQ_HEAD.unpack(_recv_exact(conn, _REQ_HEAD.size))
        if magic != MAGIC or version != VERSION or name_len > MAX_NAME:
            raise ValueError("bad metadata request header")
        wanted = _recv_exact(conn, name_len).decode("utf-8", "replace")
        name, epoch, md = self._snapshot()
        status = STATUS_OK if wanted == name else STATUS_WRONG_AGENT
        body = md if status == STATUS_OK else b""
        raw_name = name.encode()
        head = _RESP_HEAD.pack(MAGIC, VERSION, status, epoch, len(raw_name))
        conn.sendall(head + raw_name + _U32.pack(len(body)) + body)
        with self._tally.locked() as c:
            c.served += 1

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


def fetch(host: str, port: int, agent_name: str, *, timeout_s: float,
          connect_timeout_s: float | None = None) -> tuple[int, bytes]:
    """(epoch, metadata) of ``agent_name`` at host:port; ``ReadError(METADATA_UNAVAILABLE)`` on any failure.

    ``connect_timeout_s`` bounds name resolution and the TCP connect (a dead or unreachable owner fails fast);
    ``timeout_s`` bounds the whole exchange. They differ on purpose: once connected, a live owner's answer may
    wait for its serving thread to be scheduled, which on a loaded host can take longer than a connect timeout
    sized for the network (seen: 250 ms exceeded on a 2-core machine at load 8).
    """
    end = time.monotonic() + max(timeout_s, 0.001)
    connect_s = timeout_s if connect_timeout_s is None else min(connect_timeout_s, timeout_s)
    try:
        addr = _resolve(host, port, connect_s)
        with socket.create_connection(addr, timeout=max(min(connect_s, end - time.monotonic()), 0.001)) as conn:
            raw = agent_name.encode()
            conn.sendall(_REQ_HEAD.pack(MAGIC, VERSION, len(raw)) + raw)
            conn.settimeout(max(end - time.monotonic(), 0.001))
            magic, version, status, epoch, name_len = _RESP_HEAD.unpack(_recv_exact(conn, _RESP_HEAD.size))
            if magic != MAGIC or version != VERSION or name_len > MAX_NAME:
                raise ReadError(f"metadata endpoint {host}:{port} answered with a bad header",
                                reason=Reason.METADATA_UNAVAILABLE)
            name = _recv_exact(conn, name_len).decode("utf-8", "replace")
            (md_len,) = _U32.unpack(_recv_exact(conn, _U32.size))
            if md_len > MAX_METADATA:
                raise ReadError(f"metadata from {host}:{port} is {md_len} bytes, over {MAX_METADATA}",
                                reason=Reason.METADATA_UNAVAILABLE)
            md = _recv_exact(conn, md_len)
    except OSError as exc:
        raise ReadError(f"owner metadata endpoint {host}:{port} unreachable within {timeout_s * 1000:.0f} ms: {exc}",
                        reason=Reason.METADATA_UNAVAILABLE) from exc
    if status != STATUS_OK or name != agent_name:
        raise ReadError(f"{host}:{port} serves agent {name!r}, not {agent_name!r} (owner restarted?)",
                        reason=Reason.METADATA_UNAVAILABLE)
    return epoch, md


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
