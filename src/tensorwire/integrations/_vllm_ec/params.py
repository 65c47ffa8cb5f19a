"""The ``ec_transfer_params`` schema: what an encoder instance tells an LLM instance about each item.

vLLM returns a producer's ``request_finished`` params as the response's ``ec_transfer_params`` and passes a
consumer request's ``ec_transfer_params`` (``SamplingParams.extra_args["ec_transfer_params"]``, or the
OpenAI-compatible field) to its connector. vLLM's own convention keys the dict by ``mm_hash`` and puts
``item_indices`` and placeholder ``metadata`` in each entry; tensorwire adds one namespaced entry beside them::

    {"<mm_hash>": {"item_indices": [0], "metadata": {...},
                   "tensorwire": {"v": 1, "endpoint": "10.0.0.5:41234", "key": "<mm_hash>",
                                  "secret": "<32+ hex chars>", "shape": [576, 4096], "dtype": "bfloat16",
                                  "ttl_ms": 60000, "compat": "<64 hex chars>", "receipt": "<base64>"}}}

``endpoint``: the encoder instance's HeldOutputs gRPC service (``host:port``); ``key``: the store key (the
mm_hash); ``secret``: the item's grant (>= 128 random bits, hex): lookup and release need it, so whoever holds
the params holds the lease; ``shape``/``dtype``: what the encoder will hand out (the
LLM instance checks the item against them and against its own placeholder count before reading);
``ttl_ms``: how long the encoder keeps an unreleased item; ``compat``: the encoder instance's compatibility hash
(``trust.compat_hash``: vLLM version, model, dtype, this schema's version), which the LLM instance compares with
its own before anything is read; ``receipt`` (optional): the item's slot descriptor (``receipts.announceable``:
no metadata token), so that the LLM instance can read at once without a Lookup (it does so only from owners it
met through a Lookup; without a receipt, or when the read fails, it looks the item up). The params come from a
client: everything is validated (:func:`parse_entry`) and a malformed entry is treated as "not available", never
trusted.
"""

from __future__ import annotations

import base64
import binascii
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from tensorwire.errors import InvalidPayload, Reason

NAMESPACE = "tensorwire"
VERSION = 1
DTYPES = ("float32", "float16", "bfloat16", "float64", "int64", "int32", "int16", "int8", "uint8", "bool")
_HEX = re.compile(r"^[0-9a-f]{32,512}$")
_COMPAT = re.compile(r"^[0-9a-f]{16,128}$")
_HOST_PORT = re.compile(r"^(\[[0-9A-Fa-f:.]+\]|[A-Za-z0-9_.-]+):(\d{1,5})$")
MAX_DIMS = 8
MAX_RECEIPT_CHARS = 22000  # base64 of receipts.MAX_RECEIPT_BYTES (16 KiB), rounded up


@dataclass(frozen=True)
class ItemGrant:
    """One item's entry: where it is held, the grant to present, and what it must look like."""

    endpoint: str
    key: str
    secret: bytes
    shape: tuple[int, ...] | None = None
    dtype: str | None = None
    ttl_ms: int = 0
    compat: str | None = None
    receipt: bytes | None = None  # the slot descriptor(s) as announced (no metadata token), if any

    @property
    def grant_id(self) -> tuple[str, str, bytes]:
        return (self.endpoint, self.key, self.secret)

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {"v": VERSION, "endpoint": self.endpoint, "key": self.key, "secret": self.secret.hex()}
        if self.shape is not None:
            out["shape"] = list(self.shape)
        if self.dtype is not None:
            out["dtype"] = self.dtype
        if self.ttl_ms:
            out["ttl_ms"] = int(self.ttl_ms)
        if self.compat is not None:
            out["compat"] = self.compat
        if self.receipt is not None:
            out["receipt"] = base64.b64encode(self.receipt).decode("ascii")
        return out

    def __repr__(self) -> str:  # never print the secret
        return (
            f"ItemGrant(endpoint={self.endpoint!r}, key={self.key[:16]!r}..., shape={self.shape}, dtype={self.dtype})"
        )


def entry_for(grant: ItemGrant, vllm_entry: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """The params entry of one item: vLLM's own fields (if any) plus the tensorwire namespace."""
    entry = dict(vllm_entry or {})
    entry[NAMESPACE] = grant.to_json()
    return entry


def parse_entry(mm_hash: str, entry: Any) -> ItemGrant | None:
    """The tensorwire grant in one params entry; None when the entry has no tensorwire namespace (another
    connector's), InvalidPayload when it has one that is malformed."""
    if not isinstance(entry, Mapping) or NAMESPACE not in entry:
        return None
    tw = entry[NAMESPACE]
    if not isinstance(tw, Mapping):
        raise _bad(mm_hash, "the tensorwire entry is not an object")
    if tw.get("v") != VERSION:
        raise _bad(mm_hash, f"version {tw.get('v')!r} is not {VERSION}", Reason.INCOMPATIBLE)
    endpoint, key, secret = tw.get("endpoint"), tw.get("key"), tw.get("secret")
    if (
        not isinstance(endpoint, str)
        or not _HOST_PORT.match(endpoint)
        or not 0 < int(endpoint.rsplit(":", 1)[1]) < 65536
    ):
        raise _bad(mm_hash, f"endpoint {str(endpoint)[:80]!r} is not host:port")
    if key != mm_hash:
        raise _bad(mm_hash, "key does not match the entry's mm_hash")
    if not isinstance(secret, str) or not _HEX.match(secret) or len(secret) % 2:
        raise _bad(mm_hash, "secret is not 32..512 lower-case hex characters")
    shape = tw.get("shape")
    if shape is not None:
        if (
            not isinstance(shape, list)
            or not 0 < len(shape) <= MAX_DIMS
            or not all(isinstance(d, int) and not isinstance(d, bool) and 0 <= d < 2**40 for d in shape)
        ):
            raise _bad(mm_hash, f"shape {str(shape)[:80]} is not a list of 1..{MAX_DIMS} non-negative integers")
        shape = tuple(shape)
    dtype = tw.get("dtype")
    if dtype is not None and dtype not in DTYPES:
        raise _bad(mm_hash, f"dtype {str(dtype)[:40]!r} is not one of {DTYPES}")
    ttl = tw.get("ttl_ms", 0)
    if not isinstance(ttl, int) or isinstance(ttl, bool) or ttl < 0:
        raise _bad(mm_hash, "ttl_ms is not a non-negative integer")
    compat = tw.get("compat")
    if compat is not None and (not isinstance(compat, str) or not _COMPAT.match(compat)):
        raise _bad(mm_hash, "compat is not 16..128 lower-case hex characters")
    receipt = tw.get("receipt")
    if receipt is not None:
        if not isinstance(receipt, str) or not 0 < len(receipt) <= MAX_RECEIPT_CHARS:
            raise _bad(mm_hash, f"receipt is not a base64 string of at most {MAX_RECEIPT_CHARS} characters")
        try:
            receipt = base64.b64decode(receipt, validate=True)
        except (binascii.Error, ValueError):
            raise _bad(mm_hash, "receipt is not base64") from None
    return ItemGrant(endpoint, key, bytes.fromhex(secret), shape, dtype, ttl, compat, receipt)


def parse_params(params: Any) -> dict[str, ItemGrant | InvalidPayload]:
    """Every tensorwire entry of a request's ``ec_transfer_params``, keyed by mm_hash (malformed ones as the
    InvalidPayload that says why). Entries of other connectors are skipped."""
    out: dict[str, ItemGrant | InvalidPayload] = {}
    if not isinstance(params, Mapping):
        return out
    for mm_hash, entry in params.items():
        if not isinstance(mm_hash, str):
            continue
        try:
            grant = parse_entry(mm_hash, entry)
        except InvalidPayload as exc:
            out[mm_hash] = exc
            continue
        if grant is not None:
            out[mm_hash] = grant
    return out


def _bad(mm_hash: str, why: str, reason: Reason = Reason.INVALID_REQUEST) -> InvalidPayload:
    return InvalidPayload(f"ec_transfer_params[{mm_hash[:64]!r}]: {why}", reason=reason)


__all__ = ["ItemGrant", "entry_for", "parse_entry", "parse_params", "NAMESPACE", "VERSION", "DTYPES"]
