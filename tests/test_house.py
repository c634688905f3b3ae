"""helpers/ stays a house a learner can read: every module in the folder of its role, no import
cycles between modules (counting the imports inside functions, the ones that hid the cycles before),
and each role imports only the roles below it: the learner's package (learn) never imports the
runner or the demonstrations. Sizes are measured (``shared/tools/house_metrics.py``), not capped."""

from __future__ import annotations

import ast
from pathlib import Path

HELPERS = Path(__file__).resolve().parent.parent / "helpers"

#: The role folders of helpers/ and what each may import besides itself (``helpers/__init__.py`` maps them).
ROLES = {"support": set(), "learn": {"support"}, "runner": {"learn", "support"}, "demos": {"learn", "runner", "support"}}


def modules() -> dict[str, Path]:
    """``{"learn.training_config": path, "demos.roofline": path, ...}`` for every module under helpers/."""
    out = {}
    for path in HELPERS.rglob("*.py"):
        name = ".".join(path.relative_to(HELPERS).with_suffix("").parts)
        out[name.removesuffix(".__init__") if name != "__init__" else ""] = path
    return out


def import_graph() -> dict[str, set[str]]:
    """``{module: helpers modules it imports anywhere in its source}`` (dotted below helpers)."""
    mods = modules()
    graph: dict[str, set[str]] = {}
    for name, path in mods.items():
        found = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "helpers":
                base = node.module.partition(".")[2]
                found |= {f"{base}.{a.name}".strip(".") for a in node.names} | {base}
            elif isinstance(node, ast.Import):
                found |= {a.name.partition(".")[2] for a in node.names if a.name.startswith("helpers.")}
        graph[name] = {m for m in found if m in mods and m} - {name}
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
    assert {"learn.pretrain_gpt", "demos.core_loop", "learn.checkpointing", "runner.series", "demos.roofline"} <= set(graph)
    assert "learn.dataloader" in graph["demos.dataset_indices"], "the graph must see 'from helpers.x import y' lines"
    assert find_cycle(graph) is None, f"import cycle in helpers/: {' -> '.join(find_cycle(graph))}"


def test_every_module_lives_in_a_role_folder_with_a_map():
    mods = modules()
    loose = sorted(m for m in mods if m and m.split(".")[0] not in ROLES)
    assert not loose, f"modules outside the role folders {sorted(ROLES)}: {loose}"
    for role in ROLES:
        doc = ast.get_docstring(ast.parse(mods[role].read_text())) or ""
        missing = sorted(m.split(".")[1] for m in mods if m.startswith(role + ".") and m.split(".")[1] not in doc)
        assert not missing, f"helpers/{role}/__init__.py's map does not name {missing}"


def imports_across_roles(graph: dict[str, set[str]]) -> dict[str, list[str]]:
    """``{module: [modules of a role it may not import]}`` for the modules that break :data:`ROLES`."""
    wrong = {m: sorted(d for d in deps if d.split(".")[0] in ROLES and d.split(".")[0] != m.split(".")[0]
                       and d.split(".")[0] not in ROLES[m.split(".")[0]])
             for m, deps in graph.items() if m.split(".")[0] in ROLES}
    return {m: d for m, d in wrong.items() if d}


def test_each_role_imports_only_the_roles_below_it():
    graph = import_graph()
    assert not imports_across_roles(graph)
    assert graph[""] == {"support", "support.quiet"}, "helpers/__init__ imports only the warning filters"
    assert imports_across_roles({"learn.model": {"runner.launch", "support.results"}, "runner.launch": {"learn.model"},
                                 "support.results": {"learn.model"}}) == {"learn.model": ["runner.launch"],
                                                                          "support.results": ["learn.model"]}
