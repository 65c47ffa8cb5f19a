"""ReceiptBoard: the encoder instance's worker hands each held item's receipt to its scheduler, for the params.

Why: when the params carry an item's receipt (its slot descriptor) the LLM instance reads the item at once, with
no Lookup, so nothing on the LLM side waits for a thread of the encoder instance to run (on a busy host, or behind
vLLM's busy-polling worker loop, that wait was the hand-off's largest and most erratic cost). The scheduler writes
the params (``request_finished``) but the worker holds the item; the worker's ``save_caches`` returns before the
step's output reaches the scheduler, so a receipt the worker left on the board is there when the scheduler looks.

One board per process and instance name (``runtime.receipt_board``):

- scheduler and worker in one process (vLLM's uniproc executor): a dict;
- in other processes: one file per item, ``<name>.rcpt.<sha256(key)[:32]>`` in the private runtime directory
  (0700, ours, opened through a handle, ``O_NOFOLLOW``), written by the worker, read and removed by the scheduler.

What a receipt holds: the ``EncodeResponse`` a Lookup would answer for the item (``held._rpc.receipt_for``), with
the owner's metadata token removed (:func:`announceable`): params travel through clients and routers, and the
token is what lets a peer fetch the encoder's data-plane metadata, so an LLM instance learns it only from a
Lookup answer (a control call under the transport's own access rules) and reads from params only from owners met
that way. Holding a receipt does not let a reader use another slot's bytes: slot generations are random and bound
to the slot's address and size (``tensorwire.rdma._pool``, step 5), so a descriptor edited to name another
address fails validation, and the LLM instance takes no unbound descriptor from params.

A missing receipt (the hold failed, a file system error) is not an error: the params go out without one and the
LLM instance looks the item up. Receipts of items that are never announced are removed when the scheduler
revokes their grants, and every receipt of the instance when its worker starts and stops.
"""

from __future__ import annotations

import dataclasses
import hashlib
import logging
import os
import threading

from tensorwire._local import unix as _unix
from tensorwire.mm._proto import encoder_pb2 as pb
from tensorwire.mm.held._rpc import receipt_for
from tensorwire.mm.held._store import HeldItem

log = logging.getLogger(__name__)

#: Receipts larger than this are not announced (a one-slot receipt is a few hundred bytes).
MAX_RECEIPT_BYTES = 16 * 1024


def announceable(item: HeldItem) -> bytes | None:
    """The receipt of an RDMA-held item as params may carry it (no metadata token); None for an inline item
    (its bytes never ride in params) or one whose receipt is over ``MAX_RECEIPT_BYTES``."""
    desc = item.descriptor
    if desc is None:
        return None
    bare = dataclasses.replace(desc, owner=dataclasses.replace(desc.owner, metadata_token=b""))
    data = receipt_for(dataclasses.replace(item, descriptor=bare), rdma=True).SerializeToString()
    return data if len(data) <= MAX_RECEIPT_BYTES else None


def parse_receipt(data: bytes) -> pb.EncodeResponse | None:
    """The receipt in ``data`` if it names RDMA slots only (what params may carry), else None."""
    receipt = pb.EncodeResponse()
    try:
        receipt.ParseFromString(data)
    except Exception:  # DecodeError and friends: untrusted bytes
        return None
    if not receipt.rdma_slots or receipt.HasField("embedding") or len(receipt.extra_inputs):
        return None
    return receipt


class ReceiptBoard:
    """Receipts by item key, from the exporting worker to the scheduler of one instance (module docstring).

    ``dir_fd``: the private runtime directory's handle (owned by the board: closed by ``close``), or None when
    only the in-process dict may be used. ``reader_here()`` marks that this process's scheduler reads the board,
    so the worker's ``put`` stays in memory. Thread-safe; every file error is logged at DEBUG and treated as "no
    receipt".
    """

    def __init__(self, name: str, dir_fd: int | None) -> None:
        self.name = name
        self._fd = dir_fd
        self._local: dict[str, bytes] = {}
        self._lock = threading.Lock()
        self._reader_here = False
        self._prefix = f"{name}.rcpt."

    def reader_here(self) -> None:
        with self._lock:
            self._reader_here = True

    def _file(self, key: str) -> str:
        return self._prefix + hashlib.sha256(key.encode()).hexdigest()[:32]

    def put(self, key: str, data: bytes) -> None:
        with self._lock:
            if self._reader_here or self._fd is None:
                self._local[key] = data
                return
            fd = self._fd
        try:
            f = os.open(
                self._file(key),
                os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW | os.O_CLOEXEC,
                0o600,
                dir_fd=fd,
            )
            try:
                os.write(f, data)
            finally:
                os.close(f)
        except OSError as exc:
            log.debug("receipt of %.16s not written (%s): the LLM instance will look it up", key, exc)

    def take(self, key: str) -> bytes | None:
        """The receipt the worker left for ``key`` (removed from the board), or None."""
        with self._lock:
            data = self._local.pop(key, None)
            fd = self._fd
        if data is not None or fd is None:
            return data
        name = self._file(key)
        try:
            data = _unix.read_private_file(fd, name, MAX_RECEIPT_BYTES + 1)
        except FileNotFoundError:
            return None
        except (OSError, _unix.InsecurePath) as exc:  # a symlink, not ours, unreadable: not a receipt
            log.debug("receipt of %.16s unreadable (%s)", key, exc)
            self._unlink(name)
            return None
        self._unlink(name)
        return data if 0 < len(data) <= MAX_RECEIPT_BYTES else None

    def discard(self, key: str) -> None:
        """Forgets the receipt of ``key`` (its grant was revoked: the item is never announced)."""
        with self._lock:
            self._local.pop(key, None)
            fd = self._fd
        if fd is not None:
            self._unlink(self._file(key))

    def clear(self) -> int:
        """Removes every receipt of this instance (the worker at start and stop); returns how many."""
        with self._lock:
            n = len(self._local)
            self._local.clear()
            fd = self._fd
        if fd is None:
            return n
        try:
            names = [e for e in os.listdir(fd) if e.startswith(self._prefix)]
        except OSError:
            return n
        for e in names:
            self._unlink(e)
        return n + len(names)

    def close(self) -> None:
        with self._lock:
            fd, self._fd = self._fd, None
            self._local.clear()
        if fd is not None:
            os.close(fd)

    def _unlink(self, name: str) -> None:
        fd = self._fd
        if fd is None:
            return
        try:
            os.unlink(name, dir_fd=fd)
        except OSError:
            pass


__all__ = ["ReceiptBoard", "announceable", "parse_receipt", "MAX_RECEIPT_BYTES"]
