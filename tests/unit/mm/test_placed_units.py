"""Units of placed outputs (``tensorwire.mm.wire._placed``): the packing plan, the client's checks of a worker's
manifest, the worker's checks of an offer (memfd seals and size), and descriptor passing on ``_unix`` frames.
The whole path between processes is tests/integration/mm/test_placed.py."""

from __future__ import annotations

import array
import fcntl
import gc
import os
import socket

import pytest
import torch

from tensorwire._local import unix as _unix
from tensorwire.errors import ProtocolError
from tensorwire.mm._proto import encoder_pb2 as pb
from tensorwire.mm.wire import _placed
from tensorwire.mm.wire._codec import DTYPE_TO_WIRE

CPU = torch.device("cpu")


def test_plan_packs_aligned_and_refuses_what_does_not_fit() -> None:
    specs = [((3, 5), torch.float32), ((7,), torch.int64), ((1,), torch.uint8)]
    assert _placed.plan(specs, 4096) == [0, 512, 1024]
    assert _placed.plan(specs, 1536) == [0, 512, 1024]
    assert _placed.plan(specs, 1535) is None
    assert _placed.buffer_bytes(0) == _placed.MIN_BUFFER_BYTES
    assert _placed.buffer_bytes(_placed.MIN_BUFFER_BYTES + 1) == 2 * _placed.MIN_BUFFER_BYTES


def answer(*tensors: tuple[int, torch.dtype, tuple[int, ...], int, int]) -> pb.PlacedOutput:
    out = pb.PlacedOutput(buffer_id=1)
    for role, dtype, shape, offset, nbytes in tensors:
        out.tensors.add(role=role, dtype=DTYPE_TO_WIRE[dtype], shape=list(shape), offset=offset, nbytes=nbytes)
    return out


@pytest.fixture
def buf() -> _placed.RecvBuffer:
    b = _placed.RecvBuffer(1, _placed.MIN_BUFFER_BYTES, CPU)
    b.busy = True
    yield b
    gc.collect()
    b.close()


def test_placed_views_see_what_the_worker_wrote_and_lend_the_buffer(buf: _placed.RecvBuffer) -> None:
    ended: list[_placed.RecvBuffer] = []
    emb = torch.arange(12, dtype=torch.float32).reshape(3, 4)
    pos = torch.arange(6, dtype=torch.int64).reshape(3, 2)
    # What a worker does: map the offered memfd and write into it.
    body, fds = buf.offer()
    mapped = _placed.map_offer(body, list(os.dup(fd) for fd in fds), CPU, 1 << 30)
    _placed.typed_view(mapped.tensor, 0, (3, 4), torch.float32).copy_(emb)
    _placed.typed_view(mapped.tensor, 512, (3, 2), torch.int64).copy_(pos)
    tensors, roles, nbytes = _placed.placed_views(
        answer((pb.EMBEDDING, torch.float32, (3, 4), 0, 48), (pb.POS_ID, torch.int64, (3, 2), 512, 48)),
        buf,
        ended.append,
    )
    mapped.close()
    assert torch.equal(tensors[0], emb) and torch.equal(tensors[1], pos)
    assert roles == [pb.EMBEDDING, pb.POS_ID] and nbytes == 96
    del tensors
    gc.collect()
    assert ended == [buf]  # the loan ended with the last tensor


@pytest.mark.parametrize(
    "bad, why",
    [
        ((pb.EMBEDDING, torch.float32, (3, 4), 0, 40), "does not fit"),  # nbytes != prod(shape) * itemsize
        ((pb.EMBEDDING, torch.float32, (3, 4), 2, 48), "does not fit"),  # offset not a multiple of the itemsize
        ((pb.EMBEDDING, torch.float32, (1 << 18, 1), 8, 1 << 20), "does not fit"),  # runs past the end
        ((pb.EMBEDDING, torch.float32, (-1, 4), 0, 0), "shape"),
        ((pb.EMBEDDING, torch.float32, (1,) * 17, 0, 4), "shape"),
        ((7, torch.float32, (3, 4), 0, 48), "unknown role"),
    ],
)
def test_placed_views_refuse_a_manifest_that_does_not_fit(buf: _placed.RecvBuffer, bad: tuple, why: str) -> None:  # type: ignore[type-arg]
    ended: list[_placed.RecvBuffer] = []
    with pytest.raises(ProtocolError, match=why):
        _placed.placed_views(answer(bad), buf, ended.append)
    assert not ended  # nothing was lent


def test_placed_views_refuse_overlaps_unknown_dtypes_and_empty_answers(buf: _placed.RecvBuffer) -> None:
    with pytest.raises(ProtocolError, match="overlap"):
        _placed.placed_views(
            answer((pb.EMBEDDING, torch.float32, (4,), 0, 16), (pb.EXTRA_INPUT, torch.float32, (4,), 8, 16)),
            buf,
            lambda b: None,
        )
    bad = answer((pb.EMBEDDING, torch.float32, (4,), 0, 16))
    bad.tensors[0].dtype = 99  # type: ignore[assignment]
    with pytest.raises(ProtocolError, match="unknown dtype"):
        _placed.placed_views(bad, buf, lambda b: None)
    with pytest.raises(ProtocolError, match="no tensor"):
        _placed.placed_views(pb.PlacedOutput(buffer_id=1), buf, lambda b: None)


def memfd(nbytes: int, seal: bool) -> int:
    fd = os.memfd_create("t", os.MFD_ALLOW_SEALING)
    os.ftruncate(fd, nbytes)
    if seal:
        fcntl.fcntl(fd, fcntl.F_ADD_SEALS, fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW)
    return fd


@pytest.mark.parametrize(
    "offer, fds, why",
    [
        (
            pb.BufferOffer(buffer_id=1, kind=pb.BufferOffer.HOST, nbytes=4096),
            lambda: [memfd(4096, seal=False)],
            "not sealed",
        ),
        (
            pb.BufferOffer(buffer_id=1, kind=pb.BufferOffer.HOST, nbytes=8192),
            lambda: [memfd(4096, seal=True)],
            "4096 bytes",
        ),
        (pb.BufferOffer(buffer_id=1, kind=pb.BufferOffer.HOST, nbytes=4096), list, "0 descriptors"),
        (
            pb.BufferOffer(buffer_id=1, kind=pb.BufferOffer.HOST, nbytes=2 << 30),
            lambda: [memfd(4096, seal=True)],
            "this worker takes",
        ),
        (pb.BufferOffer(buffer_id=0, kind=pb.BufferOffer.HOST, nbytes=4096), lambda: [memfd(4096, seal=True)], "id 0"),
        (
            pb.BufferOffer(buffer_id=1, kind=pb.BufferOffer.CUDA, nbytes=4096, cuda_ipc_handle=b"x" * 64),
            list,
            "without a GPU",
        ),
        (pb.BufferOffer(buffer_id=1, nbytes=4096), list, "kind"),
    ],
)
def test_offers_that_a_worker_refuses(offer: pb.BufferOffer, fds, why: str) -> None:  # type: ignore[no-untyped-def]
    passed = fds()
    with pytest.raises(_placed.PlacementRefused, match=why):
        _placed.map_offer(offer, passed, CPU, 1 << 30)
    assert passed == []  # every descriptor closed, taken or not


def test_descriptors_travel_with_a_frame_and_only_where_asked_for() -> None:
    a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        fd = memfd(4096, seal=True)
        _unix.send_frame(a, b"offer", None, [fd])
        got: list[int] = []
        assert _unix.recv_frame(b, None, 64, got) == b"offer" and len(got) == 1
        assert os.fstat(got[0]).st_size == 4096  # the same file, a new descriptor
        _unix.close_fds(got)
        _unix.send_frame(a, b"again", None, [fd])
        assert _unix.recv_frame(b, None, 64) == b"again"  # not asked for: the kernel drops it
        two = array.array("i", [fd, fd])
        a.sendmsg([_unix.FRAME_HEADER.pack(3) + b"xyz"], [(socket.SOL_SOCKET, socket.SCM_RIGHTS, two)])
        before = len(os.listdir("/proc/self/fd"))
        with pytest.raises(ValueError, match="file descriptors"):
            _unix.recv_frame(b, None, 64, got)
        assert got == [] and len(os.listdir("/proc/self/fd")) <= before  # both closed, none kept
        os.close(fd)
    finally:
        a.close()
        b.close()


@pytest.mark.parametrize(
    ("offset", "shape", "dtype"),
    [
        (0, (3, 4), torch.float32),
        (512, (3, 2), torch.int64),
        (1024, (0, 5), torch.bfloat16),
        (2048, (7,), torch.float16),
        (0, (), torch.float32),
        (0, (2, 0, 3), torch.int32),
    ],
)
def test_mapped_view_matches_typed_view(offset: int, shape: tuple[int, ...], dtype: torch.dtype) -> None:
    """The worker's one-op view (a dtype reinterpretation cached per buffer) is typed_view's tensor: same bytes,
    place, shape and dtype, contiguous; an offered size that is not a multiple of the dtype still maps."""
    raw = torch.arange(4001, dtype=torch.int64).to(torch.uint8)
    mapped = _placed.MappedBuffer(1, 4001, raw, lambda: None)
    got, want = mapped.view(offset, shape, dtype), _placed.typed_view(raw, offset, shape, dtype)
    assert (got.shape, got.dtype, got.is_contiguous()) == (want.shape, want.dtype, True)
    assert got.numel() == 0 or got.data_ptr() == want.data_ptr()
    assert torch.equal(got, want)
    got.fill_(0)  # writes through to the buffer
    assert torch.equal(_placed.typed_view(raw, offset, shape, dtype), got)
