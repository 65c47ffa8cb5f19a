"""WireReceipt: a receipt as it crosses the wire, with the bytes of its inline tensors kept out of protobuf.

Why: python-protobuf copies a ``bytes`` field when it is set, serialized, parsed and read. Here the payload is
copied once on the encoder (from the output tensor into the response bytes) and not at all on the client (the
decoded tensors view the received bytes).

Encoder: ``OutputTransport.transfer`` fills ``message`` (the whole EncodeResponse, the inline tensors' dtype and
shape included, their ``data`` left empty) and one payload per inline tensor (a host view of the output tensor,
``_codec.host_view``). ``to_bytes()`` (unary) and ``to_stream_frame(id)`` (EncodeStream) write it.

Layout, valid protobuf that any parser (an old client's too) reads as the same message: the inline tensor
records come first, each with its length as a fixed 5-byte varint, its dtype and shape, then a padding record
(Tensor field 15, reserved for it in encoder.proto, unknown to every schema and ignored), then ``data``, padded
so that every payload starts ``ALIGN``-aligned from the start of the message gRPC delivers; the other fields
follow, as protobuf writes them.

Client: ``parse_receipt(raw)`` walks the top-level records; each inline tensor's ``data`` becomes a memoryview
slice of ``raw`` (no copy), and every other byte (slots, split sizes, dtype and shape, unknown fields) goes to
protobuf in a small skeleton copy, so protobuf's own rules and checks (merged records, packed or unpacked
shapes, UTF-8) apply unchanged; the walk itself bounds every length (``_pbwire``). ``parse_stream_response``
does the same for an EncodeStream answer. The channels call ``read_stream_response``: the walk for an answer over
``UPB_MAX_BYTES`` (where the views save copies), protobuf's own parser below it (an RDMA or placed receipt is a
few hundred bytes; the walk is pure Python and costs more than the copies it saves there).

Ownership: a parsed receipt's payloads view the received bytes, which nothing else holds; the receipt and the
tensors decoded from it keep them alive. An encoder's receipt views the output tensors (or a host copy of device
ones) until it is serialized, which the service does right after ``transfer`` returns, on the same thread.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from google.protobuf.message import DecodeError

from tensorwire.errors import InvalidPayload, Reason
from tensorwire.mm import wire
from tensorwire.mm._proto import encoder_pb2 as pb
from tensorwire.mm.wire._protobuf import LEN, VARINT, Buffer, WireError, fixed_varint, read_varint, records, tag, varint

ALIGN = 16  # CPython's bytes data is 16-byte aligned, so an aligned offset is an aligned address (any dtype)
EMBEDDING_FIELD, POSITION_IDS_FIELD, EXTRA_INPUTS_FIELD = 1, 2, 3  # EncodeResponse
TENSOR_DATA_FIELD = 3  # Tensor.data
TENSOR_PAD_FIELD = 15  # Tensor: alignment padding (reserved in encoder.proto)
_TENSOR_FIELDS = (EMBEDDING_FIELD, POSITION_IDS_FIELD, EXTRA_INPUTS_FIELD)
_ID_TAG, _RECEIPT_TAG = tag(1, VARINT), tag(wire.STREAM_RECEIPT_FIELD, LEN)  # StreamResponse.id, .receipt
_LEN_WIDTH = len(fixed_varint(0))
# An answer up to this size is parsed by protobuf itself (``read_stream_response``): a placed or RDMA receipt is a
# few hundred bytes, which upb reads in ~1 us where the walk takes ~13 us hot (more on a cold path); the copies it
# makes of small inline payloads cost less than that.
UPB_MAX_BYTES = 64 << 10
_EMPTY = memoryview(b"")


@dataclass(eq=False)
class WireReceipt:
    """An EncodeResponse whose inline tensors' bytes are held next to it instead of inside it.

    ``message``: every field; a present inline tensor has its dtype and shape there and an empty ``data``.
    ``embedding``/``position_ids``: the payload of that tensor, or None when the message does not have it;
    ``extra_inputs``: one payload per ``message.extra_inputs`` entry, in order.
    """

    message: pb.EncodeResponse = field(default_factory=pb.EncodeResponse)
    embedding: Buffer | None = None
    position_ids: Buffer | None = None
    extra_inputs: list[Buffer] = field(default_factory=list)

    @classmethod
    def from_message(cls, msg: pb.EncodeResponse) -> WireReceipt:
        """The WireReceipt of a complete message (a copy of it; its ``data`` fields become the payloads)."""
        m = pb.EncodeResponse()
        m.CopyFrom(msg)
        return cls.taking(m)

    @classmethod
    def taking(cls, m: pb.EncodeResponse) -> WireReceipt:
        """``from_message`` without the copy: ``m`` becomes the receipt's message (its ``data`` fields emptied)."""
        out = cls(m)
        if m.HasField("embedding"):
            out.embedding, m.embedding.data = m.embedding.data, b""
        if m.HasField("position_ids"):
            out.position_ids, m.position_ids.data = m.position_ids.data, b""
        for t in m.extra_inputs:
            out.extra_inputs.append(t.data)
            t.data = b""
        return out

    def to_message(self) -> pb.EncodeResponse:
        """The complete EncodeResponse (copies every payload into it: for tests and tools, not the data path)."""
        m = pb.EncodeResponse()
        m.CopyFrom(self.message)
        for _, t, payload in self._tensors(m):
            t.data = bytes(payload)
        return m

    @property
    def payload_bytes(self) -> int:
        return sum(len(p) for _, _, p in self._tensors(self.message))

    def to_bytes(self) -> bytes:
        """The serialized EncodeResponse (the answer of the unary Encode)."""
        pieces, _ = self._pieces(0)
        return b"".join(pieces)

    def to_stream_frame(self, message_id: int) -> bytes:
        """The serialized ``StreamResponse{id: message_id, receipt: <this>}`` (an EncodeStream answer)."""
        return b"".join(self.to_stream_pieces(message_id))

    def to_stream_pieces(self, message_id: int) -> list[Buffer]:
        """``to_stream_frame`` as buffers to send back to back (payloads by reference, not joined): for a writer
        that takes pieces (the same-host channel's ``sendmsg``), which saves the one copy of the payload."""
        head = _ID_TAG + varint(message_id) + _RECEIPT_TAG
        pieces, size = self._pieces(len(head) + _LEN_WIDTH)
        return [head + fixed_varint(size), *pieces]

    def _tensors(self, m: pb.EncodeResponse) -> list[tuple[int, pb.Tensor, Buffer]]:
        """(EncodeResponse field number, the Tensor in ``m``, its payload) of each inline tensor, in field order."""
        out: list[tuple[int, pb.Tensor, Buffer]] = []
        if m.HasField("embedding"):
            out.append((EMBEDDING_FIELD, m.embedding, self.embedding if self.embedding is not None else _EMPTY))
        if m.HasField("position_ids"):
            out.append(
                (POSITION_IDS_FIELD, m.position_ids, self.position_ids if self.position_ids is not None else _EMPTY)
            )
        if len(self.extra_inputs) != len(m.extra_inputs):
            raise InvalidPayload(
                f"receipt has {len(m.extra_inputs)} extra inputs and {len(self.extra_inputs)} payloads for them",
                reason=Reason.ASSEMBLY_MISMATCH,
            )
        out.extend((EXTRA_INPUTS_FIELD, t, p) for t, p in zip(m.extra_inputs, self.extra_inputs, strict=True))
        return out

    def _pieces(self, base: int) -> tuple[list[Buffer], int]:
        """The message as buffers to join (payloads by reference) and its size; ``base`` is the offset at which
        it starts in what is sent (the payloads are aligned relative to the start of that)."""
        m = self.message
        tensors = self._tensors(m)
        if not tensors:  # an RDMA or placed receipt: protobuf writes it as it is (no copy with the tensors cleared)
            body = m.SerializeToString()
            _check_size(len(body))
            return [body], len(body)
        _check_size(sum(len(p) for _, _, p in tensors))
        pieces: list[Buffer] = []
        pos = base
        for number, t, payload in tensors:
            meta = t.SerializeToString()  # dtype and shape: data is empty here
            for piece in _tensor_record(number, meta, payload, pos):
                pieces.append(piece)
                pos += len(piece)
        rest = pb.EncodeResponse()
        rest.CopyFrom(m)
        for name in ("embedding", "position_ids", "extra_inputs"):
            rest.ClearField(name)
        tail = rest.SerializeToString()
        pieces.append(tail)
        size = pos + len(tail) - base
        _check_size(size)
        return pieces, size


def _check_size(size: int) -> None:
    if size > wire.MAX_MESSAGE_BYTES:
        raise InvalidPayload(
            f"inline receipt of {size} bytes exceeds protobuf's message limit of "
            f"{wire.MAX_MESSAGE_BYTES} bytes; such an output needs the RDMA plane",
            reason=Reason.SIZE_OVERFLOW,
        )


def _tensor_record(number: int, meta: bytes, payload: Buffer, pos: int) -> list[Buffer]:
    """The EncodeResponse record ``number`` holding one Tensor, written at offset ``pos``: its payload aligned."""
    n = len(payload)
    if n == 0:
        return [tag(number, LEN) + varint(len(meta)) + meta]
    data_head = tag(TENSOR_DATA_FIELD, LEN) + varint(n)
    head = len(tag(number, LEN)) + len(fixed_varint(0)) + len(meta)
    pad = -(pos + head + len(data_head)) % ALIGN
    if pad == 1:  # the smallest padding record is 2 bytes (its tag and a zero length)
        pad += ALIGN
    pad_record = tag(TENSOR_PAD_FIELD, LEN) + varint(pad - 2) + bytes(pad - 2) if pad else b""
    body = len(meta) + pad + len(data_head) + n
    return [tag(number, LEN) + fixed_varint(body) + meta + pad_record + data_head, payload]


def parse_receipt(raw: Buffer, spans: Sequence[tuple[int, int]] | None = None) -> WireReceipt:
    """The receipt in ``raw`` (or in the concatenation of its ``spans``, which protobuf reads as one message
    merged from them) with its inline tensors' ``data`` as views of ``raw``. ``WireError`` when it does not parse.
    """
    mv = _byte_view(raw)
    skeleton = bytearray()
    out = WireReceipt()
    for start, end in spans if spans is not None else [(0, len(mv))]:
        for number, wire_type, vstart, vend, rstart in records(mv, start, end):
            if wire_type != LEN or number not in _TENSOR_FIELDS:
                skeleton += mv[rstart:vend]
                continue
            meta, data = _split_tensor(mv, vstart, vend)
            skeleton += tag(number, LEN)
            skeleton += varint(len(meta))
            skeleton += meta
            # A singular message field seen again is merged into the first: a later data wins, a missing one
            # keeps the earlier (protobuf's rule). Each extra_inputs record is a new element.
            if number == EMBEDDING_FIELD:
                out.embedding = data if data is not None else (out.embedding if out.embedding is not None else _EMPTY)
            elif number == POSITION_IDS_FIELD:
                out.position_ids = (
                    data if data is not None else (out.position_ids if out.position_ids is not None else _EMPTY)
                )
            else:
                out.extra_inputs.append(data if data is not None else _EMPTY)
    try:
        out.message = pb.EncodeResponse.FromString(bytes(skeleton))
    except DecodeError as exc:
        raise WireError(str(exc)) from exc
    return out


def _byte_view(raw: Buffer) -> memoryview:
    mv = memoryview(raw)
    return mv if mv.format == "B" and mv.ndim == 1 else mv.cast("B")


def _split_tensor(mv: memoryview, start: int, end: int) -> tuple[bytearray, memoryview | None]:
    """(every record of the Tensor in ``mv[start:end]`` but its data, the last data record's payload or None)."""
    meta = bytearray()
    data: memoryview | None = None
    for number, wire_type, vstart, vend, rstart in records(mv, start, end):
        if number == TENSOR_DATA_FIELD and wire_type == LEN:
            data = mv[vstart:vend]
        else:
            meta += mv[rstart:vend]
    return meta, data


def parse_stream_response(raw: Buffer) -> tuple[int, WireReceipt | pb.StreamError | None]:
    """(id, body) of a serialized StreamResponse: its receipt (a WireReceipt, as ``parse_receipt``), its
    StreamError, or None (no body this client knows). ``WireError`` when it does not parse. The oneof follows
    protobuf: the last body record's kind wins, records of one kind merge, and a body a later one replaced must
    still parse."""
    mv = _byte_view(raw)
    message_id = 0
    kind = 0  # the field number of the body being read (0: none yet)
    spans: list[tuple[int, int]] = []
    for number, wire_type, vstart, vend, _ in records(mv, 0, len(mv)):
        if number == 1 and wire_type == VARINT:
            message_id, _ = read_varint(mv, vstart, vend)
        elif number in (wire.STREAM_RECEIPT_FIELD, wire.STREAM_ERROR_FIELD) and wire_type == LEN:
            if number != kind:
                if kind:
                    _stream_body(mv, kind, spans)  # replaced, but protobuf parsed it too
                kind, spans = number, []
            spans.append((vstart, vend))
    return message_id, _stream_body(mv, kind, spans) if kind else None


def read_stream_response(raw: Buffer) -> tuple[int, WireReceipt | pb.StreamError | None]:
    """``parse_stream_response``'s answer; for an answer of at most ``UPB_MAX_BYTES`` by protobuf's parser, whose
    payloads are then ``bytes`` copies instead of views of ``raw``. What the receiving channels call."""
    if len(raw) > UPB_MAX_BYTES:
        return parse_stream_response(raw)
    try:
        msg = pb.StreamResponse.FromString(raw)  # type: ignore[arg-type]  # upb reads any buffer, not only bytes
    except DecodeError as exc:
        raise WireError(str(exc)) from exc
    kind = msg.WhichOneof("body")
    if kind == "receipt":
        return msg.id, WireReceipt.taking(msg.receipt)
    return msg.id, msg.error if kind == "error" else None


def _stream_body(mv: memoryview, number: int, spans: list[tuple[int, int]]) -> WireReceipt | pb.StreamError:
    if number == wire.STREAM_RECEIPT_FIELD:
        return parse_receipt(mv, spans)
    try:
        return pb.StreamError.FromString(b"".join(mv[s:e] for s, e in spans))
    except DecodeError as exc:
        raise WireError(str(exc)) from exc


__all__ = [
    "ALIGN",
    "TENSOR_PAD_FIELD",
    "UPB_MAX_BYTES",
    "WireReceipt",
    "WireError",
    "parse_receipt",
    "parse_stream_response",
    "read_stream_response",
]
