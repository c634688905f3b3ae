"""Training real layouts (TP=2, PP=2, DP=2) under torchrun and comparing them to one process.

Notebook 05, section 4 (the runs, their losses within :data:`LOSS_ATOL_FP32`, their wall times), section 7
(a bad layout refused before launching) and section 8 (the TP=2 run's checkpoint for notebook 06). Each
layout is Megatron-LM's loop (``helpers.learn.pretrain_gpt``), started by a one-node
:class:`helpers.demos.launch_plans.LaunchPlan`. Entry point (started by torchrun)::

    python -m helpers.demos.layout_runs --config initial.json   # save the TP=1 initial weights

Sources: Shoeybi et al. 2019 (arXiv:1909.08053) section 3; Narayanan et al. 2021 (arXiv:2104.04473)
section 3; Megatron-LM ``megatron/training/initialize.py`` (``_set_random_seed``: per-stage seeds);
megatron-core 0.19.2 ``dist_checkpointing`` (resharding a checkpoint to another TP/PP).
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import sys
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any, Sequence

from helpers.demos.launch_plans import launch_plan
from helpers.runner import preflight
from helpers.runner.launch import _ITERATION
from helpers.learn.model import Layout, ModelConfig, check_layout

#: The notebook each output folder of :func:`comparison_config` serves: its TensorBoard runs are named
#: ``<notebook>_<run>`` (``05_parallelism_tp2_pp1_dp1``).
_NOTEBOOKS = {"parallelism": "05_parallelism", "memory_toolbox": "05b_memory_toolbox",
              "memory_toolbox_moe": "05b_memory_toolbox"}

#: Largest per-iteration |loss difference| (nats) accepted as "the same run" in fp32. Reduction
#: order differs between layouts (a sum split over 2 ranks, then all-reduced), so fp32
#: round-off (about 1e-7 relative) enters every step; AdamW keeps it at that scale.
LOSS_ATOL_FP32 = 1e-4


@dataclass
class LayoutRun:
    """One layout trained by :func:`run_layout`.

    Attributes:
        layout, name: the layout and its folder name under ``{run_dir}/parallelism``.
        losses: LM loss (nats/token) of iterations 1..train_iters; s_per_iter: seconds per iteration as logged.
        valid_losses: validation losses (Megatron-LM's evaluations, then the one after training).
        wall_seconds: the torchrun job's wall time (imports, set-up, training, saving).
        command: the command executed; generated_command: the one :class:`helpers.demos.launch_plans.LaunchPlan` wrote.
        initial: ``"shared"`` (started from the shared initial checkpoint) or ``"own"``.
        skipped: the result was read from an earlier run (nothing launched).
        records_dir: where each rank wrote what it held and when it computed (:mod:`helpers.learn.rank_record`).
    """

    layout: Layout
    name: str
    losses: list[float]
    s_per_iter: list[float]
    valid_losses: list[float]
    wall_seconds: float
    command: list[str]
    generated_command: list[str]
    checkpoint_dir: str
    initial: str
    skipped: bool = False
    records_dir: str | None = None

    def to_dict(self) -> dict[str, Any]:
        data = asdict(self)
        data["layout"] = asdict(self.layout)
        return data

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "LayoutRun":
        return cls(**{**data, "layout": Layout(**data["layout"])})


def comparison_config(run_dir: str | os.PathLike, *, model: ModelConfig, micro_batch_size: int, global_batch_size: int,
                      train_iters: int, split: str = "969,30,1", lr: float = 1e-3, seed: int = 1234,
                      folder: str = "parallelism") -> Any:
    """The training config every layout of notebook 05 shares (a ``helpers.learn.training_config.TrainingConfig``).

    The ``cpu`` training profile with the given model and batch, fp32, no dropout required but
    checked, the data of ``{run_dir}/data`` (notebook 01), a loss logged every iteration, one
    validation batch at the end, no intermediate checkpoints. Its own outputs go to
    ``{run_dir}/{folder}/`` (notebook 05: ``parallelism``; 05b: ``memory_toolbox``).

    Raises:
        ValueError: dropout is not 0 (per-rank dropout streams make layouts differ by design),
            or the vocabulary padding would differ between TP=1 and TP=2 (extra logits rows
            change the softmax): the message says how to set ``make_vocab_size_divisible_by``.
    """
    from helpers.learn import training_config

    run = Path(run_dir).expanduser().resolve()
    if model.hidden_dropout or model.attention_dropout:
        raise ValueError(
            f"hidden_dropout={model.hidden_dropout}, attention_dropout={model.attention_dropout}: layouts draw "
            "dropout masks from different RNG streams (one per TP rank), so their losses cannot be compared step by "
            "step. Use dropout 0 for this comparison."
        )
    if model.padded_vocab_size(1) != model.padded_vocab_size(2):
        raise ValueError(
            f"vocab_size={model.vocab_size} pads to {model.padded_vocab_size(1)} rows at TP=1 but "
            f"{model.padded_vocab_size(2)} at TP=2 (Megatron pads to a multiple of make_vocab_size_divisible_by x TP), "
            "so the models differ. Use a vocabulary that is a multiple of "
            f"{2 * model.make_vocab_size_divisible_by}, or a smaller make_vocab_size_divisible_by."
        )
    warmup = max(1, min(10, train_iters // 5))
    return training_config.profile(
        "cpu", str(run / folder), model=model, data_prefix=str(run / "data" / "codeparrot_content_document"),
        tokenizer_dir=str(run / "data" / "tokenizer"), split=split, micro_batch_size=micro_batch_size,
        global_batch_size=global_batch_size, train_iters=train_iters, lr=lr, min_lr=lr / 10,
        lr_warmup_iters=warmup if warmup < train_iters else 0, seed=seed, precision="fp32",
        log_interval=1, eval_interval=train_iters, eval_iters=1, save_interval=None, layer_spec="local",
    )


def launch_env(world_size: int) -> dict[str, str]:
    """Extra environment of a launch of ``world_size`` processes: ``{"CUDA_VISIBLE_DEVICES": ""}``
    (GPUs hidden) when there are fewer GPUs than ``world_size`` or than 2 (the largest layout
    compared), else :data:`helpers.support.environment.IEEE_FP32_ENV` (TF32 off); so every layout
    of a comparison (and the shard inspection, :mod:`helpers.demos.shards`) runs on the same kind
    of device: all on the CPU (gloo, fp32), or all on GPUs (NCCL, IEEE fp32)."""
    import torch

    from helpers.support.environment import IEEE_FP32_ENV

    if torch.cuda.is_available() and torch.cuda.device_count() < max(world_size, 2):
        return {"CUDA_VISIBLE_DEVICES": ""}
    return dict(IEEE_FP32_ENV) if torch.cuda.is_available() else {}


def child_arguments(cfg, world_size: int) -> tuple[list[str], dict[str, str]]:
    """Megatron-LM's flags for a layout's ``world_size`` children, and their extra environment.

    The flags are for the devices the children see (:func:`launch_env`): with the GPUs hidden they
    are the CPU's (gloo, the local spec), though this process sees CUDA.
    """
    from helpers.runner import megatron_args

    env = launch_env(world_size)
    return megatron_args.arguments(cfg, target="cpu" if "CUDA_VISIBLE_DEVICES" in env else None), env


def _progress_handler(total: int, desc: str, progress: bool):
    from tqdm.auto import tqdm

    bar = tqdm(total=total, desc=desc, unit="it") if progress else None

    def on_line(line: str) -> None:
        match = _ITERATION.search(line)
        if bar is not None and match:
            bar.update(int(match[1]) - bar.n)
            if "lm loss:" in line:
                bar.set_postfix(loss=line.split("lm loss:")[1].split("|")[0].strip())

    return bar, on_line


def initial_checkpoint(base: Any, *, timeout_s: float = 600.0, progress: bool = True) -> Path:
    """Save the TP=1 model's initial weights once, as ``iter_0000000`` (cached).

    Every layout starts from it (``--pretrained-checkpoint``), resharded by ``dist_checkpointing``, so all
    start from identical weights; from scratch, stage r > 0 seeds with seed + 100 r (Megatron-LM's
    ``_set_random_seed``). One process: ``python -m helpers.demos.layout_runs --config ...``.

    Args:
        base: :func:`comparison_config`.

    Returns:
        The checkpoint folder ``{run_dir}/parallelism/initial`` (holding ``iter_0000000``).

    Raises:
        checkpointing.CheckpointMismatchError: a cached initial checkpoint of another model shape.
        helpers.runner.launch.LaunchError: the job failed or timed out.
    """
    from helpers.learn import checkpointing
    from helpers.runner import launch

    folder = base.run_path / "initial"
    cfg = replace(base, checkpoint_dir=str(folder), tensor_model_parallel_size=1, pipeline_model_parallel_size=1)
    if checkpointing.latest_iteration(folder) == 0:
        checkpointing.check_compatible(checkpointing.read_model_config(folder, 0), cfg.model.to_metadata(1), folder)
        return folder
    cfg.check(1)
    config_path = cfg.to_json(base.run_path / "initial.json")
    launch.torchrun(["helpers.demos.layout_runs", "--config", str(config_path)], nproc_per_node=1,
                    timeout_s=timeout_s, env=launch_env(1), on_line=None if not progress else _print_marked,
                    log_path=base.run_path / "initial.log")
    return folder


def _print_marked(line: str) -> None:
    if line.startswith(">"):
        print(line, flush=True)


def run_layout(base: Any, layout: Layout, *, initial: str = "shared", checkpoint_dir: str | os.PathLike | None = None,
               name: str | None = None, timeout_s: float = 900.0, progress: bool = True,
               record: bool = False) -> LayoutRun:
    """Train ``base`` with ``layout`` under torchrun on this machine and collect its losses.

    The launch is the node-0 command of a one-node :class:`LaunchPlan` (checked to be exactly the one
    executed). Cached: a layout that finished ``train_iters`` with the same config returns its stored result.

    Args:
        base: :func:`comparison_config`; ``layout.world_size`` processes are started.
        initial: ``"shared"``: start from :func:`initial_checkpoint` (made if missing); ``"own"``: the
            layout initialises its own weights (Megatron's per-stage seeds).
        name: folder name (default ``layout.name``, plus ``_own_init`` for ``initial="own"``).
        timeout_s: wall-clock limit of the job (s).
        record: each rank writes its memory and schedule to ``{folder}/ranks`` (same losses).

    Returns:
        :class:`LayoutRun`.

    Raises:
        ValueError: :func:`helpers.learn.model.check_layout` refuses the layout, or the folder holds a run of
            another config (nothing is launched or deleted); an unknown ``initial``.
        FileNotFoundError: the data of notebook 01 is missing.
        helpers.runner.launch.LaunchError: a rank failed (named) or the job timed out.
    """
    from helpers.learn import checkpointing, rank_record
    from helpers.runner import launch, megatron_args, metrics

    if initial not in ("shared", "own"):
        raise ValueError(f"initial={initial!r}: choose 'shared' or 'own'")
    check_layout(base.model, layout, world_size=layout.world_size, micro_batch_size=base.micro_batch_size,
                 global_batch_size=base.global_batch_size)
    name = name or layout.name + ("_own_init" if initial == "own" else "")
    folder = base.run_path / name
    ckpt = Path(checkpoint_dir).expanduser().resolve() if checkpoint_dir else folder / "checkpoints"
    cfg = replace(base, tensor_model_parallel_size=layout.tensor_model_parallel_size,
                  pipeline_model_parallel_size=layout.pipeline_model_parallel_size, checkpoint_dir=str(ckpt),
                  metrics_path=str(folder / "metrics.jsonl"),
                  tensorboard_dir=str(base.run_path.parent / "tensorboard" /
                                      f"{_NOTEBOOKS.get(base.run_path.name, base.run_path.name)}_{name}"))
    if initial == "shared":
        cfg = replace(cfg, pretrained_checkpoint=str(initial_checkpoint(base, timeout_s=timeout_s, progress=progress)))
    cfg.check(layout.world_size)
    config_path, result_path = folder / "run.json", folder / "layout_run.json"
    # what the run trains must match; paths and logging need not (a copied or moved run folder keeps its runs)
    diffs = preflight.training_differences(cfg, json.loads(config_path.read_text()),
                                           also_ignore=frozenset({"pretrained_checkpoint"})) if config_path.exists() else []
    if diffs:
        raise ValueError(
            f"{folder} holds a run of another config ({'; '.join(diffs)}). Nothing was launched or changed: use another "
            f"run_dir, or delete {folder}" + (f" and {ckpt}" if checkpoint_dir else "") + f" to rerun (after changing a "
            f"notebook parameter, delete {base.run_path}: every run of the notebook there was made with the old value)."
        )
    latest = checkpointing.latest_iteration(ckpt)
    if latest is not None and not config_path.exists():
        raise ValueError(
            f"{ckpt} already holds a checkpoint (iteration {latest}) that run_layout did not make for {name}: "
            "nothing was launched or changed. Pass another checkpoint_dir, or delete that folder to rerun."
        )
    if latest is not None:
        saved = checkpointing.read_model_config(ckpt, latest)
        checkpointing.check_compatible(saved, cfg.model.to_metadata(layout.tensor_model_parallel_size), ckpt)
        if latest >= cfg.train_iters and result_path.exists():
            cached = LayoutRun.from_dict(json.loads(result_path.read_text()))
            if record and not cached.records_dir:
                raise ValueError(f"{folder} holds this run, trained without record=True: nothing was launched or "
                                 f"changed. Delete {folder} (and {ckpt}) to train it again with its ranks recorded.")
            return replace(cached, skipped=True)
    folder.mkdir(parents=True, exist_ok=True)
    records_dir = folder / "ranks" if record else None
    cfg.to_json(config_path)
    argv, env = child_arguments(cfg, layout.world_size)
    plan = launch_plan(layout, [megatron_args.SCRIPT[1], *argv])
    bar, on_line = _progress_handler(cfg.train_iters, layout.label, progress)
    log_path = folder / "training.log"
    try:
        res = launch.torchrun(list(plan.target), nproc_per_node=plan.nproc_per_node, timeout_s=timeout_s,
                              master_port=plan.master_port, env={**megatron_args.ENV, **env,
                                                                 **({rank_record.ENV: str(records_dir)} if record else {})},
                              on_line=on_line, log_path=log_path)
    finally:
        if bar is not None:
            bar.close()
    if res.command != plan.local_command():
        raise RuntimeError(f"executed {shlex.join(res.command)} but the plan generated {shlex.join(plan.local_command())}")
    records = metrics.from_megatron_lm(cfg, log_path.read_text(errors="replace"))
    its = records["iteration"]
    run = LayoutRun(layout=layout, name=name, losses=[r["lm_loss"] for r in its],
                    s_per_iter=[r["s_per_iter"] for r in records["train"]],
                    valid_losses=[r["lm_loss"] for r in records["valid"]],
                    wall_seconds=round(res.wall_seconds, 2), command=res.command,
                    generated_command=plan.local_command(), checkpoint_dir=str(ckpt), initial=initial,
                    records_dir=str(records_dir) if record else None)
    result_path.write_text(json.dumps(run.to_dict(), indent=2) + "\n")
    return run


def compare_losses(reference: LayoutRun, runs: Sequence[LayoutRun], atol: float = LOSS_ATOL_FP32) -> list[dict[str, Any]]:
    """Per run: the largest |loss - reference loss| over the iterations, and whether it is <= atol.

    Returns:
        Rows for ``helpers.support.results.markdown_table``: ``[{"run", "layout", "initial weights",
        "max_abs_diff", "first_iteration_diff", "within_atol"}]`` (differences in nats/token).

    Raises:
        ValueError: a run has a different number of iterations than the reference.
    """
    rows = []
    for run in runs:
        if len(run.losses) != len(reference.losses):
            raise ValueError(f"{run.name} logged {len(run.losses)} iterations, the reference {len(reference.losses)}")
        diffs = [abs(a - b) for a, b in zip(run.losses, reference.losses)]
        rows.append({"run": run.name, "layout": run.layout.label, "initial weights": run.initial,
                     "max_abs_diff": max(diffs), "first_iteration_diff": diffs[0], "within_atol": max(diffs) <= atol})
    return rows


def loss_table(runs: Sequence[LayoutRun]) -> list[dict[str, Any]]:
    """One row per iteration: ``{"iteration": i, <run name>: LM loss (nats/token), ...}``, for
    ``helpers.support.results.markdown_table`` (pass ``digits=7`` to see fp32 round-off).

    Raises:
        ValueError: no runs.
    """
    if not runs:
        raise ValueError("loss_table needs at least one run")
    return [{"iteration": i + 1, **{r.name: r.losses[i] for r in runs}} for i in range(len(runs[0].losses))]


def timing_table(runs: Sequence[LayoutRun], tokens_per_iteration: int) -> list[dict[str, Any]]:
    """Per run: processes, the launch's wall seconds, the median seconds per iteration and the
    tokens per second it implies (``tokens_per_iteration`` = global batch x sequence length).

    Returns:
        Rows for ``helpers.support.results.markdown_table``: ``[{"run", "processes", "wall_s", "cached",
        "median_s_per_iter", "tokens_per_s"}]`` (seconds; tokens per second).
    """
    rows = []
    for run in runs:
        per_iter = median_s_per_iter(run)
        rows.append({"run": run.name, "processes": run.layout.world_size, "wall_s": run.wall_seconds,
                     "cached": run.skipped, "median_s_per_iter": round(per_iter, 4),
                     "tokens_per_s": round(tokens_per_iteration / per_iter)})
    return rows


def run_label(run: LayoutRun, reference: bool = False) -> str:
    """``"TP=2 PP=1 DP=1 (2 processes)"``: a run in words for legends and bar labels."""
    procs = run.layout.world_size
    words = f"{run.layout.label} ({procs} process{'es' if procs > 1 else ''}"
    words += ", own initial weights" if run.initial == "own" else ""
    return words + (", reference)" if reference else ")")


#: Sideways shift between two runs' markers in :func:`plot_losses` (iterations).
LOSS_PLOT_DODGE = 0.2


def _dodges(n: int) -> list[float]:
    return [(j - (n - 1) / 2) * LOSS_PLOT_DODGE for j in range(n)]


def loss_differences(reference: LayoutRun, run: LayoutRun, floor: float = 1e-12) -> list[float]:
    """``|loss - reference loss|`` per iteration (nats/token), exact zeros raised to ``floor`` for a log axis.

    Raises:
        ValueError: the runs logged different numbers of iterations.
    """
    if len(run.losses) != len(reference.losses):
        raise ValueError(f"{run.name} logged {len(run.losses)} iterations, the reference {len(reference.losses)}")
    return [max(abs(a - b), floor) for a, b in zip(run.losses, reference.losses)]


def plot_losses(reference: LayoutRun, runs: Sequence[LayoutRun]):
    """Left: loss per iteration of every run; right: |difference| to the reference (log scale).

    Runs whose losses agree to 1e-6 would hide each other, so every run has its own marker and
    line style, and its markers are shifted sideways by a multiple of :data:`LOSS_PLOT_DODGE`
    iterations (said in the legend); the reference is the wide grey line at the true iterations.
    Differences of exactly 0 are drawn at 1e-12.

    Returns:
        a matplotlib ``Figure`` with two axes; in each, the runs' lines follow the reference's
        (left) or the tolerance line (right), in the order of ``runs``.
    """
    import matplotlib.pyplot as plt

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(13, 4.6))
    its = list(range(1, len(reference.losses) + 1))
    ax1.plot(its, reference.losses, "-", color="grey", lw=6, alpha=0.35, label=run_label(reference, True))
    ax2.axhline(LOSS_ATOL_FP32, color="red", ls=":", label=f"tolerance {LOSS_ATOL_FP32:g} nats")
    styles = [("o", "--", "tab:blue"), ("s", "-.", "tab:orange"), ("^", ":", "tab:green"),
              ("D", "--", "tab:purple"), ("v", "-.", "tab:brown"), ("X", ":", "tab:pink")]
    for run, dx, (marker, ls, color) in zip(runs, _dodges(len(runs)), styles * len(runs)):
        xs = [i + dx for i in its]
        shift = f"{dx:+.1f} it" if dx else "not shifted"
        ax1.plot(xs, run.losses, marker=marker, ls=ls, ms=6, mfc="none", mew=1.5, color=color,
                 label=f"{run_label(run)}, {shift}")
        ax2.semilogy(xs, loss_differences(reference, run), marker=marker, ls=ls, ms=6, mfc="none", mew=1.5,
                     color=color, label=f"{run_label(run)}, {shift}")
    ax1.set(title="LM loss per iteration: every layout", xlabel="iteration", ylabel="loss (nats/token)")
    ax2.set(title=f"|loss - one-process loss| per iteration (log scale; 0 drawn at 1e-12)",
            xlabel="iteration", ylabel="absolute difference (nats/token)")
    ax1.legend(fontsize=8, loc="upper center", bbox_to_anchor=(0.5, -0.16), ncol=2,
               title="markers shifted sideways so that equal values stay visible", title_fontsize=8)
    ax2.legend(fontsize=8, loc="upper center", bbox_to_anchor=(0.5, -0.16), ncol=2)
    for ax in (ax1, ax2):
        ax.set_xticks(its)
        ax.grid(True, alpha=0.3)
    fig.tight_layout()
    return fig


def median_s_per_iter(run: LayoutRun) -> float:
    """The run's median seconds per iteration (the upper median, as :func:`timing_table` reports).

    Raises:
        ValueError: the run logged no iteration times.
    """
    if not run.s_per_iter:
        raise ValueError(f"{run.name} logged no s_per_iter")
    return sorted(run.s_per_iter)[len(run.s_per_iter) // 2]


#: Relative run-to-run noise of a time per iteration on a shared machine: a parallel run counts as
#: faster than one process in :func:`wall_time_summary` only when it takes less than 1 - this of its time.
TIME_NOISE = 0.10


def wall_time_summary(reference: LayoutRun, runs: Sequence[LayoutRun], cores: int | None = None) -> str:
    """One sentence, computed from the runs: were the parallel layouts faster per iteration than one process, and why.

    A run counts as faster only when its median time per iteration is below ``1 - TIME_NOISE``
    of the reference's (:data:`TIME_NOISE`: the noise of a shared machine).

    Args:
        reference: the one-process run.
        runs: the parallel runs.
        cores: CPU cores of this machine (default ``os.cpu_count()``).

    Raises:
        ValueError: no runs.
    """
    if not runs:
        raise ValueError("wall_time_summary needs at least one parallel run")
    cores = cores or os.cpu_count() or 1
    ref = median_s_per_iter(reference)
    ratios = {r.layout.label + (" from its own initial weights" if r.initial == "own" else ""):
              median_s_per_iter(r) / ref for r in runs}
    faster = [k for k, v in ratios.items() if v < 1 - TIME_NOISE]
    procs = "/".join(str(n) for n in sorted({r.layout.world_size for r in runs}))
    each = ", ".join(f"{k} {v:.2f}x as long" for k, v in ratios.items())
    closest = min(ratios, key=ratios.get)
    noise = f"{TIME_NOISE:.0%}, the run-to-run noise of a shared machine"
    verdict = (f"none of the {len(runs)} parallel runs was clearly faster per iteration than one process (by more "
               f"than {noise}; closest: {closest})" if not faster else
               f"{len(faster)} of the {len(runs)} parallel runs {'was' if len(faster) == 1 else 'were'} faster per "
               f"iteration than one process by more than {noise} ({', '.join(faster)})")
    plural = "s" if cores > 1 else ""
    shared = (f"the {procs} processes of a parallel run share the same {cores} core{plural} the one process had to "
              "itself, so no layout gets more compute")
    why = (f"{shared}, and each adds communication over gloo: TP all-reduces inside every layer, PP sends between its "
           "stages and its pipeline bubble, DP one gradient all-reduce per step" if not faster else
           f"{shared}, so the one process was slowed here: most likely by other jobs on the machine while it ran, or "
           "by its two threads. Rerun on an idle machine before reading a speed-up into it")
    return (f"On this machine's {cores} CPU core{plural}, {verdict}. Time per iteration against {ref:.3f} s for one "
            f"process: {each}. Why: {why}.")


def plot_wall_times(reference: LayoutRun, runs: Sequence[LayoutRun], title: str = "Wall time per layout"):
    """Horizontal bars per run: the launch's wall time (s) and the median seconds per iteration.

    One bar per run, the one-process reference first (grey); each bar carries its value and its
    ratio to the reference.

    Returns:
        a matplotlib ``Figure`` with two axes (wall time, seconds per iteration).
    """
    import matplotlib.pyplot as plt

    every = [reference, *runs][::-1]  # reference at the top
    labels = [run_label(r, r is reference) for r in every]
    fig, axes = plt.subplots(1, 2, figsize=(13, 0.5 * len(every) + 1.9), sharey=True)
    panels = ((axes[0], [r.wall_seconds for r in every], "s", "whole launch: imports, set-up, training, save (s)",
               "Wall time of the torchrun launch"),
              (axes[1], [median_s_per_iter(r) for r in every], "s/it", "median time per iteration (s)",
               "Time per training iteration"))
    for ax, values, unit, xlabel, panel_title in panels:
        ref = values[-1]
        ax.barh(range(len(every)), values, color=["tab:grey" if r is reference else "tab:blue" for r in every])
        for y, v in enumerate(values):
            ax.text(v + 0.02 * max(values), y, f"{v:.3g} {unit} ({v / ref:.2f}x)", va="center", fontsize=8)
        ax.set_xlim(0, max(values) * 1.35)
        ax.set(xlabel=xlabel, title=panel_title)
        ax.grid(True, axis="x", alpha=0.3)
    axes[0].set_yticks(range(len(every)), labels, fontsize=8)
    fig.suptitle(f"{title} (ratios: against the one-process run; {os.cpu_count()} CPU cores)")
    fig.tight_layout()
    return fig



# =========================================================================== torchrun entry points
def _init_checkpoint_main(config: str) -> None:
    """Build the TP=1 model with the run's seed, as Megatron-LM's loop does, and save its weights at iteration 0."""
    from helpers.learn import checkpointing, distributed, training_config
    from helpers.learn import model as model_lib

    cfg = training_config.TrainingConfig.from_json(config)
    distributed.initialize_distributed(1, 1, cfg.seed)
    model = model_lib.build_model(cfg.model, layer_spec="local")
    meta = {**cfg.model.to_metadata(1), "iteration": 0, "tensor_model_parallel_size": 1,
            "pipeline_model_parallel_size": 1, "layer_spec": "local", "tokenizer_dir": str(cfg.tokenizer_path)}
    folder = checkpointing.save_model(model, cfg.checkpoint_path, 0, meta)
    n = sum(p.numel() for p in model.parameters())
    print(f"> saved the initial weights ({n:,} parameters) to {folder}", flush=True)
    distributed.destroy_distributed()


def main(argv: list[str] | None = None) -> int:
    """``python -m helpers.demos.layout_runs --config initial.json``: save the TP=1 model's initial
    weights as ``iter_0000000`` (what :func:`initial_checkpoint` launches)."""
    parser = argparse.ArgumentParser(prog="python -m helpers.demos.layout_runs",
                                     description="save the TP=1 model's initial weights as iter_0000000")
    parser.add_argument("--config", required=True, help="a helpers.learn.training_config.TrainingConfig JSON file")
    args = parser.parse_args(argv)
    from helpers.support import run_guard

    run_guard.checkpoint_queue_in_process()
    _init_checkpoint_main(args.config)
    return 0


if __name__ == "__main__":
    sys.exit(main())
