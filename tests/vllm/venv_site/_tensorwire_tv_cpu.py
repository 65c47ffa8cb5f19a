"""Test virtualenv only (``make test-vllm`` copies it into .venv-vllm): lets the registry's torchvision import
on the CPU build of torch.

The torchvision wheels on PyPI are built against CUDA torch: their ``_C`` extension links ``libtorch_cuda.so``
and does not load with ``torch==2.13.0+cpu``. torchvision tolerates that (its kernels are then missing and
``torchvision.extension._has_ops()`` is False), except that ``torchvision/_meta_registrations.py`` registers fake
kernels for ``torchvision::nms`` and ``torchvision::qnms`` unconditionally, which raises "operator torchvision::nms
does not exist" and makes ``import torchvision`` fail. vLLM's multimodal code imports torchvision (through
transformers' Pixtral image processor) even for models that never call a torchvision kernel.

On the first ``import torchvision`` this finder tries to load torchvision's own ``_C``; only when that fails does
it define the two operator schemas (no kernels), so the pure-Python parts (transforms) import and a call to those
operators still fails loudly. A torchvision whose ``_C`` loads is left untouched.
"""

from __future__ import annotations

import importlib.abc
import importlib.util
import sys
from pathlib import Path

_SCHEMAS = {
    "nms": "nms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor",
    "qnms": "qnms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor",
}


class _TorchvisionOnCpuTorch(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):  # type: ignore[no-untyped-def]
        if name != "torchvision":
            return None
        sys.meta_path.remove(self)
        spec = importlib.util.find_spec("torchvision")
        if spec is None or spec.origin is None:
            return None
        import torch

        ext = sorted(Path(spec.origin).parent.glob("_C*.so"))
        try:
            if not ext:
                raise OSError("no _C extension")
            torch.ops.load_library(str(ext[0]))
        except OSError:
            # Kept alive in _KEEP: a Library that is garbage-collected unregisters what it defined.
            lib = torch.library.Library("torchvision", "FRAGMENT")
            for schema in _SCHEMAS.values():
                lib.define(schema)
            _KEEP.append(lib)
        return spec


_KEEP: list[object] = []
sys.meta_path.insert(0, _TorchvisionOnCpuTorch())
