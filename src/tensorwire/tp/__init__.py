"""CPU tensor-parallel broadcaster: rank 0 sends small CPU tensors to the other ranks of its node every step.

Two transports behind one API (see docs/broadcaster.md): a hardened Unix-socket star and a shared-memory ring
(rank 0 writes once, readers spin briefly then sleep on their socket). ``broadcast_cpu`` is the
torch.distributed-facing entry point that falls back to a torch.distributed broadcast across nodes.
"""

from ._broadcaster import CpuTpBroadcaster
from ._config import BroadcastConfig
from ._connect import shm_available
from ._dist import broadcast_cpu, shutdown_broadcast_cpu

__all__ = ["BroadcastConfig", "CpuTpBroadcaster", "broadcast_cpu", "shm_available", "shutdown_broadcast_cpu"]
