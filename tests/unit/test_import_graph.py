"""The import graph of ``src/tensorwire``, read with ``ast``: no circles, and the two ends of ``mm`` apart.

Every import counts, wherever it is written: at module level, inside a function (lazy), and under
``if TYPE_CHECKING:``. A circle hidden in a function or a type hint is still a circle a reader has to hold in
their head. ``from pkg import name`` counts as an import of ``pkg.name`` when that is a module, else of ``pkg`` (its
``__init__``). The parents that Python runs on the way (``a/__init__`` before ``a.b``) are not edges: a package
that re-exports its public names would otherwise sit in a circle with every module below it.
"""

from __future__ import annotations

import ast
from pathlib import Path

SRC = Path(__file__).resolve().parents[2] / "src"
PACKAGE = "tensorwire"


def _modules() -> dict[str, Path]:
    found: dict[str, Path] = {}
    for path in sorted((SRC / PACKAGE).rglob("*.py")):
        parts = list(path.relative_to(SRC).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        found[".".join(parts)] = path
    return found


def _is_package(name: str, modules: dict[str, Path]) -> bool:
    return modules[name].name == "__init__.py"


def _resolve(importer: str, node: ast.ImportFrom, modules: dict[str, Path]) -> str | None:
    if not node.level:
        return node.module
    base = importer.split(".")
    if not _is_package(importer, modules):
        base = base[:-1]
    base = base[: len(base) - (node.level - 1)]
    return ".".join(base + ([node.module] if node.module else []))


def import_graph() -> dict[str, set[str]]:
    """module -> the tensorwire modules it imports (every import statement, lazy and TYPE_CHECKING ones too)."""
    modules = _modules()
    graph: dict[str, set[str]] = {name: set() for name in modules}
    for name, path in modules.items():
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), str(path))):
            targets: list[str] = []
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = _resolve(name, node, modules)
                if base is None:
                    continue
                for alias in node.names:
                    sub = f"{base}.{alias.name}"
                    targets.append(sub if sub in modules else base)
            for target in targets:
                if target in modules and target != name:
                    graph[name].add(target)
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One circle as a list of modules (first == last), or None."""
    state: dict[str, int] = {}  # 1: on the path, 2: done
    stack: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        stack.append(node)
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                return stack[stack.index(nxt) :] + [nxt]
            if nxt not in state and (found := visit(nxt)) is not None:
                return found
        stack.pop()
        state[node] = 2
        return None

    for start in sorted(graph):
        if start not in state and (found := visit(start)) is not None:
            return found
    return None


def test_the_graph_sees_lazy_and_type_checking_imports() -> None:
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}}
    assert find_cycle(graph) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) is None
    real = import_graph()
    assert "tensorwire.errors" in real["tensorwire.rdma._config"]
    assert len(real) > 100


def test_no_import_circles() -> None:
    cycle = find_cycle(import_graph())
    assert cycle is None, "import circle: " + " -> ".join(cycle or ())


def _imports_under(graph: dict[str, set[str]], src: str, dst: str) -> list[str]:
    return sorted(f"{m} -> {t}" for m, ts in graph.items() if m.startswith(src) for t in ts if t.startswith(dst))


def test_client_and_server_never_import_each_other() -> None:
    graph = import_graph()
    client, server = "tensorwire.mm.client", "tensorwire.mm.server"
    assert _imports_under(graph, client, server) == []
    assert _imports_under(graph, server, client) == []


def test_shared_kits_sit_below_mm_and_tp_never_imports_mm() -> None:
    graph = import_graph()
    for kit in ("tensorwire._grpc", "tensorwire._local"):
        assert _imports_under(graph, kit, "tensorwire.mm") == []
        assert _imports_under(graph, kit, "tensorwire.service") == []
    assert _imports_under(graph, "tensorwire.tp", "tensorwire.mm") == []
    assert _imports_under(graph, "tensorwire.rdma", "tensorwire.mm") == []
