"""HTTP calls to the vLLM instances behind the router, every wait bounded (standard library only).

``post`` sends one request and reads the whole answer before a deadline (connect, send, status line, headers and
body all count); ``open_stream`` sends one and hands back the open response for the caller to relay, each read
bounded by an idle timeout. Both raise ``PeerUnavailable`` when nothing could be sent (refused, unreachable, reset
before the request went out: the caller may try another instance) and ``DeadlineExceeded`` or ``ProtocolError``
once the request may have reached the instance.

Thread-safety: every call uses its own connection; nothing is shared.
"""

from __future__ import annotations

import http.client
import time
from dataclasses import dataclass
from urllib.parse import urlsplit

from tensorwire.errors import DeadlineExceeded, PeerUnavailable, ProtocolError, Reason

MAX_ANSWER_BYTES = 256 * 1024 * 1024
_HOP_BY_HOP = frozenset(("connection", "keep-alive", "proxy-authenticate", "proxy-authorization", "te", "trailer",
                         "transfer-encoding", "upgrade", "content-length"))


@dataclass(frozen=True)
class Answer:
    """A complete answer: status, end-to-end headers (hop-by-hop ones and Content-Length left out), body."""

    status: int
    headers: list[tuple[str, str]]
    body: bytes


def end_to_end(headers: list[tuple[str, str]]) -> list[tuple[str, str]]:
    return [(k, v) for k, v in headers if k.lower() not in _HOP_BY_HOP]


def _connection(url: str, connect_timeout_s: float) -> http.client.HTTPConnection:
    parts = urlsplit(url)
    cls = http.client.HTTPSConnection if parts.scheme == "https" else http.client.HTTPConnection
    conn = cls(parts.hostname or "", parts.port, timeout=connect_timeout_s)
    try:
        conn.connect()
    except TimeoutError as exc:
        conn.close()
        raise PeerUnavailable(f"{url}: no connection within {connect_timeout_s:g} s") from exc
    except OSError as exc:
        conn.close()
        raise PeerUnavailable(f"{url}: {exc.strerror or exc}") from exc
    return conn


class _Deadline:
    def __init__(self, url: str, timeout_s: float) -> None:
        self.url = url
        self.timeout_s = timeout_s
        self.end = time.monotonic() + timeout_s

    def arm(self, conn: http.client.HTTPConnection) -> None:
        """Set the socket's timeout to what is left (the buffered reader above it reads through this socket)."""
        left = self.end - time.monotonic()
        if left <= 0:
            raise self.exceeded()
        if conn.sock is not None:
            conn.sock.settimeout(left)

    def exceeded(self) -> DeadlineExceeded:
        return DeadlineExceeded(f"{self.url}: no complete answer within {self.timeout_s:g} s")


def _send(conn: http.client.HTTPConnection, url: str, method: str, path: str, body: bytes | None,
          headers: dict[str, str]) -> None:
    try:
        conn.request(method, path, body=body, headers=headers)
    except TimeoutError as exc:
        raise DeadlineExceeded(f"{url}: sending the request timed out") from exc
    except OSError as exc:  # reset or closed before the request was out
        raise PeerUnavailable(f"{url}: {exc.strerror or exc} while sending the request") from exc


def post(url: str, method: str, path: str, body: bytes | None, headers: dict[str, str], *,
         connect_timeout_s: float, timeout_s: float) -> Answer:
    """One request, the whole answer read within ``timeout_s`` (``connect_timeout_s`` of it for the connect)."""
    deadline = _Deadline(url, timeout_s)
    conn = _connection(url, min(connect_timeout_s, timeout_s))
    try:
        deadline.arm(conn)
        _send(conn, url, method, path, body, headers)
        deadline.arm(conn)
        resp = conn.getresponse()
        chunks: list[bytes] = []
        total = 0
        while True:
            deadline.arm(conn)
            chunk = resp.read1(1 << 20)
            if not chunk:
                break
            total += len(chunk)
            if total > MAX_ANSWER_BYTES:
                raise ProtocolError(f"{url}: answer over {MAX_ANSWER_BYTES} bytes", reason=Reason.INVALID_PAYLOAD)
            chunks.append(chunk)
        return Answer(resp.status, end_to_end(resp.getheaders()), b"".join(chunks))
    except TimeoutError as exc:
        raise deadline.exceeded() from exc
    except (http.client.HTTPException, OSError) as exc:
        raise ProtocolError(f"{url}: broken answer ({type(exc).__name__}: {exc})") from exc
    finally:
        conn.close()


class Stream:
    """An open answer being relayed: ``status``/``headers`` now, ``read()`` chunks until b"", then ``close()``."""

    def __init__(self, url: str, conn: http.client.HTTPConnection, resp: http.client.HTTPResponse,
                 idle_timeout_s: float) -> None:
        self.url = url
        self.status = resp.status
        self.headers = end_to_end(resp.getheaders())
        self._conn = conn
        self._resp = resp
        self._idle_s = idle_timeout_s

    def read(self) -> bytes:
        """The next bytes the instance sent (b"" at the end); DeadlineExceeded after ``idle_timeout_s`` of silence."""
        if self._conn.sock is not None:
            self._conn.sock.settimeout(self._idle_s)
        try:
            return self._resp.read1(1 << 16)
        except TimeoutError as exc:
            raise DeadlineExceeded(f"{self.url}: nothing sent for {self._idle_s:g} s") from exc
        except (http.client.HTTPException, OSError) as exc:
            raise ProtocolError(f"{self.url}: broken answer ({type(exc).__name__}: {exc})") from exc

    def close(self) -> None:
        """Closes the connection (vLLM aborts a request whose client went away). Idempotent."""
        self._conn.close()


def open_stream(url: str, path: str, body: bytes, headers: dict[str, str], *, connect_timeout_s: float,
                idle_timeout_s: float) -> Stream:
    """Sends a POST and returns once the status line and headers are in (within ``idle_timeout_s``)."""
    conn = _connection(url, connect_timeout_s)
    try:
        if conn.sock is not None:
            conn.sock.settimeout(idle_timeout_s)
        _send(conn, url, "POST", path, body, headers)
        try:
            resp = conn.getresponse()
        except TimeoutError as exc:
            raise DeadlineExceeded(f"{url}: no answer within {idle_timeout_s:g} s") from exc
        except (http.client.HTTPException, OSError) as exc:
            raise ProtocolError(f"{url}: broken answer ({type(exc).__name__}: {exc})") from exc
        return Stream(url, conn, resp, idle_timeout_s)
    except BaseException:
        conn.close()
        raise
