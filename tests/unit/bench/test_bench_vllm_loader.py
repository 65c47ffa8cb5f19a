"""Finding and loading vLLM's shm_broadcast.py for ``bench broadcast``: sources, stand-ins, refusals, the real file."""

from __future__ import annotations

import base64
import hashlib
import os
import sys
import zipfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from tensorwire.bench._vllm import loader
from tensorwire.bench._vllm.loader import VllmSource, VllmUnavailable

pytestmark = pytest.mark.timeout(240)
# A real vllm, not pytest's tests/ on sys.path making tests/vllm/ a namespace package "vllm" (that skipped the
# tests below in every run).
VLLM_INSTALLED = loader._importable("vllm")

# What vLLM 0.32/0.33's file imports from vllm.* at module level, plus what it defines that the bench uses.
FAKE = b"""
import vllm.envs as envs
from vllm.distributed.utils import StatelessProcessGroup, sched_yield
from vllm.logger import init_logger
from vllm.platforms import current_platform
from vllm.utils.cpu_resource_utils import check_cgroup_memory_available
from vllm.utils.network_utils import (get_ip, get_open_zmq_inproc_path, get_open_zmq_ipc_path,
                                      is_valid_ipv6_address)
from dataclasses import dataclass
WARN = envs.VLLM_RINGBUFFER_WARNING_INTERVAL
SPIN = envs.VLLM_USE_SPINLOOP_EXT
IPC = get_open_zmq_ipc_path()
logger = init_logger(__name__)
sched_yield()
check_cgroup_memory_available(1 << 20, "ring")
@dataclass
class Handle:
    addr: str = ""
class MessageQueue:
    pass
"""


@pytest.fixture(autouse=True)
def _no_vllm_modules_left() -> Iterator[None]:
    before = set(sys.modules)
    yield
    for name in set(sys.modules) - before:
        if name == "vllm" or name.startswith("vllm."):
            del sys.modules[name]


def _wheel(path: Path, member_bytes: bytes, record_bytes: bytes | None = None) -> Path:
    digest = base64.urlsafe_b64encode(hashlib.sha256(record_bytes or member_bytes).digest()).rstrip(b"=").decode()
    with zipfile.ZipFile(path, "w") as zf:
        zf.writestr(loader.MEMBER, member_bytes)
        zf.writestr("vllm-9.8.7.dist-info/RECORD", f"{loader.MEMBER},sha256={digest},{len(member_bytes)}\n")
    return path


def test_an_explicit_path_must_exist_and_be_a_file_or_wheel(tmp_path: Path) -> None:
    with pytest.raises(VllmUnavailable, match="no such file"):
        loader.locate(str(tmp_path / "missing.py"))
    (tmp_path / "x.txt").write_text("")
    with pytest.raises(VllmUnavailable, match="expected a .py file or a vllm .whl"):
        loader.locate(str(tmp_path / "x.txt"))
    with zipfile.ZipFile(tmp_path / "other.whl", "w") as zf:
        zf.writestr("other/__init__.py", "")
    with pytest.raises(VllmUnavailable, match="the wheel has no vllm/distributed"):
        loader.locate(str(tmp_path / "other.whl"))


@pytest.mark.skipif(VLLM_INSTALLED, reason="vllm is installed here, so it is always found")
def test_nothing_to_load_says_what_was_tried_and_how_to_fix_it(tmp_path: Path) -> None:
    with pytest.raises(VllmUnavailable) as info:
        loader.locate(None, search_dir=tmp_path)
    assert "vllm is not installed" in info.value.reason and "pip download vllm" in info.value.reason


@pytest.mark.skipif(VLLM_INSTALLED, reason="an installed vllm wins over the search folder")
def test_the_search_folder_prefers_the_extracted_file_then_the_newest_name(tmp_path: Path) -> None:
    _wheel(tmp_path / "vllm-0.99.0-cp38-abi3-manylinux_2_28_x86_64.whl", FAKE)
    (tmp_path / "vllm-0.32.0-shm_broadcast.py").write_bytes(FAKE)
    (tmp_path / "vllm-0.33.0-shm_broadcast.py").write_bytes(FAKE)
    newest = str(tmp_path / "vllm-0.33.0-shm_broadcast.py")
    assert loader.locate(None, search_dir=tmp_path) == VllmSource("file", newest)
    for p in tmp_path.glob("*.py"):
        p.unlink()
    assert loader.locate(None, search_dir=tmp_path).kind == "wheel"


@pytest.mark.skipif(VLLM_INSTALLED, reason="the stand-ins are used only without vllm")
def test_the_stand_ins_provide_every_name_the_file_imports(tmp_path: Path) -> None:
    path = tmp_path / "vllm-0.33.0-shm_broadcast.py"
    path.write_bytes(FAKE)
    mod, info = loader.load(loader.locate(str(path)))
    assert info["version"] == "0.33.0" and info["sha256"] == hashlib.sha256(FAKE).hexdigest()
    assert "vllm.envs" in info["shims"] and "vllm.utils.network_utils" in info["shims"]
    assert mod.WARN == 60 and mod.SPIN is False and mod.IPC.startswith("ipc://")
    assert sys.modules[loader.MODULE] is mod and mod.Handle.__module__ == loader.MODULE


@pytest.mark.skipif(VLLM_INSTALLED, reason="the stand-ins are used only without vllm")
def test_the_environment_reaches_the_stand_in_envs(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("VLLM_RINGBUFFER_WARNING_INTERVAL", "7")
    monkeypatch.setenv("VLLM_RPC_BASE_PATH", str(tmp_path))
    path = tmp_path / "shm_broadcast.py"
    path.write_bytes(FAKE)
    mod, info = loader.load(loader.locate(str(path)))
    assert mod.WARN == 7 and mod.IPC.startswith(f"ipc://{tmp_path}/") and info["version"] is None


@pytest.mark.skipif(VLLM_INSTALLED, reason="the stand-ins are used only without vllm")
def test_a_name_the_stand_ins_lack_is_reported(tmp_path: Path) -> None:
    path = tmp_path / "shm_broadcast.py"
    path.write_bytes(b"from vllm.utils.network_utils import get_brand_new_thing\n")
    with pytest.raises(VllmUnavailable, match="shims.py"):
        loader.load(loader.locate(str(path)))
    assert loader.MODULE not in sys.modules  # a failed load leaves nothing half-built behind


@pytest.mark.skipif(VLLM_INSTALLED, reason="the stand-ins are used only without vllm")
def test_a_wheel_member_runs_only_if_it_matches_the_wheels_record(tmp_path: Path) -> None:
    good = _wheel(tmp_path / "vllm-9.8.7-cp38-abi3-manylinux_2_28_x86_64.whl", FAKE)
    _, info = loader.load(loader.locate(str(good)))
    assert info["wheel_record_matches"] is True and info["version"] == "9.8.7"
    bad = _wheel(tmp_path / "vllm-9.8.8-cp38-abi3-manylinux_2_28_x86_64.whl", FAKE + b"# edited\n", FAKE)
    with pytest.raises(VllmUnavailable, match="does not match the wheel's RECORD"):
        loader.load(loader.locate(str(bad)))


def _real_source() -> VllmSource:
    """The real file: $TENSORWIRE_BENCH_VLLM_SHM_BROADCAST, an installed vllm, or the checkout's .whl/."""
    repo = Path(__file__).resolve().parents[3]
    try:
        return loader.locate(os.environ.get("TENSORWIRE_BENCH_VLLM_SHM_BROADCAST"), search_dir=repo / ".whl")
    except VllmUnavailable as exc:
        pytest.skip(f"vLLM's shm_broadcast.py is not available: {exc.reason}")


def test_the_real_message_queue_carries_every_case_between_processes() -> None:
    source = _real_source()
    try:
        _, info = loader.load(source)
    except VllmUnavailable as exc:
        pytest.skip(f"{source.describe()} cannot be loaded here: {exc.reason}")
    from tensorwire.bench import broadcast
    from tensorwire.bench._payloads import Case
    from tensorwire.bench._tp import backends

    cases = [Case("tensor", 1024), Case("tensor", 1 << 20), Case("dict"), Case("sched"), Case("sched", 0, 1.0)]
    res = broadcast.run_group(
        2, "vllm", cases, [3] * len(cases), 1, 0.2, timeout_s=180, opts=backends.Options(vllm_source=source)
    )
    assert info["sha256"] and all(len(res[0]["lat"][c.name]) == 3 for c in cases)
    assert all(0 <= res[1]["cpu"][c.name] <= 1.5 for c in cases)
