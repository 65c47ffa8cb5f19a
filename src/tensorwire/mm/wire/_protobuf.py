"""The protobuf wire format by hand, for the inline tensors' ``data`` fields, which protobuf's Python objects
would copy several times; every other field is left to protobuf.

Reading treats the bytes as untrusted and follows upb's limits (a varint at most 10 bytes, a tag or length at
most 5, every length checked against the end of its message); a malformed record or a group (wire types 3, 4)
raises ``WireError`` (a ValueError) before anything is sliced.
"""

from __future__ import annotations

from collections.abc import Iterator

Buffer = bytes | bytearray | memoryview

VARINT, I64, LEN, SGROUP, EGROUP, I32 = 0, 1, 2, 3, 4, 5
FIXED_LEN_WIDTH = 5  # a length written with fixed_varint: 5 bytes hold up to 2**35 - 1 (a message is < 2**31)


class WireError(ValueError):
    """Bytes that are not a well-formed protobuf message (or use a construct this reader refuses)."""


def varint(n: int) -> bytes:
    """The shortest varint of ``n`` (0 <= n < 2**64)."""
    out = bytearray()
    while n > 0x7F:
        out.append(n & 0x7F | 0x80)
        n >>= 7
    out.append(n)
    return bytes(out)


def fixed_varint(n: int, width: int = FIXED_LEN_WIDTH) -> bytes:
    """``n`` as a varint of exactly ``width`` bytes (continuation bits on zero groups; every protobuf parser
    accepts such non-minimal varints). A length written this way is known in size before its value is."""
    if n >> (7 * width):
        raise ValueError(f"{n} does not fit a {width}-byte varint")
    return bytes((n >> (7 * i)) & 0x7F | (0x80 if i < width - 1 else 0) for i in range(width))


def tag(field: int, wire_type: int) -> bytes:
    return varint(field << 3 | wire_type)


def read_varint(buf: memoryview, pos: int, end: int, max_bytes: int = 10) -> tuple[int, int]:
    """(value, position after it); the value modulo 2**64, as upb reads a 10-byte varint. ``max_bytes``: 10 for
    a value, 5 for a tag or a length (upb refuses longer ones, non-minimal or not)."""
    value = 0
    shift = 0
    limit = min(end, pos + max_bytes)
    while True:
        if pos >= limit:
            raise WireError("truncated varint" if pos >= end else f"varint longer than {max_bytes} bytes")
        b = buf[pos]
        pos += 1
        value |= (b & 0x7F) << shift
        if b < 0x80:
            return value & 0xFFFFFFFFFFFFFFFF, pos
        shift += 7


def records(buf: memoryview, start: int, end: int) -> Iterator[tuple[int, int, int, int, int]]:
    """Each record of the message in ``buf[start:end]``: (field, wire type, value start, value end, record start).

    For LEN records the value is the payload (after its length); for VARINT the varint's bytes; for I64/I32
    the fixed bytes. Every value lies inside ``[start, end)``.
    """
    pos = start
    while pos < end:
        rec = pos
        key, pos = read_varint(buf, pos, end, 5)
        if key > 0xFFFFFFFF:
            raise WireError(f"tag {key} is larger than 32 bits")
        field, wire_type = key >> 3, key & 7
        if field == 0:
            raise WireError("field number 0")
        if wire_type == VARINT:
            vstart = pos
            _, pos = read_varint(buf, pos, end)
            yield field, wire_type, vstart, pos, rec
        elif wire_type == LEN:
            n, vstart = read_varint(buf, pos, end, 5)
            if n > end - vstart:
                raise WireError(f"field {field}: {n} bytes declared, {end - vstart} left in the message")
            pos = vstart + n
            yield field, wire_type, vstart, pos, rec
        elif wire_type in (I64, I32):
            width = 8 if wire_type == I64 else 4
            if pos + width > end:
                raise WireError(f"field {field}: truncated fixed-width value")
            yield field, wire_type, pos, pos + width, rec
            pos += width
        elif wire_type in (SGROUP, EGROUP):
            raise WireError(f"field {field}: groups are not supported")
        else:
            raise WireError(f"field {field}: invalid wire type {wire_type}")


__all__ = [
    "Buffer",
    "VARINT",
    "I64",
    "LEN",
    "I32",
    "FIXED_LEN_WIDTH",
    "WireError",
    "varint",
    "fixed_varint",
    "tag",
    "read_varint",
    "records",
]
