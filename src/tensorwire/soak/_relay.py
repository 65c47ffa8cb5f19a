"""A fault-injecting gRPC relay: forwards every unary call byte for byte to a target, unless told otherwise.
EncodeStream is answered UNIMPLEMENTED, so clients fall back to the unary Encode.

Faults (``FaultRelay.set_*`` or a per-call probability): ``unavailable_for(seconds)``; ``release_drop_p`` /
``release_delay_p`` (ReleaseLeases answered without forwarding, or delayed); ``corrupt_p`` (an Encode receipt
rewritten by ``_corrupt.MUTATORS``). ``retarget(address)``. Thread-safe; ``close()`` is idempotent.
"""

from __future__ import annotations

import logging
import random
import threading
import time
from collections import Counter
from concurrent import futures
from typing import Any

import grpc

from tensorwire.mm import wire
from tensorwire.soak._corrupt import corrupt_receipt

log = logging.getLogger(__name__)


def _identity(b: bytes) -> bytes:
    return b


class FaultRelay:
    def __init__(self, name: str, target: str, *, seed: int, threads: int = 32, host: str = "127.0.0.1") -> None:
        self.name = name
        self.host = host
        self._lock = threading.Lock()
        self._rng = random.Random(seed)
        self._target = ""
        self._channel: grpc.Channel | None = None
        self._unavailable_until = 0.0
        self.release_drop_p = 0.0
        self.release_delay_p = 0.0
        self.release_delay_max_s = 1.5
        self.corrupt_p = 0.0
        self.counts: Counter[str] = Counter()
        self._closed = False
        self.retarget(target)
        self._server = grpc.server(
            futures.ThreadPoolExecutor(max_workers=threads, thread_name_prefix=f"relay-{name}"),
            options=wire.channel_options(),
        )
        self._server.add_generic_rpc_handlers((_Handler(self),))
        self.port = self._server.add_insecure_port(f"{host}:0")
        self._server.start()

    @property
    def address(self) -> str:
        return f"{self.host}:{self.port}"

    def retarget(self, target: str) -> None:
        with self._lock:
            if target == self._target:
                return
            old, self._target = self._channel, target
            self._channel = grpc.insecure_channel(target, options=wire.channel_options())
        if old is not None:
            old.close()  # its target is gone; calls still on it end CANCELLED and the caller retries

    def unavailable_for(self, seconds: float) -> None:
        with self._lock:
            self._unavailable_until = max(self._unavailable_until, time.monotonic() + seconds)
            self.counts["unavailable_windows"] += 1

    def clear_faults(self) -> None:
        with self._lock:
            self._unavailable_until = 0.0
            self.release_drop_p = self.release_delay_p = self.corrupt_p = 0.0

    def _count(self, key: str) -> None:
        with self._lock:
            self.counts[key] += 1

    def _roll(self, p: float) -> bool:
        if p <= 0:
            return False
        with self._lock:
            return self._rng.random() < p

    def forward(self, method: str, request: bytes, context: grpc.ServicerContext) -> bytes:
        with self._lock:
            down = time.monotonic() < self._unavailable_until
            channel = self._channel
        if down:
            self._count("unavailable_calls")
            context.abort(grpc.StatusCode.UNAVAILABLE, f"soak relay {self.name}: control plane made unavailable")
        is_release = method == wire.RELEASE_METHOD
        if is_release and self._roll(self.release_drop_p):
            self._count("releases_dropped")
            ids = wire.ReleaseLeasesRequest.FromString(request).lease_ids
            return wire.ReleaseLeasesResponse(released=len(ids)).SerializeToString()
        if is_release and self._roll(self.release_delay_p):
            self._count("releases_delayed")
            with self._lock:
                delay = self._rng.uniform(0.05, self.release_delay_max_s)
            time.sleep(delay)
        assert channel is not None
        call = channel.unary_unary(method, request_serializer=_identity, response_deserializer=_identity)
        remaining = context.time_remaining()
        timeout = None if remaining is None else max(0.001, remaining)
        try:
            response, rpc = call.with_call(request, timeout=timeout, metadata=_forwardable(context))
        except grpc.RpcError as exc:
            code = exc.code() if hasattr(exc, "code") else grpc.StatusCode.UNKNOWN
            trailing = wire.trailing_pairs(exc)
            if trailing:
                context.set_trailing_metadata(tuple((k, v) for k, v in trailing if not k.startswith("grpc-")))
            self._count(f"upstream_{code.name.lower() if code else 'unknown'}")
            details = exc.details() if hasattr(exc, "details") else str(exc)
            context.abort(code or grpc.StatusCode.UNKNOWN, details or "")
        if method == wire.ENCODE_METHOD and self._roll(self.corrupt_p):
            with self._lock:
                seed = self._rng.getrandbits(64)
            corrupted, what = corrupt_receipt(response, random.Random(seed))
            if what is not None:
                self._count(f"corrupted_{what}")
                return corrupted
        return response

    def close(self, grace_s: float = 1.0) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
        self._server.stop(grace_s).wait(grace_s + 5.0)
        with self._lock:
            channel, self._channel = self._channel, None
        if channel is not None:
            channel.close()


def _forwardable(context: grpc.ServicerContext) -> tuple[tuple[str, Any], ...]:
    return tuple(
        (k, v)
        for k, v in context.invocation_metadata()
        if not k.startswith(("grpc-", ":")) and k not in ("user-agent", "te", "content-type")
    )


class _Handler(grpc.GenericRpcHandler):
    def __init__(self, relay: FaultRelay) -> None:
        self._relay = relay

    def service(self, details: grpc.HandlerCallDetails) -> grpc.RpcMethodHandler[bytes, bytes] | None:
        method = details.method
        if method == wire.ENCODE_STREAM_METHOD:
            # A unary relay cannot carry a stream: UNIMPLEMENTED, as from an encoder or proxy that predates it,
            # so clients use the unary Encode (the proxy behind the relay has no EncodeStream either).
            return None

        def handle(request: bytes, context: grpc.ServicerContext) -> bytes:
            return self._relay.forward(method, request, context)

        return grpc.unary_unary_rpc_method_handler(
            handle, request_deserializer=_identity, response_serializer=_identity
        )


__all__ = ["FaultRelay"]
