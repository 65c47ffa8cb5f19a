from __future__ import annotations

from prometheus_client import CollectorRegistry

from tensorwire.mm import TransportMetrics
from tensorwire.mm.client._breaker import BreakerBoard, BreakerState


class Clock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


def board(clock: Clock, reg: CollectorRegistry | None = None) -> BreakerBoard:
    m = TransportMetrics(reg) if reg is not None else None
    return BreakerBoard("endpoint", failures_to_open=3, open_seconds=30, clock=clock, metrics=m)


def test_opens_after_consecutive_failures_only() -> None:
    c = Clock()
    b = board(c)
    b.record_failure("e")
    b.record_failure("e")
    b.record_success("e")  # resets the count
    b.record_failure("e")
    b.record_failure("e")
    assert b.allow("e") and b.state("e") is BreakerState.CLOSED
    b.record_failure("e")
    assert b.state("e") is BreakerState.OPEN and not b.allow("e")
    assert b.allow("other")  # keyed: another endpoint is unaffected


def test_half_open_single_probe_then_close_on_success() -> None:
    c = Clock()
    reg = CollectorRegistry()
    b = board(c, reg)
    for _ in range(3):
        b.record_failure("e")
    assert reg.get_sample_value("tensorwire_mm_open_breakers", {"scope": "endpoint"}) == 1
    c.t += 29.9
    assert not b.allow("e")
    c.t += 0.2
    assert b.allow("e")  # the probe
    assert b.state("e") is BreakerState.HALF_OPEN
    assert not b.allow("e")  # only one probe at a time
    b.record_success("e")
    assert b.state("e") is BreakerState.CLOSED and b.allow("e")
    assert reg.get_sample_value("tensorwire_mm_open_breakers", {"scope": "endpoint"}) == 0
    assert reg.get_sample_value("tensorwire_mm_breaker_transitions_total", {"scope": "endpoint", "state": "open"}) == 1
    assert (
        reg.get_sample_value("tensorwire_mm_breaker_transitions_total", {"scope": "endpoint", "state": "half_open"})
        == 1
    )


def test_failed_probe_reopens_for_a_new_window() -> None:
    c = Clock()
    b = board(c)
    for _ in range(3):
        b.record_failure("e")
    c.t += 31
    assert b.allow("e")
    b.record_failure("e")  # one failure in half-open is enough
    assert b.state("e") is BreakerState.OPEN and not b.allow("e")
    c.t += 31
    assert b.allow("e")


def test_neutral_hands_the_probe_back_and_never_counts() -> None:
    c = Clock()
    b = board(c)
    for _ in range(5):
        b.record_neutral("e")  # budget exhaustion: never opens
    assert b.state("e") is BreakerState.CLOSED
    for _ in range(3):
        b.record_failure("e")
    c.t += 31
    assert b.allow("e")
    b.record_neutral("e")
    assert b.state("e") is BreakerState.OPEN
    assert b.allow("e")  # the next caller may probe at once


def test_reset_and_keys_not_closed() -> None:
    c = Clock()
    reg = CollectorRegistry()
    b = board(c, reg)
    for _ in range(3):
        b.record_failure("a")
    assert b.keys_not_closed() == ["a"] and b.is_blocked("a")
    b.reset("a")
    assert b.keys_not_closed() == [] and b.allow("a")
    assert reg.get_sample_value("tensorwire_mm_open_breakers", {"scope": "endpoint"}) == 0
