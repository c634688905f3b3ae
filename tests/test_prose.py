"""Every notebook reads in a sitting (issue 38): short sentences and at most 45 cells, by tools/prose_check.py's rules."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

from helpers.runner import series

ROOT = Path(__file__).resolve().parents[1]
_spec = importlib.util.spec_from_file_location("prose_check", ROOT / "tools" / "prose_check.py")
prose_check = sys.modules["prose_check"] = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(prose_check)


@pytest.mark.parametrize("path", series.notebooks(), ids=lambda p: p.stem)
def test_each_notebooks_sentences_and_cells_are_within_the_readers_bounds(path):
    stats = prose_check.measure(path)
    longest = "; ".join(f"{n} words: {text[:120]}" for n, text in stats.longest(3))
    assert not stats.breaches(), f"{path.name}: {', '.join(stats.breaches())}. Longest: {longest}"


def test_the_measure_follows_its_rules():
    md = ("# A heading of five words\n\nOne two three four. Five six `a b c` seven!\n"
          "- a list item is its own unit\n\n| a table | row of many words here |\n\n```\ncode is dropped entirely here\n```\n"
          "Math $x + y = z$ is one word. No")
    assert [n for n, _ in prose_check.sentences(md)] == [5, 4, 4, 7, 5]
    stats = prose_check.ProseStats("t", 2, 0, prose_check.sentences(md))
    assert (stats.mean, stats.p90, stats.max, stats.breaches()) == (5.0, 7, 7, [])
    assert prose_check.ProseStats("t", 46, 0, [(61, "x")]).breaches() == ["mean 61.0 > 20.0", "p90 61 > 35",
                                                                         "max 61 > 60", "cells 46 > 45"]
