"""The memory savers of notebook 05b, trained for real, measured per rank and set beside the predictions.

:data:`TECHNIQUES` holds each saver as a change of the training config and a layout; each is trained by
Megatron-LM's loop under torchrun and measured beside :func:`helpers.learn.memory.memory_per_gpu` and
Megatron-LM's own estimate (``megatron/training/theoretical_memory_usage.py``), drawn in section 3.
Section 4 sets the pipeline schedules as they ran against Narayanan et al.'s (p - 1)/(v m).

Sources: Korthikanti et al. 2022 (arXiv:2205.05198); Narayanan et al. 2021 (arXiv:2104.04473)
section 2.2; Rajbhandari et al. 2020, "ZeRO" (arXiv:1910.02054); megatron-core 0.19.2
``pipeline_parallel/schedules.py``, ``optimizer/distrib_optimizer.py``.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Sequence

from helpers.demos.layout_runs import LayoutRun, run_layout
from helpers.learn import rank_record
from helpers.learn.memory import memory_per_gpu
from helpers.learn.model import Layout


@dataclass(frozen=True)
class Technique:
    """One memory saver as a run: ``changes`` to the training config (``TrainingConfig`` fields,
    i.e. Megatron-LM flags) and the layout it runs on; ``saves`` and ``costs``: what it is for;
    ``compute``: the arithmetic per step against the baseline's, which the time per step follows on
    GPUs (communication aside)."""

    name: str
    layout: Layout
    changes: dict[str, Any] = field(default_factory=dict)
    saves: str = ""
    costs: str = ""
    compute: str = "1"


#: The savers, each beside the run it is compared with (the first: one process, nothing saved).
TECHNIQUES: tuple[Technique, ...] = (
    Technique("baseline", Layout(1, 1, 1), {}, "nothing: one process holds everything", "-"),
    Technique("recompute selective", Layout(1, 1, 1), {"recompute": "selective"},
              "attention's s^2 tensors (softmax output)", "attention's core computed twice",
              "a little above 1 (attention's core again)"),
    Technique("recompute full", Layout(1, 1, 1), {"recompute": "full"},
              "all but each layer's input", "every layer's forward computed twice",
              "about 4/3 (one more forward per layer)"),
    Technique("DP=2", Layout(1, 1, 2), {}, "nothing per rank: half the batch each, all states replicated",
              "a gradient all-reduce per step", "1/2 per rank"),
    Technique("DP=2 distributed optimizer", Layout(1, 1, 2), {"use_distributed_optimizer": True},
              "the optimizer state: 1/DP of it per rank (ZeRO-1)", "reduce-scatter + all-gather instead of all-reduce",
              "1/2 per rank"),
    Technique("TP=2", Layout(2, 1, 1), {}, "weights, gradients, optimizer state and most activations / TP",
              "4 all-reduces per layer and micro-batch", "1/2 per rank"),
    Technique("TP=2 sequence parallel", Layout(2, 1, 1), {"sequence_parallel": True},
              "the norms' and residuals' activations / TP too", "all-gather + reduce-scatter instead of all-reduce",
              "1/2 per rank (the norms too)"),
    Technique("PP=2 1F1B", Layout(1, 2, 1), {}, "weights, gradients, optimizer state / PP (not activations)",
              "the bubble, (p - 1)/m of the compute time (section 5)", "1/2 per rank, plus the bubble"),
    Technique("PP=2 interleaved v=2", Layout(1, 2, 1), {"num_virtual_stages_per_pipeline_rank": 2},
              "the bubble: (p - 1)/(v m)", "more micro-batches in flight, v x the sends",
              "1/2 per rank, plus a bubble v times smaller"),
)


#: A mixture of experts (``model.num_experts``) on one process, and with its experts split over 2 ranks.
MOE_TECHNIQUES: tuple[Technique, ...] = (
    Technique("MoE, one process", Layout(1, 1, 1), {}, "nothing: every expert on one rank", "-"),
    Technique("MoE EP=2", Layout(1, 1, 2), {"expert_model_parallel_size": 2},
              "the experts: 1/EP of them per rank", "each token sent to its experts' ranks and back", "1/2 per rank"),
)


def _folder_name(name: str) -> str:
    return "toolbox_" + re.sub(r"[^a-z0-9]+", "_", name.lower()).strip("_")


def _config(base: Any, t: Technique) -> Any:
    """The training config technique ``t`` runs: ``base`` with its changes, on its layout's TP and PP."""
    return replace(base, tensor_model_parallel_size=t.layout.tensor_model_parallel_size,
                   pipeline_model_parallel_size=t.layout.pipeline_model_parallel_size, **t.changes)


def check_techniques(base: Any, techniques: Sequence[Technique] = TECHNIQUES) -> None:
    """Every check :func:`run_techniques` would meet, for all techniques, before any process starts.

    Raises:
        ValueError: the first technique the model or batch cannot run, named with its layout and changes,
            and the reason (the config's and the layout's own checks).
    """
    from helpers.learn.model import check_layout

    for t in techniques:
        cfg = _config(base, t)
        try:
            check_layout(cfg.model, t.layout, world_size=t.layout.world_size, micro_batch_size=cfg.micro_batch_size,
                         global_batch_size=cfg.global_batch_size)
            cfg.check(t.layout.world_size, files=False)
        except ValueError as err:
            raise ValueError(f"technique {t.name!r} ({t.layout.label}{', ' if t.changes else ''}"
                             f"{', '.join(f'{k}={v}' for k, v in t.changes.items())}) cannot run with this model and "
                             f"batch, so nothing was launched: {err}") from None


def run_techniques(base: Any, techniques: Sequence[Technique] = TECHNIQUES, *, timeout_s: float = 600.0,
                   progress: bool = True) -> dict[str, LayoutRun]:
    """Train ``base`` once per technique (from the same initial weights), each rank recorded.

    Args:
        base: :func:`helpers.demos.layout_runs.comparison_config`; its ``global_batch_size`` must
            split into micro-batches on every layout.

    Returns:
        ``{technique name: LayoutRun}`` (``records_dir`` holds each rank's ``rank_<r>.json``).

    Raises:
        ValueError: a technique the model or batch cannot run (:func:`check_techniques`, before any
            process starts); see :func:`helpers.demos.layout_runs.run_layout` for the rest.
    """
    check_techniques(base, techniques)
    runs = {}
    for t in techniques:
        runs[t.name] = run_layout(replace(base, **t.changes), t.layout, name=_folder_name(t.name), record=True,
                                  timeout_s=timeout_s, progress=progress)
    return runs


#: Megatron-LM's own estimate, printed by rank 0 after the first iteration (``training.py``,
#: ``report_theoretical_memory``), in MB of 2^20 bytes.
_MEGATRON_LM_LINE = re.compile(r"Theoretical memory footprints: weight and optimizer=([\d.]+) MB, "
                               r"activation=([\d.]+) MB")


def megatron_lm_printed(log_text: str) -> dict[str, float] | None:
    """Megatron-LM's printed estimate from a run's log: ``{"states", "activations"}`` in bytes, or None."""
    match = _MEGATRON_LM_LINE.search(log_text)
    if not match:
        return None
    return {"states": float(match[1]) * 2 ** 20, "activations": float(match[2]) * 2 ** 20}


def memory_rows(base: Any, runs: dict[str, LayoutRun], techniques: Sequence[Technique] = TECHNIQUES
                ) -> list[dict[str, Any]]:
    """Per technique and rank: what the rank held (measured) beside the two predictions, in bytes.

    Measured (:mod:`helpers.learn.rank_record`): ``weights``, ``gradients``, ``optimizer_state`` and
    ``activations`` (peak saved for backward over the micro-batches in flight). ``predicted_*``:
    :func:`helpers.learn.memory.memory_per_gpu` of this rank's stage (``fused=False`` for local layers).
    ``megatron_lm_states``, ``megatron_lm_activations``: Megatron-LM's printed estimate (rank 0 only;
    first stage, bf16 mixed precision: 18 bytes per parameter, 16-bit activations).

    Returns:
        Rows ``{"technique", "rank", "tp", "pp", "dp", "parameters", "weights", ..., "in_flight",
        "predicted_in_flight", ...}``.
    """
    by_name = {t.name: t for t in techniques}
    rows = []
    for name, run in runs.items():
        t = by_name[name]
        cfg = _config(base, t)
        dp = t.layout.data_parallel_size
        m = cfg.global_batch_size // (cfg.micro_batch_size * dp)
        printed = megatron_lm_printed((Path(run.records_dir).parent / "training.log").read_text(errors="replace"))
        for rec in rank_record.read(run.records_dir):
            peak = rank_record.activation_peak(rec)
            est = memory_per_gpu(cfg.model, t.layout, micro_batch_size=cfg.micro_batch_size, num_microbatches=m,
                                 precision=cfg.precision, distributed_optimizer=cfg.use_distributed_optimizer,
                                 recompute=cfg.recompute, sequence_parallel=cfg.sequence_parallel,
                                 num_virtual_stages=cfg.num_virtual_stages_per_pipeline_rank,
                                 fused=cfg.layer_spec != "local", expert_model_parallel_size=cfg.expert_model_parallel_size,
                                 stage=rec["pipeline_rank"])
            row = {"technique": name, "rank": rec["rank"], "tp": rec["tensor_rank"], "pp": rec["pipeline_rank"],
                   "dp": rec["data_rank"], "parameters": rec["parameters"], "predicted_parameters": est.parameters,
                   "weights": rec["weights"], "gradients": rec["gradients"], "optimizer_state": rec["optimizer_state"],
                   "activations": peak["bytes"], "in_flight": peak["in_flight"],
                   "predicted_weights": est.weights, "predicted_gradients": est.gradients,
                   "predicted_optimizer_state": est.optimizer_state, "predicted_activations": est.activations,
                   "predicted_in_flight": est.microbatches_in_flight * (cfg.num_virtual_stages_per_pipeline_rank or 1)}
            if printed and rec["rank"] == 0:
                row |= {"megatron_lm_states": printed["states"], "megatron_lm_activations": printed["activations"]}
            rows.append(row)
    return rows


def states(row: dict[str, Any], prefix: str = "") -> float:
    """Weights + gradients + optimizer state of a :func:`memory_rows` row (``prefix="predicted_"``: predicted)."""
    return sum(row[prefix + k] for k in ("weights", "gradients", "optimizer_state"))


def summary_table(rows: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """The most loaded rank of each technique, in MiB, with each predictor's relative error.

    Returns:
        Rows ``{"technique", "rank", "states MiB", "states: series error", "states: Megatron-LM error (rank 0)",
        "activations MiB", "activations: series error", "activations: Megatron-LM error (rank 0)", "in flight"}``; the error columns hold ``predicted/measured - 1``
        (a fraction). Megatron-LM's estimate describes the first pipeline stage, so it is set against rank 0,
        whichever rank the row's MiB describe.
    """
    mib = 2 ** 20
    out = []
    for name in dict.fromkeys(r["technique"] for r in rows):
        ranks = [r for r in rows if r["technique"] == name]
        top = max(ranks, key=lambda r: states(r) + r["activations"])
        first = next(r for r in ranks if r["rank"] == 0)
        out.append({"technique": name, "rank": top["rank"],
                    "states MiB": round(states(top) / mib, 2),
                    "states: series error": states(top, "predicted_") / states(top) - 1,
                    "states: Megatron-LM error (rank 0)": first.get("megatron_lm_states", float("nan")) / states(first) - 1,
                    "activations MiB": round(top["activations"] / mib, 2),
                    "activations: series error": top["predicted_activations"] / top["activations"] - 1,
                    "activations: Megatron-LM error (rank 0)": first.get("megatron_lm_activations", float("nan")) / first["activations"] - 1,
                    "in flight": f"{top['in_flight']} (predicted {top['predicted_in_flight']:g})"})
    return out


def plot_memory(rows: Sequence[dict[str, Any]], title: str = ""):
    """Stacked bars of what each rank held (measured), with the series' prediction of each part as a
    marker: one group of bars per technique, one bar per rank."""
    import matplotlib.pyplot as plt

    parts = ("weights", "gradients", "optimizer_state", "activations")
    colours = ("#4c72b0", "#55a868", "#c44e52", "#8172b2")
    fig, ax = plt.subplots(figsize=(12, 4.8))
    names = list(dict.fromkeys(r["technique"] for r in rows))
    x, ticks = 0.0, []
    for name in names:
        ranks = [r for r in rows if r["technique"] == name]
        centres = []
        for r in ranks:
            bottom = 0.0
            for part, colour in zip(parts, colours):
                ax.bar(x, r[part] / 2 ** 20, 0.8, bottom=bottom, color=colour, label=part.replace("_", " ") if x == 0 else None)
                bottom += r[part] / 2 ** 20
            if len(ranks) > 1:
                ax.text(x, 0, f"r{r['rank']}", ha="center", va="bottom", fontsize=7, color="white")
            predicted = sum(r["predicted_" + p] for p in parts) / 2 ** 20
            ax.plot([x - 0.4, x + 0.4], [predicted] * 2, "k-", lw=2, label="series' prediction (total)" if x == 0 else None)
            centres.append(x)
            x += 1
        label = name.replace(" ", "\n", 1) + ("" if len(ranks) == 1 else f"\n({len(ranks)} ranks)")
        ticks.append((sum(centres) / len(centres), label))
        x += 0.7
    ax.set_xticks([t for t, _ in ticks], [n for _, n in ticks], fontsize=8)
    ax.set(ylabel="MiB per rank", title=title or "What each rank held: measured (bars) and predicted (lines)")
    ax.set_ylim(0, ax.get_ylim()[1] * 1.18)  # room for the legend above the bars
    ax.legend(fontsize=8, loc="upper center", ncol=5)
    fig.tight_layout()
    return fig


def timeline(records: Sequence[dict[str, Any]], iteration: int | None = None) -> list[dict[str, Any]]:
    """The forward and backward passes of one iteration on every rank, in seconds from its first start.

    Args:
        records: :func:`helpers.learn.rank_record.read` of a pipeline run.
        iteration: default: the last recorded.

    Returns:
        ``[{"rank", "kind", "chunk", "microbatch", "start", "end"}]`` sorted by rank and start.
    """
    it = iteration if iteration is not None else max(e["iteration"] for r in records for e in r["events"])
    events = [(r["pipeline_rank"], e) for r in records for e in r["events"] if e["iteration"] == it]
    t0 = min(e["start"] for _, e in events)
    return sorted(({"rank": rank, "kind": e["kind"], "chunk": e["chunk"], "microbatch": e["microbatch"],
                    "start": e["start"] - t0, "end": e["end"] - t0} for rank, e in events),
                  key=lambda e: (e["rank"], e["start"]))


def measured_bubble(records: Sequence[dict[str, Any]]) -> dict[str, float]:
    """The bubble as it ran: per iteration and rank, time not spent in a forward or backward
    between the rank's first start and last end, over the time spent in them (Narayanan et al.'s
    bubble time over ideal time, (p - 1)/(v m)); the median over ranks and iterations after the first.

    Returns:
        ``{"bubble": median ratio, "iterations": counted}``.
    """
    import statistics

    ratios, its = [], sorted({e["iteration"] for r in records for e in r["events"]})
    if not its:
        raise ValueError("the records hold no forward or backward: was the run recorded (record=True) and did it train?")
    for it in its[1:] or its:
        for r in records:
            ev = [e for e in r["events"] if e["iteration"] == it]
            if not ev:
                raise ValueError(f"rank {r.get('rank')} recorded nothing in iteration {it}: a rank that did not train")
            busy = sum(e["end"] - e["start"] for e in ev)
            span = max(e["end"] for e in ev) - min(e["start"] for e in ev)
            ratios.append((span - busy) / busy)
    return {"bubble": statistics.median(ratios), "iterations": len(its[1:] or its)}


def chunk_times(records: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """The median forward and backward time of each pipeline rank's model chunk, after the first iteration.

    Returns:
        Rows ``{"pipeline rank", "chunk", "forward_ms", "backward_ms"}`` (milliseconds), for a markdown table.
    """
    import statistics

    rows = []
    for r in records:
        events = [e for e in r["events"] if e["iteration"] > 1] or r["events"]
        for chunk in sorted({e["chunk"] for e in events}):
            ms = {kind: statistics.median(1e3 * (e["end"] - e["start"]) for e in events
                                          if e["chunk"] == chunk and e["kind"] == kind) for kind in ("forward", "backward")}
            rows.append({"pipeline rank": r["pipeline_rank"], "chunk": chunk, "forward_ms": round(ms["forward"], 2),
                         "backward_ms": round(ms["backward"], 2)})
    return rows


def plot_timelines(runs: dict[str, Sequence[dict[str, Any]]]):
    """One panel per run: each pipeline rank's forwards (light) and backwards (dark) of one
    iteration as they ran, labelled with the micro-batch (and model chunk ``c``)."""
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(len(runs), 1, figsize=(12, 2.0 + 1.2 * len(runs)), squeeze=False)
    for ax, (title, events) in zip(axes[:, 0], runs.items()):
        chunks = max(e["chunk"] for e in events) + 1
        for e in events:
            shade = ("#9ecae1", "#3182bd") if e["chunk"] == 0 else ("#fdae6b", "#e6550d")
            colour = shade[e["kind"] == "backward"]
            ax.barh(e["rank"], e["end"] - e["start"], left=e["start"], height=0.7, color=colour, edgecolor="white")
            label = f"{'F' if e['kind'] == 'forward' else 'B'}{e['microbatch'] + 1}" + (f"c{e['chunk']}" if chunks > 1 else "")
            ax.text((e["start"] + e["end"]) / 2, e["rank"], label, ha="center", va="center", fontsize=8)
        ranks = sorted({e["rank"] for e in events})
        ax.set_yticks(ranks, [f"pipeline rank {r}" for r in ranks])
        ax.invert_yaxis()
        ax.set(title=title, xlabel="seconds from the iteration's first forward")
    from matplotlib.patches import Patch

    legend = [Patch(color=c, label=f"{kind}, model chunk {chunk}") for chunk, shades in enumerate((("#9ecae1", "#3182bd"),
              ("#fdae6b", "#e6550d"))) for kind, c in zip(("forward", "backward"), shades)]
    fig.legend(handles=legend, loc="lower center", ncol=4, fontsize=8)
    fig.tight_layout(rect=(0, 0.06, 1, 1))
    return fig


__all__ = ["MOE_TECHNIQUES", "TECHNIQUES", "Technique", "check_techniques", "chunk_times", "measured_bubble", "megatron_lm_printed", "memory_rows",
           "plot_memory", "plot_timelines", "run_techniques", "states", "summary_table", "timeline"]
