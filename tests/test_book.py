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
    for link in re.findall(r'(?:href|src)="(\.\./figures/[^"]+)"', text):  # the report card's figures resolve
        assert (index.parent / link).resolve().is_file(), link
    training = (index.parent / "03_training.html").read_text()
    assert "data:image/png;base64," in training  # the loss curve, inlined: the folder is self-contained
    assert "training summary" in training or "validation loss" in training  # outputs are there
    for page in pages:
        body = (index.parent / page).read_text()
        assert not re.search(r'href="[^"]*\d\db?_\w+\.ipynb', body), page  # links go to the pages, not the notebooks
