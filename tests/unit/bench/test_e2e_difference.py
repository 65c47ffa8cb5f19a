"""The demo's description of a mismatch between planes (``_e2e._difference``): what differs, where, by how much."""

from __future__ import annotations

import torch

from tensorwire.cli._measure import _difference


def test_identical_outputs_differ_in_no_byte() -> None:
    x = torch.randn(4, 8).to(torch.bfloat16)
    d = _difference([x, torch.zeros(0, 8)], [x.clone(), torch.zeros(0, 8)])
    assert d["items"] == 2 and [t["bytes_differing"] for t in d["tensors"]] == [0, 0]


def test_a_changed_element_is_located_and_measured() -> None:
    x = torch.arange(12, dtype=torch.float32).reshape(3, 4)
    y = x.clone()
    y[2, 1] = 100.0
    (t,) = _difference([x], [y])["tensors"]
    assert t["bytes_differing"] >= 1 and 9 * 4 <= t["first_byte"] <= t["last_byte"] < 10 * 4
    assert t["max_abs_diff"] == 91.0 and t["zeros_in"] == [1, 1]


def test_other_shapes_or_item_counts_are_reported_as_such() -> None:
    assert _difference([torch.ones(2)], []) == {"items": [1, 0]}
    (t,) = _difference([torch.ones(2, 3)], [torch.ones(3, 2)])["tensors"]
    assert t["shapes"] == [[2, 3], [3, 2]]
