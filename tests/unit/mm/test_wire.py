"""Status mapping, public names, and compatibility with peers that predate the RDMA fields."""

from __future__ import annotations

import pickle

import grpc
import pytest
import torch
from google.protobuf import descriptor_pb2, descriptor_pool, message_factory

import tensorwire.mm as mm
from tensorwire.errors import (
    ConfigError,
    ControlPlaneError,
    DeadlineExceeded,
    InvalidPayload,
    LeaseExpired,
    PeerUnavailable,
    PoolExhausted,
    ProtocolError,
    Reason,
)
from tensorwire.mm import wire
from tensorwire.mm._proto import encoder_pb2 as pb
from tensorwire.mm.wire import _codec
from tensorwire.mm.wire._receipt import parse_receipt


def test_public_names() -> None:
    assert set(mm.__all__) >= {
        "EncoderOutput",
        "MultimodalOutput",
        "TransportConfig",
        "MultimodalInput",
        "OutputTransport",
        "EncoderService",
        "serve_encoder",
        "RemoteOutputTransport",
    }
    for name in mm.__all__:
        assert hasattr(mm, name), name
    assert wire.ENCODE_METHOD == "/tensorwire.mm.v1.EncoderService/Encode"
    assert wire.RELEASE_METHOD == "/tensorwire.mm.v1.EncoderService/ReleaseLeases"
    assert wire.ENCODE_STREAM_METHOD == "/tensorwire.mm.v1.EncoderService/EncodeStream"


@pytest.mark.parametrize(
    "exc,code",
    [
        (InvalidPayload("x"), grpc.StatusCode.INVALID_ARGUMENT),
        (ValueError("x"), grpc.StatusCode.INVALID_ARGUMENT),
        (NotImplementedError("x"), grpc.StatusCode.UNIMPLEMENTED),
        (DeadlineExceeded("x"), grpc.StatusCode.DEADLINE_EXCEEDED),
        (PeerUnavailable("x"), grpc.StatusCode.UNAVAILABLE),
        (RuntimeError("x"), grpc.StatusCode.INTERNAL),
    ],
)
def test_status_for(exc: BaseException, code: grpc.StatusCode) -> None:
    assert wire.status_for(exc)[0] == code


class FakeRpcError(grpc.RpcError):
    def __init__(self, code: grpc.StatusCode, reason: str | None = None) -> None:
        self._code = code
        self._md = ((wire.REASON_METADATA_KEY, reason),) if reason else ()

    def code(self) -> grpc.StatusCode:
        return self._code

    def details(self) -> str:
        return "detail"

    def trailing_metadata(self):  # type: ignore[no-untyped-def]
        return self._md


@pytest.mark.parametrize(
    "code,reason,cls,expect_reason",
    [
        (grpc.StatusCode.INVALID_ARGUMENT, "nbytes_mismatch", InvalidPayload, Reason.NBYTES_MISMATCH),
        (grpc.StatusCode.INVALID_ARGUMENT, None, InvalidPayload, Reason.INVALID_PAYLOAD),
        (grpc.StatusCode.UNAVAILABLE, None, PeerUnavailable, Reason.PEER_UNAVAILABLE),
        (grpc.StatusCode.DEADLINE_EXCEEDED, None, DeadlineExceeded, Reason.DEADLINE_EXCEEDED),
        (grpc.StatusCode.UNIMPLEMENTED, None, ControlPlaneError, Reason.UNIMPLEMENTED),
        (grpc.StatusCode.INTERNAL, None, ProtocolError, Reason.PROTOCOL_ERROR),
        (grpc.StatusCode.INTERNAL, "not-a-reason", ProtocolError, Reason.PROTOCOL_ERROR),
    ],
)
def test_error_from_rpc(code, reason, cls, expect_reason) -> None:  # type: ignore[no-untyped-def]
    err = wire.error_from_rpc(FakeRpcError(code, reason), "Encode")
    assert type(err) is cls and err.reason is expect_reason
    back = pickle.loads(pickle.dumps(err))
    assert type(back) is cls and back.reason is expect_reason


class ServerRpcError(grpc.RpcError):
    """What a client sees when the server ended a call with ``wire.abort_with(context, exc)``."""

    def __init__(self, exc: BaseException) -> None:
        self._code, reason = wire.status_for(exc)
        self._details = f"{type(exc).__name__}: {exc}"
        self._md = ((wire.REASON_METADATA_KEY, reason.value),)

    def code(self) -> grpc.StatusCode:
        return self._code

    def details(self) -> str:
        return self._details

    def trailing_metadata(self):  # type: ignore[no-untyped-def]
        return self._md


@pytest.mark.parametrize(
    "exc",
    [
        InvalidPayload("bad", reason=Reason.NBYTES_MISMATCH),
        ValueError("bad"),
        NotImplementedError("video"),
        DeadlineExceeded("slow"),
        TimeoutError("slow"),
        PeerUnavailable("gone"),
        PoolExhausted("full"),
        ConfigError("cfg"),
        LeaseExpired("old"),
        RuntimeError("boom"),
        ProtocolError("garbled"),
    ],
    ids=lambda e: type(e).__name__,
)
def test_a_stream_error_raises_what_the_unary_status_raises(exc: BaseException) -> None:
    unary = wire.error_from_rpc(ServerRpcError(exc), "Encode on w")
    streamed = wire.error_from_stream(
        pb.StreamError.FromString(wire.stream_error_for(exc).SerializeToString()), "Encode on w"
    )
    assert type(streamed) is type(unary) and streamed.reason is unary.reason and str(streamed) == str(unary)


def test_a_stream_error_with_unknown_code_or_reason_still_maps() -> None:
    err = wire.error_from_stream(pb.StreamError(code=999, reason="from-the-future", message="m"), "Encode")
    assert type(err) is ControlPlaneError and err.reason is Reason.UNKNOWN
    err = wire.error_from_stream(pb.StreamError(code=grpc.StatusCode.INTERNAL.value[0], reason="nope"), "Encode")
    assert type(err) is ProtocolError and err.reason is Reason.PROTOCOL_ERROR


@pytest.mark.parametrize("message_id", [1, 127, 128, 300, 2**35, 2**64 - 1])
def test_stream_frame_is_what_protobuf_writes(message_id: int) -> None:
    request = pb.EncodeRequest(support_rdma=True, deadline_ms=5, inputs=[pb.MultimodalInput(data=b"x" * 200)])
    release = pb.ReleaseLeasesRequest(lease_ids=["a", "b"])
    receipt = pb.EncodeResponse(split_sizes=[1, 2])
    error = pb.StreamError(code=3, reason="invalid_request", message="m")
    for field, body, want in [
        (wire.STREAM_ENCODE_FIELD, request, pb.StreamRequest(id=message_id, encode=request)),
        (wire.STREAM_RELEASE_FIELD, release, pb.StreamRequest(id=message_id, release=release)),
        (wire.STREAM_RECEIPT_FIELD, receipt, pb.StreamResponse(id=message_id, receipt=receipt)),
        (wire.STREAM_ERROR_FIELD, error, pb.StreamResponse(id=message_id, error=error)),
    ]:
        framed = wire.stream_frame(message_id, field, body.SerializeToString())
        assert framed == want.SerializeToString()
        assert type(want).FromString(framed) == want
    empty = wire.stream_frame(0, wire.STREAM_RELEASE_FIELD, b"")  # id 0 written explicitly still parses as 0
    assert pb.StreamRequest.FromString(empty) == pb.StreamRequest(release=pb.ReleaseLeasesRequest())


def test_only_the_marked_resource_exhausted_is_a_stream_refusal() -> None:
    class Refused(FakeRpcError):
        def trailing_metadata(self):  # type: ignore[no-untyped-def]
            return ((wire.REASON_METADATA_KEY, "pool_exhausted"), wire.STREAM_REFUSED_METADATA)

    assert wire.is_stream_refusal(Refused(grpc.StatusCode.RESOURCE_EXHAUSTED))
    assert not wire.is_stream_refusal(Refused(grpc.StatusCode.UNAVAILABLE))
    # gRPC's own RESOURCE_EXHAUSTED (a message over the size limit) may come after the request ran
    assert not wire.is_stream_refusal(FakeRpcError(grpc.StatusCode.RESOURCE_EXHAUSTED, "pool_exhausted"))
    assert not wire.is_stream_refusal(FakeRpcError(grpc.StatusCode.RESOURCE_EXHAUSTED))


def _legacy_classes():  # type: ignore[no-untyped-def]
    """The same schema without any RDMA-era field, as an old peer compiled it."""
    fdp = descriptor_pb2.FileDescriptorProto()
    pb.DESCRIPTOR.CopyToProto(fdp)
    fdp.name = "legacy_encoder.proto"
    fdp.package = "legacy.mm"
    new_fields = {"EncodeRequest": {2, 3, 4}, "EncodeResponse": {5, 6, 7}}
    for msg in fdp.message_type:
        drop = new_fields.get(msg.name, set())
        keep = [f for f in msg.field if f.number not in drop]
        del msg.field[:]
        msg.field.extend(keep)
        for f in [*msg.field, *(nf for nested in msg.nested_type for nf in nested.field)]:
            if f.HasField("type_name"):
                f.type_name = f.type_name.replace(".tensorwire.mm.v1.", ".legacy.mm.")
    keep_msgs = [m for m in fdp.message_type if m.name not in ("RdmaSlot", "WorkerIdentity")]
    del fdp.message_type[:]
    fdp.message_type.extend(keep_msgs)
    del fdp.service[:]
    pool = descriptor_pool.DescriptorPool()
    pool.Add(fdp)
    get = lambda n: message_factory.GetMessageClass(pool.FindMessageTypeByName(f"legacy.mm.{n}"))  # noqa: E731
    return get("EncodeRequest"), get("EncodeResponse")


def test_old_peers_interoperate_inline() -> None:
    LegacyRequest, LegacyResponse = _legacy_classes()
    assert "support_rdma" not in LegacyRequest.DESCRIPTOR.fields_by_name
    # an old client's request parses with support_rdma false: a new encoder answers inline
    old_req = LegacyRequest()
    item = old_req.inputs.add()
    item.data = b"jpeg"
    item.kind = "image"
    new_req = pb.EncodeRequest.FromString(old_req.SerializeToString())
    assert not new_req.support_rdma and new_req.inputs[0].data == b"jpeg"
    # an old encoder's receipt (no slots, no worker) decodes through the new terminal
    old_resp = LegacyResponse()
    old_resp.split_sizes.extend([1, 2])
    emb = torch.arange(12, dtype=torch.float32).reshape(3, 4)
    old_resp.embedding.dtype = pb.FLOAT32
    old_resp.embedding.shape.extend([3, 4])
    old_resp.embedding.data = emb.numpy().tobytes()
    new_resp = pb.EncodeResponse.FromString(old_resp.SerializeToString())
    assert not new_resp.rdma_slots and not new_resp.HasField("worker")
    embs, splits, _, _, _ = _codec.decode_inline_receipt(parse_receipt(old_resp.SerializeToString()))
    assert splits == [1, 2] and torch.equal(torch.cat(embs), emb)
    # a new encoder's inline receipt, with the new fields set, still parses for an old client
    new_resp.worker.worker_id = "w1"
    new_resp.encoder_stage_us["encode"] = 5
    back = LegacyResponse.FromString(new_resp.SerializeToString())
    assert list(back.split_sizes) == [1, 2] and back.embedding.data == old_resp.embedding.data
    # ... and so does the receipt a new encoder writes (payload aligned behind a padding record), on both paths
    transport = mm.OutputTransport(mm.TransportConfig(mode="grpc"))
    receipt = transport.transfer(pb.EncodeRequest(), mm.EncoderOutput(embeddings=emb, split_sizes=[1, 2]))
    transport.close()
    streamed = pb.StreamResponse.FromString(receipt.to_stream_frame(3)).receipt.SerializeToString()
    for raw in (receipt.to_bytes(), streamed):
        back = LegacyResponse.FromString(raw)
        assert list(back.split_sizes) == [1, 2] and list(back.embedding.shape) == [3, 4]
        assert back.embedding.dtype == pb.FLOAT32 and back.embedding.data == old_resp.embedding.data


def test_rpc_budget_formula_is_the_one_the_client_and_the_proxy_use() -> None:
    budget = lambda ts: wire.rpc_budget_ms(ts, worker_timeout_ms=1_000, margin_ms=50)  # noqa: E731
    assert budget([]) == 1_050  # no items: the worker default
    assert budget([0, -5]) == 1_050  # <= 0: the worker default
    assert budget([0, 3_000, 200]) == 3_050  # the largest item budget wins
    assert budget([200]) == 250  # an item may ask for less than the default
