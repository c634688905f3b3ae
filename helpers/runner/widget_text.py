"""Progress bars an executed notebook keeps as the text of their final state.

An executed notebook saves each ``tqdm.auto`` bar as a widget view plus a ``text/plain`` fallback of
its *first* state (``training: 0% | 0/1000``), which JupyterLab and the static book show.
:func:`progress_as_text` writes each bar's final state as tqdm prints it in a terminal and drops the
widget views and state; the series runner applies it to each notebook it executes, ``make book`` to each page.

Source: tqdm ``notebook.py`` (``tqdm_notebook.status_printer``: an ``HBox`` of an ``HTML`` prefix, a
``FloatProgress`` bar and an ``HTML`` suffix); the ipywidgets widget-state and widget-view MIME types
(``jupyter-widgets/ipywidgets``, ``docs/source/embedding.md``).
"""

from __future__ import annotations

import html
from pathlib import Path
from typing import Any

VIEW = "application/vnd.jupyter.widget-view+json"
STATE = "application/vnd.jupyter.widget-state+json"


def bar_text(state: dict[str, Any], model_id: str, width: int = 10) -> str | None:
    """The terminal text of the tqdm bar ``model_id`` in a notebook's widget ``state`` (the metadata's
    ``state`` mapping), or ``None`` when that widget is not a tqdm bar (an HBox of HTML, FloatProgress, HTML)."""
    box = state.get(model_id, {})
    children = box.get("state", {}).get("children", []) if box.get("model_name") == "HBoxModel" else []
    parts = [state.get(str(c).removeprefix("IPY_MODEL_"), {}) for c in children]
    if [p.get("model_name") for p in parts] != ["HTMLModel", "FloatProgressModel", "HTMLModel"]:
        return None
    left, bar, right = (p.get("state", {}) for p in parts)
    total = bar.get("max") or 0
    filled = int(width * min(1.0, (bar.get("value") or 0) / total)) if total else 0
    text = f"{html.unescape(left.get('value', ''))}|{'#' * filled}{' ' * (width - filled)}|{html.unescape(right.get('value', ''))}"
    return text.replace("\u2007", " ")


def progress_as_text(notebook) -> int:
    """Replace the notebook's tqdm widget outputs by their final text, in place (an ``nbformat`` node).

    Returns:
        The number of bars replaced. The saved widget state is dropped once no widget view is left.
    """
    state = notebook.metadata.get("widgets", {}).get(STATE, {}).get("state", {})
    replaced, left = 0, 0
    for cell in notebook.cells:
        for output in cell.get("outputs", []):
            view = output.get("data", {}).get(VIEW)
            if view is None:
                continue
            text = bar_text(state, view.get("model_id", ""))
            if text is None:
                left += 1
                continue
            output["data"] = {"text/plain": text}
            replaced += 1
    if not left:
        notebook.metadata.pop("widgets", None)
    return replaced


def rewrite(path: str | Path) -> int:
    """:func:`progress_as_text` on a notebook file, written back only when a bar was replaced."""
    import nbformat

    if not Path(path).is_file():  # papermill wrote nothing (a run stubbed in a test): nothing to rewrite
        return 0
    notebook = nbformat.read(str(path), as_version=4)
    replaced = progress_as_text(notebook)
    if replaced:
        nbformat.write(notebook, str(path))
    return replaced
