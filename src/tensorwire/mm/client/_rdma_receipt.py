"""An RDMA receipt on the LLM side, as pure functions (no I/O, metrics or state), called in order:
``parse_slots``, ``lease_ids`` (what to release whatever happens), ``validate_slots``, the read (elsewhere),
``check_read``, ``assemble_output``.

Slot order is reassembly order: ``EMBEDDING`` chunks in row order, at most one ``POS_ID``, ``EXTRA_INPUT`` in item
order. Raises ``InvalidDescriptor``, ``ProtocolError``, ``InvalidPayload`` and
``ReadError`` (``RESULT_MISMATCH``), each with its reason.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from tensorwire.errors import InvalidPayload, ProtocolError, ReadError, Reason
from tensorwire.mm._proto import encoder_pb2 as pb
from tensorwire.mm._types import MultimodalOutput, Plane
from tensorwire.mm.wire import _codec

MAX_SLOTS_PER_RECEIPT = 4096

DescriptorParser = Callable[[bytes], Any]
"""parse(descriptor bytes) -> a ``tensorwire.rdma.Descriptor`` (validated), or raises ``InvalidDescriptor``."""


def parse_slots(receipt: pb.EncodeResponse, parse: DescriptorParser) -> list[Any]:
    """Each slot's descriptor, or the exception parsing it raised; parsed once per receipt (on a slow host a
    parse with its validation costs tens of microseconds). At most ``MAX_SLOTS_PER_RECEIPT`` slots."""
    out: list[Any] = []
    for slot in receipt.rdma_slots[:MAX_SLOTS_PER_RECEIPT]:
        try:
            out.append(parse(slot.descriptor))
        except Exception as exc:  # kept for validate_slots, which raises it
            out.append(exc)
    return out


def lease_ids(parsed: list[Any]) -> list[str]:
    """Every lease id that can be read out of the parsed slots (unparsable slots are left to the owner's GC)."""
    return [d.lease_id for d in parsed if not isinstance(d, BaseException) and d.lease_id]


def validate_slots(receipt: pb.EncodeResponse, parsed: list[Any]) -> tuple[list[Any], list[int]]:
    """(descriptors, one role per manifest tensor in slot order), or raises why the receipt cannot be read."""
    if len(receipt.rdma_slots) > MAX_SLOTS_PER_RECEIPT:
        raise ProtocolError(f"receipt has {len(receipt.rdma_slots)} slots, over {MAX_SLOTS_PER_RECEIPT}")
    if receipt.HasField("embedding") or receipt.HasField("position_ids") or len(receipt.extra_inputs):
        raise ProtocolError("RDMA receipt also carries inline tensors")
    descs: list[Any] = []
    roles: list[int] = []
    for i, (slot, desc) in enumerate(zip(receipt.rdma_slots, parsed, strict=True)):
        if isinstance(desc, BaseException):
            raise desc  # InvalidDescriptor with a reason
        if len(slot.roles) != len(desc.manifest):
            raise InvalidPayload(
                f"slot {i}: {len(slot.roles)} roles for {len(desc.manifest)} tensors", reason=Reason.ASSEMBLY_MISMATCH
            )
        for r in slot.roles:
            if r not in _codec.ROLE_LABELS:
                raise InvalidPayload(f"slot {i}: role {r} is unspecified or unknown", reason=Reason.ASSEMBLY_MISMATCH)
        descs.append(desc)
        roles.extend(slot.roles)
    return descs, roles


def check_read(descs: list[Any], roles: list[int], tensors: list[torch.Tensor]) -> None:
    """The reader returned one tensor per manifest entry, each with its manifest's shape and dtype."""
    metas = [m for d in descs for m in d.manifest]
    if len(tensors) != len(roles) or len(metas) != len(roles):
        raise ReadError(
            f"read returned {len(tensors)} tensors for {len(roles)} manifest entries", reason=Reason.RESULT_MISMATCH
        )
    for i, (t, m) in enumerate(zip(tensors, metas, strict=True)):
        if tuple(t.shape) != tuple(m.shape) or t.dtype != m.dtype:
            raise ReadError(
                f"tensor {i}: read {tuple(t.shape)} {t.dtype}, manifest says {tuple(m.shape)} {m.dtype}",
                reason=Reason.RESULT_MISMATCH,
            )


def role_bytes(tensors: list[torch.Tensor], roles: list[int]) -> dict[str, int]:
    """Bytes read per role label (for ``tensorwire_mm_bytes_total``)."""
    out: dict[str, int] = {}
    for t, role in zip(tensors, roles, strict=True):
        label = _codec.ROLE_LABELS[role]
        out[label] = out.get(label, 0) + t.numel() * t.element_size()
    return out


def assemble_output(
    tensors: list[torch.Tensor], roles: list[int], receipt: pb.EncodeResponse, plane: Plane = Plane.RDMA
) -> MultimodalOutput:
    """The RDMA (or placed) output: embedding chunks joined and split per item, position ids on the host, extras
    per item."""
    chunks: list[torch.Tensor] = []
    pos: torch.Tensor | None = None
    extras: list[torch.Tensor] = []
    nbytes = 0
    for t, role in zip(tensors, roles, strict=True):
        nbytes += t.numel() * t.element_size()
        if role == pb.EMBEDDING:
            chunks.append(t)
        elif role == pb.POS_ID:
            if pos is not None:
                raise InvalidPayload("receipt has more than one POS_ID tensor", reason=Reason.ASSEMBLY_MISMATCH)
            pos = t.cpu()  # position ids are consumed on the host (documented on MultimodalOutput)
        else:
            extras.append(t)
    if not chunks:
        raise InvalidPayload("RDMA receipt has no EMBEDDING tensor", reason=Reason.ASSEMBLY_MISMATCH)
    if len({(c.shape[1:], c.dtype) for c in chunks}) != 1:
        raise InvalidPayload("embedding chunks disagree in row shape or dtype", reason=Reason.ASSEMBLY_MISMATCH)
    embedding = chunks[0] if len(chunks) == 1 else torch.cat(chunks, 0)
    splits = [int(s) for s in receipt.split_sizes]
    embs, pos_parts, extra_list = _codec.split_per_item(embedding, splits, pos, extras)
    return MultimodalOutput(
        embeddings=embs,
        split_sizes=splits,
        position_ids=pos_parts,
        extra_inputs=extra_list,
        plane=plane,
        worker_id=receipt.worker.worker_id,
        payload_bytes=nbytes,
    )


def check_receipt(receipt: pb.EncodeResponse, parse: DescriptorParser) -> tuple[list[str], Exception | None]:
    """(lease ids, the first problem or None): every check a reader makes before it reads or decodes (slots,
    roles, reassembly layout from the manifests; inline dtypes, sizes and layout), reading no memory. For a hop
    in the middle (the proxy), which can ask another worker when a receipt is broken; the ids are what it must
    release on the worker that sent it."""
    if not receipt.rdma_slots:
        try:
            _codec.check_inline_receipt(receipt)
        except InvalidPayload as exc:
            return [], exc
        return [], None
    parsed = parse_slots(receipt, parse)
    ids = lease_ids(parsed)
    try:
        descs, roles = validate_slots(receipt, parsed)
        metas = [m for d in descs for m in d.manifest]
        emb = [m.shape for m, r in zip(metas, roles, strict=True) if r == pb.EMBEDDING]
        pos = [m.shape for m, r in zip(metas, roles, strict=True) if r == pb.POS_ID]
        if not emb or len(pos) > 1 or any(len(e) == 0 for e in emb):
            raise InvalidPayload(
                f"receipt has {len(emb)} embedding chunk(s) and {len(pos)} POS_ID tensor(s)",
                reason=Reason.ASSEMBLY_MISMATCH,
            )
        rows = (sum(int(e[0]) for e in emb), *emb[0][1:])
        _codec.check_layout(
            rows, receipt.split_sizes, pos[0] if pos else None, sum(1 for r in roles if r == pb.EXTRA_INPUT)
        )
    except Exception as exc:  # InvalidDescriptor, ProtocolError, InvalidPayload
        return ids, exc
    return ids, None


def encoder_stages(receipt: pb.EncodeResponse) -> dict[str, float]:
    """The encoder's own stage times, in ms, under ``encoder.<stage>``."""
    return {f"encoder.{k}": v / 1000.0 for k, v in receipt.encoder_stage_us.items()}


__all__ = [
    "MAX_SLOTS_PER_RECEIPT",
    "DescriptorParser",
    "parse_slots",
    "lease_ids",
    "validate_slots",
    "check_read",
    "role_bytes",
    "assemble_output",
    "check_receipt",
    "encoder_stages",
]
