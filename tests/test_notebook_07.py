"""Notebook 07 (evaluation): the training-time arithmetic and figures of helpers/demos/evaluation_curve.py,
and the values the notebook records in the smoke series (relations between them, not magic numbers)."""

from __future__ import annotations

import math
from pathlib import Path

import matplotlib
import pytest

from helpers.demos import evaluation_curve

matplotlib.use("Agg")

#: Three log records as helpers.runner.metrics.from_megatron_lm writes them: log_interval 2, then a slower and a faster interval.
RECORDS = [{"kind": "train", "iteration": 2, "s_per_iter": 0.5}, {"kind": "train", "iteration": 4, "s_per_iter": 1.0},
           {"kind": "train", "iteration": 6, "s_per_iter": 0.25}]


def test_training_seconds_sums_each_interval_and_interpolates_inside_one():
    # 0 -> 2: 2 x 0.5 = 1.0 s; 2 -> 4: 2 x 1.0 = 2.0 s (iteration 3 halfway: 2.0); 4 -> 6: 2 x 0.25 = 0.5 s.
    assert evaluation_curve.training_seconds(RECORDS, [0, 1, 2, 3, 4, 6]) == [0.0, 0.5, 1.0, 2.0, 3.0, 3.5]
    assert evaluation_curve.training_seconds(RECORDS, [6, 0]) == [3.5, 0.0]  # the caller's order


def test_training_seconds_refuses_what_the_log_does_not_cover():
    with pytest.raises(ValueError, match="outside the logged iterations 0..6"):
        evaluation_curve.training_seconds(RECORDS, [8])
    with pytest.raises(ValueError, match="outside the logged iterations"):
        evaluation_curve.training_seconds([], [1])
    with pytest.raises(ValueError, match="out of order"):
        evaluation_curve.training_seconds(RECORDS[::-1], [2])


def test_figures_draw_one_bar_per_scorer_and_set_and_one_line_per_set():
    table = {"validation split": {"model": 2.5, "gzip -9": 3.0, "xz -9e": 2.9},
             "unseen packages": {"model": 3.1, "gzip -9": 3.2, "xz -9e": 3.0}}
    ax = evaluation_curve.bits_per_byte_figure(table).axes[0]
    assert len(ax.patches) == 6 and "bits per byte" in ax.get_title()
    assert [t.get_text() for t in ax.get_legend().get_texts()] == ["model", "gzip -9", "xz -9e"]
    points = {"validation split": [(0.0, 4.0, 0), (5.0, 2.5, 6)], "unseen packages": [(0.0, 4.5, 0), (5.0, 3.1, 6)]}
    fig = evaluation_curve.curve_figure(points, {"validation split": 3.0, "unseen packages": 3.2})
    ax, top = fig.axes
    assert len(ax.lines) == 4  # a curve and gzip's level per set
    assert list(ax.lines[0].get_ydata()) == [4.0, 2.5] and list(ax.lines[1].get_ydata()) == [3.0, 3.0]
    assert "training time" in ax.get_xlabel() and not ax.texts  # no labels beside the points: they overlapped
    assert [t.get_text() for t in top.get_xticklabels()] == ["0", "6"] and list(top.get_xticks()) == [0.0, 5.0]
    assert top.get_xlim() == ax.get_xlim() and "iteration" in top.get_xlabel()


@pytest.mark.slow
def test_07_results_in_the_smoke_series(series_run):
    """Notebook 07 in the series (smoke profile): both models score alike, the values are in range and consistent."""
    run_dir, _, summary = series_run
    s = summary["07_evaluation"]
    assert s["megatron_vs_hf_max_abs_bits_per_byte_diff"] < 1e-4
    for held_out in ("valid", "unseen"):
        for scorer in ("model", "gzip", "xz", "unigram"):
            value = s[f"{held_out}_{scorer}_bits_per_byte"]
            assert isinstance(value, float) and math.isfinite(value) and value > 0, (held_out, scorer, value)
        curve = s[f"{held_out}_bits_per_byte_by_iteration"]
        assert list(curve) == ["iter_0000000", "iter_0000006", "iter_0000012"]  # fresh, then save_interval=6 of 12
        assert curve["iter_0000012"] == s[f"{held_out}_model_bits_per_byte"]  # the last point is the scored checkpoint
    assert s["model_beats_gzip_on_unseen"] == (s["unseen_model_bits_per_byte"] < s["unseen_gzip_bits_per_byte"])
    assert s["unseen_files_in_corpus"] == 0
    assert 0.0 <= s["syntax_validity"] <= 1.0
    assert s["pass_k"] == 2 and 0.0 <= s["pass_at_1"] <= s["pass_at_k"] <= 1.0
    assert isinstance(s["sample"], str) and s["sample"]
    for name in ("07_bits_per_byte", "07_bits_per_byte_curve"):
        assert (Path(run_dir) / "figures" / f"{name}.png").stat().st_size > 10_000
    report = (Path(run_dir) / "report.md").read_text(encoding="utf-8")
    assert "| 07_evaluation | pass_at_1 |" in report and "| 07_evaluation | unseen_gzip_bits_per_byte |" in report
