"""What ``bench broadcast`` sends: the cases, their payloads, and the per-round marker every reader checks.

Cases (each back to back and again with a gap between messages):

* ``tensor``: one uint8 tensor of ``size_bytes`` (1 KiB, 64 KiB, 1 MiB by default);
* ``dict``: a dict of six tensors, a decode step's model inputs for 256 tokens of 64 requests (int64 token ids,
  positions and slot mapping, int32 sequence lengths and query start offsets, an int32 block table of 64 x 128
  blocks): 39,428 bytes in all;
* ``sched``: :class:`SchedulerStep`, a Python object shaped like vLLM's ``SchedulerOutput`` for one decode step of a
  64-request batch: 2 new requests (id, 512 prompt token ids, 32 block ids, sampling parameters), 62 running ones
  as parallel lists (ids, one new token id each, a new block for every 16th, computed-token counts), a dict of
  scheduled tokens per request id, an empty speculative-token dict, two finished request ids, multimodal hashes to
  free. It carries no tensors; it pickles to 8.8 KB (protocol 5).

Rank 0 stamps the round's counter into the value (:func:`mark`); readers rebuild the expected value and compare the
whole of what they received (:func:`matches`), outside the timed part.
"""

from __future__ import annotations

import dataclasses
from typing import Any

KINDS = ("tensor", "dict", "sched")


@dataclasses.dataclass(frozen=True)
class Case:
    kind: str  # one of KINDS
    size_bytes: int = 0  # tensor cases only
    gap_ms: float = 0.0  # rank 0 sleeps this long before each message

    @property
    def payload(self) -> str:
        return size_name(self.size_bytes) if self.kind == "tensor" else self.kind

    @property
    def name(self) -> str:
        return self.payload + (f"@{self.gap_ms:g}ms" if self.gap_ms else "")


def size_name(n: int) -> str:
    for unit, scale in (("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= scale and n % scale == 0:
            return f"{n // scale}{unit}"
    return f"{n}B"


@dataclasses.dataclass
class NewRequest:
    req_id: str
    prompt_token_ids: list[int]
    block_ids: list[int]
    sampling: dict[str, float]
    num_computed_tokens: int = 0


@dataclasses.dataclass
class CachedRequests:
    req_ids: list[str]
    new_token_ids: list[list[int]]
    new_block_ids: list[list[int] | None]
    num_computed_tokens: list[int]


@dataclasses.dataclass
class SchedulerStep:
    step: int
    new_reqs: list[NewRequest]
    cached: CachedRequests
    num_scheduled_tokens: dict[str, int]
    total_num_scheduled_tokens: int
    spec_decode_tokens: dict[str, list[int]]
    finished_req_ids: set[str]
    mm_hashes_to_free: list[str]


def _req_id(i: int) -> str:
    return f"cmpl-{i:08x}{'5eed' * 6}-0"  # vLLM's id shape: a prefix, 32 hex digits, the sample index


def scheduler_step(n_running: int = 62, n_new: int = 2, prompt_len: int = 512) -> SchedulerStep:
    new = [
        NewRequest(
            _req_id(1000 + k),
            [(k * 7919 + j * 104729) % 151936 for j in range(prompt_len)],
            list(range(k * 32, k * 32 + 32)),
            {"temperature": 0.7, "top_p": 0.95, "top_k": 50.0, "seed": float(k)},
        )
        for k in range(n_new)
    ]
    ids = [_req_id(i) for i in range(n_running)]
    cached = CachedRequests(
        ids,
        [[(i * 31337) % 151936] for i in range(n_running)],
        [[4096 + i] if i % 16 == 0 else None for i in range(n_running)],
        [700 + 13 * i for i in range(n_running)],
    )
    scheduled = {r.req_id: prompt_len for r in new} | {i: 1 for i in ids}
    return SchedulerStep(
        0,
        new,
        cached,
        scheduled,
        sum(scheduled.values()),
        {},
        {_req_id(5000), _req_id(5001)},
        [f"{k:064x}" for k in range(2)],
    )


def tensor_dict() -> dict[str, Any]:
    import torch

    g = torch.Generator().manual_seed(1)
    tokens, reqs = 256, 64
    return {
        "input_ids": torch.randint(0, 151936, (tokens,), generator=g, dtype=torch.int64),
        "positions": torch.arange(tokens, dtype=torch.int64),
        "slot_mapping": torch.randint(0, 1 << 20, (tokens,), generator=g, dtype=torch.int64),
        "seq_lens": torch.randint(1, 8192, (reqs,), generator=g, dtype=torch.int32),
        "query_start_loc": torch.arange(0, tokens + 1, tokens // reqs, dtype=torch.int32),
        "block_table": torch.randint(0, 1 << 16, (reqs, 128), generator=g, dtype=torch.int32),
    }


def build(case: Case) -> Any:
    """The case's value (rank 0 sends it; readers use it as the template and as the expected value)."""
    import torch

    if case.kind == "tensor":
        return torch.arange(case.size_bytes, dtype=torch.int64).remainder_(251).to(torch.uint8)
    if case.kind == "dict":
        return tensor_dict()
    if case.kind == "sched":
        return scheduler_step()
    raise ValueError(f"unknown case kind {case.kind!r}; expected one of {KINDS}")


def mark(case: Case, value: Any, counter: int) -> None:
    """Stamp round ``counter`` into ``value`` in place (so no reader can pass by replaying an old message)."""
    if case.kind == "tensor":
        value[0] = counter % 251
    elif case.kind == "dict":
        value["positions"][0] = counter
    else:
        value.step = counter


def matches(case: Case, got: Any, expected: Any) -> bool:
    """Whether a reader received exactly ``expected`` (already marked with the round)."""
    import torch

    if case.kind == "tensor":
        return isinstance(got, torch.Tensor) and got.dtype == expected.dtype and torch.equal(got, expected)
    if case.kind == "dict":
        return (
            isinstance(got, dict)
            and list(got) == list(expected)
            and all(got[k].dtype == v.dtype and torch.equal(got[k], v) for k, v in expected.items())
        )
    return bool(got == expected)


def payload_bytes(case: Case) -> int:
    """Bytes of tensor data (tensor, dict) or of the pickled object (sched), for the tables."""
    import pickle

    value = build(case)
    if case.kind == "tensor":
        return int(value.nbytes)
    if case.kind == "dict":
        return sum(int(t.nbytes) for t in value.values())
    return len(pickle.dumps(value, protocol=pickle.HIGHEST_PROTOCOL))
