"""Proxy route table: routes come only from record(); a fake clock drives the TTL."""

from __future__ import annotations

import pytest

from tensorwire.service._routes import ROUTE_GC_SAFETY_S, RouteTable, route_ttl_s


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def clock() -> Clock:
    return Clock()


def test_ttl_is_slot_gc_plus_safety() -> None:
    assert route_ttl_s(60_000) == 65.0
    assert route_ttl_s(1_500) == 1.5 + ROUTE_GC_SAFETY_S


def test_release_groups_by_owner(clock: Clock) -> None:
    t = RouteTable(10.0, clock=clock)
    assert t.record("w1:1", ["a", "b"]) == []
    assert t.record("w2:2", ["c"]) == []
    plan = t.plan_release(["a", "c", "b", "zz", "a"])
    assert plan.by_worker == {"w1:1": ["a", "b"], "w2:2": ["c"]}
    assert plan.unknown == ["zz"]
    assert t.stats().unknown_total == 1


def test_route_dropped_only_after_confirmed_success(clock: Clock) -> None:
    t = RouteTable(10.0, clock=clock)
    t.record("w1", ["a", "b"])
    plan = t.plan_release(["a", "b"])
    # Planning alone (a release in flight or failed) removes nothing: a retry must still find the owner.
    assert t.lookup("a") == "w1" and t.lookup("b") == "w1"
    retry = t.plan_release(["a", "b"])
    assert retry.by_worker == {"w1": ["a", "b"]}
    assert t.confirm_released(retry, "w1") == 2
    assert t.lookup("a") is None and len(t) == 0
    # Confirming the first (stale) plan afterwards changes nothing and never raises.
    assert t.confirm_released(plan, "w1") == 0
    assert t.stats().released_total == 2


def test_confirm_keeps_a_route_recorded_again_in_between(clock: Clock) -> None:
    t = RouteTable(10.0, clock=clock)
    t.record("w1", ["a"])
    plan = t.plan_release(["a"])
    clock.now += 1
    t.record("w1", ["a"])  # a newer receipt for the same id: a different route
    assert t.confirm_released(plan, "w1") == 0
    assert t.lookup("a") == "w1"


def test_collision_poisons_and_hands_back_both(clock: Clock) -> None:
    t = RouteTable(10.0, clock=clock)
    t.record("w1", ["a", "x"])
    collided = t.record("w2", ["a", "y"])
    assert sorted(collided) == [("w1", "a"), ("w2", "a")]
    assert t.is_poisoned("a") and t.lookup("a") is None
    assert t.lookup("x") == "w1" and t.lookup("y") == "w2"
    plan = t.plan_release(["a", "x"])
    assert plan.poisoned == ["a"] and plan.by_worker == {"w1": ["x"]}
    # A third claim of a poisoned id is handed back too and counted again.
    assert t.record("w3", ["a"]) == [("w3", "a")]
    assert t.stats().collisions_total == 2


def test_same_worker_recording_twice_is_not_a_collision(clock: Clock) -> None:
    t = RouteTable(10.0, clock=clock)
    t.record("w1", ["a"])
    assert t.record("w1", ["a"]) == []
    assert t.stats().collisions_total == 0 and t.lookup("a") == "w1"


def test_routes_expire_after_ttl(clock: Clock) -> None:
    t = RouteTable(route_ttl_s(1_000), clock=clock)  # 6 s
    t.record("w1", ["old"])
    clock.now += 3
    t.record("w1", ["new"])
    clock.now += 3.0  # old is exactly at the TTL: still routed
    assert t.lookup("old") == "w1"
    clock.now += 0.5
    plan = t.plan_release(["old", "new"])
    assert plan.unknown == ["old"] and plan.by_worker == {"w1": ["new"]}
    assert t.stats().expired_total == 1
    clock.now += 10
    assert t.expire() == 1 and len(t) == 0


def test_poison_is_forgotten_after_ttl(clock: Clock) -> None:
    t = RouteTable(5.0, clock=clock)
    t.record("w1", ["a"])
    t.record("w2", ["a"])
    clock.now += 6
    t.expire()
    assert not t.is_poisoned("a")
    assert t.record("w1", ["a"]) == [] and t.lookup("a") == "w1"


def test_invalid_ttl() -> None:
    with pytest.raises(ValueError):
        RouteTable(0)


def test_service_public_names_resolve() -> None:
    import tensorwire.service as svc

    for name in svc.__all__:
        assert getattr(svc, name) is not None
    with pytest.raises(AttributeError):
        svc.not_a_name  # noqa: B018
