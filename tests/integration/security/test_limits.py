"""Issue 15, deliverable 5 and findings 5 and 7: limits from configuration, enforced before the work.

Against a real ``serve-encoder`` (built-in ViT). Before issue 15 a worker accepted requests up to 2 GiB (a
256 MB request grew it by ~1 GB), decoded a 65 KB PNG declaring 8192x8192 (1.5 s, 325 MB), and kept encoding
every image of a request long after its caller's deadline had passed.
"""

from __future__ import annotations

import threading
import time
from pathlib import Path

import grpc
import pytest
from _sec import cpu_seconds, rss_bytes, serve

from tensorwire.encoder import sample_paths
from tensorwire.mm import wire
from tensorwire.testing import hostile


def _pid(child: object) -> int:
    return int(child.proc.pid)  # type: ignore[attr-defined]


@pytest.mark.timeout(300)
def test_oversized_requests_and_pixel_bombs_are_refused_before_the_work(tmp_path: Path) -> None:
    worker, ready = serve(tmp_path, "worker", "--port", "0", "--metrics-port", "-1")
    try:
        pid = _pid(worker)
        with hostile.channel(ready["grpc"]) as ch:
            hostile.encode_image(ch, sample_paths()[1].read_bytes(), timeout_s=120)  # warm: first forward done
            rss0 = rss_bytes(pid)
            # 200 MB, far over max_request_items x max_item_bytes (16 x 8 MiB): refused from its length prefix.
            payload = bytes(200 << 20)
            for _ in range(3):
                t0 = time.monotonic()
                assert hostile.oversized(ch, len(payload), payload=payload, timeout_s=60) == "RESOURCE_EXHAUSTED"
                assert time.monotonic() - t0 < 10.0
            # One item over max_item_bytes inside a request under the message limit: INVALID_ARGUMENT, named.
            raw = hostile.encode_request([bytes(9 << 20)])
            with pytest.raises(grpc.RpcError) as info:
                ch.unary_unary(wire.ENCODE_METHOD)(raw, timeout=60)
            assert info.value.code() is grpc.StatusCode.INVALID_ARGUMENT
            assert "max_item_bytes" in (info.value.details() or "")
            # 65 KB of PNG declaring 8192 x 8192: refused from its header, before a pixel is decoded.
            bomb = hostile.pixel_bomb_png(8192)
            assert len(bomb) < 200_000
            for _ in range(3):
                t0 = time.monotonic()
                with pytest.raises(grpc.RpcError) as info:
                    ch.unary_unary(wire.ENCODE_METHOD)(hostile.encode_request([bomb]), timeout=60)
                assert time.monotonic() - t0 < 1.0
                assert info.value.code() is grpc.StatusCode.INVALID_ARGUMENT
                assert "max_item_pixels" in (info.value.details() or "")
            # Twelve 3000 x 3000 images (each under the item budget) add up to more than the request's budget.
            twelve = hostile.encode_request([hostile.pixel_bomb_png(3000)] * 12)
            with pytest.raises(grpc.RpcError) as info:
                ch.unary_unary(wire.ENCODE_METHOD)(twelve, timeout=60)
            assert "max_request_pixels" in (info.value.details() or "")
            grown = rss_bytes(pid) - rss0
            assert grown < 150 << 20, f"the worker grew by {grown >> 20} MiB"
    finally:
        worker.terminate(grace_s=5)


@pytest.mark.timeout(300)
def test_work_stops_when_the_caller_gives_up(tmp_path: Path) -> None:
    worker, ready = serve(tmp_path, "worker", "--port", "0", "--metrics-port", "-1")
    try:
        pid = _pid(worker)
        scene = sample_paths()[-1].read_bytes()  # 2048 x 1365: the slowest sample to encode
        heavy = hostile.encode_request([scene] * 16)
        with hostile.channel(ready["grpc"]) as ch:
            t0 = time.monotonic()
            hostile.encode_image(ch, scene, timeout_s=120)  # warm, and one image's time on this machine
            one_image_s = time.monotonic() - t0
            calls = []
            for _ in range(4):
                calls.append(ch.unary_unary(wire.ENCODE_METHOD).future(heavy, timeout=1.0))
            for call in calls:
                with pytest.raises(grpc.RpcError) as info:
                    call.result(timeout=60)
                assert info.value.code() is grpc.StatusCode.DEADLINE_EXCEEDED
            # Each request stops at the image it is on; nothing keeps running for the 4 x 15 images left.
            gone = time.monotonic()
            settle_s = 2 * one_image_s + 2.0
            time.sleep(settle_s)  # let the images in progress finish (bounded by one image each)
            cpu0 = cpu_seconds(pid)
            window = threading.Event()
            window.wait(3.0)
            burned = cpu_seconds(pid) - cpu0
            assert burned < 0.6, (
                f"the worker used {burned:.2f} CPU-s in 3 s, {time.monotonic() - gone:.0f} s "
                "after every caller had gone"
            )
            t0 = time.monotonic()
            hostile.encode_image(ch, scene, timeout_s=120)
            assert time.monotonic() - t0 < 3 * one_image_s + 5.0  # a normal request is not queued behind them
    finally:
        worker.terminate(grace_s=5)
