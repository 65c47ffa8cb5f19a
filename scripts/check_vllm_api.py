#!/usr/bin/env python3
"""Record the part of vLLM's API that tensorwire's encoder-cache connector uses, from vLLM's source, without
importing vLLM (a wheel installed with ``--no-deps``, or an unpacked one, is enough).

    python scripts/check_vllm_api.py record [--vllm DIR] [--out FILE]   # write the surface as JSON
    python scripts/check_vllm_api.py diff OLD.json [--vllm DIR | NEW.json]  # what changed between two surfaces

``DIR`` is the ``vllm`` package directory (default: where ``importlib.util.find_spec("vllm")`` finds it, which
does not run vLLM's ``__init__``). The surface lists, for the modules and names in ``WANTED``: each class's
bases, fields (class-level annotations), enum members, attributes its ``__init__`` sets, and its methods'
signatures with their decorators (``abstractmethod``, ``property``); each function's signature; and
``hook_calls``: for every ``ECConnectorBase`` method, the functions in ``vllm/v1`` that call it on an
``ec_connector``. ``tests/unit/integrations/test_vllm_api_surface.py`` checks the connector against every
recorded surface under ``tests/unit/integrations/vllm_api/``; record a new vLLM release there to verify it.
"""

from __future__ import annotations

import argparse
import ast
import hashlib
import importlib.util
import json
import sys
from pathlib import Path
from typing import Any

BASE_MODULE = "vllm.distributed.ec_transfer.ec_connector.base"
# module -> the names in it that tensorwire's connector (or tensorwire.bench.vllm_engine.instance, the instance
# of its tests and benchmark) uses.
WANTED: dict[str, tuple[str, ...]] = {
    BASE_MODULE: ("ECConnectorBase", "ECConnectorMetadata", "ECConnectorRole"),
    "vllm.distributed.ec_transfer.ec_connector.utils": ("PlaceholderMetadataResolver", "collect_ec_item_metadata"),
    "vllm.config.ec_transfer": ("ECTransferConfig",),
    "vllm.config.parallel": ("ParallelConfig",),
    "vllm.config.model": ("ModelConfig",),
    "vllm.config.vllm": ("VllmConfig",),
    "vllm.config": ("VllmConfig",),
    "vllm.v1.request": ("Request", "RequestStatus"),
    "vllm.v1.core.sched.output": ("SchedulerOutput", "NewRequestData"),
    "vllm.multimodal.inputs": ("MultiModalFeatureSpec", "PlaceholderRange"),
    "vllm.distributed.parallel_state": ("get_pp_group", "get_tensor_model_parallel_rank"),
    "vllm.platforms": ("current_platform",),
}
_SCAN_CALLS = ("v1",)
# Modules whose functions' and methods' bodies are fingerprinted too (a default hook or a helper tensorwire calls
# can change behaviour without changing its signature).
_BODIES = ("vllm.distributed.ec_transfer.",)


def find_vllm() -> Path:
    spec = importlib.util.find_spec("vllm")
    if spec is None or not spec.submodule_search_locations:
        raise SystemExit("vLLM is not installed here (pass --vllm DIR: the vllm package directory)")
    return Path(next(iter(spec.submodule_search_locations)))


def vllm_version(root: Path) -> str:
    for name in ("_version.py", "version.py"):
        path = root / name
        if not path.exists():
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Assign) and any(
                isinstance(t, ast.Name) and t.id == "__version__" for t in node.targets
            ):
                if isinstance(node.value, ast.Constant) and isinstance(node.value.value, str):
                    return node.value.value
    return "unknown"


def _module_path(root: Path, module: str) -> Path | None:
    rel = Path(*module.split(".")[1:])
    for cand in (root / rel.with_suffix(".py"), root / rel / "__init__.py"):
        if cand.exists():
            return cand
    return None


def signature(fn: ast.FunctionDef | ast.AsyncFunctionDef) -> str:
    """``(a, b=1, *args, c, **kw)``: names, defaults as written, no annotations (they move for typing only)."""
    a = fn.args
    parts: list[str] = []
    positional = [*a.posonlyargs, *a.args]
    defaults: list[ast.expr | None] = [None] * (len(positional) - len(a.defaults)) + list(a.defaults)
    for i, (arg, d) in enumerate(zip(positional, defaults, strict=True)):
        parts.append(arg.arg if d is None else f"{arg.arg}={ast.unparse(d)}")
        if a.posonlyargs and i == len(a.posonlyargs) - 1:
            parts.append("/")
    if a.vararg is not None:
        parts.append(f"*{a.vararg.arg}")
    elif a.kwonlyargs:
        parts.append("*")
    for arg, kd in zip(a.kwonlyargs, a.kw_defaults, strict=True):
        parts.append(arg.arg if kd is None else f"{arg.arg}={ast.unparse(kd)}")
    if a.kwarg is not None:
        parts.append(f"**{a.kwarg.arg}")
    return "(" + ", ".join(parts) + ")"


def body_hash(fn: ast.FunctionDef | ast.AsyncFunctionDef) -> str:
    body = fn.body
    if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant):
        body = body[1:]  # the docstring
    return hashlib.sha256("\n".join(ast.dump(n) for n in body).encode()).hexdigest()[:16]


def _decorators(fn: ast.FunctionDef | ast.AsyncFunctionDef) -> list[str]:
    out = []
    for d in fn.decorator_list:
        target = d.func if isinstance(d, ast.Call) else d
        out.append(ast.unparse(target).rsplit(".", 1)[-1])
    return out


def describe_class(cls: ast.ClassDef, bodies: bool = False) -> dict[str, Any]:
    fields: list[str] = []
    members: list[str] = []
    methods: dict[str, dict[str, Any]] = {}
    attributes: set[str] = set()
    for node in cls.body:
        if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            fields.append(node.target.id)
        elif isinstance(node, ast.Assign):
            members.extend(t.id for t in node.targets if isinstance(t, ast.Name) and not t.id.startswith("_"))
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            methods[node.name] = {"signature": signature(node), "decorators": _decorators(node)}
            if bodies:
                methods[node.name]["body"] = body_hash(node)
            if node.name in ("__init__", "__post_init__"):
                for sub in ast.walk(node):
                    targets = (
                        sub.targets
                        if isinstance(sub, ast.Assign)
                        else [sub.target]
                        if isinstance(sub, (ast.AnnAssign, ast.AugAssign))
                        else []
                    )
                    for t in targets:
                        if isinstance(t, ast.Attribute) and isinstance(t.value, ast.Name) and t.value.id == "self":
                            attributes.add(t.attr)
    return {
        "bases": [ast.unparse(b) for b in cls.bases],
        "fields": fields,
        "members": members,
        "attributes": sorted(attributes),
        "methods": methods,
    }


def describe_module(path: Path, names: tuple[str, ...], bodies: bool = False) -> dict[str, Any]:
    text = path.read_text()
    tree = ast.parse(text)
    out: dict[str, Any] = {}
    for node in tree.body:
        name = getattr(node, "name", None)
        if isinstance(node, ast.ClassDef) and name in names:
            out[name] = {"kind": "class", **describe_class(node, bodies)}
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and name in names:
            out[name] = {"kind": "function", "signature": signature(node)}
            if bodies:
                out[name]["body"] = body_hash(node)
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            for t in targets:
                if isinstance(t, ast.Name) and t.id in names:
                    out[t.id] = {"kind": "variable"}
        elif isinstance(node, ast.ImportFrom):  # re-exports (vllm.config: from .vllm import VllmConfig)
            for alias in node.names:
                if (alias.asname or alias.name) in names and (alias.asname or alias.name) not in out:
                    out[alias.asname or alias.name] = {"kind": "import", "from": f"{'.' * node.level}{node.module}"}
    for name in names:  # a module-level __getattr__ that builds it on first use (vllm.platforms.current_platform)
        if name not in out and f'"{name}"' in text and "def __getattr__" in text:
            out[name] = {"kind": "lazy"}
    return out


def hook_calls(root: Path, hooks: set[str]) -> dict[str, list[str]]:
    """For every hook name, ``file:Class.function`` of each call ``<...ec_connector...>.<hook>(...)``."""
    calls: dict[str, set[str]] = {h: set() for h in hooks}
    for sub in _SCAN_CALLS:
        for path in sorted((root / sub).rglob("*.py")):
            rel = path.relative_to(root.parent).as_posix()
            try:
                tree = ast.parse(path.read_text())
            except SyntaxError:
                continue

            def visit(node: ast.AST, scope: list[str], rel: str = rel) -> None:
                for child in ast.iter_child_nodes(node):
                    if isinstance(child, (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
                        visit(child, [*scope, child.name])
                        continue
                    if (
                        isinstance(child, ast.Call)
                        and isinstance(child.func, ast.Attribute)
                        and child.func.attr in hooks
                        and "ec_connector" in ast.unparse(child.func.value)
                    ):
                        calls[child.func.attr].add(f"{rel}:{'.'.join(scope) or '<module>'}")
                    visit(child, scope)

            visit(tree, [])
    return {h: sorted(v) for h, v in sorted(calls.items())}


def record(root: Path) -> dict[str, Any]:
    modules: dict[str, Any] = {}
    for module, names in WANTED.items():
        path = _module_path(root, module)
        modules[module] = describe_module(path, names, module.startswith(_BODIES)) if path is not None else {}
    base = modules[BASE_MODULE].get("ECConnectorBase", {})
    hooks = {m for m in base.get("methods", {}) if not m.startswith("__")}
    return {
        "vllm_version": vllm_version(root),
        "source": "AST of the vllm package (not imported)",
        "modules": modules,
        "hook_calls": hook_calls(root, hooks),
    }


def diff(old: dict[str, Any], new: dict[str, Any]) -> list[str]:
    out: list[str] = []

    def walk(a: Any, b: Any, path: str) -> None:
        if isinstance(a, dict) and isinstance(b, dict):
            for k in sorted(set(a) | set(b)):
                if k not in b:
                    out.append(f"- {path}{k}")
                elif k not in a:
                    out.append(f"+ {path}{k}: {json.dumps(b[k])[:160]}")
                else:
                    walk(a[k], b[k], f"{path}{k}.")
        elif a != b:
            out.append(f"~ {path.rstrip('.')}: {json.dumps(a)[:160]} -> {json.dumps(b)[:160]}")

    walk(
        {k: v for k, v in old.items() if k != "vllm_version"}, {k: v for k, v in new.items() if k != "vllm_version"}, ""
    )
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    sub = ap.add_subparsers(dest="cmd", required=True)
    rec = sub.add_parser("record")
    rec.add_argument("--vllm", type=Path, help="the vllm package directory (default: the installed one)")
    rec.add_argument("--out", type=Path, help="write here (default: stdout)")
    dif = sub.add_parser("diff")
    dif.add_argument("old", type=Path)
    dif.add_argument("new", type=Path, nargs="?", help="a recorded surface (default: record --vllm now)")
    dif.add_argument("--vllm", type=Path)
    args = ap.parse_args(argv)
    if args.cmd == "record":
        surface = record(args.vllm or find_vllm())
        text = json.dumps(surface, indent=1, sort_keys=True) + "\n"
        if args.out:
            args.out.write_text(text)
            print(f"recorded vLLM {surface['vllm_version']} into {args.out}", file=sys.stderr)
        else:
            sys.stdout.write(text)
        return 0
    old = json.loads(args.old.read_text())
    new = json.loads(args.new.read_text()) if args.new else record(args.vllm or find_vllm())
    changes = diff(old, new)
    print(f"vLLM {old['vllm_version']} -> {new['vllm_version']}: {len(changes)} change(s)")
    for line in changes:
        print(line)
    return 1 if changes else 0


if __name__ == "__main__":
    sys.exit(main())
