"""The metadata endpoint's wire format as an attacker (or a test) writes it by hand (see providers/_metadata.py)."""

from __future__ import annotations

import socket
import struct

REFUSED_V2 = struct.pack(">4sBBQI", b"TWMD", 2, 2, 0, 0)  # status 2, epoch 0, no metadata


def v1_request(name: bytes) -> bytes:
    return struct.pack(">4sBH", b"TWMD", 1, len(name)) + name


def v2_request(name: bytes, token: bytes) -> bytes:
    return struct.pack(">4sBHH", b"TWMD", 2, len(name), len(token)) + name + token


def ask(port: int, payload: bytes, host: str = "127.0.0.1") -> bytes:
    """Everything the endpoint answers to ``payload`` until it closes the connection."""
    with socket.create_connection((host, port), timeout=5) as c:
        c.sendall(payload)
        out = b""
        while chunk := c.recv(65536):
            out += chunk
    return out
