"""The package's shape (DEVELOPERS.md, "Design we want to live in"): no import circle,
function-level imports included; no module over 380 lines, no class over 260."""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "vllm_lookahead"
MAX_MODULE_LINES = 380
MAX_CLASS_LINES = 260


def _modules() -> dict[str, ast.Module]:
    modules = {}
    for path in PACKAGE.rglob("*.py"):
        name = ".".join(path.relative_to(PACKAGE.parent).with_suffix("").parts)
        modules[name.removesuffix(".__init__")] = ast.parse(path.read_text())
    return modules


def import_graph(modules: dict[str, ast.Module]) -> dict[str, set[str]]:
    """Module -> the package's modules it imports, anywhere in its body."""
    graph = {name: set() for name in modules}
    for name, tree in modules.items():
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith(PACKAGE.name):
                for alias in node.names:
                    full = f"{node.module}.{alias.name}"
                    graph[name].add(full if full in modules else node.module)
            elif isinstance(node, ast.Import):
                graph[name].update(a.name for a in node.names if a.name in modules)
        graph[name] &= set(modules) - {name}
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected groups of more than one module (Tarjan)."""
    index, low, stack, on_stack, groups = {}, {}, [], set(), []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for successor in sorted(graph[node]):
            if successor not in index:
                visit(successor)
                low[node] = min(low[node], low[successor])
            elif successor in on_stack:
                low[node] = min(low[node], index[successor])
        if low[node] == index[node]:
            group = []
            while not group or group[-1] != node:
                group.append(stack.pop())
                on_stack.discard(group[-1])
            if len(group) > 1:
                groups.append(sorted(group))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return groups


def test_no_import_circles():
    assert cycles(import_graph(_modules())) == []


def test_the_circle_check_sees_function_level_imports():
    modules = {"vllm_lookahead.a": ast.parse("from vllm_lookahead import b"),
               "vllm_lookahead.b": ast.parse("def f():\n    from vllm_lookahead.a import x")}
    assert cycles(import_graph(modules)) == [["vllm_lookahead.a", "vllm_lookahead.b"]]


def test_modules_and_classes_stay_small():
    too_long = []
    for path in PACKAGE.rglob("*.py"):
        text = path.read_text()
        if text.count("\n") > MAX_MODULE_LINES:
            too_long.append(f"{path.name}: {text.count(chr(10))} lines")
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, ast.ClassDef) and node.end_lineno - node.lineno + 1 > MAX_CLASS_LINES:
                too_long.append(f"{path.name}: class {node.name} "
                                f"{node.end_lineno - node.lineno + 1} lines")
    assert too_long == []
