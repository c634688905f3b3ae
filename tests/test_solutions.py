"""The exercises' solutions (issue 15): one solutions notebook per notebook, every exercise
quoted and solved in cells JupyterLab shows collapsed, every solution checking its answer with
an assertion; the slow test executes them all against the smoke run."""

from __future__ import annotations

import ast
import json
import re

import nbformat
import pytest

from helpers.runner import book, series
from helpers.support import results

NOTEBOOKS = series.notebooks()
IDS = [p.stem for p in NOTEBOOKS]
EXERCISE = re.compile(r"^## Exercise (\d+)\n")


def exercises(path) -> dict[int, str]:
    """``{number: text}`` of the numbered list under a notebook's ``## Exercises`` heading."""
    nb = nbformat.read(path, as_version=4)
    cell = next(c.source for c in nb.cells if c.cell_type == "markdown" and "## Exercises" in c.source)
    section = cell.split("## Exercises", 1)[1].split("\n## ", 1)[0]
    return {int(n): text.strip() for n, text in re.findall(r"^(\d+)\. (.+)$", section, re.M)}


def solution_blocks(path) -> dict[int, tuple[str, list]]:
    """``{number: (quoted exercise text, [the cells after its heading])}`` of a solutions notebook."""
    nb = nbformat.read(path, as_version=4)
    blocks: dict[int, tuple[str, list]] = {}
    current = None
    for cell in nb.cells:
        m = EXERCISE.match(cell.source) if cell.cell_type == "markdown" else None
        if m:
            quote = "\n".join(l[2:] if l.startswith("> ") else l for l in cell.source[m.end():].strip().splitlines())
            current = int(m[1])
            blocks[current] = (quote.strip(), [])
        elif current is not None:
            blocks[current][1].append(cell)
    return blocks


def test_every_notebook_has_a_solutions_notebook_and_nothing_else_is_there():
    assert [p.name for p in series.solutions()] == [p.name for p in NOTEBOOKS]


@pytest.mark.parametrize("path", NOTEBOOKS, ids=IDS)
def test_every_exercise_is_quoted_and_solved_in_collapsed_cells_that_assert(path):
    asked = exercises(path)
    assert asked and sorted(asked) == list(range(1, len(asked) + 1)), f"{path.name}: exercises {sorted(asked)}"
    solved = solution_blocks(series.SOLUTIONS_DIR / path.name)
    assert sorted(solved) == sorted(asked), f"solutions/{path.name} solves {sorted(solved)}, the notebook asks {sorted(asked)}"
    for n, (quote, cells) in solved.items():
        assert quote == asked[n], f"solutions/{path.name} exercise {n} quotes another text than the notebook's:\n{quote}\n!=\n{asked[n]}"
        code = [c for c in cells if c.cell_type == "code"]
        assert code, f"solutions/{path.name} exercise {n} has no code cell"
        for c in cells:
            assert c.metadata.get("jupyter", {}).get("source_hidden") is True, \
                f"solutions/{path.name} exercise {n}: a cell JupyterLab shows open (metadata.jupyter.source_hidden)"
        assert all("solution" in c.metadata.get("tags", []) for c in code)
        asserts = [n for c in code for n in ast.walk(ast.parse(c.source)) if isinstance(n, ast.Assert)]
        assert asserts, f"solutions/{path.name} exercise {n}: no assert checks the answer"


@pytest.mark.parametrize("path", series.solutions(), ids=[p.stem for p in series.solutions()])
def test_solutions_notebooks_are_stripped_titled_and_take_the_runners_parameters(path):
    raw = json.loads(path.read_text(encoding="utf-8"))
    nb = nbformat.reads(json.dumps(raw), as_version=4)
    assert all("id" in c for c in raw["cells"])
    assert not [c for c in nb.cells if c.cell_type == "code" and (c.outputs or c.execution_count)]
    assert nb.cells[0].cell_type == "markdown" and nb.cells[0].source.startswith(f"# Solutions · {path.stem.split('_')[0]} ")
    assert "parameters" in nb.cells[1].metadata.get("tags", [])
    assert set(series.notebook_parameters(path)) >= set(series.RUNNER_PARAMETERS)
    for cell in nb.cells:
        assert not re.search(r"^\s*[!%]\s*pip", cell.source, re.M)


def test_run_solutions_refuses_a_missing_run_folder_and_an_unknown_notebook(tmp_path):
    with pytest.raises(series.ParameterError, match="is not a run folder"):
        series.run_solutions(tmp_path / "nothing")
    (tmp_path / "empty").mkdir()  # an empty folder is no run: it would build notebooks 01, 03 and 06 first
    with pytest.raises(series.ParameterError, match="is not a run folder"):
        series.run_solutions(tmp_path / "empty")
    results.record(tmp_path, "x", "y", 1)
    with pytest.raises(series.ParameterError, match="no such solutions notebook"):
        series.run_solutions(tmp_path, "smoke", only=["99"])
    with pytest.raises(series.ParameterError, match="workers=0"):
        series.run_solutions(tmp_path, "smoke", workers=0)


@pytest.mark.slow
def test_every_solution_runs_against_the_smoke_run_and_its_assertions_hold(series_run):
    run_dir, _, _ = series_run
    runs = series.run_solutions(run_dir, "smoke", workers=2)  # two kernels at a time: 146 s against 191 s one by one
    assert [r.stem for r in runs] == IDS
    for r in runs:
        nb = nbformat.read(r.output, as_version=4)
        code = [c for c in nb.cells if c.cell_type == "code"]
        assert all(c.execution_count for c in code), f"{r.stem}: a solution cell did not run"
        assert not [o for c in code for o in c.outputs if o.output_type == "error"]
    index = book.build(run_dir)  # make book then has a page for each, and the links lead to pages
    pages = sorted(p.name for p in (index.parent / "solutions").glob("*.html"))
    assert pages == [f"{stem}.html" for stem in IDS] and all(f'href="solutions/{p}"' in index.read_text() for p in pages)
    for page in pages:
        body = (index.parent / "solutions" / page).read_text()
        assert f'href="../{page}"' in body and not re.search(r'href="[^"]*\d\db?_\w+\.ipynb', body), page
