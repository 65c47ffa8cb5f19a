"""The connector against the API of every verified vLLM release, without vLLM: recorded surfaces
(``vllm_api/<version>.json``, written by ``scripts/check_vllm_api.py record`` from that release's source) and the
connector's own source, both read as ASTs.

A release counts as verified for the API when every check here passes against its surface; the version gate
(``_vllm_ec/version.py``) must cover exactly the recorded releases. Engines run only on the releases docs/vllm.md
says (the API surface cannot show a changed call order or a hook that stopped being called at the same point).
"""

from __future__ import annotations

import ast
import importlib.util
import json
from pathlib import Path
from typing import Any

import pytest

from tensorwire.integrations._vllm_ec import version

ROOT = Path(__file__).resolve().parents[3]
CONNECTOR = ROOT / "src" / "tensorwire" / "integrations" / "vllm.py"
SURFACES = sorted((Path(__file__).resolve().parent / "vllm_api").glob("*.json"))
BASE = "vllm.distributed.ec_transfer.ec_connector.base"

# What the connector reads from vLLM objects, by (module, class): each name must be a field, enum member,
# attribute set in __init__, or method of that class in every verified release.
USES: dict[tuple[str, str], tuple[str, ...]] = {
    ("vllm.config.vllm", "VllmConfig"): ("ec_transfer_config", "parallel_config", "model_config"),
    ("vllm.config.ec_transfer", "ECTransferConfig"): (
        "ec_connector_extra_config",
        "engine_id",
        "mm_encoder_output_widths",
    ),
    ("vllm.config.parallel", "ParallelConfig"): (
        "distributed_executor_backend",
        "pipeline_parallel_size",
        "tensor_parallel_size",
        "data_parallel_rank",
        "nnodes",
        "prefill_context_parallel_size",
    ),
    ("vllm.config.model", "ModelConfig"): ("model", "dtype", "revision", "quantization"),
    ("vllm.v1.request", "Request"): ("request_id", "mm_features", "ec_transfer_params", "status"),
    ("vllm.v1.request", "RequestStatus"): ("FINISHED_ABORTED", "FINISHED_IGNORED", "FINISHED_ERROR"),
    ("vllm.v1.core.sched.output", "SchedulerOutput"): ("scheduled_new_reqs",),
    ("vllm.v1.core.sched.output", "NewRequestData"): ("req_id", "mm_features"),
    ("vllm.multimodal.inputs", "MultiModalFeatureSpec"): ("identifier", "mm_position", "modality", "data"),
    ("vllm.multimodal.inputs", "PlaceholderRange"): ("offset", "length", "get_num_embeds"),
    (BASE, "ECConnectorBase"): ("is_producer", "is_consumer", "_get_connector_metadata", "role"),
    (BASE, "ECConnectorRole"): ("SCHEDULER", "WORKER"),
    ("vllm.distributed.ec_transfer.ec_connector.utils", "PlaceholderMetadataResolver"): ("fields_for",),
}
# Calls into vLLM functions and constructors, by (module, name): the arguments the connector passes.
CALLS: dict[tuple[str, str], str] = {
    ("vllm.distributed.ec_transfer.ec_connector.utils", "collect_ec_item_metadata"): "(mm_features, resolver)",
    ("vllm.distributed.parallel_state", "get_tensor_model_parallel_rank"): "()",
    ("vllm.distributed.parallel_state", "get_pp_group"): "()",
}


def _script() -> Any:
    spec = importlib.util.spec_from_file_location("check_vllm_api", ROOT / "scripts" / "check_vllm_api.py")
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _connector() -> ast.ClassDef:
    tree = ast.parse(CONNECTOR.read_text())
    (cls,) = [n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "TensorwireECConnector"]
    return cls


def _imports() -> set[tuple[str, str]]:
    """Every ``from vllm... import name`` in the connector module, at any depth (lazy imports included)."""
    out = set()
    for node in ast.walk(ast.parse(CONNECTOR.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] == "vllm":
            out.update((node.module, a.name) for a in node.names)
    return out


def _params(sig: str) -> list[str]:
    inner = sig.strip()[1:-1]
    return [p.split("=")[0].strip() for p in inner.split(",") if p.strip()] if inner else []


def _load(path: Path) -> dict[str, Any]:
    return dict(json.loads(path.read_text()))


def test_surfaces_are_recorded_for_the_gated_range() -> None:
    versions = [version.parse_version(_load(p)["vllm_version"]) for p in SURFACES]
    assert versions and None not in versions
    assert [p.stem for p in SURFACES] == [_load(p)["vllm_version"] for p in SURFACES]
    found = sorted(v for v in versions if v is not None)
    # the gate opens exactly the minor releases recorded here, from the oldest to the newest
    assert version.TESTED_MIN == found[0], (version.TESTED_MIN, found)
    assert version.TESTED_MAX == (found[-1][0], found[-1][1] + 1, 0), (version.TESTED_MAX, found)
    minors = {(v[0], v[1]) for v in found}
    assert all((0, m) in minors for m in range(found[0][1], found[-1][1] + 1)), minors
    for v in found:
        version.check_version(".".join(map(str, v)), {})


@pytest.mark.parametrize("surface_path", SURFACES, ids=[p.stem for p in SURFACES])
def test_connector_overrides_match_the_base_class(surface_path: Path) -> None:
    surface = _load(surface_path)
    base = surface["modules"][BASE]["ECConnectorBase"]["methods"]
    ours = {n.name: n for n in _connector().body if isinstance(n, ast.FunctionDef)}
    signature = _script().signature
    missing = sorted(m for m, d in base.items() if "abstractmethod" in d["decorators"] and m not in ours)
    assert not missing, f"vLLM {surface['vllm_version']}: abstract hooks not implemented: {missing}"
    for name, fn in ours.items():
        if name.startswith("_") and name != "__init__":
            continue  # helpers of our own
        assert name in base, (
            f"vLLM {surface['vllm_version']} has no ECConnectorBase.{name}: the override is never called"
        )
        theirs, mine = _params(base[name]["signature"]), _params(signature(fn))
        fixed = [p for p in theirs if not p.startswith("*")]
        assert mine[: len(fixed)] == fixed, f"{name}{signature(fn)} does not take vLLM's {base[name]['signature']}"
        extra = [p for p in mine[len(fixed) :] if not p.startswith("*")]
        assert not extra, f"{name}: parameters {extra} that vLLM {surface['vllm_version']} does not pass"
        if any(p.startswith("**") for p in theirs):
            assert any(p.startswith("**") for p in mine), f"{name} must take **kwargs as vLLM's does"
        if name != "__init__":
            assert surface["hook_calls"].get(name), f"vLLM {surface['vllm_version']} never calls {name}"


@pytest.mark.parametrize("surface_path", SURFACES, ids=[p.stem for p in SURFACES])
def test_every_vllm_name_the_connector_uses_exists(surface_path: Path) -> None:
    surface = _load(surface_path)
    modules = surface["modules"]
    for module, name in sorted(_imports()):
        assert module in modules, f"{module} is not recorded: add it to WANTED in scripts/check_vllm_api.py"
        assert name in modules[module], f"vLLM {surface['vllm_version']}: {module} has no {name}"
    for (module, cls), names in USES.items():
        c = modules[module][cls]
        have = set(c["fields"]) | set(c["members"]) | set(c["attributes"]) | set(c["methods"])
        gone = [n for n in names if n not in have]
        assert not gone, f"vLLM {surface['vllm_version']}: {cls} has no {gone}"
    for (module, name), passed in CALLS.items():
        theirs = _params(modules[module][name]["signature"])
        assert theirs == _params(passed), f"vLLM {surface['vllm_version']}: {name}{modules[module][name]['signature']}"
    resolver = modules["vllm.distributed.ec_transfer.ec_connector.utils"]["PlaceholderMetadataResolver"]
    assert _params(resolver["methods"]["__init__"]["signature"]) == ["self", "model_config"]


def test_recorder_reads_signatures_as_the_connector_declares_them() -> None:
    sig = _script().signature
    fn = ast.parse("def f(self, a, b=1, *args, c, d=2, **kw): pass").body[0]
    assert isinstance(fn, ast.FunctionDef)
    assert sig(fn) == "(self, a, b=1, *args, c, d=2, **kw)"
    ours = {n.name: n for n in _connector().body if isinstance(n, ast.FunctionDef)}
    assert sig(ours["save_caches"]) == "(self, encoder_cache, mm_hash, **kwargs)"
