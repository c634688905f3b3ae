"""helpers.runner.book (make book): the smoke series' executed notebooks as a static site."""

from __future__ import annotations

import re

import pytest

from helpers.runner import book, series


def test_a_run_without_executed_notebooks_says_what_to_run(tmp_path, capsys):
    with pytest.raises(FileNotFoundError, match="make tutorial"):
        book.build(tmp_path)
    assert book.main([str(tmp_path)]) == 2 and "run the series first" in capsys.readouterr().err


@pytest.mark.slow
def test_the_book_of_the_smoke_series(series_run):
    run_dir, runs, _ = series_run
    index = book.build(run_dir)
    pages = sorted(p.name for p in index.parent.glob("[0-9][0-9]*_*.html"))
    assert pages == sorted(f"{r.stem}.html" for r in runs) and len(pages) == len(series.notebooks()) == 9
    text = index.read_text()
    assert all(f'href="{p}"' in text for p in pages) and "report card" in text and "<table>" in text
    links = re.findall(r'(?:href|src)="(figures/[^"]+)"', text)
    assert links and "figures/03_loss_and_lr.png" in links  # thumbnails, copied into the book: it stands alone
    for link in links:  # the index's and the report card's figures resolve
        assert (index.parent / link).resolve().is_file(), link
    training = (index.parent / "03_training.html").read_text()
    assert "data:image/png;base64," in training  # the loss curve, inlined: the folder is self-contained
    assert "training summary" in training or "validation loss" in training  # outputs are there
    for page in pages:
        body = (index.parent / page).read_text()
        assert not re.search(r'href="[^"]*\d\db?_\w+\.ipynb', body), page  # links go to the pages, not the notebooks


def test_pages_have_one_parameters_cell_relative_paths_navigation_and_no_dead_solutions_link(tmp_path):
    """Issue 30: papermill's injected cell folded into the parameters cell, the machine's absolute paths gone,
    previous / contents / next links, and a link to a solutions page that make solutions did not write is replaced
    by the command that writes it."""
    import nbformat

    run = tmp_path / "runs" / "cpu-test"
    (run / "executed").mkdir(parents=True)
    for stem, text in (("00_first", "see [the solutions](solutions/00_first.ipynb)"),
                       ("01_second", "next one, as [the README](../README.md) says ([gone](../no_such_file.md))")):
        nb = nbformat.v4.new_notebook()
        params = nbformat.v4.new_code_cell('run_dir: str = "../runs/latest"  # run folder')
        params.metadata["tags"] = ["parameters"]
        injected = nbformat.v4.new_code_cell(f'# Parameters\nrun_dir = "{run}"\n')
        injected.metadata["tags"] = ["injected-parameters"]
        shown = nbformat.v4.new_code_cell("print(run_dir)")
        shown.outputs = [nbformat.v4.new_output("stream", name="stdout", text=f"{run}/checkpoints\n")]
        nb.cells = [nbformat.v4.new_markdown_cell(f"# {stem}\n\n{text}"), params, injected, shown]
        nbformat.write(nb, run / "executed" / f"{stem}.ipynb")
    (run / "figures").mkdir()
    (run / "figures" / "00_first_plot.png").write_bytes(b"\x89PNG")
    (run / "summary.json").write_text('{"00_first": {"wall_seconds": 12.4, "all_layouts_match": true}}')
    (run / "report.md").write_text("# Report card: cpu-test\n\n## Evaluation\n\n| notebook | name | value |\n| --- | --- | --- |\n"
                                   "| 00_first | all_layouts_match | yes |\n\n## Figures\n\n[00_first_plot](figures/00_first_plot.png)\n")
    index = book.build(run).read_text()
    assert "12 s in this run" in index and "see [the solutions]" not in index  # the time; the intro's paragraph, rendered
    assert index.count('<img src="figures/00_first_plot.png"') == 2  # the notebook's thumbnail and the card's
    assert (run / "book" / "figures" / "00_first_plot.png").read_bytes() == b"\x89PNG"  # copied: the book stands alone
    assert index.count("<h1") == 1 and re.search(r"<h2[^>]*>Report card: cpu-test", index) and "<td>all layouts match</td>" in index
    assert "font-family" in index and "border-collapse" in index
    first, second = ((run / "book" / f"{s}.html").read_text() for s in ("00_first", "01_second"))
    assert str(run) not in first and "runs/cpu-test/checkpoints" in first
    assert "injected-parameters" not in first and first.count("this run&#39;s values") + first.count("this run's values") == 1
    assert 'href="01_second.html"' in first and 'href="00_first.html"' in second and 'href="index.html">contents' in second
    assert 'href="solutions/' not in first and "make solutions</code> for this page" in first
    readme = re.search(r'href="([^"]*README\.md)"', second)[1]  # a repository file: pointed at from the book's folder
    assert (run / "book" / readme).resolve() == book.ROOT / "README.md" and 'href="../no_such_file.md"' in second
    assert 'preferredFont: "STIX-Web"' in second  # the fonts the installed MathJax has: no request for missing ones
