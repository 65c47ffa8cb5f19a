"""The ``nixl`` provider: NIXL with its UCX backend (RDMA NICs between hosts, cuda_ipc / CMA inside a host).

- Agent: one per provider instance, named ``tw-<role>-<host>-<pid>-<random>``. UCX defaults are applied first
  (``_ucx_env``). NIXL's Python wrapper hard-codes ``pthrDelay = 0``, which makes the progress thread spin on
  ``poll(fd, 0)`` and burn a core per agent (nixl-on-cpu.md §3); we construct the agent under a scoped patch that
  sets ``progress_delay_us`` instead, so the idle thread blocks in ``poll`` on UCX's event fd.
- Owner side: ``serve`` starts ``_metadata.MetadataServer`` where ``rdma._endpoint`` says (it follows the
  control plane; never a wildcard unless configured) and hands out a random ``metadata_token`` in the ``Owner``
  (so in every descriptor): the endpoint answers only requests that present it. ``registration_epoch`` counts
  registrations; a snapshot (name, epoch, full agent metadata) is taken under the registration lock.
- Reader side: per owner agent, the metadata is fetched once with the descriptor's token (``connect_timeout_ms``,
  bounded by the read deadline), loaded with ``add_remote_agent`` and cached with its epoch; a descriptor with a
  newer epoch triggers a refresh. Ranges are passed as plain (addr, len, dev) tuples; NIXL checks them against the
  owner's registered regions (``NIXL_ERR_NOT_FOUND`` otherwise). On ``NIXL_ERR_REMOTE_DISCONNECT`` the owner is
  forgotten (``remove_remote_agent``) so a restarted owner or another owner keeps working.
- Deadline: NIXL has no transfer timeout. The caller polls ``check_xfer_state`` until the deadline; a transfer
  still in progress then is returned as a ``PendingTransfer`` on the ``ReadTimeout`` (destination quarantined by
  the reader until NIXL reports it done or failed).
- Transport: the first READ to each owner runs under ``_ucx_probe.capture_stdout`` to learn the UCX transport.
- Reposting: a completed READ request is kept (``_xfer_cache``) and posted again when the same (local ranges,
  owner, remote ranges) recur, which pooled slots make the common case. Entries are dropped before the local
  memory they name is deregistered and when an owner is forgotten or reloaded.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import secrets
import socket
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from tensorwire.errors import ClosedError, ExportError, LeaseExpired, ReadError, ReadTimeout, Reason
from tensorwire.rdma import _endpoint
from tensorwire.rdma._config import RdmaConfig
from tensorwire.rdma._descriptor import Owner
from tensorwire.rdma._local import host_id
from tensorwire.rdma._stats import ProviderStats, Tally
from tensorwire.rdma.providers import _metadata, _ucx_env, _ucx_probe
from tensorwire.rdma.providers._ucx_probe import MemPair
from tensorwire.rdma.providers._xfer_cache import XferCache, XferEntry, XferKey, release_quietly
from tensorwire.rdma.providers.base import ROLE_EXPORTER, PendingTransfer, Provider, Range, Registration

log = logging.getLogger(__name__)

_CTOR_LOCK = threading.Lock()  # serializes the scoped pthrDelay patch of nixlBind.nixlAgent
_AVAILABLE: bool | None = None
_SPIN_S = 0.0005  # busy-poll this long before sleeping between state checks (sub-ms reads stay sub-ms)


def _api() -> Any:
    _ucx_env.quiet_nixl()
    import nixl._api as api  # heavy, only when the provider is used

    return api


@dataclass
class NixlStats(ProviderStats):
    """The nixl provider's ``stats()``: counters since the agent was created, and owners and transport now."""

    metadata_fetches: int = 0  # owner metadata fetched and loaded (first contact, newer epoch, reconnect)
    peer_disconnects: int = 0  # READs that found their owner gone (NIXL_ERR_REMOTE_DISCONNECT)
    nixl_read_errors: int = 0  # READs NIXL failed for any other reason
    idle_owners_forgotten: int = 0  # owners dropped after 2 x slot_gc_timeout_ms unused
    known_owners: int = 0
    xfer_reposts: int = 0  # READs posted from a prepared request (_xfer_cache)
    xfer_preps: int = 0  # READs that prepared a new request
    metadata_served: int = 0  # owner side: metadata handed out
    metadata_refused: int = 0  # owner side: requests without this owner's token or with another agent's name
    metadata_rejected: int = 0  # owner side: metadata connections dropped (bad request, I/O error, timeout, cap)
    metadata_evicted: int = 0  # owner side: of those, idle connections closed to make room (over the cap)


class _Remote:
    __slots__ = ("name", "epoch", "lock", "probed", "busy", "last_used")

    def __init__(self, name: str) -> None:
        self.name = name
        self.epoch = -1
        self.lock = threading.Lock()
        self.probed: set[MemPair] = set()  # memory pairs whose first READ was captured
        self.busy = 0  # READs in progress or pending past their deadline (guarded by the provider's remotes lock)
        self.last_used = time.monotonic()


class _NixlPending(PendingTransfer):
    def __init__(self, agent: Any, xfer: Any, handles: list[Any], on_done: Callable[[], None]) -> None:
        self._agent = agent
        self._xfer = xfer
        self._handles = handles
        self._done = False
        self._on_done = on_done

    def poll(self) -> bool:
        if self._done:
            return True
        try:
            state = self._agent.check_xfer_state(self._xfer)
        except Exception:  # a failed transfer raises: NIXL no longer works on it
            state = "ERR"
        if state == "PROC":
            return False
        self._done = True
        release_quietly(self._xfer, *self._handles)
        self._on_done()
        return True

    def abandon(self) -> None:
        if not self._done:
            self._done = True
            release_quietly(self._xfer, *self._handles)  # NIXL tries to cancel an active transfer on release
            self._on_done()


class NixlProvider(Provider):
    name = "nixl"

    def __init__(self, config: RdmaConfig, *, role: str) -> None:
        super().__init__(config, role=role)
        env = _ucx_env.apply_defaults(cuda=config.is_cuda)
        api = _api()
        self._agent_name = f"tw-{role}-{socket.gethostname()}-{os.getpid()}-{secrets.token_hex(4)}"
        try:
            self._agent = _make_agent(api, self._agent_name, config)
        except Exception as exc:
            err = ExportError if role == ROLE_EXPORTER else ReadError
            raise err(f"NIXL agent creation failed: {exc}", reason=Reason.PROVIDER_UNAVAILABLE) from exc
        self._reg_lock = threading.Lock()
        self._epoch = 0
        self._server: _metadata.MetadataServer | None = None
        self._md_token = secrets.token_bytes(32)  # what a reader must present to get this agent's metadata
        self._advertised = ""
        self._remotes: dict[str, _Remote] = {}
        self._remotes_lock = threading.Lock()
        self._transports: dict[MemPair, str] = {}
        # Owners unused for twice the lease TTL hold no valid lease any more: their metadata and UCX endpoints
        # (sockets, up to qp_count per owner) are dropped, so restarted or retired owners do not leak in a
        # long-lived reader. A forgotten owner that is still alive only costs a metadata fetch on its next read.
        self._idle_forget_s = 2 * config.slot_gc_timeout_ms / 1000.0
        self._next_sweep = time.monotonic() + min(self._idle_forget_s, 10.0)
        self._closed = False
        self._tally = Tally(NixlStats())  # counters only; stats() fills in the rest. Bumped by many reader threads
        self._xfers = XferCache()
        log.info(
            "NIXL agent %s created (role=%s, device=%s, progress_delay_us=%d, env=%s)",
            self._agent_name,
            role,
            config.device,
            config.progress_delay_us,
            env,
        )

    @classmethod
    def available(cls) -> bool:
        global _AVAILABLE
        if _AVAILABLE is None:
            try:
                api = _api()
                _AVAILABLE = hasattr(api, "nixl_agent")
            except Exception as exc:  # ImportError, missing shared libraries (OSError), broken wheels
                log.info("NIXL unavailable: %s", exc)
                _AVAILABLE = False
        return _AVAILABLE

    @property
    def supports_device_memory(self) -> bool:
        return True

    @property
    def agent_name(self) -> str:
        return self._agent_name

    @property
    def registration_epoch(self) -> int:
        return self._epoch

    # -- memory --

    def register(self, addr: int, nbytes: int, mem_type: str, device_id: int) -> Registration:
        self._check_open()
        with self._reg_lock:
            try:
                reg = self._agent.register_memory([(addr, nbytes, device_id, "")], mem_type)
            except Exception as exc:
                raise ExportError(
                    f"NIXL could not register {nbytes} bytes of {mem_type}: {exc}", reason=Reason.REGISTRATION_FAILED
                ) from exc
            self._epoch += 1
        return Registration(addr, nbytes, mem_type, device_id, reg)

    def deregister(self, reg: Registration) -> None:
        if self._closed:
            return
        # Requests naming this memory (as local side) must go before the registration does.
        lo, hi = reg.addr, reg.addr + reg.nbytes
        self._xfers.invalidate(lambda key: any(lo < a + n and a < hi for a, n, _dev in key.local))
        with self._reg_lock:
            self._agent.deregister_memory(reg.handle)

    # -- owner side --

    def serve(self) -> Owner:
        self._check_open()
        if self._server is None:
            cfg = self.config
            ep = _endpoint.resolve(cfg.bind_ip, cfg.advertise_host, cfg.control_host)
            try:
                self._server = _metadata.MetadataServer(ep.bind_ip, cfg.port, self._snapshot, token=self._md_token)
            except OSError as exc:
                raise ExportError(
                    f"metadata endpoint {ep.bind_ip}:{cfg.port} ({ep.bind_rule}) could not listen: {exc}",
                    reason=Reason.PROVIDER_UNAVAILABLE,
                ) from exc
            self._advertised = ep.advertise_host
            _endpoint.announce(ep, self._server.port, self._agent_name, cfg.control_host)
        return Owner(self._agent_name, self._advertised, self._server.port, 0, self._md_token, os.getpid(), host_id())

    def _snapshot(self) -> tuple[str, int, bytes]:
        with self._reg_lock:
            return self._agent_name, self._epoch, self._agent.get_agent_metadata()

    # -- reader side --

    def read(
        self,
        owner: Owner,
        local_mem: str,
        local: Sequence[Range],
        remote_mem: str,
        remote: Sequence[Range],
        *,
        deadline: float,
    ) -> None:
        self._check_open()
        if len(local) != len(remote) or not local:
            raise ReadError(f"read needs matching non-empty range lists ({len(local)} vs {len(remote)})")
        self._sweep_idle(owner.agent_name)
        rem = self._remote(owner, deadline)
        with self._remotes_lock:
            rem.busy += 1
        try:
            self._read_from(rem, owner, local_mem, local, remote_mem, remote, deadline)
        finally:
            with self._remotes_lock:
                rem.busy -= 1
                rem.last_used = time.monotonic()

    def _read_from(
        self,
        rem: _Remote,
        owner: Owner,
        local_mem: str,
        local: Sequence[Range],
        remote_mem: str,
        remote: Sequence[Range],
        deadline: float,
    ) -> None:
        key = MemPair(local_mem, remote_mem)
        if key not in rem.probed:
            # UCX prints its READ protocol table on the first READ of each memory-type pair (per endpoint config).
            with _ucx_probe.capture_stdout() as cap:
                try:
                    self._transfer(rem, owner, local_mem, local, remote_mem, remote, deadline)
                finally:
                    rem.probed.add(key)
            self._learn_transport(cap.text, owner, local_mem, remote_mem)
        else:
            self._transfer(rem, owner, local_mem, local, remote_mem, remote, deadline)

    def _sweep_idle(self, keep: str) -> None:
        now = time.monotonic()
        if now < self._next_sweep:
            return
        with self._remotes_lock:
            self._next_sweep = now + min(self._idle_forget_s, 10.0)
            idle = [
                r.name
                for r in self._remotes.values()
                if r.name != keep and r.busy == 0 and now - r.last_used > self._idle_forget_s
            ]
        for name in idle:
            self._forget(name)
        if idle:
            with self._tally.locked() as c:
                c.idle_owners_forgotten += len(idle)
            log.info("forgot %d owner(s) idle for over %.0f s", len(idle), self._idle_forget_s)

    def _remote(self, owner: Owner, deadline: float) -> _Remote:
        with self._remotes_lock:
            rem = self._remotes.get(owner.agent_name)
            if rem is None:
                rem = self._remotes[owner.agent_name] = _Remote(owner.agent_name)
        if rem.epoch >= owner.registration_epoch:
            return rem
        with rem.lock:
            if rem.epoch < owner.registration_epoch:
                self._load(rem, owner, deadline)
        return rem

    def _load(self, rem: _Remote, owner: Owner, deadline: float) -> None:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            raise ReadTimeout(f"no time left to fetch metadata of {owner.agent_name}", reason=Reason.READ_TIMEOUT)
        epoch, md = _metadata.fetch(
            owner.host,
            owner.port,
            owner.agent_name,
            token=owner.metadata_token,
            timeout_s=remaining,
            connect_timeout_s=self.config.connect_timeout_ms / 1000.0,
        )
        with self._tally.locked() as c:
            c.metadata_fetches += 1
        try:
            loaded = self._agent.add_remote_agent(md)
        except Exception as exc:
            raise ReadError(
                f"NIXL rejected the metadata of {owner.agent_name}: {exc}", reason=Reason.METADATA_UNAVAILABLE
            ) from exc
        loaded_name = loaded.decode() if isinstance(loaded, bytes) else str(loaded)
        if loaded_name != owner.agent_name:
            self._forget(loaded_name)
            raise ReadError(
                f"metadata from {owner.endpoint} names agent {loaded_name!r}, not {owner.agent_name!r}",
                reason=Reason.METADATA_UNAVAILABLE,
            )
        # An epoch below the descriptor's (a forged or racing descriptor) is kept as is: the next such read refetches.
        rem.epoch = epoch
        self._xfers.invalidate(lambda key: key.owner == rem.name and key.epoch != epoch)

    def _transfer(
        self,
        rem: _Remote,
        owner: Owner,
        local_mem: str,
        local: Sequence[Range],
        remote_mem: str,
        remote: Sequence[Range],
        deadline: float,
    ) -> None:
        agent = self._agent
        key = XferKey(rem.name, rem.epoch, local_mem, _ranges(local), remote_mem, _ranges(remote))
        token = self._xfers.token()
        cached = self._xfers.take(key)
        handles: list[Any] = cached.handles if cached is not None else []
        xfer = cached.xfer if cached is not None else None
        try:
            if xfer is None:
                try:
                    handles.append(agent.prep_xfer_dlist("NIXL_INIT_AGENT", list(local), local_mem))
                    handles.append(agent.prep_xfer_dlist(rem.name, list(remote), remote_mem))
                except Exception as exc:
                    if _is(exc, "NotFound"):
                        raise LeaseExpired(
                            f"{owner.agent_name} has no registered memory at the descriptor's range (slot released "
                            "and freed, or a bad address)",
                            reason=Reason.LEASE_EXPIRED,
                        ) from exc
                    raise self._translate(exc, rem, owner) from exc
                idx = list(range(len(local)))
                xfer = agent.make_prepped_xfer("READ", handles[0], idx, handles[1], idx)
            state = agent.transfer(xfer)
            spin_until = time.monotonic() + _SPIN_S
            sleep_s = 0.00005
            while state == "PROC":
                now = time.monotonic()
                if now >= deadline:
                    with self._remotes_lock:
                        rem.busy += 1  # until NIXL is done with it: the owner must not be swept meanwhile
                    pending = _NixlPending(agent, xfer, handles, lambda: self._unbusy(rem))
                    xfer, handles = None, []
                    err = ReadTimeout(
                        f"READ from {owner.agent_name} ({sum(n for _, n, _ in remote)} bytes) missed its "
                        "deadline; destination quarantined until NIXL finishes",
                        reason=Reason.READ_TIMEOUT,
                    )
                    err.pending = pending
                    raise err
                if now >= spin_until:
                    time.sleep(min(sleep_s, max(deadline - now, 0)))
                    sleep_s = min(sleep_s * 2, 0.001)
                state = agent.check_xfer_state(xfer)
            if state != "DONE":
                # Reconnect from fresh metadata next time: an errored endpoint may stay unusable in UCX.
                self._forget(rem.name)
                with self._tally.locked() as c:
                    c.nixl_read_errors += 1
                raise ReadError(f"READ from {owner.agent_name} failed (state {state})", reason=Reason.RDMA_READ_ERROR)
            self._xfers.put(key, XferEntry(xfer, handles), token)  # completed: may be posted again
            xfer, handles = None, []
        except (ReadError, ClosedError):
            raise
        except Exception as exc:
            raise self._translate(exc, rem, owner) from exc
        finally:
            if xfer is not None or handles:
                release_quietly(xfer, *handles)

    def _unbusy(self, rem: _Remote) -> None:
        with self._remotes_lock:
            rem.busy -= 1
            rem.last_used = time.monotonic()

    def _translate(self, exc: Exception, rem: _Remote, owner: Owner) -> ReadError:
        if _is(exc, "RemoteDisconnect"):
            with self._tally.locked() as c:
                c.peer_disconnects += 1
            self._forget(rem.name)
            return ReadError(
                f"owner {owner.agent_name} at {owner.endpoint} disconnected (dead or restarted)",
                reason=Reason.PEER_DISCONNECTED,
            )
        with self._tally.locked() as c:
            c.nixl_read_errors += 1
        return ReadError(
            f"NIXL READ from {owner.agent_name} failed: {type(exc).__name__}: {exc}", reason=Reason.RDMA_READ_ERROR
        )

    def _forget(self, name: str) -> None:
        self._xfers.invalidate(lambda key: key.owner == name)
        with self._remotes_lock:
            self._remotes.pop(name, None)
        try:
            self._agent.remove_remote_agent(name)
        except Exception:  # already gone
            log.debug("remove_remote_agent(%s) failed", name, exc_info=True)

    def _learn_transport(self, text: str, owner: Owner, local_mem: str, remote_mem: str) -> None:
        found = _ucx_probe.parse_read_tables(text)
        if not found and "memory read" in text:
            log.info(
                "could not parse the UCX READ protocol table: %r", [ln for ln in text.splitlines() if "|" in ln][:12]
            )
        for pair, transport in found.items():
            if self._transports.get(pair) != transport:
                self._transports[pair] = transport
                if "VRAM" in pair and _ucx_probe.is_slow_for_gpu(transport):
                    log.warning(
                        "GPU READ (%s <- %s) from %s goes over %s, not cuda_ipc/RDMA: expect ~1000x lower "
                        "bandwidth; check UCX_CUDA_IPC_ENABLE_GET_ZCOPY=y and UCX_TLS",
                        pair.local,
                        pair.remote,
                        owner.agent_name,
                        transport,
                    )
                else:
                    log.info(
                        "rdma READ %s <- %s from %s uses UCX transport %s",
                        pair.local,
                        pair.remote,
                        owner.agent_name,
                        transport,
                    )

    def transport(self, local_mem: str | None = None, remote_mem: str | None = None) -> str:
        own = "VRAM" if self.config.is_cuda else "DRAM"
        return self._transports.get(MemPair(local_mem or own, remote_mem or local_mem or own), "unknown")

    def stats(self) -> NixlStats:
        xfers = self._xfers.stats()
        served = self._server.stats() if self._server is not None else _metadata.ServerStats()
        with self._remotes_lock:
            owners = len(self._remotes)
        return dataclasses.replace(
            self._tally.snapshot(),
            transport=self.transport(),
            known_owners=owners,
            xfer_reposts=xfers.reposts,
            xfer_preps=xfers.preps,
            metadata_served=served.served,
            metadata_refused=served.refused,
            metadata_rejected=served.rejected,
            metadata_evicted=served.evicted,
        )

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        if self._server is not None:
            self._server.close()
        self._xfers.clear()
        for name in list(self._remotes):
            try:
                self._agent.remove_remote_agent(name)
            except Exception:
                pass
        self._remotes.clear()
        # Dropping the last reference destroys the agent (UCX workers, progress thread) in the C++ destructor.
        self._agent = None

    def _check_open(self) -> None:
        if self._closed:
            raise ClosedError("NIXL provider is closed")


def _make_agent(api: Any, name: str, config: RdmaConfig) -> Any:
    conf = api.nixl_agent_config(
        enable_prog_thread=True,
        enable_listen_thread=False,
        backends=[],
        sync_mode=api.nixl_thread_sync_t.NIXL_THREAD_SYNC_STRICT,  # read() runs on many threads
    )
    delay_us = config.progress_delay_us
    with _CTOR_LOCK:
        original = api.nixlBind.nixlAgent

        def patched(agent_name: str, cfg: Any) -> Any:
            cfg.pthrDelay = delay_us
            return original(agent_name, cfg)

        api.nixlBind.nixlAgent = patched
        try:
            agent = api.nixl_agent(name, conf)
        finally:
            api.nixlBind.nixlAgent = original
    # qp_count -> UCX workers: NIXL spreads transfers of different threads over them (each with its own endpoints
    # to every peer), so concurrent reads do not serialize on one worker. Idle cost measured: ~2% of a core at 8.
    agent.create_backend("UCX", {"num_workers": str(config.qp_count)})
    return agent


def _ranges(ranges: Sequence[Range]) -> tuple[Range, ...]:
    """Ranges as a hashable tuple of plain (addr, length, device) tuples (callers may pass lists of lists).

    The reader passes tuples already: ``tuple()`` plus a hash is ~0.1 us, rebuilding each range ~0.7 us (4 per fetch).
    """
    out = tuple(ranges)
    try:
        hash(out)
    except TypeError:
        out = tuple((a, n, d) for a, n, d in out)
    return out


def _is(exc: BaseException, fragment: str) -> bool:
    return fragment in type(exc).__name__ or f"NIXL_ERR_{fragment.upper()}" in str(exc)
