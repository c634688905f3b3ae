"""Words per sentence in the notebooks' markdown, and the longest sentences (issue 38's measure).

Usage::

    python tools/prose_check.py [NOTEBOOK ...] [--longest N]

Prints, per notebook: cells, words, sentences, mean and 90th-percentile words per sentence, the
longest sentence's length, then its ``N`` longest sentences. Exits 1 when a notebook is outside
:data:`BOUNDS` (tests/test_prose.py runs the same check).

The rules: code spans, math and link texts count as one word each; fenced code blocks, tables and
HTML are dropped; each list item and heading is its own unit; within a unit a sentence ends at
``.``, ``!`` or ``?`` followed by a space and a capital, digit, bracket, quote or ``*``; units of fewer
than 3 words are not sentences. Words are the whitespace-separated tokens of the markdown outside
fenced code blocks.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
#: The reader's limits: mean and 90th percentile of words per sentence, the longest sentence, cells.
BOUNDS = {"mean": 20.0, "p90": 35, "max": 60, "cells": 45}


def units(markdown: str):
    """The units of ``markdown``: paragraphs, list items and headings, code and math as one word ``X``."""
    md = re.sub(r"```.*?```", " ", markdown, flags=re.S)
    md = re.sub(r"\$\$.*?\$\$", "X", md, flags=re.S)
    md = re.sub(r"\$[^$\n]+\$", "X", md)
    md = re.sub(r"`[^`]*`", "X", md)
    md = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", md)
    md = re.sub(r"<[^>]+>", " ", md)
    para: list[str] = []
    for line in md.splitlines():
        s = line.strip()
        if not s or s.startswith("|"):
            if para:
                yield " ".join(para)
                para = []
            continue
        if re.match(r"^(#+|[-*+]|\d+\.)\s", s):
            if para:
                yield " ".join(para)
            para = [re.sub(r"^(#+|[-*+]|\d+\.)\s+", "", s)]
        else:
            para.append(s)
    if para:
        yield " ".join(para)


def sentences(markdown: str) -> list[tuple[int, str]]:
    """``(words, sentence)`` for each sentence of ``markdown`` of at least 3 words."""
    out = []
    for unit in units(markdown):
        for s in re.split(r"(?<=[.!?])\s+(?=[A-Z0-9(\[*\"'])", unit):
            if len(s.split()) >= 3:
                out.append((len(s.split()), s))
    return out


@dataclass
class ProseStats:
    """One notebook's measure: counts, and words per sentence (mean, 90th percentile, max)."""

    name: str
    cells: int
    words: int
    sentences: list[tuple[int, str]]

    @property
    def mean(self) -> float:
        return sum(n for n, _ in self.sentences) / len(self.sentences) if self.sentences else 0.0

    @property
    def p90(self) -> int:
        lengths = sorted(n for n, _ in self.sentences)
        return lengths[int(0.9 * len(lengths))] if lengths else 0

    @property
    def max(self) -> int:
        return max((n for n, _ in self.sentences), default=0)

    def longest(self, n: int = 5) -> list[tuple[int, str]]:
        return sorted(self.sentences, key=lambda x: -x[0])[:n]

    def breaches(self, bounds: dict = BOUNDS) -> list[str]:
        """What exceeds ``bounds``, in words: ``["mean 25.2 > 20.0", ...]``; empty when within."""
        found = [(k, getattr(self, k)) for k in ("mean", "p90", "max", "cells")]
        return [f"{k} {v:.1f} > {bounds[k]}" if k == "mean" else f"{k} {v} > {bounds[k]}"
                for k, v in found if v > bounds[k]]


def measure(path: str | Path) -> ProseStats:
    """The measure of one ``.ipynb`` file's markdown cells.

    Raises:
        FileNotFoundError: no such notebook.
    """
    nb = json.loads(Path(path).read_text())
    md = "\n\n".join("".join(c["source"]) for c in nb["cells"] if c["cell_type"] == "markdown")
    words = len(re.sub(r"```.*?```", " ", md, flags=re.S).split())
    return ProseStats(Path(path).stem, len(nb["cells"]), words, sentences(md))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("notebooks", nargs="*", help="default: notebooks/NN_*.ipynb")
    parser.add_argument("--longest", type=int, default=3, help="longest sentences quoted per notebook")
    args = parser.parse_args(argv)
    paths = args.notebooks or sorted(str(p) for p in (ROOT / "notebooks").glob("[0-9]*.ipynb"))
    failed = False
    for path in paths:
        s = measure(path)
        bad = s.breaches()
        failed |= bool(bad)
        print(f"{s.name:28} cells {s.cells:3}  words {s.words:5}  sentences {len(s.sentences):4}  mean {s.mean:4.1f}  "
              f"p90 {s.p90:3}  max {s.max:3}  {'OK' if not bad else 'over: ' + ', '.join(bad)}")
        for n, text in s.longest(args.longest):
            print(f"    {n:3} words: {text[:200]}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
