"""Notebook 03's megatron-core training loop (section 5's cells) as functions, for the tests and the benchmarks.

From the same configuration, Megatron-LM's loop (:mod:`helpers.learn.pretrain_gpt`) gives the same loss at
every iteration, bit for bit on a CPU (tested)::

    loop = core_loop.setup(cfg)            # process groups, seeds, data, GPTModel + DDP, optimizer, schedule
    for _ in range(cfg.train_iters):
        out = core_loop.train_step(loop)    # {"lm_loss", "grad_norm", "lr"}

Without CUDA, ``helpers.support.cpu_compat.apply()`` must run first (``initialize_distributed`` does it).
Sources: Megatron-LM ``examples/run_simple_mcore_train_loop.py``; ``megatron/training/training.py``
(``setup_model_and_optimizer``, ``get_optimizer_param_scheduler``, ``train_step``); ``pretrain_gpt.py``.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial
from typing import Any

import torch


@dataclass
class Loop:
    """What a training step needs (built by :func:`setup`)."""

    cfg: Any
    model: Any  # megatron-core DistributedDataParallel around the GPTModel
    optimizer: Any
    scheduler: Any
    train_ds: Any
    valid_ds: Any
    num_micro_batches: int
    dp_rank: int
    dp_size: int
    iteration: int = 0
    consumed_samples: int = 0

    @property
    def device(self) -> torch.device:
        return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")


def loss_func(loss_mask: torch.Tensor, output_tensor: torch.Tensor):
    """``pretrain_gpt.loss_func``: the micro-batch's summed token loss, its token count, and the report.

    Args:
        loss_mask: ``[micro_batch, seq]`` fp32. output_tensor: ``[micro_batch, seq]`` fp32 losses (nats).

    Returns:
        ``(loss_sum, num_tokens, {"lm loss": [loss_sum, num_tokens]})``; the schedule divides by
        ``num_tokens`` before backward.
    """
    losses, mask = output_tensor.view(-1).float(), loss_mask.view(-1).float()
    loss = torch.sum(losses * mask)
    num_tokens = mask.sum().clone().detach().to(torch.int)
    return loss, num_tokens, {"lm loss": torch.cat([loss.clone().detach().view(1), num_tokens.view(1)])}


def forward_step(data_iterator, model):
    """Megatron's ``forward_step(data_iterator, model)``: the micro-batch's per-token loss and its loss function."""
    batch = next(data_iterator)
    output = model(batch["tokens"], batch["position_ids"], None, labels=batch["labels"])
    return output, partial(loss_func, batch["loss_mask"])


def setup(cfg) -> Loop:
    """Process groups and seeds, the ``GPTDataset`` s, ``GPTModel`` in ``DistributedDataParallel``,
    ``get_megatron_optimizer`` and ``OptimizerParamScheduler``, configured as Megatron-LM's flags
    for ``cfg`` configure them (``helpers.runner.megatron_args``).

    Args:
        cfg: a ``helpers.learn.training_config.TrainingConfig``.

    Raises:
        ValueError / FileNotFoundError: see ``TrainingConfig.check``.
    """
    import os

    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig, finalize_model_grads
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer, get_standard_config_overrides
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

    from helpers.learn import dataloader
    from helpers.learn import model as model_lib
    from helpers.learn.distributed import initialize_distributed
    from helpers.learn.training_config import num_microbatches, resolve_precision

    cfg.check(int(os.environ.get("WORLD_SIZE", "1")) if "RANK" in os.environ else 1)
    precision = resolve_precision(cfg.precision)
    info = initialize_distributed(cfg.tensor_model_parallel_size, cfg.pipeline_model_parallel_size, cfg.seed)
    train_ds, valid_ds, _ = dataloader.build_run_datasets(cfg)
    gpt = model_lib.build_model(cfg.model, precision=precision, layer_spec="local")
    if torch.cuda.is_available():
        gpt.cuda(torch.cuda.current_device())
    model = DistributedDataParallel(gpt.config, DistributedDataParallelConfig(check_for_nan_in_grad=True), gpt)
    gpt.config.no_sync_func = model.no_sync
    gpt.config.finalize_model_grads_func = finalize_model_grads
    opt_config = OptimizerConfig(optimizer="adam", lr=cfg.lr, min_lr=cfg.min_lr, weight_decay=cfg.weight_decay,
                                 adam_beta1=cfg.adam_beta1, adam_beta2=cfg.adam_beta2, adam_eps=cfg.adam_eps,
                                 clip_grad=cfg.clip_grad, bf16=precision == "bf16", fp16=precision == "fp16")
    optimizer = get_megatron_optimizer(opt_config, [model], get_standard_config_overrides(opt_config))
    gpt.config.grad_scale_func = optimizer.scale_loss
    gbs = cfg.global_batch_size  # Megatron-LM counts the schedule in samples
    scheduler = OptimizerParamScheduler(
        optimizer, init_lr=0.0, max_lr=cfg.lr, min_lr=cfg.min_lr, lr_warmup_steps=cfg.lr_warmup_iters * gbs,
        lr_decay_steps=cfg.decay_iters * gbs, lr_decay_style=cfg.lr_decay_style, start_wd=cfg.weight_decay,
        end_wd=cfg.weight_decay, wd_incr_steps=cfg.train_iters * gbs, wd_incr_style="constant")
    return Loop(cfg, model, optimizer, scheduler, train_ds, valid_ds,
                num_microbatches(gbs, cfg.micro_batch_size, info["dp"]), info["dp_rank"], info["dp"])


def _run(loop: Loop, dataset, first_sample: int, forward_only: bool) -> torch.Tensor | None:
    """One global batch through ``get_forward_backward_func``; ``[loss sum, tokens]`` over the
    micro-batches and data-parallel ranks, on the last pipeline stage (None elsewhere)."""
    from megatron.core import parallel_state
    from megatron.core.pipeline_parallel import get_forward_backward_func

    from helpers.learn import dataloader

    cfg = loop.cfg
    ids = dataloader.micro_batch_indices(first_sample, cfg.micro_batch_size, loop.dp_rank, loop.dp_size,
                                         loop.num_micro_batches)
    batches = [dataloader.collate(dataset, i, loop.device) for i in ids]
    reports = get_forward_backward_func()(
        forward_step_func=forward_step, data_iterator=iter(batches), model=[loop.model],
        num_microbatches=len(batches), seq_length=cfg.model.seq_length, micro_batch_size=cfg.micro_batch_size,
        forward_only=forward_only)
    if not parallel_state.is_pipeline_last_stage():
        return None
    total = torch.vstack([r["lm loss"].view(-1) for r in reports]).sum(dim=0)  # [loss sum, tokens]
    torch.distributed.all_reduce(total, group=parallel_state.get_data_parallel_group())
    return total


def train_step(loop: Loop) -> dict[str, float]:
    """One optimizer step over one global batch, as Megatron-LM's ``train_step``.

    Returns:
        ``{"lm_loss", "grad_norm", "lr"}``: the loss (nats/token; NaN off the last pipeline stage),
        the gradient norm before clipping and the learning rate the step used.
    """
    loop.model.zero_grad_buffer()
    loop.optimizer.zero_grad()
    lr = loop.optimizer.param_groups[0]["lr"]
    total = _run(loop, loop.train_ds, loop.consumed_samples, forward_only=False)
    update_successful, grad_norm, _ = loop.optimizer.step()
    if update_successful:
        loop.scheduler.step(increment=loop.cfg.global_batch_size)
    loop.iteration += 1
    loop.consumed_samples += loop.cfg.global_batch_size
    return {"lm_loss": float("nan") if total is None else float(total[0] / total[1]), "grad_norm": float(grad_norm),
            "lr": lr}


def evaluate(loop: Loop, first_sample: int = 0) -> float | None:
    """Validation loss (nats/token) over ``eval_iters`` global batches from ``first_sample``, no
    gradient, as Megatron-LM's ``evaluate`` (its k-th evaluation starts at sample
    ``(k - 1) x eval_iters x global_batch_size``). None off the last pipeline stage."""
    loop.model.eval()
    with torch.no_grad():
        totals = [_run(loop, loop.valid_ds, first_sample + i * loop.cfg.global_batch_size, forward_only=True)
                  for i in range(loop.cfg.eval_iters)]
    loop.model.train()
    if totals[0] is None:
        return None
    total = torch.stack(totals).sum(dim=0)
    return float(total[0] / total[1])
