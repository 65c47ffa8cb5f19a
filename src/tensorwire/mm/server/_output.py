"""Encoder side: OutputTransport turns an EncoderOutput into a receipt (RDMA slots or inline tensors).

Decision (per request): RDMA only when the config mode is ``auto``, the caller advertised ``support_rdma``, the
caller did not exclude this worker, the exporter is built, every tensor is exportable, and the caller's peer
stays within its quota of leased bytes (``PeerLeases``; the peer is ``current_call().peer``); otherwise inline
in the same response. An RDMA attempt that fails in any way (planning, export, descriptor serialization) rolls
back every lease of the request and answers inline, counting the reason on ``tensorwire_mm_fallbacks_total``
(degrades are not errors).

The exporter is built at ``start()``, on a background thread, off the request path, with its metadata endpoint
on the address the control plane is bound to (``rdma_config``). A permanent failure
(no provider, bad config) disables RDMA for the process with one WARNING; any other failure is retried with
exponential backoff (``init_backoff_ms`` doubling to ``init_backoff_max_ms``) until it succeeds or
``close()``. Leases a reader never releases are reclaimed by the exporter's TTL GC.

Zero-copy outputs: ``allocate_output`` hands the encoder an embedding (and position-id) tensor that already
lives in a registered slot. When the EncoderOutput returned to ``transfer`` carries exactly those tensors, the
slot is published as is (``TensorExporter.export_allocated``): no export copy. On every other path (inline
answer, mismatch, failure) the bytes are taken from the buffers first and the lease is released after, so an
allocation never outlives its request: ``transfer`` also ends every other allocation its thread made, and
``EncoderService`` calls ``release_pending`` when the encoder raises. An allocation made on one thread and
never handed to ``transfer`` elsewhere is left to ``release_output`` or, at worst, the TTL GC (counted).

Inline receipts (``WireReceipt``) hold the output's host bytes by reference (``_codec.host_view``): a contiguous
host tensor is copied once, when the service serializes the receipt right after ``transfer`` returns; a device
tensor is copied to pinned host memory here first. When this transfer ends an allocation (slot memory), the
bytes are copied out of it here, before the lease goes back.

Thread-safety: ``transfer``, ``allocate_output`` and ``release`` may run on many gRPC threads at once.
"""

from __future__ import annotations

import logging
import os
import socket
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from tensorwire._grpc.scope import current_call
from tensorwire._ratelog import RateLimitedLog
from tensorwire.errors import ExportError, Reason, TensorwireError
from tensorwire.mm._background import BackgroundInit, InitState, is_permanent
from tensorwire.mm._config import MODE_AUTO, TransportConfig
from tensorwire.mm._metrics import TransportMetrics, metrics_for
from tensorwire.mm._proto import encoder_pb2 as pb
from tensorwire.mm._types import EncoderOutput
from tensorwire.mm.server._quota import PeerLeases
from tensorwire.mm.wire import _codec, _placed
from tensorwire.mm.wire._placed import Placement
from tensorwire.mm.wire._receipt import WireReceipt
from tensorwire.rdma import Descriptor, Exporter, Lease, RdmaConfig
from tensorwire.rdma._pool import bucket_bytes

log = logging.getLogger(__name__)


ExporterFactory = Callable[[RdmaConfig], Exporter]


@dataclass(eq=False)
class OutputBuffers:
    """Output tensors inside one RDMA slot (``OutputTransport.allocate_output``): write them in place, return them
    as ``EncoderOutput(embeddings=buffers.embedding, split_sizes=..., position_ids=buffers.position_ids)``.

    They are valid until ``transfer`` returns (or ``release_output``): after that the slot belongs to the reader
    or to the next request.
    """

    embedding: torch.Tensor
    position_ids: torch.Tensor | None
    lease: Lease | None  # None: the tensors are in the caller's receive buffer (``placement``), not in a slot
    thread: int = 0  # the allocating thread: its next transfer() ends this allocation if it is not the output
    allocate_us: int = 0  # what allocate_output took: transport work inside the encoder's compute time
    placement: Placement | None = None

    def matches(self, emb: torch.Tensor, pos: torch.Tensor | None, extras: Sequence[torch.Tensor]) -> bool:
        """True when the output is exactly these buffers (same storage, shape and dtype), nothing else."""
        if extras or not _same_tensor(emb, self.embedding):
            return False
        if pos is None or self.position_ids is None:
            return pos is None and self.position_ids is None
        return _same_tensor(pos, self.position_ids)


def _same_tensor(a: torch.Tensor, b: torch.Tensor) -> bool:
    return (
        a.data_ptr() == b.data_ptr()
        and a.shape == b.shape
        and a.dtype == b.dtype
        and a.device == b.device
        and a.is_contiguous()
    )


def _default_exporter_factory(rdma_config: RdmaConfig) -> Exporter:
    from tensorwire.rdma import TensorExporter

    return TensorExporter(rdma_config)


ExporterState = InitState


def _gc_reader(exporter: Exporter) -> Callable[[], float]:
    def reclaimed() -> float:
        try:
            return float(exporter.stats().gc_reclaims)
        except Exception:  # a scrape must not fail because of the exporter
            log.debug("exporter stats for the GC gauge failed", exc_info=True)
            return 0.0

    return reclaimed


def _align_up(n: int, align: int) -> int:
    return (n + align - 1) // align * align


def plan_slots(
    embedding: torch.Tensor,
    position_ids: torch.Tensor | None,
    extra_inputs: Sequence[torch.Tensor],
    max_slot_bytes: int,
    align: int,
) -> list[tuple[list[torch.Tensor], list[pb.Role]]]:
    """Groups of (tensors, roles), one per slot, in reassembly order; no slot's aligned footprint exceeds
    ``max_slot_bytes``. The embedding is split along dim 0 into whole-row chunks. ExportError(SLOT_TOO_LARGE)
    when one embedding row or one other tensor cannot fit in a slot."""
    rows = int(embedding.shape[0])
    row_bytes = embedding[0].numel() * embedding.element_size() if rows else 0
    if rows == 0 or row_bytes == 0:
        raise ExportError("embedding has no bytes to export", reason=Reason.EMPTY_EXPORT)
    rows_per_slot = max_slot_bytes // row_bytes
    while rows_per_slot > 0 and _align_up(rows_per_slot * row_bytes, align) > max_slot_bytes:
        rows_per_slot = (max_slot_bytes // align * align) // row_bytes
        if _align_up(rows_per_slot * row_bytes, align) > max_slot_bytes:
            rows_per_slot -= 1
    if rows_per_slot <= 0:
        raise ExportError(
            f"one embedding row is {row_bytes} bytes; max_slot_bytes={max_slot_bytes} "
            f"(aligned to {align}) cannot hold it",
            reason=Reason.SLOT_TOO_LARGE,
        )
    groups: list[tuple[list[torch.Tensor], list[pb.Role]]] = []
    footprints: list[int] = []
    for start in range(0, rows, rows_per_slot):
        n = min(rows_per_slot, rows - start)
        chunk = embedding.narrow(0, start, n)
        groups.append(([chunk], [pb.EMBEDDING]))
        footprints.append(_align_up(n * row_bytes, align))
    tail = ([(position_ids, pb.POS_ID)] if position_ids is not None else []) + [
        (t, pb.EXTRA_INPUT) for t in extra_inputs
    ]
    for t, role in tail:
        fp = _align_up(t.numel() * t.element_size(), align)
        if fp > max_slot_bytes:
            raise ExportError(
                f"a {_codec.ROLE_LABELS[role]} tensor of {t.numel() * t.element_size()} bytes exceeds "
                f"max_slot_bytes={max_slot_bytes}",
                reason=Reason.SLOT_TOO_LARGE,
            )
        if footprints[-1] + fp <= max_slot_bytes:
            groups[-1][0].append(t)
            groups[-1][1].append(role)
            footprints[-1] += fp
        else:
            groups.append(([t], [role]))
            footprints.append(fp)
    return groups


class OutputTransport:
    """Encoder-side transport: ``transfer(request, output) -> receipt`` and ``release(lease_ids)``.

    ``request`` is the EncodeRequest the caller sent (its ``support_rdma`` and ``rdma_excluded_workers`` are
    read); the receipt is a ``WireReceipt`` (the EncodeResponse, with inline tensor bytes held by reference).
    ``start()`` begins building the exporter (``serve_encoder`` calls it); ``close()`` is idempotent and releases
    the exporter, after which ``transfer`` answers inline.
    """

    def __init__(
        self,
        config: TransportConfig | None = None,
        *,
        exporter_factory: ExporterFactory | None = None,
        metrics: TransportMetrics | None = None,
        worker_id: str | None = None,
        worker_address: str = "",
    ) -> None:
        self.config = config if config is not None else TransportConfig()
        self.metrics = metrics if metrics is not None else metrics_for(None)
        self.worker_id = worker_id or self.config.worker_id or f"{socket.gethostname()}-{os.getpid()}"
        self.worker_address = worker_address
        factory = exporter_factory or _default_exporter_factory
        cfg = self.config

        def on_ready(exporter: Exporter) -> None:
            self.metrics.exporter_ready.set(1)
            self.metrics.watch_gc(_gc_reader(exporter))
            self.metrics.watch_exporter(exporter.stats)

        def on_failure(exc: BaseException, permanent: bool) -> None:
            self.metrics.fallbacks.labels("encoder", "rdma_init_failed").inc()

        self._holder: BackgroundInit[Exporter] = BackgroundInit(
            "exporter",
            lambda: factory(self.rdma_config()),
            is_permanent,
            backoff_s=cfg.init_backoff_ms / 1000.0,
            backoff_max_s=cfg.init_backoff_max_ms / 1000.0,
            on_ready=on_ready,
            on_failure=on_failure,
        )
        self._rl = RateLimitedLog(log)
        self._closed = False
        self._buffers: dict[int, OutputBuffers] = {}  # embedding data_ptr -> allocation awaiting transfer()
        self._buffers_lock = threading.Lock()
        self.peer_leases = PeerLeases(cfg.effective_peer_leased_bytes, cfg.rdma.slot_gc_timeout_ms / 1000.0)

    def rdma_config(self) -> RdmaConfig:
        """The RdmaConfig the exporter is built with: ``config.rdma`` with ``control_host`` set to the host of
        ``worker_address`` (the gRPC server's bound address, set before ``start``), so that the metadata endpoint
        follows the control plane's address (rules: docs/deployment.md "Addresses")."""
        host = self.worker_address.rsplit(":", 1)[0] if ":" in self.worker_address else ""
        return self.config.rdma.replace(control_host=host) if host else self.config.rdma

    @property
    def exporter_state(self) -> ExporterState:
        return self._holder.state

    def start(self) -> None:
        """Begins building the exporter in the background (mode auto only); idempotent."""
        if self.config.mode == MODE_AUTO:
            self._holder.start()

    def wait_ready(self, timeout_s: float) -> bool:
        return self._holder.wait_ready(timeout_s)

    def allocate_output(
        self,
        rows: int,
        hidden: int,
        dtype: torch.dtype = torch.bfloat16,
        *,
        position_cols: int = 0,
        position_dtype: torch.dtype = torch.int64,
    ) -> OutputBuffers | None:
        """Tensors for the encoder to write its output into, inside one registered slot (no export copy later).

        ``None`` when that cannot help (mode grpc, exporter not built, closed, the output needs more than one slot,
        or the allocation failed): then produce the output as usual.
        """
        t0 = time.perf_counter()
        if self._closed or rows <= 0:
            return None
        specs: list[tuple[tuple[int, ...], torch.dtype]] = [((int(rows), int(hidden)), dtype)]
        if position_cols:
            specs.append(((int(rows), int(position_cols)), position_dtype))
        placement = current_call().placement
        if placement is not None:
            placed = placement.views(specs)
            if placed is not None:
                return self._keep(
                    OutputBuffers(
                        placed[0],
                        placed[1] if position_cols else None,
                        None,
                        threading.get_ident(),
                        int((time.perf_counter() - t0) * 1e6),
                        placement,
                    )
                )
        if self.config.mode != MODE_AUTO:
            return None
        exporter = self._holder.get()
        if exporter is None:
            return None
        try:
            lease, tensors = exporter.allocate(specs)
        except TensorwireError as exc:
            if exc.reason is not Reason.SLOT_TOO_LARGE:  # too large for one slot: not a degrade, the copy path splits
                self.metrics.fallbacks.labels("encoder", "allocate_" + exc.reason.value).inc()
            return None
        return self._keep(
            OutputBuffers(
                tensors[0],
                tensors[1] if position_cols else None,
                lease,
                threading.get_ident(),
                int((time.perf_counter() - t0) * 1e6),
            )
        )

    def _keep(self, buffers: OutputBuffers) -> OutputBuffers:
        with self._buffers_lock:
            self._buffers[buffers.embedding.data_ptr()] = buffers
        return buffers

    def release_output(self, buffers: OutputBuffers) -> None:
        """Gives back an allocation that will not reach ``transfer`` (the encoder failed); idempotent."""
        with self._buffers_lock:
            if self._buffers.get(buffers.embedding.data_ptr()) is buffers:
                del self._buffers[buffers.embedding.data_ptr()]
        if buffers.lease is not None:
            self.release([buffers.lease.lease_id])

    def _claim_buffers(self, emb: torch.Tensor | None) -> tuple[OutputBuffers | None, list[OutputBuffers]]:
        """(the allocation holding ``emb``, every other allocation this thread made): this request's."""
        if not self._buffers:
            return None, []
        me = threading.get_ident()
        with self._buffers_lock:
            own = self._buffers.pop(emb.data_ptr(), None) if emb is not None else None
            rest = [k for k, b in self._buffers.items() if b.thread == me]
            return own, [self._buffers.pop(k) for k in rest]

    def release_pending(self) -> int:
        """Ends the allocations the calling thread made and did not pass to ``transfer`` (the encoder failed)."""
        _, stale = self._claim_buffers(None)
        return self.release([b.lease.lease_id for b in stale if b.lease is not None])

    def transfer(self, request: pb.EncodeRequest, output: EncoderOutput) -> WireReceipt:
        """The receipt for ``output``: RDMA slots, or the inline tensors as views of the output's host memory
        (serialize it before the output's tensors change: ``WireReceipt.to_bytes``; the service does at once)."""
        buffers: OutputBuffers | None = None
        stale: list[OutputBuffers] = []
        try:
            emb, splits, pos, extras = output.flatten()
        except Exception:
            self.release_pending()  # an inconsistent output still ends this request's allocations
            raise
        try:
            buffers, stale = self._claim_buffers(emb)
            return self._transfer(request, emb, splits, pos, extras, buffers, bool(stale))
        finally:
            # Exported in place: the lease now belongs to the reader. Otherwise the bytes were copied out of the
            # buffers above (or the output was something else), so the allocation ends here.
            ended = [b.lease.lease_id for b in stale if b.lease is not None]
            if buffers is not None and buffers.lease is not None and not buffers.lease.exported:
                ended.append(buffers.lease.lease_id)
            if ended:
                self.release(ended)

    def _transfer(
        self,
        request: pb.EncodeRequest,
        emb: torch.Tensor | None,
        splits: list[int],
        pos: torch.Tensor | None,
        extras: list[torch.Tensor],
        buffers: OutputBuffers | None,
        ends_allocations: bool,
    ) -> WireReceipt:
        out = WireReceipt()
        receipt = out.message
        receipt.worker.worker_id = self.worker_id
        receipt.worker.address = self.worker_address
        if emb is None:
            self.metrics.requests.labels("encoder", "inline").inc()
            return out
        receipt.split_sizes[:] = splits
        placement = current_call().placement
        if placement is not None and self._try_place(placement, emb, pos, extras, buffers, receipt):
            return out
        exporter, why_not = self._rdma_choice(request, emb, pos, extras)
        if exporter is not None:
            peer = current_call().peer.key
            payload = sum(t.numel() * t.element_size() for t in (emb, *([pos] if pos is not None else []), *extras))
            nbytes = self._pinned(payload)
            if not self.peer_leases.reserve(peer, nbytes):
                exporter, why_not = None, Reason.PEER_QUOTA.value
                self._rl.log(
                    logging.INFO,
                    "peer-quota",
                    "a peer holds its quota of %d leased bytes; answering "
                    "it inline until it releases (peer_leased_bytes)",
                    self.peer_leases.cap_bytes,
                )
        if exporter is not None:
            t0 = time.perf_counter()
            slots: list[pb.RdmaSlot] | None = None
            leased: list[Descriptor] = []
            try:
                if buffers is not None and buffers.lease is not None and buffers.matches(emb, pos, extras):
                    slots = self._try_publish(exporter, buffers, buffers.lease, emb, pos, leased)
                    if slots is not None:
                        receipt.encoder_stage_us["allocate"] = buffers.allocate_us
                else:
                    slots = self._try_export(exporter, emb, pos, extras, leased)
            finally:
                self.peer_leases.settle(
                    peer,
                    nbytes,
                    [(d.lease_id, self._pinned(int(d.payload_bytes))) for d in leased] if slots is not None else [],
                )
            if slots is not None:
                receipt.rdma_slots.extend(slots)
                receipt.encoder_stage_us["export"] = int((time.perf_counter() - t0) * 1e6)
                self.metrics.child(self.metrics.requests, "encoder", "rdma").inc()
                return out
        elif why_not is not None:
            self.metrics.fallbacks.labels("encoder", why_not).inc()
        # Inline: the receipt views the output's host bytes, copied once when it is serialized. Slot memory goes
        # back to the pool when transfer() returns (before that), so an output in an allocation is copied now.
        t0 = time.perf_counter()
        private = buffers is not None or ends_allocations or placement is not None
        out.embedding = _codec.host_view(emb, receipt.embedding, private=private)
        self.metrics.bytes.labels("encoder", "inline", "embedding").inc(len(out.embedding))
        if pos is not None:
            out.position_ids = _codec.host_view(pos, receipt.position_ids, private=private)
            self.metrics.bytes.labels("encoder", "inline", "pos_id").inc(len(out.position_ids))
        for t in extras:
            out.extra_inputs.append(_codec.host_view(t, receipt.extra_inputs.add(), private=private))
            self.metrics.bytes.labels("encoder", "inline", "extra_input").inc(len(out.extra_inputs[-1]))
        receipt.encoder_stage_us["serialize"] = int((time.perf_counter() - t0) * 1e6)
        self.metrics.requests.labels("encoder", "inline").inc()
        return out

    def _try_place(
        self,
        placement: Placement,
        emb: torch.Tensor,
        pos: torch.Tensor | None,
        extras: list[torch.Tensor],
        buffers: OutputBuffers | None,
        receipt: pb.EncodeResponse,
    ) -> bool:
        """Writes the output into the caller's receive buffer (in place already when it came from
        ``allocate_output``) and describes it in ``receipt.placed``; False (``placed.declined`` says why) when the
        output goes by another plane."""
        tensors = [emb, *([pos] if pos is not None else []), *extras]
        roles = [pb.EMBEDDING, *([pb.POS_ID] if pos is not None else []), *([pb.EXTRA_INPUT] * len(extras))]
        placed = receipt.placed
        placed.buffer_id = placement.buffer.buffer_id
        base = placement.buffer.tensor
        lo, hi = base.data_ptr(), base.data_ptr() + placement.buffer.nbytes
        in_place = buffers is not None and buffers.placement is placement and buffers.matches(emb, pos, extras)
        why = ""
        offsets: list[int] | None = None
        if any(t.dtype not in _codec.SUPPORTED_DTYPES for t in tensors):
            why = Reason.UNSUPPORTED_DTYPE.value
        elif in_place:
            offsets = [t.data_ptr() - lo for t in tensors]
        else:
            offsets = _placed.plan([(tuple(t.shape), t.dtype) for t in tensors], placement.buffer.nbytes)
            if offsets is None:
                why = "too_large"
                placed.needed_bytes = _placed.needed_bytes(tensors)
            # A tensor already in the buffer (from allocate_output, the rest of the output not) must sit where
            # the plan puts it: the copies of the others then never overwrite it.
            elif any(
                lo <= t.data_ptr() < hi and (t.data_ptr() - lo != off or not t.is_contiguous())
                for t, off in zip(tensors, offsets, strict=True)
                if t.numel()
            ):
                why = "output_overlaps_buffer"
        if why or offsets is None:
            placed.declined = why
            self.metrics.fallbacks.labels("encoder", "placement_" + why).inc()
            return False
        t0 = time.perf_counter()
        if not in_place:
            for t, off in zip(tensors, offsets, strict=True):
                if t.numel() and t.data_ptr() - lo != off:  # not there already
                    placement.buffer.view(off, tuple(t.shape), t.dtype).copy_(t, non_blocking=True)
        if base.is_cuda:  # the encoder's writes (and ours) are on this stream: done before the caller looks
            torch.cuda.current_stream(base.device).synchronize()
        elif any(t.is_cuda for t in tensors):
            torch.cuda.synchronize()
        for t, off, role in zip(tensors, offsets, roles, strict=True):
            nbytes = t.numel() * t.element_size()
            placed.tensors.add(
                role=role, dtype=_codec.DTYPE_TO_WIRE[t.dtype], shape=list(t.shape), offset=off, nbytes=nbytes
            )
            self.metrics.child(self.metrics.bytes, "encoder", "placed", _codec.ROLE_LABELS[role]).inc(nbytes)
        receipt.encoder_stage_us["place"] = int((time.perf_counter() - t0) * 1e6)
        if buffers is not None and in_place:
            receipt.encoder_stage_us["allocate"] = buffers.allocate_us
        self.metrics.child(self.metrics.requests, "encoder", "placed").inc()
        return True

    def _pinned(self, payload: int) -> int:
        """Pool bytes ``payload`` bytes hold: the size of the slot it lands in (quotas count what is pinned)."""
        return bucket_bytes(payload, int(self.config.rdma.max_slot_bytes))

    def _rdma_choice(
        self, request: pb.EncodeRequest, emb: torch.Tensor, pos: torch.Tensor | None, extras: list[torch.Tensor]
    ) -> tuple[Exporter | None, str | None]:
        """(exporter, None) to try RDMA; (None, reason) for a counted degrade; (None, None) when not asked."""
        if self.config.mode != MODE_AUTO or not request.support_rdma or self._closed:
            return None, None
        if self.worker_id in request.rdma_excluded_workers:
            return None, Reason.BREAKER_OPEN.value
        exporter = self._holder.get()
        if exporter is None:
            return None, Reason.PROVIDER_UNAVAILABLE.value
        for t in [emb, *([pos] if pos is not None else []), *extras]:
            if t.dtype not in _codec.SUPPORTED_DTYPES:
                return None, Reason.UNSUPPORTED_DTYPE.value
            if t.numel() == 0:
                return None, Reason.EMPTY_EXPORT.value
        return exporter, None

    def _try_publish(
        self,
        exporter: Exporter,
        buffers: OutputBuffers,
        lease: Lease,
        emb: torch.Tensor,
        pos: torch.Tensor | None,
        leased: list[Descriptor],
    ) -> list[pb.RdmaSlot] | None:
        """The zero-copy path: the output already lives in the slot; publish it. None -> answer inline."""
        try:
            desc = exporter.export_allocated(lease)
            leased.append(desc)
            slot = pb.RdmaSlot(descriptor=desc.to_bytes())
            slot.roles.append(pb.EMBEDDING)
            if pos is not None:
                slot.roles.append(pb.POS_ID)
        except Exception as exc:
            self._count_degrade(exc, 0)
            return None
        self.metrics.child(self.metrics.bytes, "encoder", "rdma", "embedding").inc(emb.numel() * emb.element_size())
        if pos is not None:
            self.metrics.child(self.metrics.bytes, "encoder", "rdma", "pos_id").inc(pos.numel() * pos.element_size())
        return [slot]

    def _count_degrade(self, exc: BaseException, rolled_back: int) -> None:
        reason = exc.reason.value if isinstance(exc, TensorwireError) else Reason.EXPORT_FAILED.value
        self.metrics.fallbacks.labels("encoder", reason).inc()
        self._rl.log(
            logging.WARNING,
            "export-" + reason,
            "RDMA export failed (%s: %s); rolled back %d lease(s), answering inline",
            type(exc).__name__,
            exc,
            rolled_back,
        )

    def _try_export(
        self,
        exporter: Exporter,
        emb: torch.Tensor,
        pos: torch.Tensor | None,
        extras: list[torch.Tensor],
        leased: list[Descriptor],
    ) -> list[pb.RdmaSlot] | None:
        descs: list[Descriptor] = []
        try:
            emb = emb.contiguous()
            pos = pos.to(emb.device).contiguous() if pos is not None else None
            extras = [e.to(emb.device).contiguous() for e in extras]
            groups = plan_slots(
                emb, pos, extras, int(self.config.rdma.max_slot_bytes), int(self.config.rdma.slot_align)
            )
            descs = list(exporter.export_batch([g for g, _ in groups]))
            leased.extend(descs)
            if len(descs) != len(groups):
                raise ExportError(
                    f"exporter returned {len(descs)} descriptors for {len(groups)} groups",
                    reason=Reason.RESULT_MISMATCH,
                )
            slots = []
            for desc, (tensors, roles) in zip(descs, groups, strict=True):
                if len(desc.manifest) != len(roles):
                    raise ExportError(
                        f"descriptor manifest has {len(desc.manifest)} entries for {len(roles)} tensors",
                        reason=Reason.RESULT_MISMATCH,
                    )
                slot = pb.RdmaSlot(descriptor=desc.to_bytes())
                slot.roles.extend(roles)
                slots.append(slot)
                for t, role in zip(tensors, roles, strict=True):
                    counter = self.metrics.child(self.metrics.bytes, "encoder", "rdma", _codec.ROLE_LABELS[role])
                    counter.inc(t.numel() * t.element_size())
            return slots
        except Exception as exc:
            lease_ids = [d.lease_id for d in descs if d.lease_id]
            if lease_ids:
                try:
                    exporter.release(lease_ids)
                except Exception as rexc:
                    self.metrics.errors.labels("encoder", "rdma_release_error").inc()
                    log.warning("rollback of %d lease(s) failed: %r; the TTL GC reclaims them", len(lease_ids), rexc)
            self._count_degrade(exc, len(lease_ids))
            return None

    def discard(self, receipt: WireReceipt) -> int:
        """Releases the leases of a receipt that will never reach its reader (the caller went away)."""
        ids = []
        for slot in receipt.message.rdma_slots:
            try:
                ids.append(Descriptor.from_bytes(slot.descriptor).lease_id)
            except Exception:
                continue  # not parseable here: the TTL GC reclaims it
        return self.release(ids)

    def release(self, lease_ids: Sequence[str]) -> int:
        """Returns leases to the exporter (idempotent). Returns how many ids named a live lease; the rest (already
        released, reclaimed, never minted, or not ours) are counted as unknown."""
        ids = [i for i in lease_ids if i]
        if not ids:
            return 0
        self.peer_leases.remove(ids)
        exporter = self._holder.get()
        if exporter is None:
            # Closed or never built: nothing of ours can be leased; the ids are stale or foreign.
            self.metrics.exported_leases_released.labels("no_exporter").inc(len(ids))
            return 0
        try:
            ended = exporter.release(ids)
        except Exception as exc:
            self.metrics.errors.labels("encoder", "rdma_release_error").inc()
            self.metrics.exported_leases_released.labels("error").inc(len(ids))
            self._rl.log(
                logging.WARNING, "release", "releasing %d lease(s) failed: %r; the TTL GC reclaims them", len(ids), exc
            )
            return 0
        released = len(ids) if ended is None else int(ended)  # None: an exporter of the older protocol
        self.metrics.child(self.metrics.exported_leases_released, "ok").inc(released)
        if released < len(ids):
            self.metrics.child(self.metrics.exported_leases_released, "unknown").inc(len(ids) - released)
        return released

    def live_leases(self) -> int:
        """Exported leases not yet released or reclaimed (0 without an exporter)."""
        exporter = self._holder.get()
        if exporter is None:
            return 0
        try:
            return int(exporter.stats().live_leases)
        except Exception:  # a closed exporter holds nothing
            return 0

    def wait_released(self, deadline: float, poll_s: float = 0.05) -> int:
        """Waits until every exported lease is released (or reclaimed) or ``deadline`` (time.monotonic) passes;
        returns how many are still out. A stopping server calls this before ``close()``, so that readers of
        receipts it already sent can still read them."""
        left = self.live_leases()
        if left:
            log.info(
                "waiting up to %.1f s for %d exported lease(s) to be released",
                max(0.0, deadline - time.monotonic()),
                left,
            )
        while left and time.monotonic() < deadline:
            time.sleep(min(poll_s, max(0.0, deadline - time.monotonic())))
            left = self.live_leases()
        return left

    def close(self) -> None:
        self._closed = True
        self._holder.close()
        self.peer_leases.clear()
        self.metrics.exporter_ready.set(0)

    def __enter__(self) -> OutputTransport:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


__all__ = ["OutputTransport", "OutputBuffers", "ExporterState", "plan_slots"]
