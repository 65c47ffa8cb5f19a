"""Hostile callers of an encoder service, for the issue-15 regression tests and ``bench hostile``.

Each function makes one hostile call (or holds one hostile connection) against ``target`` (``host:port``) and
returns how it ended, as a short bounded string (a gRPC status name, ``ok``, ``closed``, ...). They need only a
channel (``channel(target, tls)``); nothing here knows the server's internals.

- ``idle_stream``: opens an EncodeStream and sends nothing (``first=None``) or one message, then holds it open;
- ``unsent_body``: starts a unary Encode and never sends its request message;
- ``guessed_release``: ReleaseLeases with ids it made up (random, or near a lease id it saw);
- ``oversized``: an Encode whose one item is ``nbytes`` long;
- ``pixel_bomb``: a small PNG that declares ``side`` x ``side`` pixels; ``pixel_bomb_png`` makes it
  (``encode_image`` is the same call with any image, for the legitimate requests of a test);
- ``metadata_flood``: holds an idle TCP connection to an RDMA metadata endpoint.
"""

from __future__ import annotations

import secrets
import socket
import struct
import threading
import zlib
from typing import Any

import grpc

from tensorwire.mm import wire


def channel(target: str, tls: Any = None, options: list[tuple[str, Any]] | None = None) -> grpc.Channel:
    """A channel to ``target``: TLS with ``tls`` (a TlsConfig) when given, plaintext otherwise."""
    opts = list(options or []) + [("grpc.max_send_message_length", -1), ("grpc.max_receive_message_length", -1)]
    if tls is not None:
        from tensorwire._grpc.tls import channel_credentials, channel_options

        return grpc.secure_channel(target, channel_credentials(tls), options=opts + channel_options(tls))
    return grpc.insecure_channel(target, options=opts)


def _code(exc: grpc.RpcError) -> str:
    code = exc.code() if hasattr(exc, "code") else None
    return code.name if code is not None else "UNKNOWN"


def _blocking(first: bytes | None, release: threading.Event) -> Any:
    if first is not None:
        yield first
    release.wait()


def _held(done: threading.Event, hold_s: float, stop: threading.Event | None) -> bool:
    """Waits until ``done``, ``hold_s`` or ``stop``; True when the call is still open."""
    waited = 0.0
    while waited < hold_s and not (stop is not None and stop.is_set()):
        if done.wait(min(0.25, hold_s - waited)):
            return False
        waited += 0.25
    return not done.is_set()


def idle_stream(
    ch: grpc.Channel, *, first: bytes | None = None, hold_s: float = 30.0, stop: threading.Event | None = None
) -> str:
    """An EncodeStream that sends ``first`` (or nothing) and then nothing, held until the server ends it,
    ``hold_s`` passes or ``stop`` is set; returns the status name (``held`` when it was still open)."""
    release = threading.Event()
    # The call is also a grpc.Future (the stubs type it as an iterator only).
    call: Any = ch.stream_stream(wire.ENCODE_STREAM_METHOD)(_blocking(first, release), timeout=hold_s + 5)
    done = threading.Event()
    call.add_done_callback(lambda _c: done.set())
    try:
        return "held" if _held(done, hold_s, stop) else call.code().name
    finally:
        release.set()
        call.cancel()


def unsent_body(ch: grpc.Channel, *, hold_s: float = 30.0, stop: threading.Event | None = None) -> str:
    """A unary Encode whose request message never comes; the status the server ended it with (or ``held``)."""
    release = threading.Event()
    method: grpc.StreamUnaryMultiCallable[bytes, bytes] = ch.stream_unary(wire.ENCODE_METHOD)
    future = method.future(_blocking(None, release), timeout=hold_s + 5)
    done = threading.Event()
    future.add_done_callback(lambda _f: done.set())
    try:
        if _held(done, hold_s, stop):
            return "held"
        future.result(timeout=0)
        return "ok"
    except grpc.RpcError as exc:
        return _code(exc)
    finally:
        release.set()
        future.cancel()


def guess_ids(seen: str = "", n: int = 64) -> list[str]:
    """Lease ids an attacker would try: near ``seen`` (the old ``<prefix>-<counter>`` form, counters around it),
    else random ones of the same length."""
    if "-" in seen:
        prefix, _, counter = seen.rpartition("-")
        try:
            base = int(counter, 16)
            return [f"{prefix}-{base + k:x}" for k in range(-n // 2, n // 2 + 1) if k and base + k > 0]
        except ValueError:
            pass
    return [secrets.token_hex(max(8, len(seen) // 2) if seen else 16) for _ in range(n)]


def guessed_release(ch: grpc.Channel, ids: list[str], *, timeout_s: float = 10.0) -> tuple[str, int, int]:
    """ReleaseLeases of ``ids``: (status name, released, unknown)."""
    call = ch.unary_unary(
        wire.RELEASE_METHOD,
        request_serializer=wire.ReleaseLeasesRequest.SerializeToString,
        response_deserializer=wire.ReleaseLeasesResponse.FromString,
    )
    try:
        resp = call(wire.ReleaseLeasesRequest(lease_ids=ids), timeout=timeout_s)
    except grpc.RpcError as exc:
        return _code(exc), 0, 0
    return "ok", int(resp.released), int(getattr(resp, "unknown", 0))


def _encode(ch: grpc.Channel) -> grpc.UnaryUnaryMultiCallable[bytes, bytes]:
    """The Encode method, raw bytes both ways."""
    method: grpc.UnaryUnaryMultiCallable[bytes, bytes] = ch.unary_unary(wire.ENCODE_METHOD)
    return method


def encode_request(items: list[bytes], *, support_rdma: bool = False) -> bytes:
    req = wire.EncodeRequest(support_rdma=support_rdma)
    for data in items:
        req.inputs.add(data=data, kind="image")
    return req.SerializeToString()


def oversized(ch: grpc.Channel, nbytes: int, *, timeout_s: float = 30.0, payload: bytes | None = None) -> str:
    """An Encode with one item of ``nbytes`` (``payload`` reused when given); the status name."""
    raw = encode_request([payload if payload is not None else bytes(nbytes)])
    try:
        _encode(ch)(raw, timeout=timeout_s)
        return "ok"
    except grpc.RpcError as exc:
        return _code(exc)


def pixel_bomb_png(side: int = 8192) -> bytes:
    """A valid PNG of ``side`` x ``side`` 8-bit grey pixels, all zero: a few hundred bytes per 1000 rows."""

    def chunk(kind: bytes, body: bytes) -> bytes:
        return struct.pack(">I", len(body)) + kind + body + struct.pack(">I", zlib.crc32(kind + body) & 0xFFFFFFFF)

    raw = zlib.compressobj(9)
    row = b"\0" * (side + 1)  # filter byte + pixels
    data = b"".join(raw.compress(row) for _ in range(side)) + raw.flush()
    ihdr = struct.pack(">IIBBBBB", side, side, 8, 0, 0, 0, 0)
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", ihdr) + chunk(b"IDAT", data) + chunk(b"IEND", b"")


def encode_image(ch: grpc.Channel, data: bytes, *, timeout_s: float = 30.0) -> str:
    """An Encode of one image (inline answer); the status name."""
    try:
        _encode(ch)(encode_request([data]), timeout=timeout_s)
        return "ok"
    except grpc.RpcError as exc:
        return _code(exc)


def pixel_bomb(ch: grpc.Channel, png: bytes, *, timeout_s: float = 30.0) -> str:
    """An Encode of ``png`` (from ``pixel_bomb_png``); the status name."""
    return encode_image(ch, png, timeout_s=timeout_s)


def metadata_flood(endpoint: str, *, hold_s: float = 30.0, stop: threading.Event | None = None) -> str:
    """Holds one idle TCP connection to ``endpoint`` (``host:port``) until the peer closes it, ``hold_s``
    passes or ``stop`` is set; ``closed``, ``held`` or ``refused``."""
    host, _, port = endpoint.rpartition(":")
    try:
        sock = socket.create_connection((host.strip("[]"), int(port)), timeout=5)
    except OSError:
        return "refused"
    try:
        sock.settimeout(0.25)
        waited = 0.0
        while waited < hold_s and not (stop is not None and stop.is_set()):
            try:
                if not sock.recv(4096):
                    return "closed"
            except TimeoutError:
                waited += 0.25
            except OSError:
                return "closed"
        return "held"
    finally:
        sock.close()


__all__ = [
    "channel",
    "encode_image",
    "encode_request",
    "guess_ids",
    "guessed_release",
    "idle_stream",
    "metadata_flood",
    "oversized",
    "pixel_bomb",
    "pixel_bomb_png",
    "unsent_body",
]
