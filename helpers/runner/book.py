"""``make book``: a run's executed notebooks as a static HTML site, read before running anything.

``python -m helpers.runner.book [RUN_DIR]`` (default ``runs/latest``) writes ``RUN_DIR/book/``: one
self-contained page per executed notebook (and per solutions notebook under ``solutions/`` when
``make solutions`` ran), previous / contents / next links, MathJax copied beside the pages (no network
needed), and ``index.html`` listing them in order with the run's report card (``report.md``).
Open ``book/index.html`` in a browser, or serve the folder (``python -m http.server -d RUN_DIR/book``).

Source: nbconvert's documentation, "Using as a library" (``HTMLExporter``, ``template_name``);
``nbconvert.filters.markdown2html`` for the report card.
"""

from __future__ import annotations

import argparse
import html
import re
import shutil
import sys
from pathlib import Path

from helpers.runner import widget_text
from helpers.runner.series import NOTEBOOK_GLOB

ROOT = Path(__file__).resolve().parents[2]
_NOTEBOOK_LINK = re.compile(r'href="(\.\./notebooks/|\./|\.\./)?(solutions/)?(\d\db?_[\w]+)\.ipynb(#[^"]*)?"')


def _page_link(m: re.Match) -> str:
    """A link to a notebook, pointed at its page (``solutions/NN_x.ipynb`` -> ``solutions/NN_x.html``)."""
    prefix = "" if m[1] == "../notebooks/" else (m[1] or "")
    return f'href="{prefix}{m[2] or ""}{m[3]}.html{m[4] or ""}"'


#: MathJax 2.7 as the book loads it, from ``_static/`` beside the pages: the copy the ``jupyter-server-mathjax``
#: package installs (nbconvert's default loads it from a CDN, so the math showed as raw TeX offline).
MATHJAX = "_static/mathjax/MathJax.js?config=TeX-AMS-MML_HTMLorMML-full,Safe"
_MATHJAX_PARTS = ("MathJax.js", "config", "jax", "fonts", "extensions")
#: jupyter-server-mathjax ships only the STIX-Web web fonts: without this MathJax asks for its default TeX fonts
#: first (a request for a file that is not there on every page with math) before it falls back.
_MATHJAX_FONTS = ('<script type="text/x-mathjax-config">MathJax.Hub.Config({"HTML-CSS": {availableFonts: ["STIX-Web"], '
                  'preferredFont: "STIX-Web", webFont: "STIX-Web", imageFont: null}});</script>')


def _copy_mathjax(out: Path) -> None:
    """Copy the installed MathJax (its script, configurations, input/output processors, fonts, extensions;
    about 10 MB) to ``out/_static/mathjax`` once."""
    import jupyter_server_mathjax

    source = Path(jupyter_server_mathjax.__file__).parent / "static"
    target = out / "_static" / "mathjax"
    if (target / "MathJax.js").is_file():
        return
    target.mkdir(parents=True, exist_ok=True)
    for part in _MATHJAX_PARTS:
        if (source / part).is_dir():
            shutil.copytree(source / part, target / part, dirs_exist_ok=True)
        else:
            shutil.copy2(source / part, target / part)


#: A link to a solutions page (after :func:`_page_link`): its href, the page's file name, the link's text.
_SOLUTIONS_LINK = re.compile(r'<a href="((?:\.\./)?solutions/([\w]+\.html)[^"]*)"[^>]*>(.*?)</a>')


def _one_parameters_cell(notebook):
    """The notebook with papermill's ``injected-parameters`` cell folded into the ``parameters`` cell as a
    comment (the defaults with their explanations, then this run's values): one parameters cell per page."""
    injected = [c for c in notebook.cells if "injected-parameters" in c.metadata.get("tags", [])]
    defaults = [c for c in notebook.cells if "parameters" in c.metadata.get("tags", [])]
    if injected and defaults:
        values = [line for line in injected[0].source.splitlines() if line.strip() and not line.startswith("#")]
        defaults[0].source += "\n\n# this run's values (the series runner passed them to papermill):\n" + \
            "\n".join(f"#   {line}" for line in values)
        notebook.cells = [c for c in notebook.cells if c is not injected[0]]
    return notebook


_RELATIVE_HREF = re.compile(r'href="(?![a-z]+:|#|/)([^"#?]+)([^"]*)"')


def _repository_links(body: str, source_dir: Path, page_dir: Path) -> str:
    """Links to files of the repository (``../README.md`` in a notebook of ``source_dir``) pointed at them from the
    page's folder ``page_dir``; links to pages, and to what is not in the repository, are left as they are."""
    import os

    def point(m: re.Match) -> str:
        target = (source_dir / m[1]).resolve()
        if target.suffix in (".html", ".ipynb") or not target.is_relative_to(ROOT) or not target.exists():
            return m[0]
        return f'href="{os.path.relpath(target, page_dir)}{m[2]}"'

    return _RELATIVE_HREF.sub(point, body)


def _relative_paths(body: str, run: Path) -> str:
    """The run folder and the repository named relative to the repository (``runs/<run>``, ``.``), not as this
    machine's absolute paths."""
    return body.replace(str(run), f"runs/{run.name}").replace(str(ROOT) + "/", "").replace(str(ROOT), ".")


def _with_navigation(body: str, order: list[str], stem: str, up: str = "") -> str:
    """The page with previous / contents / next links at its top and bottom (``order``: the stems in reading order)."""
    i = order.index(stem)
    links = ([f'<a href="{order[i - 1]}.html">&larr; {html.escape(order[i - 1])}</a>'] if i else []) + \
        [f'<a href="{up}index.html">contents</a>'] + \
        ([f'<a href="{order[i + 1]}.html">{html.escape(order[i + 1])} &rarr;</a>'] if i + 1 < len(order) else [])
    nav = f'<nav class="series-nav" style="margin:1em 2em;font-family:sans-serif">{" | ".join(links)}</nav>'
    body = re.sub(r"(<body[^>]*>)", lambda m: m[1] + nav, body, count=1)
    return body.replace("</body>", nav + "</body>", 1)


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
    _copy_mathjax(out)
    entries: dict[str, list[str]] = {"": [], "solutions/": []}
    solutions = sorted((run / "executed" / "solutions").glob(NOTEBOOK_GLOB))  # make solutions
    if solutions:
        (out / "solutions").mkdir(exist_ok=True)
    solution_pages = {f"{p.stem}.html" for p in solutions}
    for path, sub in [(p, "") for p in pages] + [(p, "solutions/") for p in solutions]:
        notebook = _one_parameters_cell(nbformat.read(path, as_version=4))
        widget_text.progress_as_text(notebook)  # a run executed before the runner did it itself
        exporter.mathjax_url = f"{'../' if sub else ''}{MATHJAX}"
        body, _ = exporter.from_notebook_node(notebook, resources={"metadata": {"name": _title(notebook) or path.stem}})
        body = body.replace(f'<script src="{exporter.require_js_url}"></script>', "")  # for widgets; none are left
        body = body.replace("<!-- MathJax configuration -->", _MATHJAX_FONTS + "\n<!-- MathJax configuration -->", 1)
        body = _NOTEBOOK_LINK.sub(_page_link, body)  # the pages link to each other
        body = _SOLUTIONS_LINK.sub(lambda m: m[0] if m[2] in solution_pages else
                                   f"{m[3]} (run <code>make solutions</code> for this page)", body)
        body = _relative_paths(body, run)
        body = _repository_links(body, ROOT / "notebooks" / sub, (out / sub).resolve())  # links to the repository's files
        order = pages if not sub else solutions
        body = _with_navigation(body, [p.stem for p in order], path.stem, up="../" if sub else "")
        (out / sub / f"{path.stem}.html").write_text(body, encoding="utf-8")
        entries[sub].append(_entry(run, sub, path.stem, notebook) if not sub else
                            f'<li><a href="{sub}{path.stem}.html">{html.escape(_title(notebook) or path.stem)}</a></li>')
    listed = f"<ol class=\"series\">{''.join(entries[''])}</ol>" + (
        f"<h2>The exercises' solutions</h2><ol>{''.join(entries['solutions/'])}</ol>" if entries["solutions/"] else "")
    report = run / "report.md"
    card = markdown2html(report.read_text(encoding="utf-8")) if report.is_file() else "<p>(no report card in this run)</p>"
    card = _relative_paths(card, run)
    if (run / "figures").is_dir():  # a copy beside the pages: the book folder alone is the whole site
        shutil.copytree(run / "figures", out / "figures", dirs_exist_ok=True)
    (out / "index.html").write_text(
        "<!DOCTYPE html>\n<html><head><meta charset=\"utf-8\"><title>Pre-train a GPT with Megatron</title>"
        f"<style>{_INDEX_CSS}</style></head>"
        f"<body><h1>Pre-train a GPT with Megatron, hand it to transformers</h1><p>The executed notebooks of the run "
        f"<code>{html.escape(run.name)}</code>, outputs and figures included, with the time each took in this run.</p>"
        f"{listed}<h2>The run's report card</h2>{_readable_card(card)}</body></html>\n", encoding="utf-8")
    return out / "index.html"


#: The index page's style: a readable sans-serif column, tables with borders, thumbnails in a row.
_INDEX_CSS = ("body{font-family:system-ui,-apple-system,'Segoe UI',Roboto,sans-serif;max-width:60em;margin:2em auto;"
              "padding:0 1em;line-height:1.5;color:#222}table{border-collapse:collapse;margin:1em 0}"
              "th,td{border:1px solid #ccc;padding:.3em .6em;text-align:left}th{background:#f4f4f4}"
              "ol.series li{margin:0 0 1.2em}ol.series p{margin:.2em 0}.time{color:#666;font-size:.9em}"
              ".thumbs img{height:90px;margin:.3em .4em 0 0;border:1px solid #ddd}code{background:#f4f4f4;padding:0 .2em}")


def _entry(run: Path, sub: str, stem: str, notebook) -> str:
    """One notebook in the index: its title (linked), the first paragraph of its introduction, the
    time it took in this run (``summary.json``) and thumbnails of the figures it saved."""
    import json

    from nbconvert.filters import markdown2html

    intro = next((c.source for c in notebook.cells if c.cell_type == "markdown"), "")
    parts = [p for p in intro.split("\n\n")[1:] if p.strip()]
    paragraph = next((p for p in parts if not p.startswith(("#", "**", "-"))), None) or \
        next((p for p in parts if p.startswith("**What you will learn**")), "")  # else its list of what it teaches
    summary = run / "summary.json"
    wall = json.loads(summary.read_text()).get(stem, {}).get("wall_seconds") if summary.is_file() else None
    figures = sorted((run / "figures").glob(f"{stem.split('_')[0]}_*.png"))  # saved as 01_tokens.png, 05b_...
    thumbs = "".join(f'<a href="figures/{f.name}"><img src="figures/{f.name}" alt="{html.escape(f.stem)}" '
                     f'title="{html.escape(f.stem)}"></a>' for f in figures)
    title = re.sub(r"`([^`]+)`", r"<code>\1</code>", html.escape(_title(notebook) or stem))
    return (f'<li><a href="{sub}{stem}.html"><strong>{title}</strong></a>'
            + (f' <span class="time">{wall:.0f} s in this run</span>' if wall is not None else "")
            + (markdown2html(paragraph) if paragraph else "") + (f'<div class="thumbs">{thumbs}</div>' if thumbs else "")
            + "</li>")


def _readable_card(card: str) -> str:
    """The report card's HTML for the index: headings one level down (the page has its own h1), figures
    as thumbnails, and the recorded names (``all_savers_match``) with spaces."""
    card = re.sub(r"<(/?)h([1-5])", lambda m: f"<{m[1]}h{int(m[2]) + 1}", card)
    card = re.sub(r'<a href="(figures/[^"]+\.png)">([^<]+)</a>',
                  r'<a href="\1"><img src="\1" alt="\2" title="\2" style="height:90px;margin:.3em"></a>', card)
    return re.sub(r"<td>([a-z0-9]+(?:_[a-z0-9]+)+)</td>", lambda m: f"<td>{m[1].replace('_', ' ')}</td>", card)


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
