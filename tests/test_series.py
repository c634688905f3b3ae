"""The series runner: profiles, overrides, validation, and a real papermill run of tiny notebooks."""

import time
from pathlib import Path

import nbformat
import pytest
from nbformat.v4 import new_code_cell, new_markdown_cell, new_notebook

from helpers.support import results
from helpers.runner import series


def _notebook(path: Path, params: str, body: str) -> Path:
    nb = new_notebook()
    nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3", "language": "python"}
    cell = new_code_cell(params)
    cell.metadata["tags"] = ["parameters"]
    nb.cells = [new_markdown_cell("# Tiny"), cell, new_code_cell(body)]
    nbformat.write(nb, path)
    return path


@pytest.fixture()
def tiny_series(tmp_path, monkeypatch):
    nbdir = tmp_path / "notebooks"
    nbdir.mkdir()
    _notebook(nbdir / "00_first.ipynb",
              'run_dir: str = "../runs/latest"  # run folder\nprofile: str = "cpu"  # profile\nsteps: int = 3  # steps\n',
              "from helpers.support import results\nresults.record(run_dir, '00_first', 'steps_squared', steps * steps)")
    _notebook(nbdir / "01_second.ipynb",
              'run_dir: str = "../runs/latest"  # run folder\nprofile: str = "cpu"  # profile\nsteps: int = 5  # steps\nrate: float = 0.5  # a rate\n',
              "from helpers.support import results\nresults.record(run_dir, '01_second', 'product', steps * rate)\n"
              "results.record(run_dir, '01_second', 'profile', profile)")
    monkeypatch.setattr(series, "NOTEBOOK_DIR", nbdir)
    monkeypatch.setattr(series, "RUNS_DIR", tmp_path / "runs")
    monkeypatch.setitem(series.PROFILES, "tiny", {"01_second": {"rate": 2.0}, "all": {"steps": 4}})
    return nbdir


def test_parse_override_reads_literals_and_strings():
    assert series.parse_override("train_iters=500") == ("train_iters", 500)
    assert series.parse_override("lr=5e-4") == ("lr", 5e-4)
    assert series.parse_override("flag=True") == ("flag", True)
    assert series.parse_override("source=/data/code") == ("source", "/data/code")
    assert series.parse_override("split=969,30,1") == ("split", "969,30,1")  # was the tuple (969, 30, 1)
    assert series.parse_override("blend_split=90,9,1") == ("blend_split", "90,9,1")
    with pytest.raises(series.ParameterError, match="name=value"):
        series.parse_override("train_iters")


def test_profile_then_overrides_are_applied_per_notebook(tiny_series):
    paths = series.notebooks(tiny_series)
    resolved = series.resolve_parameters(paths, "tiny", {"01_second.steps": 7}, run_dir="/r")
    assert resolved["00_first"] == {"profile": "tiny", "run_dir": "/r", "steps": 4}
    assert resolved["01_second"] == {"profile": "tiny", "run_dir": "/r", "steps": 7, "rate": 2.0}


def test_unknown_parameter_lists_the_valid_names(tiny_series):
    with pytest.raises(series.ParameterError) as err:
        series.resolve_parameters(series.notebooks(tiny_series), "cpu", {"stepz": 1})
    assert "'stepz' is not a parameter" in str(err.value)
    assert "Valid names: rate, steps" in str(err.value)


def test_wrong_type_and_unknown_profile_are_errors(tiny_series):
    paths = series.notebooks(tiny_series)
    with pytest.raises(series.ParameterError, match="steps must be int"):
        series.resolve_parameters(paths, "cpu", {"steps": "many"})
    with pytest.raises(series.ParameterError, match="steps must be int"):
        series.resolve_parameters(paths, "cpu", {"steps": True})
    assert series.resolve_parameters(paths, "cpu", {"rate": 1})["01_second"]["rate"] == 1.0
    with pytest.raises(series.ParameterError, match="profile 'gpu-huge' is unknown"):
        series.resolve_parameters(paths, "gpu-huge")


def test_notebook_without_runner_parameters_is_refused(tmp_path):
    path = _notebook(tmp_path / "00_bad.ipynb", "steps: int = 1  # steps\n", "pass")
    with pytest.raises(series.ParameterError, match=r"no parameter\(s\) \['run_dir', 'profile'\]"):
        series.resolve_parameters([path], "cpu")


def test_cli_reports_bad_names_without_running(tiny_series, capsys):
    assert series.main(["run", "--profile", "cpu", "-p", "bogus=1"]) == 2
    assert "'bogus' is not a parameter" in capsys.readouterr().err
    assert not (tiny_series.parent / "runs").exists()


def test_run_executes_in_order_records_wall_time_and_points_latest(tiny_series, capsys):
    runs_dir = tiny_series.parent / "runs"
    done = series.run("tiny", {"00_first.steps": 6}, run_dir=runs_dir / "t1")
    assert [r.stem for r in done] == ["00_first", "01_second"]
    summary = results.load_summary(runs_dir / "t1")
    assert summary["00_first"]["steps_squared"] == 36
    assert summary["01_second"]["product"] == 8.0
    assert summary["01_second"]["profile"] == "tiny"
    assert all(summary[s]["wall_seconds"] > 0 for s in ("00_first", "01_second"))
    assert (runs_dir / "latest").resolve() == (runs_dir / "t1").resolve()
    assert (runs_dir / "t1" / "executed" / "01_second.ipynb").exists()
    out = capsys.readouterr().out
    assert "[1/2] 00_first done in" in out and "[2/2] 01_second done in" in out


def test_only_selects_by_number(tiny_series):
    done = series.run("tiny", run_dir=tiny_series.parent / "runs" / "t2", only=["01"])
    assert [r.stem for r in done] == ["01_second"]
    with pytest.raises(series.ParameterError, match="no such notebook"):
        series.run("tiny", run_dir=tiny_series.parent / "runs" / "t3", only=["07"])


def test_stages_needed_follows_needs_and_skips_stages_whose_files_exist(tmp_path):
    assert series.stages_needed("06_conversion", tmp_path) == ["01_data_preprocessing", "03_training"]
    assert series.stages_needed("00_container_setup", tmp_path) == []
    assert series.stages_needed("04_fused_kernels", tmp_path) == ["01_data_preprocessing"]  # section 11's loop reads it
    for f in series.PRODUCES["01_data_preprocessing"]:
        (tmp_path / f).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / f).write_text("{}")
    assert series.stages_needed("06_conversion", tmp_path) == ["03_training"]
    assert series.stages_needed("02_data_loader", tmp_path) == [] == series.stages_needed("04_fused_kernels", tmp_path)


def test_require_without_build_names_the_exact_command(tmp_path):
    with pytest.raises(FileNotFoundError) as err:
        series.require("06_conversion", tmp_path, "smoke", build=False)
    text = str(err.value)
    assert f"python -m helpers.runner.series run --profile smoke --run-dir {tmp_path.resolve()} --only 01 03" in text
    assert "data/data_manifest.json" in text
    assert not any(tmp_path.iterdir()), "require(build=False) made files"


def test_every_stage_named_is_a_notebook():
    stems = {p.stem for p in series.notebooks()}
    assert set(series.PRODUCES) <= stems
    assert set(series.NEEDS) <= stems and all(set(v) <= stems for v in series.NEEDS.values())


def test_run_only_a_later_notebook_runs_its_missing_stages_first_and_require_then_finds_them(tiny_series, tmp_path,
                                                                                              monkeypatch):
    """--only 01 in a fresh folder runs 00 first (01 reads 00's file), with the same profile; a
    second call finds the file and runs only what was asked."""
    monkeypatch.setitem(series.PRODUCES, "00_first", ("summary.json",))
    monkeypatch.setitem(series.NEEDS, "01_second", ("00_first",))
    run = tmp_path / "run"
    done = series.run("tiny", run_dir=run, only=["01"])
    assert [r.stem for r in done] == ["00_first", "01_second"]
    assert results.load_summary(run)["00_first"]["steps_squared"] == 16
    assert [r.stem for r in series.run("tiny", run_dir=run, only=["01"])] == ["01_second"]
    assert series.require("01_second", run, "tiny", build=False) == run.resolve()


def test_a_float_override_that_is_not_finite_is_refused(tiny_series):
    assert series.parse_override("rate=1e400") == ("rate", float("inf"))
    with pytest.raises(series.ParameterError, match=r"01_second.rate=inf is not a finite number"):
        series.run("tiny", {"rate": float("inf")})


def test_a_partial_run_does_not_take_runs_latest_from_a_complete_one(tiny_series):
    runs_dir = tiny_series.parent / "runs"
    series.run("tiny", run_dir=runs_dir / "full")
    series.run("tiny", run_dir=runs_dir / "partial", only=["01"])
    assert (runs_dir / "latest").resolve() == (runs_dir / "full").resolve()


def test_a_stem_qualified_unknown_name_lists_that_notebooks_parameters_only(tiny_series):
    with pytest.raises(series.ParameterError) as err:
        series.run("tiny", {"00_first.rate": 1.0})
    assert "Valid names: steps" in str(err.value) and "rate" not in str(err.value).split("Valid names:")[1]


def test_a_failing_notebook_ends_with_its_name_the_cause_and_the_executed_notebook(tiny_series, capfd):
    """Issue 13 item 3: the last lines name the notebook, the rank's exception and its files, and
    where the partly executed notebook is; the job's log tail stays in the log. Item 7: no
    kernel prints "running over TCP without encryption" (the kernels talk over IPC)."""
    _notebook(tiny_series / "02_fails.ipynb",
              'run_dir: str = "../runs/latest"  # run folder\nprofile: str = "cpu"  # profile\n',
              "from helpers.runner.launch import LaunchError\n"
              "raise LaunchError('torchrun job failed: rank 1 exited with an error (exit code 1): EOFError', "
              "'a line of the log tail', failed_rank=1, failure='rank:       rank 1 (the first to fail)\\n"
              "the log of every rank: /x/training.log')")
    run_dir = tiny_series.parent / "runs" / "f1"
    assert series.main(["run", "--profile", "tiny", "--run-dir", str(run_dir), "--only", "02"]) == 1
    captured = capfd.readouterr()
    last = captured.err.strip().splitlines()[-5:]
    assert last[0] == "error: notebook 02_fails failed in cell In [3]: LaunchError"
    assert last[1] == "  torchrun job failed: rank 1 exited with an error (exit code 1): EOFError"
    assert last[2:4] == ["  rank:       rank 1 (the first to fail)", "  the log of every rank: /x/training.log"]
    executed = run_dir.resolve() / "executed" / series.ATTEMPT_DIR / "02_fails.ipynb"  # a failed attempt: not a result
    assert last[4] == f"  executed notebook (run up to the failing cell): {executed}" and executed.exists()
    assert not (run_dir / "executed" / "02_fails.ipynb").exists()
    assert "a line of the log tail" not in captured.err
    assert "without encryption" not in captured.out + captured.err


def test_a_failed_rerun_keeps_the_last_good_notebook_results_and_figures(tiny_series, capfd):
    """Issue 24 item 6: a rerun that fails leaves the finished notebook, its summary entries and its
    figures as they were, and keeps the failed attempt beside them; a rerun that succeeds replaces
    the notebook's entries whole (none of the old run's is left mixed in)."""
    _notebook(tiny_series / "02_rerun.ipynb",
              'run_dir: str = "../runs/latest"  # run folder\nprofile: str = "cpu"  # profile\nfail: bool = False  # fail\n'
              'tag: str = "good"  # the run\n',
              "import matplotlib\nmatplotlib.use('Agg')\nimport matplotlib.pyplot as plt\nfrom helpers.support import results\n"
              "results.record(run_dir, '02_rerun', 'tag', tag)\n"
              "if tag == 'good':\n    results.record(run_dir, '02_rerun', 'only_in_the_first', 1)\n"
              "fig, ax = plt.subplots()\nax.set_title(tag)\nresults.save_figure(fig, run_dir, 'rerun_plot')\n"
              "assert results.load_summary(run_dir)['02_rerun']['tag'] == tag  # a notebook reads its own results back\n"
              "if fail:\n    raise RuntimeError('the rerun fails here')")
    run_dir = tiny_series.parent / "runs" / "r1"
    series.run("tiny", run_dir=run_dir, only=["02"])
    executed, figure = run_dir / "executed" / "02_rerun.ipynb", run_dir / "figures" / "rerun_plot.png"
    good = (executed.read_bytes(), results.load_summary(run_dir)["02_rerun"], figure.read_bytes())
    assert good[1]["tag"] == "good" and good[1]["only_in_the_first"] == 1
    assert not (run_dir / "executed" / series.ATTEMPT_DIR).exists()  # a success leaves no attempt behind

    with pytest.raises(series.NotebookError) as err:
        series.run("tiny", {"fail": True, "tag": "bad"}, run_dir=run_dir, only=["02"])
    attempt = run_dir.resolve() / "executed" / series.ATTEMPT_DIR
    assert f"executed notebook (run up to the failing cell): {attempt / '02_rerun.ipynb'}" in str(err.value)
    assert f"the last good run of 02_rerun is kept: {executed.resolve()}" in str(err.value)
    assert (executed.read_bytes(), results.load_summary(run_dir)["02_rerun"], figure.read_bytes()) == good
    assert '"tag": "bad"' in (attempt / "02_rerun.results.json").read_text()  # the failed attempt, kept to read
    assert (attempt / "02_rerun.figures" / "rerun_plot.png").exists()

    series.run("tiny", {"tag": "new"}, run_dir=run_dir, only=["02"])
    summary = results.load_summary(run_dir)["02_rerun"]
    assert summary["tag"] == "new" and "only_in_the_first" not in summary and summary["wall_seconds"] > 0
    assert figure.read_bytes() != good[2] and executed.read_bytes() != good[0]
    assert not attempt.exists()


def test_a_read_only_run_folder_is_refused_before_anything_starts(tiny_series, tmp_path, capfd):
    """Issue 24 item 2: EROFS/EACCES named with the folder and the fix, not a 34-line traceback."""
    import os

    if os.geteuid() == 0:  # root writes through mode bits; a read-only mount needs a namespace
        pytest.skip("running as root: covered by test_run_folder_faults.py (a read-only mount)")
    ro = tmp_path / "ro"
    ro.mkdir()
    ro.chmod(0o555)
    try:
        for run_dir in (ro, ro / "new"):
            assert series.main(["run", "--profile", "tiny", "--run-dir", str(run_dir), "--only", "00"]) == 2
            err = capfd.readouterr().err
            assert f"the run folder {run_dir} cannot be written" in err and "--run-dir" in err
            assert not (ro / "new").exists()
    finally:
        ro.chmod(0o755)


def test_a_second_runner_on_a_folder_is_refused_and_a_rerun_keeps_the_folders_profile(tiny_series, capfd):
    """Breaker (issue 24): two runners on one folder shared the attempt folder; a fix command without
    --profile ran the default profile over a smoke run's data."""
    from helpers.support import run_guard

    run_dir = tiny_series.parent / "runs" / "lock"
    series.run("tiny", run_dir=run_dir, only=["01"])
    capfd.readouterr()
    with run_guard.run_folder_lock(run_dir, name=series.RUNNER_LOCK, doing="run by another series runner"):
        assert series.main(["run", "--run-dir", str(run_dir), "--only", "01"]) == 2
    err = capfd.readouterr().err
    assert "is being run by another series runner (" in err and "pid " in err and "--run-dir" in err
    series.run(None, run_dir=run_dir, only=["01"])  # no profile: the folder's
    assert "Profile tiny: the one" in capfd.readouterr().out
    assert results.load_summary(run_dir)["01_second"]["product"] == 4 * 2.0  # tiny's steps=4, rate=2.0


def test_require_refuses_a_file_as_run_folder_and_parse_override_an_empty_name(tmp_path):
    afile = tmp_path / "notes.txt"
    afile.write_text("x")
    with pytest.raises(NotADirectoryError, match=r"run_dir='.*notes.txt' is a file, not a run folder"):
        series.require("06_conversion", afile)
    with pytest.raises(series.ParameterError, match="the name before '=' is empty"):
        series.parse_override("=5")


def test_a_dead_kernel_and_a_cell_timeout_end_the_run_naming_the_notebook(tiny_series, monkeypatch):
    """The IPC kernel manager is jupyter_client's async one: with the blocking one nbclient waited
    for ever on a killed kernel and never applied the cell timeout (a breaker found both)."""
    _notebook(tiny_series / "02_dies.ipynb",
              'run_dir: str = "../runs/latest"  # run folder\nprofile: str = "cpu"  # profile\n',
              "import os, signal\nos.kill(os.getpid(), signal.SIGKILL)")
    start = time.monotonic()
    with pytest.raises(series.NotebookError, match=r"notebook 02_dies failed: DeadKernelError"):
        series.run("tiny", run_dir=tiny_series.parent / "runs" / "d1", only=["02"])
    assert time.monotonic() - start < 60
    (tiny_series / "02_dies.ipynb").unlink()
    _notebook(tiny_series / "02_sleeps.ipynb",
              'run_dir: str = "../runs/latest"  # run folder\nprofile: str = "cpu"  # profile\n',
              "import time\ntime.sleep(120)")
    monkeypatch.setitem(series.CELL_TIMEOUT_S, "tiny", 5)
    start = time.monotonic()
    with pytest.raises(series.NotebookError, match=r"notebook 02_sleeps failed: CellTimeoutError"):
        series.run("tiny", run_dir=tiny_series.parent / "runs" / "d2", only=["02"])
    assert time.monotonic() - start < 60


def test_the_runner_says_where_a_long_notebook_is_and_the_time_left(tmp_path, monkeypatch, capsys):
    """Issue 30: while a notebook runs, a line every HEARTBEAT_S: its time, the code cell it is at, and the series'
    time left from the measured times (MEASURED_SECONDS: every notebook of the series, for the cpu profile)."""
    assert set(series.MEASURED_SECONDS["cpu"]) == {p.stem for p in series.notebooks()}
    line = series.progress_line("03_training", 100.0, (23, 51), 131.1, 300.0)
    assert line == "    03_training: 100 s, code cell 23 of 51; the series: about 331 s left (times measured on a 2-core laptop)"
    assert series.progress_line("03_training", 200.0, None, 131.1, 300.0) == (
        "    03_training: 200 s; past its measured 131 s (a slower or busier machine than the 2-core laptop), "
        "then about 300 s for the notebooks after it")
    assert series.progress_line("x", 5.0, None, None, None) == "    x: 5 s"
    nb = nbformat.v4.new_notebook()
    nb.cells = [nbformat.v4.new_code_cell("a"), nbformat.v4.new_markdown_cell("m"), nbformat.v4.new_code_cell("b")]
    nb.cells[0].metadata["papermill"] = {"status": "completed"}
    nbformat.write(nb, tmp_path / "running.ipynb")
    assert series._cells_done(tmp_path / "running.ipynb") == (2, 2) and series._cells_done(tmp_path / "missing.ipynb") is None
    monkeypatch.setattr(series, "HEARTBEAT_S", 0.05)
    with series._heartbeat("03_training", tmp_path / "running.ipynb", 131.1, 0.0):
        time.sleep(0.3)
    assert "03_training: 0 s, code cell 2 of 2; the series: about 131 s left" in capsys.readouterr().out


@pytest.mark.slow
def test_ctrl_c_during_a_notebook_ends_quietly_with_the_runners_message_and_nothing_left(tmp_path):
    """A terminal's Ctrl-C reaches the runner and its kernel (one process group): exit 130, the runner's own
    message, no traceback (the kernel's log of its channels closing goes to its .kernel.log), no process left."""
    import os
    import signal
    import subprocess
    import sys

    run = tmp_path / "run"
    proc = subprocess.Popen([sys.executable, "-m", "helpers.runner.series", "run", "--profile", "smoke", "--run-dir",
                             str(run), "--only", "00"], cwd=series.ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, start_new_session=True,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    log = run / "executed" / "last-attempt" / "00_container_setup.kernel.log"
    deadline = time.monotonic() + 120
    while not log.exists() and time.monotonic() < deadline and proc.poll() is None:
        time.sleep(0.2)
    time.sleep(4)  # the kernel is running the notebook's cells
    assert proc.poll() is None, "notebook 00 ended before it could be interrupted"
    os.killpg(proc.pid, signal.SIGINT)
    start = time.monotonic()
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 130 and time.monotonic() - start < 15
    assert "Traceback" not in err and "interrupted: the notebook that was running is kept" in err, err
    assert f"kept as far as it got in {run / 'executed' / 'last-attempt'}/" in err, err  # the folder itself, named
    time.sleep(1)
    with pytest.raises(ProcessLookupError):
        os.killpg(proc.pid, 0)  # no kernel or child of the runner is left in its process group
