import pickle

import pytest

import tensorwire.errors as errors
from tensorwire.errors import Reason, TensorwireError

ALL = [getattr(errors, n) for n in errors.__all__ if n != "Reason"]


@pytest.mark.parametrize("cls", ALL, ids=lambda c: c.__name__)
def test_every_exception_pickles_with_its_reason(cls):
    exc = cls("boom", reason=Reason.STALE_GENERATION)
    back = pickle.loads(pickle.dumps(exc))
    assert type(back) is cls
    assert str(back) == "boom"
    assert back.reason is Reason.STALE_GENERATION


@pytest.mark.parametrize("cls", ALL, ids=lambda c: c.__name__)
def test_default_reason_and_root(cls):
    exc = cls("x")
    assert isinstance(exc, TensorwireError)
    assert exc.reason is cls.default_reason


def test_timeouts_are_timeout_errors():
    for cls in (errors.ReadTimeout, errors.DeadlineExceeded, errors.BootstrapTimeout, errors.BroadcastTimeout):
        assert issubclass(cls, TimeoutError)


def test_reason_values_unique():
    values = [r.value for r in Reason]
    assert len(values) == len(set(values))
