"""``make book``: a run's executed notebooks as a static HTML site, read before running anything.

``python -m helpers.runner.book [RUN_DIR]`` (default ``runs/latest``) writes ``RUN_DIR/book/``: one page per
executed notebook (nbconvert's ``HTMLExporter`` with JupyterLab's template: outputs and figures
included, images inlined, so the folder is self-contained), one per executed solutions notebook
under ``solutions/`` when ``make solutions`` ran, links between notebooks pointing at the pages,
and ``index.html`` listing them in order with the run's report card (``report.md``).
Open ``book/index.html`` in a browser, or serve the folder (``python -m http.server -d RUN_DIR/book``).

Source: nbconvert's documentation, "Using as a library" (``HTMLExporter``, ``template_name``);
``nbconvert.filters.markdown2html`` for the report card.
"""

from __future__ import annotations

import argparse
import html
import re
import sys
from pathlib import Path

from helpers.runner.series import NOTEBOOK_GLOB

ROOT = Path(__file__).resolve().parents[2]
_NOTEBOOK_LINK = re.compile(r'href="(\.\./notebooks/|\./|\.\./)?(solutions/)?(\d\db?_[\w]+)\.ipynb(#[^"]*)?"')


def _page_link(m: re.Match) -> str:
    """A link to a notebook, pointed at its page (``solutions/NN_x.ipynb`` -> ``solutions/NN_x.html``)."""
    prefix = "" if m[1] == "../notebooks/" else (m[1] or "")
    return f'href="{prefix}{m[2] or ""}{m[3]}.html{m[4] or ""}"'


def _title(notebook) -> str:
    """The notebook's H1 (its first markdown line starting with ``# ``), else its file name."""
    for cell in notebook.cells:
        if cell.cell_type == "markdown":
            for line in cell.source.splitlines():
                if line.startswith("# "):
                    return line[2:].strip()
    return ""


def build(run_dir: str | Path = ROOT / "runs" / "latest", out_dir: str | Path | None = None) -> Path:
    """Write the site and return its ``index.html``.

    Raises:
        FileNotFoundError: no executed notebooks in ``run_dir/executed`` (run the series first:
            ``make tutorial``, or ``python -m helpers.runner.series run --only NN``).
    """
    import nbformat
    from nbconvert import HTMLExporter
    from nbconvert.filters import markdown2html

    run = Path(run_dir).expanduser().resolve()
    pages = sorted((run / "executed").glob(NOTEBOOK_GLOB))
    if not pages:
        raise FileNotFoundError(f"no executed notebooks in {run / 'executed'}: run the series first (make tutorial)")
    out = Path(out_dir) if out_dir else run / "book"
    out.mkdir(parents=True, exist_ok=True)
    exporter = HTMLExporter(template_name="lab")
    entries: dict[str, list[str]] = {"": [], "solutions/": []}
    solutions = sorted((run / "executed" / "solutions").glob(NOTEBOOK_GLOB))  # make solutions
    if solutions:
        (out / "solutions").mkdir(exist_ok=True)
    for path, sub in [(p, "") for p in pages] + [(p, "solutions/") for p in solutions]:
        notebook = nbformat.read(path, as_version=4)
        body, _ = exporter.from_notebook_node(notebook, resources={"metadata": {"name": _title(notebook) or path.stem}})
        body = _NOTEBOOK_LINK.sub(_page_link, body)  # the pages link to each other
        (out / sub / f"{path.stem}.html").write_text(body, encoding="utf-8")
        entries[sub].append(f'<li><a href="{sub}{path.stem}.html">{html.escape(_title(notebook) or path.stem)}</a></li>')
    listed = f"<ol>{''.join(entries[''])}</ol>" + (f"<h2>The exercises' solutions</h2><ol>{''.join(entries['solutions/'])}</ol>"
                                                  if entries["solutions/"] else "")
    report = run / "report.md"
    card = markdown2html(report.read_text(encoding="utf-8")) if report.is_file() else "<p>(no report card in this run)</p>"
    card = re.sub(r'(href|src)="figures/', r'\1="../figures/', card)  # the run's figures/, next to book/
    (out / "index.html").write_text(
        "<!DOCTYPE html>\n<html><head><meta charset=\"utf-8\"><title>Pre-train a GPT with Megatron</title></head>"
        f"<body><h1>Pre-train a GPT with Megatron, hand it to transformers</h1><p>The executed notebooks of the run "
        f"<code>{html.escape(run.name)}</code>, outputs and figures included.</p>{listed}"
        f"<h2>The run's report card</h2>{card}</body></html>\n", encoding="utf-8")
    return out / "index.html"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("run_dir", nargs="?", default=str(ROOT / "runs" / "latest"))
    args = parser.parse_args(argv)
    try:
        index = build(args.run_dir)
    except FileNotFoundError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    print(f"book: {index} ({len(list(index.parent.glob('*.html'))) - 1} pages, "
          f"{len(list(index.parent.glob('solutions/*.html')))} of solutions)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
