"""Encoder-instance (producer) logic: export every saved output, announce it with a grant, nothing flows back.

Why grants are minted by the scheduler: vLLM's ``request_finished`` (which builds the response's
``ec_transfer_params``) runs in the scheduler, while the tensors are in a worker; on the CPU (V1) model runner an
encoder-only instance's worker metadata never reaches its scheduler, and ``request_finished`` runs before
``update_connector_output`` anyway. So the scheduler decides everything the params carry and only ever sends it
*down*, in the step metadata:

- ``build_connector_meta``: each request scheduled for the first time gets one random secret per item
  (:func:`tensorwire.mm.new_secret`), sent to the workers as grants.
- worker ``start_save_caches`` (before the step's encoder runs): each grant is added to the held-outputs store
  (:class:`tensorwire.mm.HeldStore`); an item already in vLLM's encoder cache but not held (vLLM will
  not encode it again) is exported from there.
- worker ``save_caches`` (vLLM just encoded an item): exported under its mm_hash; pending grants attach; the
  item's receipt goes on the instance's :class:`~tensorwire.integrations._vllm_ec.receipts.ReceiptBoard`.
- ``request_finished``: the params (endpoint, key, secret, shape, dtype, compatibility hash) of every item of the
  request. The
  endpoint is the worker's store server (same process: asked directly; other process: the rendezvous file the
  worker wrote, see ``runtime``); the shape is the item's placeholder count by the encoder output width vLLM
  measured at start-up; the dtype the model's; the receipt the worker left on the board (the step that held the
  item ended before this runs), else none (the LLM instance then looks the item up).
- A request that does not finish normally (aborted, error) is not announced; its grants are revoked in the next
  step's metadata, and the TTL reclaims them if no step comes.

Only the first tensor-parallel rank exports (every rank computes the same encoder output).
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from collections.abc import Callable, Iterable, Mapping, MutableMapping
from dataclasses import dataclass
from typing import Any

import torch

from tensorwire.errors import Reason, TensorwireError
from tensorwire.integrations._vllm_ec.metrics import ECMetrics
from tensorwire.integrations._vllm_ec.params import ItemGrant, entry_for
from tensorwire.integrations._vllm_ec.receipts import ReceiptBoard, announceable
from tensorwire.mm.held._store import HeldStore, new_secret

log = logging.getLogger(__name__)

# Receipts the scheduler took from the board, kept for later requests of the same item (the worker holds an
# item once, so its receipt reaches the board once). A stale one only costs the LLM instance a Lookup.
_RECENT_RECEIPTS = 1024

_DTYPE_NAMES = {
    torch.float32: "float32",
    torch.float16: "float16",
    torch.bfloat16: "bfloat16",
    torch.float64: "float64",
}


@dataclass
class ProducerStep:
    """What one step's metadata carries down to the workers."""

    grants: list[tuple[str, bytes]]
    revokes: list[tuple[str, bytes]]


class ProducerScheduler:
    """The scheduler half of the producer. ``endpoint()`` returns the store's address or None (not known yet).

    ``width(modality)`` is the encoder output width (None: unknown, the shape is then not announced);
    ``item_metadata(request)`` returns vLLM's own per-item entries (placeholder metadata) to merge in;
    ``compat`` is this instance's compatibility hash (``trust.compat_hash``), announced with every item;
    ``board`` where the worker leaves each held item's receipt (None: items are announced without one).
    """

    def __init__(
        self,
        endpoint: Callable[[], str | None],
        metrics: ECMetrics,
        *,
        dtype: torch.dtype,
        width: Callable[[str], int | None],
        ttl_ms: int,
        item_metadata: Callable[[Any], Mapping[str, Any]] | None = None,
        compat: str | None = None,
        board: ReceiptBoard | None = None,
    ) -> None:
        self._endpoint = endpoint
        self._board = board
        self._recent: OrderedDict[str, bytes] = OrderedDict()
        self._compat = compat
        self._metrics = metrics
        self._dtype = _DTYPE_NAMES.get(dtype)
        self._width = width
        self._ttl_ms = ttl_ms
        self._item_metadata = item_metadata
        self._grants: dict[str, dict[str, bytes]] = {}  # request id -> mm_hash -> secret
        self._revokes: list[tuple[str, bytes]] = []

    def build_step(self, new_requests: Iterable[Any]) -> ProducerStep:
        grants: list[tuple[str, bytes]] = []
        for req in new_requests:
            rid = req.req_id
            mine = self._grants.setdefault(rid, {})
            for feat in req.mm_features or []:
                if feat.identifier in mine:
                    continue
                secret = new_secret()
                mine[feat.identifier] = secret
                grants.append((feat.identifier, secret))
        if grants:
            self._metrics.grants.labels("issued").inc(len(grants))
        revokes, self._revokes = self._revokes, []
        return ProducerStep(grants, revokes)

    def request_finished(self, request: Any, *, finished_ok: bool) -> dict[str, Any] | None:
        mine = self._grants.pop(request.request_id, None)
        if not mine:
            return None
        endpoint = self._endpoint() if finished_ok else None
        if endpoint is None:
            if finished_ok:
                log.error(
                    "request %s: the held-outputs store address is unknown (no worker published it); its "
                    "%d item(s) are not announced",
                    request.request_id,
                    len(mine),
                )
            self._revokes.extend(mine.items())
            self._metrics.grants.labels("revoked").inc(len(mine))
            if self._board is not None:
                for mm_hash in mine:
                    self._board.discard(mm_hash)
            return None
        vllm_entries: Mapping[str, Any] = {}
        if self._item_metadata is not None:
            try:
                vllm_entries = self._item_metadata(request)
            except Exception:
                log.debug("vLLM item metadata unavailable for request %s", request.request_id, exc_info=True)
        params: dict[str, Any] = {}
        for feat in request.mm_features or []:
            secret = mine.get(feat.identifier)
            if secret is None or feat.identifier in params:
                continue
            width = self._width(feat.modality)
            shape = (int(feat.mm_position.get_num_embeds()), int(width)) if width else None
            grant = ItemGrant(
                endpoint,
                feat.identifier,
                secret,
                shape,
                self._dtype,
                self._ttl_ms,
                self._compat,
                self._receipt(feat.identifier),
            )
            params[feat.identifier] = entry_for(grant, vllm_entries.get(feat.identifier))
        self._metrics.grants.labels("announced").inc(len(params))
        return params or None

    def _receipt(self, mm_hash: str) -> bytes | None:
        if self._board is None:
            return None
        data = self._board.take(mm_hash)
        if data is not None:
            self._recent[mm_hash] = data
            if len(self._recent) > _RECENT_RECEIPTS:
                self._recent.popitem(last=False)
            return data
        data = self._recent.get(mm_hash)
        if data is not None:
            self._recent.move_to_end(mm_hash)
        return data


class ProducerWorker:
    """The worker half: exports into the store (``store`` None on ranks that do not export) and leaves each held
    item's receipt on ``board`` (None: none are left)."""

    def __init__(self, store: HeldStore | None, metrics: ECMetrics, board: ReceiptBoard | None = None) -> None:
        self.store = store
        self._board = board
        self._metrics = metrics
        self._plane = "rdma" if store is not None and store.is_rdma else "inline"

    def start_save_caches(self, encoder_cache: Mapping[str, torch.Tensor] | None, step: ProducerStep) -> None:
        if self.store is None:
            return
        for mm_hash, secret in step.revokes:
            self.store.release(mm_hash, secret)
        for mm_hash, secret in step.grants:
            self.store.grant(mm_hash, secret)
            if encoder_cache is not None and mm_hash in encoder_cache and not self.store.holds(mm_hash):
                self._hold(mm_hash, encoder_cache[mm_hash])  # cached from an earlier step: not encoded again

    def save_caches(self, encoder_cache: MutableMapping[str, torch.Tensor], mm_hash: str) -> None:
        if self.store is None or self.store.holds(mm_hash):
            return
        self._hold(mm_hash, encoder_cache[mm_hash])

    def _hold(self, mm_hash: str, tensor: torch.Tensor) -> None:
        assert self.store is not None
        try:
            if self.store.hold(mm_hash, [tensor.detach()]):
                self._metrics.saved.labels(self._plane).inc()
                item = self.store.peek(mm_hash) if self._board is not None else None
                data = announceable(item) if item is not None else None
                if data is not None and self._board is not None:
                    self._board.put(mm_hash, data)
        except TensorwireError as exc:
            # Not held: a lookup answers not_held and the LLM instance falls back; vLLM keeps running.
            self._metrics.save_failures.labels(exc.reason.value).inc()
            log.warning("could not export item %.16s (%s): %s", mm_hash, exc.reason.value, exc)
        except Exception as exc:
            self._metrics.save_failures.labels(Reason.EXPORT_FAILED.value).inc()
            log.warning("could not export item %.16s: %r", mm_hash, exc)


__all__ = ["ProducerScheduler", "ProducerWorker", "ProducerStep"]
