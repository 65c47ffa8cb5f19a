"""Same-host copy: a reader on the owner's host copies a slot straight out of the owner's memory.

Why: on one host UCX already moves a host slot with CMA (``process_vm_readv``), but a READ through NIXL also posts
a request, is completed by polling and registers a destination the caller gave (docs/rdma.md "Same-host copy" has
the figures). This module makes that one system call itself.

Contract:

- Only host-memory slots (``DRAM``) of an owner whose descriptor names this host (:func:`host_id`: the boot id, the
  pid namespace, so a pid is only ever looked up in the pid space that issued it, and the network namespace) and
  whose generation is bound to the slot (``Descriptor.binding``; see ``_descriptor.bound_generation``), read by a
  host reader on x86-64. The copy keeps the generation protocol: payload first, then the generation word (both in
  one system call, in that order), then the same comparison as a READ. The binding is what makes the comparison mean
  "this slot": without it a descriptor could keep a valid (word, generation) pair and point ``slot_addr`` at any
  memory of the owner process, which NIXL's registrations would refuse and ``process_vm_readv`` would not.
- Why x86-64 only: the protocol needs the payload's loads to complete before the generation word's load, and the
  owner's bump to be visible before a new tenant's bytes. x86's ordering gives both for plain loads and stores
  (one thread's stores are seen in order; loads are not reordered with older loads); other architectures would
  need fences that a system call boundary does not promise.
- Permission is the kernel's: ``process_vm_readv`` needs the right to ptrace the owner (same uid, not setuid, not
  blocked by Yama's ``ptrace_scope``), the same as UCX's CMA. Another user of the host gets EPERM and reads over
  the provider (which has its own access rules).
- :func:`copy_from` raises :class:`LocalCopyFailed` for any failure (EPERM, ESRCH: the owner is gone, EFAULT: an
  address is not mapped there, a short copy); the caller then reads through the provider, which reports the real
  state of the lease. ``permanent`` says that no copy from this owner will work (do not try again).
"""

from __future__ import annotations

import ctypes
import errno
import functools
import hashlib
import os
import platform
from collections.abc import Sequence

Range = tuple[int, int]  # (address, bytes)

HOST_ID_BYTES = 16
_MAX_IOV = 1024  # IOV_MAX on Linux


class LocalCopyFailed(OSError):
    """A same-host copy did not happen; ``permanent``: the owner can never be copied from (EPERM, ESRCH)."""

    def __init__(self, message: str, *, permanent: bool) -> None:
        super().__init__(message)
        self.permanent = permanent


class _Iovec(ctypes.Structure):
    _fields_ = (("base", ctypes.c_void_p), ("len", ctypes.c_size_t))


@functools.cache
def host_id() -> bytes:
    """This host's identity (16 bytes; empty when /proc does not say): the kernel's boot id, the pid namespace
    (a pid means something only there) and the network namespace. The last one is conservative: the copy would
    work across network namespaces, but a process in another one is on another host as far as its addresses go
    (containers, the cross-host test harness), and a deployment that separates them expects its reads to cross
    the network the way it configured."""
    try:
        with open("/proc/sys/kernel/random/boot_id", "rb") as f:
            boot = f.read().strip()
        pid_ns = os.readlink("/proc/self/ns/pid").encode()
        net_ns = os.readlink("/proc/self/ns/net").encode()
    except OSError:
        return b""
    return hashlib.sha256(b"tensorwire-host\0" + boot + b"\0" + pid_ns + b"\0" + net_ns).digest()[:HOST_ID_BYTES]


@functools.cache
def _readv() -> ctypes._CFuncPtr | None:  # type: ignore[name-defined]
    if platform.system() != "Linux" or platform.machine() not in ("x86_64", "AMD64"):
        return None
    try:
        fn = ctypes.CDLL(None, use_errno=True).process_vm_readv
    except (OSError, AttributeError):
        return None
    fn.restype = ctypes.c_ssize_t
    fn.argtypes = (
        ctypes.c_int,
        ctypes.POINTER(_Iovec),
        ctypes.c_ulong,
        ctypes.POINTER(_Iovec),
        ctypes.c_ulong,
        ctypes.c_ulong,
    )
    return fn


def available() -> bool:
    """Whether this process can copy from another one at all (Linux on x86-64 with ``process_vm_readv``)."""
    return _readv() is not None and bool(host_id())


def copy_from(pid: int, local: Sequence[Range], remote: Sequence[Range]) -> None:
    """Copies ``remote`` ranges of process ``pid`` into ``local`` ranges of this process, in order, as one
    ``process_vm_readv`` per ``IOV_MAX`` ranges; the two lists are the same length and their sizes equal.
    Returns when every byte is here; raises :class:`LocalCopyFailed` otherwise (the local bytes are then
    undefined).

    Order: every byte of a remote range is loaded before the first byte of the next one (the kernel copies the
    ranges one after the other on the calling CPU, and x86-64 does not reorder loads with older loads), so a
    generation word placed after its payload in one call is read after the payload, as the protocol needs."""
    fn = _readv()
    if fn is None:
        raise LocalCopyFailed("process_vm_readv is not available here", permanent=True)
    for start in range(0, len(local), _MAX_IOV):
        lo, ro = local[start : start + _MAX_IOV], remote[start : start + _MAX_IOV]
        liov = (_Iovec * len(lo))(*(_Iovec(a, n) for a, n in lo))
        riov = (_Iovec * len(ro))(*(_Iovec(a, n) for a, n in ro))
        want = sum(n for _, n in lo)
        got = fn(pid, liov, len(lo), riov, len(ro), 0)
        if got < 0:
            err = ctypes.get_errno()
            raise LocalCopyFailed(
                f"process_vm_readv from pid {pid}: {os.strerror(err)}", permanent=err in (errno.EPERM, errno.ESRCH)
            )
        if got != want:
            raise LocalCopyFailed(f"process_vm_readv from pid {pid} copied {got} of {want} bytes", permanent=False)


__all__ = ["HOST_ID_BYTES", "LocalCopyFailed", "available", "copy_from", "host_id"]
