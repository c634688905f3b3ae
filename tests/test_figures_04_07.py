"""Issue 30 (part 3): the figures of notebooks 04-07, drawn from made-up measurements and checked value by value.

Each test builds the result object a notebook cell passes to a plot helper (a ``FusionBenchmark``, the
``FlagsBenchmark`` and ``AttentionBenchmark`` of notebook 04, ``LayoutRun``s, logits, an evaluation curve),
draws it, and asserts that the artists carry those values and that the labels are words, not code names."""

from __future__ import annotations

import re

import matplotlib
import pytest
import torch

from helpers.demos import conversion_proofs, evaluation_curve, fused_ops, layout_runs, model_fusions, roofline
from helpers.demos.timing import Timing
from helpers.learn.model import Layout

matplotlib.use("Agg")

#: An identifier with an underscore (``bias_gelu``, ``tp2_pp1_dp1``): what a learner-facing label must not show.
CODE_NAME = re.compile(r"\b[a-z]+_[a-z_]+\b")


def _bench() -> fused_ops.FusionBenchmark:
    """Eleven rows shaped like notebook 04's CPU run: (op, key, form, median ms, intensity)."""
    spec = [("bias_gelu", "eager", "unfused", 10.0, 0.4), ("bias_gelu", "eager_formula", "unfused_formula", 40.0, 0.1),
            ("bias_gelu", "megatron_fused", "fused", 8.0, 0.5), ("bias_gelu", "torch_compile", "fused", 9.0, 0.5),
            ("bias_dropout_add", "eager", "unfused", 3.0, 0.2), ("bias_dropout_add", "megatron_fused", "fused", 2.0, 0.3),
            ("scale_mask_softmax", "eager", "unfused", 5.0, 0.3), ("scale_mask_softmax", "torch_compile", "fused", 4.0, 0.5),
            ("layernorm", "eager", "unfused", 4.0, 0.3), ("layernorm", "torch_native", "fused", 1.0, 1.0),
            ("layernorm", "torch_compile", "fused", 1.25, 1.0)]
    base = {op: ms for op, key, _, ms, _ in spec if key == "eager"}
    rows = [{"op": op, "key": key, "form": form, "median_ms": ms, "q25_ms": 0.9 * ms, "q75_ms": 1.1 * ms,
             "implementation": f"{key} (torch.compile)" if key == "megatron_fused" else key,
             "speedup_vs_eager": base[op] / ms, "intensity_flop_per_byte": x, "achieved_GFLOP_s": x / ms}
            for op, key, form, ms, x in spec]
    return fused_ops.FusionBenchmark(rows, [], {}, "cpu", "float32")


# ------------------------------------------------------------------------------ notebook 04
def test_log_ticks_cover_the_range_with_several_1_2_5_ticks():
    assert fused_ops.log_ticks(0.23, 4.3) == [0.2, 0.5, 1.0, 2.0, 5.0]
    assert fused_ops.log_ticks(0.9, 1.3) == [0.5, 1.0, 2.0, 5.0]  # a narrow range still gets a scale
    assert fused_ops.log_ticks(0.1, 50) == [0.1, 0.3, 1.0, 3.0, 10.0, 30.0, 100.0]  # wider: fewer per decade
    assert fused_ops.log_ticks(0.06, 900) == [0.01, 0.1, 1.0, 10.0, 100.0, 1000.0]
    assert fused_ops.log_ticks(1.0, 1.0, minimum=3) == [0.5, 1.0, 2.0]
    with pytest.raises(ValueError, match="0 < lo <= hi"):
        fused_ops.log_ticks(0.0, 1.0)


def test_speedup_chart_draws_the_measured_speedups_with_words_and_a_scale():
    bench = _bench()
    bars = fused_ops.speedup_bars(bench)
    assert [b["speedup"] for b in bars] == [r["speedup_vs_eager"] for r in bench.rows]
    assert bars[2]["label"] == "bias + GELU: megatron-core fused (torch.compile), tanh GELU"
    assert bars[9]["label"] == "LayerNorm: torch's native LayerNorm kernel"
    ax = fused_ops.plot_speedups(bench).axes[0]
    measured = [r for r in bench.rows if r["key"] != "eager"][::-1]  # the baselines are markers at 1x
    assert [p.get_x() for p in ax.patches] == pytest.approx([1.0] * len(measured))
    assert [p.get_width() for p in ax.patches] == pytest.approx([r["speedup_vs_eager"] - 1 for r in measured])
    labels = [t.get_text() for t in ax.get_yticklabels()]
    assert labels == [b["label"] for b in bars][::-1] and not any(CODE_NAME.search(t) for t in labels)
    legend = [t.get_text() for t in ax.get_legend().get_texts()]
    assert legend == ["eager baseline, unfused: one kernel per op", "fused: one kernel", "tanh formula, one kernel per op"]
    lo, hi = ax.get_xlim()
    ticks = [t for t in ax.get_xticks() if lo <= t <= hi]
    assert len(ticks) >= 3 and [t.get_text() for t in ax.get_xticklabels()][:len(ticks)] == [f"{t:g}x" for t in ticks]
    assert "0.25x" in [t.get_text() for t in ax.texts] and "1x (baseline)" in [t.get_text() for t in ax.texts]


def test_roofline_colours_by_operation_and_marks_by_implementation_with_legends_outside():
    bench = _bench()
    points = fused_ops.roofline_points(bench)
    assert points[0] == ("bias + GELU", "eager, op by op (unfused)", 0.4, pytest.approx(0.04e9))
    fig = roofline.plot_roofline(roofline.Roofline(10e9, 100e9), points)
    ax = fig.axes[0]
    dots = [ln for ln in ax.lines if len(ln.get_xdata()) == 1 and ln.get_linestyle() == "None"]
    assert len(dots) == len(bench.rows) == 11
    spread = roofline.SPREAD_FACTOR  # equal intensities (0.5: three points, 0.3: three, 1.0: two) are spread sideways
    assert [d.get_xdata()[0] for d in dots] == pytest.approx(
        [0.4, 0.1, 0.5 / spread, 0.5, 0.2, 0.3 / spread, 0.3, 0.5 * spread, 0.3 * spread, 1.0 / spread ** 0.5,
         1.0 * spread ** 0.5])
    assert roofline.spread_intensities([0.5, 0.2, 0.5]) == pytest.approx([0.5 / spread ** 0.5, 0.2, 0.5 * spread ** 0.5])
    assert [d.get_ydata()[0] for d in dots] == pytest.approx([p[3] / 1e9 for p in points])
    by_point = {(p[0], p[1]): (d.get_color(), d.get_marker()) for p, d in zip(points, dots)}
    assert len(set(by_point.values())) == 11  # every point its own colour-and-marker pair
    legends = [c for c in ax.get_children() if isinstance(c, matplotlib.legend.Legend)]
    titles = sorted(lg.get_title().get_text() for lg in legends)
    assert titles == ["", "colour: operation", "marker: implementation"]
    words = [t.get_text() for lg in legends for t in lg.get_texts()]
    assert "scale + mask + softmax" in words and not any(CODE_NAME.search(w) for w in words)
    fig.canvas.draw()  # the two point legends sit to the right of the axes
    box = ax.get_window_extent()
    assert all(lg.get_window_extent().x0 > box.x1 for lg in legends if lg.get_title().get_text())
    assert len(roofline.plot_roofline(roofline.Roofline(10e9, 100e9), [("point", 0.5, 1e9)]).axes) == 1
    with pytest.raises(ValueError, match="not sizes"):
        roofline.plot_roofline(roofline.Roofline(10e9, 100e9), [("a", 0.5, 1e9), ("g", "k", 0.5, 1e9)])


def _timing(times):
    return Timing("t", tuple(times), 1, "cpu", "time.perf_counter")


def test_step_time_bars_are_the_measured_medians_with_their_speedups():
    flags = model_fusions.FlagsBenchmark({"flags off": _timing([0.30, 0.32, 0.31]), "flags on": _timing([0.25, 0.24, 0.26])},
                                         {"flags off": 9.0, "flags on": 9.0}, {"flags off": 0.4, "flags on": 5.0},
                                         0.31 / 0.25, 2, 256)
    attn = model_fusions.AttentionBenchmark((256, 8, 6, 64), {"unfused": _timing([0.020, 0.022, 0.021]),
                                                              "sdpa": _timing([0.012, 0.010, 0.011])}, 1e-6, 1000)
    bars = model_fusions.step_time_bars(flags, attn)
    assert [b["median_ms"] for b in bars] == pytest.approx([310.0, 250.0, 21.0, 11.0])
    assert [b["speedup"] for b in bars] == pytest.approx([1.0, 1.24, 1.0, 21 / 11])
    assert bars[1]["q25_ms"] == pytest.approx(245.0) and bars[3]["q75_ms"] == pytest.approx(11.5)
    fig = model_fusions.plot_step_times(flags, attn)
    top, bottom = fig.axes
    assert [p.get_width() for p in top.patches] == pytest.approx([250.0, 310.0])  # first configuration at the top
    assert [p.get_width() for p in bottom.patches] == pytest.approx([11.0, 21.0])
    texts = [t.get_text() for t in top.texts + bottom.texts]
    assert texts == ["250.0 ms (speed-up 1.24x)", "310.0 ms (baseline)", "11.0 ms (speed-up 1.91x)", "21.0 ms (baseline)"]
    assert all("ms" in ax.get_xlabel() and ax.get_title() for ax in (top, bottom)) and fig._suptitle.get_text()
    labels = [t.get_text() for ax in (top, bottom) for t in ax.get_yticklabels()]
    assert "fused: torch scaled_dot_product_attention" in labels and "fusion flags on" in labels[0]


# ------------------------------------------------------------------------------ notebook 05
def _run(name, layout, losses, s_per_iter, wall, initial="shared"):
    return layout_runs.LayoutRun(layout=layout, name=name, losses=losses, s_per_iter=s_per_iter, valid_losses=[7.0],
                                 wall_seconds=wall, command=["x"], generated_command=["x"], checkpoint_dir="c",
                                 initial=initial)


REF = _run("tp1_pp1_dp1", Layout(1, 1, 1), [10.0, 9.0, 8.0], [0.2, 0.1, 0.3], 7.0)
TP2 = _run("tp2_pp1_dp1", Layout(2, 1, 1), [10.0, 9.0 + 1e-6, 8.0 - 2e-6], [0.4, 0.3, 0.5], 9.0)
PP2 = _run("tp1_pp2_dp1", Layout(1, 2, 1), [10.0, 9.0 + 1e-6, 8.0 - 2e-6], [0.5, 0.5, 0.5], 9.5)
DP2 = _run("tp1_pp1_dp2", Layout(1, 1, 2), [10.0 + 3e-7, 9.0, 8.0], [0.2, 0.3, 0.25], 8.0)


def test_loss_figure_keeps_equal_layouts_apart_and_draws_their_differences():
    assert layout_runs.loss_differences(REF, TP2) == pytest.approx([1e-12, 1e-6, 2e-6])
    fig = layout_runs.plot_losses(REF, [TP2, DP2, PP2])
    left, right = fig.axes
    ref_line, *lines = left.lines
    assert list(ref_line.get_xdata()) == [1, 2, 3] and list(ref_line.get_ydata()) == REF.losses
    dodge = layout_runs.LOSS_PLOT_DODGE
    for line, run, dx in zip(lines, (TP2, DP2, PP2), (-dodge, 0.0, dodge)):
        assert list(line.get_ydata()) == run.losses
        assert list(line.get_xdata()) == pytest.approx([1 + dx, 2 + dx, 3 + dx])
    # TP=2 and PP=2 have equal losses: their markers and line styles differ, and they sit apart
    assert (lines[0].get_marker(), lines[0].get_linestyle()) != (lines[2].get_marker(), lines[2].get_linestyle())
    diffs = right.lines[1:]  # after the tolerance line
    assert [list(d.get_ydata()) for d in diffs] == [pytest.approx(layout_runs.loss_differences(REF, r))
                                                    for r in (TP2, DP2, PP2)]
    assert right.get_yscale() == "log" and right.lines[0].get_ydata()[0] == layout_runs.LOSS_ATOL_FP32
    legend = [t.get_text() for t in left.get_legend().get_texts()]
    assert legend[0] == "TP=1 PP=1 DP=1 (1 process, reference)" and legend[1] == "TP=2 PP=1 DP=1 (2 processes), -0.2 it"
    assert not any(CODE_NAME.search(t) for t in legend) and "shifted" in left.get_legend().get_title().get_text()


def test_wall_time_bars_equal_the_runs_and_the_sentence_is_computed():
    own = _run("tp1_pp2_dp1_own_init", Layout(1, 2, 1), [10.1, 9.1, 8.1], [0.5, 0.6, 0.4], 9.2, initial="own")
    assert layout_runs.median_s_per_iter(REF) == 0.2 and layout_runs.median_s_per_iter(DP2) == 0.25
    fig = layout_runs.plot_wall_times(REF, [TP2, DP2, PP2, own])
    wall, per_iter = fig.axes
    order = [own, PP2, DP2, TP2, REF]  # reference at the top
    assert [p.get_width() for p in wall.patches] == [r.wall_seconds for r in order]
    assert [p.get_width() for p in per_iter.patches] == [layout_runs.median_s_per_iter(r) for r in order]
    assert [t.get_text() for t in per_iter.texts][-2:] == ["0.4 s/it (2.00x)", "0.2 s/it (1.00x)"]
    labels = [t.get_text() for t in wall.get_yticklabels()]
    assert labels[-1] == "TP=1 PP=1 DP=1 (1 process, reference)"
    assert labels[0] == "TP=1 PP=2 DP=1 (2 processes, own initial weights)"
    assert all(ax.get_xlabel() and ax.get_title() for ax in (wall, per_iter))
    text = layout_runs.wall_time_summary(REF, [TP2, DP2, PP2], cores=2)
    assert text.startswith("On this machine's 2 CPU cores, none of the 3 parallel runs was clearly faster per iteration")
    assert "closest: TP=1 PP=1 DP=2" in text and "share the same 2 cores" in text
    assert "against 0.200 s for one process: TP=2 PP=1 DP=1 2.00x as long, TP=1 PP=1 DP=2 1.25x as long" in text
    noisy = _run("tp1_pp1_dp2", Layout(1, 1, 2), REF.losses, [0.19, 0.19, 0.19], 5.0)  # 0.95x: within the noise
    assert "none of the 2 parallel runs was clearly faster" in layout_runs.wall_time_summary(REF, [TP2, noisy], cores=2)
    fast = _run("tp1_pp1_dp2", Layout(1, 1, 2), REF.losses, [0.1, 0.1, 0.1], 5.0)
    faster = layout_runs.wall_time_summary(REF, [TP2, fast], cores=2)
    assert "1 of the 2 parallel runs was faster per iteration than one process by more than 10%" in faster
    assert "so the one process was slowed here" in faster and "adds communication" not in faster
    with pytest.raises(ValueError, match="at least one"):
        layout_runs.wall_time_summary(REF, [])


# ------------------------------------------------------------------------------ notebook 06
def test_logit_figure_draws_the_differences_not_the_diagonal():
    ref = torch.tensor([[[1.0, -2.0, 3.0, 99.0], [0.5, 0.25, -1.0, 99.0]]])  # [b=1, s=2, V_pad=4]; column 4 is padding
    out = ref[..., :3] + torch.tensor([[[0.0, 1e-6, -2e-6], [4e-7, 0.0, 0.0]]])
    values, diffs = conversion_proofs.logit_differences(ref, out)
    assert values.tolist() == [1.0, -2.0, 3.0, 0.5, 0.25, -1.0]
    assert diffs.tolist() == pytest.approx([0.0, 1e-6, -2e-6, 4e-7, 0.0, 0.0], abs=1e-7)
    fig = conversion_proofs.logit_difference_figure(ref, out)
    left, right = fig.axes
    drawn = left.collections[0].get_offsets()
    expected = sorted((v, max(abs(d), conversion_proofs.ZERO_FLOOR)) for v, d in zip(values.tolist(), diffs.tolist()))
    got = sorted(map(tuple, drawn.tolist()))
    assert [v for v, _ in got] == [v for v, _ in expected]
    assert [d for _, d in got] == pytest.approx([d for _, d in expected], rel=1e-6)
    assert left.get_yscale() == "log" and "logit" in left.get_xlabel() and "nats" in left.get_ylabel()
    assert sum(p.get_height() for p in right.patches) == 6  # every logit in the histogram
    assert "3 exactly equal" in right.get_legend().get_texts()[0].get_text()
    with pytest.raises(ValueError, match="cannot be compared"):
        conversion_proofs.logit_differences(ref[..., :2], out)


# ------------------------------------------------------------------------------ notebook 07
def test_curve_iterations_go_to_a_top_axis_without_overlapping_labels():
    points = {"validation split": [(0.0, 4.0, 0), (0.5, 3.5, 1), (30.0, 2.5, 100), (60.0, 2.2, 200)],
              "unseen packages": [(0.0, 4.1, 0), (0.5, 3.6, 1), (30.0, 2.7, 100), (60.0, 2.5, 200)]}
    assert evaluation_curve.iteration_ticks(points) == [(0.0, 0), (30.0, 100), (60.0, 200)]  # 1 is too close to 0
    assert evaluation_curve.iteration_ticks({"a": [(0.0, 4.0, 0), (59.0, 2.0, 199), (60.0, 1.9, 200)]}) == [
        (0.0, 0), (60.0, 200)]  # the last checkpoint is kept
    fig = evaluation_curve.curve_figure(points, {"validation split": 3.0, "unseen packages": 3.2})
    ax, top = fig.axes
    assert [t.get_text() for t in top.get_xticklabels()] == ["0", "100", "200"]
    assert not ax.texts and ax.get_legend() is not None and ax.get_title()
    fig.canvas.draw()
    assert ax.get_legend().get_window_extent().x0 > ax.get_window_extent().x1  # the legend covers no curve
