"""Byte-level mutations for the fuzzers: flips, sets, truncations, insertions, splices, random bytes."""

from __future__ import annotations

import random
from collections.abc import Sequence
from typing import Any

from google.protobuf.message import Message

INTERESTING = (
    b"\x00",
    b"\xff",
    b"\x7f",
    b"\x80",
    b"\xff\xff\xff\xff\xff\xff\xff\xff\x01",
    b"\x80\x80\x80\x80\x80\x80\x80\x80\x80\x01",
    b"\x08\x00",
    b"\x12\x00",
)


def mutate(data: bytes, rng: random.Random, corpus: Sequence[bytes] = ()) -> bytes:
    """One to four stacked mutations of ``data``."""
    buf = bytearray(data)
    for _ in range(rng.randint(1, 4)):
        op = rng.randrange(8)
        n = len(buf)
        if op == 0 and n:  # bit flip
            i = rng.randrange(n)
            buf[i] ^= 1 << rng.randrange(8)
        elif op == 1 and n:  # byte set
            buf[rng.randrange(n)] = rng.randrange(256)
        elif op == 2 and n:  # truncate
            del buf[rng.randrange(n) :]
        elif op == 3:  # insert an interesting run (varints, lengths)
            i = rng.randrange(n + 1)
            buf[i:i] = rng.choice(INTERESTING)
        elif op == 4 and n > 1:  # delete a range
            i = rng.randrange(n)
            del buf[i : i + rng.randint(1, 16)]
        elif op == 5 and corpus:  # splice with another seed
            other = rng.choice(corpus)
            i, j = rng.randrange(n + 1), rng.randrange(len(other) + 1)
            buf = buf[:i] + bytearray(other[j:])
        elif op == 6 and n:  # duplicate a chunk (repeated fields)
            i = rng.randrange(n)
            buf[i:i] = buf[i : i + rng.randint(1, 32)]
        else:  # random bytes
            i = rng.randrange(n + 1)
            buf[i:i] = rng.randbytes(rng.randint(1, 16))
    return bytes(buf)


def random_bytes(rng: random.Random, max_len: int = 256) -> bytes:
    return rng.randbytes(rng.randint(0, max_len))


_EDGE_INTS = (0, 1, -1, 2**31 - 1, -(2**31), 2**63 - 1, -(2**63), 4095, 4097, 2**40)
_EDGE_UINTS = (0, 1, 2**32 - 1, 2**63, 2**64 - 1, 4095, 4097, 2**40)


def mutate_message(msg: Any, rng: random.Random, depth: int = 0) -> bool:
    """Sets one field somewhere in a protobuf message to an edge value; True when something changed.

    Byte-level mutation mostly yields bytes that do not parse; this reaches the validators behind the parser.
    """
    from google.protobuf.descriptor import FieldDescriptor as F

    fields = list(msg.DESCRIPTOR.fields)
    if not fields:
        return False
    f = rng.choice(fields)
    repeated = bool(f.is_repeated) if hasattr(f, "is_repeated") else f.label == F.LABEL_REPEATED
    if f.type == F.TYPE_MESSAGE:
        if f.message_type.GetOptions().map_entry:
            getattr(msg, f.name)[rng.choice(("", "x" * 300, "k"))] = (
                rng.choice(("", "v"))
                if f.message_type.fields_by_name["value"].type == F.TYPE_STRING
                else rng.choice(_EDGE_INTS)
            )
            return True
        if repeated:
            items = getattr(msg, f.name)
            if items and rng.random() < 0.7:
                return mutate_message(items[rng.randrange(len(items))], rng, depth + 1)
            if items and rng.random() < 0.5:
                del items[rng.randrange(len(items))]
                return True
            return mutate_message(items.add(), rng, depth + 1) if depth < 4 else False
        if rng.random() < 0.2:
            msg.ClearField(f.name)
            return True
        return mutate_message(getattr(msg, f.name), rng, depth + 1) if depth < 4 else False
    if f.type in (F.TYPE_INT64, F.TYPE_INT32, F.TYPE_SINT64, F.TYPE_SFIXED64):
        lim = 2**31 if f.type == F.TYPE_INT32 else 2**63
        value: Any = max(-lim, min(lim - 1, rng.choice(_EDGE_INTS)))
    elif f.type in (F.TYPE_UINT64, F.TYPE_UINT32, F.TYPE_FIXED64):
        lim = 2**32 if f.type == F.TYPE_UINT32 else 2**64
        value = min(lim - 1, rng.choice(_EDGE_UINTS))
    elif f.type == F.TYPE_ENUM:
        value = rng.choice([v.number for v in f.enum_type.values] + [99, -1])
    elif f.type == F.TYPE_BOOL:
        value = rng.random() < 0.5
    elif f.type == F.TYPE_STRING:
        value = rng.choice(("", "x" * rng.randint(1, 400), "\u00e9\u4e2d", "a:b", "127.0.0.1"))
    elif f.type == F.TYPE_BYTES:
        value = rng.randbytes(rng.randint(0, 64))
    else:
        return False
    if repeated:
        items = getattr(msg, f.name)
        if items and rng.random() < 0.6:
            items[rng.randrange(len(items))] = value
        elif items and rng.random() < 0.5:
            del items[rng.randrange(len(items))]
        else:
            items.append(value)
    else:
        setattr(msg, f.name, value)
    return True


def mutate_proto(data: bytes, cls: type[Message], rng: random.Random) -> bytes:
    """Parse ``data`` as ``cls``, apply 1-3 field mutations, serialize; falls back to byte mutation."""
    try:
        msg = cls.FromString(data)
    except Exception:  # not a parseable seed: byte-level instead
        return mutate(data, rng)
    for _ in range(rng.randint(1, 3)):
        mutate_message(msg, rng)
    return msg.SerializeToString()


__all__ = ["mutate", "mutate_message", "mutate_proto", "random_bytes"]
