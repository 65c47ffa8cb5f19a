"""LLM side: RemoteOutputTransport.fetch(inputs) -> MultimodalOutput.

One fetch, one budget (never reset), shared by every step::

    budget = timeout_ms or max_i(item.timeout_ms > 0 ? item.timeout_ms : worker_timeout_ms) + margin
    advertise RDMA  iff  mode auto, the reader is built, and the endpoint breaker allows it
    Encode(request, deadline = remaining)
    receipt has slots, RDMA was advertised  -> consume:
        validate every descriptor and role list; read all slots in ONE batch with
        read_ms = min(remaining - fallback_reserve_ms, read_timeout_ms); check every tensor against its
        manifest; reassemble by role and split sizes
        ok   -> release async (a message on the fetch's stream, else the queue; never blocks), breaker success,
                return (plane rdma)
        fail -> sync release within min(release_timeout_ms, remaining); breaker failure unless the cause was the
                budget; the request is withdrawn to an _InlineAttempt and sent ONCE more if at least
                min_fallback_ms remain, else the original error is raised
    receipt has slots, RDMA not advertised -> sync release, ProtocolError(UNREQUESTED_RDMA), no fallback
    receipt inline -> decode (validated), return (plane inline)

Control path: the policy here talks to the encoder only through a ``ControlChannel`` (``_channel.py``, the
contract): one ``ControlSession`` per fetch carries its Encode(s) and its success-path release (the default
``GrpcControlChannel`` puts both on a pooled EncodeStream, else unary RPCs and the release queue; on one host the
``LocalControlChannel`` puts them on the worker's Unix socket, with the gRPC channel as the way in and the fallback);
failure-path releases are the channel's answered ``release``. Receipt parsing, validation and reassembly are
pure functions in ``_receipt.py``; every way the RDMA consume fails is classified in one place,
``classify_consume_error``.

"At most one fallback" is a property of the types: the retry is an ``_InlineAttempt``, which has no RDMA
capability to advertise, and the terminal decoder it goes to returns an output or raises; nothing in it can
ask for another round.

Errors: the caller sees tensorwire exceptions only (PeerUnavailable, DeadlineExceeded, InvalidPayload,
ProtocolError, ReadError, ...). ``DeadlineExceeded`` with reason BUDGET_EXHAUSTED means the caller's own
budget ran out; it is never counted against an endpoint's breaker.

Thread-safety: ``fetch`` may be called from many threads at once (each uses its own session); ``close`` is
idempotent, drains and closes the channel, and leaves no thread behind.
"""

from __future__ import annotations

import enum
import logging
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from tensorwire._ratelog import RateLimitedLog
from tensorwire.errors import (
    ClosedError,
    ConfigError,
    DeadlineExceeded,
    ProtocolError,
    ReadError,
    ReadTimeout,
    Reason,
    TensorwireError,
)
from tensorwire.mm import wire
from tensorwire.mm._background import BackgroundInit, InitState, is_permanent
from tensorwire.mm._config import MODE_AUTO, TransportConfig
from tensorwire.mm._metrics import TransportMetrics, metrics_for
from tensorwire.mm._proto import encoder_pb2 as pb
from tensorwire.mm._types import MultimodalInput, MultimodalOutput, Plane
from tensorwire.mm.client import _rdma_receipt as _receipt
from tensorwire.mm.client._breaker import BreakerBoard, BreakerState
from tensorwire.mm.client._channel import Budget, ControlChannel, ControlSession
from tensorwire.mm.client._local import control_channel_for
from tensorwire.mm.client._rdma_receipt import DescriptorParser
from tensorwire.mm.client._release import ReleaseQueue
from tensorwire.mm.wire import _codec
from tensorwire.mm.wire._receipt import WireReceipt
from tensorwire.rdma import RdmaConfig, Reader, is_staged_gpu_transport

log = logging.getLogger(__name__)


ReaderFactory = Callable[[RdmaConfig], Reader]
Observer = Callable[[str, dict[str, Any]], None]
"""observer(event, details): "request" (details include ``path``: stream/unary), "read", "release_sync",
"release_stream", "release_async", "decode_inline"; for tests."""


def _default_reader_factory(rdma_config: RdmaConfig) -> Reader:
    from tensorwire.rdma import TensorReader

    return TensorReader(rdma_config)


def _default_parser(config: TransportConfig) -> DescriptorParser:
    from tensorwire.rdma import Descriptor

    max_slot = int(config.rdma.max_slot_bytes)
    align = int(config.rdma.slot_align)
    return lambda data: Descriptor.from_bytes(data, max_slot_bytes=max_slot, slot_align=align)


def resolve_rpc_timeout_ms(inputs: Sequence[MultimodalInput], config: TransportConfig) -> int:
    """A fetch's budget without ``timeout_ms``: ``wire.rpc_budget_ms`` with the config's worker budget and margin."""
    return wire.rpc_budget_ms(
        (i.timeout_ms for i in inputs),
        worker_timeout_ms=config.worker_timeout_ms,
        margin_ms=config.rpc_timeout_margin_ms,
    )


@dataclass(frozen=True)
class _RdmaAttempt:
    """A request that advertises RDMA. ``withdraw`` is the only way to the inline plane."""

    inputs: tuple[MultimodalInput, ...]
    excluded_workers: tuple[str, ...] = ()

    def to_pb(self, budget: Budget) -> pb.EncodeRequest:
        req = _codec.inputs_to_pb(self.inputs)
        req.support_rdma = True
        req.rdma_excluded_workers.extend(self.excluded_workers)
        req.deadline_ms = max(0, int(budget.remaining_ms()))
        return req

    def withdraw(self, failed_worker: str = "") -> _InlineAttempt:
        """The inline retry; it names the worker whose receipt could not be read, so that a proxy in between sends
        the retry to another worker when it can (the worker may have died with its slots)."""
        avoid = (*self.excluded_workers, failed_worker) if failed_worker else self.excluded_workers
        return _InlineAttempt(self.inputs, avoid)


@dataclass(frozen=True)
class _InlineAttempt:
    """A request that cannot advertise RDMA (it has no such field); its answer goes to the terminal decoder.

    ``avoid``: worker ids sent in ``rdma_excluded_workers``; without ``support_rdma`` they only tell a proxy to
    ask other workers first."""

    inputs: tuple[MultimodalInput, ...]
    avoid: tuple[str, ...] = ()

    def to_pb(self, budget: Budget) -> pb.EncodeRequest:
        req = _codec.inputs_to_pb(self.inputs)
        req.rdma_excluded_workers.extend(self.avoid)
        req.deadline_ms = max(0, int(budget.remaining_ms()))
        return req


@dataclass
class _Stages:
    ms: dict[str, float] = field(default_factory=dict)

    def add(self, name: str, seconds: float) -> None:
        self.ms[name] = self.ms.get(name, 0.0) + seconds * 1e3


class Blame(enum.Enum):
    """Who a failed RDMA consume says something about (the breakers listen only to ENDPOINT)."""

    ENDPOINT = "endpoint"  # the endpoint or its data plane: its breakers count a failure
    CALLER = "caller"  # this side: the fetch's budget ran out, or this process's reader closed; breakers neutral


@dataclass(frozen=True)
class ConsumeFailure:
    """An RDMA consume that did not deliver (its leases are already released): the fetch withdraws to the inline
    plane once if ``min_fallback_ms`` remain; otherwise it raises ``error`` (ENDPOINT) or budget exhaustion."""

    error: TensorwireError
    blame: Blame


@dataclass(frozen=True)
class ReadPlan:
    """The RDMA read's timeout: ``min(budget left after the fallback reserve, rdma.read_timeout_ms)``."""

    timeout_ms: int  # <= 0: no read (no budget left for it)
    budget_limited: bool  # the budget set it (or there is no cap): a timeout then is the caller's, not the endpoint's

    @classmethod
    def within(cls, remaining_ms: float, cap_ms: int) -> ReadPlan:
        budget_limited = cap_ms <= 0 or remaining_ms < cap_ms
        return cls(int(math.floor(remaining_ms if budget_limited else cap_ms)), budget_limited)


class _NotTheEndpoint(Exception):
    """Raised inside the consume for a failure on this side (no budget for the read, reader closed)."""

    def __init__(self, error: TensorwireError) -> None:
        super().__init__(str(error))
        self.error = error


def classify_consume_error(exc: BaseException, read: ReadPlan | None) -> ConsumeFailure:
    """Every way an RDMA consume can fail, in one place: the error the fetch reports and who is to blame.

    ``read`` is the read's plan once it was made (None: the failure came before, in validation).

    ==================================================  ======================================  ========
    exception                                           error reported                          blame
    ==================================================  ======================================  ========
    this side: no budget for the read, reader closed    its error                               CALLER
    ``ReadTimeout`` at a budget-derived deadline        DeadlineExceeded(BUDGET_EXHAUSTED)      CALLER
    any other ``TensorwireError`` (descriptor, roles,   itself                                  ENDPOINT
    read error, lease expired, ``read_timeout_ms``,
    result or assembly mismatch)
    anything else (a provider or parser bug)            ReadError(RDMA_READ_ERROR), cause kept  ENDPOINT
    ==================================================  ======================================  ========
    """
    if isinstance(exc, _NotTheEndpoint):
        return ConsumeFailure(exc.error, Blame.CALLER)
    if isinstance(exc, ReadTimeout) and read is not None and read.budget_limited:
        err: TensorwireError = DeadlineExceeded(
            f"RDMA read ran out of the request budget ({read.timeout_ms} ms): {exc}", reason=Reason.BUDGET_EXHAUSTED
        )
        err.__cause__ = exc
        return ConsumeFailure(err, Blame.CALLER)
    if isinstance(exc, TensorwireError):
        return ConsumeFailure(exc, Blame.ENDPOINT)
    err = ReadError(f"RDMA read raised {exc!r}", reason=Reason.RDMA_READ_ERROR)
    err.__cause__ = exc
    return ConsumeFailure(err, Blame.ENDPOINT)


class RemoteOutputTransport:
    """The LLM-side transport for one encoder endpoint (a worker or a proxy in front of workers).

    Keyword-only seams: ``channel`` (a ``ControlChannel`` to ``endpoint``; default: ``control_channel_for``, the
    same-host ``LocalControlChannel`` unless ``local_channel`` is off, else a ``GrpcControlChannel``;
    the transport owns it and closes it), ``reader_factory`` / ``descriptor_parser`` (default tensorwire.rdma),
    ``clock`` (the breaker's and the budget's), ``metrics`` (a TransportMetrics on your registry),
    ``release_queue`` (its sender must reach this endpoint; default: one queue per transport), ``observer``.
    """

    def __init__(
        self,
        endpoint: str,
        config: TransportConfig | None = None,
        *,
        channel: ControlChannel | None = None,
        reader_factory: ReaderFactory | None = None,
        descriptor_parser: DescriptorParser | None = None,
        clock: Callable[[], float] = time.monotonic,
        metrics: TransportMetrics | None = None,
        release_queue: ReleaseQueue | None = None,
        observer: Observer | None = None,
    ) -> None:
        if not endpoint:
            raise ConfigError("endpoint must be 'host:port'")
        if channel is not None and channel.endpoint != endpoint:
            raise ConfigError(f"the control channel goes to {channel.endpoint!r}, not to {endpoint!r}")
        self.endpoint = endpoint
        self.config = config if config is not None else TransportConfig()
        self.metrics = metrics if metrics is not None else metrics_for(None)
        self._clock = clock
        self._observer = observer
        self._channel = channel if channel is not None else control_channel_for(endpoint, self.config, self.metrics)
        self._channel.bind_requeue(self._requeue)
        self._owns_queue = release_queue is None
        self._queue = (
            release_queue
            if release_queue is not None
            else ReleaseQueue(
                self._send_release,
                max_pending=self.config.release_queue_max,
                release_timeout_ms=self.config.release_timeout_ms,
                shutdown_ms=self.config.release_shutdown_ms,
                metrics=self.metrics,
            )
        )
        self.endpoint_breakers = BreakerBoard(
            "endpoint", self.config.failures_to_open, self.config.open_seconds, clock, self.metrics
        )
        self.worker_breakers = BreakerBoard(
            "worker", self.config.failures_to_open, self.config.open_seconds, clock, self.metrics
        )
        self._rl = RateLimitedLog(log)
        self._closed = False
        rfactory = reader_factory or _default_reader_factory
        cfg = self.config
        self._parse: DescriptorParser | None = descriptor_parser
        self._reader: BackgroundInit[Reader] = BackgroundInit(
            "reader",
            lambda: rfactory(cfg.rdma),
            is_permanent,
            backoff_s=cfg.init_backoff_ms / 1000.0,
            backoff_max_s=cfg.init_backoff_max_ms / 1000.0,
            on_failure=lambda exc, permanent: self.metrics.fallbacks.labels("llm", "rdma_init_failed").inc(),
        )
        if self.config.mode == MODE_AUTO:
            # Warm up now, off the request path; until it is ready, fetch does not advertise RDMA.
            self._reader.start()

    # -- public -------------------------------------------------------------------------------------------

    @property
    def reader_state(self) -> InitState:
        return self._reader.state

    def wait_ready(self, timeout_s: float) -> bool:
        """Waits for the RDMA reader to be built (False in mode grpc or when it cannot be)."""
        return self._reader.wait_ready(timeout_s)

    @property
    def release_queue(self) -> ReleaseQueue:
        return self._queue

    def fetch(self, inputs: Sequence[MultimodalInput], timeout_ms: int | None = None) -> MultimodalOutput:
        """Asks the encoder for ``inputs``' output and returns it as owning tensors (see the module docstring)."""
        if self._closed:
            raise ClosedError("RemoteOutputTransport is closed")
        items = tuple(inputs)
        total_ms = resolve_rpc_timeout_ms(items, self.config) if timeout_ms is None else timeout_ms
        budget = Budget(total_ms, self._clock)
        stages = _Stages()
        t0 = time.perf_counter()
        session = self._channel.session()
        try:
            excluded = self._advertise()
            if excluded is not None:
                out = self._fetch_rdma(_RdmaAttempt(items, excluded), budget, stages, session)
            else:
                out = self._fetch_inline(_InlineAttempt(items), budget, stages, session, fallback_from=None)
        except TensorwireError as exc:
            self.metrics.errors.labels("llm", exc.reason.value).inc()
            raise
        finally:
            session.close()
        elapsed = time.perf_counter() - t0
        stages.add("total", elapsed)
        out.stage_ms = stages.ms
        self.metrics.child(self.metrics.fetch_seconds, out.plane.value).observe(elapsed)
        self.metrics.child(self.metrics.requests, "llm", out.plane.value).inc()
        return out

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        try:
            # The channel's streams first: their queued releases still reach the encoder (and any they could not
            # send go to the queue, which is closed next).
            self._channel.drain(self.config.release_shutdown_ms / 1000.0)
            if self._owns_queue:
                self._queue.close()
        finally:
            try:
                self._reader.close()
            finally:
                self._channel.close()

    def __enter__(self) -> RemoteOutputTransport:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- planes -------------------------------------------------------------------------------------------

    def _advertise(self) -> tuple[str, ...] | None:
        """None: do not advertise. Otherwise the workers to exclude (their breakers are open)."""
        if self.config.mode != MODE_AUTO or self._reader.get() is None:
            return None
        if not self.endpoint_breakers.allow(self.endpoint):
            return None
        return tuple(w for w in self.worker_breakers.keys_not_closed() if not self.worker_breakers.allow(w))

    def _emit(self, event: str, **details: Any) -> None:
        if self._observer is not None:
            self._observer(event, details)

    def _request(
        self,
        attempt: _RdmaAttempt | _InlineAttempt,
        budget: Budget,
        stages: _Stages,
        session: ControlSession,
        stage: str,
    ) -> WireReceipt:
        req = attempt.to_pb(budget)
        self._emit(
            "request", support_rdma=req.support_rdma, excluded=list(req.rdma_excluded_workers), path=session.path
        )
        t = time.perf_counter()
        try:
            return session.encode(req, budget)
        finally:
            stages.add(stage, time.perf_counter() - t)

    def _fetch_rdma(
        self, attempt: _RdmaAttempt, budget: Budget, stages: _Stages, session: ControlSession
    ) -> MultimodalOutput:
        try:
            receipt = self._request(attempt, budget, stages, session, "request")
        except TensorwireError:
            self._neutral(None)
            raise
        worker = receipt.message.worker.worker_id
        self._neutral_probes_except(worker)
        if not receipt.message.rdma_slots:
            # The encoder chose inline (exporter not ready, this worker excluded, ...): nothing learned about RDMA.
            self._neutral(worker)
            return self._decode_terminal(receipt, budget, stages, session, fallback_from=None)
        result = self._consume_rdma(receipt, budget, stages, session)
        if isinstance(result, MultimodalOutput):
            return result
        if result.blame is Blame.ENDPOINT:
            self.endpoint_breakers.record_failure(self.endpoint)
            if worker:
                self.worker_breakers.record_failure(worker)
        else:
            self._neutral(worker)
        reason = result.error.reason
        self.metrics.fallbacks.labels("llm", reason.value).inc()
        if budget.remaining_ms() < self.config.min_fallback_ms:
            self._rl.log(
                logging.WARNING,
                "nofallback-" + reason.value,
                "RDMA consume failed (%s) and %.0f ms of budget remain (< min_fallback_ms=%d); no fallback",
                result.error,
                budget.remaining_ms(),
                self.config.min_fallback_ms,
            )
            if result.blame is Blame.ENDPOINT:
                raise result.error
            raise DeadlineExceeded(
                f"data-plane fallback exhausted request deadline ({result.error})", reason=Reason.BUDGET_EXHAUSTED
            ) from result.error
        self._rl.log(
            logging.WARNING,
            "fallback-" + reason.value,
            "RDMA consume from %s failed (%s); falling back to inline once",
            self.endpoint,
            result.error,
        )
        return self._fetch_inline(attempt.withdraw(worker), budget, stages, session, fallback_from=reason)

    def _fetch_inline(
        self,
        attempt: _InlineAttempt,
        budget: Budget,
        stages: _Stages,
        session: ControlSession,
        fallback_from: Reason | None,
    ) -> MultimodalOutput:
        stage = "request" if fallback_from is None else "fallback_request"
        receipt = self._request(attempt, budget, stages, session, stage)
        return self._decode_terminal(receipt, budget, stages, session, fallback_from)

    def _decode_terminal(
        self,
        wire_receipt: WireReceipt,
        budget: Budget,
        stages: _Stages,
        session: ControlSession,
        fallback_from: Reason | None,
    ) -> MultimodalOutput:
        """The terminal plane: takes a placed output, decodes inline bytes, or raises. It cannot ask for another
        round."""
        receipt = wire_receipt.message
        if receipt.rdma_slots:
            ids = _receipt.lease_ids(_receipt.parse_slots(receipt, self._parser()))
            self._release_sync(ids, budget, stages)
            self._rl.log(
                logging.WARNING,
                "unrequested",
                "encoder %s sent an RDMA receipt (%d slot(s)) that was not asked for; released and failing the request",
                self.endpoint,
                len(receipt.rdma_slots),
            )
            raise ProtocolError(
                f"{self.endpoint} answered with {len(receipt.rdma_slots)} RDMA slot(s) to a request "
                "that did not advertise RDMA",
                reason=Reason.UNREQUESTED_RDMA,
            )
        if receipt.placed.tensors:
            t = time.perf_counter()
            tensors, roles, placed_bytes = session.take_placed(wire_receipt)
            output = _receipt.assemble_output(tensors, roles, receipt, plane=Plane.PLACED)
            stages.add("decode", time.perf_counter() - t)
            for role, n in _receipt.role_bytes(tensors, roles).items():
                self.metrics.child(self.metrics.bytes, "llm", "placed", role).inc(n)
            stages.ms.update(_receipt.encoder_stages(receipt))
            output.fallback_reason = fallback_from
            return output
        t = time.perf_counter()
        embs, splits, pos, extras, nbytes = _codec.decode_inline_receipt(wire_receipt)
        stages.add("decode", time.perf_counter() - t)
        self._emit("decode_inline", items=len(splits))
        self.metrics.bytes.labels("llm", "inline", "embedding").inc(len(wire_receipt.embedding or b""))
        self.metrics.bytes.labels("llm", "inline", "pos_id").inc(len(wire_receipt.position_ids or b""))
        self.metrics.bytes.labels("llm", "inline", "extra_input").inc(sum(len(p) for p in wire_receipt.extra_inputs))
        stages.ms.update(_receipt.encoder_stages(receipt))
        return MultimodalOutput(
            embeddings=embs,
            split_sizes=splits,
            position_ids=pos,
            extra_inputs=extras,
            plane=Plane.INLINE,
            fallback_reason=fallback_from,
            worker_id=receipt.worker.worker_id,
            payload_bytes=nbytes,
        )

    def _consume_rdma(
        self, wire_receipt: WireReceipt, budget: Budget, stages: _Stages, session: ControlSession
    ) -> MultimodalOutput | ConsumeFailure:
        receipt = wire_receipt.message
        parsed = _receipt.parse_slots(receipt, self._parser())
        ids = _receipt.lease_ids(parsed)
        plan: ReadPlan | None = None
        try:
            descs, roles = _receipt.validate_slots(receipt, parsed)
            plan = ReadPlan.within(
                budget.remaining_ms() - self.config.fallback_reserve_ms, int(self.config.rdma.read_timeout_ms)
            )
            if plan.timeout_ms <= 0:
                raise _NotTheEndpoint(
                    DeadlineExceeded(
                        f"no budget left for the RDMA read ({budget.remaining_ms():.0f} ms remain, "
                        f"{self.config.fallback_reserve_ms} ms reserved for the fallback)",
                        reason=Reason.BUDGET_EXHAUSTED,
                    )
                )
            reader = self._reader.get()
            if reader is None:  # closed under us
                raise _NotTheEndpoint(ReadError("RDMA reader is not available", reason=Reason.PROVIDER_UNAVAILABLE))
            self._emit("read", slots=len(descs), timeout_ms=plan.timeout_ms)
            t = time.perf_counter()
            try:
                tensors = reader.read(descs, timeout_ms=plan.timeout_ms)
            finally:
                read_s = time.perf_counter() - t
                stages.add("read", read_s)
            self.metrics.read_seconds.observe(read_s)
            _receipt.check_read(descs, roles, tensors)
            for role, nbytes in _receipt.role_bytes(tensors, roles).items():
                self.metrics.child(self.metrics.bytes, "llm", "rdma", role).inc(nbytes)
            output = _receipt.assemble_output(tensors, roles, receipt)
        except Exception as exc:
            self._release_sync(ids, budget, stages)
            return classify_consume_error(exc, plan)
        t = time.perf_counter()
        if session.release_after_read(ids):
            released_by = "release_stream"
        else:
            self._queue.submit(self.endpoint, ids)
            released_by = "release_async"
        stages.add("release", time.perf_counter() - t)
        self._emit(released_by, lease_ids=list(ids))
        self.endpoint_breakers.record_success(self.endpoint)
        if output.worker_id:
            self.worker_breakers.record_success(output.worker_id)
        self._log_hit(len(descs), output.payload_bytes, read_s)
        self._note_transport(reader)
        stages.ms.update(_receipt.encoder_stages(receipt))
        return output

    # -- helpers ------------------------------------------------------------------------------------------

    def _parser(self) -> DescriptorParser:
        if self._parse is None:
            self._parse = _default_parser(self.config)
        return self._parse

    def _release_sync(self, lease_ids: list[str], budget: Budget, stages: _Stages) -> None:
        """Best effort within min(release_timeout_ms, remaining); the owner's GC is the backstop."""
        if not lease_ids:
            return
        timeout_ms = min(float(self.config.release_timeout_ms), budget.remaining_ms())
        self._emit("release_sync", lease_ids=list(lease_ids), timeout_ms=timeout_ms)
        if timeout_ms <= 0:
            self.metrics.releases.labels("sync", "release_budget_exhausted").inc(len(lease_ids))
            return
        t = time.perf_counter()
        try:
            self._channel.release(lease_ids, timeout_ms / 1000.0)
        except TensorwireError as exc:
            self.metrics.releases.labels("sync", exc.reason.value).inc(len(lease_ids))
            self._rl.log(
                logging.WARNING,
                "sync-release",
                "sync release of %d lease(s) on %s failed: %s; the encoder's TTL GC will reclaim them",
                len(lease_ids),
                self.endpoint,
                exc,
            )
            return
        finally:
            stages.add("release", time.perf_counter() - t)
        self.metrics.release_seconds.labels("sync").observe(time.perf_counter() - t)
        self.metrics.releases.labels("sync", "ok").inc(len(lease_ids))

    def _requeue(self, lease_ids: list[str]) -> None:
        self._queue.submit(self.endpoint, lease_ids)  # dropped ids are counted there; the owner's GC reclaims them

    def _send_release(self, endpoint: str, lease_ids: list[str], timeout_s: float) -> None:
        if endpoint != self.endpoint:  # a shared queue routes each batch to its own transport's channel
            raise ProtocolError(f"release batch for {endpoint} reached the transport of {self.endpoint}")
        self._channel.release(lease_ids, timeout_s)

    def _neutral(self, worker: str | None) -> None:
        self.endpoint_breakers.record_neutral(self.endpoint)
        if worker:
            self.worker_breakers.record_neutral(worker)

    def _neutral_probes_except(self, worker: str) -> None:
        for w in self.worker_breakers.keys_not_closed():
            if w != worker and self.worker_breakers.state(w) is BreakerState.HALF_OPEN:
                self.worker_breakers.record_neutral(w)

    def _note_transport(self, reader: Reader) -> None:
        # Never silently slow: a GPU read UCX staged through TCP/host memory is counted (the rdma layer also logs
        # a WARNING once per peer). transport() is a cached lookup, not a probe.
        if not self.config.rdma.device.startswith("cuda"):
            return
        if is_staged_gpu_transport(reader.transport()):
            self.metrics.staged_gpu_reads.inc()

    def _log_hit(self, slots: int, nbytes: int, read_s: float) -> None:
        # First hit at INFO (smoke tests grep it), then at most once per interval: never per request.
        self._rl.log(logging.INFO, "hit", "[MM-RDMA-HIT] multimodal embedding read over rdma, %d slot(s)", slots)
        gbps = nbytes / read_s / 1e9 if read_s > 0 else float("inf")
        self._rl.log(logging.INFO, "bw", "[RDMA-BW] read %d bytes in %.3f ms: %.2f GB/s", nbytes, read_s * 1e3, gbps)


__all__ = ["RemoteOutputTransport", "Blame", "ConsumeFailure", "ReadPlan", "classify_consume_error"]
