from __future__ import annotations

import pytest
import torch

from tensorwire.errors import ExportError, InvalidPayload, Reason
from tensorwire.mm import EncoderOutput
from tensorwire.mm._proto import encoder_pb2 as pb
from tensorwire.mm.server._output import plan_slots


def footprint(tensors: list[torch.Tensor], align: int) -> int:
    return sum(-(-t.numel() * t.element_size() // align) * align for t in tensors)


@pytest.mark.parametrize("rows,cols,max_slot", [(100, 64, 8192), (37, 100, 4096 * 3), (5, 1024, 4096), (1, 8, 4096)])
def test_plan_splits_whole_rows_under_the_cap(rows: int, cols: int, max_slot: int) -> None:
    emb = torch.randn(rows, cols)
    pos = torch.arange(rows * 3).reshape(rows, 3)
    extras = [torch.ones(7), torch.zeros(2, 2)]
    groups = plan_slots(emb, pos, extras, max_slot, 4096)
    for tensors, roles in groups:
        assert footprint(tensors, 4096) <= max_slot
        assert len(tensors) == len(roles)
    flat_roles = [r for _, rs in groups for r in rs]
    n_emb = flat_roles.count(pb.EMBEDDING)
    # embedding chunks first, in row order, then POS_ID, then extras in order
    assert flat_roles == [pb.EMBEDDING] * n_emb + [pb.POS_ID, pb.EXTRA_INPUT, pb.EXTRA_INPUT]
    chunks = [t for ts, rs in groups for t, r in zip(ts, rs, strict=True) if r == pb.EMBEDDING]
    assert torch.equal(torch.cat(chunks), emb)
    assert all(c.is_contiguous() for c in chunks)


def test_plan_rejects_rows_or_tensors_that_cannot_fit() -> None:
    with pytest.raises(ExportError) as ei:
        plan_slots(torch.zeros(4, 2048), None, [], 4096, 4096)  # one row is 8 KiB
    assert ei.value.reason is Reason.SLOT_TOO_LARGE
    with pytest.raises(ExportError) as ei:
        plan_slots(torch.zeros(4, 4), torch.zeros(2000, 4), [], 4096, 4096)
    assert ei.value.reason is Reason.SLOT_TOO_LARGE
    with pytest.raises(ExportError):
        plan_slots(torch.zeros(0, 4), None, [], 4096, 4096)


def test_encoder_output_forms_and_invariants() -> None:
    a, b = torch.randn(2, 4), torch.randn(3, 4)
    emb, splits, pos, extras = EncoderOutput(embeddings=[a, b]).flatten()
    assert emb is not None and splits == [2, 3] and torch.equal(emb, torch.cat([a, b])) and pos is None
    emb, splits, _, _ = EncoderOutput(embeddings=torch.cat([a, b]), split_sizes=[4, 1]).flatten()
    assert splits == [4, 1]
    emb, splits, _, _ = EncoderOutput(embeddings=a).flatten()
    assert splits == [2]
    assert EncoderOutput(embeddings=[]).flatten() == (None, [], None, [])
    with pytest.raises(InvalidPayload, match="split_sizes"):
        EncoderOutput(embeddings=torch.cat([a, b]), split_sizes=[2, 2]).flatten()
    with pytest.raises(InvalidPayload, match="position ids"):
        EncoderOutput(embeddings=[a, b], position_ids=torch.zeros(4, 1)).flatten()
    with pytest.raises(InvalidPayload, match="extra_input count"):
        EncoderOutput(embeddings=[a, b], extra_inputs=[torch.ones(1)]).flatten()
    with pytest.raises(InvalidPayload):
        EncoderOutput(embeddings=torch.tensor(1.0)).flatten()
    _, _, pos, _ = EncoderOutput(embeddings=[a, b], position_ids=[torch.zeros(2, 3), torch.ones(3, 3)]).flatten()
    assert pos is not None and pos.shape == (5, 3)
