"""Receipt corruptions the transport must detect: each one breaks a rule the client or the rdma layer checks.

The control plane has no integrity protection of its own; a rewrite into another valid-looking receipt is
prevented only by TLS (docs/reliability.md). So the soak injects only the corruptions the protocol promises to
catch.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from typing import cast

from tensorwire.mm._proto import encoder_pb2 as pb
from tensorwire.rdma._proto import descriptor_pb2 as dpb

Mutator = Callable[[pb.EncodeResponse, random.Random], bool]


def _desc_mutation(fn: Callable[[dpb.DescriptorPB, random.Random], None]) -> Mutator:
    def mutate(resp: pb.EncodeResponse, rng: random.Random) -> bool:
        if not resp.rdma_slots:
            return False
        slot = resp.rdma_slots[rng.randrange(len(resp.rdma_slots))]
        d = dpb.DescriptorPB.FromString(slot.descriptor)
        fn(d, rng)
        slot.descriptor = d.SerializeToString()
        return True

    return mutate


def _set_manifest(d: dpb.DescriptorPB, rng: random.Random, what: str) -> None:
    m = d.manifest[rng.randrange(len(d.manifest))]
    if what == "dtype":
        m.dtype = dpb.DTYPE_UNSPECIFIED  # both numberings: a reader falls back to the legacy field alone
        m.legacy_dtype = dpb.LEGACY_DTYPE_UNSPECIFIED
    elif what == "nbytes":
        m.nbytes = m.nbytes + rng.choice((-1, 1, 8, 4096))
    elif what == "offset":
        m.offset = m.offset + rng.choice((1, 3, 7))
    elif what == "shape":
        if m.shape:
            m.shape[0] = m.shape[0] + rng.choice((1, 2))
    elif what == "negative":
        if m.shape:
            m.shape[0] = -1


def _truncate_desc(resp: pb.EncodeResponse, rng: random.Random) -> bool:
    if not resp.rdma_slots:
        return False
    slot = resp.rdma_slots[rng.randrange(len(resp.rdma_slots))]
    slot.descriptor = slot.descriptor[: rng.randrange(max(1, len(slot.descriptor) // 2))] + b"\xff\xff"
    return True


def _garbage_desc(resp: pb.EncodeResponse, rng: random.Random) -> bool:
    if not resp.rdma_slots:
        return False
    slot = resp.rdma_slots[rng.randrange(len(resp.rdma_slots))]
    slot.descriptor = rng.randbytes(rng.randrange(1, 64))
    return True


def _roles(resp: pb.EncodeResponse, rng: random.Random) -> bool:
    if not resp.rdma_slots:
        return False
    slot = resp.rdma_slots[rng.randrange(len(resp.rdma_slots))]
    if rng.random() < 0.5:
        slot.roles.append(pb.EMBEDDING)
    else:
        slot.roles[0] = pb.ROLE_UNSPECIFIED
    return True


def _splits(resp: pb.EncodeResponse, rng: random.Random) -> bool:
    if not resp.split_sizes:
        return False
    resp.split_sizes[rng.randrange(len(resp.split_sizes))] += rng.choice((1, -1, 1000))
    return True


def _inline_shape(resp: pb.EncodeResponse, rng: random.Random) -> bool:
    if not resp.HasField("embedding") or not resp.embedding.shape:
        return False
    resp.embedding.shape[-1] += rng.choice((1, -1))
    return True


def _inline_dtype(resp: pb.EncodeResponse, rng: random.Random) -> bool:
    if not resp.HasField("embedding"):
        return False
    resp.embedding.dtype = rng.choice((pb.DTYPE_UNSPECIFIED, cast(pb.DType, 99)))  # 99: no such enum value
    return True


def _inline_truncate(resp: pb.EncodeResponse, rng: random.Random) -> bool:
    if not resp.HasField("embedding") or not resp.embedding.data:
        return False
    resp.embedding.data = resp.embedding.data[: len(resp.embedding.data) - rng.randrange(1, 9)]
    return True


def _generation(d: dpb.DescriptorPB, rng: random.Random) -> None:
    d.generation = d.generation + rng.randrange(1, 1 << 20)  # read succeeds, the generation check must not


def _owner_port(d: dpb.DescriptorPB, rng: random.Random) -> None:
    d.owner.port = 1 if d.owner.port != 1 else 2  # nothing listens there: metadata fetch must fail cleanly


def _agent_name(d: dpb.DescriptorPB, rng: random.Random) -> None:
    d.owner.agent_name = d.owner.agent_name + "-x"  # must not match the metadata fetched from the owner


def _version(d: dpb.DescriptorPB, rng: random.Random) -> None:
    d.version = d.version + 1


def _payload(d: dpb.DescriptorPB, rng: random.Random) -> None:
    d.payload_bytes = (1 << 62) + rng.randrange(1 << 20)


# name -> mutator; every one must end in a typed error or a counted fallback, never in a delivered output.
MUTATORS: dict[str, Mutator] = {
    "desc_truncated": _truncate_desc,
    "desc_garbage": _garbage_desc,
    "desc_dtype": _desc_mutation(lambda d, r: _set_manifest(d, r, "dtype")),
    "desc_nbytes": _desc_mutation(lambda d, r: _set_manifest(d, r, "nbytes")),
    "desc_offset": _desc_mutation(lambda d, r: _set_manifest(d, r, "offset")),
    "desc_shape": _desc_mutation(lambda d, r: _set_manifest(d, r, "shape")),
    "desc_negative_dim": _desc_mutation(lambda d, r: _set_manifest(d, r, "negative")),
    "desc_generation": _desc_mutation(_generation),
    "desc_owner_port": _desc_mutation(_owner_port),
    "desc_agent_name": _desc_mutation(_agent_name),
    "desc_version": _desc_mutation(_version),
    "desc_payload_bytes": _desc_mutation(_payload),
    "slot_roles": _roles,
    "split_sizes": _splits,
    "inline_shape": _inline_shape,
    "inline_dtype": _inline_dtype,
    "inline_truncated": _inline_truncate,
}


def corrupt_receipt(raw: bytes, rng: random.Random) -> tuple[bytes, str | None]:
    """A corrupted copy of an EncodeResponse and the mutation's name (None when none applied)."""
    try:
        resp = pb.EncodeResponse.FromString(raw)
    except Exception:
        return raw, None
    names = list(MUTATORS)
    rng.shuffle(names)
    for name in names:
        if MUTATORS[name](resp, rng):
            return resp.SerializeToString(), name
    return raw, None


__all__ = ["MUTATORS", "corrupt_receipt"]
