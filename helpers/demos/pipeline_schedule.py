"""Pipeline schedules: when each stage runs each micro-batch, and the bubble (notebook 05, section 3).

:func:`pipeline_schedule` simulates GPipe and megatron-core's 1F1B; the simulated bubble is set beside
the formula :func:`bubble_fraction`. Section 5's memory calculator (:mod:`helpers.learn.memory`) uses
the same micro-batches-in-flight result.

Sources: Narayanan et al. 2021, "Efficient Large-Scale Language Model Training on GPU Clusters
Using Megatron-LM" (arXiv:2104.04473) section 2.2 (1F1B, the bubble); Huang et al. 2019,
"GPipe" (arXiv:1811.06965); megatron-core 0.19.2 ``pipeline_parallel/schedules.py``
(``forward_backward_pipelining_without_interleaving``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence


@dataclass(frozen=True)
class PipelineOp:
    """One forward (``"F"``) or backward (``"B"``) pass of a micro-batch on a stage; times in
    units of one forward pass of one stage."""

    stage: int
    kind: str
    microbatch: int
    start: float
    end: float


def bubble_fraction(pipeline_model_parallel_size: int, num_microbatches: int) -> float:
    """Idle fraction of a pipeline step: (p - 1) / (m + p - 1).

    Each stage idles for (p - 1) forward and (p - 1) backward slots while the pipeline fills and
    drains, out of (m + p - 1) slots in all. Narayanan et al. 2021 (arXiv:2104.04473) section
    2.2.1 state it relative to the ideal time, (p - 1) / m; both are the same bubble.

    Raises:
        ValueError: p or m below 1.
    """
    p, m = pipeline_model_parallel_size, num_microbatches
    if p < 1 or m < 1:
        raise ValueError(f"pipeline_model_parallel_size={p} and num_microbatches={m} must be >= 1")
    return (p - 1) / (m + p - 1)


def pipeline_schedule(pipeline_model_parallel_size: int, num_microbatches: int, *, schedule: str = "1f1b",
                      forward_time: float = 1.0, backward_time: float = 2.0) -> list[PipelineOp]:
    """Simulate a pipeline step: when each stage runs each micro-batch's forward and backward.

    ``"1f1b"`` follows megatron-core ``forward_backward_pipelining_without_interleaving``: stage r runs
    ``min(p - r - 1, m)`` warm-up forwards, alternates one forward and one backward, then drains the
    backwards. ``"gpipe"`` runs all forwards, then all backwards (Huang et al. 2019). A forward waits
    for stage r - 1's, a backward for stage r + 1's (the last stage: its own forward); no communication time.

    Args:
        pipeline_model_parallel_size, num_microbatches: stages p, micro-batches m per optimizer step.
        forward_time, backward_time: durations (a backward is about 2 forwards).

    Returns:
        The operations of every stage, sorted by start time.

    Raises:
        ValueError: p or m below 1, an unknown schedule, or non-positive durations.
    """
    p, m = pipeline_model_parallel_size, num_microbatches
    if p < 1 or m < 1:
        raise ValueError(f"pipeline_model_parallel_size={p} and num_microbatches={m} must be >= 1")
    if forward_time <= 0 or backward_time <= 0:
        raise ValueError("forward_time and backward_time must be > 0")
    if schedule == "1f1b":
        orders = []
        for r in range(p):
            warmup = min(p - r - 1, m)
            order = [("F", i) for i in range(warmup)]
            for i in range(m - warmup):
                order += [("F", warmup + i), ("B", i)]
            order += [("B", i) for i in range(m - warmup, m)]
            orders.append(order)
    elif schedule == "gpipe":
        orders = [[("F", i) for i in range(m)] + [("B", i) for i in range(m)] for _ in range(p)]
    else:
        raise ValueError(f"schedule={schedule!r}: choose '1f1b' or 'gpipe'")
    done: dict[tuple[str, int, int], float] = {}
    free = [0.0] * p
    pos = [0] * p
    ops: list[PipelineOp] = []
    while any(pos[r] < len(orders[r]) for r in range(p)):
        progressed = False
        for r in range(p):
            if pos[r] == len(orders[r]):
                continue
            kind, i = orders[r][pos[r]]
            dep = ("F", r - 1, i) if kind == "F" and r > 0 else ("B", r + 1, i) if kind == "B" and r < p - 1 else (
                ("F", r, i) if kind == "B" else None)
            if dep is not None and dep not in done:
                continue
            start = max(free[r], done[dep] if dep is not None else 0.0)
            end = start + (forward_time if kind == "F" else backward_time)
            done[(kind, r, i)] = free[r] = end
            ops.append(PipelineOp(r, kind, i, start, end))
            pos[r] += 1
            progressed = True
        if not progressed:  # pragma: no cover - the orders above never deadlock
            raise RuntimeError("pipeline schedule deadlocked")
    return sorted(ops, key=lambda o: (o.start, o.stage))


def schedule_stats(ops: list[PipelineOp]) -> dict[str, Any]:
    """Makespan, idle (bubble) fraction and the peak number of micro-batches whose activations
    a stage holds at once (forward done, backward not yet), from :func:`pipeline_schedule`.

    Returns:
        ``{"makespan", "bubble_fraction", "peak_in_flight": [per stage]}``.
    """
    stages = sorted({o.stage for o in ops})
    makespan = max(o.end for o in ops)
    busy = sum(o.end - o.start for o in ops)
    peaks = []
    for s in stages:
        events = sorted([(o.end, 1) for o in ops if o.stage == s and o.kind == "F"]
                        + [(o.end, -1) for o in ops if o.stage == s and o.kind == "B"])
        level = peak = 0
        for _, delta in events:
            level += delta
            peak = max(peak, level)
        peaks.append(peak)
    return {"makespan": makespan, "bubble_fraction": 1 - busy / (makespan * len(stages)), "peak_in_flight": peaks}


def plot_schedule(pipeline_model_parallel_size: int, num_microbatches: int,
                  schedules: Sequence[str] = ("gpipe", "1f1b")):
    """Timelines (one row per stage) of the simulated schedules, with their bubble fractions.

    Returns:
        The matplotlib figure.
    """
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    p, m = pipeline_model_parallel_size, num_microbatches
    fig, axes = plt.subplots(len(schedules), 1, figsize=(11, 1.0 + 0.55 * p * len(schedules)), squeeze=False)
    colors = {"F": "tab:blue", "B": "tab:orange"}
    for ax, name in zip(axes[:, 0], schedules):
        ops = pipeline_schedule(p, m, schedule=name)
        stats = schedule_stats(ops)
        for o in ops:
            ax.broken_barh([(o.start, o.end - o.start)], (p - 1 - o.stage - 0.4, 0.8),
                           facecolors=colors[o.kind], edgecolor="white")
            ax.text((o.start + o.end) / 2, p - 1 - o.stage, str(o.microbatch + 1), ha="center", va="center",
                    fontsize=7, color="white")
        ax.set_yticks(range(p), [f"stage {p - 1 - i}" for i in range(p)])
        ax.set_xlim(0, stats["makespan"])
        ax.set_xlabel("time (units of one stage's forward pass; backward = 2)")
        ax.set_title(f"{name.upper()}: p={p} stages, m={m} micro-batches | bubble {stats['bubble_fraction']:.1%} "
                     f"(formula (p-1)/(m+p-1) = {bubble_fraction(p, m):.1%}) | peak micro-batches held "
                     f"{max(stats['peak_in_flight'])}", fontsize=9)
        ax.legend(handles=[Patch(color=colors["F"], label="forward (micro-batch no.)"),
                           Patch(color=colors["B"], label="backward")], fontsize=7, loc="upper left",
                  bbox_to_anchor=(1.0, 1.0))
    fig.tight_layout()
    return fig


def bubble_table(pipeline_model_parallel_size: int, microbatches: Sequence[int] = (1, 2, 4, 8, 16, 32)
                 ) -> list[dict[str, Any]]:
    """Per micro-batch count m: the bubble by formula and by simulation (1F1B), and the most
    micro-batches a stage holds at once with 1F1B and with GPipe.

    Returns:
        Rows for ``helpers.support.results.markdown_table``: ``[{"micro-batches m", "bubble (p-1)/(m+p-1),
        p=<p>", "simulated 1F1B bubble", "1F1B peak micro-batches held", "GPipe peak"}]``
        (bubbles as percentage strings).
    """
    rows = []
    p = pipeline_model_parallel_size
    for m in microbatches:
        one_f_one_b = schedule_stats(pipeline_schedule(p, m))
        gpipe = schedule_stats(pipeline_schedule(p, m, schedule="gpipe"))
        rows.append({"micro-batches m": m, f"bubble (p-1)/(m+p-1), p={p}": f"{bubble_fraction(p, m):.1%}",
                     "simulated 1F1B bubble": f"{one_f_one_b['bubble_fraction']:.1%}",
                     "1F1B peak micro-batches held": max(one_f_one_b["peak_in_flight"]),
                     "GPipe peak": max(gpipe["peak_in_flight"])})
    return rows
