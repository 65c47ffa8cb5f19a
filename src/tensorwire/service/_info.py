"""``WorkerInfo``: what a worker tells a proxy at start-up, and the proxy's checks on the answers.

The proxy refuses to start when two workers on one host were given the same non-zero ``--rdma-port``. A worker
answers only loopback callers of a trusted uid and mTLS-verified clients; anyone else gets PERMISSION_DENIED, so
a proxy on another host needs mTLS or ``--no-check-workers``.
"""

from __future__ import annotations

import os
import socket
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import grpc

from tensorwire._grpc.host import Method, Service
from tensorwire._grpc.scope import current_call
from tensorwire.errors import ConfigError, PeerUnavailable, Reason
from tensorwire.mm import wire
from tensorwire.service._proto import service_pb2 as pb

INFO_SERVICE = "tensorwire.service.v1.WorkerInfo"
INFO_METHOD = f"/{INFO_SERVICE}/Get"


@dataclass(frozen=True)
class WorkerInfo:
    address: str  # how the proxy reaches the worker (its --worker value)
    worker_id: str
    hostname: str
    pid: int
    mode: str
    rdma_provider: str
    rdma_bind_ip: str
    rdma_port: int
    slot_gc_timeout_ms: int
    model: str
    device: str
    hidden_size: int
    version: str

    @classmethod
    def from_pb(cls, address: str, msg: pb.WorkerInfoResponse) -> WorkerInfo:
        return cls(
            address=address,
            worker_id=msg.worker_id,
            hostname=msg.hostname,
            pid=msg.pid,
            mode=msg.mode,
            rdma_provider=msg.rdma_provider,
            rdma_bind_ip=msg.rdma_bind_ip,
            rdma_port=msg.rdma_port,
            slot_gc_timeout_ms=msg.slot_gc_timeout_ms,
            model=msg.model,
            device=msg.device,
            hidden_size=msg.hidden_size,
            version=msg.version,
        )


def _answer(get_info: Callable[[], pb.WorkerInfoResponse]) -> Callable[..., pb.WorkerInfoResponse]:
    def get(_request: pb.WorkerInfoRequest, context: grpc.ServicerContext) -> pb.WorkerInfoResponse:
        peer = current_call().peer
        if not (peer.loopback or peer.authenticated):
            context.set_trailing_metadata(((wire.REASON_METADATA_KEY, Reason.PERMISSION_DENIED.value),))
            context.abort(
                grpc.StatusCode.PERMISSION_DENIED, "WorkerInfo answers loopback and mTLS-authenticated callers only"
            )
        return get_info()

    return get


def info_service(get_info: Callable[[], pb.WorkerInfoResponse]) -> Service:
    """``WorkerInfo/Get`` from ``get_info()`` as a ``GrpcHost`` service (loopback and mTLS callers only)."""
    return Service(
        INFO_SERVICE,
        (
            Method(
                "Get",
                _answer(get_info),
                request_deserializer=pb.WorkerInfoRequest.FromString,
                response_serializer=pb.WorkerInfoResponse.SerializeToString,
            ),
        ),
    )


def info_handler(get_info: Callable[[], pb.WorkerInfoResponse]) -> grpc.GenericRpcHandler:
    """The same method as a plain generic handler, for a server built without ``GrpcHost`` (test doubles)."""
    return grpc.method_handlers_generic_handler(
        INFO_SERVICE,
        {
            "Get": grpc.unary_unary_rpc_method_handler(
                _answer(get_info),
                request_deserializer=pb.WorkerInfoRequest.FromString,
                response_serializer=pb.WorkerInfoResponse.SerializeToString,
            ),
        },
    )


def make_info(
    *, worker_id: str, mode: str, rdma: Any, model: str, device: str, hidden_size: int
) -> pb.WorkerInfoResponse:
    """The answer of a worker built from its ``RdmaConfig`` (``rdma``) and encoder."""
    import tensorwire

    return pb.WorkerInfoResponse(
        worker_id=worker_id,
        hostname=socket.gethostname(),
        pid=os.getpid(),
        mode=mode,
        rdma_provider=str(rdma.provider),
        rdma_bind_ip=str(rdma.bind_ip),
        rdma_port=int(rdma.port),
        slot_gc_timeout_ms=int(rdma.slot_gc_timeout_ms),
        model=model,
        device=device,
        hidden_size=hidden_size,
        version=tensorwire.__version__,
    )


# A connection failure that names TLS (tls_hint), the same for this long (several connection attempts: gRPC's
# reconnect backoff starts at 1 s), is a configuration mismatch, which waiting does not mend: the wait ends there
# instead of at its deadline.
TLS_MISMATCH_GIVE_UP_S = 2.0


def fetch_info(channel: grpc.Channel, address: str, *, timeout_s: float, tls: Any = None) -> WorkerInfo:
    """Ask one worker, waiting up to ``timeout_s`` for it to come up; raises ``PeerUnavailable``.

    Each attempt fails fast while the connection cannot be made (no ``wait_for_ready``), so the reason is seen:
    a worker not up yet is asked again (gRPC's reconnect backoff paces the attempts); a connection refused for a
    TLS mismatch with ``tls`` (this side's ``TlsConfig``) ends the wait with the mismatch and the flags that fix it
    (``tensorwire._grpc.hints.tls_hint``) once it persists ``TLS_MISMATCH_GIVE_UP_S``, instead of a timeout without a
    reason."""
    import time

    from tensorwire._grpc.hints import tls_hint

    call = channel.unary_unary(
        INFO_METHOD,
        request_serializer=pb.WorkerInfoRequest.SerializeToString,
        response_deserializer=pb.WorkerInfoResponse.FromString,
    )
    deadline = time.monotonic() + timeout_s
    hint, since, pause_s = None, 0.0, 0.05
    while True:
        left = deadline - time.monotonic()
        try:
            msg = call(pb.WorkerInfoRequest(), timeout=max(left, 0.05), wait_for_ready=False)
            return WorkerInfo.from_pb(address, msg)
        except grpc.RpcError as exc:
            code = exc.code() if hasattr(exc, "code") else grpc.StatusCode.UNKNOWN
            details = (exc.details() if hasattr(exc, "details") else "") or ""
            found = tls_hint(details, tls) if code == grpc.StatusCode.UNAVAILABLE else None
            if found != hint or not found:
                since = time.monotonic()  # a new reason (or none): the mismatch must persist from here
            hint = found or hint
            if found and time.monotonic() - since >= TLS_MISMATCH_GIVE_UP_S:
                raise PeerUnavailable(f"worker {address} refused the connection: {found}") from exc
            left = deadline - time.monotonic()
            if code != grpc.StatusCode.UNAVAILABLE or left <= 0:
                last = f"; {hint}" if hint else (f"; last error: {details}" if details else "")
                raise PeerUnavailable(
                    f"worker {address} did not answer WorkerInfo within {timeout_s:.1f} s ({code.name}); is it a "
                    f"`tensorwire serve-encoder` and is it up?{last}"
                ) from exc
        time.sleep(min(pause_s, max(left, 0.0)))  # gRPC's reconnect backoff paces the connection attempts
        pause_s = min(pause_s * 2, 0.25)  # a worker that comes up is seen within 0.25 s


def check_workers(infos: Sequence[WorkerInfo]) -> None:
    """Refuse a worker set that cannot work behind one proxy; raises ``ConfigError`` naming both workers."""
    seen_ids: dict[str, str] = {}
    for info in infos:
        if info.worker_id in seen_ids:
            raise ConfigError(
                f"workers {seen_ids[info.worker_id]} and {info.address} report the same worker_id "
                f"{info.worker_id!r}; receipts could not tell their leases apart"
            )
        seen_ids[info.worker_id] = info.address
    fixed = [i for i in infos if i.rdma_port != 0 and i.mode != "grpc" and i.rdma_provider != "none"]
    for a_idx, a in enumerate(fixed):
        for b in fixed[a_idx + 1 :]:
            same_host = a.hostname == b.hostname
            overlapping_ip = not a.rdma_bind_ip or not b.rdma_bind_ip or a.rdma_bind_ip == b.rdma_bind_ip
            if same_host and overlapping_ip and a.rdma_port == b.rdma_port:
                raise ConfigError(
                    f"workers {a.address} and {b.address} on host {a.hostname} both use the fixed RDMA port "
                    f"{a.rdma_port}; only one can bind it and the other would serve inline only. Give each "
                    "worker its own --rdma-port, or use --rdma-port 0 (the default)"
                )


__all__ = [
    "INFO_METHOD",
    "INFO_SERVICE",
    "WorkerInfo",
    "check_workers",
    "fetch_info",
    "info_handler",
    "info_service",
    "make_info",
]
