"""Raw device memory as a torch tensor: what the reader's loans and the mm layer's placed outputs both wrap."""

from __future__ import annotations

import torch


class DeviceMemory:
    """``nbytes`` of device memory at ``ptr`` as a CUDA array interface; the tensor built on it keeps it alive
    (``weakref.finalize`` on it says when the last such tensor is gone)."""

    __slots__ = ("__cuda_array_interface__", "__weakref__")

    def __init__(self, ptr: int, nbytes: int) -> None:
        self.__cuda_array_interface__ = {"shape": (nbytes,), "typestr": "|u1", "data": (ptr, False),
                                         "strides": None, "version": 2}


def wrap_device(ptr: int, nbytes: int, device: torch.device) -> tuple[torch.Tensor, DeviceMemory]:
    """(a 1-D uint8 tensor over ``[ptr, ptr + nbytes)`` on ``device``, the object it holds); ``RuntimeError``
    when torch wrapped anything else (it may copy what it cannot view)."""
    mem = DeviceMemory(ptr, nbytes)
    t = torch.as_tensor(mem, device=device)
    if t.data_ptr() != ptr or t.numel() != nbytes:
        raise RuntimeError(f"torch wrapped {t.numel()} bytes at {t.data_ptr():#x}, not {nbytes} at {ptr:#x}")
    return t, mem


__all__ = ["DeviceMemory", "wrap_device"]
