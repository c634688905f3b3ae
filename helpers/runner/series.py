"""Run the notebook series with papermill (``make tutorial``): profiles, parameter overrides, one run folder.

Command line::

    python -m helpers.runner.series run --profile cpu -p train_iters=500 [--only 01 02]
    python -m helpers.runner.series params                            # every notebook's parameters
    python -m helpers.runner.series solutions --run-dir runs/latest   # the exercises' solutions

Each notebook runs in order into ``runs/<name>/executed/`` (first into ``executed/last-attempt/``, so a
failed rerun destroys nothing); ``runs/latest`` points at the newest run. :data:`PRODUCES` and :data:`NEEDS`
are the one place that knows the order of the stages: ``run --only 06`` and a notebook opened alone
(:func:`require`) run the missing ones first. Profiles and ``-p``: :mod:`helpers.runner.parameters`.
"""

from __future__ import annotations

import argparse
import ast
import logging
import os
import signal
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any, Iterable

from helpers.runner import data_stage, report, timings, widget_text
from helpers.support import results, run_guard
from helpers.runner.parameters import (PROFILES, RUNNER_PARAMETERS, ParameterError, notebook_parameters,  # noqa: F401
                                parse_override, resolve_parameters)  # (re-exported: the runner's API)

ROOT = Path(__file__).resolve().parents[2]
NOTEBOOK_DIR = ROOT / "notebooks"
SOLUTIONS_DIR = NOTEBOOK_DIR / "solutions"
RUNS_DIR = ROOT / "runs"
#: A series notebook's file name: ``NN_name.ipynb``, or ``NNb_name.ipynb`` for one inserted after NN (05b).
NOTEBOOK_GLOB = "[0-9][0-9]*_*.ipynb"

#: The files of a run folder that each notebook makes for later notebooks.
PRODUCES: dict[str, tuple[str, ...]] = {
    "01_data_preprocessing": ("data/data_manifest.json",),
    "03_training": ("checkpoints/latest_checkpointed_iteration.txt", "training_summary.json"),
    "06_conversion": ("hf_model/config.json",),
}

#: The notebooks whose files each notebook reads (direct needs; :func:`stages_needed` follows them).
NEEDS: dict[str, tuple[str, ...]] = {
    "02_data_loader": ("01_data_preprocessing",),
    "03_training": ("01_data_preprocessing",),
    "04_fused_kernels": ("01_data_preprocessing",),  # section 11 times the training loop on notebook 01's data
    "05_parallelism": ("01_data_preprocessing",),
    "05b_memory_toolbox": ("01_data_preprocessing",),
    "06_conversion": ("01_data_preprocessing", "03_training"),
    "07_evaluation": ("01_data_preprocessing", "03_training", "06_conversion"),
}

#: The lock file a series runner holds in its run folder for the whole run (a second runner is refused),
#: and the variable that tells the notebooks' kernels which folder their runner holds.
RUNNER_LOCK = "series.lock"
RUNNER_ENV = "HELPERS_SERIES_RUN_DIR"

#: Where a notebook is executed until it succeeds: ``{run}/executed/last-attempt/`` (see the module's docstring).
ATTEMPT_DIR = "last-attempt"

#: Seconds each notebook took in a measured run of a profile (the cpu profile's: ``data/measured_cpu_run.json``,
#: :mod:`helpers.runner.timings`). The runner prints the time left from them while it runs; a profile without a
#: measurement gets no estimate.
MEASURED_SECONDS: dict[str, dict[str, float]] = {"cpu": timings.notebook_seconds()}
#: Seconds between two progress lines of a notebook that is still running.
HEARTBEAT_S = 30.0
#: The run folder this process is running notebooks in (named by the message after Ctrl-C).
_running_folder: Path | None = None

#: Per-cell timeout (seconds) for papermill, by profile.
CELL_TIMEOUT_S = {"smoke": 600, "cpu": 1800, "cpu-long": 7200, "gpu": 7200, "codeparrot-small": None}


class NotebookError(RuntimeError):
    """A notebook failed: the message names it, the failing cell, the error (a training failure's
    rank, exception and files) and the partly executed notebook, which is kept."""


@dataclass
class NotebookRun:
    """One executed notebook: its stem, output path and wall time in seconds."""

    stem: str
    output: Path
    wall_seconds: float


def default_profile() -> str:
    """``gpu`` when a CUDA GPU is visible, else ``cpu``; ``codeparrot-small`` (the guide's 12-hour
    recipe) only when asked for."""
    try:
        import torch

        return "gpu" if torch.cuda.is_available() else "cpu"
    except ImportError:
        return "cpu"


def notebooks(notebook_dir: Path | None = None) -> list[Path]:
    """The series' notebooks (:data:`NOTEBOOK_GLOB`) in reading order (default: ``notebooks/``)."""
    return sorted((notebook_dir or NOTEBOOK_DIR).glob(NOTEBOOK_GLOB))


def stages_needed(stem: str, run_dir: str | os.PathLike) -> list[str]:
    """The notebooks (in series order) to run before ``stem`` because their files are missing.

    Follows :data:`NEEDS` transitively (06 needs 03, which needs 01); a stage whose files in
    :data:`PRODUCES` all exist in ``run_dir`` is not needed again.
    """
    folder = Path(run_dir).expanduser()
    todo: set[str] = set()

    def visit(s: str) -> None:
        for need in NEEDS.get(s, ()):
            if not all((folder / f).exists() for f in PRODUCES.get(need, ())):
                todo.add(need)
                visit(need)

    visit(stem)
    return sorted(todo)


def require(stem: str, run_dir: str | os.PathLike, profile: str | None = None, *, build: bool = True) -> Path:
    """Make sure the files notebook ``stem`` reads are in ``run_dir``; run the missing stages.

    The first code cell of notebooks 02, 03, 05 and 06 calls this. Under the runner everything is in place;
    opened alone in Jupyter, it runs each missing notebook as ``python -m helpers.runner.series run --only NN``
    would, into ``{run_dir}/executed/`` with ``profile`` (default :func:`default_profile`).

    Args:
        stem: the calling notebook, e.g. ``"06_conversion"``.
        build: ``False``: do not run anything; raise with the command instead.

    Returns:
        The run folder, resolved.

    Raises:
        NotADirectoryError: ``run_dir`` is a file.
        FileNotFoundError: (``build=False``) a needed stage is missing; the message is the command.
    """
    folder = Path(run_dir).expanduser().resolve()
    if folder.exists() and not folder.is_dir():
        raise NotADirectoryError(f"run_dir={str(run_dir)!r} is a file, not a run folder: pass a folder "
                                 f"(the series' default is ../runs/latest)")
    missing = stages_needed(stem, folder)
    if not missing:
        return folder
    profile = profile or default_profile()
    numbers = " ".join(m.split("_")[0] for m in missing)
    command = f"python -m helpers.runner.series run --profile {profile} --run-dir {folder} --only {numbers}"
    if not build:
        files = [f for m in missing for f in PRODUCES.get(m, ())]
        raise FileNotFoundError(f"{stem} reads {files} from {folder}, made by {missing}: run\n  {command}")
    print(f"{stem} needs {', '.join(missing)} first (their files are not in {folder}); running:\n  {command}", flush=True)
    run(profile, run_dir=folder, only=missing)
    return folder


def _point_latest(run_folder: Path) -> None:
    latest = run_folder.parent / "latest"
    tmp = run_folder.parent / f".latest.{os.getpid()}"
    if tmp.is_symlink() or tmp.exists():
        tmp.unlink()
    tmp.symlink_to(run_folder.name)
    os.replace(tmp, latest)


def run(
    profile: str | None = None,
    overrides: dict[str, Any] | None = None,
    *,
    run_dir: str | os.PathLike | None = None,
    only: Iterable[str] | None = None,
    log_output: bool = False,
) -> list[NotebookRun]:
    """Execute the series (or ``only`` some notebooks) with papermill into one run folder.

    Args:
        profile: a key of :data:`PROFILES`; ``None`` picks the profile ``run_dir`` was made with, else
            :func:`default_profile`.
        run_dir: default ``runs/<profile>-<timestamp>``; ``runs/latest`` points at it when it lies in
            ``runs/`` (for an ``only`` run, only when there is no ``runs/latest`` yet). A reused folder's
            artifacts are reused.
        only: notebook numbers or stems to run (``["01", "02"]``); default all.

    Returns:
        One :class:`NotebookRun` per executed notebook.

    Raises:
        ParameterError: bad profile or parameter (before anything runs).
        NotebookError: a cell failed; the message names the notebook, the cell and the error; the partly
            executed notebook stays in ``executed/last-attempt/``, the last good one in place.
        helpers.support.run_guard.RunFolderNotWritableError: the run folder cannot be written (nothing started).
        helpers.support.run_guard.RunFolderBusyError: another series runner is running in the folder (nothing started).
        helpers.support.run_guard.DiskFullError: too little free space for notebook 03's checkpoints
            (nothing started), or the disk filled up while a notebook was written.
    """
    if profile is None and run_dir is not None:  # a run folder keeps its profile: its data and checkpoints are that shape
        profile = results.load_summary(Path(run_dir).expanduser()).get(report.SECTION, {}).get("start", {}).get("profile")
        if profile:
            print(f"Profile {profile}: the one {Path(run_dir).expanduser()} was made with (--profile chooses another)", flush=True)
    profile = profile or default_profile()
    selected = _select(notebooks(), only)
    if not selected:
        raise ParameterError(f"no notebooks NN_*.ipynb found in {NOTEBOOK_DIR}")
    if run_dir is None:
        run_dir = RUNS_DIR / f"{profile}-{datetime.now():%Y%m%d-%H%M%S}"
    folder = run_guard.check_writable(run_dir)  # a read-only folder: refused before anything is made
    stems = {p.stem for p in selected}
    before = sorted({s for p in selected for s in stages_needed(p.stem, folder)} - stems)
    if before:
        print(f"Also running {', '.join(before)} first: the selected notebooks read their files, "
              f"which {folder} lacks.", flush=True)
        selected = sorted(selected + [p for p in notebooks() if p.stem in before])
    params = resolve_parameters(selected, profile, overrides, run_dir=str(folder))  # before any file is made
    plan = _print_preflight(selected, params, folder)  # refuses a run that repeats its data too often, if the data exists
    results.run_path(folder)
    held = os.environ.get(RUNNER_ENV) == str(folder)  # a notebook of this very runner, running stages it needs
    with run_guard.run_folder_lock(folder, name=RUNNER_LOCK, doing="run by another series runner", enabled=not held), \
            run_guard.environ(RUNNER_ENV, str(folder)):
        return _run_notebooks(folder, selected, params, plan, profile, overrides, only, log_output)


def _run_notebooks(folder: Path, selected: list[Path], params: dict[str, dict[str, Any]], plan, profile: str,
                   overrides: dict[str, Any] | None, only: Iterable[str] | None, log_output: bool) -> list[NotebookRun]:
    """The body of :func:`run`, under the run folder's runner lock: each notebook, attempt by attempt."""
    global _running_folder
    _running_folder = folder
    report.record_start(folder, profile=profile, overrides=overrides, notebooks=[p.stem for p in notebooks()])
    latest = RUNS_DIR / "latest"
    if folder.parent.resolve() == RUNS_DIR.resolve() and (only is None or not (latest.is_symlink() or latest.exists())):
        _point_latest(folder)  # a partial run (--only) does not take runs/latest from a complete one
    executed = folder / "executed"
    executed.mkdir(exist_ok=True)
    timeout = CELL_TIMEOUT_S.get(profile, 1800)
    done: list[NotebookRun] = []
    print(f"Run folder: {folder}  (profile {profile}, {len(selected)} notebooks)", flush=True)
    for i, path in enumerate(selected, 1):
        output = executed / path.name
        if path.stem == "03_training" and plan is not None and plan.epochs is None:
            _print_preflight(selected, params, folder)  # notebook 01 has made the data now: the epochs are known
        print(f"[{i}/{len(selected)}] {path.stem} ...", flush=True)
        attempt, pending = results.start_attempt(executed / ATTEMPT_DIR, path.name)
        measured = MEASURED_SECONDS.get(profile, {})
        after = sum(measured.get(p.stem, 0.0) for p in selected[i:]) if measured else None
        try:
            with results.attempt_env(pending), _heartbeat(path.stem, attempt, measured.get(path.stem), after):
                wall = _execute(path, attempt, params[path.stem], timeout, log_output, last_good=output)
        except NotebookError:
            _report_card(report.write, folder)  # what the run has so far; "finished: never"
            raise
        results.commit_attempt(folder, pending)  # it succeeded: its results and figures become the run's
        if attempt.exists():
            os.replace(attempt, output)
        _keep_kernel_log(attempt, output)
        if not any(attempt.parent.iterdir()):  # no failed attempt at another notebook is kept there
            attempt.parent.rmdir()
        results.record(folder, path.stem, "wall_seconds", round(wall, 2))
        done.append(NotebookRun(path.stem, output, wall))
        print(f"[{i}/{len(selected)}] {path.stem} done in {wall:.1f} s", flush=True)
    total = sum(r.wall_seconds for r in done)
    print(f"\nSeries done in {total:.1f} s.")
    print(f"  executed notebooks: {executed}")
    print(f"  figures:            {folder / 'figures'}")
    print(f"  results:            {folder / results.SUMMARY_FILE}")
    print(f"  report card:        {_report_card(report.finish, folder)}")
    return done


def progress_line(stem: str, elapsed: float, cells: tuple[int, int] | None, expected: float | None,
                  after: float | None) -> str:
    """The runner's line for a notebook still running: its time so far, the code cell it is at, and the time
    left for the series from :data:`MEASURED_SECONDS` (this notebook's rest plus the ones after it); past its
    measured time, the line says so instead of a frozen count."""
    line = f"    {stem}: {elapsed:.0f} s"
    if cells:
        line += f", code cell {cells[0]} of {cells[1]}"
    if expected is not None and after is not None and elapsed <= expected:
        line += f"; the series: about {expected - elapsed + after:.0f} s left (times measured on a 2-core laptop)"
    elif expected is not None and after is not None:  # a slower or busier machine: still running, not hung
        line += (f"; past its measured {expected:.0f} s (a slower or busier machine than the 2-core laptop), "
                 f"then about {after:.0f} s for the notebooks after it")
    return line


def _cells_done(path: Path) -> tuple[int, int] | None:
    """(code cells papermill finished + 1, code cells) of a notebook it is writing, or None while unreadable."""
    import nbformat

    try:
        nb = nbformat.read(str(path), as_version=4)
    except Exception:  # papermill is writing it, or has not yet: no cell count this time
        return None
    code = [c for c in nb.cells if c.cell_type == "code"]
    done = sum(c.metadata.get("papermill", {}).get("status") == "completed" for c in code)
    return (min(done + 1, len(code)), len(code)) if code else None


class _heartbeat:
    """A daemon thread printing :func:`progress_line` every :data:`HEARTBEAT_S` while a notebook runs."""

    def __init__(self, stem: str, output: Path, expected: float | None, after: float | None):
        import threading

        self.args, self.stop = (stem, output, expected, after), threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        stem, output, expected, after = self.args
        start = time.perf_counter()
        while not self.stop.wait(HEARTBEAT_S):
            print(progress_line(stem, time.perf_counter() - start, _cells_done(output), expected, after), flush=True)

    def __enter__(self):
        self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop.set()
        self.thread.join(timeout=5)


def _select(paths: list[Path], only: Iterable[str] | None, what: str = "notebook") -> list[Path]:
    """The ``paths`` whose stem or number (``"01"``) is in ``only`` (all when it is empty).

    Raises:
        ParameterError: ``only`` names none of them.
    """
    wanted = [str(o) for o in only or ()]
    selected = [p for p in paths if not wanted or any(p.stem == w or p.stem.split("_")[0] == w for w in wanted)]
    if wanted and not selected:
        raise ParameterError(f"--only {wanted}: no such {what}; have {[p.stem for p in paths]}")
    return selected


def _execute(path: Path, output: Path, parameters: dict[str, Any], timeout: int | None, log_output: bool,
             last_good: Path | None = None) -> float:
    """Execute one notebook with papermill (cwd: its folder; kernel over IPC sockets) into ``output``.

    Returns:
        The wall time in seconds.

    Raises:
        NotebookError: a cell failed, the kernel died or a cell ran past ``timeout`` seconds; the
            message names ``output`` (run up to the failing cell) and ``last_good`` when it exists.
        helpers.support.run_guard.DiskFullError: the disk filled up while papermill wrote ``output``.
    """
    import papermill
    from nbclient.exceptions import CellTimeoutError, DeadKernelError

    start = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="kernel-") as ipc_dir, run_guard.explain_disk_full(
            output.parent, None, f"notebook {path.stem} (its executed notebook {output}, kept as it is: not a result)",
            "write the run into a folder on another disk (--run-dir)"):
        try:
            papermill.execute_notebook(
                str(path), str(output), parameters=parameters, cwd=str(path.parent),
                kernel_name="python3", progress_bar=False, log_output=log_output,
                execution_timeout=timeout, kernel_manager_class=_ipc_kernel_manager(Path(ipc_dir), output.with_suffix(".kernel.log")),
            )
        except (papermill.PapermillExecutionError, DeadKernelError, CellTimeoutError) as err:
            raise NotebookError(_failure_text(path.stem, err, output, last_good)) from None
    widget_text.rewrite(output)  # progress bars saved at their end, not frozen at 0 %
    return time.perf_counter() - start


def solutions(solution_dir: Path | None = None) -> list[Path]:
    """The solutions notebooks ``solutions/NN_name.ipynb`` (one per notebook, same stem), in order."""
    return notebooks(solution_dir or SOLUTIONS_DIR)


def run_solutions(run_dir: str | os.PathLike, profile: str | None = None, *, only: Iterable[str] | None = None,
                  workers: int = 1, log_output: bool = False) -> list[NotebookRun]:
    """Execute the solutions notebooks against a run folder, into ``{run_dir}/executed/solutions/``.

    Each reads the run's files (running missing stages with ``profile``, like :func:`require`) and writes
    only under ``{run_dir}/solutions/``.

    Args:
        only: notebook numbers or stems (``["01"]``); default all.
        workers: notebooks run at a time (2 on 2 cores overlaps their imports); with more than 1, the
            stages the solutions read (01, 03, 06) are made first.

    Returns:
        One :class:`NotebookRun` per executed solutions notebook, in order.

    Raises:
        ParameterError: ``run_dir`` is not a run folder (no summary), ``workers < 1``, or ``only`` names
            no solutions notebook.
        NotebookError: a solution failed (its assertion, or an error); the message names the cell.
    """
    folder = Path(run_dir).expanduser().resolve()
    if not (folder / results.SUMMARY_FILE).is_file():  # the runner writes it first: an empty folder is no run
        raise ParameterError(f"run_dir={str(run_dir)!r} is not a run folder (no {results.SUMMARY_FILE}): run the series "
                             "first (make tutorial) or pass --run-dir with the folder of a run")
    if workers < 1:
        raise ParameterError(f"workers={workers}: run at least 1 notebook at a time (2 on 2 cores)")
    recorded = results.load_summary(folder).get(report.SECTION, {}).get("start", {}).get("profile")
    profile = profile or recorded or default_profile()
    selected = _select(solutions(), only, "solutions notebook")
    executed = folder / "executed" / "solutions"
    executed.mkdir(parents=True, exist_ok=True)
    if workers > 1:  # the stages every solution may read, made once before the notebooks run side by side
        require("07_evaluation", folder, profile)

    def one(path: Path) -> NotebookRun:
        print(f"solutions of {path.stem} ...", flush=True)
        wall = _execute(path, executed / path.name, {"run_dir": str(folder), "profile": profile},
                        CELL_TIMEOUT_S.get(profile, 1800), log_output)
        print(f"solutions of {path.stem} done in {wall:.1f} s", flush=True)
        return NotebookRun(path.stem, executed / path.name, wall)

    start = time.perf_counter()
    with ThreadPoolExecutor(max_workers=workers) as pool:  # each notebook has its own kernel process
        done = list(pool.map(one, selected))
    print(f"{len(done)} solutions notebooks ran in {time.perf_counter() - start:.1f} s ({workers} at a time): {executed}")
    return done


def _print_preflight(selected: list[Path], params: dict[str, dict[str, Any]], folder: Path):
    """Print notebook 03's preflight (:mod:`helpers.runner.preflight`) for the parameters it will get.

    Returns:
        The :class:`helpers.runner.preflight.Preflight`, or None when notebook 03 is not selected.

    Raises:
        ParameterError: the data exists and the run would read it more than ``max_epochs`` times;
            values no run can have (a global batch that does not divide, ``train_iters=0``...);
            data that cannot be read.
        helpers.support.run_guard.DiskFullError: the run's checkpoints would not fit on the disk.
    """
    from helpers.runner import preflight
    from helpers.learn import preprocess

    path = next((p for p in selected if p.stem == "03_training"), None)
    if path is None:
        return None
    values = {n: ast.literal_eval(i["default"]) for n, i in notebook_parameters(path).items()} | params[path.stem]
    try:
        vocab = data_stage.data_paths(folder).vocab_size
    except FileNotFoundError:  # notebook 01 runs first: its vocab_size parameter
        first = next(p for p in notebooks() if p.stem == "01_data_preprocessing")
        vocab = params.get(first.stem, {}).get("vocab_size") or ast.literal_eval(notebook_parameters(first)["vocab_size"]["default"])
    try:
        plan = preflight.plan_for_parameters(values, vocab, folder)
        print("Preflight of 03_training (helpers/runner/preflight.py):\n  " + plan.text().replace("\n", "\n  "), flush=True)
        preflight.check_repeats(plan, values.get("max_epochs", preflight.MAX_EPOCHS))
        preflight.check_disk(plan, folder)
    except (preflight.RepeatedDataError, preprocess.DamagedDataError) as err:
        raise ParameterError(str(err)) from None
    except run_guard.DiskFullError:
        raise
    except (TypeError, ValueError, OSError) as err:  # values no run can have, unreadable data: before anything runs
        raise ParameterError(f"notebook 03 cannot train with these parameters: {err}") from None
    return plan


def _report_card(write, folder: Path) -> Path | str:
    """Write the report card; a failure to write it is printed, never raised (the run's own
    results stand): ``python -m helpers.runner.report FOLDER`` writes it again."""
    try:
        return write(folder)
    except Exception as err:  # noqa: BLE001 - the report must not fail a finished run
        print(f"report card not written ({type(err).__name__}: {err}); once fixed, run "
              f"python -m helpers.runner.report {folder}", flush=True)
        return "not written"


def _keep_kernel_log(attempt: Path, output: Path) -> None:
    """Move a successful attempt's kernel log beside its executed notebook (removed when empty)."""
    log = attempt.with_suffix(".kernel.log")
    if log.exists() and log.stat().st_size:
        os.replace(log, output.with_suffix(".kernel.log"))
    elif log.exists():
        log.unlink()


def _ipc_kernel_manager(folder: Path, stderr_log: Path | None = None):
    """A jupyter_client ``KernelManager`` that talks to its kernel over local IPC sockets in
    ``folder`` instead of TCP: no ports, and no "Kernel is running over TCP without encryption"
    warning from every notebook's kernel (ipykernel 7). The kernel process's own stderr (its log, not
    the cells' output) goes to ``stderr_log``: after Ctrl-C it reports the channels closing under it
    (``zmq.error.ZMQError: Socket operation on non-socket``), which is no error of the notebook."""
    from jupyter_client.manager import AsyncKernelManager  # async: nbclient then sees a dead kernel and cell timeouts

    class IPCKernelManager(AsyncKernelManager):
        def __init__(self, **kwargs):
            kwargs.update(transport="ipc", ip=str(folder / "kernel"))
            super().__init__(**kwargs)

        async def start_kernel(self, **kw):
            if stderr_log is None:
                return await super().start_kernel(**kw)
            with open(stderr_log, "ab") as log:  # the kernel holds its own copy of the descriptor
                return await super().start_kernel(stderr=log, **kw)

    return IPCKernelManager


def _failure_text(stem: str, err, output: Path, last_good: Path | None = None) -> str:
    """What a failed notebook prints last: the notebook, its cell, the error without the job's log
    tail (``helpers.runner.launch.LaunchError`` puts the rank, exception and files after it), the
    executed notebook, and the last good one that stays in place."""
    where = f"  executed notebook (run up to the failing cell): {output}"
    pending = output.parent / f"{stem}.results.json"
    if last_good is not None and output != last_good:
        where += ((f"\n  its results so far: {pending} (not in {results.SUMMARY_FILE})" if pending.exists() else "")
                  + (f"\n  the last good run of {stem} is kept: {last_good} and its results in {results.SUMMARY_FILE}"
                     if last_good.exists() else ""))
    if not hasattr(err, "evalue"):  # the kernel died or a cell ran past its timeout
        log = output.with_suffix(".kernel.log")
        where += f"\n  the kernel's own log: {log}" if log.exists() and log.stat().st_size else ""
        return f"notebook {stem} failed: {type(err).__name__}: {err}\n{where}"
    value = str(err.evalue)
    if "\n--- last lines of the log ---\n" in value:
        head, rest = value.split("\n--- last lines of the log ---\n", 1)
        value = head + ("\n" + rest.split("\n--- the failure ---\n", 1)[1] if "\n--- the failure ---\n" in rest else "")
    cell = f"cell In [{err.exec_count}]" if err.exec_count else f"cell {err.cell_index} (0-based)"
    body = "\n".join("  " + line for line in value.splitlines())
    return f"notebook {stem} failed in {cell}: {err.ename}\n{body}\n{where}"


def _mute_on_interrupt(signum, frame) -> None:
    """Ctrl-C: mute what the notebook machinery reports on its way down (nbclient's "Kernel died while
    waiting for execute reply", asyncio's "Task exception was never retrieved" when that task is
    collected), then raise KeyboardInterrupt as Python's own handler does: the runner prints its message."""
    for name in ("asyncio", "papermill", "traitlets", "nbclient"):
        logging.getLogger(name).disabled = True
    raise KeyboardInterrupt


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m helpers.runner.series", description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    run_p = sub.add_parser("run", help="execute the notebooks with papermill")
    run_p.add_argument("--profile", choices=sorted(PROFILES), default=None,
                       help="parameter profile (default: the one --run-dir was made with, else gpu with a GPU, else cpu; codeparrot-small is the guide's full run)")
    run_p.add_argument("-p", "--param", action="append", default=[], metavar="NAME=VALUE",
                       help="override a notebook parameter (NAME or NN_stem.NAME); repeatable")
    run_p.add_argument("--run-dir", default=None, help="run folder (default runs/<profile>-<time>)")
    run_p.add_argument("--only", nargs="+", default=None, metavar="NN", help="run only these notebooks")
    run_p.add_argument("--log-output", action="store_true", help="stream cell output")
    sol_p = sub.add_parser("solutions", help="execute the exercises' solutions against a run folder")
    sol_p.add_argument("--run-dir", default=str(RUNS_DIR / "latest"), help="run folder (default runs/latest)")
    sol_p.add_argument("--profile", choices=sorted(PROFILES), default=None, help="profile of missing stages")
    sol_p.add_argument("--only", nargs="+", default=None, metavar="NN", help="only these notebooks' solutions")
    sol_p.add_argument("--workers", type=int, default=1, help="notebooks run at a time (default 1)")
    sol_p.add_argument("--log-output", action="store_true", help="stream cell output")
    params_p = sub.add_parser("params", help="list every notebook's parameters")
    params_p.add_argument("--profile", choices=sorted(PROFILES), default="cpu")
    args = parser.parse_args(argv)
    own_handler = signal.getsignal(signal.SIGINT) is signal.default_int_handler
    if own_handler:
        signal.signal(signal.SIGINT, _mute_on_interrupt)
    try:
        if args.command == "params":
            for path in notebooks():
                resolved = resolve_parameters([path], args.profile)[path.stem]
                print(path.stem)
                for name, info in notebook_parameters(path).items():
                    value = resolved.get(name, info["default"])
                    print(f"  {name:<24} {value!s:<20} {info.get('inferred_type_name', '')}  {info.get('help', '')}")
            return 0
        if args.command == "solutions":
            run_solutions(args.run_dir, args.profile, only=args.only, workers=args.workers, log_output=args.log_output)
            return 0
        overrides = dict(parse_override(p) for p in args.param)
        run(args.profile, overrides, run_dir=args.run_dir, only=args.only, log_output=args.log_output)
    except (ParameterError, run_guard.RunFolderNotWritableError, run_guard.DiskFullError, run_guard.RunFolderBusyError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        attempt = (_running_folder or Path("<run folder>")) / "executed" / ATTEMPT_DIR
        print(f"\ninterrupted: the notebook that was running is kept as far as it got in {attempt}/ (not a result); "
              "a training run saved a checkpoint on the way out, and the same command resumes from it.", file=sys.stderr)
        return 130
    except NotebookError as err:
        print(f"\nerror: {err}", file=sys.stderr)
        return 1
    finally:
        if own_handler:
            signal.signal(signal.SIGINT, signal.default_int_handler)
    return 0


if __name__ == "__main__":
    sys.exit(main())
