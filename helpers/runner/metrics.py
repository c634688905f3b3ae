"""What Megatron-LM's training loop logged, read back: its TensorBoard scalars and its log lines.

:func:`from_megatron_lm` turns both into the records notebooks 03, 05 and 06 plot (``metrics.jsonl``).
The records undo two habits of ``megatron/training/training.py`` (``core_v0.19.0``):

* ``training_log`` does not reset its totals after a launch's first iteration (``should_reset = not
  is_first_iteration``), so a launch's second log line averages that iteration in again; the records
  average TensorBoard's per-iteration losses;
* the learning rate logged at iteration ``i`` is the one for iteration ``i + 1`` (the scheduler steps first).

Sources: Megatron-LM ``megatron/training/training.py`` (``training_log``,
``evaluate_and_print_results``); TensorBoard's ``EventAccumulator``.
"""

from __future__ import annotations

import json
import os
import re
import statistics
from datetime import datetime
from pathlib import Path
from typing import Any

from helpers.support import results

_ITERATION = re.compile(r"\biteration\s+(\d+)/\s*(\d+) \|.*?elapsed time per iteration \(ms\): ([\d.]+)")
_VALID = re.compile(r"validation loss at iteration (\d+)(?: on (validation|test) set)? \| lm loss value: "
                    r"([-+\d.eE]+) \| lm loss PPL: ([-+\d.eEinfa]+)")


def read_tensorboard(folder: str | os.PathLike) -> dict[str, dict[int, float]]:
    """Every scalar of a TensorBoard folder: ``{tag: {step: value}}``.

    Event files of several launches (a resumed run) are read in order; when a launch wrote a
    step again, its value replaces the earlier one (TensorBoard's own purge of orphaned steps).

    Returns:
        ``{}`` when the folder holds no event file.
    """
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    folder = Path(folder)
    if not folder.is_dir() or not any(folder.glob("events.out.tfevents.*")):
        return {}
    acc = EventAccumulator(str(folder), size_guidance={"scalars": 0})
    acc.Reload()
    return {tag: {e.step: e.value for e in acc.Scalars(tag)} for tag in acc.Tags()["scalars"]}


def from_megatron_lm(cfg, log_text: str, *, write: bool = True) -> dict[str, list[dict[str, Any]]]:
    """The records of a run of Megatron-LM's loop, from its TensorBoard folder and its log.

    Args:
        cfg: the run's :class:`~helpers.learn.training_config.TrainingConfig`.
        log_text: the loop's output, every launch oldest first (a resumed run repeats iterations; the last wins).
        write: also write the records to ``cfg.metrics_file`` (``metrics.jsonl``).

    Returns:
        ``{"iteration", "train", "valid", "test"}`` lists: per iteration ``{iteration, lm_loss, lr, grad_norm}``
        (nats per token); per log line ``{iteration, lm_loss (interval mean), lr, grad_norm, s_per_iter,
        tokens_per_s, consumed_samples}``; per evaluation ``{iteration, lm_loss, ppl, when}`` (``when``:
        ``"during"`` training or ``"end"``, on new validation batches; the test split's under ``"test"``).
    """
    scalars = read_tensorboard(cfg.tensorboard_path)
    loss, lr, norm = (scalars.get(t, {}) for t in ("lm loss", "learning-rate", "grad-norm"))
    per_iter = [{"kind": "iteration", "iteration": i, "lm_loss": loss[i], "lr": lr.get(i), "grad_norm": norm.get(i)}
                for i in sorted(loss)]
    times: dict[int, float] = {}
    evals: dict[tuple[str, int], dict[str, Any]] = {}
    for line in log_text.splitlines():
        if m := _ITERATION.search(line):
            times[int(m[1])] = float(m[3]) / 1000
        elif m := _VALID.search(line):
            kind, when = ("test", "end") if m[2] == "test" else ("valid", "end" if m[2] else "during")
            evals[(kind, int(m[1]), when)] = {"kind": kind, "iteration": int(m[1]), "lm_loss": float(m[3]),
                                             "ppl": float(m[4]), "when": when}
    tokens = cfg.global_batch_size * cfg.model.seq_length
    train, previous = [], 0
    for it in sorted(times):
        window = [loss[i] for i in range(previous + 1, it + 1) if i in loss]
        train.append({"kind": "train", "iteration": it, "lm_loss": sum(window) / len(window) if window else None,
                      "lr": lr.get(it), "grad_norm": norm.get(it), "s_per_iter": times[it],
                      "tokens_per_s": tokens / times[it] if times[it] else None,
                      "consumed_samples": it * cfg.global_batch_size})
        previous = it
    records = {"iteration": per_iter, "train": train,
               "valid": [evals[k] for k in sorted(evals) if k[0] == "valid"],
               "test": [evals[k] for k in sorted(evals) if k[0] == "test"]}
    if write:
        path = cfg.metrics_file
        path.parent.mkdir(parents=True, exist_ok=True)
        results.write_atomic(path, "".join(json.dumps(r) + "\n" for kind in ("iteration", "train", "valid", "test")
                                           for r in records[kind]))
    return records


def summary(cfg, records: dict[str, list[dict[str, Any]]], *, nproc_per_node: int, optimizer: str) -> dict[str, Any]:
    """``training_summary.json`` of a run: what notebooks 03, 05, 06 and the report card read.

    Returns:
        parameters, iterations, final train/validation loss, median tokens/s over the log lines
        after the first (which holds the start-up), optimizer, precision, checkpoint, FLOPs per
        token and the parallel layout.
    """
    from helpers.learn import checkpointing
    from helpers.learn.training_config import resolve_precision

    train = records["train"]
    valid = [r for r in records["valid"] if r["when"] == "during"] or records["valid"]
    rates = [r["tokens_per_s"] for r in train[1:] or train if r["tokens_per_s"]]
    meta = cfg.model.to_metadata(cfg.tensor_model_parallel_size)
    last = max([r["iteration"] for r in records["iteration"]] or [0])
    tp, pp = cfg.tensor_model_parallel_size, cfg.pipeline_model_parallel_size
    return {
        "parameters": meta["num_parameters"], "iterations": last, "train_iters": cfg.train_iters,
        "completed": last >= cfg.train_iters,
        "final_train_loss": train[-1]["lm_loss"] if train else None,
        "first_valid_loss": valid[0]["lm_loss"] if valid else None,
        "final_valid_loss": valid[-1]["lm_loss"] if valid else None,
        "tokens_per_s": statistics.median(rates) if rates else None,
        "optimizer": optimizer, "precision": resolve_precision(cfg.precision),
        "checkpoint_path": str(checkpointing.iteration_dir(cfg.checkpoint_path, last)),
        "flops_per_token": meta["flops_per_token"],
        "tensor_model_parallel_size": tp, "pipeline_model_parallel_size": pp,
        "data_parallel_size": nproc_per_node // (tp * pp),
        "trained_by": "Megatron-LM's pretrain (megatron.training)",
    }


def read_metrics(path: str | os.PathLike) -> dict[str, list[dict[str, Any]]]:
    """``metrics.jsonl`` split by kind: ``{"iteration": [...], "train": [...], "valid": [...], "test": [...]}``."""
    out: dict[str, list[dict[str, Any]]] = {"iteration": [], "train": [], "valid": [], "test": []}
    path = Path(path)
    if path.exists():
        for line in path.read_text().splitlines():
            if line.strip():
                rec = json.loads(line)
                out.setdefault(rec["kind"], []).append(rec)
    return out


#: Megatron-LM's start-up timers, in the order a launch passes them, and what each covers (``training.py``,
#: ``pretrain`` and ``setup_model_and_optimizer``; the script registers the first two with ``set_startup_timestamps``).
STARTUP_PHASES = {
    "startup-library-setup": "imports (torch, megatron.core, megatron.training)",
    "startup-program-setup": "the script before pretrain (flags parsed, tokenizer built)",
    "startup-megatron-init-local": "initialize_megatron (process groups, seeds)",
    "model-and-optimizer-setup": "model, optimizer, scheduler (and --load)",
    "train/valid/test-data-iterators-setup": "datasets and their indices",
}
_TIMER = re.compile(r"^\s*([\w/-]+) \.+: \(([\d.]+), ([\d.]+)\)")
_DATETIME = re.compile(r"^\[(launched|before library-setup|before the start of training step|after training is done)\] "
                       r"datetime: (\S+ \S+)")


def startup_table(log_text: str, wall_seconds: float) -> list[dict[str, Any]]:
    """Where one launch's wall time went, from Megatron-LM's start-up timers and datetimes in its log.

    Rows ``{"phase", "seconds", "share"}``: torchrun's start (the launcher's ``[launched]`` line to
    Megatron-LM's ``[before library-setup]``), the phases of :data:`STARTUP_PHASES` (the slowest rank's
    time), the training iterations (``[before the start of training step]`` to ``[after training is
    done]``), and the rest of ``wall_seconds``: the evaluation after training, the last save and the
    exit. Empty when the log lacks the start-up timers (a script without ``set_startup_timestamps``).
    A resumed run's log holds several launches: the last one is read.
    """
    last = log_text.rfind("[launched] datetime: ")  # a resumed run's log holds one launch after another
    timers, stamps = {}, {}
    for line in log_text[max(last, 0):].splitlines():
        if (m := _TIMER.match(line)) and m[1] in STARTUP_PHASES:
            timers[m[1]] = float(m[3]) / 1e3
        elif m := _DATETIME.match(line):
            stamps[m[1]] = datetime.fromisoformat(m[2])
    if "startup-library-setup" not in timers:
        return []
    rows = []
    if "launched" in stamps and "before library-setup" in stamps:
        rows.append(("torchrun's start, until the script runs",
                     (stamps["before library-setup"] - stamps["launched"]).total_seconds()))
    rows += [(STARTUP_PHASES[k], timers[k]) for k in STARTUP_PHASES if k in timers]
    if "before the start of training step" in stamps and "after training is done" in stamps:
        rows.append(("training iterations", (stamps["after training is done"]
                                             - stamps["before the start of training step"]).total_seconds()))
    rows.append(("the rest: evaluation after training, last save, exit", wall_seconds - sum(s for _, s in rows)))
    return [{"phase": p, "seconds": round(s, 2), "share": f"{s / wall_seconds:.0%}"} for p, s in rows]
