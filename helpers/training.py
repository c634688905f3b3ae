"""Pre-train a GPT with megatron-core: the series' counterpart of Megatron-LM's ``pretrain_gpt.py``.

Run it the way Megatron-LM is run (one process per GPU; on a CPU, processes over gloo)::

    python -m helpers.training --config run.json                                  # one process
    python -m torch.distributed.run --nproc_per_node 2 -m helpers.training --config run.json
    python -m torch.distributed.run --nnodes 2 --nproc_per_node 8 --rdzv-backend c10d \\
        --rdzv-endpoint HOST:29500 -m helpers.training --config run.json          # two nodes

``run.json`` is a :class:`helpers.training_config.TrainingConfig`; from a notebook,
``helpers.launch.train`` writes it and runs the command above with a progress bar.

Read :func:`pretrain` top to bottom: it is the loop notebook 03 (section 5) writes out in
cells, call by call, and a test shows both give the same losses bit for bit.

1. :func:`setup`: ``initialize_distributed`` (process groups, seeded RNGs), the
   ``GPTDataset`` s, ``GPTModel`` wrapped in megatron-core's ``DistributedDataParallel``,
   AdamW and ``OptimizerParamScheduler``.
2. :func:`load`: resume from the latest ``dist_checkpointing`` checkpoint, if any.
3. :func:`train_step` per iteration: ``get_forward_backward_func()`` runs the micro-batches
   through :func:`forward_step` / :func:`loss_func` (gradient accumulation, or 1F1B when
   PP > 1; DDP reduces the gradients in ``finalize_model_grads``), clip, step, schedule.
4. Every ``log_interval`` a log line, every ``eval_interval`` :func:`evaluate`, every
   ``save_interval`` :func:`save`; SIGTERM saves and exits.

:func:`main` adds what a job needs around :func:`pretrain` (``helpers.run_guard``): it stops
when its launcher dies, rank 0 holds the run folder's lock, and torch elastic's ``@record``
writes a failing rank's traceback to its error file, which the launcher reports.

Sources: Megatron-LM ``pretrain_gpt.py``, ``megatron/training/training.py`` (``setup_model_and_optimizer``,
``train_step``, ``training_log``, ``evaluate``), ``megatron/training/checkpointing.py``,
``megatron/legacy/data/data_samplers.py`` (``MegatronPretrainingSampler``),
``examples/run_simple_mcore_train_loop.py``.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import signal
import sys
import time
from dataclasses import dataclass, replace
from functools import partial
from pathlib import Path
from typing import Any, Iterator

import torch
import torch.distributed as dist
from megatron.core import parallel_state
from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig, finalize_model_grads
from megatron.core.pipeline_parallel import get_forward_backward_func
from torch.distributed.elastic.multiprocessing.errors import record

from helpers import checkpointing, dataloader, run_guard
from helpers import model as model_lib
from helpers.distributed import destroy_distributed, initialize_distributed
from helpers.environment import package_version
from helpers.optimizer import ADAMW_CALLS, build_optimizer, build_scheduler, grad_norm_and_clip
from helpers.metrics import MetricsLogger, read_metrics
from helpers.tokenizer import load_tokenizer
from helpers.training_config import TrainingConfig, check_resume_schedule, num_microbatches, resolve_precision


# =========================================================================== data
def build_datasets(cfg: TrainingConfig, data_parallel_size: int = 1):
    """megatron-core ``GPTDataset`` s for train / validation / test over the run's ``.bin/.idx``.

    Sizes as Megatron-LM asks for them (``train_valid_test_num_samples``): train
    ``train_iters x global_batch_size`` samples; validation ``eval_iters x global_batch_size``
    (this series evaluates the same fixed validation batches every time, so curves are
    comparable); test ``eval_iters x global_batch_size``.

    Returns:
        ``(train, valid, test)``; each sample is a dict of ``tokens``, ``labels``,
        ``loss_mask``, ``position_ids``: ``[seq_length]`` tensors.
    """
    n_eval = cfg.eval_iters * cfg.global_batch_size
    return dataloader.build_gpt_datasets(
        str(cfg.data_prefix_path), str(cfg.tokenizer_path), seq_length=cfg.model.seq_length,
        split=cfg.split, num_samples=(cfg.train_iters * cfg.global_batch_size, n_eval, n_eval),
        seed=cfg.seed, cache_dir=str(cfg.run_path / "data" / "cache"),
    )


def micro_batch_indices(consumed_samples: int, micro_batch_size: int, data_parallel_rank: int,
                        data_parallel_size: int, num_micro_batches: int) -> list[list[int]]:
    """Sample ids of this rank's micro-batches for the global batch starting at ``consumed_samples``.

    As Megatron-LM's ``MegatronPretrainingSampler``: consecutive blocks of
    ``micro_batch_size x data_parallel_size`` samples, each split across the data-parallel
    ranks. Resuming at ``consumed_samples`` continues exactly where training stopped.

    Returns:
        ``num_micro_batches`` lists of ``micro_batch_size`` sample ids.
    """
    block = micro_batch_size * data_parallel_size
    return [
        [consumed_samples + m * block + data_parallel_rank * micro_batch_size + j for j in range(micro_batch_size)]
        for m in range(num_micro_batches)
    ]


def collate(dataset, indices: list[int], device: Any = "cpu") -> dict[str, Any]:
    """Stack samples ``indices`` of a GPTDataset into a micro-batch.

    Returns:
        ``tokens``, ``labels``, ``position_ids`` int64 ``[micro_batch, seq]`` and ``loss_mask``
        fp32 ``[micro_batch, seq]`` on ``device``.
    """
    samples = [dataset[i % len(dataset)] for i in indices]
    out = {}
    for key in ("tokens", "labels", "loss_mask", "position_ids"):
        t = torch.stack([torch.as_tensor(s[key]) for s in samples])
        out[key] = (t.float() if key == "loss_mask" else t.long()).to(device)
    return out


# =========================================================================== one step
@dataclass
class Trainer:
    """Everything a training step needs (built by :func:`setup`)."""
    cfg: TrainingConfig
    dist_info: dict[str, int]
    model: Any  # DDP-wrapped (or bare) GPTModel
    optimizer: Any
    optimizer_name: str
    scheduler: Any
    train_ds: Any
    valid_ds: Any
    precision: str
    num_micro_batches: int
    grad_scaler: Any = None
    iteration: int = 0
    consumed_train_samples: int = 0

    @property
    def bare_model(self):
        """The ``GPTModel`` inside the DDP wrapper."""
        return getattr(self.model, "module", self.model)

    @property
    def device(self):
        """Where batches go: the current CUDA device, or the CPU."""
    
        return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")


def loss_func(loss_mask, output_tensor):
    """Masked mean of the per-token loss; the schedule divides it by the micro-batch count."""
    losses = output_tensor.float()
    loss = (losses * loss_mask).sum() / loss_mask.sum().clamp(min=1)
    return loss, {"lm loss": loss.detach().clone()}


def forward_step(batches: Iterator[dict[str, Any]], model):
    """Megatron's ``forward_step(data_iterator, model)``: returns output and loss function."""
    batch = next(batches)
    output = model(batch["tokens"], batch["position_ids"], None, labels=batch["labels"])
    return output, partial(loss_func, batch["loss_mask"])


def _run_schedule(trainer: Trainer, batches: list[dict[str, Any]], forward_only: bool) -> float | None:
    """Run the micro-batches through megatron-core's schedule; the mean loss on the last stage."""
    cfg = trainer.cfg
    results = get_forward_backward_func()(
        forward_step_func=forward_step, data_iterator=iter(batches), model=[trainer.model],
        num_microbatches=len(batches), seq_length=cfg.model.seq_length,
        micro_batch_size=cfg.micro_batch_size, forward_only=forward_only,
    )
    if not parallel_state.is_pipeline_last_stage():
        return None
    loss = torch.stack([r["lm loss"] for r in results]).mean()
    if parallel_state.get_data_parallel_world_size() > 1:
        dist.all_reduce(loss, group=parallel_state.get_data_parallel_group())
        loss /= parallel_state.get_data_parallel_world_size()
    return float(loss)


def _micro_batches(trainer: Trainer, dataset, consumed: int, num_micro: int) -> list[dict[str, Any]]:
    info = trainer.dist_info
    ids = micro_batch_indices(consumed, trainer.cfg.micro_batch_size, info["dp_rank"], info["dp"], num_micro)
    return [collate(dataset, i, trainer.device) for i in ids]


def train_step(trainer: Trainer) -> dict[str, float]:
    """One optimizer step over one global batch (Megatron-LM ``train_step``).

    Zero the grad buffers, run forward/backward over the micro-batches with the schedule
    (DDP reduces the gradients in ``finalize_model_grads``), clip, step AdamW, step the LR
    scheduler, advance the data position.

    Returns:
        ``{"lm_loss", "grad_norm", "lr"}`` (``lm_loss`` is NaN on ranks that are not the
        last pipeline stage).
    """
    cfg = trainer.cfg
    batches = _micro_batches(trainer, trainer.train_ds, trainer.consumed_train_samples, trainer.num_micro_batches)
    if hasattr(trainer.model, "zero_grad_buffer"):
        trainer.model.zero_grad_buffer()
    trainer.optimizer.zero_grad(set_to_none=True)
    loss = _run_schedule(trainer, batches, forward_only=False)
    params = [p for g in trainer.optimizer.param_groups for p in g["params"]]
    for p in params:
        if getattr(p, "main_grad", None) is not None:
            p.grad = p.main_grad
    if trainer.grad_scaler is not None:
        trainer.grad_scaler.unscale_(trainer.optimizer)
    norm = grad_norm_and_clip(params, cfg.clip_grad)
    lr = trainer.optimizer.param_groups[0]["lr"]
    _stop_on_non_finite(trainer, loss, norm, lr)
    if trainer.grad_scaler is not None:
        trainer.grad_scaler.step(trainer.optimizer)
        trainer.grad_scaler.update()
    else:
        trainer.optimizer.step()
    trainer.scheduler.step(1)
    trainer.iteration += 1
    trainer.consumed_train_samples += cfg.global_batch_size
    return {"lm_loss": float("nan") if loss is None else loss, "grad_norm": norm, "lr": lr}


def _stop_on_non_finite(trainer: Trainer, loss: float | None, grad_norm: float, lr: float) -> None:
    """Raise before the optimizer step when the loss or the gradient norm is NaN or infinite.

    Megatron-LM checks the same by default (``check_for_nan_in_loss_and_grad``); stepping would
    write NaN into every weight, and the next checkpoint would keep it. The gradient norm is the
    same on every rank (reduced over the model-parallel group), so all ranks stop together.
    Under fp16 an infinite norm is the loss scaler's business (it skips the step), not an error.

    Raises:
        FloatingPointError: names the iteration, the values and what to try.
    """
    bad_loss = loss is not None and not math.isfinite(loss)
    bad_norm = not math.isfinite(grad_norm) and trainer.grad_scaler is None
    if bad_loss or bad_norm:
        raise FloatingPointError(
            f"iteration {trainer.iteration + 1}: lm loss {loss}, grad norm {grad_norm} (lr {lr:.3g}) is not finite; "
            "training stopped before the optimizer step, so the last checkpoint is intact. Lower lr, keep "
            "clip_grad on, or check the model's init_method_std")


def evaluate(trainer: Trainer, dataset=None, eval_iters: int | None = None) -> float | None:
    """Mean LM loss (nats/token) over the first ``eval_iters`` global batches of ``dataset``
    (the validation set by default), forward only, no gradient (Megatron-LM ``evaluate``).

    Returns:
        The loss on the last pipeline stage, None elsewhere, and None when there is no
        dataset (a ``split`` whose valid weight is 0: Megatron-LM then skips evaluation).
    """
    dataset = trainer.valid_ds if dataset is None else dataset
    if dataset is None:
        return None
    eval_iters = eval_iters or trainer.cfg.eval_iters
    trainer.model.eval()
    losses = []
    with torch.no_grad():
        for i in range(eval_iters):
            batches = _micro_batches(trainer, dataset, i * trainer.cfg.global_batch_size, trainer.num_micro_batches)
            losses.append(_run_schedule(trainer, batches, forward_only=True))
    trainer.model.train()
    return None if losses[0] is None else sum(losses) / len(losses)


# =========================================================================== set-up, save, load
def setup(cfg: TrainingConfig) -> Trainer:
    """Initialise distributed state, datasets, model (+DDP), optimizer and scheduler.

    Raises:
        ValueError / FileNotFoundError: see :meth:`TrainingConfig.check`.
    """
    world_size = int(os.environ.get("WORLD_SIZE", "1")) if "RANK" in os.environ else 1
    cfg.check(world_size)
    precision = resolve_precision(cfg.precision)
    info = initialize_distributed(cfg.tensor_model_parallel_size, cfg.pipeline_model_parallel_size, cfg.seed)
    n_micro = num_microbatches(cfg.global_batch_size, cfg.micro_batch_size, info["dp"])
    train_ds, valid_ds, _ = build_datasets(cfg, info["dp"])
    model = model_lib.build_model(cfg.model, precision=precision, layer_spec=cfg.layer_spec)
    if torch.cuda.is_available():
        model.cuda(torch.cuda.current_device())
    if cfg.use_megatron_ddp:
        ddp_config = DistributedDataParallelConfig(grad_reduce_in_fp32=True, overlap_grad_reduce=False,
                                                   use_distributed_optimizer=False)
        model = DistributedDataParallel(model.config, ddp_config, model)
        model.config.no_sync_func = model.no_sync
        model.config.finalize_model_grads_func = finalize_model_grads
    optimizer = build_optimizer(model, cfg)
    checkpointing.init_optimizer_state(optimizer)
    scheduler = build_scheduler(optimizer, cfg)
    scaler = None
    if precision == "fp16":
        scaler = torch.amp.GradScaler("cuda")
        getattr(model, "module", model).config.grad_scale_func = scaler.scale
    return Trainer(cfg=cfg, dist_info=info, model=model, optimizer=optimizer, optimizer_name=ADAMW_CALLS[optimizer.implementation],
                   scheduler=scheduler, train_ds=train_ds, valid_ds=valid_ds, precision=precision,
                   num_micro_batches=n_micro, grad_scaler=scaler)


def _checkpoint_metadata(trainer: Trainer) -> dict[str, Any]:
    """``model_config.json`` written with each checkpoint (what a converter needs)."""
    cfg, info = trainer.cfg, trainer.dist_info
    return {
        **cfg.model.to_metadata(cfg.tensor_model_parallel_size),
        "iteration": trainer.iteration,
        "consumed_train_samples": trainer.consumed_train_samples,
        "tensor_model_parallel_size": info["tp"],
        "pipeline_model_parallel_size": info["pp"],
        "data_parallel_size": info["dp"],
        "precision": trainer.precision,
        "layer_spec": getattr(trainer.bare_model, "layer_spec_name", "local"),
        "tokenizer_dir": str(cfg.tokenizer_path),
        "checkpoint_format": "torch_dist",
        "megatron_core_version": package_version("megatron-core"),
        "lr_schedule": cfg.lr_schedule_settings(),
    }


def _state(trainer: Trainer) -> dict:
    info = trainer.dist_info
    return checkpointing.sharded_state_dict(
        trainer.bare_model, trainer.optimizer, trainer.scheduler, iteration=trainer.iteration,
        consumed_train_samples=trainer.consumed_train_samples, layout=(info["tp"], info["pp"], info["dp"]),
    )


def save(trainer: Trainer) -> Path:
    """Save a checkpoint of the current iteration (all ranks call it); returns its folder."""
    return checkpointing.save_checkpoint(trainer.cfg.checkpoint_path, trainer.iteration, _state(trainer),
                                         _checkpoint_metadata(trainer))


def load(trainer: Trainer) -> int:
    """Resume from the latest checkpoint if there is one; returns the iteration (0 if none).

    Restores model, optimizer, scheduler, iteration, consumed samples and, when the
    parallel layout is the same as when saved, every rank's RNG states.

    Raises:
        checkpointing.CheckpointMismatchError: the checkpoint has another model shape
            (nothing is loaded or overwritten).
    """
    ckpt_dir = trainer.cfg.checkpoint_path
    iteration = checkpointing.latest_iteration(ckpt_dir)
    if iteration is None:
        return 0
    saved = checkpointing.read_model_config(ckpt_dir, iteration)
    checkpointing.check_compatible(saved, _checkpoint_metadata(trainer), ckpt_dir)
    if saved.get("model_only"):  # e.g. the way back from transformers: weights, no optimizer
        state = checkpointing.load_checkpoint(ckpt_dir, iteration, {"model": trainer.bare_model.sharded_state_dict()})
        trainer.bare_model.load_state_dict(state["model"], strict=True)
        trainer.iteration = iteration
        print(f"> {ckpt_dir} holds model weights only (model_config.json: model_only): fresh AdamW state and "
              f"learning-rate schedule from iteration {iteration}", flush=True)
        return iteration
    schedule = check_resume_schedule(trainer.cfg, saved)
    if schedule is not None:  # use_checkpoint_opt_param_scheduler: the saved schedule
        trainer.scheduler = build_scheduler(trainer.optimizer, replace(
            trainer.cfg, lr_decay_iters=schedule["lr_decay_iters"],
            **{k: v for k, v in schedule.items() if k != "lr_decay_iters"}))
    template = _state(trainer)
    info = trainer.dist_info
    same_layout = [saved.get("tensor_model_parallel_size"), saved.get("pipeline_model_parallel_size"),
                   saved.get("data_parallel_size")] == [info["tp"], info["pp"], info["dp"]]
    if not same_layout:
        template.pop("rng_state")
    state = checkpointing.load_checkpoint(ckpt_dir, iteration, template)
    trainer.bare_model.load_state_dict(state["model"], strict=True)
    checkpointing.load_optimizer_state(trainer.optimizer, state["optimizer"])
    trainer.scheduler.load_state_dict(state["opt_param_scheduler"])
    if same_layout:
        checkpointing.set_rng_state(state["rng_state"])
    trainer.iteration = int(state["iteration"])
    trainer.consumed_train_samples = int(state["consumed_train_samples"])
    return trainer.iteration


def sample_text(trainer: Trainer, tokenizer) -> str | None:
    """``cfg.sample_prompt`` continued by ``cfg.sample_tokens`` tokens drawn from the model in training.

    Temperature 0.8 and top-k 50 (``helpers.evaluation.sample``, nanoGPT's ``sample.py`` loop; its
    defaults are 0.8 and 200),
    from a generator seeded with ``cfg.seed + iteration``: the training RNG is not touched, so
    the losses are the same with or without samples, and a resumed run prints the same ones.
    ``None`` when the model is split over ranks (TP or PP > 1).
    """
    from helpers import evaluation

    cfg, gpt, dev = trainer.cfg, trainer.bare_model, trainer.device
    if trainer.dist_info["tp"] > 1 or trainer.dist_info["pp"] > 1:
        return None
    generator = torch.Generator(device=dev).manual_seed(cfg.seed + trainer.iteration)
    gpt.eval()
    try:
        with torch.no_grad():
            ids = evaluation.sample(lambda t: gpt(t.to(dev), torch.arange(t.shape[1], device=dev).expand(t.shape), None),
                                    tokenizer.encode(cfg.sample_prompt), cfg.sample_tokens, temperature=0.8, top_k=50,
                                    generator=generator, eod_id=tokenizer.eos_token_id, seq_length=cfg.model.seq_length,
                                    vocab_size=len(tokenizer))
    finally:
        gpt.train()
    return cfg.sample_prompt + tokenizer.decode(ids)


# =========================================================================== the loop
class _ExitSignal:
    """SIGTERM/SIGINT set a flag; the loop saves a checkpoint at the end of the iteration and
    exits (Megatron-LM ``--exit-signal-handler``)."""
    def __init__(self) -> None:
        self.received: int | None = None
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, self._handler)

    def _handler(self, signum, frame) -> None:
        self.received = signum


def _should_exit(flag: _ExitSignal) -> bool:

    t = torch.tensor([1.0 if flag.received else 0.0], device="cuda" if torch.cuda.is_available() else "cpu")
    dist.all_reduce(t)
    return bool(t.item() > 0)


def pretrain(cfg: TrainingConfig) -> dict[str, Any]:
    """Train ``cfg`` to ``train_iters``, resuming from the latest checkpoint (pretrain_gpt).

    Logs every ``log_interval`` (iteration, LM loss, LR, grad norm, tokens/s, s/iteration),
    evaluates every ``eval_interval`` (validation loss and perplexity), saves every
    ``save_interval`` and at the end. SIGTERM saves and exits cleanly.

    Returns:
        The summary also written to ``cfg.summary_file`` (by the logging rank; by default
        ``{run_dir}/training_summary.json``):
        parameters, iterations, final train/validation loss, tokens/s, optimizer, checkpoint.
    """
    exit_flag = _ExitSignal()
    t_setup = time.perf_counter()
    trainer = setup(cfg)
    start = load(trainer)
    rank, world = trainer.dist_info["rank"], trainer.dist_info["world_size"]
    is_logger = rank == world - 1
    n_params = sum(p.numel() for p in trainer.bare_model.parameters())
    total_params = cfg.model.to_metadata(cfg.tensor_model_parallel_size)["num_parameters"]
    logger = MetricsLogger(cfg, is_logger, start)
    say = (lambda s: print(s, flush=True)) if is_logger else (lambda s: None)
    say(f"> megatron-core {package_version("megatron-core")}, torch {torch.__version__}, world size {world} "
        f"(TP={trainer.dist_info['tp']}, PP={trainer.dist_info['pp']}, DP={trainer.dist_info['dp']}), "
        f"precision {trainer.precision}, layer spec {getattr(trainer.bare_model, 'layer_spec_name', '?')}")
    say(f"> parameters: {total_params:,} in all, {n_params:,} on this rank; "
        f"padded vocab size {cfg.model.padded_vocab_size(cfg.tensor_model_parallel_size)}")
    say(f"> optimizer: {trainer.optimizer_name}; micro-batch {cfg.micro_batch_size} x DP "
        f"{trainer.dist_info['dp']} x {trainer.num_micro_batches} micro-batches = global batch {cfg.global_batch_size}")
    loaded = checkpointing.latest_iteration(cfg.checkpoint_path) is not None
    say(f"> {'resumed from checkpoint at iteration ' + str(start) if loaded else 'starting from scratch'}; "
        f"set-up {time.perf_counter() - t_setup:.1f} s")
    tokens_per_iter = cfg.global_batch_size * cfg.model.seq_length
    last_train, last_valid, tok_rates, tokenizer = None, None, [], None
    if start == 0 and cfg.eval_interval:
        last_valid = evaluate(trainer)
        if last_valid is not None:
            logger.log({"kind": "valid", "iteration": 0, "lm_loss": last_valid, "ppl": math.exp(min(last_valid, 50))},
                       f" validation loss at iteration 0 | lm loss: {last_valid:.6E} | lm loss PPL: {math.exp(min(last_valid, 50)):.3f}")
    interval_start, interval_iters, loss_sum, loss_n = time.perf_counter(), 0, 0.0, 0
    saved_at = start if start else None
    stopped_by_signal = False
    while trainer.iteration < cfg.train_iters:
        out = train_step(trainer)
        interval_iters += 1
        if math.isfinite(out["lm_loss"]):
            loss_sum, loss_n = loss_sum + out["lm_loss"], loss_n + 1
        it = trainer.iteration
        if it % cfg.log_interval == 0 or it == cfg.train_iters:
            elapsed = time.perf_counter() - interval_start
            s_per_iter = elapsed / interval_iters
            tps = tokens_per_iter / s_per_iter
            tok_rates.append(tps)
            last_train = loss_sum / max(loss_n, 1) if loss_n else float("nan")
            rec = {"kind": "train", "iteration": it, "lm_loss": last_train, "lr": out["lr"],
                   "grad_norm": out["grad_norm"], "tokens_per_s": tps, "s_per_iter": s_per_iter,
                   "consumed_samples": trainer.consumed_train_samples}
            logger.log(rec, f" iteration {it:8d}/{cfg.train_iters:8d} | consumed samples: {trainer.consumed_train_samples:10d} "
                            f"| elapsed time per iteration (ms): {1000 * s_per_iter:.1f} | learning rate: {out['lr']:.6E} "
                            f"| global batch size: {cfg.global_batch_size:5d} | lm loss: {last_train:.6E} "
                            f"| grad norm: {out['grad_norm']:.3f} | tokens per second: {tps:.0f}")
            interval_start, interval_iters, loss_sum, loss_n = time.perf_counter(), 0, 0.0, 0
        if cfg.eval_interval and (it % cfg.eval_interval == 0 or it == cfg.train_iters):
            t0 = time.perf_counter()
            last_valid = evaluate(trainer)
            if last_valid is not None:
                ppl = math.exp(min(last_valid, 50))
                logger.log({"kind": "valid", "iteration": it, "lm_loss": last_valid, "ppl": ppl},
                           f" validation loss at iteration {it} | lm loss: {last_valid:.6E} | lm loss PPL: {ppl:.3f}")
            interval_start += time.perf_counter() - t0
        if cfg.sample_interval and it % cfg.sample_interval == 0 and is_logger:
            t0 = time.perf_counter()
            tokenizer = tokenizer or load_tokenizer(cfg.tokenizer_path)
            text = sample_text(trainer, tokenizer)
            if text is not None:
                logger.log({"kind": "sample", "iteration": it, "text": text}, f" sample at iteration {it}: {text!r}")
            interval_start += time.perf_counter() - t0
        exit_now = _should_exit(exit_flag)
        if (cfg.save_interval and it % cfg.save_interval == 0) or it == cfg.train_iters or exit_now:
            t0 = time.perf_counter()
            folder = save(trainer)
            saved_at = it
            say(f" saved checkpoint at iteration {it:8d} to {folder} in {time.perf_counter() - t0:.1f} s")
            interval_start += time.perf_counter() - t0
        if exit_now:
            say(f" exiting at iteration {it} on signal {exit_flag.received or 'from another rank'} (checkpoint saved)")
            stopped_by_signal = True
            break
        if cfg.exit_interval and it % cfg.exit_interval == 0:
            say(f" exiting at iteration {it} (exit_interval={cfg.exit_interval})")
            if saved_at != it:
                save(trainer)
                saved_at = it
            break
    if saved_at != trainer.iteration and not stopped_by_signal:
        save(trainer)
    metrics = read_metrics(cfg.metrics_file) if is_logger else {}
    train_recs, valid_recs = metrics.get("train", []), metrics.get("valid", [])
    summary = {
        "parameters": total_params,
        "iterations": trainer.iteration,
        "train_iters": cfg.train_iters,
        "completed": trainer.iteration >= cfg.train_iters,
        "final_train_loss": train_recs[-1]["lm_loss"] if train_recs else None,
        "first_valid_loss": valid_recs[0]["lm_loss"] if valid_recs else None,
        "final_valid_loss": valid_recs[-1]["lm_loss"] if valid_recs else None,
        "tokens_per_s": (sorted(r["tokens_per_s"] for r in train_recs)[len(train_recs) // 2] if train_recs else None),
        "optimizer": trainer.optimizer_name,
        "precision": trainer.precision,
        "checkpoint_path": str(checkpointing.iteration_dir(cfg.checkpoint_path, trainer.iteration)),
        "flops_per_token": cfg.model.to_metadata()["flops_per_token"],
        "tensor_model_parallel_size": trainer.dist_info["tp"],
        "pipeline_model_parallel_size": trainer.dist_info["pp"],
        "data_parallel_size": trainer.dist_info["dp"],
    }
    if is_logger:
        cfg.summary_file.write_text(json.dumps(summary, indent=2) + "\n")
        say(f"> training summary: {json.dumps(summary)}")
    logger.close()
    dist.barrier()
    destroy_distributed()
    return summary


@record
def main(argv: list[str] | None = None) -> int:
    """``python -m helpers.training --config run.json [--train-iters N]``.

    Raises:
        run_guard.RunFolderBusyError: another job trains the same run folder (rank 0 checks).
    """
    parser = argparse.ArgumentParser(prog="python -m helpers.training", description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", required=True, help="run.json written by TrainingConfig.to_json")
    parser.add_argument("--train-iters", type=int, default=None, help="override train_iters")
    parser.add_argument("--exit-interval", type=int, default=None, help="stop (and save) every N iterations")
    args = parser.parse_args(argv)
    cfg = TrainingConfig.from_json(args.config)
    if args.train_iters is not None:
        cfg = replace(cfg, train_iters=args.train_iters)
    if args.exit_interval is not None:
        cfg = replace(cfg, exit_interval=args.exit_interval)
    run_guard.fork_checkpoint_queue()  # before watch_launcher's thread: see its docstring
    run_guard.watch_launcher()
    with run_guard.run_folder_lock(cfg.run_path, enabled=int(os.environ.get("RANK", "0")) == 0):
        pretrain(cfg)
    return 0


if __name__ == "__main__":
    sys.exit(main())
