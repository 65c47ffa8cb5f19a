"""``python -m tensorwire.bench vllm_ec``: the item check, the file path's calls, the summaries, and whole runs at a
tiny size (real encoder and LLM processes, the connector's store, Fetcher and staging area; no vLLM)."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch

from tensorwire.bench import vllm_ec
from tensorwire.bench._plain_grpc import embedding
from tensorwire.bench._vllm import ec_paths as paths
from tensorwire.errors import ProtocolError, Reason
from tensorwire.mm.held._rpc import receipt_for
from tensorwire.mm.held._store import HeldStore

pytestmark = pytest.mark.timeout(240)
safetensors = pytest.importorskip("safetensors")

BASE = embedding(16, 64)


def test_only_the_item_itself_matches() -> None:
    item = paths.make_item(BASE, 7, 8)
    assert paths.matches(item, BASE, 7, 8)
    assert not paths.matches(paths.make_item(BASE, 6, 8), BASE, 7, 8)  # the previous item (stale)
    assert not paths.matches(torch.zeros_like(item), BASE, 7, 8)  # zeroed
    assert not paths.matches(item[:7], BASE, 7, 8)  # truncated
    assert not paths.matches(item, BASE, 7, 9)  # not the expected row count
    assert not paths.matches(item.float(), BASE, 7, 8)  # other dtype
    flipped = item.clone()
    flipped.view(torch.int16)[5, 3] ^= 1  # one bit, deep inside
    assert not paths.matches(flipped, BASE, 7, 8)


def test_the_file_path_makes_the_example_connectors_calls(tmp_path: Path) -> None:
    from safetensors.torch import load_file

    item = paths.make_item(BASE, 3, 8)
    paths.file_save(str(tmp_path), "abc", item)
    name = tmp_path / "abc" / "encoder_cache.safetensors"  # <root>/<mm_hash>/encoder_cache.safetensors
    assert list(load_file(str(name))) == ["ec_cache"]
    got = paths.file_load(str(tmp_path), "abc", "cpu")
    assert got is not None and paths.matches(got, BASE, 3, 8)
    assert paths.files_left(str(tmp_path)) == 1
    paths.file_remove(str(tmp_path), "abc")
    assert paths.files_left(str(tmp_path)) == 0 and not (tmp_path / "abc").exists()
    assert paths.file_load(str(tmp_path), "missing", "cpu") is None  # has_cache_item False


def test_the_staging_area_refuses_an_item_that_is_not_equal() -> None:
    area = paths.CheckedArea(BASE, "cpu", "none")
    with HeldStore(None) as store:  # inline receipts: the check, not the read, is under test here
        store.grant("good", b"s" * 16)
        store.hold("good", [paths.make_item(BASE, 4, 8)])
        store.grant("bad", b"s" * 16)
        store.hold("bad", [paths.make_item(BASE, 5, 8)])
        expect = paths.expect_for(8, 64)
        ok = receipt_for(store.lookup("good", b"s" * 16), rdma=False)
        assert area.stage(paths.staging_key(4, "good"), ok, timeout_ms=1000, expect=expect) == 8 * 64 * 2
        stale = receipt_for(store.lookup("bad", b"s" * 16), rdma=False)
        with pytest.raises(ProtocolError) as info:
            area.stage(paths.staging_key(4, "bad"), stale, timeout_ms=1000, expect=expect)
    assert info.value.reason is Reason.RESULT_MISMATCH
    assert area.keys() == [paths.staging_key(4, "good")] and area.checked == 1
    area.close()


def test_summaries() -> None:
    flat = vllm_ec.flatness([1.0] * 100 + [5.0] * 10 + [1.1] * 80 + [1.3] * 20)
    assert flat["window"] == 100 and flat["p90_first_ms"] == 1.0
    assert flat["p90_last_ms"] == 1.3 and flat["ratio_last_over_first"] == pytest.approx(1.3)
    by_path = {
        "tensorwire": {"total": {"median_ms": 2.0}, "staged": {"median_ms": 1.0}},
        "file_tmpfs": {"total": {"median_ms": 3.0}},
        "file_disk": {"total": {"median_ms": 8.0}},
    }
    assert vllm_ec.ratios_of(by_path) == {
        "file_tmpfs_over_tensorwire": 1.5,
        "file_tmpfs_over_tensorwire_staged": 3.0,
        "file_disk_over_tensorwire": 4.0,
        "file_disk_over_tensorwire_staged": 8.0,
    }
    sizes = [
        {"bytes": 1 << 20, "ratios": {"file_tmpfs_over_tensorwire": 0.9}},
        {"bytes": 10 << 20, "ratios": {"file_tmpfs_over_tensorwire": 1.4}},
    ]
    t = vllm_ec.targets_of(sizes, {"paths": {"tensorwire": {"flatness": flat}}}, {"clean": True}, cuda=False)
    assert t["speedup_vs_file_tmpfs_10MB"] == 1.4 and t["meets_speedup_10MB"]
    assert t["speedup_vs_file_tmpfs_100MB"] is None  # not measured: not claimed
    assert not t["meets_flat"] and t["meets_nothing_left"]
    assert t["speedup_vs_file_tmpfs_10MB_from"] == "sizes" and t["speedup_vs_file_tmpfs_10MB_series"] is None
    g = vllm_ec.targets_of(sizes, {}, {"clean": False}, cuda=True)
    assert not g["meets_speedup_10MB"] and g["target_speedup_10MB_min"] == 3.0 and not g["meets_speedup_100MB"]
    # A series at ~10 MB is the larger sample: its ratio is the target's, the 30-item one is kept beside it.
    series = {"bytes": 10 << 20, "ratios": {"file_tmpfs_over_tensorwire": 1.2}, "paths": {}}
    s = vllm_ec.targets_of(sizes, series, {"clean": True}, cuda=False)
    assert s["speedup_vs_file_tmpfs_10MB"] == 1.2 and not s["meets_speedup_10MB"]
    assert s["speedup_vs_file_tmpfs_10MB_from"] == "series" and s["speedup_vs_file_tmpfs_10MB_sizes"] == 1.4
    far = vllm_ec.targets_of(sizes, {**series, "bytes": 1 << 20}, {"clean": True}, cuda=False)
    assert far["speedup_vs_file_tmpfs_10MB"] == 1.4  # a 1 MB series says nothing about 10 MB


def _nixl() -> bool:
    try:
        import nixl  # noqa: F401
    except ImportError:
        return False
    return True


@pytest.mark.parametrize("stager", ["local", "remote"])
def test_a_tiny_run_hands_every_item_over_and_leaves_nothing(
    stager: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    shm, disk, out = tmp_path / "shm", tmp_path / "disk", tmp_path / "r.json"
    shm.mkdir()
    disk.mkdir()
    series = 12 if stager == "local" else 0
    rc = vllm_ec.main(
        [
            "--rows",
            "4",
            "16",
            "--cols",
            "64",
            "--iters",
            "3",
            "--warmup",
            "1",
            "--series",
            str(series),
            "--series-rows",
            "8",
            "--stager",
            stager,
            "--tmpfs-dir",
            str(shm),
            "--disk-dir",
            str(disk),
            "--out",
            str(out),
        ]
    )
    printed = capsys.readouterr().out
    assert rc == 0, printed
    doc = json.loads(out.read_text())
    assert doc["benchmark"] == "vllm-ec" and doc["stager"] == stager and "machine" in doc
    assert [s["bytes"] for s in doc["sizes"]] == [4 * 64 * 2, 16 * 64 * 2]
    for size in doc["sizes"]:
        for p in vllm_ec.PATHS:
            assert size["paths"][p]["total"]["n"] == 3
        assert size["ratios"]["file_tmpfs_over_tensorwire"] > 0
    left = doc["leftovers"]
    assert left["clean"] and doc["failures"] == [] and left["failures"] == 0
    assert left["files_left"] == {"file_tmpfs": 0, "file_disk": 0}
    for k in ("held_items", "grants", "pending_grants", "exporter_live_leases", "pool_busy_slots"):
        assert left["encoder_store"].get(k, 0) == 0, k
    tw_items = 2 * (1 + 3) + series  # warmup + timed per size, then the series
    assert left["releases"]["ok"] == tw_items  # every grant went back
    assert left["llm_staging"]["staged_items"] == 0 and left["llm_staging"]["checked"] == tw_items
    if _nixl():
        assert left["planes"] == {"rdma": tw_items} and doc["producer_plane"] == "rdma"
    if series:
        assert len(doc["series"]["paths"]["tensorwire"]["totals_ms"]) == series
        assert doc["series"]["paths"]["tensorwire"]["flatness"]["window"] == series // 2
        assert len(doc["series"]["paths"]["tensorwire"]["items_ms"]["lookup"]) == series
        assert "series" in printed and "left at the end" in printed
    assert os.listdir(shm) == [] and os.listdir(disk) == []  # the bench's directories are gone too


def test_bad_arguments_are_refused(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as info:
        vllm_ec.main(["--rows", "1"])
    assert info.value.code == 2 and "row counts >= 2" in capsys.readouterr().err
    if not torch.cuda.is_available():
        assert vllm_ec.main(["--device", "cuda:0"]) == 2
        assert "CUDA is not available" in capsys.readouterr().err
