"""helpers/ stays a house a learner can read: no import cycles between its modules, counting
the imports inside functions (the ones that hid the cycles before)."""

from __future__ import annotations

import ast
from pathlib import Path

HELPERS = Path(__file__).resolve().parent.parent / "helpers"


def import_graph() -> dict[str, set[str]]:
    """``{module: helpers modules it imports anywhere in its source}`` for every helpers module."""
    modules = {p.stem for p in HELPERS.glob("*.py")}
    graph: dict[str, set[str]] = {}
    for path in HELPERS.glob("*.py"):
        found = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module == "helpers":
                found |= {a.name for a in node.names if a.name in modules}
            elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith("helpers."):
                found.add(node.module.split(".")[1])
            elif isinstance(node, ast.Import):
                found |= {a.name.split(".")[1] for a in node.names if a.name.startswith("helpers.")}
        graph[path.stem] = found - {path.stem}
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import cycle as ``[a, b, ..., a]``, or None."""
    state: dict[str, int] = {}

    def visit(node: str, path: list[str]) -> list[str] | None:
        state[node] = 1
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                return path[path.index(nxt):] + [nxt]
            if nxt not in state and (cycle := visit(nxt, path + [nxt])):
                return cycle
        state[node] = 2
        return None

    for start in sorted(graph):
        if start not in state and (cycle := visit(start, [start])):
            return cycle
    return None


def test_find_cycle_sees_a_cycle_through_function_level_imports():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": set()}) is None


def test_helpers_has_no_import_cycle():
    graph = import_graph()
    assert {"training", "checkpointing", "distributed", "model"} <= set(graph)
    assert find_cycle(graph) is None, f"import cycle in helpers/: {' -> '.join(find_cycle(graph))}"
