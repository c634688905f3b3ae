"""AdamW in each of its implementations, and the learning-rate schedule a run follows.

Notebook 04 measures the AdamW implementations (:func:`make_adamw`); notebook 03 plots
:func:`lr_schedule` against what Megatron-LM's loop logged. Training itself steps the optimizer
megatron-core's ``get_megatron_optimizer`` builds (notebook 03, section 5.6).

Sources: megatron-core ``optimizer/__init__.py``, ``optimizer_param_scheduler.py``; torch
``optim/adamw.py``; Apex ``optimizers/fused_adam.py``; Loshchilov & Hutter 2019 (AdamW).
"""

from __future__ import annotations

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


def adamw_unavailable_reason(implementation: str, device: str = "cpu") -> str | None:
    """None when ``implementation`` can run on ``device`` (``"cpu"``/``"cuda"``), else why not.

    Raises:
        ValueError: unknown implementation.
    """
    if implementation not in ADAMW_IMPLEMENTATIONS:
        raise ValueError(f"implementation={implementation!r}: choose one of {ADAMW_IMPLEMENTATIONS}")
    if implementation == "apex-fused":
        from helpers.support.environment import nvidia_apex

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


def lr_schedule(cfg) -> list[float]:
    """The learning rate megatron-core's ``OptimizerParamScheduler`` sets after each of 0..train_iters steps.

    Linear warmup from 0 to ``lr`` over ``lr_warmup_iters``, then ``lr_decay_style`` decay to
    ``min_lr`` at ``lr_decay_iters``. Entry ``i`` is the rate after ``i`` steps: the one iteration
    ``i + 1`` uses, and the one Megatron-LM logs at iteration ``i`` (its scheduler steps before the log).

    Args:
        cfg: a ``helpers.learn.training_config.TrainingConfig``.

    Returns:
        ``train_iters + 1`` learning rates.
    """
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

    p = torch.nn.Parameter(torch.zeros(1))
    opt = torch.optim.SGD([{"params": [p], "wd_mult": 1.0}], lr=cfg.lr)
    sched = OptimizerParamScheduler(
        opt, init_lr=0.0, max_lr=cfg.lr, min_lr=cfg.min_lr, lr_warmup_steps=cfg.lr_warmup_iters,
        lr_decay_steps=cfg.decay_iters, lr_decay_style=cfg.lr_decay_style, start_wd=cfg.weight_decay,
        end_wd=cfg.weight_decay, wd_incr_steps=cfg.train_iters, wd_incr_style="constant")
    lrs = [opt.param_groups[0]["lr"]]
    for _ in range(cfg.train_iters):
        sched.step(1)
        lrs.append(opt.param_groups[0]["lr"])
    return lrs
