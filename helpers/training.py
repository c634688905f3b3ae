"""Pre-train the GPT with megatron-core: the torchrun entry point and the pieces it is made of.

Launched the way Megatron-LM's ``pretrain_gpt.py`` is::

    python -m torch.distributed.run --nproc_per_node N -m helpers.training --config run.json
    python -m helpers.training --config run.json          # one process, no torchrun needed

or from Python/a notebook with :func:`launch` (writes ``run.json``, runs torchrun through
:mod:`helpers.launch`, streams a progress bar, returns the metrics). Each step of
``pretrain`` is a function another module can call: :func:`initialize_distributed`,
:func:`build_datasets`, :func:`build_optimizer`, :func:`build_scheduler`, :func:`train_step`,
:func:`evaluate`, :func:`save` / :func:`load` and :class:`MetricsLogger`.

What megatron-core does here (and a plain PyTorch loop would not): ``parallel_state`` builds
the tensor/pipeline/data-parallel process groups; ``GPTModel`` shards its layers across the
tensor-parallel group; ``DistributedDataParallel`` reduces gradients in contiguous buckets
and ``finalize_model_grads`` also all-reduces the tied embedding across pipeline stages;
``get_forward_backward_func`` runs the micro-batches (gradient accumulation, or the 1F1B
pipeline schedule when PP > 1); ``OptimizerParamScheduler`` sets the learning rate;
``dist_checkpointing`` writes sharded, reshardable checkpoints.

Sources: Megatron-LM ``pretrain_gpt.py``, ``megatron/training/training.py`` (``train_step``,
``training_log``, ``evaluate``), ``megatron/training/checkpointing.py``,
``megatron/core/optimizer/__init__.py`` (weight-decay groups),
``megatron/core/optimizer_param_scheduler.py``, ``megatron/legacy/data/data_samplers.py``
(``MegatronPretrainingSampler``).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import math
import os
import signal
import sys
import time
from dataclasses import asdict, dataclass, field, fields, replace
from pathlib import Path
from typing import Any, Callable, Iterator

from helpers import checkpointing
from helpers.environment import package_version
from helpers.distributed import destroy_distributed, initialize_distributed  # noqa: F401  (training.initialize_distributed)
from helpers.model import ModelConfig
from helpers.model import PROFILES as MODEL_PROFILES

SUMMARY_FILE = "training_summary.json"
METRICS_FILE = "metrics.jsonl"


# =========================================================================== configuration
@dataclass(frozen=True)
class TrainingConfig:
    """One training run: the model, the data, the batch, the optimizer and the outputs.

    Names follow Megatron-LM's arguments (``--micro-batch-size``, ``--global-batch-size``,
    ``--lr-warmup-iters``...). Paths left ``None`` default to the run folder's layout:
    ``{run_dir}/data/codeparrot_content_document``, ``{run_dir}/data/tokenizer``,
    ``{run_dir}/checkpoints``, ``{run_dir}/tensorboard``, ``{run_dir}/metrics.jsonl``.

    Attributes (units): batch sizes in samples of ``seq_length`` tokens; iterations are
    optimizer steps; ``lr``/``min_lr`` per step; intervals in iterations.
    """

    run_dir: str = "runs/latest"
    model: ModelConfig = field(default_factory=lambda: MODEL_PROFILES["cpu"])
    data_prefix: str | None = None
    tokenizer_dir: str | None = None
    split: str = "969,30,1"
    micro_batch_size: int = 4
    global_batch_size: int = 8
    tensor_model_parallel_size: int = 1
    pipeline_model_parallel_size: int = 1
    train_iters: int = 200
    lr: float = 2e-3
    min_lr: float = 2e-4
    lr_warmup_iters: int = 20
    lr_decay_iters: int | None = None
    lr_decay_style: str = "cosine"
    weight_decay: float = 0.1
    adam_beta1: float = 0.9
    adam_beta2: float = 0.999
    adam_eps: float = 1e-8
    clip_grad: float = 1.0
    seed: int = 1234
    precision: str = "auto"
    log_interval: int = 10
    eval_interval: int = 40
    eval_iters: int = 4
    save_interval: int | None = 100
    exit_interval: int | None = None
    checkpoint_dir: str | None = None
    tensorboard_dir: str | None = None
    metrics_path: str | None = None
    layer_spec: str = "auto"
    use_megatron_ddp: bool = True

    # ----------------------------------------------------------------- derived paths
    @property
    def run_path(self) -> Path:
        """The run folder, absolute."""
        return Path(self.run_dir).expanduser().resolve()

    @property
    def data_prefix_path(self) -> Path:
        """``.bin/.idx`` prefix (default ``{run_dir}/data/codeparrot_content_document``)."""
        return Path(self.data_prefix) if self.data_prefix else self.run_path / "data" / "codeparrot_content_document"

    @property
    def tokenizer_path(self) -> Path:
        """Tokenizer folder (default ``{run_dir}/data/tokenizer``)."""
        return Path(self.tokenizer_dir) if self.tokenizer_dir else self.run_path / "data" / "tokenizer"

    @property
    def checkpoint_path(self) -> Path:
        """Checkpoint folder (default ``{run_dir}/checkpoints``)."""
        return Path(self.checkpoint_dir) if self.checkpoint_dir else self.run_path / "checkpoints"

    @property
    def tensorboard_path(self) -> Path:
        """TensorBoard folder, Megatron's ``--tensorboard-dir`` (default ``{run_dir}/tensorboard``)."""
        return Path(self.tensorboard_dir) if self.tensorboard_dir else self.run_path / "tensorboard"

    @property
    def metrics_file(self) -> Path:
        """JSON Lines metrics (default ``{run_dir}/metrics.jsonl``)."""
        return Path(self.metrics_path) if self.metrics_path else self.run_path / METRICS_FILE

    @property
    def summary_file(self) -> Path:
        """``training_summary.json`` next to the metrics file (``{run_dir}/training_summary.json``)."""
        return self.metrics_file.with_name(SUMMARY_FILE)

    @property
    def decay_iters(self) -> int:
        """``lr_decay_iters``, or ``train_iters`` when unset (Megatron's default)."""
        return self.lr_decay_iters or self.train_iters

    # ----------------------------------------------------------------- (de)serialisation
    def to_dict(self) -> dict[str, Any]:
        """All fields as plain JSON-ready values (``model`` as a dict)."""
        data = asdict(self)
        data["model"] = self.model.to_dict()
        return data

    def to_json(self, path: str | os.PathLike) -> Path:
        """Write the config as ``run.json`` (the ``--config`` of the entry point)."""
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(self.to_dict(), indent=2) + "\n")
        return path

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "TrainingConfig":
        """Inverse of :meth:`to_dict`.

        Raises:
            ValueError: unknown keys (listed with the valid ones).
        """
        data = dict(data)
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ValueError(f"unknown TrainingConfig keys {unknown}; valid keys: {sorted(known)}")
        if isinstance(data.get("model"), dict):
            data["model"] = ModelConfig.from_dict(data["model"])
        return cls(**data)

    @classmethod
    def from_json(cls, path: str | os.PathLike) -> "TrainingConfig":
        """Read a ``run.json`` written by :meth:`to_json` (errors as :meth:`from_dict`)."""
        return cls.from_dict(json.loads(Path(path).read_text()))

    # ----------------------------------------------------------------- checks
    def data_parallel_size(self, world_size: int) -> int:
        """world size / (TP x PP).

        Raises:
            ValueError: the world size is not a multiple of TP x PP.
        """
        mp = self.tensor_model_parallel_size * self.pipeline_model_parallel_size
        if world_size % mp:
            raise ValueError(
                f"world size {world_size} is not divisible by tensor_model_parallel_size x "
                f"pipeline_model_parallel_size = {self.tensor_model_parallel_size} x "
                f"{self.pipeline_model_parallel_size}: launch a multiple of {mp} processes"
            )
        return world_size // mp

    def check(self, world_size: int = 1) -> None:
        """Validate the config for ``world_size`` processes before anything starts.

        Raises:
            ValueError: non-positive sizes, a global batch not divisible by micro-batch x
                data-parallel size, TP not dividing the heads / hidden size / MLP width or PP
                not dividing the layers (:func:`helpers.model.check_layout`), warmup not shorter than decay, unknown precision or
                decay style, bf16/fp16 without CUDA.
            FileNotFoundError: the data prefix's ``.bin``/``.idx`` or the tokenizer is missing.
            ValueError: ``split`` leaves a part with no documents (megatron-core would hang).
        """
        for name in ("micro_batch_size", "global_batch_size", "train_iters", "log_interval",
                     "eval_iters", "eval_interval", "tensor_model_parallel_size",
                     "pipeline_model_parallel_size"):
            if int(getattr(self, name)) < 1:
                raise ValueError(f"{name}={getattr(self, name)} must be >= 1")
        dp = self.data_parallel_size(world_size)
        num_microbatches(self.global_batch_size, self.micro_batch_size, dp)
        from helpers.model import Layout, check_layout  # TP divides heads/width, PP divides layers

        check_layout(self.model, Layout(self.tensor_model_parallel_size, self.pipeline_model_parallel_size, dp))
        if self.lr_warmup_iters >= self.decay_iters:
            raise ValueError(f"lr_warmup_iters={self.lr_warmup_iters} must be below lr_decay_iters={self.decay_iters}")
        if self.lr_decay_style not in ("constant", "linear", "cosine", "inverse-square-root"):
            raise ValueError(f"lr_decay_style={self.lr_decay_style!r}: use constant, linear, cosine or inverse-square-root")
        if not self.lr > 0:
            raise ValueError(f"lr={self.lr} must be positive (the peak learning rate, e.g. 2e-3)")
        if not 0 <= self.min_lr <= self.lr:
            raise ValueError(f"min_lr={self.min_lr} must be between 0 and lr={self.lr}")
        resolve_precision(self.precision)
        prefix = self.data_prefix_path
        missing = [str(prefix) + ext for ext in (".bin", ".idx") if not Path(str(prefix) + ext).exists()]
        if missing:
            raise FileNotFoundError(
                f"data prefix {prefix} has no {', '.join(missing)}: run notebook 01 "
                "(or helpers.preprocess.ensure_data(run_dir)) first, or pass data_prefix="
            )
        from helpers import dataloader

        dataloader.check_split(dataloader._sequence_lengths(str(prefix)), self.split)  # empty split: error, not a hang
        if not (self.tokenizer_path / "vocab.json").exists():
            raise FileNotFoundError(f"no tokenizer in {self.tokenizer_path} (vocab.json): run notebook 01 first")
        from helpers import tokenizer as tokenizer_lib

        tok_size = tokenizer_lib.vocab_size_of(self.tokenizer_path)
        if tok_size != self.model.vocab_size:
            raise ValueError(
                f"model.vocab_size={self.model.vocab_size} but the tokenizer in {self.tokenizer_path} has "
                f"{tok_size} entries: set model vocab_size={tok_size} (Megatron pads it to "
                f"{self.model.padded_vocab_size(self.tensor_model_parallel_size)} rows itself)"
            )


#: Training profiles. ``cpu``: about 3 minutes on 2 cores. ``codeparrot-small``: the
#: CodeParrot guide's exact hyperparameters (see shared/notes/reference-recipe.md).
PROFILES: dict[str, TrainingConfig] = {
    "cpu": TrainingConfig(),
    "codeparrot-small": TrainingConfig(
        model=MODEL_PROFILES["codeparrot-small"], micro_batch_size=12, global_batch_size=192,
        train_iters=150_000, lr=5e-4, min_lr=0.0, lr_warmup_iters=2000, lr_decay_iters=150_000,
        lr_decay_style="cosine", weight_decay=0.1, adam_beta1=0.9, adam_beta2=0.999, adam_eps=1e-8,
        clip_grad=1.0, seed=1234, log_interval=10, eval_interval=200, eval_iters=10,
        save_interval=2000, split="969,30,1",
    ),
}


def profile(name: str, run_dir: str, **overrides: Any) -> TrainingConfig:
    """Training profile ``name`` for ``run_dir``; ``model`` may be given as a dict of overrides.

    Raises:
        KeyError: unknown profile (lists the profiles).
    """
    if name not in PROFILES:
        raise KeyError(f"training profile {name!r} is unknown: choose one of {sorted(PROFILES)}")
    base = PROFILES[name]
    if isinstance(overrides.get("model"), dict):
        overrides["model"] = replace(base.model, **overrides["model"])
    return replace(base, run_dir=str(run_dir), **overrides)


def num_microbatches(global_batch_size: int, micro_batch_size: int, data_parallel_size: int) -> int:
    """Gradient-accumulation steps: global = micro x data-parallel size x accumulation steps.

    Source: Megatron-LM ``megatron/core/num_microbatches_calculator.py``
    (``ConstantNumMicroBatchesCalculator``).

    Raises:
        ValueError: ``global_batch_size`` is not divisible by micro x data-parallel size.
    """
    per_step = micro_batch_size * data_parallel_size
    if global_batch_size % per_step:
        raise ValueError(
            f"global_batch_size={global_batch_size} is not divisible by micro_batch_size x "
            f"data_parallel_size = {micro_batch_size} x {data_parallel_size} = {per_step}: "
            f"use a multiple of {per_step} (e.g. {max(per_step, global_batch_size // per_step * per_step)})"
        )
    return global_batch_size // per_step


def resolve_precision(precision: str) -> str:
    """``"auto"`` -> fp32 on CPU, bf16 on a GPU that supports it, else fp16 (loss-scaled).

    Raises:
        ValueError: unknown name, or bf16/fp16 without CUDA.
    """
    import torch

    if precision == "auto":
        if not torch.cuda.is_available():
            return "fp32"
        return "bf16" if torch.cuda.is_bf16_supported() else "fp16"
    if precision not in ("fp32", "bf16", "fp16"):
        raise ValueError(f"precision={precision!r}: choose auto, fp32, bf16 or fp16")
    if precision != "fp32" and not torch.cuda.is_available():
        raise ValueError(f"precision={precision!r} needs a CUDA GPU; use 'fp32' (or 'auto') on CPU")
    return precision


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
    from helpers import dataloader

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
    import torch

    samples = [dataset[i % len(dataset)] for i in indices]
    out = {}
    for key in ("tokens", "labels", "loss_mask", "position_ids"):
        t = torch.stack([torch.as_tensor(s[key]) for s in samples])
        out[key] = (t.float() if key == "loss_mask" else t.long()).to(device)
    return out


# =========================================================================== optimizer
def param_groups(model, weight_decay: float) -> list[dict[str, Any]]:
    """Two parameter groups: weight decay on matrices, none on biases and norm weights.

    Megatron's rule (``megatron/core/optimizer/__init__.py::_get_param_groups``): no decay
    for biases and 1-D parameters (LayerNorm weight/bias). ``wd_mult`` is read by
    ``OptimizerParamScheduler`` (weight_decay = wd x wd_mult).
    """
    decay, no_decay = [], []
    for name, p in model.named_parameters():
        if not p.requires_grad:
            continue
        (no_decay if name.endswith(".bias") or p.ndim == 1 else decay).append(p)
    return [
        {"params": decay, "wd_mult": 1.0, "weight_decay": weight_decay, "name": "decay"},
        {"params": no_decay, "wd_mult": 0.0, "weight_decay": 0.0, "name": "no_decay"},
    ]


def build_optimizer(model, cfg: TrainingConfig):
    """AdamW with Megatron's weight-decay groups, the fastest implementation available.

    Apex ``FusedAdam`` (adam_w_mode) when NVIDIA Apex is importable on CUDA; else torch's
    fused AdamW (CUDA, and CPU in torch >= 2.4); else torch's foreach AdamW.

    Returns:
        ``(optimizer, name)``, e.g. ``(AdamW, "torch.optim.AdamW(fused=True)")``.
    """
    import torch

    groups = param_groups(model, cfg.weight_decay)
    kwargs = dict(lr=cfg.lr, betas=(cfg.adam_beta1, cfg.adam_beta2), eps=cfg.adam_eps, weight_decay=cfg.weight_decay)
    if torch.cuda.is_available() and importlib.util.find_spec("apex") is not None:
        try:
            from apex.optimizers import FusedAdam

            return FusedAdam(groups, adam_w_mode=True, **kwargs), "apex.optimizers.FusedAdam"
        except ImportError:  # the unrelated PyPI "apex" package
            pass
    try:
        return torch.optim.AdamW(groups, fused=True, **kwargs), "torch.optim.AdamW(fused=True)"
    except (RuntimeError, TypeError):
        return torch.optim.AdamW(groups, foreach=True, **kwargs), "torch.optim.AdamW(foreach=True)"


def build_scheduler(optimizer, cfg: TrainingConfig):
    """megatron-core ``OptimizerParamScheduler``: linear warmup to ``lr`` over
    ``lr_warmup_iters``, then ``lr_decay_style`` decay to ``min_lr`` at ``lr_decay_iters``,
    counted in iterations (one ``step(1)`` per optimizer step).

    On resume only the step count comes from the checkpoint; the schedule is ``cfg``'s
    (Megatron-LM ``--override-opt_param-scheduler``). megatron-core's default would keep the
    checkpoint's decay length, so a rerun with more ``train_iters`` would sit at ``min_lr``
    instead of following :func:`lr_schedule`."""
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

    return OptimizerParamScheduler(
        optimizer, init_lr=0.0, max_lr=cfg.lr, min_lr=cfg.min_lr, lr_warmup_steps=cfg.lr_warmup_iters,
        lr_decay_steps=cfg.decay_iters, lr_decay_style=cfg.lr_decay_style, start_wd=cfg.weight_decay,
        end_wd=cfg.weight_decay, wd_incr_steps=cfg.train_iters, wd_incr_style="constant",
        use_checkpoint_opt_param_scheduler=False, override_opt_param_scheduler=True,
    )


def lr_schedule(cfg: TrainingConfig) -> list[float]:
    """The learning rate of every iteration 1..train_iters (what the scheduler will set)."""
    import torch

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
    import torch
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
        import torch

        return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")


def _loss_func(loss_mask, output_tensor):
    """Masked mean of the per-token loss; the schedule divides it by the micro-batch count."""
    losses = output_tensor.float()
    loss = (losses * loss_mask).sum() / loss_mask.sum().clamp(min=1)
    return loss, {"lm loss": loss.detach().clone()}


def _forward_step(batches: Iterator[dict[str, Any]], model):
    """Megatron's ``forward_step(data_iterator, model)``: returns output and loss function."""
    from functools import partial

    batch = next(batches)
    output = model(batch["tokens"], batch["position_ids"], None, labels=batch["labels"])
    return output, partial(_loss_func, batch["loss_mask"])


def _run_schedule(trainer: Trainer, batches: list[dict[str, Any]], forward_only: bool) -> float | None:
    """Run the micro-batches through megatron-core's schedule; the mean loss on the last stage."""
    import torch
    import torch.distributed as dist
    from megatron.core import parallel_state
    from megatron.core.pipeline_parallel import get_forward_backward_func

    cfg = trainer.cfg
    results = get_forward_backward_func()(
        forward_step_func=_forward_step, data_iterator=iter(batches), model=[trainer.model],
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
    if trainer.grad_scaler is not None:
        trainer.grad_scaler.step(trainer.optimizer)
        trainer.grad_scaler.update()
    else:
        trainer.optimizer.step()
    trainer.scheduler.step(1)
    trainer.iteration += 1
    trainer.consumed_train_samples += cfg.global_batch_size
    return {"lm_loss": float("nan") if loss is None else loss, "grad_norm": norm, "lr": lr}


def evaluate(trainer: Trainer, dataset=None, eval_iters: int | None = None) -> float | None:
    """Mean LM loss (nats/token) over the first ``eval_iters`` global batches of ``dataset``
    (the validation set by default), forward only, no gradient (Megatron-LM ``evaluate``).

    Returns:
        The loss on the last pipeline stage, None elsewhere, and None when there is no
        dataset (a ``split`` whose valid weight is 0: Megatron-LM then skips evaluation).
    """
    import torch

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


# =========================================================================== logging
class MetricsLogger:
    """Writes each log record to the console, ``metrics.jsonl`` and TensorBoard.

    Only the logging rank (the last one, which holds the loss, as Megatron's
    ``print_rank_last``) writes. On resume from iteration ``start``, records after ``start``
    from an interrupted run are dropped from ``metrics.jsonl`` and TensorBoard
    (``purge_step``) so curves have no duplicates; a run from scratch starts a new file.
    """

    def __init__(self, cfg: TrainingConfig, active: bool, start_iteration: int = 0):
        self.active = active
        self.path = cfg.metrics_file
        self.writer = None
        if not active:
            return
        self.path.parent.mkdir(parents=True, exist_ok=True)
        if self.path.exists():
            kept = [line for line in self.path.read_text().splitlines()
                    if start_iteration and line.strip() and json.loads(line).get("iteration", 0) <= start_iteration]
            tmp = self.path.with_suffix(".jsonl.tmp")
            tmp.write_text("".join(line + "\n" for line in kept))
            os.replace(tmp, self.path)
        try:
            from torch.utils.tensorboard import SummaryWriter

            self.writer = SummaryWriter(str(cfg.tensorboard_path), purge_step=start_iteration + 1 if start_iteration else None)
        except ImportError:  # tensorboard not installed: console + JSON Lines only
            self.writer = None

    def log(self, record: dict[str, Any], console: str | None = None) -> None:
        """Append ``record`` (``kind``, ``iteration`` and numbers) everywhere; print ``console``."""
        if not self.active:
            return
        if console:
            print(console, flush=True)
        with open(self.path, "a", encoding="utf-8") as f:
            f.write(json.dumps(record) + "\n")
        if self.writer is not None:
            step = record["iteration"]
            for key, value in record.items():
                if key not in ("kind", "iteration") and isinstance(value, (int, float)) and math.isfinite(value):
                    self.writer.add_scalar(f"{record['kind']}/{key}", value, step)
            self.writer.flush()

    def close(self) -> None:
        """Flush and close TensorBoard."""
        if self.writer is not None:
            self.writer.close()


def read_metrics(path: str | os.PathLike) -> dict[str, list[dict[str, Any]]]:
    """``metrics.jsonl`` split by kind: ``{"train": [...], "valid": [...]}`` in iteration order."""
    out: dict[str, list[dict[str, Any]]] = {"train": [], "valid": []}
    path = Path(path)
    if path.exists():
        for line in path.read_text().splitlines():
            if line.strip():
                rec = json.loads(line)
                out.setdefault(rec["kind"], []).append(rec)
    return out


# =========================================================================== set-up, save, load
def setup(cfg: TrainingConfig) -> Trainer:
    """Initialise distributed state, datasets, model (+DDP), optimizer and scheduler.

    Raises:
        ValueError / FileNotFoundError: see :meth:`TrainingConfig.check`.
    """
    import torch

    from helpers import model as model_lib

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
        from megatron.core.distributed import (
            DistributedDataParallel,
            DistributedDataParallelConfig,
            finalize_model_grads,
        )

        ddp_config = DistributedDataParallelConfig(grad_reduce_in_fp32=True, overlap_grad_reduce=False,
                                                   use_distributed_optimizer=False)
        model = DistributedDataParallel(model.config, ddp_config, model)
        model.config.no_sync_func = model.no_sync
        model.config.finalize_model_grads_func = finalize_model_grads
    optimizer, opt_name = build_optimizer(model, cfg)
    checkpointing.init_optimizer_state(optimizer)
    scheduler = build_scheduler(optimizer, cfg)
    scaler = None
    if precision == "fp16":
        scaler = torch.amp.GradScaler("cuda")
        getattr(model, "module", model).config.grad_scale_func = scaler.scale
    return Trainer(cfg=cfg, dist_info=info, model=model, optimizer=optimizer, optimizer_name=opt_name,
                   scheduler=scheduler, train_ds=train_ds, valid_ds=valid_ds, precision=precision,
                   num_micro_batches=n_micro, grad_scaler=scaler)


def checkpoint_metadata(trainer: Trainer) -> dict[str, Any]:
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
                                         checkpoint_metadata(trainer))


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
    checkpointing.check_compatible(saved, checkpoint_metadata(trainer), ckpt_dir)
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
    import torch
    import torch.distributed as dist

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
    import torch
    import torch.distributed as dist

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
    last_train, last_valid, tok_rates = None, None, []
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


# =========================================================================== launch from Python
@dataclass
class TrainingResult:
    """What :func:`launch` returns: the summary, the metrics and the launch's wall time (s)."""

    summary: dict[str, Any]
    metrics: dict[str, list[dict[str, Any]]]
    wall_seconds: float
    skipped: bool
    log: list[str]


_ITER_LINE = "iteration "


def launch(cfg: TrainingConfig, *, nproc_per_node: int = 1, timeout_s: float = 3600.0,
           master_port: int | None = None, progress: bool = True, echo: bool = False,
           config_name: str = "run.json", env: dict[str, str] | None = None) -> TrainingResult:
    """Write ``run.json`` into the run folder and train under torchrun, with a progress bar.

    Skips the launch when the latest checkpoint already reached ``train_iters`` (cached).
    The config, and an existing checkpoint's model shape, are checked here first, so bad
    input fails before any process starts.

    Args:
        cfg: the run; ``nproc_per_node`` must be a multiple of TP x PP.
        nproc_per_node: processes (one per GPU on a GPU machine).
        timeout_s: wall-clock limit (s); past it every process is killed.
        master_port: rendezvous port (a free one by default).
        progress: show a tqdm bar over iterations; ``echo`` also prints every log line.
        env: extra environment variables (e.g. ``OMP_NUM_THREADS``; CPU results are
            bit-identical only between runs with the same thread count).

    Raises:
        ValueError / FileNotFoundError: bad config (see :meth:`TrainingConfig.check`).
        checkpointing.CheckpointMismatchError: the checkpoint folder holds another model shape.
        helpers.launch.LaunchError: port in use, timeout, or a rank failed (its log tail).
    """
    from tqdm.auto import tqdm

    from helpers import launch as launch_lib

    cfg.check(nproc_per_node)
    latest = checkpointing.latest_iteration(cfg.checkpoint_path)
    summary_path = cfg.summary_file
    if latest is not None:
        saved = checkpointing.read_model_config(cfg.checkpoint_path, latest)
        checkpointing.check_compatible(saved, cfg.model.to_metadata(cfg.tensor_model_parallel_size), cfg.checkpoint_path)
    if latest is not None and latest >= cfg.train_iters and summary_path.exists():
        return TrainingResult(json.loads(summary_path.read_text()), read_metrics(cfg.metrics_file), 0.0, True, [])
    config_path = cfg.to_json(cfg.run_path / config_name)
    bar = tqdm(total=cfg.train_iters, initial=latest or 0, desc="training", unit="it") if progress else None
    info: dict[str, str] = {}

    def on_line(line: str) -> None:
        stripped = line.strip()
        if bar is not None and stripped.startswith(_ITER_LINE):
            try:
                it = int(stripped.split()[1].split("/")[0])
            except (IndexError, ValueError):
                it = None
            if it is not None:
                bar.update(it - bar.n)
                if "lm loss:" in stripped:
                    info["loss"] = stripped.split("lm loss:")[1].split("|")[0].strip()
                    bar.set_postfix(loss=float(info["loss"]))
        if echo or (bar is None and stripped):
            print(line, flush=True)
        elif stripped.startswith((">", "validation", "saved", "exiting")):
            (bar.write if bar is not None else print)(stripped)

    try:
        res = launch_lib.torchrun(["helpers.training", "--config", str(config_path)], nproc_per_node=nproc_per_node,
                                  timeout_s=timeout_s, master_port=master_port, on_line=on_line,
                                  log_path=cfg.run_path / "training.log", env=env)
    finally:
        if bar is not None:
            bar.close()
    summary = json.loads(summary_path.read_text())
    return TrainingResult(summary, read_metrics(cfg.metrics_file), res.wall_seconds, False, res.lines)


def main(argv: list[str] | None = None) -> int:
    """``python -m helpers.training --config run.json [--train-iters N]``."""
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
    pretrain(cfg)
    return 0


if __name__ == "__main__":
    sys.exit(main())
