"""The typed codec behind ``broadcast_object(obj, schema=T)``: msgpack through msgspec, decoded straight into ``T``.

Why a second codec next to pickle: almost all of a broadcast's latency is the serializer, and msgspec encodes
and decodes a dataclass tree faster than pickle (``docs/broadcaster.md``). Readers decode into a declared type,
so nothing rank 0 sends can run code on a reader: a frame that does not fit ``T`` is a ``FrameMismatch``.

What it costs the caller: every rank names the same ``schema``, and the value must be something msgspec can encode
(dataclasses, ``msgspec.Struct``, ``TypedDict``/``NamedTuple``, builtin containers and scalars, enums, datetimes,
UUIDs...; not tensors or arbitrary classes: those keep using pickle). The payload starts with an 8-byte fingerprint
of the schema's name, so ranks that named different schemas fail loudly instead of decoding one type as another
of the same shape.

msgspec is an optional dependency (``tensorwire[typed]``; vLLM already depends on it); without it ``schema=``
raises ``BroadcastError`` (``INVALID_CONFIG``) saying so, and pickle still works.
"""

from __future__ import annotations

import hashlib
from typing import Any

from tensorwire.errors import BroadcastError, FrameMismatch, Reason

FINGERPRINT_BYTES = 8


class Codec:
    """One schema's encoder and decoder (msgspec builds them once per type; they are reused for every message)."""

    __slots__ = ("schema", "name", "fingerprint", "_cls", "_enc", "_dec")

    def __init__(self, schema: Any) -> None:
        try:
            import msgspec
        except ImportError as exc:
            raise BroadcastError(
                "broadcast_object(schema=...) needs msgspec (pip install 'tensorwire[typed]'); "
                "without a schema the object is pickled",
                reason=Reason.INVALID_CONFIG,
            ) from exc
        self.schema = schema
        self.name = _name_of(schema)
        self.fingerprint = hashlib.blake2b(self.name.encode(), digest_size=FINGERPRINT_BYTES).digest()
        # A class schema is checked on rank 0 (cheap, and it keeps the group in step); a generic alias such as
        # list[int] is left to the readers' decode.
        self._cls = schema if isinstance(schema, type) else None
        try:
            self._enc = msgspec.msgpack.Encoder()
            self._dec = msgspec.msgpack.Decoder(schema)
        except TypeError as exc:  # msgspec cannot build a decoder for this type
            raise BroadcastError(
                f"broadcast_object: schema {self.name} is not a type msgspec can decode: {exc}",
                reason=Reason.INVALID_CONFIG,
            ) from exc

    def encode(self, obj: Any, rank: int) -> bytes:
        """fingerprint + msgpack of ``obj``; ``BroadcastError`` (``INVALID_CONFIG``) when it is not a ``schema``
        instance or cannot be encoded."""
        if self._cls is not None and not isinstance(obj, self._cls):
            raise BroadcastError(
                f"rank {rank}: broadcast_object(schema={self.name}) got a value of type {type(obj).__name__}",
                reason=Reason.INVALID_CONFIG,
            )
        try:
            return self.fingerprint + self._enc.encode(obj)
        except Exception as exc:  # msgspec raises TypeError / EncodeError / OverflowError, user hooks anything
            raise BroadcastError(
                f"rank {rank}: broadcast_object cannot encode the {type(obj).__name__} as {self.name}: {exc}",
                reason=Reason.INVALID_CONFIG,
            ) from exc

    def decode(self, payload: memoryview, rank: int, seq: int) -> Any:
        """The object in ``payload`` (a view into the transport, read once and not kept); ``FrameMismatch`` when
        rank 0 named another schema or the bytes do not decode into this one."""
        if bytes(payload[:FINGERPRINT_BYTES]) != self.fingerprint:
            raise FrameMismatch(
                f"rank {rank}: message {seq} was encoded with another schema than {self.name}; "
                f"every rank must pass the same schema to broadcast_object"
            )
        # A copy, not the view: msgspec may hand out views into its input (memoryview / Raw fields), and the ring
        # slot is reused once this call returns. 8.8 KB is well under a microsecond.
        data = bytes(payload[FINGERPRINT_BYTES:])
        try:
            return self._dec.decode(data)
        except Exception as exc:  # ValidationError / DecodeError, or a dec_hook-free type's own __post_init__
            raise FrameMismatch(
                f"rank {rank}: message {seq} does not decode as {self.name}: {type(exc).__name__}: {exc}"
            ) from exc


def _name_of(schema: Any) -> str:
    if isinstance(schema, type):
        return f"{schema.__module__}.{schema.__qualname__}"
    return repr(schema)  # list[int], dict[str, Foo], a Union...: their repr names their parts
