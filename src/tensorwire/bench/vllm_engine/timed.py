"""EC connectors with timestamps: vLLM's and tensorwire's connectors, each subclassed the same way.

Loaded inside the engines, never by the driver. Each subclass calls the connector's methods unchanged and appends
``time.time_ns()`` records to ``$TW_EC_TIMES_DIR/<pid>.jsonl``: ``save`` (producer worker), ``seen`` (consumer
scheduler: vLLM's first look at the item), ``ready`` (consumer scheduler: the connector first answered that the item
is available), ``placed`` (consumer worker: the item entered the encoder cache; ``t_load`` is when that
``start_load_caches`` call began). Without ``TW_EC_TIMES_DIR`` nothing is recorded. With ``TW_EC_GC_MS`` set as well,
every garbage collection of at least that many ms in a process that loaded this module is recorded as ``gc``
(``gen``, ``ms``, ``collected``, ``t`` at its end): a diagnostic for pauses that are not the connector's.
"""

from __future__ import annotations

import gc
import json
import os
import threading
import time
from typing import Any

from vllm.distributed.ec_transfer.ec_connector.example_connector import ECExampleConnector

from tensorwire.integrations.vllm import TensorwireECConnector

_lock = threading.Lock()
_file: Any = None
_file_pid = 0


def _record(event: str, mm_hash: str, **fields: Any) -> None:
    global _file, _file_pid
    directory = os.environ.get("TW_EC_TIMES_DIR")
    if not directory:
        return
    line = json.dumps({"ev": event, "mm_hash": mm_hash, "pid": os.getpid(), **fields})
    with _lock:
        if _file is None or _file_pid != os.getpid():  # a forked worker writes its own file
            _file_pid = os.getpid()
            _file = open(os.path.join(directory, f"{os.getpid()}.jsonl"), "a", buffering=1)
        _file.write(line + "\n")


def _watch_gc(threshold_ms: float) -> None:
    """Records collections that took ``threshold_ms`` or more (see the module docstring)."""
    started: dict[int, int] = {}

    def callback(phase: str, info: dict[str, int]) -> None:
        tid = threading.get_ident()
        if phase == "start":
            started[tid] = time.perf_counter_ns()
            return
        t0 = started.pop(tid, None)
        if t0 is None:
            return
        ms = (time.perf_counter_ns() - t0) / 1e6
        if ms >= threshold_ms:
            _record("gc", "", gen=info.get("generation"), ms=ms, collected=info.get("collected"), t=time.time_ns())

    gc.callbacks.append(callback)


if os.environ.get("TW_EC_TIMES_DIR") and os.environ.get("TW_EC_GC_MS"):
    _watch_gc(float(os.environ["TW_EC_GC_MS"]))


class _Timed:
    """The recording overrides; the connector class follows in the MRO."""

    def _tw_first(self, event: str, identifier: str, t: int) -> None:
        """Records ``event`` for ``identifier`` the first time only."""
        done = self.__dict__.setdefault(f"_tw_{event}", set())
        if identifier not in done:
            done.add(identifier)
            _record(event, identifier, t=t)

    def save_caches(self, encoder_cache: dict[str, Any], mm_hash: str, **kwargs: Any) -> None:
        t0 = time.time_ns()
        super().save_caches(encoder_cache, mm_hash, **kwargs)  # type: ignore[misc]
        _record("save", mm_hash, t0=t0, t1=time.time_ns())

    def start_load_caches(self, encoder_cache: dict[str, Any], **kwargs: Any) -> None:
        before = set(encoder_cache)
        t_load = time.time_ns()
        super().start_load_caches(encoder_cache, **kwargs)  # type: ignore[misc]
        if len(encoder_cache) != len(before) or encoder_cache.keys() != before:
            t = time.time_ns()
            for key in encoder_cache.keys() - before:
                nbytes = int(encoder_cache[key].numel() * encoder_cache[key].element_size())
                _record("placed", key, t=t, t_load=t_load, nbytes=nbytes)

    def has_cache_item(self, identifier: str) -> bool:
        if self.is_consumer:  # type: ignore[attr-defined]
            self._tw_first("seen", identifier, time.time_ns())
        return bool(super().has_cache_item(identifier))  # type: ignore[misc]

    def ensure_cache_available(self, request: Any, num_computed_tokens: int) -> bool:
        if self.is_consumer:  # type: ignore[attr-defined]
            t = time.time_ns()
            for feature in request.mm_features or ():
                self._tw_first("seen", feature.identifier, t)
        available = bool(super().ensure_cache_available(request, num_computed_tokens))  # type: ignore[misc]
        if available and self.is_consumer:  # type: ignore[attr-defined]
            t = time.time_ns()
            for feature in request.mm_features or ():
                self._tw_first("ready", feature.identifier, t)
        return available


class TimedTensorwireEC(_Timed, TensorwireECConnector):
    """``TensorwireECConnector`` with the records above."""


class TimedExampleEC(_Timed, ECExampleConnector):  # type: ignore[misc]  # (vLLM ships no type information)
    """vLLM's ``ECExampleConnector`` (safetensors files under ``shared_storage_path``) with the records above."""


def __getattr__(name: str) -> Any:
    # Mooncake's connector module imports fine without the transfer engine; build its subclass only when asked.
    if name == "TimedMooncakeEC":
        from vllm.distributed.ec_transfer.ec_connector.mooncake_ec_connector import ECMooncakeConnector

        cls = type(
            "TimedMooncakeEC",
            (_Timed, ECMooncakeConnector),
            {"__doc__": "vLLM's ``ECMooncakeConnector`` with the records above.", "__module__": __name__},
        )
        globals()[name] = cls
        return cls
    raise AttributeError(name)
