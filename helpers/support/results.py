"""Recorded results of a run: ``summary.json``, figures, and the one table formatter.

Every notebook records its key results with :func:`record`; the series runner adds each
notebook's wall time, and keeps a notebook's results apart until it succeeds (:data:`ATTEMPT_ENV`),
so a failed rerun never overwrites the last good ones. Tests and benchmarks read the same file back with :func:`load_summary`.

Layout of a run folder (see the README)::

    runs/<name>/summary.json      {"01_data_preprocessing": {"num_documents": 799, ...}, ...}
    runs/<name>/figures/*.png
"""

from __future__ import annotations

import json
import math
import os
import tempfile
from pathlib import Path
from typing import Any, Iterable, Mapping, Sequence

from helpers.support.run_guard import environ, explain_disk_full

SUMMARY_FILE = "summary.json"


def run_path(run_dir: str | os.PathLike) -> Path:
    """The run folder as an absolute :class:`~pathlib.Path`, created if absent.

    Raises:
        NotADirectoryError: ``run_dir`` exists and is a file.
    """
    path = Path(run_dir).expanduser().resolve()
    if path.exists() and not path.is_dir():
        raise NotADirectoryError(f"run_dir={str(run_dir)!r} is a file, not a folder: pass a folder path")
    path.mkdir(parents=True, exist_ok=True)
    return path


def _jsonable(value: Any) -> Any:
    """Numbers from numpy/torch become plain Python; NaN/inf become strings JSON can hold."""
    if hasattr(value, "item") and callable(value.item) and getattr(value, "ndim", 0) == 0:
        value = value.item()
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    if isinstance(value, dict):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    if isinstance(value, Path):
        return str(value)
    return value


#: Set by the series runner (:func:`helpers.runner.series.run`) for the notebook it executes: the file that
#: notebook's results go to until it succeeds, ``{run}/executed/last-attempt/{stem}.results.json``.
#: The runner then merges them into ``summary.json`` (:func:`commit_attempt`); a failed attempt
#: leaves ``summary.json``, and the last good results in it, as they were.
ATTEMPT_ENV = "HELPERS_ATTEMPT_RESULTS"


def attempt_results(run_dir: str | os.PathLike) -> Path | None:
    """The runner's attempt file (:data:`ATTEMPT_ENV`) when this process runs a notebook into ``run_dir``, else None."""
    value = os.environ.get(ATTEMPT_ENV)
    if not value:
        return None
    path = Path(value)
    return path if path.parent.parent.parent == Path(run_dir).expanduser().resolve() else None


def _read_json(path: Path) -> dict[str, Any]:
    if not path.exists():
        return {}
    with open(path, encoding="utf-8") as f:
        return json.load(f)


def write_atomic(path: str | os.PathLike, text: str) -> Path:
    """Write ``text`` (UTF-8) to ``path`` through a temporary file in the same folder, fsynced and
    renamed over it (``os.replace``), with the mode ``open()`` gives (:func:`mkstemp_readable`):
    a crash or a full disk leaves the old file as it was and no temporary file behind.

    Returns:
        ``path`` as a :class:`~pathlib.Path`.

    Raises:
        helpers.support.run_guard.DiskFullError: the disk filled up (``ENOSPC``); the message names the folder.
    """
    path = Path(path)
    with explain_disk_full(path.parent, len(text.encode()), f"writing {path.name}",
                           "write the run into a folder on another disk"):
        fd, tmp = mkstemp_readable(path.parent, f".{path.name}.", ".tmp")
        try:
            with os.fdopen(fd, "w", encoding="utf-8") as f:
                f.write(text)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, path)
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise
    return path


def write_json(path: str | os.PathLike, data: Any) -> Path:
    """``data`` as indented JSON with sorted keys, written by :func:`write_atomic`."""
    return write_atomic(path, json.dumps(data, indent=2, sort_keys=True) + "\n")


def load_summary(run_dir: str | os.PathLike) -> dict[str, dict[str, Any]]:
    """``summary.json`` of a run as a dict (empty when nothing was recorded yet); in a notebook the
    series runner executes, with that notebook's results so far in place of its last good ones."""
    summary = _read_json(Path(run_dir) / SUMMARY_FILE)
    pending = attempt_results(run_dir)
    if pending is not None:
        summary.update(_read_json(pending))
    return summary


def record(run_dir: str | os.PathLike, notebook: str, name: str, value: Any) -> Any:
    """Store ``value`` as ``summary[notebook][name]`` in the run's ``summary.json``.

    The file is rewritten atomically (temporary file + rename), so a crash never leaves
    a half-written summary. Returns ``value`` so a notebook can record and show in one line.
    In a notebook the series runner executes, the value goes to the attempt's file
    (:data:`ATTEMPT_ENV`) instead, and into ``summary.json`` when the notebook succeeds.

    Args:
        run_dir: the run folder.
        notebook: the notebook's stem, e.g. ``"01_data_preprocessing"``.
        name: the result's name, e.g. ``"tokens_per_second"``; units belong in the name.
        value: anything JSON can hold (numpy/torch scalars are converted).

    Raises:
        TypeError: ``value`` cannot be stored as JSON.
        helpers.support.run_guard.DiskFullError: the disk is full (the file stays as it was).
    """
    record_many(run_dir, notebook, {name: value})
    return value


def start_attempt(folder: str | os.PathLike, notebook_name: str) -> tuple[Path, Path]:
    """``(executed notebook, results file)`` of a new attempt at ``notebook_name`` (``NN_stem.ipynb``)
    in ``folder`` (the runner's ``executed/last-attempt/``); an earlier failed attempt at the same
    notebook is removed, since this one replaces it."""
    folder, stem = Path(folder), Path(notebook_name).stem
    folder.mkdir(parents=True, exist_ok=True)
    notebook, pending = folder / notebook_name, folder / f"{stem}.results.json"
    notebook.unlink(missing_ok=True)
    pending.unlink(missing_ok=True)
    figures = _attempt_figures(pending)
    if figures.is_dir():
        for old in figures.iterdir():
            old.unlink()
    return notebook, pending


def attempt_env(pending: str | os.PathLike):
    """A context manager: :data:`ATTEMPT_ENV` is ``pending`` for the block, so a kernel started in it records there."""
    return environ(ATTEMPT_ENV, str(pending))


def record_many(run_dir: str | os.PathLike, notebook: str, values: Mapping[str, Any]) -> dict[str, Any]:
    """:func:`record` for several results at once (one write): a notebook's recording cell at its end.

    Returns:
        ``values``. Raises as :func:`record`.
    """
    folder = run_path(run_dir)
    target = attempt_results(folder) or folder / SUMMARY_FILE
    data = _read_json(target)
    data.setdefault(notebook, {}).update({name: _jsonable(value) for name, value in values.items()})
    write_json(target, data)
    return dict(values)


def commit_attempt(run_dir: str | os.PathLike, pending: str | os.PathLike) -> dict[str, dict[str, Any]]:
    """Make a successful attempt's results the run's: each notebook section of ``pending`` replaces that
    section of ``summary.json`` (a rerun's results, not a mix with the last run's), and its figures
    (``{stem}.figures/`` beside ``pending``) replace those of the same name in ``figures/``.
    ``pending`` and the figures folder are removed.

    Returns:
        The new summary.
    """
    folder, pending = Path(run_dir).expanduser().resolve(), Path(pending)
    summary = _read_json(folder / SUMMARY_FILE)
    summary.update(_read_json(pending))
    write_json(folder / SUMMARY_FILE, summary)
    pending.unlink(missing_ok=True)
    figures = _attempt_figures(pending)
    if figures.is_dir():
        (folder / "figures").mkdir(exist_ok=True)
        for path in figures.iterdir():
            os.replace(path, folder / "figures" / path.name)
        figures.rmdir()
    return summary


def _attempt_figures(pending: Path) -> Path:
    """Where an attempt's figures wait: ``{stem}.figures/`` beside its results file."""
    return pending.with_name(pending.name.replace(".results.json", ".figures"))


def mkstemp_readable(folder: str | os.PathLike, prefix: str, suffix: str = "") -> tuple[int, str]:
    """``tempfile.mkstemp`` in ``folder`` for an atomic write, with the mode ``open()`` would give.

    mkstemp creates files with mode 0600; after ``os.replace`` the run folder's JSON files
    would be unreadable to anyone but their writer (a workshop's shared run folder, a
    container writing as root). This sets 0666 minus the umask, as a plain ``open()`` does.

    Returns:
        ``(fd, path)`` as ``tempfile.mkstemp``.
    """
    fd, tmp = tempfile.mkstemp(dir=folder, prefix=prefix, suffix=suffix)
    os.fchmod(fd, 0o666 & ~_umask())
    return fd, tmp


def default_modes(folder: str | os.PathLike) -> Path:
    """Give ``folder`` and everything in it the modes ``mkdir`` and ``open()`` give: 0777 / 0666 minus the umask.

    For a folder built under a temporary name and moved into place whole: ``tempfile.mkdtemp``
    makes it 0700 and safetensors 0.8 writes ``model.safetensors`` as 0600, so other users, a web
    server or a container of another uid could not read the result. Files lose any execute bit.

    Returns:
        ``folder`` as a :class:`~pathlib.Path`.
    """
    folder, umask = Path(folder), _umask()
    for path in [*folder.rglob("*"), folder]:
        path.chmod((0o777 if path.is_dir() else 0o666) & ~umask)
    return folder


def _umask() -> int:
    """The process's umask (reading it means setting it, so it is set back at once)."""
    umask = os.umask(0)
    os.umask(umask)
    return umask


def _figure_path(run_dir: str | os.PathLike, name: str) -> Path:
    """Where figure ``name`` (without extension) of this run is saved: ``<run>/figures/<name>.png``
    (in a notebook the series runner executes, the attempt's folder until the notebook succeeds)."""
    pending = attempt_results(run_path(run_dir))
    folder = run_path(run_dir) / "figures" if pending is None else _attempt_figures(pending)
    folder.mkdir(parents=True, exist_ok=True)
    return folder / f"{name}.png"


def save_figure(fig, run_dir: str | os.PathLike, name: str) -> Path:
    """Save a matplotlib figure as ``<run>/figures/<name>.png`` (150 dpi) and return that path.

    In a notebook the series runner executes, the file waits in the attempt's folder and moves to
    that path when the notebook succeeds (:func:`commit_attempt`); the returned path is where it lands.
    """
    fig.savefig(_figure_path(run_dir, name), dpi=150, bbox_inches="tight")
    return run_path(run_dir) / "figures" / f"{name}.png"


def markdown_table(rows: Sequence[Mapping[str, Any]] | Iterable[Sequence[Any]],
                   headers: Sequence[str] | None = None, *, digits: int = 4) -> str:
    """A Markdown table (for ``IPython.display.Markdown``): the series' one table formatter.

    Args:
        rows: dicts sharing their keys (the keys are the headers), or sequences with ``headers``.
        headers: column names; default the first dict's keys.
        digits: significant digits of float cells (``0.000123`` -> ``0.000123``, ``1234.5`` -> ``1234``).

    Raises:
        ValueError: no rows and no headers, or sequences without ``headers``; a row with more or
            fewer cells than headers (the message names the row and both lengths).
    """
    rows = list(rows)
    if headers is None:
        if not rows or not isinstance(rows[0], Mapping):
            raise ValueError("markdown_table needs dict rows, or headers= for sequence rows")
        headers = list(rows[0])
    if rows and isinstance(rows[0], Mapping):
        rows = [[r.get(h, "") for h in headers] for r in rows]
    for i, row in enumerate(rows):
        if len(row) != len(headers):
            raise ValueError(f"markdown_table: row {i} has {len(row)} cells but there are {len(headers)} headers "
                             f"{list(headers)}: give every row one cell per header (row {i} is {list(row)!r})")

    def cell(v: Any) -> str:
        if isinstance(v, float) and not isinstance(v, bool):
            return f"{v:.{digits}g}" if v == 0 or abs(v) < 10 ** digits else f"{v:.0f}"
        return str(v).replace("|", "\\|")

    lines = ["| " + " | ".join(map(str, headers)) + " |", "|" + " --- |" * len(headers)]
    lines += ["| " + " | ".join(cell(c) for c in row) + " |" for row in rows]
    return "\n".join(lines)
