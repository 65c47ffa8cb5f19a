"""Stand-ins for the few ``vllm.*`` names that vLLM's ``shm_broadcast.py`` imports, so that file runs unchanged
without vllm installed (the ``bench broadcast`` baseline; see ``_vllm_loader``).

Written here from what those names do in vLLM (documented behaviour, not vLLM's code); only what vLLM 0.32 and
0.33's file needs at import time and on the paths the bench takes (one writer, local readers, no tensor arena):

===========================================  ===========================================================================
``vllm.envs``                                ``VLLM_RINGBUFFER_WARNING_INTERVAL`` (env, default 60 s),
                                             ``VLLM_USE_SPINLOOP_EXT`` (env, default 0: the C spin loop stays off, as in
                                             vLLM), ``VLLM_RPC_BASE_PATH`` (env, default the temp dir); read per access
``vllm.distributed.utils``                   ``sched_yield`` (``os.sched_yield``, what vLLM uses on Python >= 3.11.1);
                                             ``StatelessProcessGroup`` (an empty class: only an ``isinstance`` check in
                                             ``create_from_process_group``, which the bench does not call)
``vllm.logger``                              ``init_logger`` -> ``logging.getLogger``
``vllm.platforms``                           ``current_platform.device_count()`` (torch's CUDA count; only the
                                             single-reader constructor uses it)
``vllm.utils.cpu_resource_utils``            ``check_cgroup_memory_available``: no check (the bench's segments are a few
                                             MiB; the file still checks /dev/shm's free space itself)
``vllm.utils.network_utils``                 ``get_open_zmq_ipc_path`` (``ipc://<VLLM_RPC_BASE_PATH>/<uuid4>``),
                                             ``get_open_zmq_inproc_path`` (``inproc://<uuid4>``),
                                             ``is_valid_ipv6_address``, ``get_ip`` (127.0.0.1: only remote readers,
                                             which the bench never has, use it)
===========================================  ===========================================================================

Not provided (imported lazily on paths the bench does not take): ``vllm.spinloop`` (the file falls back with a
warning when ``VLLM_USE_SPINLOOP_EXT=1``), ``shm_tensor_arena``, ``vllm.platforms.interface``,
``vllm.distributed.parallel_state``. A vLLM version whose file imports something else fails to load with a
message naming the missing name (``_vllm_loader``).
"""

from __future__ import annotations

import ipaddress
import logging
import os
import sys
import tempfile
import types
import uuid
from typing import Any

PACKAGES = ("vllm", "vllm.distributed", "vllm.distributed.device_communicators", "vllm.utils")


def _env_value(name: str) -> Any:
    if name == "VLLM_RINGBUFFER_WARNING_INTERVAL":
        return int(os.environ.get(name, "60"))
    if name == "VLLM_USE_SPINLOOP_EXT":
        return bool(int(os.environ.get(name, "0")))
    if name == "VLLM_RPC_BASE_PATH":
        return os.environ.get(name, tempfile.gettempdir())
    raise AttributeError(
        f"vllm.envs has no {name!r} in tensorwire's stand-in (tensorwire/bench/_vllm/shims.py); "
        f"this vLLM file needs a new stand-in"
    )


def _sched_yield() -> None:
    os.sched_yield()


class _StatelessProcessGroup:
    """Placeholder type: the file only tests ``isinstance(pg, StatelessProcessGroup)``."""


class _Platform:
    @staticmethod
    def device_count() -> int:
        import torch

        return torch.cuda.device_count()


def _check_cgroup_memory_available(required_bytes: int, allocation_name: str = "") -> None:
    return None


def _get_open_zmq_ipc_path() -> str:
    return f"ipc://{_env_value('VLLM_RPC_BASE_PATH')}/{uuid.uuid4()}"


def _get_open_zmq_inproc_path() -> str:
    return f"inproc://{uuid.uuid4()}"


def _is_valid_ipv6_address(address: str) -> bool:
    try:
        ipaddress.IPv6Address(address)
    except ValueError:
        return False
    return True


def _get_ip() -> str:
    return "127.0.0.1"


def _module(name: str, **attrs: Any) -> types.ModuleType:
    mod = types.ModuleType(name, f"tensorwire bench stand-in for {name} (tensorwire/bench/_vllm/shims.py)")
    mod.__dict__.update(attrs)
    return mod


def install() -> list[str]:
    """Put the stand-ins into ``sys.modules`` (only names not already there); returns the names added.

    Call only when vllm itself is not importable: the stand-ins would shadow the real package.
    """
    envs = _module("vllm.envs")
    envs.__dict__["__getattr__"] = _env_value  # PEP 562: the module's own __getattr__ reads the environment
    modules = {name: _module(name, __path__=[]) for name in PACKAGES}
    modules.update(
        {
            "vllm.envs": envs,
            "vllm.distributed.utils": _module(
                "vllm.distributed.utils", sched_yield=_sched_yield, StatelessProcessGroup=_StatelessProcessGroup
            ),
            "vllm.logger": _module("vllm.logger", init_logger=logging.getLogger),
            "vllm.platforms": _module("vllm.platforms", current_platform=_Platform()),
            "vllm.utils.cpu_resource_utils": _module(
                "vllm.utils.cpu_resource_utils", check_cgroup_memory_available=_check_cgroup_memory_available
            ),
            "vllm.utils.network_utils": _module(
                "vllm.utils.network_utils",
                get_ip=_get_ip,
                get_open_zmq_ipc_path=_get_open_zmq_ipc_path,
                get_open_zmq_inproc_path=_get_open_zmq_inproc_path,
                is_valid_ipv6_address=_is_valid_ipv6_address,
            ),
        }
    )
    added = []
    for name, mod in modules.items():
        if name not in sys.modules:
            sys.modules[name] = mod
            added.append(name)
    for name in modules:  # ``import vllm.envs as envs`` also reads the attribute on the parent
        parent, _, child = name.rpartition(".")
        if parent in sys.modules and not hasattr(sys.modules[parent], child):
            setattr(sys.modules[parent], child, sys.modules[name])
    return added
