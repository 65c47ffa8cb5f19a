"""Product code never imports the benchmarks: nothing under ``src/tensorwire`` outside ``tensorwire/bench`` imports
``tensorwire.bench`` (what the CLI measures and prints lives in ``tensorwire.cli``)."""

from __future__ import annotations

import ast
from pathlib import Path

SRC = Path(__file__).resolve().parents[2] / "src" / "tensorwire"


def _imports_bench(tree: ast.AST) -> list[int]:
    lines = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
        else:
            continue
        if any(n == "tensorwire.bench" or n.startswith("tensorwire.bench.") for n in names):
            lines.append(node.lineno)
    return lines


def test_no_module_outside_bench_imports_tensorwire_bench() -> None:
    offenders = []
    for path in sorted(SRC.rglob("*.py")):
        if (SRC / "bench") in path.parents:
            continue
        for line in _imports_bench(ast.parse(path.read_text(), str(path))):
            offenders.append(f"{path.relative_to(SRC.parent)}:{line}")
    assert not offenders, offenders


def test_the_walk_sees_every_import_form() -> None:
    for source in (
        "import tensorwire.bench._common",
        "from tensorwire.bench import _common",
        "from tensorwire import bench",
        "def f():\n    from tensorwire.bench._e2e import measure\n",
    ):
        assert _imports_bench(ast.parse(source)), source
    assert not _imports_bench(ast.parse("from tensorwire.benchmarks import x\nimport tensorwire.cli"))
