"""helpers.runner.timings: the recorded cpu run behind the series' stated times, and the estimates scaled from it."""

from __future__ import annotations

import json

import pytest

from helpers.runner import series, timings

RECORDED = {"run": "cpu-x", "commit": "abc1234def", "started": "2026-12-04T16:00:00", "finished": "2026-12-04T16:10:00",
            "machine": {"cpu_model": "AMD EPYC", "logical_cpus": 2, "usable_cpus": 2, "memory_gib": 23.5,
                        "matmul_gflops": 200.0, "python_loop_mops": 25.0},
            "load_average_start": [0.2, 0.1, 0.1], "load_average_end": [1.9, 1.2, 0.6],
            "notebooks": {"00_a": 20.0, "03_training": 150.0, "07_b": 30.0},
            "training": {"launch_wall_seconds": 120.0, "estimated_seconds": 110.0, "tokens_per_s": 5000.0,
                         "flops_per_token": 2e7, "iterations": 1000, "train_tokens": 500_000}}


def _run_folder(tmp_path, *, profile="cpu", finished=True, speed=180.0, launch_wall=130.0, estimated=125.0):
    run = tmp_path / "runs" / "cpu-y"
    run.mkdir(parents=True)
    start = {"profile": profile, "overrides": {}, "notebooks": ["00_a", "03_training", "07_b"], "commit": "fff0000aaa",
             "started": "2026-12-05T09:00:00", "cpu_model": "Intel Xeon", "logical_cpus": 2, "usable_cpus": 2,
             "memory_gib": 23.5, "load_average_start": [0.5, 0.2, 0.1], "matmul_gflops": speed, "python_loop_mops": 20.0}
    summary = {"series": {"start": start, "end": {"finished": "2026-12-05T09:12:00", "load_average_end": [2.0, 1.0, 0.5]}
                          if finished else {}},
               "00_a": {"wall_seconds": 25.0}, "03_training": {"wall_seconds": 160.0}, "07_b": {"wall_seconds": 35.0}}
    (run / "summary.json").write_text(json.dumps(summary))
    (run / "training_summary.json").write_text(json.dumps(
        {"launch_wall_seconds": launch_wall, "estimated_seconds": estimated, "tokens_per_s": 4500.0,
         "flops_per_token": 2e7, "iterations": 1000, "train_tokens": 500_000, "final_valid_loss": 4.2}))
    return run


def _executed_solutions(run, stem, durations):
    """An executed solutions notebook: set-up cells, then one heading per exercise and its timed code cells."""
    import nbformat

    cells = [nbformat.v4.new_code_cell("setup")]
    cells[0].metadata["papermill"] = {"duration": 9.0}  # before the first exercise: not counted
    for n, seconds in enumerate(durations, 1):
        cells.append(nbformat.v4.new_markdown_cell(f"## Exercise {n}\n\n> the task"))
        for part in seconds:
            cells.append(nbformat.v4.new_code_cell("work"))
            cells[-1].metadata["papermill"] = {"duration": part}
    nb = nbformat.v4.new_notebook()
    nb.cells = cells
    (run / "executed" / "solutions").mkdir(parents=True, exist_ok=True)
    nbformat.write(nb, run / "executed" / "solutions" / f"{stem}.ipynb")


def test_a_finished_cpu_run_is_recorded_with_its_machine_load_launch_and_exercises(tmp_path, monkeypatch):
    run = _run_folder(tmp_path)
    monkeypatch.setattr(timings, "ROOT", tmp_path)  # the series' solutions notebooks: 00_a and 03_training
    for stem in ("00_a", "03_training"):
        (tmp_path / "notebooks" / "solutions").mkdir(parents=True, exist_ok=True)
        (tmp_path / "notebooks" / "solutions" / f"{stem}.ipynb").write_text("{}")
    _executed_solutions(run, "00_a", [[1.5, 2.0], [30.25]])
    with pytest.raises(ValueError, match="make solutions RUN=.* WORKERS=1"):  # 03's solutions did not run
        timings.from_run(run)
    _executed_solutions(run, "03_training", [[0.4], [61.0, 60.0], [0.0]])
    measured = timings.from_run(run)
    assert measured["exercises"] == {"00_a": [3.5, 30.2], "03_training": [0.4, 121.0, 0.0]}
    table = timings.exercise_table(measured)
    assert "| 00_a | 4 · 30 | 5 · 6 | 11 |" in table and "| 03_training | 0 · 121 | " not in table
    assert "| 03_training | 0 · 121 · 0 | 5 · 7 · 5 | 17 |" in table  # 5 minutes to read + the machine time, to the minute
    assert measured["notebooks"] == {"00_a": 25.0, "03_training": 160.0, "07_b": 35.0}
    assert measured["machine"]["matmul_gflops"] == 180.0 and measured["machine"]["cpu_model"] == "Intel Xeon"
    assert measured["load_average_start"] == [0.5, 0.2, 0.1] and measured["load_average_end"][0] == 2.0
    assert measured["training"] == {"launch_wall_seconds": 130.0, "estimated_seconds": 125.0, "tokens_per_s": 4500.0,
                                    "flops_per_token": 2e7, "iterations": 1000, "train_tokens": 500_000}


def test_runs_that_cannot_be_the_reference_are_refused_by_name(tmp_path):
    with pytest.raises(FileNotFoundError, match="not a run folder"):
        timings.from_run(tmp_path)
    with pytest.raises(ValueError, match="profile 'smoke'"):
        timings.from_run(_run_folder(tmp_path / "a", profile="smoke"))
    with pytest.raises(ValueError, match="not a finished cpu run"):
        timings.from_run(_run_folder(tmp_path / "b", finished=False))
    with pytest.raises(ValueError, match="not a finished cpu run"):
        timings.from_run(_run_folder(tmp_path / "c", speed=None))
    assert timings.main(["record", str(tmp_path / "c" / "runs" / "cpu-y")]) == 2  # nothing written


def test_the_estimates_are_the_recorded_times_scaled_by_the_speed_ratio():
    assert timings.speed_ratio(100.0, RECORDED) == 2.0
    assert timings.series_estimate(100.0, RECORDED) == pytest.approx(2 * 200.0)  # a machine half as fast: twice the time
    assert timings.series_estimate(12.5, RECORDED, "python_loop_mops") == pytest.approx(2 * 200.0)
    # the recorded launch: 500,000 tokens at 5,000 tokens/s = 100 s of loop, 20 s fixed (start-up, evaluations, saves)
    seconds, rate = timings.training_estimate(500_000, 2e7, 200.0, RECORDED)
    assert seconds == pytest.approx(120.0) and rate == pytest.approx(5000 * 2e7)
    seconds, rate = timings.training_estimate(250_000, 4e7, 100.0, RECORDED)  # same FLOPs, a machine half as fast
    assert seconds == pytest.approx(2 * 20 + 250_000 * 4e7 / (5000 * 2e7 / 2)) and rate == pytest.approx(5e10)
    with pytest.raises(ValueError, match="positive"):
        timings.speed_ratio(0.0, RECORDED)


def test_compare_states_each_estimate_against_another_run(tmp_path):
    rows = timings.compare(_run_folder(tmp_path), RECORDED)
    series_row, launch = rows["series (make check)"], rows["03's training launch (preflight)"]
    assert series_row["estimated"] == pytest.approx(200.0 * 200 / 180) and series_row["measured"] == 220.0
    assert series_row["error"] == pytest.approx(200.0 * 200 / 180 / 220 - 1)
    assert launch == {"estimated": 125.0, "measured": 130.0, "error": pytest.approx(125 / 130 - 1)}
    unestimated = timings.compare(_run_folder(tmp_path / "none", estimated=None), RECORDED)  # the recorded run itself
    assert unestimated["03's training launch (preflight)"]["error"] is None
    assert timings.main(["compare", str(tmp_path / "none" / "runs" / "cpu-y")]) == 0


def test_the_guide_blocks_are_the_recorded_run_and_only_they_are_rewritten(tmp_path):
    table = timings.guide_table(RECORDED)
    assert "| 03_training | 150 s |" in table and "**200 s (3.3 min)**" in table
    assert "AMD EPYC, 2 cores" in table and "load average 0.2 when the run started, 1.9 at its end" in table
    (times_start, times_end), (out_start, out_end) = timings.GUIDE_MARKERS["measured-times"], timings.GUIDE_MARKERS["outcomes"]
    guide = tmp_path / "guide.md"
    guide.write_text(f"# Guide\n\nbefore\n{times_start}\nold table\n{times_end}\nmiddle\n{out_start}\n{out_end}\nafter\n")
    timings.write_guide(RECORDED, guide)
    text = guide.read_text()
    assert text.startswith("# Guide\n\nbefore\n") and text.endswith(f"{out_end}\nafter\n") and "\nmiddle\n" in text
    assert "old table" not in text and table in text and timings.outcomes_text(RECORDED) in text
    timings.write_guide(RECORDED, guide)  # again: the same text (the blocks are replaced, not appended)
    assert guide.read_text() == text
    plain = tmp_path / "plain.md"
    plain.write_text(f"{times_start}\n{times_end}\n")  # the outcomes' markers are missing
    with pytest.raises(ValueError, match="missing"):
        timings.write_guide(RECORDED, plain)
    assert plain.read_text() == f"{times_start}\n{times_end}\n"


def test_the_outcomes_say_what_the_cpu_model_reached():
    outcomes = {"final_valid_loss": 4.256, "unseen_model_bits_per_byte": 2.115, "unseen_gzip_bits_per_byte": 2.597,
                "valid_model_bits_per_byte": 2.2, "valid_gzip_bits_per_byte": 2.95, "syntax_validity": 0.0,
                "pass_at_1": 0.0, "sample": "def f(x):\n    return x"}
    text = timings.outcomes_text({**RECORDED, "outcomes": outcomes})
    assert "validation loss during training was 4.26" in text and "2.12 bits per byte against gzip's 2.60" in text
    assert "None of its sampled completions parse" in text and "def f(x):\n    return x" in text
    some = timings.outcomes_text({**RECORDED, "outcomes": {**outcomes, "syntax_validity": 0.25}})
    assert "25% of its sampled completions parse" in some


def test_the_shipped_record_covers_the_series_and_the_guide_shows_it():
    """data/measured_cpu_run.json is one real run of every notebook; docs/instructor.md holds its table unedited."""
    measured = timings.load()
    assert set(measured["notebooks"]) == {p.stem for p in series.notebooks()}
    assert series.MEASURED_SECONDS["cpu"] == measured["notebooks"]
    assert measured["machine"]["matmul_gflops"] > 0 and measured["training"]["launch_wall_seconds"] > 0
    guide = timings.GUIDE.read_text()
    for name, body in timings.guide_blocks(measured).items():
        start, end = timings.GUIDE_MARKERS[name]
        assert f"{start}\n{body}\n{end}" in guide, f"docs/instructor.md's {name} block was edited or is stale"


def test_each_notebook_states_the_time_of_the_recorded_run():
    """Each notebook's "Time to run: about N s / minutes on a 2-core laptop CPU" is within 25 % of the recorded run
    (data/measured_cpu_run.json), so that a learner is not told 2 minutes for what takes 3.5."""
    import re

    import nbformat

    recorded = timings.notebook_seconds()
    for path in series.notebooks():
        intro = nbformat.read(path, as_version=4).cells[0].source
        m = re.search(r"\*\*Time to run:\*\* about ([\d.]+) (s|minutes?) on a 2-core laptop CPU", intro)
        assert m, f"{path.name}: no 'Time to run: about N s on a 2-core laptop CPU'"
        stated = float(m[1]) * (60 if m[2].startswith("minute") else 1)
        assert abs(stated / recorded[path.stem] - 1) <= 0.25, (path.name, stated, recorded[path.stem])
