"""Fuzz targets: every decoder that reads bytes from another process, driven in-process.

A target takes untrusted bytes and returns an outcome string: ``"ok"`` (a valid value, checked for internal
consistency) or ``"typed:<reason>"`` (a tensorwire exception with its reason). Anything else it raises is a
crash. Targets (and what crosses the boundary in production):

- ``descriptor``: ``Descriptor.from_bytes`` (RDMA slot descriptors in receipts);
- ``inline_tensor``: ``_codec.decode_tensor`` of a ``Tensor`` message (inline payloads);
- ``receipt_wire`` / ``stream_wire``: the client's hand-walked parse of an EncodeResponse / StreamResponse
  (``_wire_receipt``), checked against protobuf's own parse of the same bytes: both accept with equal values, or
  both refuse (the walk may refuse groups, which protobuf skips); ``stream_wire`` also holds
  ``read_stream_response`` (protobuf's own parser for small answers, what the channels call) to protobuf's answer;
- ``receipt``: a whole ``EncodeResponse`` through the real ``RemoteOutputTransport.fetch`` (control plane
  replaced by a stub that answers these bytes; the RDMA reader by an in-memory one that returns the bytes the
  manifest asks for): parse, slot validation, read, assembly, release, the one fallback;
- ``frame_header`` / ``frame_table``: the broadcaster's frame header and tensor table decoders;
- ``hello``: rank 0's validation of a peer's handshake (``RootBootstrap._validate``).

The live targets (a real encoder server, a real rank 0) are in ``_fuzz_live``.
"""

from __future__ import annotations

import random
import socket
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, cast

import torch

from tensorwire.errors import TensorwireError

if TYPE_CHECKING:
    from tensorwire.rdma import ReaderStats

Target = Callable[[bytes], str]


def _typed(exc: TensorwireError) -> str:
    return f"typed:{exc.reason.value}"


# ---- descriptor


def target_descriptor(data: bytes) -> str:
    from tensorwire.rdma import Descriptor

    try:
        d = Descriptor.from_bytes(data)
    except TensorwireError as exc:
        return _typed(exc)
    # A descriptor that validates must be self-consistent: tensors inside the payload, sizes matching shapes.
    for m in d.manifest:
        assert m.offset + m.nbytes <= d.payload_bytes, "validated descriptor has a tensor outside its payload"
        assert m.nbytes == m.numel * torch.empty((), dtype=m.dtype).element_size(), "nbytes/shape disagree"
    assert d.lease_id, "validated descriptor without a lease id"
    return "ok"


# ---- inline tensor


def target_inline_tensor(data: bytes) -> str:
    from google.protobuf.message import DecodeError

    from tensorwire.mm._proto import encoder_pb2 as pb
    from tensorwire.mm.wire import _codec

    try:
        msg = pb.Tensor.FromString(data)
    except DecodeError:
        return "typed:protocol_error"  # the client maps unparsable receipts to ProtocolError
    try:
        t = _codec.decode_tensor(msg)
    except TensorwireError as exc:
        return _typed(exc)
    assert t.numel() * t.element_size() == len(msg.data), "decoded tensor size differs from its payload"
    assert list(t.shape) == [int(s) for s in msg.shape]
    return "ok"


# ---- the client's receipt parse against protobuf's


def _protobuf_parse(cls: Any, data: bytes) -> Any:
    from google.protobuf.message import DecodeError

    try:
        msg = cls.FromString(data)
    except DecodeError:
        return None
    msg.DiscardUnknownFields()
    return msg


def _walk_refused(exc: Exception, ref: Any) -> str:
    # The walk may only refuse what protobuf refuses too, or a group (which protobuf skips as unknown).
    assert ref is None or "group" in str(exc), f"the walk refuses what protobuf reads: {exc}"
    return "typed:protocol_error"


def _same_receipt(got: Any, ref: Any, data: bytes) -> None:
    full = got.to_message()
    full.DiscardUnknownFields()
    assert full == ref, "the walk reads another receipt than protobuf"
    for payload in [got.embedding, got.position_ids, *got.extra_inputs]:
        if payload is not None and len(payload):
            assert isinstance(payload, memoryview) and payload.obj is data, "a payload is not a view of the input"


def target_receipt_wire(data: bytes) -> str:
    from tensorwire.mm._proto import encoder_pb2 as pb
    from tensorwire.mm.wire._receipt import WireError, parse_receipt

    ref = _protobuf_parse(pb.EncodeResponse, data)
    try:
        got = parse_receipt(data)
    except WireError as exc:
        return _walk_refused(exc, ref)
    assert ref is not None, "the walk reads a receipt protobuf refuses"
    _same_receipt(got, ref, data)
    return "ok"


def target_stream_wire(data: bytes) -> str:
    from tensorwire.mm._proto import encoder_pb2 as pb
    from tensorwire.mm.wire._receipt import WireError, WireReceipt, parse_stream_response

    ref = _protobuf_parse(pb.StreamResponse, data)
    _same_read(data, ref)
    try:
        message_id, body = parse_stream_response(data)
    except WireError as exc:
        return _walk_refused(exc, ref)
    assert ref is not None, "the walk reads a stream answer protobuf refuses"
    assert message_id == ref.id, "the walk reads another id than protobuf"
    kind = ref.WhichOneof("body")
    if kind == "receipt":
        assert isinstance(body, WireReceipt), "protobuf reads a receipt, the walk does not"
        _same_receipt(body, ref.receipt, data)
    elif kind == "error":
        assert isinstance(body, pb.StreamError), "protobuf reads an error, the walk does not"
        body.DiscardUnknownFields()
        assert body == ref.error, "the walk reads another error than protobuf"
    else:
        assert body is None, "the walk reads a body protobuf does not"
    return "ok"


def _same_read(data: bytes, ref: Any) -> None:
    """``read_stream_response`` (what the channels call: protobuf's parser for a small answer) reads what
    protobuf reads, or refuses what it refuses, with a WireError."""
    from tensorwire.mm.wire._receipt import UPB_MAX_BYTES, WireError, WireReceipt, read_stream_response

    if len(data) > UPB_MAX_BYTES:
        return  # the walk: checked against protobuf below
    try:
        message_id, body = read_stream_response(data)
    except WireError:
        assert ref is None, "read_stream_response refuses an answer protobuf reads"
        return
    assert ref is not None and message_id == ref.id, "read_stream_response reads another id than protobuf"
    got = body.to_message() if isinstance(body, WireReceipt) else body
    if got is not None:
        got.DiscardUnknownFields()  # as ``ref``
    kind = ref.WhichOneof("body")
    assert got == (getattr(ref, kind) if kind else None), "read_stream_response reads another body than protobuf"


# ---- receipt through the real client


class _MemReader:
    """Reads succeed with deterministic bytes of the manifest's shapes (the data plane itself is not fuzzed here)."""

    MAX_BYTES = 64 << 20  # a validated manifest may name up to max_slot_bytes; do not allocate that per input

    def read(self, descriptors: Any, timeout_ms: int | None = None, *, into: Any = None) -> list[torch.Tensor]:
        from tensorwire.errors import ReadError

        assert into is None, "the transport under fuzzing reads into memory of its own"
        if sum(m.nbytes for d in descriptors for m in d.manifest) > self.MAX_BYTES:
            raise ReadError("fuzz reader: manifest larger than the harness reads")
        out = []
        for d in descriptors:
            for m in d.manifest:
                out.append(torch.zeros(m.shape, dtype=m.dtype))
        return out

    def transport(self, descriptor: Any = None) -> str:
        return "memory"

    def stats(self) -> ReaderStats:
        from tensorwire.rdma import ReaderStats

        return ReaderStats(provider="fuzz-memory")

    def close(self) -> None:
        pass


class _StubGrpcChannel:
    """A grpc.Channel stand-in whose unary Encode answers the queued bytes: the real GrpcControlChannel logic (the
    budget check, the receipt parse and its ProtocolError) runs around it. Streams are off in the harness."""

    def __init__(self, responses: list[bytes]) -> None:
        self.responses = responses

    def unary_unary(self, method: str, request_serializer: Any = None, response_deserializer: Any = None) -> Any:
        from tensorwire.mm import wire
        from tensorwire.mm._proto import encoder_pb2 as pb

        if method == wire.RELEASE_METHOD:
            return lambda req, timeout=None: pb.ReleaseLeasesResponse(released=len(req.lease_ids))
        return lambda _req, timeout=None: self.responses.pop(0) if self.responses else b""

    def stream_stream(self, *_a: Any, **_k: Any) -> Any:
        return None  # never called: control_stream is off

    def close(self) -> None:
        pass


class ReceiptHarness:
    """A RemoteOutputTransport whose control plane answers a given receipt's bytes. Build once, reuse."""

    def __init__(self) -> None:
        import grpc
        from prometheus_client import CollectorRegistry

        from tensorwire.mm import RemoteOutputTransport, TransportConfig, TransportMetrics
        from tensorwire.mm.client._grpc import GrpcControlChannel

        cfg = TransportConfig(
            mode="auto", fallback_reserve_ms=0, min_fallback_ms=0, failures_to_open=10**9, control_stream=False
        )
        metrics = TransportMetrics(CollectorRegistry())
        self.responses: list[bytes] = []
        # Duck-typed: with control_stream off the control channel calls only unary_unary and close.
        stub = cast(grpc.Channel, _StubGrpcChannel(self.responses))
        channel = GrpcControlChannel("fuzz:1", cfg, metrics, grpc_channel=stub)
        self.transport = RemoteOutputTransport(
            "fuzz:1", cfg, channel=channel, reader_factory=lambda _c: _MemReader(), metrics=metrics
        )
        assert self.transport.wait_ready(10.0)

    def __call__(self, data: bytes) -> str:
        from tensorwire.mm import MultimodalInput

        # First answer: the fuzzed bytes. If the client falls back, the inline retry gets the same bytes again.
        self.responses[:] = [data, data]
        try:
            out = self.transport.fetch([MultimodalInput(b"x")], timeout_ms=10_000)
        except TensorwireError as exc:
            return _typed(exc)
        assert len(out.embeddings) == len(out.split_sizes), "one embedding per item"
        for e, s in zip(out.embeddings, out.split_sizes, strict=True):
            assert e.shape[0] == s, "embedding rows differ from the split size"
        if out.position_ids is not None:
            assert [p.shape[0] for p in out.position_ids] == list(out.split_sizes)
        return "ok"

    def close(self) -> None:
        self.transport.close()


# ---- broadcaster frames


def target_frame_header(data: bytes) -> str:
    from tensorwire.tp._frame import HEADER, decode_header

    buf = (data + bytes(HEADER.size))[: HEADER.size]  # the link reads exactly HEADER.size bytes first
    try:
        decode_header(buf, 1)
    except TensorwireError as exc:
        return _typed(exc)
    return "ok"


def target_frame_table(data: bytes) -> str:
    from tensorwire.tp._frame import decode_table

    if len(data) < 3:
        return "ok"
    n = data[0] % 8
    payload = int.from_bytes(data[1:3], "little") * 64
    try:
        entries = decode_table(data[3:], n, payload, 1)
    except TensorwireError as exc:
        return _typed(exc)
    for e in entries:
        assert e.offset + e.nbytes <= payload, "table entry outside the payload"
    return "ok"


# ---- broadcaster handshake


class HelloHarness:
    """Rank 0's handshake validation against arbitrary HELLO bytes (the reject goes to a socketpair)."""

    def __init__(self) -> None:
        import hashlib

        from tensorwire.tp._paths import Rendezvous, session_digest
        from tensorwire.tp._star import Hello, RootBootstrap

        self.hello = Hello(0, 4, "uds", session_digest("fuzz"), hashlib.blake2b(b"p", digest_size=16).digest())
        self.root = RootBootstrap(Rendezvous("/nonexistent/fuzz.sock", "fuzz", False), 4, self.hello, 1.0, 0, False)

    def __call__(self, data: bytes) -> str:
        from tensorwire.tp._link import Link
        from tensorwire.tp._star import HELLO

        raw = (data + bytes(HELLO.size))[: HELLO.size]
        a, b = socket.socketpair()
        a.setblocking(False)
        link = Link(a, 0, -1)
        try:
            rank = self.root._validate(raw, [None] * 4, link)
        except TensorwireError as exc:
            return _typed(exc)
        finally:
            link.close()
            b.close()
        assert 0 < rank < 4
        return "ok"


# ---- seeds


def seed_descriptors(rng: random.Random, n: int = 8) -> list[bytes]:
    from tensorwire.rdma import Descriptor, Owner, TensorMeta

    out = []
    for i in range(n):
        rows = rng.randint(1, 64)
        emb_bytes = rows * 64 * 4
        pos_off = (emb_bytes + 4095) // 4096 * 4096
        d = Descriptor(
            owner=Owner(f"tw-exporter-fuzz-{i}", "127.0.0.1", 40000 + i, rng.randint(0, 5)),
            mem_type="DRAM",
            device_id=0,
            slot_addr=0x7F0000000000 + 4096 * i,
            payload_bytes=pos_off + rows * 2 * 8,
            lease_id=f"{rng.getrandbits(64):016x}-{i}",
            generation=rng.randint(1, 1000),
            generation_addr=0x7E0000000000 + 8 * i,
            manifest=(
                TensorMeta((rows, 64), torch.float32, 0, emb_bytes),
                TensorMeta((rows, 2), torch.int64, pos_off, rows * 16),
            ),
        )
        out.append(d.to_bytes())
    return out


def seed_receipts(rng: random.Random) -> list[bytes]:
    """Inline and RDMA receipts as the encoder builds them."""
    from tensorwire.mm import EncoderOutput, OutputTransport, TransportConfig
    from tensorwire.mm._proto import encoder_pb2 as pb

    out = []
    t = OutputTransport(TransportConfig(mode="grpc"))
    try:
        for rows in ([3], [2, 5], [1]):
            emb = [torch.randn(r, 16) for r in rows]
            pos = [torch.arange(r * 2, dtype=torch.int64).reshape(r, 2) for r in rows]
            receipt = t.transfer(pb.EncodeRequest(), EncoderOutput(embeddings=emb, position_ids=pos))
            out.append(receipt.to_bytes())
    finally:
        t.close()
    for desc in seed_descriptors(rng, 3):
        from tensorwire.rdma import Descriptor

        d = Descriptor.from_bytes(desc)
        r = pb.EncodeResponse(split_sizes=[d.manifest[0].shape[0]])
        r.rdma_slots.add(descriptor=desc, roles=[pb.EMBEDDING, pb.POS_ID])
        r.worker.worker_id = "fuzz-worker"
        out.append(r.SerializeToString())
    return out


def seed_inline_tensors(rng: random.Random) -> list[bytes]:
    from tensorwire.mm.wire import _codec

    seeds = []
    for dtype in (torch.float32, torch.bfloat16, torch.int64, torch.uint8, torch.bool):
        t = torch.zeros(rng.randint(0, 4), rng.randint(1, 5), dtype=dtype)
        seeds.append(_codec.encode_tensor(t).SerializeToString())
    return seeds


def seed_frames(rng: random.Random) -> tuple[list[bytes], list[bytes]]:
    from tensorwire.tp._frame import HEADER, encode_prefix

    headers, tables = [], []
    for _ in range(4):
        tensors = [torch.zeros(rng.randint(1, 4), dtype=torch.float32) for _ in range(rng.randint(1, 3))]
        keys = [f"k{i}" for i in range(len(tensors))]
        prefix, _offsets, payload = encode_prefix(1, rng.randint(0, 9), 2, keys, tensors, 64)
        headers.append(bytes(prefix[: HEADER.size]))
        # target_frame_table's framing: n, payload/64 (2 bytes), then the table
        tables.append(bytes([len(tensors)]) + (payload // 64 + 1).to_bytes(2, "little") + bytes(prefix[HEADER.size :]))
    return headers, tables


def seed_hellos() -> list[bytes]:
    import hashlib

    from tensorwire.tp._paths import session_digest
    from tensorwire.tp._star import BACKEND_CODES, HELLO, HELLO_MAGIC, PROTO_VERSION

    params = hashlib.blake2b(b"p", digest_size=16).digest()
    return [
        HELLO.pack(HELLO_MAGIC, PROTO_VERSION, BACKEND_CODES["uds"], 0, r, 4, session_digest("fuzz"), params)
        for r in (1, 2, 3)
    ]


def seed_stream_answers(rng: random.Random) -> list[bytes]:
    """EncodeStream answers as the encoder writes them: receipts (inline and RDMA) and an error."""
    from tensorwire.mm import wire
    from tensorwire.mm._proto import encoder_pb2 as pb
    from tensorwire.mm.wire._receipt import parse_receipt

    out = [parse_receipt(r).to_stream_frame(rng.randint(1, 2**40)) for r in seed_receipts(rng)]
    error = pb.StreamError(code=3, reason="invalid_request", message="m").SerializeToString()
    out.append(wire.stream_frame(7, wire.STREAM_ERROR_FIELD, error))
    return out


__all__ = [
    "ReceiptHarness",
    "HelloHarness",
    "target_descriptor",
    "target_inline_tensor",
    "target_receipt_wire",
    "target_stream_wire",
    "target_frame_header",
    "target_frame_table",
    "seed_descriptors",
    "seed_receipts",
    "seed_stream_answers",
    "seed_inline_tensors",
    "seed_frames",
    "seed_hellos",
]
