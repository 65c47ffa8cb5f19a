"""A scripted EncoderService worker on a real gRPC server (127.0.0.1:0), for proxy tests.

It answers with receipts whose RDMA slots carry real, valid ``tensorwire.rdma.Descriptor`` bytes (the proxy
parses them for lease ids) but no memory behind them: proxy tests claim routing, not data movement.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from concurrent import futures
from dataclasses import dataclass, field

import grpc
import torch

from tensorwire._grpc.health import SERVING, HealthService
from tensorwire.mm import wire
from tensorwire.rdma import Descriptor, Owner, TensorMeta
from tensorwire.service._info import info_handler
from tensorwire.service._proto import service_pb2


def descriptor(lease_id: str, port: int = 5555) -> bytes:
    meta = TensorMeta(shape=(4, 8), dtype=torch.float32, offset=0, nbytes=128)
    return Descriptor(
        owner=Owner("agent", "127.0.0.1", port),
        mem_type="DRAM",
        device_id=0,
        slot_addr=1 << 20,
        payload_bytes=4096,
        lease_id=lease_id,
        generation=1,
        generation_addr=1 << 16,
        manifest=(meta,),
    ).to_bytes()


@dataclass
class FakeWorker:
    name: str
    rdma_port: int = 0
    hostname: str = "host-a"
    slot_gc_timeout_ms: int = 60_000
    # Called per Encode; returns the lease ids to put in the receipt or raises via context.abort.
    on_encode: Callable[[wire.EncodeRequest, grpc.ServicerContext], list[str]] | None = None
    # Called on each receipt before it is sent (to break it on purpose).
    on_receipt: Callable[[wire.EncodeResponse], None] | None = None
    release_failures: int = 0  # fail this many ReleaseLeases calls with UNAVAILABLE first
    encodes: int = 0
    releases: list[list[str]] = field(default_factory=list)
    release_time_left: list[float] = field(default_factory=list)  # the deadline each ReleaseLeases arrived with
    owner_port: int = 0
    lock: threading.Lock = field(default_factory=threading.Lock)
    server: grpc.Server | None = None
    port: int = 0
    health: HealthService = field(default_factory=lambda: HealthService(("", wire.SERVICE_NAME), SERVING))

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    def start(self) -> FakeWorker:
        server = grpc.server(futures.ThreadPoolExecutor(max_workers=4), options=wire.channel_options())
        server.add_generic_rpc_handlers(
            (
                grpc.method_handlers_generic_handler(
                    wire.SERVICE_NAME,
                    {
                        "Encode": grpc.unary_unary_rpc_method_handler(
                            self._encode,
                            request_deserializer=wire.EncodeRequest.FromString,
                            response_serializer=wire.EncodeResponse.SerializeToString,
                        ),
                        "ReleaseLeases": grpc.unary_unary_rpc_method_handler(
                            self._release,
                            request_deserializer=wire.ReleaseLeasesRequest.FromString,
                            response_serializer=wire.ReleaseLeasesResponse.SerializeToString,
                        ),
                    },
                ),
                info_handler(
                    lambda: service_pb2.WorkerInfoResponse(
                        worker_id=self.name,
                        hostname=self.hostname,
                        mode="auto",
                        rdma_provider="auto",
                        rdma_port=self.rdma_port,
                        slot_gc_timeout_ms=self.slot_gc_timeout_ms,
                    )
                ),
            )
        )
        self.health.add_to(server)
        self.port = server.add_insecure_port(f"127.0.0.1:{self.port}")
        server.start()
        self.server = server
        return self

    def stop(self) -> None:
        if self.server is not None:
            self.server.stop(0).wait(5)

    def _encode(self, request: wire.EncodeRequest, context: grpc.ServicerContext) -> wire.EncodeResponse:
        with self.lock:
            self.encodes += 1
            n = self.encodes
        leases = self.on_encode(request, context) if self.on_encode else [f"{self.name}-{n}"]
        resp = wire.EncodeResponse(split_sizes=[4])
        resp.worker.worker_id = self.name
        if request.support_rdma:
            for lease in leases:
                resp.rdma_slots.add(
                    descriptor=descriptor(lease, self.owner_port or 20000 + self.port % 10000), roles=[1]
                )
        else:
            resp.embedding.dtype = 1
            resp.embedding.shape.extend([4, 8])
            resp.embedding.data = b"\0" * 128
        if self.on_receipt is not None:
            self.on_receipt(resp)
        return resp

    def _release(self, request: wire.ReleaseLeasesRequest, context: grpc.ServicerContext) -> wire.ReleaseLeasesResponse:
        with self.lock:
            left = context.time_remaining()
            if left is not None:
                self.release_time_left.append(float(left))
            if self.release_failures > 0:
                self.release_failures -= 1
                context.abort(grpc.StatusCode.UNAVAILABLE, "scripted release failure")
            self.releases.append(list(request.lease_ids))
        return wire.ReleaseLeasesResponse(released=len(request.lease_ids))


def sleep_then(seconds: float, leases: list[str]) -> Callable[..., list[str]]:
    def fn(_request: wire.EncodeRequest, _context: grpc.ServicerContext) -> list[str]:
        time.sleep(seconds)
        return leases

    return fn


def abort_with(code: grpc.StatusCode, message: str = "scripted") -> Callable[..., list[str]]:
    def fn(_request: wire.EncodeRequest, context: grpc.ServicerContext) -> list[str]:
        context.set_trailing_metadata(((wire.REASON_METADATA_KEY, "invalid_payload"),))
        context.abort(code, message)
        return []

    return fn
