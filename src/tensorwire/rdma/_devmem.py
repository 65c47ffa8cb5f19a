"""Raw device memory as a torch tensor: what the reader's loans and the mm layer's placed outputs both wrap."""

from __future__ import annotations

from collections.abc import Sequence

import torch

# The CUDA array interface's type string of each dtype torch wraps directly. It has none for bfloat16: that is
# wrapped as the integer of its size and reinterpreted (one more tensor op).
_TYPESTR: dict[torch.dtype, str] = {
    torch.float16: "<f2",
    torch.float32: "<f4",
    torch.float64: "<f8",
    torch.bool: "|b1",
    torch.uint8: "|u1",
    torch.int8: "|i1",
    torch.int16: "<i2",
    torch.int32: "<i4",
    torch.int64: "<i8",
}
_WRAPPED_AS: dict[torch.dtype, torch.dtype] = {torch.bfloat16: torch.int16}


class DeviceMemory:
    """Device memory at ``ptr`` as a CUDA array interface (a contiguous array of ``shape``, items ``typestr``);
    the tensor built on it keeps it alive (``weakref.finalize`` on it says when the last such tensor is gone)."""

    __slots__ = ("__cuda_array_interface__", "__weakref__")

    def __init__(self, ptr: int, shape: tuple[int, ...], typestr: str = "|u1") -> None:
        self.__cuda_array_interface__ = {
            "shape": shape,
            "typestr": typestr,
            "data": (ptr, False),
            "strides": None,
            "version": 2,
        }


def wrap_device(ptr: int, nbytes: int, device: torch.device) -> tuple[torch.Tensor, DeviceMemory]:
    """(a 1-D uint8 tensor over ``[ptr, ptr + nbytes)`` on ``device``, the object it holds); ``RuntimeError``
    when torch wrapped anything else (it may copy what it cannot view)."""
    return wrap_device_as(ptr, (nbytes,), torch.uint8, device)


def wrap_device_as(
    ptr: int, shape: Sequence[int], dtype: torch.dtype, device: torch.device
) -> tuple[torch.Tensor, DeviceMemory]:
    """(a contiguous tensor of ``shape`` and ``dtype`` over the device memory at ``ptr``, the object it holds):
    one tensor op (two for bfloat16), where a uint8 wrap sliced and viewed takes three or four. ``ptr`` is
    aligned for ``dtype`` and the shape is not empty (the caller's checks); ``RuntimeError`` when torch wrapped
    anything else, ``TypeError`` for a dtype without a wrap."""
    wrapped = _WRAPPED_AS.get(dtype, dtype)
    typestr = _TYPESTR.get(wrapped)
    if typestr is None:
        raise TypeError(f"no CUDA array interface wrap for {dtype}")
    dims = tuple(int(d) for d in shape)
    mem = DeviceMemory(ptr, dims, typestr)
    t = torch.as_tensor(mem, device=device)
    if t.data_ptr() != ptr or t.dtype != wrapped or t.shape != dims:
        raise RuntimeError(
            f"torch wrapped {tuple(t.shape)} {t.dtype} at {t.data_ptr():#x}, not {dims} {wrapped} at {ptr:#x}"
        )
    return (t if wrapped is dtype else t.view(dtype)), mem


__all__ = ["DeviceMemory", "wrap_device", "wrap_device_as"]
