"""SlotPool and GenerationTable against a recording fake provider (registration bookkeeping only)."""

from __future__ import annotations

import pytest
from _rdma_fake import FakeProvider

from tensorwire.errors import ExportError, PoolExhausted, Reason
from tensorwire.rdma import RdmaConfig
from tensorwire.rdma._pool import MIN_BUCKET_BYTES, GenerationTable, SlotPool, bucket_bytes

KIB, MIB = 1024, 1024 * 1024


def make(cap: int = 64 * KIB, max_slot: int = 64 * KIB) -> tuple[FakeProvider, GenerationTable, SlotPool]:
    cfg = RdmaConfig(provider="none", pool_cap_bytes=cap, max_slot_bytes=max_slot)
    prov = FakeProvider(cfg, role="exporter")
    gens = GenerationTable(prov, words=64)
    return prov, gens, SlotPool(prov, cfg, generations=gens)


def test_buckets() -> None:
    assert bucket_bytes(1, 1 << 30) == MIN_BUCKET_BYTES
    assert bucket_bytes(4097, 1 << 30) == 8192
    assert bucket_bytes(256 * MIB, 1 << 30) == 256 * MIB
    assert bucket_bytes(700 * MIB, 1 << 30) == 1 << 30
    assert bucket_bytes(3 * MIB, 3 * MIB) == 3 * MIB  # top bucket is max_slot_bytes itself


def test_release_keeps_registration_and_reuses() -> None:
    prov, gens, pool = make()
    s = pool.acquire(5000)
    assert s.nbytes == 8192 and s.busy
    registered = len(prov.events)
    pool.release(s)
    assert not s.busy
    again = pool.acquire(6000)
    assert again is s
    assert len(prov.events) == registered  # no deregister/register on reuse
    st = pool.stats()
    assert st.slot_reuses == 1 and st.busy_slots == 1 and st.pool_bytes == 8192


def test_generation_bumps_on_release_and_never_repeats() -> None:
    prov, gens, pool = make()
    s = pool.acquire(100)
    seen = {gens.current(s.gen_index)}
    for _ in range(5):
        pool.release(s)
        v = gens.current(s.gen_index)
        assert v not in seen
        seen.add(v)
        assert pool.acquire(100) is s
    # A retired word handed to a new slot still never shows an old value.
    pool.release(s)
    pool.shrink(1.0)
    s2 = pool.acquire(100)
    assert gens.current(s2.gen_index) not in seen


def test_generations_are_unguessable() -> None:
    # A descriptor forged from a guessed slot address must fail the reader's generation check: the values are
    # random 63-bit numbers, not a counter a peer could predict from one descriptor it was given.
    prov, gens, pool = make()
    s = pool.acquire(100)
    values = []
    for _ in range(200):
        pool.release(s)
        values.append(gens.current(s.gen_index))
        assert pool.acquire(100) is s
    assert len(set(values)) == len(values)
    assert all(0 < v < 2**63 for v in values)
    steps = {b - a for a, b in zip(values, values[1:], strict=False)}
    assert len(steps) > 100  # no fixed stride
    assert max(values) > 2**60  # spread over the whole range, not a small counter


def test_cap_triggers_shrink_half_then_all_then_exhausted() -> None:
    prov, gens, pool = make(cap=64 * KIB, max_slot=64 * KIB)
    small = [pool.acquire(4 * KIB) for _ in range(8)]  # 32 KiB in 8 slots
    for s in small:
        pool.release(s)
    assert pool.stats().idle_slots == 8
    big = pool.acquire(32 * KIB)  # 32 + 32 = cap: fits without shrinking
    assert pool.stats().shrinks == 0
    pool.release(big)
    # 64 KiB needs everything idle gone: the 50% shrink is not enough, the full shrink is.
    huge = pool.acquire(64 * KIB)
    st = pool.stats()
    assert st.shrinks == 2 and st.idle_slots == 0 and st.pool_bytes == 64 * KIB
    assert huge.busy
    with pytest.raises(PoolExhausted) as info:
        pool.acquire(4 * KIB)
    assert info.value.reason is Reason.POOL_EXHAUSTED
    assert "pool_cap_bytes" in str(info.value)
    assert huge.busy and huge.tensor.numel() == 64 * KIB  # the busy slot was never touched
    assert pool.stats().pool_exhausted == 1


def test_a_shrunk_slot_keeps_no_reference_to_its_memory() -> None:
    import torch

    from tensorwire.rdma._descriptor import layout, views

    prov, gens, pool = make()
    s = pool.acquire(4 * KIB)
    manifest, _ = layout([((16,), torch.float32), ((8,), torch.int64)], 8)
    views(s.tensor, manifest, s.typed)  # caches per-dtype reinterpretations of the slot
    assert set(s.typed) == {torch.float32, torch.int64}
    pool.release(s)
    pool.shrink(1.0)
    assert s.typed == {} and s.tensor.numel() == 0  # nothing left that would keep the freed buffer alive


def test_half_shrink_suffices_when_it_can() -> None:
    prov, gens, pool = make(cap=64 * KIB)
    slots = [pool.acquire(8 * KIB) for _ in range(8)]
    for s in slots[:4]:
        pool.release(s)  # 4 idle x 8 KiB, 4 busy x 8 KiB: full
    pool.acquire(16 * KIB)  # needs 16 KiB: shrinking half of the idle (2 slots) is enough
    st = pool.stats()
    assert st.shrinks == 1 and st.shrunk_slots == 2 and st.idle_slots == 2
    assert all(s.busy for s in slots[4:])


def test_registration_failure_is_export_error_and_rolls_back() -> None:
    prov, gens, pool = make()

    def boom(*a: object, **k: object) -> None:
        raise RuntimeError("no MR")

    prov.register = boom  # type: ignore[method-assign]
    with pytest.raises(ExportError) as info:
        pool.acquire(100)
    assert info.value.reason is Reason.REGISTRATION_FAILED
    assert pool.stats().pool_bytes == 0


def test_close_deregisters_everything() -> None:
    prov, gens, pool = make()
    a, b = pool.acquire(100), pool.acquire(100)
    pool.release(a)
    assert pool.close() == 1  # one still busy
    pool.release(b)  # freed on release after close
    assert all(reg.addr == gens.addr_of(0) for reg in prov.live.values())  # only the generation table is left


def test_lease_ids_are_128_random_bits_and_never_logged_whole() -> None:
    from tensorwire.rdma._exporter import LEASE_ID_BYTES, lease_ref, new_lease_id

    ids = [new_lease_id() for _ in range(2000)]
    assert LEASE_ID_BYTES * 8 >= 128
    assert all(len(i) == 2 * LEASE_ID_BYTES and int(i, 16) >= 0 for i in ids)
    assert len(set(ids)) == len(ids) and len({i[:6] for i in ids}) > 1900  # no shared prefix, no counter
    assert lease_ref(ids[0]) == ids[0][:8] + "..." and ids[0] not in lease_ref(ids[0])
