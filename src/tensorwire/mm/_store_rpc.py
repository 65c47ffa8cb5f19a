"""gRPC for held outputs: the HeldOutputs and Staging services (held.proto), a server hosting them, clients.

``HeldOutputs`` serves a :class:`HeldStore` (Lookup by grant -> receipt, Release grants); ``Staging`` serves a
:class:`StagingArea` (Stage a receipt -> answered once the tensors are local, Drop keys). Either or both run
in one :class:`StoreServer` (``GrpcHost``: the encoder server's bind / health / stop sequence) on ``host:port``
or ``unix:/path``. Methods are registered as ``GrpcHost`` services
(raw bytes in and out, as ``EncoderService``): a malformed message is INVALID_ARGUMENT with a reason and the
server keeps serving.

Transport security is the encoder's (``tensorwire.mm._tls``, docs/security.md): ``serve_store(tls=...)`` with a
certificate listens with TLS (mTLS unless ``client_auth`` is off); without one a TCP listener binds only a
loopback address unless ``insecure=True``. A ``unix:`` socket is plaintext (its directory's mode is the access
control). The clients take the same ``TlsConfig`` and speak TLS when it has a CA or a certificate; a refused
handshake is a ``PeerUnavailable``. Errors cross as status + ``tensorwire-reason`` (``tensorwire.mm.wire``);
per-grant lookup failures are fields of the answer (one bad grant does not fail the others). ``grpc.RpcError``
never leaves here.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import grpc
from google.protobuf.message import DecodeError

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
from tensorwire.mm._codec import encode_tensor
from tensorwire.mm._host import GrpcHost, Method, Service
from tensorwire.mm._proto import encoder_pb2 as pb
from tensorwire.mm._proto import held_pb2 as hpb
from tensorwire.mm._service import _parse_or_abort as _parse  # INVALID_ARGUMENT for bytes that do not parse
from tensorwire.mm._staging import Expect, StagingArea
from tensorwire.mm._store import HeldItem, HeldStore
from tensorwire.mm._tls import TlsConfig, secure_or_insecure_channel

log = logging.getLogger(__name__)

HELD_SERVICE = f"{wire.PACKAGE}.HeldOutputs"
STAGING_SERVICE = f"{wire.PACKAGE}.Staging"
LOOKUP_METHOD = f"/{HELD_SERVICE}/Lookup"
RELEASE_METHOD = f"/{HELD_SERVICE}/Release"
STAGE_METHOD = f"/{STAGING_SERVICE}/Stage"
DROP_METHOD = f"/{STAGING_SERVICE}/Drop"
MAX_GRANTS_PER_CALL = 4096


def receipt_for(item: HeldItem, *, rdma: bool) -> pb.EncodeResponse:
    """The receipt of a held item: one RDMA slot (roles EMBEDDING, then EXTRA_INPUT) or inline tensors."""
    receipt = pb.EncodeResponse()
    if item.shapes[0]:
        receipt.split_sizes.append(int(item.shapes[0][0]))
    if rdma and item.descriptor is not None:
        slot = receipt.rdma_slots.add()
        slot.descriptor = item.descriptor.to_bytes()
        slot.roles.extend([pb.EMBEDDING] + [pb.EXTRA_INPUT] * (len(item.shapes) - 1))
        return receipt
    if item.tensors is None:
        raise TensorwireError(f"item {item.key[:64]!r} is held in RDMA slots only; the reader must support RDMA",
                              reason=Reason.PROVIDER_UNAVAILABLE)
    encode_tensor(item.tensors[0], receipt.embedding)
    for t in item.tensors[1:]:
        encode_tensor(t, receipt.extra_inputs.add())
    return receipt


def _check_count(n: int, context: grpc.ServicerContext) -> None:
    if n > MAX_GRANTS_PER_CALL:
        wire.abort_with(context, InvalidPayload(f"{n} grants in one call exceed {MAX_GRANTS_PER_CALL}",
                                                reason=Reason.INVALID_REQUEST))


class HeldStoreServicer:
    """Lookup and Release over a HeldStore (which the servicer does not own)."""

    def __init__(self, store: HeldStore) -> None:
        self.store = store

    def lookup(self, raw: bytes, context: grpc.ServicerContext) -> bytes:
        req = _parse(hpb.LookupRequest, raw, context)
        _check_count(len(req.grants), context)
        resp = hpb.LookupResponse()
        for g in req.grants:
            result = resp.results.add(key=g.key)
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
        return grpc.method_handlers_generic_handler(HELD_SERVICE, {
            "Lookup": grpc.unary_unary_rpc_method_handler(self.lookup),
            "Release": grpc.unary_unary_rpc_method_handler(self.release),
        })

    def service(self) -> Service:
        """The same methods as a ``GrpcHost`` service (its per-peer limits and request deadline)."""
        return Service(HELD_SERVICE, (Method("Lookup", self.lookup), Method("Release", self.release)))


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
        return grpc.method_handlers_generic_handler(STAGING_SERVICE, {
            "Stage": grpc.unary_unary_rpc_method_handler(self.stage),
            "Drop": grpc.unary_unary_rpc_method_handler(self.drop),
        })

    def service(self) -> Service:
        """The same methods as a ``GrpcHost`` service (its per-peer limits and request deadline)."""
        return Service(STAGING_SERVICE, (Method("Stage", self.stage), Method("Drop", self.drop)))


class StoreServer:
    """A running gRPC server with HeldOutputs and/or Staging (and grpc.health.v1), on ``GrpcHost``.

    ``address`` is what clients dial: ``host:port`` (the bound port) or ``unix:/path``. ``stop`` is idempotent.
    The server does not own the store or the area; their owner closes them after ``stop``.
    """

    def __init__(self, host: GrpcHost, address: str, port: int) -> None:
        self._host = host
        self.address = address
        self.port = port

    def stop(self, grace: float | None = 1.0) -> None:
        self._host.stop(grace)

    def __enter__(self) -> StoreServer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def serve_store(address: str, *, store: HeldStore | None = None, staging: StagingArea | None = None,
                threads: int = 4, advertise_host: str = "", tls: TlsConfig | None = None,
                insecure: bool = False) -> StoreServer:
    """Starts a StoreServer on ``address`` (``host:0`` picks a port; ``unix:/path`` a socket).

    ``advertise_host`` replaces the bind host in ``StoreServer.address`` (for ``0.0.0.0`` binds). ``tls`` with a
    certificate: a TLS listener (mTLS unless ``tls.client_auth`` is off); without one, a TCP address that is not
    loopback needs ``insecure=True``. Raises ConfigError when nothing is served, the address cannot be bound, the
    TLS files do not load, or a plaintext listener would face a non-loopback address without ``insecure``.
    """
    if store is None and staging is None:
        raise ConfigError("serve_store needs a store, a staging area, or both")
    services: list[Service] = []
    names: list[str] = []
    if store is not None:
        services.append(HeldStoreServicer(store).service())
        names.append(HELD_SERVICE)
    if staging is not None:
        services.append(StagingServicer(staging).service())
        names.append(STAGING_SERVICE)
    unix = address.startswith("unix:")
    if unix and tls is not None and tls.server_enabled:
        raise ConfigError(f"serve_store({address!r}): TLS on a unix socket is not supported (the socket's directory "
                          "is its access control); give a host:port address or no certificate")
    host = GrpcHost("store server", services, work_slots=threads, thread_prefix="tensorwire-store", serving=names,
                    tls=tls)
    # A unix socket never leaves the host: GrpcHost's loopback rule is about TCP addresses.
    port = host.bind(address, insecure=insecure or unix)
    host.start()
    if unix:
        dial = address
    else:
        dial = f"{advertise_host or host.host}:{port}"
    log.info("store server on %s (%s, %s)", dial, ", ".join(names), host.tls.describe() if host.tls else "plaintext")
    return StoreServer(host, dial, port)


@dataclass(frozen=True)
class LookupOutcome:
    """One grant's answer: ``receipt`` or ``error`` (a TensorwireError with the owner's reason)."""

    key: str
    receipt: pb.EncodeResponse | None
    error: TensorwireError | None


class _Client:
    """One channel to ``address``: TLS when ``tls`` has a CA or a certificate (``tensorwire.mm._tls``), else
    plaintext (``unix:`` sockets are always plaintext)."""

    def __init__(self, address: str, tls: TlsConfig | None = None) -> None:
        self.address = address
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
                method, request_serializer=None, response_deserializer=None)
        try:
            raw = call(request.SerializeToString(), timeout=timeout_s)
        except grpc.RpcError as exc:
            raise wire.error_from_rpc(exc, f"{what} on {self.address}") from exc
        try:
            return response.FromString(raw)
        except DecodeError as exc:
            raise ProtocolError(f"{what} on {self.address}: the answer does not parse: {exc}",
                                reason=Reason.PROTOCOL_ERROR) from exc

    def close(self) -> None:
        if not self._closed:
            self._closed = True
            self._channel.close()

    def __enter__(self) -> Any:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class HeldStoreClient(_Client):
    """Calls HeldOutputs on one owner. Thread-safe (one channel)."""

    def lookup(self, grants: Sequence[tuple[str, bytes]], *, timeout_s: float,
               support_rdma: bool = True) -> list[LookupOutcome]:
        req = hpb.LookupRequest(support_rdma=support_rdma)
        for key, secret in grants:
            req.grants.add(key=key, secret=secret)
        resp = self._call(LOOKUP_METHOD, req, hpb.LookupResponse, timeout_s, "Lookup")
        if len(resp.results) != len(grants):
            raise ProtocolError(f"Lookup on {self.address}: {len(resp.results)} results for {len(grants)} grants",
                                reason=Reason.PROTOCOL_ERROR)
        out = []
        for (key, _), r in zip(grants, resp.results, strict=True):
            if r.key != key:
                raise ProtocolError(f"Lookup on {self.address}: result for {r.key[:64]!r} where {key[:64]!r} was "
                                    "asked", reason=Reason.PROTOCOL_ERROR)
            if r.error_reason:
                try:
                    reason = Reason(r.error_reason)
                except ValueError:
                    reason = Reason.UNKNOWN
                cls = LeaseExpired if reason in (Reason.NOT_HELD, Reason.LEASE_EXPIRED) else TensorwireError
                out.append(LookupOutcome(key, None, cls(r.error_message or reason.value, reason=reason)))
            else:
                out.append(LookupOutcome(key, r.receipt, None))
        return out

    def release(self, grants: Sequence[tuple[str, bytes]], *, timeout_s: float) -> int:
        req = hpb.ReleaseRequest()
        for key, secret in grants:
            req.grants.add(key=key, secret=secret)
        return int(self._call(RELEASE_METHOD, req, hpb.ReleaseResponse, timeout_s, "Release").released)


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
    """Calls Staging on one reader process. Thread-safe (one channel)."""

    def stage(self, key: str, receipt: pb.EncodeResponse, *, timeout_ms: int, expect: Expect | None = None) -> int:
        req = hpb.StageRequest(key=key, timeout_ms=max(1, int(timeout_ms)))
        req.receipt.CopyFrom(receipt)
        if expect is not None:
            expect.to_pb(req)
        # The RPC deadline leaves the reader its whole read budget plus a margin for the answer.
        try:
            resp = self._call(STAGE_METHOD, req, hpb.StageResponse, timeout_ms / 1000.0 + 1.0, "Stage")
        except TensorwireError as exc:
            cls = _STAGE_ERRORS.get(exc.reason)
            if cls is None or isinstance(exc, cls):
                raise
            raise cls(str(exc), reason=exc.reason) from exc
        return int(resp.nbytes)

    def drop(self, keys: Sequence[str], *, timeout_s: float) -> int:
        return int(self._call(DROP_METHOD, hpb.DropRequest(keys=list(keys)), hpb.DropResponse, timeout_s,
                              "Drop").dropped)


__all__ = ["HeldStoreServicer", "StagingServicer", "StoreServer", "serve_store", "HeldStoreClient",
           "StagingClient", "LookupOutcome", "receipt_for", "HELD_SERVICE", "STAGING_SERVICE"]
