"""HTTP calls to the vLLM instances behind the router (aiohttp client), every wait bounded.

One ``aiohttp.ClientSession`` holds pooled keep-alive connections (TCP_NODELAY, at most ``upstream_connections``
per instance, an idle one closed after ``upstream_keepalive_s``), https with ``upstream_ca`` (and a client
certificate when given). Answers are never decompressed (bytes go to the client as the instance sent them).

``open`` sends one request and returns once the status line and headers are in; the caller reads the body (each
read bounded by the call's ``sock_read``) and releases or closes the response. ``fetch`` reads a whole, small
answer (the encoder step's). Both raise, with messages that never hold the URL (the caller adds the instance's
name for clients and its URL for the log):

- ``PeerUnavailable`` when nothing was sent (refused, unreachable, connect or TLS handshake timed out, a pooled
  connection found closed twice in a row): the caller may try another instance;
- ``DeadlineExceeded`` (no answer in time) or ``ProtocolError`` (a broken answer) once the request may have
  reached the instance.

Thread-safety: none needed; every call runs on the router's event loop.
"""

from __future__ import annotations

import asyncio
import os
import ssl
from collections.abc import Mapping

import aiohttp
from yarl import URL

from tensorwire.errors import DeadlineExceeded, PeerUnavailable, ProtocolError, Reason

MAX_FETCH_BYTES = 64 * 1024 * 1024
HOP_BY_HOP = frozenset(
    (
        "connection",
        "keep-alive",
        "proxy-authenticate",
        "proxy-authorization",
        "proxy-connection",
        "te",
        "trailer",
        "transfer-encoding",
        "upgrade",
        "content-length",
        "date",
        "server",
        "x-request-id",
    )
)
_AUTO = ("Accept", "Accept-Encoding", "User-Agent", "Content-Type")


def client_ssl(ca: str, cert: str, key: str) -> ssl.SSLContext:
    ctx = ssl.create_default_context(cafile=ca or None)
    if cert:
        ctx.load_cert_chain(cert, key)
    return ctx


class Upstreams:
    """The pooled client session. ``start()`` on the event loop that will use it, ``close()`` there too."""

    def __init__(self, *, connections: int, keepalive_s: float, ssl_context: ssl.SSLContext | None) -> None:
        self._connections = connections
        self._keepalive_s = keepalive_s
        self._ssl = ssl_context
        self._session: aiohttp.ClientSession | None = None

    async def start(self) -> None:
        connector = aiohttp.TCPConnector(
            limit=0, limit_per_host=self._connections, keepalive_timeout=self._keepalive_s, ssl=self._ssl or True
        )
        self._session = aiohttp.ClientSession(
            connector=connector,
            auto_decompress=False,
            timeout=aiohttp.ClientTimeout(total=None),
            cookie_jar=aiohttp.DummyCookieJar(),
        )

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None

    async def open(
        self,
        base: str,
        method: str,
        target: str,
        body: bytes | None,
        headers: Mapping[str, str],
        *,
        timeout: aiohttp.ClientTimeout,
    ) -> aiohttp.ClientResponse:
        assert self._session is not None, "Upstreams.start() first"
        url = URL(base.rstrip("/") + target, encoded=True)
        skip = [h for h in _AUTO if h not in headers]
        for attempt in (1, 2):
            try:
                return await self._session.request(
                    method,
                    url,
                    data=body,
                    headers=dict(headers),
                    timeout=timeout,
                    allow_redirects=False,
                    skip_auto_headers=skip,
                )
            except aiohttp.ClientConnectorError as exc:
                raise PeerUnavailable(_why(exc)) from exc
            except aiohttp.ConnectionTimeoutError as exc:
                raise PeerUnavailable("no connection within the connect timeout") from exc
            except aiohttp.ServerDisconnectedError as exc:
                # A pooled keep-alive connection the instance had just closed: the request never ran. Once more
                # on a fresh connection; a second close means the instance drops requests.
                if attempt == 2:
                    raise ProtocolError("the instance closed the connection without answering") from exc
            except TimeoutError as exc:  # sock_read (the answer did not start) or the call's total
                raise DeadlineExceeded("no answer within the timeout") from exc
            except aiohttp.ClientError as exc:
                raise ProtocolError(f"broken answer ({_name(exc)})") from exc
        raise AssertionError("unreachable")

    async def fetch(
        self,
        base: str,
        method: str,
        target: str,
        body: bytes | None,
        headers: Mapping[str, str],
        *,
        timeout: aiohttp.ClientTimeout,
    ) -> tuple[int, str, bytes]:
        """(status, content type, body) of a whole answer of at most ``MAX_FETCH_BYTES``."""
        resp = await self.open(base, method, target, body, headers, timeout=timeout)
        try:
            chunks: list[bytes] = []
            total = 0
            async for chunk in resp.content.iter_any():
                total += len(chunk)
                if total > MAX_FETCH_BYTES:
                    raise ProtocolError(f"answer over {MAX_FETCH_BYTES} bytes", reason=Reason.INVALID_PAYLOAD)
                chunks.append(chunk)
            return resp.status, resp.headers.get("Content-Type", "application/json"), b"".join(chunks)
        except TimeoutError as exc:
            resp.close()
            raise DeadlineExceeded("the answer did not complete within the timeout") from exc
        except aiohttp.ClientError as exc:
            resp.close()
            raise ProtocolError(f"broken answer ({_name(exc)})") from exc
        finally:
            resp.release()

    async def probe(self, base: str, timeout_s: float) -> str:
        """'' when ``GET /health`` answers 200 within ``timeout_s``, else why not."""
        try:
            status, _, _ = await self.fetch(
                base, "GET", "/health", None, {}, timeout=aiohttp.ClientTimeout(total=timeout_s)
            )
        except (PeerUnavailable, DeadlineExceeded, ProtocolError) as exc:
            return str(exc)
        except asyncio.CancelledError:
            raise
        return "" if status == 200 else f"/health answered {status}"


def _why(exc: aiohttp.ClientConnectorError) -> str:
    """The reason without the address (asyncio's messages name it; clients must not see it)."""
    if isinstance(exc, aiohttp.ClientSSLError):
        return "TLS handshake failed (check --upstream-ca and the instance's certificate)"
    errno = exc.os_error.errno if exc.os_error is not None else None
    return os.strerror(errno).lower() if errno else "cannot connect"


def _name(exc: BaseException) -> str:
    """The exception's kind only: aiohttp's messages name the URL."""
    return type(exc).__name__
