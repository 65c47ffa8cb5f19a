"""The values business code hands to and gets from the transport."""

from __future__ import annotations

import enum
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import torch

from tensorwire.errors import InvalidPayload, Reason


class Plane(str, enum.Enum):
    """Which data plane delivered an output (values double as metric labels)."""

    RDMA = "rdma"
    INLINE = "inline"
    PLACED = "placed"  # written by the encoder into this process's receive buffer (same-host channel)


@dataclass(frozen=True)
class MultimodalInput:
    """One item of a request. A request is a sequence of them.

    data: the encoded item (for example JPEG bytes). kind: what it is ("image" by default). params:
    preprocessing parameters, forwarded to ``encode_fn`` unchanged. timeout_ms: this item's worker budget;
    ``<= 0`` means the configured ``worker_timeout_ms``.
    """

    data: bytes
    kind: str = "image"
    params: Mapping[str, str] = field(default_factory=dict)
    timeout_ms: int = 0


@dataclass
class EncoderOutput:
    """What ``encode_fn`` returns: per-item embeddings, optional position ids, optional extra inputs.

    Either ``embeddings`` is a list with one ``[rows_i, ...]`` tensor per item, or one tensor of all items
    concatenated along dim 0 together with ``split_sizes`` (rows per item). ``position_ids`` follows the same
    form and has one row per embedding row. ``extra_inputs`` is empty or holds one tensor per item.
    """

    embeddings: torch.Tensor | Sequence[torch.Tensor]
    split_sizes: Sequence[int] | None = None
    position_ids: torch.Tensor | Sequence[torch.Tensor] | None = None
    extra_inputs: Sequence[torch.Tensor] = ()

    def flatten(self) -> tuple[torch.Tensor | None, list[int], torch.Tensor | None, list[torch.Tensor]]:
        """(embedding, split_sizes, position_ids, extra_inputs) in wire form; checks the invariants.

        The embedding is None for an output with no items. Raises InvalidPayload on inconsistent output.
        """
        if isinstance(self.embeddings, torch.Tensor):
            emb = self.embeddings
            if emb.dim() < 1:
                raise InvalidPayload(
                    "embedding must have at least one dimension (rows)", reason=Reason.ASSEMBLY_MISMATCH
                )
            splits = [int(s) for s in self.split_sizes] if self.split_sizes is not None else [int(emb.shape[0])]
        else:
            items = list(self.embeddings)
            if not items:
                if self.position_ids is not None and not _is_empty_seq(self.position_ids):
                    raise InvalidPayload(
                        "position ids given for an output with no items", reason=Reason.ASSEMBLY_MISMATCH
                    )
                if self.extra_inputs:
                    raise InvalidPayload(
                        "extra inputs given for an output with no items", reason=Reason.ASSEMBLY_MISMATCH
                    )
                return None, [], None, []
            for t in items:
                if t.dim() < 1:
                    raise InvalidPayload(
                        "every item's embedding needs a row dimension", reason=Reason.ASSEMBLY_MISMATCH
                    )
            splits = [int(t.shape[0]) for t in items]
            if self.split_sizes is not None and [int(s) for s in self.split_sizes] != splits:
                raise InvalidPayload(
                    f"split_sizes {list(self.split_sizes)} disagree with the item rows {splits}",
                    reason=Reason.ASSEMBLY_MISMATCH,
                )
            emb = items[0] if len(items) == 1 else torch.cat(items, 0)
        if any(s < 0 for s in splits) or sum(splits) != emb.shape[0]:
            raise InvalidPayload(
                f"split_sizes {splits} (sum {sum(splits)}) do not cover the {emb.shape[0]} embedding rows",
                reason=Reason.ASSEMBLY_MISMATCH,
            )
        pos: torch.Tensor | None
        if self.position_ids is None:
            pos = None
        elif isinstance(self.position_ids, torch.Tensor):
            pos = self.position_ids
        else:
            parts = list(self.position_ids)
            pos = None if not parts else (parts[0] if len(parts) == 1 else torch.cat(parts, 0))
        if pos is not None and (pos.dim() < 1 or pos.shape[0] != sum(splits)):
            raise InvalidPayload(
                f"position ids have {pos.shape[0] if pos.dim() else 0} rows; the embedding has {sum(splits)}",
                reason=Reason.ASSEMBLY_MISMATCH,
            )
        extras = list(self.extra_inputs)
        if extras and len(extras) != len(splits):
            raise InvalidPayload(
                f"extra_input count {len(extras)} != item count {len(splits)}", reason=Reason.ASSEMBLY_MISMATCH
            )
        return emb, splits, pos, extras


def _is_empty_seq(x: torch.Tensor | Sequence[torch.Tensor]) -> bool:
    return not isinstance(x, torch.Tensor) and len(x) == 0


@dataclass
class MultimodalOutput:
    """What ``fetch`` returns: owning tensors, one embedding (and position ids, extra input) per item. Inline
    tensors from 64 KiB on view the received message (no copy), which nothing else holds; they may be written.

    plane: which plane delivered the tensors. fallback_reason: set when an RDMA attempt failed and the inline
    plane delivered instead. stage_ms: client-side stage times (``request``, ``read``, ``decode``, ``release``,
    ``fallback_request``, ``total``) plus the encoder's own (``encoder.encode``, ``encoder.export``,
    ``encoder.serialize``, and ``encoder.allocate``: the part of ``encoder.encode`` spent in ``allocate_output``).
    Position ids are on the host; embeddings and extra inputs stay on the device the plane delivered them to (the
    reader's device for RDMA, the host for inline).
    """

    embeddings: list[torch.Tensor]
    split_sizes: list[int]
    position_ids: list[torch.Tensor] | None
    extra_inputs: list[torch.Tensor]
    plane: Plane
    fallback_reason: Reason | None = None
    worker_id: str = ""
    stage_ms: dict[str, float] = field(default_factory=dict)
    payload_bytes: int = 0


__all__ = ["Plane", "MultimodalInput", "EncoderOutput", "MultimodalOutput"]
