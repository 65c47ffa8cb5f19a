"""Provider conformance suite: the contract of ``tensorwire.rdma.providers.base`` as executable checks.

Every provider registered in ``tensorwire.rdma`` must pass it (tests/conformance runs it for each known provider).
A third-party provider runs it from its own tests::

    from tensorwire.rdma import RdmaConfig, register_provider
    from tensorwire.testing.conformance import CHECKS, ConformanceSkip, run_check

    register_provider("mooncake", "my_pkg.provider:MooncakeProvider")

    @pytest.mark.parametrize("name", CHECKS)
    def test_mooncake(name):
        try:
            run_check(name, RdmaConfig(provider="mooncake", bind_ip="127.0.0.1"))
        except ConformanceSkip as exc:
            pytest.skip(str(exc))

Checks run exporter and reader in one process (two provider instances); cross-process behaviour is covered by
the provider's own integration tests. A provider that is not available in this process must still pass
``availability`` (construction raises PROVIDER_UNAVAILABLE with the right exception per role); the other checks
are then skipped.
"""

from __future__ import annotations

import dataclasses
import threading
import time
from collections.abc import Callable

import torch

from tensorwire.errors import (
    ExportError,
    InvalidDescriptor,
    LeaseExpired,
    ReadError,
    Reason,
)
from tensorwire.rdma import SUPPORTED_DTYPES, RdmaConfig, TensorExporter, TensorReader
from tensorwire.rdma.providers import create_provider, provider_class, resolve_name
from tensorwire.testing.data import make_tensor, same_bytes


class ConformanceSkip(Exception):
    """The check does not apply (provider unavailable here)."""


def _available(config: RdmaConfig) -> bool:
    return provider_class(resolve_name(config)).available()


def _need(config: RdmaConfig) -> None:
    if not _available(config):
        raise ConformanceSkip(f"provider {config.provider!r} is not available in this process")


def check_availability(config: RdmaConfig) -> None:
    """Unavailable: PROVIDER_UNAVAILABLE per role. Available: both sides construct and report the provider."""
    if not _available(config):
        for cls, err in ((TensorExporter, ExportError), (TensorReader, ReadError)):
            try:
                cls(config).close()
            except err as exc:
                assert exc.reason is Reason.PROVIDER_UNAVAILABLE, exc
            else:
                raise AssertionError(f"{cls.__name__} built with unavailable provider {config.provider!r}")
        return
    with TensorExporter(config) as exp, TensorReader(config) as rd:
        assert exp.ready and rd.ready
        assert exp.provider_name == rd.provider_name == resolve_name(config)


def check_round_trip_every_dtype(config: RdmaConfig) -> None:
    """Bytes come back identical for every supported dtype, including zero-size and 0-dim tensors."""
    _need(config)
    inputs = [make_tensor((4, 3), dt, seed=i) for i, dt in enumerate(SUPPORTED_DTYPES)]
    inputs += [make_tensor((0, 5), "float32", 1), make_tensor((), "int64", 2)]
    with TensorExporter(config) as exp, TensorReader(config) as rd:
        out = rd.read([exp.export(inputs)])
        assert len(out) == len(inputs)
        for a, b in zip(inputs, out, strict=True):
            assert same_bytes(a, b.cpu()), (a.dtype, a.shape)


def check_ordering(config: RdmaConfig) -> None:
    """Results are flattened in descriptor order x manifest order, whatever the sizes."""
    _need(config)
    groups = [
        [make_tensor((n,), "int32", 10 * g + j) for j, n in enumerate(sizes)]
        for g, sizes in enumerate([(5, 5000, 3), (70000,), (1, 2, 3, 4)])
    ]
    with TensorExporter(config) as exp, TensorReader(config) as rd:
        descs = exp.export_batch(groups)
        out = rd.read(list(reversed(descs)))
        want = [t for g in reversed(groups) for t in g]
        assert len(out) == len(want)
        for a, b in zip(want, out, strict=True):
            assert same_bytes(a, b.cpu())


def check_ownership(config: RdmaConfig) -> None:
    """Inputs may change after export; results survive release, slot reuse and reader close."""
    _need(config)
    with TensorExporter(config) as exp:
        t = make_tensor((3000,), "float32", 5)
        want = t.clone()
        d = exp.export([t])
        t.zero_()
        rd = TensorReader(config)
        (got,) = rd.read([d])
        exp.release([d.lease_id])
        exp.export([torch.ones(3000)])  # same bucket: reuses the slot
        rd.close()
        assert same_bytes(got.cpu(), want)


def check_release_idempotent(config: RdmaConfig) -> None:
    """release() twice and unknown ids are fine and counted."""
    _need(config)
    with TensorExporter(config) as exp:
        d = exp.export([torch.ones(8)])
        exp.release([d.lease_id])
        exp.release([d.lease_id, "unknown-lease"])
        st = exp.stats()
        assert st.live_leases == 0 and st.releases == 1 and st.unknown_releases == 2


def check_stale_generation(config: RdmaConfig) -> None:
    """A descriptor read after release (and after reuse of its slot) fails with LeaseExpired."""
    _need(config)
    with TensorExporter(config) as exp, TensorReader(config) as rd:
        old = exp.export([torch.full((100,), 1.0)])
        rd.read([old])
        exp.release([old.lease_id])
        for attempt in ("released", "reused"):
            try:
                rd.read([old])
            except LeaseExpired:
                pass
            else:
                raise AssertionError(f"stale descriptor read succeeded after the slot was {attempt}")
            exp.export([torch.full((100,), 2.0)])


def check_failure_form(config: RdmaConfig) -> None:
    """Bad input yields tensorwire errors only: InvalidDescriptor before memory, ReadError from the provider."""
    _need(config)
    with TensorExporter(config) as exp, TensorReader(config) as rd:
        d = exp.export([torch.ones(16)])
        cases = [
            dataclasses.replace(d, lease_id=""),
            dataclasses.replace(d, slot_addr=d.slot_addr + (1 << 44)),
            dataclasses.replace(d, generation_addr=d.generation_addr + (1 << 44)),
            dataclasses.replace(d, owner=dataclasses.replace(d.owner, agent_name="nobody")),
        ]
        for bad in cases:
            try:
                rd.read([bad], timeout_ms=2000)
            except (InvalidDescriptor, ReadError):
                continue
            raise AssertionError(f"read of a corrupted descriptor succeeded: {bad}")
        assert same_bytes(rd.read([d])[0].cpu(), torch.ones(16))  # still works afterwards
        # A reader that never met the owner must reach it through the endpoint; a wrong one is a ReadError.
        with TensorReader(config) as fresh:
            try:
                fresh.read([dataclasses.replace(d, owner=dataclasses.replace(d.owner, port=1))], timeout_ms=2000)
            except ReadError:
                pass
            else:
                raise AssertionError("read through a wrong owner endpoint succeeded")


def check_concurrency(config: RdmaConfig) -> None:
    """Reads from several threads at once, interleaved with exports and releases, all return the right bytes."""
    _need(config)
    with TensorExporter(config) as exp, TensorReader(config) as rd:
        stable = [(make_tensor((1000 + i,), "float16", i), None) for i in range(4)]
        descs = [exp.export([t]) for t, _ in stable]
        errors: list[BaseException] = []
        stop = time.monotonic() + 30

        def reader(k: int) -> None:
            try:
                for r in range(25):
                    i = (k + r) % len(descs)
                    assert same_bytes(rd.read([descs[i]])[0].cpu(), stable[i][0])
            except BaseException as exc:  # collected
                errors.append(exc)

        def churn() -> None:
            try:
                while time.monotonic() < stop and any(t.is_alive() for t in threads):
                    exp.release([exp.export([torch.ones(64)]).lease_id])
            except BaseException as exc:  # collected
                errors.append(exc)

        threads = [threading.Thread(target=reader, args=(k,)) for k in range(4)]
        for t in threads:
            t.start()
        churner = threading.Thread(target=churn)
        churner.start()
        for t in [*threads, churner]:
            t.join(timeout=60)
        assert not any(t.is_alive() for t in [*threads, churner]), "threads hung"
        assert not errors, errors


def check_provider_epoch_and_registration(config: RdmaConfig) -> None:
    """Provider level: the registration epoch grows with every register; deregister takes it back."""
    _need(config)
    prov = create_provider(config, role="exporter")
    try:
        buf = torch.zeros(8192, dtype=torch.uint8)
        e0 = prov.registration_epoch
        reg = prov.register(buf.data_ptr(), buf.numel(), "DRAM", 0)
        assert prov.registration_epoch > e0
        prov.deregister(reg)
        assert prov.agent_name
    finally:
        prov.close()
        prov.close()


CHECKS: dict[str, Callable[[RdmaConfig], None]] = {
    "availability": check_availability,
    "round_trip_every_dtype": check_round_trip_every_dtype,
    "ordering": check_ordering,
    "ownership": check_ownership,
    "release_idempotent": check_release_idempotent,
    "stale_generation": check_stale_generation,
    "failure_form": check_failure_form,
    "concurrency": check_concurrency,
    "provider_epoch_and_registration": check_provider_epoch_and_registration,
}


def run_check(name: str, config: RdmaConfig) -> None:
    """Run one check; raises AssertionError on a violation and ConformanceSkip when it does not apply. Every
    read goes through the provider (``same_host_copy=0``): the reader's same-host copy would bypass it."""
    CHECKS[name](config.replace(same_host_copy=0))
