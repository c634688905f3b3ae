"""helpers/ stays a house a learner can read: no import cycles between its modules (counting the
imports inside functions, the ones that hid the cycles before), the learner's path never imports
the demonstrations, and every module stays short enough to read in one sitting."""

from __future__ import annotations

import ast
import io
import tokenize
from pathlib import Path

HELPERS = Path(__file__).resolve().parent.parent / "helpers"

#: Plumbing: what runs the series and keeps megatron-core working on a CPU; a learner need not read it.
PLUMBING = {"series", "parameters", "results", "environment", "quiet", "cpu_compat", "launch", "encoders", "data_stage", "metrics",
            "run_guard", "report", "preflight", "readiness", "book"}
MAX_MODULE_LINES = 420
MAX_LEARNER_LINES = 3400  # issue 12: "about 2,000"; 2,214 when it closed, 2,289 with issue 13's checks; issue 16 adds evaluation (259), corpus CodeParrot's later filters and MinHash (100); issue 14 moves the memory calculator (78) out of demos for the preflight and adds the 🤗 datasets source (hub_datasets 77, corpus 8) and the reading of Megatron-LM's own checkpoints (megatron_lm 367, with its restricted torch_dist metadata reader)


def modules() -> dict[str, Path]:
    """``{"training": path, "demos.roofline": path, ...}`` for every module under helpers/."""
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


def code_lines(path: Path) -> int:
    """Lines holding code: not blank, not a comment, not a docstring (as shared/tools/house_metrics.py)."""
    src = path.read_text(encoding="utf-8")
    skip = set()
    for node in ast.walk(ast.parse(src)):
        body = getattr(node, "body", None)
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and body \
                and isinstance(body[0], ast.Expr) and isinstance(getattr(body[0], "value", None), ast.Constant) \
                and isinstance(body[0].value.value, str):
            skip.update(range(body[0].lineno, body[0].end_lineno + 1))
    lines = set()
    ignored = (tokenize.COMMENT, tokenize.NL, tokenize.NEWLINE, tokenize.INDENT, tokenize.DEDENT, tokenize.ENDMARKER)
    for tok in tokenize.generate_tokens(io.StringIO(src).readline):
        if tok.type not in ignored:
            lines |= {ln for ln in range(tok.start[0], tok.end[0] + 1) if ln not in skip}
    return len(lines)


def test_find_cycle_sees_a_cycle_through_function_level_imports():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": set()}) is None


def test_helpers_has_no_import_cycle():
    graph = import_graph()
    assert {"pretrain_gpt", "core_loop", "checkpointing", "distributed", "model", "demos.roofline"} <= set(graph)
    assert "dataloader" in graph["demos.dataset_indices"], "the graph must see 'from helpers.x import y' lines"
    assert find_cycle(graph) is None, f"import cycle in helpers/: {' -> '.join(find_cycle(graph))}"


def test_the_learners_path_never_imports_a_demonstration():
    graph = import_graph()
    offenders = {m: sorted(d for d in deps if d.startswith("demos")) for m, deps in graph.items()
                 if not m.startswith("demos")}
    assert not any(offenders.values()), {m: d for m, d in offenders.items() if d}


def test_every_module_reads_in_one_sitting_and_the_learners_path_is_small():
    sizes = {name: code_lines(path) for name, path in modules().items()}
    too_long = {m: n for m, n in sizes.items() if n > MAX_MODULE_LINES}
    assert not too_long, f"modules over {MAX_MODULE_LINES} code lines: {too_long}"
    learner = {m: n for m, n in sizes.items() if m and not m.startswith("demos") and m not in PLUMBING}
    assert {"corpus", "tokenizer", "preprocess", "dataloader", "model", "pretrain_gpt", "core_loop", "conversion"} <= set(learner)
    assert sum(learner.values()) <= MAX_LEARNER_LINES, f"learner's path: {sum(learner.values())} code lines {learner}"


def test_code_lines_skip_docstrings_comments_and_blanks(tmp_path):
    path = tmp_path / "m.py"
    path.write_text('"""Doc\nstring."""\n\n# comment\ndef f():\n    """doc"""\n    return (1,\n            2)\n')
    assert code_lines(path) == 3
