"""AdamW with Megatron's weight-decay groups, its learning-rate schedule, and gradient clipping.

Notebook 03 (sections 5.8-5.9) writes these calls out in cells; the training script
(:mod:`helpers.training`) and notebook 04's AdamW benchmark call them. This is the series'
one choice of AdamW implementation.

Sources: megatron-core ``optimizer/__init__.py`` (``_get_param_groups``: no weight decay on
biases and 1-D parameters), ``optimizer_param_scheduler.py``, ``optimizer/clip_grads.py``;
torch ``optim/adamw.py``; Apex ``optimizers/fused_adam.py``; Loshchilov & Hutter 2019 (AdamW).
"""

from __future__ import annotations

import math
from typing import Any, Iterable

import torch

#: AdamW implementations: one small kernel per op per tensor; torch ``_foreach_*`` over lists;
#: torch's single fused kernel per group (CPU and CUDA); Apex ``FusedAdam`` (CUDA only).
ADAMW_IMPLEMENTATIONS = ("for-loop", "foreach", "fused", "apex-fused")

#: The call each implementation is (what a training log names).
ADAMW_CALLS = {"for-loop": "torch.optim.AdamW(foreach=False)", "foreach": "torch.optim.AdamW(foreach=True)",
               "fused": "torch.optim.AdamW(fused=True)", "apex-fused": "apex.optimizers.FusedAdam(adam_w_mode=True)"}

#: Tried in this order when nothing else is said (notebook 04 measures why: on 2 CPU cores
#: fused is ~4x faster than for-loop and foreach; on GPUs Apex's and torch's fused are both one
#: multi-tensor kernel).
DEFAULT_ADAMW_PREFERENCE = ("apex-fused", "fused", "foreach", "for-loop")


def param_groups(model, weight_decay: float) -> list[dict[str, Any]]:
    """Two parameter groups: weight decay on matrices, none on biases and norm weights.

    Megatron's rule (``megatron/core/optimizer/__init__.py::_get_param_groups``): no decay
    for biases and 1-D parameters (LayerNorm weight/bias). ``wd_mult`` is read by
    ``OptimizerParamScheduler`` (weight_decay = wd x wd_mult).
    """
    decay, no_decay = [], []
    for name, p in model.named_parameters():
        if p.requires_grad:
            (no_decay if name.endswith(".bias") or p.ndim == 1 else decay).append(p)
    return [
        {"params": decay, "wd_mult": 1.0, "weight_decay": weight_decay, "name": "decay"},
        {"params": no_decay, "wd_mult": 0.0, "weight_decay": 0.0, "name": "no_decay"},
    ]


def adamw_unavailable_reason(implementation: str, device: str = "cpu") -> str | None:
    """None when ``implementation`` can run on ``device`` (``"cpu"``/``"cuda"``), else why not.

    Raises:
        ValueError: unknown implementation.
    """
    if implementation not in ADAMW_IMPLEMENTATIONS:
        raise ValueError(f"implementation={implementation!r}: choose one of {ADAMW_IMPLEMENTATIONS}")
    if implementation == "apex-fused":
        from helpers.environment import nvidia_apex

        if device != "cuda":
            return f"needs a CUDA GPU and NVIDIA Apex (this run is on {device})"
        if not nvidia_apex()["FusedAdam"]:
            return ("NVIDIA Apex is not installed (it is not on PyPI: build it from source "
                    "or use the NGC PyTorch container)")
    return None


def make_adamw(params: Iterable[Any], implementation: str | None = None, *, lr: float = 5e-4,
               betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8,
               weight_decay: float = 0.0) -> torch.optim.Optimizer:
    """AdamW (decoupled weight decay) in the named implementation.

    Args:
        params: parameters or parameter groups, as ``torch.optim`` takes them.
        implementation: one of :data:`ADAMW_IMPLEMENTATIONS`; ``None``: the first available of
            :data:`DEFAULT_ADAMW_PREFERENCE` on this machine (Apex on a GPU with Apex, else fused).
        lr, betas, eps, weight_decay: hyper-parameters (the guide: 5e-4, (0.9, 0.999), 1e-8, 0.1).

    Returns:
        the optimizer; ``optimizer.implementation`` names the one used.

    Raises:
        ValueError: unknown or unavailable implementation (the message says why).
    """
    device = "cuda" if torch.cuda.is_available() else "cpu"
    if implementation is None:
        implementation = next(i for i in DEFAULT_ADAMW_PREFERENCE if adamw_unavailable_reason(i, device) is None)
    reason = adamw_unavailable_reason(implementation, device)
    if reason:
        raise ValueError(f"implementation={implementation!r} is unavailable: {reason}")
    kw = dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay)
    if implementation == "apex-fused":
        from apex.optimizers import FusedAdam

        opt = FusedAdam(params, adam_w_mode=True, **kw)
    elif implementation == "fused":
        opt = torch.optim.AdamW(params, fused=True, **kw)
    else:
        opt = torch.optim.AdamW(params, foreach=implementation == "foreach", **kw)
    opt.implementation = implementation
    return opt


def build_optimizer(model, cfg) -> torch.optim.Optimizer:
    """:func:`make_adamw` over :func:`param_groups` with a ``TrainingConfig``'s hyper-parameters."""
    return make_adamw(param_groups(model, cfg.weight_decay), lr=cfg.lr, betas=(cfg.adam_beta1, cfg.adam_beta2),
                      eps=cfg.adam_eps, weight_decay=cfg.weight_decay)


def build_scheduler(optimizer, cfg):
    """megatron-core ``OptimizerParamScheduler``: linear warmup to ``lr`` over
    ``lr_warmup_iters``, then ``lr_decay_style`` decay to ``min_lr`` at ``lr_decay_iters``,
    counted in iterations (one ``step(1)`` per optimizer step).

    On resume only the step count comes from the checkpoint; the schedule is ``cfg``'s
    (Megatron-LM ``--override-opt_param-scheduler``)."""
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

    return OptimizerParamScheduler(
        optimizer, init_lr=0.0, max_lr=cfg.lr, min_lr=cfg.min_lr, lr_warmup_steps=cfg.lr_warmup_iters,
        lr_decay_steps=cfg.decay_iters, lr_decay_style=cfg.lr_decay_style, start_wd=cfg.weight_decay,
        end_wd=cfg.weight_decay, wd_incr_steps=cfg.train_iters, wd_incr_style="constant",
        use_checkpoint_opt_param_scheduler=False, override_opt_param_scheduler=True,
    )


def lr_schedule(cfg) -> list[float]:
    """The learning rate of every iteration 1..train_iters (what the scheduler will set)."""
    p = torch.nn.Parameter(torch.zeros(1))
    opt = torch.optim.SGD([{"params": [p], "wd_mult": 1.0}], lr=cfg.lr)
    sched = build_scheduler(opt, cfg)
    lrs = []
    for _ in range(cfg.train_iters):
        lrs.append(opt.param_groups[0]["lr"])
        sched.step(1)
    return lrs


def grad_norm_and_clip(params: list, clip_grad: float) -> float:
    """Global L2 norm of the gradients over all model-parallel ranks, then clip to ``clip_grad``.

    Counts each parameter once: tensor-parallel duplicates (LayerNorm, row-parallel bias) on
    rank 0 only and the tied output weight on the first stage only, then sums squares across
    the model-parallel group. As megatron-core ``optimizer/clip_grads.py``
    (``get_grad_norm_fp32``, ``clip_grad_by_total_norm_fp32``), whose CUDA-only asserts
    prevent using it on CPU.

    Returns:
        The norm before clipping (float).
    """
    import torch.distributed as dist
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel import param_is_not_tensor_parallel_duplicate
    from megatron.core.transformer.module import param_is_not_shared

    grads = [p.grad for p in params if p.grad is not None]
    counted = [p.grad for p in params if p.grad is not None and param_is_not_shared(p)
               and param_is_not_tensor_parallel_duplicate(p)]
    sq = torch.zeros((), dtype=torch.float32, device=grads[0].device if grads else "cpu")
    for g in counted:
        sq += g.detach().float().pow(2).sum()
    if parallel_state.get_model_parallel_group().size() > 1:
        dist.all_reduce(sq, group=parallel_state.get_model_parallel_group())
    norm = float(sq.sqrt())
    if clip_grad > 0 and math.isfinite(norm):
        coeff = clip_grad / (norm + 1e-6)
        if coeff < 1.0:
            torch._foreach_mul_(grads, coeff)
    return norm
