"""Live fuzz targets: a real encoder server in a child process, and a real broadcaster rank 0.

``LiveEncoder``: raw bytes to ``Encode`` / ``ReleaseLeases``; outcomes ``ok``, ``typed:<reason>``,
``untyped:<code>`` (a crash) or ``dead``; ``canary()`` checks the server still answers correctly.
``hello_live``: rank 0 must end a fuzzed bootstrap with ``BootstrapError`` or ``BootstrapTimeout`` and leave no
socket file behind.
"""

from __future__ import annotations

import os
import socket
import tempfile
import threading
import time
from typing import TYPE_CHECKING, Any

from tensorwire.errors import TensorwireError

if TYPE_CHECKING:
    import grpc


def _identity(data: bytes) -> bytes:
    return data


class LiveEncoder:
    def __init__(
        self,
        images: list[bytes],
        digests: dict[tuple[int, ...], str],
        env: dict[str, str] | None = None,
        timeout_s: float = 10.0,
    ) -> None:
        import grpc

        from tensorwire.mm import TransportConfig, wire
        from tensorwire.rdma import RdmaConfig
        from tensorwire.soak._worker_proc import WorkerProcess

        self.images, self.digests, self.timeout_s = images, digests, timeout_s
        cfg = TransportConfig(mode="auto", worker_id="fuzz-worker", rdma=RdmaConfig(slot_gc_timeout_ms=2000))
        self.worker = WorkerProcess(cfg, dict(env or {}))
        self._channel = grpc.insecure_channel(self.worker.address, options=wire.channel_options())
        self._encode = self._channel.unary_unary(
            wire.ENCODE_METHOD, request_serializer=_identity, response_deserializer=_identity
        )
        self._release = self._channel.unary_unary(
            wire.RELEASE_METHOD, request_serializer=_identity, response_deserializer=_identity
        )
        self._wire = wire

    def _call(self, method: grpc.UnaryUnaryMultiCallable[bytes, bytes], data: bytes) -> tuple[str, bytes]:
        """(outcome, the answer's bytes: empty unless the outcome is "ok")."""
        import grpc

        try:
            return "ok", method(data, timeout=self.timeout_s)
        except grpc.RpcError as exc:
            code = exc.code()
            for key, value in self._wire.trailing_pairs(exc):
                if key == self._wire.REASON_METADATA_KEY:
                    text = value if isinstance(value, str) else value.decode(errors="replace")
                    return f"typed:{text}", b""
            if code == grpc.StatusCode.DEADLINE_EXCEEDED or not self.worker.alive():
                return "dead", b""
            return f"untyped:{code.name}", b""

    def encode(self, data: bytes) -> str:
        outcome, raw = self._call(self._encode, data)
        if outcome == "ok":
            resp = self._wire.EncodeResponse.FromString(raw)  # a server must answer a receipt that parses
            self._release_slots(resp)
        return outcome

    def release(self, data: bytes) -> str:
        outcome, raw = self._call(self._release, data)
        if outcome == "ok":
            self._wire.ReleaseLeasesResponse.FromString(raw)
        return outcome

    def _release_slots(self, resp: Any) -> None:
        from tensorwire.rdma import Descriptor

        ids = [Descriptor.from_bytes(s.descriptor).lease_id for s in resp.rdma_slots]
        if ids:
            self._call(self._release, self._wire.ReleaseLeasesRequest(lease_ids=ids).SerializeToString())

    def canary(self, index: int = 0) -> bool:
        """A valid single-image request (inline): True when the answer matches the local digest."""
        from tensorwire.mm.wire import _codec
        from tensorwire.mm.wire._receipt import parse_receipt
        from tensorwire.soak._corpus import output_digest

        req = self._wire.EncodeRequest()
        req.inputs.add(data=self.images[index], kind="image")
        outcome, raw = self._call(self._encode, req.SerializeToString())
        if outcome != "ok":
            return False
        embs, _splits, pos, _extras, _n = _codec.decode_inline_receipt(parse_receipt(raw))
        return output_digest(embs, pos) == self.digests[(index,)]

    def stats(self) -> dict[str, Any]:
        return self.worker.stats()

    def close(self) -> None:
        self._channel.close()
        self.worker.stop()


def seed_requests(images: list[bytes]) -> list[bytes]:
    from tensorwire.mm import wire

    seeds = []
    for i, img in enumerate(images[:4]):
        req = wire.EncodeRequest(support_rdma=bool(i % 2), deadline_ms=5000)
        req.inputs.add(data=img, kind="image", timeout_ms=5000)
        if i == 3:
            req.inputs.add(data=images[0], kind="image", params={"k": "v"})
        seeds.append(req.SerializeToString())
    seeds.append(wire.ReleaseLeasesRequest(lease_ids=["abc-1", ""]).SerializeToString())
    return seeds


def hello_live(data: bytes, timeout_s: float = 1.0) -> str:
    """One rank-0 bootstrap against one fuzz peer that sends ``data``."""
    from tensorwire.tp import BroadcastConfig, CpuTpBroadcaster
    from tensorwire.tp._paths import make_endpoint

    base = tempfile.mkdtemp(prefix="twfz-")
    session = f"fz{os.getpid()}{threading.get_ident() % 10000}"
    result: dict[str, Any] = {}

    def rank0() -> None:
        try:
            b = CpuTpBroadcaster(
                0,
                2,
                session,
                backend="uds",
                base_dir=base,
                init_timeout_s=timeout_s,
                config=BroadcastConfig(check_peer_uid=False),
            )
            b.close()
            result["out"] = "ok"
        except TensorwireError as exc:
            result["out"] = f"typed:{exc.reason.value}"
        except BaseException as exc:  # a crash is what we count
            result["out"] = f"crash:{type(exc).__name__}: {exc}"

    t = threading.Thread(target=rank0, daemon=True)
    t.start()
    path = make_endpoint(session, base, False).path
    assert path is not None
    deadline = time.monotonic() + timeout_s
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        while time.monotonic() < deadline:
            try:
                sock.connect(path)
                break
            except (FileNotFoundError, ConnectionRefusedError):
                time.sleep(0.002)
        try:
            sock.sendall(data)
        except OSError:
            pass
        t.join(timeout_s + 5.0)
    finally:
        sock.close()
    if t.is_alive():
        return "hung"
    leftover = [n for n in os.listdir(base) if n.endswith(".sock")]
    try:
        os.rmdir(base)
    except OSError:
        pass
    if leftover:
        return "leftover_socket_file"
    return str(result.get("out", "crash:no result"))


__all__ = ["LiveEncoder", "hello_live", "seed_requests"]
