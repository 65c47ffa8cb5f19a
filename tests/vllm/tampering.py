"""Test only: an encoder-instance connector that corrupts what it exports when told to.

``TW_TAMPER_FILE`` names a file whose content is the mode for the next saves: ``zero`` exports an all-zero
tensor instead of each encoder output; ``swap`` exports the first two outputs of a step under each other's
mm_hash; anything else (or no file) exports faithfully, exactly as TensorwireECConnector. The tampering is done
on copies: vLLM's own encoder cache is never touched. It proves two things end to end: the LLM instance really
uses the delivered embeddings (it does not silently re-encode), and the equality check against the baseline
catches a zeroed embedding and two swapped images.
"""

from __future__ import annotations

import os
from typing import Any

import torch

from tensorwire.integrations.vllm import TensorwireECConnector


class TamperingECConnector(TensorwireECConnector):
    _pending: tuple[str, torch.Tensor] | None = None

    @staticmethod
    def _mode() -> str:
        path = os.environ.get("TW_TAMPER_FILE", "")
        try:
            with open(path) as f:
                return f.read().strip()
        except OSError:
            return ""

    def save_caches(self, encoder_cache: dict[str, torch.Tensor], mm_hash: str, **kwargs: Any) -> None:
        mode = self._mode()
        if mode == "zero":
            super().save_caches({mm_hash: torch.zeros_like(encoder_cache[mm_hash])}, mm_hash, **kwargs)
        elif mode == "swap":
            if self._pending is None:
                self._pending = (mm_hash, encoder_cache[mm_hash].clone())
                return
            first, first_tensor = self._pending
            self._pending = None
            super().save_caches({first: encoder_cache[mm_hash]}, first, **kwargs)
            super().save_caches({mm_hash: first_tensor}, mm_hash, **kwargs)
        else:
            super().save_caches(encoder_cache, mm_hash, **kwargs)
