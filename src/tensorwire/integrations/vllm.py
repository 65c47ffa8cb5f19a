"""tensorwire as a vLLM encoder-cache (EC) connector: encoder instances hand embeddings to LLM instances.

Load it from outside vLLM's tree with one flag per instance (docs/vllm.md has the commands)::

    # encoder instance (runs only the vision encoder)
    --ec-transfer-config '{"ec_connector": "TensorwireECConnector",
                           "ec_connector_module_path": "tensorwire.integrations.vllm",
                           "ec_role": "ec_producer", "ec_connector_extra_config": {"host": "0.0.0.0"}}'
    # LLM instance
    --ec-transfer-config '{"ec_connector": "TensorwireECConnector",
                           "ec_connector_module_path": "tensorwire.integrations.vllm", "ec_role": "ec_consumer"}'

The encoder instance's response carries ``ec_transfer_params`` (schema:
``tensorwire.integrations._vllm_ec.params``); a request to the LLM instance that carries them gets its
embeddings over ``tensorwire.rdma`` instead of encoding them. Everything the LLM instance needs travels in
those params; nothing flows from a worker back to a scheduler through vLLM. ``ec_both`` is not supported.

This module imports vLLM and refuses to load (ImportError naming the range) when vLLM is missing or outside
the tested range (``SUPPORTED``). The logic lives in ``tensorwire.integrations._vllm_ec`` (no vLLM import);
this class only maps vLLM's hooks onto it.
"""

from __future__ import annotations

from tensorwire.integrations._vllm_ec.version import SUPPORTED, require_vllm

VLLM_VERSION = require_vllm()

import logging  # noqa: E402  (after the version gate, on purpose)
from dataclasses import dataclass, field  # noqa: E402
from typing import TYPE_CHECKING, Any  # noqa: E402

import torch  # noqa: E402
from vllm.distributed.ec_transfer.ec_connector.base import (  # noqa: E402
    ECConnectorBase,
    ECConnectorMetadata,
    ECConnectorRole,
)

from tensorwire.errors import ConfigError  # noqa: E402
from tensorwire.integrations._vllm_ec import runtime as rt  # noqa: E402
from tensorwire.integrations._vllm_ec.config import ECConfig  # noqa: E402
from tensorwire.integrations._vllm_ec.consumer import ConsumerScheduler, ConsumerWorker  # noqa: E402
from tensorwire.integrations._vllm_ec.fetch import Fetcher, LocalStager, RemoteStager  # noqa: E402
from tensorwire.integrations._vllm_ec.metrics import CONSUMER, PRODUCER, metrics_for  # noqa: E402
from tensorwire.integrations._vllm_ec.producer import ProducerScheduler, ProducerStep, ProducerWorker  # noqa: E402
from tensorwire.integrations._vllm_ec.segments import SegmentSpares  # noqa: E402
from tensorwire.integrations._vllm_ec.trust import ProducerGate, ProducerTrust, compat_hash  # noqa: E402

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.request import Request

log = logging.getLogger(__name__)

_IN_PROCESS_BACKENDS = ("uni",)
_SUPPORTED_BACKENDS = ("uni", "mp")


@dataclass
class TensorwireECMetadata(ECConnectorMetadata):  # type: ignore[misc]  # (vLLM ships no type information)
    """One step's scheduler -> worker message: producer grants/revokes, consumer loads (mm_hash, staging key)."""

    grants: list[tuple[str, bytes]] = field(default_factory=list)
    revokes: list[tuple[str, bytes]] = field(default_factory=list)
    loads: list[tuple[str, str, Any]] = field(default_factory=list)  # (mm_hash, staging key, SegmentRef | None)


class TensorwireECConnector(ECConnectorBase):  # type: ignore[misc]  # (vLLM ships no type information)
    """vLLM's ``ECConnectorBase`` over tensorwire: see the module docstring and docs/vllm.md."""

    def __init__(self, vllm_config: VllmConfig, role: ECConnectorRole) -> None:
        super().__init__(vllm_config=vllm_config, role=role)
        ec = vllm_config.ec_transfer_config
        assert ec is not None  # the base class raised otherwise
        if self.is_producer and self.is_consumer:
            raise ConfigError(
                "TensorwireECConnector does not support ec_role 'ec_both'; run an ec_producer "
                "(encoder) instance and an ec_consumer (LLM) instance"
            )
        self._cfg = ECConfig.from_extra(ec.ec_connector_extra_config)
        pc = vllm_config.parallel_config
        backend = pc.distributed_executor_backend
        if backend not in _SUPPORTED_BACKENDS:
            raise ConfigError(f"TensorwireECConnector supports the {_SUPPORTED_BACKENDS} executors, not {backend!r}")
        if pc.pipeline_parallel_size > 1 or getattr(pc, "prefill_context_parallel_size", 1) > 1:
            raise ConfigError(
                "TensorwireECConnector is tested with pipeline_parallel_size=1 and prefill_context_parallel_size=1 only"
            )
        if getattr(pc, "nnodes", 1) > 1:
            raise ConfigError("TensorwireECConnector needs every tensor-parallel rank on one host (nnodes=1)")
        self._in_process = backend in _IN_PROCESS_BACKENDS
        self._tp = pc.tensor_parallel_size
        self._name = rt.instance_name(ec.engine_id, getattr(pc, "data_parallel_rank", 0) or 0)
        self._metrics = metrics_for(None, PRODUCER if self.is_producer else CONSUMER)
        self._model_config = vllm_config.model_config
        self._resolver: Any = None
        self._producer_sched: ProducerScheduler | None = None
        self._producer_worker: ProducerWorker | None = None
        self._consumer_sched: ConsumerScheduler | None = None
        self._consumer_worker: ConsumerWorker | None = None
        self._rank = 0
        if role == ECConnectorRole.SCHEDULER:
            rt.serve_metrics(self._cfg.metrics_port)
            if self.is_producer:
                self._init_producer_scheduler(vllm_config)
            else:
                self._init_consumer_scheduler()
        else:
            from vllm.distributed.parallel_state import get_pp_group, get_tensor_model_parallel_rank

            self._rank = get_tensor_model_parallel_rank()
            if self._cfg.metrics_port:
                rt.serve_metrics(self._cfg.metrics_port + 1 + self._rank)
            device = self._worker_device()
            if self.is_producer:
                exporting = self._rank == 0 and get_pp_group().is_first_rank
                store = None
                board = None
                if exporting:
                    store = rt.producer_runtime(
                        self._cfg, self._name, device, on_change=self._held_changed, compat=self._compat_hash()
                    ).store
                    if self._cfg.receipts:
                        board = rt.receipt_board(self._cfg, self._name)
                        board.clear()  # a dead instance's leftovers under the same name
                self._producer_worker = ProducerWorker(store, self._metrics, board)
            elif self._host_stages(device):
                self._consumer_worker = ConsumerWorker(None, self._metrics)  # maps the host's segments
            else:
                area = rt.staging_runtime(self._cfg, self._name, self._rank, device, serve=not self._in_process).area
                self._consumer_worker = ConsumerWorker(area, self._metrics)
        log.info(
            "TensorwireECConnector %s/%s for %s (vLLM %s, executor %s, tp %d)",
            role.name,
            "producer" if self.is_producer else "consumer",
            self._name,
            VLLM_VERSION,
            backend,
            self._tp,
        )

    # -- construction helpers --

    def _held_changed(self, items: int, nbytes: int) -> None:
        self._metrics.held_items.set(items)
        self._metrics.held_bytes.set(nbytes)

    def _init_producer_scheduler(self, vllm_config: VllmConfig) -> None:
        ec = vllm_config.ec_transfer_config
        assert ec is not None
        widths = ec.mm_encoder_output_widths
        board = None
        if self._cfg.receipts:
            board = rt.receipt_board(self._cfg, self._name)
            board.reader_here()  # a worker in this process leaves its receipts in memory
        self._producer_sched = ProducerScheduler(
            lambda: rt.producer_endpoint(self._cfg, self._name),
            self._metrics,
            dtype=self._model_config.dtype,
            width=lambda modality: widths.get(modality),
            ttl_ms=self._cfg.lease_ttl_ms,
            item_metadata=self._vllm_item_metadata,
            compat=self._compat_hash(),
            board=board,
        )

    def _compat_hash(self) -> str:
        """This instance's compatibility hash (``trust.compat_hash``), the same computation on both roles."""
        mc = self._model_config
        return compat_hash(
            vllm_version=VLLM_VERSION,
            model=self._cfg.model_identity or str(mc.model),
            revision=getattr(mc, "revision", None),
            dtype=str(mc.dtype),
            quantization=getattr(mc, "quantization", None),
        )

    def _host_stages(self, device: str) -> bool:
        """Workers in other processes on host memory: the scheduler process reads each item once into a shared
        segment every rank maps (``segments``). GPU ranks read into their own VRAM instead."""
        return not self._in_process and device == "cpu"

    def _init_consumer_scheduler(self) -> None:
        stagers: list[Any]
        if self._in_process:
            device = self._worker_device()
            area = rt.staging_runtime(self._cfg, self._name, 0, device, serve=False).area
            host = device == "cpu"
            stagers = [
                LocalStager(area, spares=SegmentSpares() if host else None, map_host=host and self._cfg.same_host_map)
            ]
        elif self._host_stages(self._worker_device()):
            stagers = [rt.segment_stager(self._cfg)]
        else:
            addresses = [rt.staging_address(self._cfg, self._name, r) for r in range(self._tp)]
            stagers = [
                RemoteStager(a, f"tp{r}", local_path=rt.staging_local_path(a), metrics=self._metrics)
                for r, a in enumerate(addresses)
            ]
        compat = self._compat_hash()
        fetcher = Fetcher(
            self._cfg, stagers, self._metrics, support_rdma=self._cfg.rdma_provider != "none", compat=compat
        )
        trust = ProducerTrust.from_config(self._cfg.trusted_producers, tls_ca=self._cfg.tls_ca)
        gate = ProducerGate(trust, compat)
        log.info("TensorwireECConnector %s reads from trusted producers: %s", self._name, trust.description)
        self._consumer_sched = ConsumerScheduler(
            self._cfg, fetcher, self._metrics, has_media=self._has_media, gate=gate
        )

    def _worker_device(self) -> str:
        if self._cfg.device != "auto":
            return self._cfg.device
        from vllm.platforms import current_platform

        if current_platform.is_cuda_alike() and torch.cuda.is_available():
            return f"cuda:{torch.cuda.current_device()}"
        return "cpu"

    def _metadata_resolver(self) -> Any:
        if self._resolver is None:
            from vllm.distributed.ec_transfer.ec_connector.utils import PlaceholderMetadataResolver

            self._resolver = PlaceholderMetadataResolver(self._model_config)
        return self._resolver

    def _vllm_item_metadata(self, request: Request) -> dict[str, Any]:
        from vllm.distributed.ec_transfer.ec_connector.utils import collect_ec_item_metadata

        return dict(collect_ec_item_metadata(request.mm_features, self._metadata_resolver()))

    def _has_media(self, feature: Any) -> bool:
        """Does the request still carry what vLLM needs to encode this item (not only placeholder metadata)?"""
        data = feature.data
        if data is None:
            return False
        metadata_only = self._metadata_resolver().fields_for(feature.modality)
        return any(elem.data is not None for key, elem in data.items() if key not in metadata_only)

    def _meta(self) -> TensorwireECMetadata:
        meta = self._get_connector_metadata()
        assert isinstance(meta, TensorwireECMetadata)
        return meta

    # -- worker side --

    def start_load_caches(self, encoder_cache: dict[str, torch.Tensor], **kwargs: Any) -> None:
        if self._consumer_worker is not None:
            self._consumer_worker.start_load_caches(encoder_cache, self._meta().loads)

    def start_save_caches(self, **kwargs: Any) -> None:
        if self._producer_worker is not None:
            meta = self._meta()
            self._producer_worker.start_save_caches(
                kwargs.get("encoder_cache"), ProducerStep(meta.grants, meta.revokes)
            )

    def save_caches(self, encoder_cache: dict[str, torch.Tensor], mm_hash: str, **kwargs: Any) -> None:
        if self._producer_worker is not None:
            self._producer_worker.save_caches(encoder_cache, mm_hash)

    # -- scheduler side --

    def has_cache_item(self, identifier: str) -> bool:
        return self._consumer_sched is not None and self._consumer_sched.has_cache_item(identifier)

    def ensure_cache_available(self, request: Request, num_computed_tokens: int) -> bool:
        if self._consumer_sched is None:
            return True
        return self._consumer_sched.ensure_cache_available(request, num_computed_tokens)

    def update_state_after_alloc(self, request: Request, index: int) -> None:
        if self._consumer_sched is not None:
            self._consumer_sched.update_state_after_alloc(request, index)

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> ECConnectorMetadata:
        if self._producer_sched is not None:
            step = self._producer_sched.build_step(scheduler_output.scheduled_new_reqs)
            return TensorwireECMetadata(grants=step.grants, revokes=step.revokes)
        if self._consumer_sched is not None:
            return TensorwireECMetadata(loads=self._consumer_sched.take_loads())
        return TensorwireECMetadata()

    def take_unavailable_requests(self) -> set[str]:
        return self._consumer_sched.take_unavailable_requests() if self._consumer_sched is not None else set()

    def request_finished(self, request: Request) -> tuple[bool, dict[str, Any] | None]:
        if self._producer_sched is not None:
            from vllm.v1.request import RequestStatus

            ok = request.status not in (
                RequestStatus.FINISHED_ABORTED,
                RequestStatus.FINISHED_IGNORED,
                RequestStatus.FINISHED_ERROR,
            )
            return False, self._producer_sched.request_finished(request, finished_ok=ok)
        if self._consumer_sched is not None:
            self._consumer_sched.request_finished(request)
        return False, None

    def shutdown(self) -> None:
        if self._consumer_sched is not None:
            self._consumer_sched.close()
            self._consumer_sched = None
            if self._in_process:
                rt.close_staging(self._name, 0)
        if self._producer_worker is not None and self._producer_worker.store is not None:
            rt.close_producer(self._name)
            self._producer_worker = None
        if self._consumer_worker is not None:
            rt.close_staging(self._name, self._rank)
            self._consumer_worker = None


__all__ = ["TensorwireECConnector", "TensorwireECMetadata", "SUPPORTED", "VLLM_VERSION"]
