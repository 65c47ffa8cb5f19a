"""Per-process pieces of the connector: servers, staging areas, unix sockets, the endpoint rendezvous.

vLLM builds one connector per role and process, and the two halves of one instance may or may not share a
process (uniproc executor: yes; multiprocess executor, vLLM's default on CPU: no). Whatever must be shared
between the halves, or found by the other process, lives here, keyed by the *instance name*
``<engine_id>-dp<data parallel rank>`` (vLLM hands every process of an instance the same ``engine_id``):

- Producer: the worker (first rank) owns a :class:`ProducerRuntime` (exporter, HeldStore, its gRPC server).
  Its scheduler finds the endpoint in this process's registry, else in ``<runtime_dir>/<name>.producer.json``
  (written atomically by the worker at start-up, removed at shutdown), else from a fixed ``port``.
  Each held item's receipt goes from the worker to the scheduler through the instance's
  :class:`~tensorwire.integrations._vllm_ec.receipts.ReceiptBoard` (``receipt_board``).
- Consumer: each worker rank owns a :class:`StagingRuntime` (StagingArea on the rank's device). When the
  scheduler is in another process it serves the Staging service on ``unix:<runtime_dir>/<name>-tp<rank>.sock``
  (the directory is created 0700: the socket is the access control); in the same process the scheduler uses
  the area directly.
"""

from __future__ import annotations

import json
import logging
import os
import re
import threading
from collections.abc import Callable
from pathlib import Path

from tensorwire._grpc.scope import is_loopback_host
from tensorwire._local import unix as _unix
from tensorwire._local.unix import InsecurePath
from tensorwire.errors import ConfigError, ExportError, Reason
from tensorwire.integrations._vllm_ec.config import ECConfig
from tensorwire.integrations._vllm_ec.receipts import ReceiptBoard
from tensorwire.integrations._vllm_ec.segments import SegmentSpares, SegmentStager
from tensorwire.mm.held._local import LocalRpcServer
from tensorwire.mm.held._rpc import StoreServer, serve_staging_local, serve_store
from tensorwire.mm.held._staging import StagingArea
from tensorwire.mm.held._store import HeldStore
from tensorwire.rdma import RdmaConfig, TensorExporter, TensorReader
from tensorwire.rdma._endpoint import detect, is_loopback, is_wildcard

log = logging.getLogger(__name__)

_lock = threading.Lock()
_producers: dict[str, ProducerRuntime] = {}
_staging: dict[tuple[str, int], StagingRuntime] = {}
_boards: dict[str, ReceiptBoard] = {}
_metrics_servers: set[int] = set()
_SAFE = re.compile(r"[^A-Za-z0-9_.-]")
_MAX_SLOT = 1024**3


def instance_name(engine_id: str | None, dp_rank: int) -> str:
    return f"{_SAFE.sub('_', str(engine_id or 'engine'))[:64]}-dp{int(dp_rank)}"


def runtime_dir(cfg: ECConfig) -> Path:
    """The directory for sockets and rendezvous files, created 0700 and checked through a handle
    (:func:`open_runtime_dir`)."""
    path, fd = open_runtime_dir(cfg)
    os.close(fd)
    return path


def open_runtime_dir(cfg: ECConfig) -> tuple[Path, int]:
    """``(path, handle)`` of the runtime directory: opened without following a symlink, and checked through the
    handle to be this user's with mode 0700 (a ConfigError otherwise, reason ``insecure_path``), the default's
    parent (tensorwire's per-user directory, ``_unix.default_runtime_dir``, which moves to a private fallback
    when another user took its name) too. Files in it are opened relative to the handle (the caller closes it):
    a name swapped for a symlink or another directory afterwards is never used."""
    path = Path(cfg.effective_runtime_dir)
    try:
        if not cfg.runtime_dir:
            os.close(_unix.open_private_dir(str(path.parent)))
        return path, _unix.open_private_dir(str(path), strict=True)
    except InsecurePath as exc:
        raise ConfigError(
            f"runtime_dir {path} must be a directory (not a symlink) owned by uid {os.geteuid()} "
            f"with mode 0700, as it holds the connector's sockets: {exc}; set "
            "ec_connector_extra_config.runtime_dir",
            reason=Reason.INSECURE_PATH,
        ) from exc


# How long the idle NIXL progress thread of the connector's host-memory agents (an encoder instance's exporter, an
# LLM instance's reader) sleeps between wake-ups. At RdmaConfig's 1 ms it woke ~920 times a second inside the
# engine (2.6-3.2% of a core on the 2-core box) beside vLLM's own threads; at 50 ms 22 times (0.2-0.4%). A reader's
# READs are driven by its reading thread's own polling; an exporter serves the TCP READs of other hosts from that
# thread, which the READ's arrival wakes (UCX's event fd), not the delay: a READ from another network namespace
# over a veth took as long at 50 ms as at 1 ms, 4 KiB to 10 MiB, also after the owner sat idle 0.02-0.2 s
# (benchmarks/results/progress-delay-cpu2.json). GPU agents keep the default (not measured there).
_CPU_PROGRESS_DELAY_US = 50_000


def _rdma_config(cfg: ECConfig, device: str) -> RdmaConfig:
    """The connector's RDMA settings for ``device`` (an encoder instance's exporter, an LLM instance's reader)."""
    # control_host: the metadata endpoint follows the store's gRPC address, and advertises what the store's
    # endpoint advertises (the rules of tensorwire.rdma._endpoint, docs/deployment.md "Addresses").
    rdma = RdmaConfig(
        provider=cfg.rdma_provider,
        device=device,
        slot_gc_timeout_ms=cfg.lease_ttl_ms,
        pool_cap_bytes=cfg.pool_cap_bytes,
        max_slot_bytes=min(_MAX_SLOT, cfg.pool_cap_bytes),
        control_host=cfg.host,
        advertise_host=cfg.advertise_host,
        port=cfg.rdma_port,
    )
    if device == "cpu":
        rdma = rdma.replace(progress_delay_us=_CPU_PROGRESS_DELAY_US)
    return rdma


def _advertise(cfg: ECConfig) -> str:
    """The host written into ec_transfer_params: ``advertise_host``, a specific ``host``, else the address the
    RDMA metadata endpoint detects too (the default route's source address), so both planes name one host."""
    if cfg.advertise_host:
        return cfg.advertise_host
    if not is_wildcard(cfg.host):
        return cfg.host
    return detect()[0]


def _check_listener(cfg: ECConfig) -> None:
    """The store's bind rule (``GrpcHost.bind``'s, docs/security.md) in the connector's own terms, before anything
    starts: plaintext on a non-loopback ``host`` only with ``insecure: true``."""
    if not cfg.tls.server_enabled and not cfg.insecure and not is_loopback_host(cfg.host):
        raise ConfigError(
            f"refusing a plaintext held-outputs store on ec_connector_extra_config.host={cfg.host!r}, which is not a "
            "loopback address: anyone who can reach it could look up and release items. Set tls_cert, tls_key and "
            "tls_ca (mTLS; docs/security.md) or insecure: true on a network you trust"
        )


class ProducerRuntime:
    """The encoder instance's exporter, held-outputs store and gRPC server (in the exporting worker)."""

    def __init__(
        self,
        cfg: ECConfig,
        name: str,
        device: str,
        on_change: Callable[[int, int], None] | None = None,
        compat: str = "",
    ) -> None:
        _check_listener(cfg)
        self.name = name
        self._file: Path | None = None
        self.exporter: TensorExporter | None = None
        self.store: HeldStore | None = None
        self.server: StoreServer | None = None
        self.segments: SegmentSpares | None = None  # the store's host segments (``same_host_map``)
        try:
            try:
                self.exporter = TensorExporter(_rdma_config(cfg, device))
            except ExportError as exc:
                if exc.reason is not Reason.PROVIDER_UNAVAILABLE:
                    raise
                log.warning("no RDMA provider on this encoder instance (%s); items are served inline over gRPC", exc)
            if cfg.same_host_map and self.exporter is not None and device == "cpu":
                self.segments = SegmentSpares()
            self.store = HeldStore(
                self.exporter,
                ttl_s=cfg.lease_ttl_ms / 1000.0,
                on_change=on_change,
                compat=compat,
                segments=self.segments,
            )
            local_dir = str(runtime_dir(cfg)) if cfg.serves_local_channel else ""
            self.server = serve_store(
                f"{cfg.host}:{cfg.port}",
                store=self.store,
                advertise_host=_advertise(cfg),
                tls=cfg.tls,
                insecure=cfg.insecure,
                local_dir=local_dir,
            )
            self.endpoint = self.server.address
            if cfg.port == 0:
                directory, fd = open_runtime_dir(cfg)
                try:
                    _unix.write_private_file(
                        fd,
                        f"{name}.producer.json",
                        json.dumps({"endpoint": self.endpoint, "pid": os.getpid()}).encode(),
                    )
                finally:
                    os.close(fd)
                self._file = directory / f"{name}.producer.json"
        except BaseException:
            self.close()
            raise
        log.info(
            "tensorwire EC producer %s: held outputs on %s (%s, device %s, ttl %d ms)",
            name,
            self.endpoint,
            "rdma" if self.exporter is not None else "inline",
            device,
            cfg.lease_ttl_ms,
        )
        if is_loopback(cfg.host):  # a warning: vLLM leaves non-vllm loggers at WARNING, and this decides reachability
            log.warning(
                "tensorwire EC producer %s listens on loopback only (%s): LLM instances on other hosts cannot "
                "reach it; set ec_connector_extra_config.host to an address they can reach",
                name,
                cfg.host,
            )

    def close(self) -> None:
        if self._file is not None:
            try:
                fd = _unix.open_private_dir(str(self._file.parent), create=False, strict=True)
                try:
                    os.unlink(self._file.name, dir_fd=fd)
                finally:
                    os.close(fd)
            except (OSError, InsecurePath):
                pass
            self._file = None
        if self.server is not None:
            self.server.stop(0.5)
            self.server = None
        if self.store is not None:
            self.store.close()
        if self.segments is not None:
            self.segments.close()
            self.segments = None
        if self.exporter is not None:
            self.exporter.close()
            self.exporter = None


def producer_runtime(
    cfg: ECConfig, name: str, device: str, on_change: Callable[[int, int], None] | None = None, compat: str = ""
) -> ProducerRuntime:
    with _lock:
        rt = _producers.get(name)
        if rt is None:
            rt = _producers[name] = ProducerRuntime(cfg, name, device, on_change, compat)
        return rt


def producer_endpoint(cfg: ECConfig, name: str) -> str | None:
    """Where the instance's store is: this process, the rendezvous file, or the fixed port; None if unknown."""
    with _lock:
        rt = _producers.get(name)
    if rt is not None:
        return rt.endpoint
    if cfg.port:
        return f"{_advertise(cfg)}:{cfg.port}"
    try:
        _, fd = open_runtime_dir(cfg)
    except ConfigError:  # not private: nothing in it is read (the producer itself refused to start there)
        return None
    try:
        data = json.loads(_unix.read_private_file(fd, f"{name}.producer.json"))
        endpoint = data.get("endpoint")
        return endpoint if isinstance(endpoint, str) and endpoint else None
    except (OSError, ValueError, InsecurePath):
        return None
    finally:
        os.close(fd)


def close_producer(name: str) -> None:
    with _lock:
        rt = _producers.pop(name, None)
        board = _boards.pop(name, None)
    if rt is not None:
        rt.close()
    if board is not None:
        board.clear()
        board.close()


def receipt_board(cfg: ECConfig, name: str) -> ReceiptBoard:
    """This process's receipt board of instance ``name`` (one per process: the scheduler and worker halves of a
    one-process engine share it). Without a private runtime directory it keeps receipts in memory only."""
    with _lock:
        board = _boards.get(name)
        if board is None:
            try:
                _, fd = open_runtime_dir(cfg)
            except ConfigError as exc:
                log.warning("no private runtime dir for receipts (%s): LLM instances look items up", exc)
                fd = None
            board = _boards[name] = ReceiptBoard(name, fd)
        return board


def staging_address(cfg: ECConfig, name: str, rank: int) -> str:
    """``unix:<runtime_dir>/<name>-tp<rank>.sock``: the rank's Staging gRPC service; its same-host socket
    (``staging_local_path``) is next to it."""
    path = runtime_dir(cfg) / f"{name}-tp{int(rank)}.sock"
    if len(staging_local_path(f"unix:{path}")) > 100:
        raise ConfigError(
            f"socket path {path} is too long for a unix socket; set a shorter runtime_dir", reason=Reason.PATH_TOO_LONG
        )
    return f"unix:{path}"


def staging_local_path(address: str) -> str:
    """The same-host socket (``tensorwire.mm.held._local``) next to a rank's ``unix:`` Staging address."""
    path = address[len("unix:") :] if address.startswith("unix:") else address
    return path[: -len(".sock")] + ".local.sock" if path.endswith(".sock") else path + ".local"


class StagingRuntime:
    """One consumer rank's StagingArea (reader on the rank's device), served on a socket when asked."""

    def __init__(self, cfg: ECConfig, name: str, rank: int, device: str, *, serve: bool) -> None:
        rdma = _rdma_config(cfg, device)
        factory = None if cfg.rdma_provider == "none" else (lambda: TensorReader(rdma))
        self.area = StagingArea(factory, device=device)
        self.server: StoreServer | None = None
        self.local: LocalRpcServer | None = None
        self._socket: Path | None = None
        try:
            if serve:
                address = staging_address(cfg, name, rank)
                self._socket = Path(address[len("unix:") :])
                if self._socket.exists():
                    self._socket.unlink()  # a dead instance's socket under the same name
                self.server = serve_store(address, staging=self.area, threads=max(4, cfg.fetch_threads))
                # Stage/Drop without gRPC's thread hand-offs (the scheduler's RemoteStager tries it first; a
                # stale file of a dead instance is replaced by _unix.listen). Optional: without it, gRPC serves.
                try:
                    self.local = serve_staging_local(staging_local_path(address), self.area)
                except (OSError, InsecurePath) as exc:
                    log.warning(
                        "tensorwire EC consumer %s rank %d: no same-host staging socket (%s); the scheduler "
                        "uses the gRPC socket",
                        name,
                        rank,
                        exc,
                    )
            # The NIXL agent takes a fraction of a second to build: do it now, not in the first fetch.
            threading.Thread(target=self.area.warm_up, name="tensorwire-ec-warmup", daemon=True).start()
        except BaseException:
            self.close()
            raise
        log.info(
            "tensorwire EC consumer %s rank %d: staging on %s (device %s)",
            name,
            rank,
            self.server.address if self.server else "this process",
            device,
        )

    def close(self) -> None:
        if self.local is not None:
            self.local.close(0.5)
            self.local = None
        if self.server is not None:
            self.server.stop(0.5)
            self.server = None
        if self._socket is not None:
            try:
                self._socket.unlink()
            except OSError:
                pass
            self._socket = None
        self.area.close()


def staging_runtime(cfg: ECConfig, name: str, rank: int, device: str, *, serve: bool) -> StagingRuntime:
    with _lock:
        rt = _staging.get((name, rank))
        if rt is None:
            rt = _staging[(name, rank)] = StagingRuntime(cfg, name, rank, device, serve=serve)
        return rt


def close_staging(name: str, rank: int) -> None:
    with _lock:
        rt = _staging.pop((name, rank), None)
    if rt is not None:
        rt.close()


def segment_stager(cfg: ECConfig) -> SegmentStager:
    """The LLM instance's host stager (scheduler process, CPU workers in other processes): one reader on host
    memory, built in the background now (a NIXL agent takes a fraction of a second), not in the first fetch."""
    rdma = _rdma_config(cfg, "cpu")
    stager = SegmentStager(
        None if cfg.rdma_provider == "none" else (lambda: TensorReader(rdma)), map_host=cfg.same_host_map
    )
    threading.Thread(target=stager.warm_up, name="tensorwire-ec-warmup", daemon=True).start()
    return stager


def serve_metrics(port: int) -> None:
    """Serves this process's default Prometheus registry on ``port`` (once per port and process)."""
    if port <= 0:
        return
    with _lock:
        if port in _metrics_servers:
            return
        _metrics_servers.add(port)
    from prometheus_client import start_http_server

    try:
        start_http_server(port)
        log.info("tensorwire EC metrics on :%d", port)
    except OSError as exc:
        log.warning("cannot serve metrics on port %d: %s", port, exc)


__all__ = [
    "instance_name",
    "runtime_dir",
    "open_runtime_dir",
    "ProducerRuntime",
    "producer_runtime",
    "producer_endpoint",
    "close_producer",
    "receipt_board",
    "StagingRuntime",
    "staging_runtime",
    "close_staging",
    "staging_address",
    "staging_local_path",
    "segment_stager",
    "serve_metrics",
]
