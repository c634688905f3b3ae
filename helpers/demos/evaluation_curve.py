"""Notebook 07's pictures: bits per byte against the baselines, and against training time.

Section 2 draws :func:`bits_per_byte_figure` (the model next to gzip, xz and a unigram model on
each held-out set); section 4 computes the training time of every saved checkpoint with
:func:`training_seconds` (from ``metrics.jsonl``) and draws :func:`curve_figure`. The scores
themselves come from ``helpers.learn.evaluation``.
"""

from __future__ import annotations

from typing import Any, Mapping, Sequence


def training_seconds(train_records: Sequence[Mapping[str, Any]], iterations: Sequence[int]) -> list[float]:
    """Seconds of training up to each of ``iterations``, from the train records of ``metrics.jsonl``.

    Each record's ``s_per_iter`` is the mean wall time of the iterations since the previous record
    (evaluation, samples and checkpoint saves not counted); the time at iteration ``i`` sums
    ``s_per_iter x iterations`` up to ``i``, pro rata inside an interval. Iteration 0 is 0 s.

    Args:
        train_records: ``read_metrics(...)["train"]``, in iteration order.
        iterations: iterations to time (e.g. the saved checkpoints), each >= 0.

    Returns:
        Seconds (float), one per iteration, in the given order.

    Raises:
        ValueError: an iteration past the last record (the log does not cover it), or
            records not in increasing iteration order.
    """
    marks, elapsed, previous = [(0, 0.0, 0.0)], 0.0, 0
    for rec in train_records:
        if rec["iteration"] <= previous:
            raise ValueError(f"train records out of order: iteration {rec['iteration']} after {previous}")
        elapsed += rec["s_per_iter"] * (rec["iteration"] - previous)
        marks.append((rec["iteration"], elapsed, rec["s_per_iter"]))
        previous = rec["iteration"]
    out = []
    for it in iterations:
        if it < 0 or it > previous:
            raise ValueError(f"iteration {it} is outside the logged iterations 0..{previous} of metrics.jsonl")
        end = next(m for m in marks if m[0] >= it)
        out.append(end[1] - (end[0] - it) * end[2])
    return out


def bits_per_byte_figure(table: Mapping[str, Mapping[str, float]]):
    """Grouped bars: bits per byte of each scorer (model, gzip -9, ...) on each held-out set.

    Args:
        table: ``{held-out set: {scorer: bits per byte}}``; every set has the same scorers.

    Returns:
        A matplotlib ``Figure`` (titled, labelled, with a legend and the value on each bar).
    """
    import matplotlib.pyplot as plt

    sets = list(table)
    scorers = list(table[sets[0]])
    width = 0.8 / len(scorers)
    fig, ax = plt.subplots(figsize=(8, 4))
    for j, scorer in enumerate(scorers):
        xs = [i + (j - (len(scorers) - 1) / 2) * width for i in range(len(sets))]
        bars = ax.bar(xs, [table[s][scorer] for s in sets], width, label=scorer)
        ax.bar_label(bars, fmt="%.2f", fontsize=8)
    ax.set_xticks(range(len(sets)), sets)
    ax.set(title="Held-out code: bits per byte (lower is better)", ylabel="bits per UTF-8 byte",
           ylim=(0, 1.25 * max(v for row in table.values() for v in row.values())))
    ax.legend(ncol=len(scorers), loc="upper center")
    fig.tight_layout()
    return fig


def iteration_ticks(points: Mapping[str, Sequence[tuple[float, float, int]]],
                    min_gap: float = 0.04) -> list[tuple[float, int]]:
    """The checkpoints of :func:`curve_figure`'s top axis: ``(training seconds, iteration)``, one per
    checkpoint, in time order, leaving out any closer than ``min_gap`` of the time range to the
    last one kept (their labels would overlap); the last checkpoint is always kept.
    """
    pairs = sorted({(p[0], p[2]) for pts in points.values() for p in pts})
    if not pairs:
        return []
    span = (pairs[-1][0] - pairs[0][0]) or 1.0
    kept = [pairs[0]]
    for sec, it in pairs[1:]:
        if sec - kept[-1][0] >= min_gap * span:
            kept.append((sec, it))
        elif (sec, it) == pairs[-1]:
            kept[-1] = (sec, it)
    return kept


def curve_figure(points: Mapping[str, Sequence[tuple[float, float, int]]], baselines: Mapping[str, float],
                 baseline_name: str = "gzip -9"):
    """Bits per byte of each held-out set against training time, with a baseline's level as a line.

    The checkpoint iterations are the ticks of a top axis (:func:`iteration_ticks`); the legend sits
    outside the axes, to the right.

    Args:
        points: ``{held-out set: [(training seconds, bits per byte, iteration), ...]}``.
        baselines: ``{held-out set: bits per byte of the baseline}`` (drawn dashed, same colour).
        baseline_name: the baseline's name in the legend.

    Returns:
        A matplotlib ``Figure`` with the curves' axes first and the top axis of iterations second.
    """
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(10, 4.2))
    markers = "osD^v"
    for i, (name, pts) in enumerate(points.items()):
        line, = ax.plot([p[0] for p in pts], [p[1] for p in pts], marker=markers[i % len(markers)], ls="-",
                        label=f"model, {name}")
        ax.axhline(baselines[name], color=line.get_color(), ls="--", lw=1, label=f"{baseline_name}, {name}")
    ax.set(xlabel="training time (s, optimizer steps only)", ylabel="bits per UTF-8 byte")
    ax.set_title("Bits per byte on held-out code during training", pad=10)
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.02, 1.0))
    top = ax.twiny()
    top.set_xlim(ax.get_xlim())
    ticks = iteration_ticks(points)
    top.set_xticks([t[0] for t in ticks], [str(t[1]) for t in ticks], fontsize=8)
    top.set_xlabel("checkpoint (training iteration)", fontsize=9)
    fig.tight_layout()
    return fig
