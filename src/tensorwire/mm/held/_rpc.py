"""gRPC for held outputs: the HeldOutputs and Staging services (held.proto), a server hosting them, clients.

``HeldOutputs`` serves a :class:`HeldStore` (Lookup by grant -> receipt, Release grants); ``Staging`` serves a
:class:`StagingArea` (Stage a receipt -> answered once the tensors are local, Drop keys). Either or both run
in one :class:`StoreServer` (``GrpcHost``: the encoder server's bind / health / stop sequence) on ``host:port``
or ``unix:/path``. Methods are registered as ``GrpcHost`` services
(raw bytes in and out, as ``EncoderService``): a malformed message is INVALID_ARGUMENT with a reason and the
server keeps serving.

Transport security is the encoder's (``tensorwire._grpc.tls``, docs/security.md): ``serve_store(tls=...)`` with a
certificate listens with TLS (mTLS unless ``client_auth`` is off); without one a TCP listener binds only a
loopback address unless ``insecure=True``. A ``unix:`` socket is plaintext (its directory's mode is the access
control). The clients take the same ``TlsConfig`` and speak TLS when it has a CA or a certificate; a refused
handshake is a ``PeerUnavailable``. Errors cross as status + ``tensorwire-reason`` (``tensorwire.mm.wire``);
per-grant lookup failures are fields of the answer (one bad grant does not fail the others), each a
``Reason`` value: ``not_held`` (no live grant: never held, released, expired), ``not_ready`` (granted, the item
is not held yet: retry), ``incompatible`` (the request's compatibility hash is not the store's). ``grpc.RpcError``
never leaves here.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import grpc
from google.protobuf.message import DecodeError

from tensorwire._grpc.host import GrpcHost, Method, Service
from tensorwire._grpc.tls import TlsConfig, secure_or_insecure_channel
from tensorwire._local import unix as _unix
from tensorwire.errors import (
    ClosedError,
    ConfigError,
    DeadlineExceeded,
    InvalidPayload,
    LeaseExpired,
    ProtocolError,
    ReadError,
    ReadTimeout,
    Reason,
    TensorwireError,
)
from tensorwire.mm import wire
from tensorwire.mm._proto import encoder_pb2 as pb
from tensorwire.mm._proto import held_pb2 as hpb
from tensorwire.mm.held._local import (
    LocalRpcClient,
    LocalRpcServer,
    LocalUnavailable,
    PendingCall,
    local_channel_request,
)
from tensorwire.mm.held._staging import Expect, StagingArea
from tensorwire.mm.held._store import HeldItem, HeldStore
from tensorwire.mm.server._service import _parse_or_abort as _parse  # INVALID_ARGUMENT for bytes that do not parse
from tensorwire.mm.wire._codec import encode_tensor
from tensorwire.mm.wire._local import channel_info

log = logging.getLogger(__name__)

HELD_SERVICE = f"{wire.PACKAGE}.HeldOutputs"
STAGING_SERVICE = f"{wire.PACKAGE}.Staging"
LOOKUP_METHOD = f"/{HELD_SERVICE}/Lookup"
RELEASE_METHOD = f"/{HELD_SERVICE}/Release"
LOCAL_CHANNEL_METHOD = f"/{HELD_SERVICE}/LocalChannel"
STAGE_METHOD = f"/{STAGING_SERVICE}/Stage"
DROP_METHOD = f"/{STAGING_SERVICE}/Drop"
MAX_GRANTS_PER_CALL = 4096


def receipt_for(item: HeldItem, *, rdma: bool) -> pb.EncodeResponse:
    """The receipt of a held item: one RDMA slot (roles EMBEDDING, then EXTRA_INPUT), with the item's host
    segment when it has one, or inline tensors."""
    receipt = pb.EncodeResponse()
    if item.shapes[0]:
        receipt.split_sizes.append(int(item.shapes[0][0]))
    if rdma and item.descriptor is not None:
        slot = receipt.rdma_slots.add()
        slot.descriptor = item.descriptor.to_bytes()
        slot.roles.extend([pb.EMBEDDING] + [pb.EXTRA_INPUT] * (len(item.shapes) - 1))
        seg = item.segment
        if seg is not None and seg.fd >= 0:
            hs = receipt.host_segment
            hs.fd, hs.name, hs.nbytes = seg.fd, seg.name, seg.size
            manifest = item.descriptor.manifest
            if len(manifest) == 1:  # the tensor's place, so that a reader that met the owner needs no descriptor
                m = manifest[0]
                hs.shape.extend(m.shape)
                hs.dtype, hs.offset = str(m.dtype).removeprefix("torch."), m.offset
        return receipt
    if item.tensors is None:
        raise TensorwireError(
            f"item {item.key[:64]!r} is held in RDMA slots only; the reader must support RDMA",
            reason=Reason.PROVIDER_UNAVAILABLE,
        )
    encode_tensor(item.tensors[0], receipt.embedding)
    for t in item.tensors[1:]:
        encode_tensor(t, receipt.extra_inputs.add())
    return receipt


def _check_count(n: int, context: grpc.ServicerContext) -> None:
    if n > MAX_GRANTS_PER_CALL:
        wire.abort_with(
            context,
            InvalidPayload(f"{n} grants in one call exceed {MAX_GRANTS_PER_CALL}", reason=Reason.INVALID_REQUEST),
        )


class HeldStoreServicer:
    """Lookup and Release over a HeldStore (which the servicer does not own)."""

    def __init__(self, store: HeldStore) -> None:
        self.store = store
        self.local: LocalRpcServer | None = None  # the same-host socket, when serve_store opened one

    def local_channel(self, raw: bytes, context: grpc.ServicerContext) -> bytes:
        """The same-host socket's path for a client with our host token, else an empty answer."""
        request = _parse(pb.LocalChannelRequest, raw, context)
        local = self.local
        return channel_info(local, request).SerializeToString()

    def lookup(self, raw: bytes, context: grpc.ServicerContext) -> bytes:
        req = _parse(hpb.LookupRequest, raw, context)
        _check_count(len(req.grants), context)
        resp = hpb.LookupResponse()
        mine = self.store.compat
        incompatible = bool(req.compat and mine and req.compat != mine)
        for g in req.grants:
            result = resp.results.add(key=g.key)
            if incompatible:  # refused before the store is asked: nothing of the item is handed out
                result.error_reason = Reason.INCOMPATIBLE.value
                result.error_message = (
                    f"this store's compatibility hash {mine[:12]}... differs from the reader's "
                    f"{req.compat[:12]}... (vLLM version, model, dtype or tensorwire version)"
                )
                continue
            try:
                item = self.store.lookup(g.key, bytes(g.secret))
                result.receipt.CopyFrom(receipt_for(item, rdma=req.support_rdma))
            except ClosedError as exc:
                wire.abort_with(context, exc)
            except TensorwireError as exc:
                result.error_reason = exc.reason.value
                result.error_message = str(exc)
        return resp.SerializeToString()

    def release(self, raw: bytes, context: grpc.ServicerContext) -> bytes:
        req = _parse(hpb.ReleaseRequest, raw, context)
        _check_count(len(req.grants), context)
        released = 0
        for g in req.grants:
            try:
                released += int(self.store.release(g.key, bytes(g.secret)))
            except InvalidPayload:
                continue  # a malformed grant cannot name anything held
        return hpb.ReleaseResponse(released=released).SerializeToString()

    def handler(self) -> grpc.GenericRpcHandler:
        return grpc.method_handlers_generic_handler(
            HELD_SERVICE,
            {
                "Lookup": grpc.unary_unary_rpc_method_handler(self.lookup),
                "Release": grpc.unary_unary_rpc_method_handler(self.release),
                "LocalChannel": grpc.unary_unary_rpc_method_handler(self.local_channel),
            },
        )

    def service(self) -> Service:
        """The same methods as a ``GrpcHost`` service (its per-peer limits and request deadline)."""
        return Service(
            HELD_SERVICE,
            (
                Method("Lookup", self.lookup),
                Method("Release", self.release),
                Method("LocalChannel", self.local_channel),
            ),
        )

    def local_methods(self) -> dict[str, Callable[[bytes, Any], bytes]]:
        """What the same-host socket serves: the same functions, so the same semantics and errors."""
        return {"Lookup": self.lookup, "Release": self.release}


class StagingServicer:
    """Stage and Drop over a StagingArea (which the servicer does not own)."""

    def __init__(self, area: StagingArea) -> None:
        self.area = area

    def stage(self, raw: bytes, context: grpc.ServicerContext) -> bytes:
        req = _parse(hpb.StageRequest, raw, context)
        try:
            remaining = context.time_remaining()
            timeout_ms = int(req.timeout_ms) if req.timeout_ms > 0 else 3000
            if remaining is not None:
                timeout_ms = min(timeout_ms, int(remaining * 1000))
            nbytes = self.area.stage(req.key, req.receipt, timeout_ms=timeout_ms, expect=Expect.from_pb(req))
        except Exception as exc:
            wire.abort_with(context, exc)
            raise  # unreachable: abort raises
        return hpb.StageResponse(nbytes=nbytes).SerializeToString()

    def drop(self, raw: bytes, context: grpc.ServicerContext) -> bytes:
        req = _parse(hpb.DropRequest, raw, context)
        _check_count(len(req.keys), context)
        return hpb.DropResponse(dropped=self.area.drop(list(req.keys))).SerializeToString()

    def handler(self) -> grpc.GenericRpcHandler:
        return grpc.method_handlers_generic_handler(
            STAGING_SERVICE,
            {
                "Stage": grpc.unary_unary_rpc_method_handler(self.stage),
                "Drop": grpc.unary_unary_rpc_method_handler(self.drop),
            },
        )

    def service(self) -> Service:
        """The same methods as a ``GrpcHost`` service (its per-peer limits and request deadline)."""
        return Service(STAGING_SERVICE, (Method("Stage", self.stage), Method("Drop", self.drop)))

    def local_methods(self) -> dict[str, Callable[[bytes, Any], bytes]]:
        """What a reader process's same-host socket serves (``serve_staging_local``)."""
        return {"Stage": self.stage, "Drop": self.drop}


class StoreServer:
    """A running gRPC server with HeldOutputs and/or Staging (and grpc.health.v1), on ``GrpcHost``.

    ``address`` is what clients dial: ``host:port`` (the bound port) or ``unix:/path``. ``stop`` is idempotent.
    The server does not own the store or the area; their owner closes them after ``stop``.
    """

    def __init__(self, host: GrpcHost, address: str, port: int, local: LocalRpcServer | None = None) -> None:
        self._host = host
        self.address = address
        self.port = port
        self.local = local  # the same-host socket for Lookup/Release, if one was opened

    def stop(self, grace: float | None = 1.0) -> None:
        if self.local is not None:
            self.local.stop_accepting()  # its file first: new same-host clients go to gRPC, which drains
        self._host.stop(grace)
        if self.local is not None:
            self.local.close(grace_s=0.5 if grace is None else min(grace, 0.5))

    def __enter__(self) -> StoreServer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def serve_store(
    address: str,
    *,
    store: HeldStore | None = None,
    staging: StagingArea | None = None,
    threads: int = 4,
    advertise_host: str = "",
    tls: TlsConfig | None = None,
    insecure: bool = False,
    local_dir: str = "",
) -> StoreServer:
    """Starts a StoreServer on ``address`` (``host:0`` picks a port; ``unix:/path`` a socket).

    ``local_dir`` (with a store on a TCP address): also serve Lookup/Release on a same-host Unix socket in that
    private directory (``_local_rpc``; clients on this host find it through ``LocalChannel``). The caller decides
    whether same-uid trust is acceptable (the connector does not open it for an mTLS store unless asked). A
    socket that cannot be made safely is logged and skipped: gRPC serves alone.

    ``advertise_host`` replaces the bind host in ``StoreServer.address`` (for ``0.0.0.0`` binds). ``tls`` with a
    certificate: a TLS listener (mTLS unless ``tls.client_auth`` is off); without one, a TCP address that is not
    loopback needs ``insecure=True``. Raises ConfigError when nothing is served, the address cannot be bound, the
    TLS files do not load, or a plaintext listener would face a non-loopback address without ``insecure``.
    """
    if store is None and staging is None:
        raise ConfigError("serve_store needs a store, a staging area, or both")
    services: list[Service] = []
    names: list[str] = []
    held: HeldStoreServicer | None = None
    if store is not None:
        held = HeldStoreServicer(store)
        services.append(held.service())
        names.append(HELD_SERVICE)
    if staging is not None:
        services.append(StagingServicer(staging).service())
        names.append(STAGING_SERVICE)
    unix = address.startswith("unix:")
    if unix and tls is not None and tls.server_enabled:
        raise ConfigError(
            f"serve_store({address!r}): TLS on a unix socket is not supported (the socket's directory "
            "is its access control); give a host:port address or no certificate"
        )
    host = GrpcHost(
        "store server", services, work_slots=threads, thread_prefix="tensorwire-store", serving=names, tls=tls
    )
    # A unix socket never leaves the host: GrpcHost's loopback rule is about TCP addresses.
    port = host.bind(address, insecure=insecure or unix)
    local: LocalRpcServer | None = None
    if held is not None and local_dir and not unix:
        try:
            local = held.local = LocalRpcServer("held", held.local_methods(), local_dir)
        except (OSError, _unix.InsecurePath) as exc:
            log.warning("no same-host channel for the held-outputs store: %s; clients use gRPC", exc)
    try:
        host.start()
    except BaseException:
        if local is not None:
            local.close(0.0)
        raise
    if unix:
        dial = address
    else:
        dial = f"{advertise_host or host.host}:{port}"
    log.info(
        "store server on %s (%s, %s%s)",
        dial,
        ", ".join(names),
        host.tls.describe() if host.tls else "plaintext",
        f"; same-host socket {local.path}" if local is not None else "",
    )
    return StoreServer(host, dial, port, local)


def serve_staging_local(path: str, staging: StagingArea) -> LocalRpcServer:
    """Stage and Drop of ``staging`` on a same-host socket at ``path`` (its directory must be private): the
    multiprocess executor's scheduler -> worker hop without gRPC's thread hand-offs. No deadline cap beyond the
    caller's (a Stage runs for its read budget)."""
    return LocalRpcServer(
        "staging", StagingServicer(staging).local_methods(), os.path.dirname(path), path=path, max_deadline_s=3600.0
    )


@dataclass(frozen=True)
class LookupOutcome:
    """One grant's answer: ``receipt`` or ``error`` (a TensorwireError with the owner's reason)."""

    key: str
    receipt: pb.EncodeResponse | None
    error: TensorwireError | None


class _Client:
    """One channel to ``address``: TLS when ``tls`` has a CA or a certificate (``tensorwire._grpc.tls``), else
    plaintext (``unix:`` sockets are always plaintext)."""

    def __init__(
        self, address: str, tls: TlsConfig | None = None, *, on_call: Callable[[str, str], None] | None = None
    ) -> None:
        self.address = address
        self._on_call = on_call or (lambda _m, _c: None)
        self._local: LocalRpcClient | None = None  # the same-host socket, when one is known (see _unary)
        self._local_lock = threading.Lock()
        tls = tls if tls is not None else TlsConfig()
        if address.startswith("unix:") and tls.client_enabled:
            raise ConfigError(f"{type(self).__name__}({address!r}): TLS on a unix socket is not supported")
        self._channel = secure_or_insecure_channel(address, tls, wire.channel_options())
        # One multicallable per method for the channel's life (not one per call: each is a native object).
        self._calls: dict[str, grpc.UnaryUnaryMultiCallable[bytes, bytes]] = {}
        self._closed = False

    def _call(self, method: str, request: Any, response: Any, timeout_s: float, what: str) -> Any:
        if self._closed:
            raise ClosedError(f"{type(self).__name__} for {self.address} is closed")
        if timeout_s <= 0:
            raise DeadlineExceeded(f"{what} on {self.address}: no time left", reason=Reason.BUDGET_EXHAUSTED)
        call = self._calls.get(method)
        if call is None:  # a race builds two; either works
            call = self._calls[method] = self._channel.unary_unary(
                method, request_serializer=None, response_deserializer=None
            )
        try:
            raw = call(request.SerializeToString(), timeout=timeout_s)
        except grpc.RpcError as exc:
            raise wire.error_from_rpc(exc, f"{what} on {self.address}") from exc
        except ValueError as exc:  # grpc: close() closed the channel after the check above
            raise ClosedError(f"{what} on {self.address}: the channel was closed ({exc})") from exc
        return self._parse_answer(response, raw, what)

    def _parse_answer(self, response: Any, raw: bytes, what: str) -> Any:
        try:
            return response.FromString(raw)
        except DecodeError as exc:
            raise ProtocolError(
                f"{what} on {self.address}: the answer does not parse: {exc}", reason=Reason.PROTOCOL_ERROR
            ) from exc

    def _unary(self, method: str, name: str, request: Any, response: Any, timeout_s: float) -> Any:
        """One call: over the same-host socket when there is one (a call that gets no answer there is made
        again over gRPC within what is left of ``timeout_s``: every method that goes this way is idempotent),
        else over gRPC."""
        local = self._local
        if local is None:
            self._local_missing()
        else:
            start = time.monotonic()
            try:
                raw = local.call(name, request.SerializeToString(), timeout_s, f"{name} on {self.address}")
            except TensorwireError:
                self._on_call(name, "local")  # answered (with an error) over the socket
                raise
            except LocalUnavailable as exc:
                self._local_failed(local)
                self._on_call(name, "local_fallback")
                log.info("%s %s: %s; this call and the next go over gRPC", type(self).__name__, self.address, exc)
                timeout_s -= time.monotonic() - start
            else:
                self._on_call(name, "local")
                return self._parse_answer(response, raw, name)
        out = self._call(method, request, response, timeout_s, name)
        self._on_call(name, "grpc")
        return out

    def _local_missing(self) -> None:
        """Called before a gRPC call made for want of a socket (a client that discovers one starts it here)."""

    def _local_failed(self, local: LocalRpcClient) -> None:
        """The socket gave no answer: stop using it (a discovering client asks again later)."""
        with self._local_lock:
            if self._local is local:
                self._local = None
        local.close()

    def close(self) -> None:
        with self._local_lock:
            local, self._local = self._local, None
        if local is not None:
            local.close()
        if not self._closed:
            self._closed = True
            self._channel.close()

    def __enter__(self) -> Any:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class HeldStoreClient(_Client):
    """Calls HeldOutputs on one owner. Thread-safe (one channel).

    ``local_channel`` (a TCP address): ask the owner once, in the background, for its same-host socket
    (``LocalChannel``); when it answers with one on this host, Lookup and Release go there (``_local_rpc``) and
    gRPC is the fallback: a call that gets no answer over the socket (gone, refused, broken) is made again over
    gRPC within the same budget (both methods are idempotent), and the socket is asked for again later. A
    deadline that passes is not retried. ``on_call(method, channel)`` counts each answered call (channel
    ``local`` or ``grpc``) and each fallback (channel ``local_fallback``).
    """

    def __init__(
        self,
        address: str,
        tls: TlsConfig | None = None,
        *,
        local_channel: bool = True,
        on_call: Callable[[str, str], None] | None = None,
    ) -> None:
        super().__init__(address, tls, on_call=on_call)
        self._local_wanted = local_channel and not address.startswith("unix:") and bool(_unix.host_token())
        self._local_due = 0.0  # monotonic time of the next discovery (inf: one is running)
        self._maybe_discover()

    @property
    def local_path(self) -> str:
        """The same-host socket in use ("" when calls go over gRPC)."""
        local = self._local
        return local.path if local is not None else ""

    def _maybe_discover(self) -> None:
        if not self._local_wanted or self._closed:
            return
        with self._local_lock:
            if self._local is not None or time.monotonic() < self._local_due:
                return
            self._local_due = float("inf")
        threading.Thread(target=self._discover, name="tensorwire-held-discover", daemon=True).start()

    def _discover(self) -> None:
        retry_s = 30.0
        try:
            info = self._call(LOCAL_CHANNEL_METHOD, local_channel_request(), pb.LocalChannelInfo, 2.0, "LocalChannel")
            if info.path and info.host_token == _unix.host_token():
                _unix.check_socket_path(info.path)
                with self._local_lock:
                    if not self._closed:
                        self._local = LocalRpcClient(info.path)
                log.info("held-outputs store %s: Lookup/Release over the same-host socket %s", self.address, info.path)
        except TensorwireError as exc:  # not up yet, an owner without LocalChannel (UNIMPLEMENTED), or closing
            transient = exc.reason in (Reason.PEER_UNAVAILABLE, Reason.DEADLINE_EXCEEDED)
            retry_s = 1.0 if transient else 30.0
            log.debug("held-outputs store %s: no same-host channel (%s)", self.address, exc)
        except (OSError, _unix.InsecurePath) as exc:
            log.warning(
                "held-outputs store %s advertised a same-host socket that fails its checks (%s); using gRPC",
                self.address,
                exc,
            )
        finally:
            with self._local_lock:
                self._local_due = time.monotonic() + retry_s

    def _local_missing(self) -> None:
        self._maybe_discover()

    def _local_failed(self, local: LocalRpcClient) -> None:
        super()._local_failed(local)
        with self._local_lock:
            self._local_due = time.monotonic() + 1.0

    def lookup(
        self, grants: Sequence[tuple[str, bytes]], *, timeout_s: float, support_rdma: bool = True, compat: str = ""
    ) -> list[LookupOutcome]:
        """One outcome per grant, in order. ``compat``: the caller's compatibility hash; a store with another
        answers every grant ``incompatible``."""
        req = hpb.LookupRequest(support_rdma=support_rdma, compat=compat)
        for key, secret in grants:
            req.grants.add(key=key, secret=secret)
        resp = self._unary(LOOKUP_METHOD, "Lookup", req, hpb.LookupResponse, timeout_s)
        return self._outcomes(grants, resp)

    def begin_lookup(
        self, grants: Sequence[tuple[str, bytes]], *, timeout_s: float, support_rdma: bool = True
    ) -> PendingLookup | None:
        """Sends a Lookup over the same-host socket and returns at once (``PendingLookup.poll()`` collects the
        answer without blocking); None when there is no same-host socket (use ``lookup``). Raises
        ``LocalUnavailable`` when the request could not be written (the socket is dropped as ``lookup`` does)."""
        begun = self._begin_local("Lookup", hpb.LookupRequest(support_rdma=support_rdma), grants, timeout_s)
        return None if begun is None else PendingLookup(self, *begun, list(grants))

    def _begin_local(
        self, method: str, req: Any, grants: Sequence[tuple[str, bytes]], timeout_s: float
    ) -> tuple[LocalRpcClient, PendingCall] | None:
        """Writes ``req`` with ``grants`` to the same-host socket; None when there is none (discovery is asked
        for again). ``LocalUnavailable`` when the request could not be written (the socket is dropped)."""
        local = self._local
        if local is None:
            self._local_missing()
            return None
        for key, secret in grants:
            req.grants.add(key=key, secret=secret)
        try:
            return local, local.begin(method, req.SerializeToString(), timeout_s, f"{method} on {self.address}")
        except LocalUnavailable:
            self._local_failed(local)
            self._on_call(method, "local_fallback")
            raise

    def _outcomes(self, grants: Sequence[tuple[str, bytes]], resp: Any) -> list[LookupOutcome]:
        if len(resp.results) != len(grants):
            raise ProtocolError(
                f"Lookup on {self.address}: {len(resp.results)} results for {len(grants)} grants",
                reason=Reason.PROTOCOL_ERROR,
            )
        out = []
        for (key, _), r in zip(grants, resp.results, strict=True):
            if r.key != key:
                raise ProtocolError(
                    f"Lookup on {self.address}: result for {r.key[:64]!r} where {key[:64]!r} was asked",
                    reason=Reason.PROTOCOL_ERROR,
                )
            if r.error_reason:
                try:
                    reason = Reason(r.error_reason)
                except ValueError:
                    reason = Reason.UNKNOWN
                cls = (
                    LeaseExpired
                    if reason in (Reason.NOT_HELD, Reason.LEASE_EXPIRED)
                    else ReadError
                    if reason is Reason.NOT_READY
                    else TensorwireError
                )
                out.append(LookupOutcome(key, None, cls(r.error_message or reason.value, reason=reason)))
            else:
                out.append(LookupOutcome(key, r.receipt, None))
        return out

    def release(self, grants: Sequence[tuple[str, bytes]], *, timeout_s: float) -> int:
        req = hpb.ReleaseRequest()
        for key, secret in grants:
            req.grants.add(key=key, secret=secret)
        return int(self._unary(RELEASE_METHOD, "Release", req, hpb.ReleaseResponse, timeout_s).released)

    def begin_release(self, grants: Sequence[tuple[str, bytes]], *, timeout_s: float) -> PendingRelease | None:
        """Sends a Release over the same-host socket and returns at once (``PendingRelease.poll()`` collects the
        answer without blocking), so that a caller on a busy thread wakes no other thread; None when there is no
        same-host socket (use ``release``). Raises ``LocalUnavailable`` when the request could not be written."""
        begun = self._begin_local("Release", hpb.ReleaseRequest(), grants, timeout_s)
        return None if begun is None else PendingRelease(self, *begun)


class _Pending:
    """A unary call written to the same-host socket, its answer collected without blocking. Single-threaded."""

    method = ""

    def __init__(self, client: HeldStoreClient, local: LocalRpcClient, call: PendingCall) -> None:
        self._client = client
        self._local = local
        self._call = call

    def _answer(self) -> bytes | None:
        """The answer's bytes once there (None: not yet), each outcome counted as the blocking call counts it."""
        try:
            raw = self._call.poll()
        except TensorwireError:
            self._client._on_call(self.method, "local")
            raise
        except LocalUnavailable:
            self._client._local_failed(self._local)
            self._client._on_call(self.method, "local_fallback")
            raise
        if raw is not None:
            self._client._on_call(self.method, "local")
        return raw

    def cancel(self) -> None:
        self._call.cancel()


class PendingLookup(_Pending):
    """A Lookup written to the same-host socket (``HeldStoreClient.begin_lookup``). Single-threaded."""

    method = "Lookup"

    def __init__(
        self, client: HeldStoreClient, local: LocalRpcClient, call: PendingCall, grants: list[tuple[str, bytes]]
    ) -> None:
        super().__init__(client, local, call)
        self._grants = grants

    def poll(self) -> list[LookupOutcome] | None:
        """The outcomes once answered (None: not yet). Raises what ``lookup`` raises; ``LocalUnavailable`` when the
        socket gave no answer (the client then uses gRPC: call ``lookup``, the method is idempotent)."""
        raw = self._answer()
        if raw is None:
            return None
        return self._client._outcomes(self._grants, self._client._parse_answer(hpb.LookupResponse, raw, "Lookup"))


class PendingRelease(_Pending):
    """A Release written to the same-host socket (``HeldStoreClient.begin_release``). Single-threaded."""

    method = "Release"

    def poll(self) -> int | None:
        """The number of grants released once answered (None: not yet). Raises ``LocalUnavailable`` when the
        socket gave no answer (Release is idempotent: send it again with ``release``)."""
        raw = self._answer()
        if raw is None:
            return None
        return int(self._client._parse_answer(hpb.ReleaseResponse, raw, "Release").released)


# A failed Stage comes back as a status (INTERNAL for read failures) plus the reader's reason; rebuild the read
# error class the reader raised, so callers can tell a stale lease from a timeout from a broken reader.
_STAGE_ERRORS: dict[Reason, type[TensorwireError]] = {
    Reason.STALE_GENERATION: LeaseExpired,
    Reason.LEASE_EXPIRED: LeaseExpired,
    Reason.NOT_HELD: LeaseExpired,
    Reason.READ_TIMEOUT: ReadTimeout,
    Reason.RDMA_READ_ERROR: ReadError,
    Reason.PEER_DISCONNECTED: ReadError,
    Reason.METADATA_UNAVAILABLE: ReadError,
    Reason.PROVIDER_UNAVAILABLE: ReadError,
    Reason.RESULT_MISMATCH: ProtocolError,
}


class StagingClient(_Client):
    """Calls Staging on one reader process. Thread-safe (one channel).

    ``local_path``: the reader process's same-host socket (``serve_staging_local``); Stage and Drop go there,
    gRPC (``address``) is the fallback for a call that gets no answer on it (Stage is idempotent: a second one
    replaces the first under its key). After such a call the next one goes over gRPC and the one after tries
    the socket again: a worker that restarted serves it again at the same path.
    """

    def __init__(
        self,
        address: str,
        tls: TlsConfig | None = None,
        *,
        local_path: str = "",
        on_call: Callable[[str, str], None] | None = None,
    ) -> None:
        super().__init__(address, tls, on_call=on_call)
        self._local_path = local_path
        if local_path:
            self._local = LocalRpcClient(local_path)

    def _local_missing(self) -> None:
        if self._local_path and not self._closed:
            with self._local_lock:
                if self._local is None:
                    self._local = LocalRpcClient(self._local_path)

    def stage(self, key: str, receipt: pb.EncodeResponse, *, timeout_ms: int, expect: Expect | None = None) -> int:
        req = hpb.StageRequest(key=key, timeout_ms=max(1, int(timeout_ms)))
        req.receipt.CopyFrom(receipt)
        if expect is not None:
            expect.to_pb(req)
        # The RPC deadline leaves the reader its whole read budget plus a margin for the answer.
        try:
            resp = self._unary(STAGE_METHOD, "Stage", req, hpb.StageResponse, timeout_ms / 1000.0 + 1.0)
        except TensorwireError as exc:
            cls = _STAGE_ERRORS.get(exc.reason)
            if cls is None or isinstance(exc, cls):
                raise
            raise cls(str(exc), reason=exc.reason) from exc
        return int(resp.nbytes)

    def drop(self, keys: Sequence[str], *, timeout_s: float) -> int:
        return int(
            self._unary(DROP_METHOD, "Drop", hpb.DropRequest(keys=list(keys)), hpb.DropResponse, timeout_s).dropped
        )


__all__ = [
    "HeldStoreServicer",
    "StagingServicer",
    "StoreServer",
    "serve_store",
    "HeldStoreClient",
    "StagingClient",
    "LookupOutcome",
    "PendingLookup",
    "PendingRelease",
    "receipt_for",
    "serve_staging_local",
    "HELD_SERVICE",
    "STAGING_SERVICE",
]
