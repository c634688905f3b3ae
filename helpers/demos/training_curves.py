"""Notebook 03's pictures of Megatron-LM's training loop: what it logged, and a kill and resume.

Section 7: the loss curves, the learning-rate schedule and the tokens per second of each log interval.
Section 8: a short run trained once without a break, and once stopped by SIGTERM and resumed from its
checkpoint (``--exit-signal-handler``, ``--load``). Records: :mod:`helpers.runner.metrics`'s.

Sources: Megatron-LM ``megatron/training/training.py`` (``training_log``: "elapsed time per
iteration (ms)"; the exit signal handler's save), ``megatron/training/checkpointing.py``
(``load_checkpoint``: RNG states and the data position); TensorBoard's ``EventAccumulator``.
"""

from __future__ import annotations

import json
import os
import signal
import statistics
import subprocess
import tempfile
import time
from dataclasses import replace
from pathlib import Path
from typing import Any, Mapping, Sequence

_ROOT = Path(__file__).resolve().parents[2]


# --------------------------------------------------------------------------- loss and learning rate
def plot_loss_and_lr(records: Mapping[str, Sequence[Mapping[str, Any]]], schedule: Sequence[float]):
    """Left: the training loss (each iteration, and the mean of each log interval) and the validation
    loss during training; right: the learning rate of the schedule and the rates Megatron-LM logged.

    Args:
        records: :func:`helpers.runner.metrics.read_metrics` of the run (``iteration``, ``train``, ``valid``).
        schedule: the learning rate after each step, ``[train_iters + 1]``
            (:func:`helpers.learn.optimizer.lr_schedule`).

    Returns:
        The matplotlib figure (constrained layout: no label overlaps its neighbour).
    """
    import matplotlib.pyplot as plt

    per_iter, train = records["iteration"], records["train"]
    valid = [r for r in records["valid"] if r["when"] == "during"]
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4), layout="constrained")
    ax1.plot([r["iteration"] for r in per_iter], [r["lm_loss"] for r in per_iter], lw=0.5, alpha=0.4,
             label="train, each iteration")
    ax1.plot([r["iteration"] for r in train], [r["lm_loss"] for r in train], label="train, mean of each log interval")
    ax1.plot([r["iteration"] for r in valid], [r["lm_loss"] for r in valid], "o-", label="validation")
    ax1.set(title="LM loss", xlabel="iteration", ylabel="cross-entropy (nats/token)")
    ax1.legend(loc="upper right")
    scale = 1e3  # the rates as multiples of 1e-3: short tick labels, no offset text over the title
    ax2.plot(range(len(schedule)), [v * scale for v in schedule], label="scheduler, after each step")
    ax2.plot([r["iteration"] for r in train if r["lr"] is not None], [r["lr"] * scale for r in train if r["lr"] is not None],
             ".", label="logged by Megatron-LM")
    ax2.set(title="Learning rate: warmup + cosine", xlabel="iteration", ylabel="learning rate (× 10⁻³)")
    ax2.legend(loc="upper right")
    return fig


# --------------------------------------------------------------------------- throughput
def throughput(train_records: Sequence[Mapping[str, Any]], tokens_per_iteration: int) -> list[dict[str, float]]:
    """Throughput of each log interval, from the log lines' "elapsed time per iteration" (``s_per_iter``, s).

    Args:
        train_records: ``read_metrics(...)["train"]``, in iteration order.
        tokens_per_iteration: ``global_batch_size x seq_length`` (tokens).

    Returns:
        One dict per log line: ``first`` and ``last`` iteration of its interval, ``s_per_iter`` (s),
        ``tokens_per_s`` = ``tokens_per_iteration / s_per_iter`` and ``iterations_per_s`` = ``1 / s_per_iter``.

    Raises:
        ValueError: a record without a positive ``s_per_iter`` (its line was not a training log line).

    Source: Megatron-LM ``megatron/training/training.py`` (``training_log``).
    """
    rows, previous = [], 0
    for r in train_records:
        seconds = r.get("s_per_iter")
        if not seconds or seconds <= 0:
            raise ValueError(f"the record of iteration {r.get('iteration')} has no positive s_per_iter: {dict(r)}")
        rows.append({"first": previous + 1, "last": int(r["iteration"]), "s_per_iter": float(seconds),
                     "tokens_per_s": tokens_per_iteration / seconds, "iterations_per_s": 1 / seconds})
        previous = int(r["iteration"])
    return rows


def plot_throughput(rows: Sequence[Mapping[str, float]], tokens_per_iteration: int, *, title: str | None = None):
    """Tokens per second of each log interval as a step over its iterations, with the median of
    the intervals after the first (the first holds the start-up) and iterations per second on the
    right-hand axis.

    Args:
        rows: :func:`throughput`'s. tokens_per_iteration: as given to :func:`throughput`.

    Returns:
        The matplotlib figure.

    Raises:
        ValueError: ``rows`` is empty.
    """
    import matplotlib.pyplot as plt

    if not rows:
        raise ValueError("no log interval to plot: the run logged no training line")
    edges = [rows[0]["first"] - 0.5] + [r["last"] + 0.5 for r in rows]
    rates = [r["tokens_per_s"] for r in rows]
    median = statistics.median(rates[1:] or rates)
    fig, ax = plt.subplots(figsize=(8, 3.8), layout="constrained")
    ax.stairs(rates, edges, baseline=None, color="tab:blue", lw=1.5, label=f"each log interval ({len(rows)})")
    ax.axhline(median, color="black", ls="--", lw=1, label=f"median after the first: {median:,.0f} tokens/s")
    ax.set(xlabel="iteration", ylabel="throughput (tokens/s)", ylim=(0, max(rates) * 1.25),
           title=title or "Training throughput per log interval")
    ax.secondary_yaxis("right", functions=(lambda t: t / tokens_per_iteration, lambda i: i * tokens_per_iteration)) \
        .set_ylabel("iterations/s")
    ax.legend(loc="upper right", ncols=2)
    return fig


# --------------------------------------------------------------------------- kill and resume
def per_launch_losses(tensorboard_dir: str | os.PathLike) -> list[dict[int, float]]:
    """The ``lm loss`` of every iteration, one dict per launch (TensorBoard event file), oldest first.

    Megatron-LM opens a new event file each time it starts, so a resumed run has one per launch;
    :func:`helpers.runner.metrics.read_tensorboard` merges them, this keeps them apart.
    """
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    out = []
    for path in sorted(Path(tensorboard_dir).glob("events.out.tfevents.*")):  # the name starts with the time
        acc = EventAccumulator(str(path), size_guidance={"scalars": 0})
        acc.Reload()
        if "lm loss" in acc.Tags()["scalars"]:
            out.append({e.step: e.value for e in acc.Scalars("lm loss")})
    return out


def _train_until_sigterm(cfg, after_iteration: int, env: Mapping[str, str], timeout_s: float) -> list[str]:
    """Start Megatron-LM's loop on ``cfg`` under torchrun and send SIGTERM to the job once it logged
    ``after_iteration``; wait for it to save and exit. Returns its output lines (also appended to
    ``training.log``).

    Raises:
        RuntimeError: the job ended before ``after_iteration``, or did not save on SIGTERM.
        subprocess.TimeoutExpired: it did not end within ``timeout_s`` (it is killed).
    """
    from helpers.runner import launch, megatron_args
    from helpers.support import run_guard

    cfg.run_path.mkdir(parents=True, exist_ok=True)
    cfg.to_json(cfg.run_path / "run.json")
    cmd = launch.torchrun_command([*megatron_args.SCRIPT[1:], *megatron_args.arguments(cfg)], nproc_per_node=1,
                                  master_port=launch.free_port())
    job_env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")}
    job_env.update({**megatron_args.ENV, **env, "PYTHONUNBUFFERED": "1",
                    "PYTHONPATH": str(_ROOT) + (os.pathsep + job_env["PYTHONPATH"] if job_env.get("PYTHONPATH") else ""),
                    run_guard.LAUNCHER_PID_ENV: str(os.getpid())})  # as launch.torchrun: the job stops if this process dies
    marker, lines, sent = f"iteration {after_iteration:8d}/", [], False
    deadline = time.monotonic() + timeout_s
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=job_env, cwd=_ROOT,
                            start_new_session=True)  # its own process group: the signal reaches torchrun and its worker
    try:
        with open(cfg.run_path / "training.log", "a") as log:
            for line in proc.stdout:
                log.write(line)
                lines.append(line.rstrip("\n"))
                if not sent and marker in line:
                    os.killpg(proc.pid, signal.SIGTERM)  # as a scheduler does at a job's time limit
                    sent = True
                if time.monotonic() > deadline:
                    raise subprocess.TimeoutExpired(cmd, timeout_s)
        proc.wait(timeout=max(1.0, deadline - time.monotonic()))
    except BaseException:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
        raise
    if not sent:
        raise RuntimeError(f"the job ended before iteration {after_iteration}:\n" + "\n".join(lines[-20:]))
    if not any("exiting program after receiving SIGTERM" in line for line in lines):
        raise RuntimeError("the job did not save and exit on SIGTERM:\n" + "\n".join(lines[-20:]))
    return lines


def kill_and_resume(cfg, record: str | os.PathLike, *, train_iters: int = 20, kill_after: int = 8,
                    threads: int = 1, timeout_s: float = 900.0, progress: bool = True) -> dict[str, Any]:
    """Train a short run of ``cfg``'s model twice, uninterrupted and killed-then-resumed; the loss of
    every iteration of both.

    ``train_iters`` iterations, a log line each, one evaluation and a checkpoint at the end, in a temporary
    folder. The second copy gets SIGTERM once it logged ``kill_after``: Megatron-LM's exit signal handler
    saves a checkpoint and exits, and :func:`helpers.runner.launch.train` restarts it (``--load``: weights,
    optimizer, scheduler, RNG states, data position). All launches use ``threads`` CPU threads (CPU sums are
    bit-identical only at the same count). Cached in ``record`` (JSON).

    Returns:
        ``{"uninterrupted": {iteration: loss}, "launches": [{iteration: loss}, ...], "killed_at",
        "resumed_from", "max_abs_difference" (nats/token, over the resumed run), "train_iters", "seconds"}``;
        the losses are TensorBoard's float32 values.

    Raises:
        ValueError: ``kill_after`` not in ``[1, train_iters)``.
        RuntimeError / helpers.runner.launch.LaunchError: a launch failed (its output in the message).
    """
    from helpers.runner import launch

    record = Path(record)
    if record.exists():
        data = json.loads(record.read_text())
        data["uninterrupted"] = {int(k): v for k, v in data["uninterrupted"].items()}  # JSON keys are strings
        data["launches"] = [{int(k): v for k, v in launch_.items()} for launch_ in data["launches"]]
        return data
    if not 1 <= kill_after < train_iters:
        raise ValueError(f"kill_after={kill_after} must be at least 1 and below train_iters={train_iters}")
    env = {"OMP_NUM_THREADS": str(threads)}
    started = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="kill-and-resume-") as tmp:
        short = dict(data_prefix=str(cfg.data_prefix_path), tokenizer_dir=str(cfg.tokenizer_path),  # the run's own data
                     train_iters=train_iters, lr_warmup_iters=max(1, train_iters // 5), lr_decay_iters=train_iters,
                     log_interval=1, eval_interval=train_iters, eval_iters=1, save_interval=train_iters,
                     exit_interval=None, checkpoint_dir=None, tensorboard_dir=None, metrics_path=None,
                     pretrained_checkpoint=None, override_opt_param_scheduler=False,
                     use_checkpoint_opt_param_scheduler=False)
        whole = replace(cfg, run_dir=str(Path(tmp, "uninterrupted")), **short)
        cut = replace(cfg, run_dir=str(Path(tmp, "killed-and-resumed")), **short)
        launch.train(whole, progress=progress, env=env, max_epochs=0)
        _train_until_sigterm(cut, kill_after, env, timeout_s)
        launch.train(cut, progress=progress, env=env, max_epochs=0)
        reference = per_launch_losses(whole.tensorboard_path)[-1]
        launches = per_launch_losses(cut.tensorboard_path)
    if len(launches) != 2:
        raise RuntimeError(f"expected 2 launches of the killed run, found {len(launches)} TensorBoard files")
    resumed = {**launches[0], **launches[1]}  # the second launch's values where both logged an iteration
    data = {"uninterrupted": reference, "launches": launches, "killed_at": max(launches[0]),
            "resumed_from": min(launches[1]) - 1, "train_iters": train_iters,
            "max_abs_difference": max(abs(resumed[i] - reference[i]) for i in reference),
            "seconds": round(time.perf_counter() - started, 1)}
    record.parent.mkdir(parents=True, exist_ok=True)
    record.write_text(json.dumps(data, indent=1) + "\n")
    return data


def plot_kill_and_resume(result: Mapping[str, Any]):
    """The uninterrupted run's loss as a line, the killed run's two launches as markers on it, the
    kill marked; below, the difference of each resumed iteration from the uninterrupted one.

    Args:
        result: :func:`kill_and_resume`'s.

    Returns:
        The matplotlib figure.
    """
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    ref, (first, second) = result["uninterrupted"], result["launches"][:2]
    killed, resumed = result["killed_at"], result["resumed_from"]
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(8, 5), sharex=True, layout="constrained",
                                      gridspec_kw={"height_ratios": [3, 1.2]})
    its = sorted(ref)
    top.plot(its, [ref[i] for i in its], color="0.6", lw=5, alpha=0.5, label="uninterrupted run")
    top.plot(sorted(first), [first[i] for i in sorted(first)], "o", ms=4, color="tab:blue",
             label=f"launch 1: SIGTERM, saved at iteration {killed}")
    top.plot(sorted(second), [second[i] for i in sorted(second)], "s", ms=4, mfc="none", color="tab:orange",
             label=f"launch 2: resumed from iteration {resumed}")
    for ax in (top, bottom):
        ax.axvline(killed + 0.5, color="tab:red", ls=":", lw=1.5, label="the kill" if ax is top else None)
    top.set(ylabel="LM loss (nats/token)",
            title=f"Stopped by SIGTERM, saved at iteration {killed}, resumed: the same loss at every iteration")
    top.legend(loc="lower left")  # a falling loss leaves that corner empty
    merged = {**first, **second}
    diff = [merged[i] - ref[i] for i in its]
    bound = max(1e-6, 2 * max(map(abs, diff)))
    bottom.plot(its, diff, "o-", ms=3, color="tab:purple", label="killed-and-resumed minus uninterrupted")
    bottom.set(xlabel="iteration", ylabel="difference\n(nats/token)", ylim=(-bound, bound))
    bottom.set_yticks([-bound, 0, bound], [f"{-bound:.0e}", "0", f"{bound:.0e}"])
    bottom.xaxis.set_major_locator(MaxNLocator(integer=True))
    bottom.legend(loc="upper right", fontsize=8)
    return fig
