"""What one training run is: its configuration, its profiles, and the metrics file it writes.

:class:`TrainingConfig` carries Megatron-LM's argument names (``--micro-batch-size``,
``--global-batch-size``, ``--lr-warmup-iters``...): :mod:`helpers.runner.megatron_args` turns it into
the flags of Megatron-LM's training script, and ``helpers.runner.launch.train`` writes it as the run
folder's ``run.json``. Notebook 03 builds one from its parameters; notebooks 05 and 06 read it back.

Sources: Megatron-LM ``megatron/training/arguments.py`` (the names and defaults),
``megatron/core/num_microbatches_calculator.py``, ``megatron/training/training.py``
(``training_log``: the metrics logged).
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import asdict, dataclass, field, fields, replace
from numbers import Integral, Real
from pathlib import Path
from typing import Any

from helpers.learn.model import PROFILES as MODEL_PROFILES
from helpers.learn.model import ModelConfig, batch_size_error

SUMMARY_FILE = "training_summary.json"
#: Retired fields a run.json may hold (the series' own training loop's samples and DDP switch);
#: read back, they are dropped: none changes what Megatron-LM trains.
_RETIRED_FIELDS = {"sample_interval", "sample_prompt", "sample_tokens", "use_megatron_ddp"}
METRICS_FILE = "metrics.jsonl"
#: Activation recomputation (``TrainingConfig.recompute``): Korthikanti et al. 2022, sections 4.4 and 5.
RECOMPUTE = ("none", "selective", "full")
#: What :meth:`TrainingConfig.check` accepts for a field declared so (a bool is no number here).
_FIELD_TYPES = {"int": (Integral,), "int | None": (Integral, type(None)), "float": (Real,), "bool": (bool,),
                "str | None": (str, type(None))}


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
    ``override_opt_param_scheduler`` / ``use_checkpoint_opt_param_scheduler``: on a resume whose
    schedule differs from the checkpoint's, follow this config's or the saved one.
    ``pretrained_checkpoint``: weights to start from when ``checkpoint_dir`` holds none (iteration 0,
    a fresh optimizer). ``layer_spec`` picks ``--transformer-impl`` on a GPU; a CPU runs local layers.
    ``recompute`` (Korthikanti et al. 2022): ``"none"``, ``"selective"`` (``--recompute-activations``)
    or ``"full"`` (``--recompute-granularity full --recompute-method uniform --recompute-num-layers 1``).
    ``use_distributed_optimizer``: ZeRO-1 (Rajbhandari et al. 2020), optimizer state sharded over DP.
    ``sequence_parallel`` (TP > 1): Korthikanti et al. 2022, section 4.2.2.
    ``num_virtual_stages_per_pipeline_rank`` (PP > 1): interleaved 1F1B (Narayanan et al. 2021, section 2.2).
    ``expert_model_parallel_size``: each layer's experts split over that many of the data-parallel ranks
    (GShard, arXiv:2006.16668; megatron-core 0.19.2 ``transformer/moe/token_dispatcher.py``).
    None of these change the arithmetic; the losses match the one-process run's.
    """
    run_dir: str = "runs/latest"
    model: ModelConfig = field(default_factory=lambda: MODEL_PROFILES["cpu"])
    data_prefix: str | None = None
    tokenizer_dir: str | None = None
    split: str = "969,30,1"
    micro_batch_size: int = 4
    global_batch_size: int = 4
    tensor_model_parallel_size: int = 1
    pipeline_model_parallel_size: int = 1
    train_iters: int = 1000
    lr: float = 2e-3
    min_lr: float = 2e-4
    lr_warmup_iters: int = 100
    lr_decay_iters: int | None = None
    lr_decay_style: str = "cosine"
    weight_decay: float = 0.1
    adam_beta1: float = 0.9
    adam_beta2: float = 0.999
    adam_eps: float = 1e-8
    clip_grad: float = 1.0
    seed: int = 1234
    precision: str = "auto"
    log_interval: int = 20
    eval_interval: int = 200
    eval_iters: int = 4
    save_interval: int | None = 250
    exit_interval: int | None = None
    checkpoint_dir: str | None = None
    pretrained_checkpoint: str | None = None
    tensorboard_dir: str | None = None
    metrics_path: str | None = None
    layer_spec: str = "auto"
    override_opt_param_scheduler: bool = False
    use_checkpoint_opt_param_scheduler: bool = False
    recompute: str = "none"
    use_distributed_optimizer: bool = False
    sequence_parallel: bool = False
    num_virtual_stages_per_pipeline_rank: int | None = None
    expert_model_parallel_size: int = 1

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
        data = {k: v for k, v in data.items() if k not in _RETIRED_FIELDS}
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ValueError(f"unknown TrainingConfig keys {unknown}; valid keys: {sorted(known)}")
        if isinstance(data.get("model"), dict):
            data["model"] = ModelConfig.from_dict(data["model"])
        return cls(**data)

    @classmethod
    def from_json(cls, path: str | os.PathLike) -> "TrainingConfig":
        """Read a ``run.json`` written by :meth:`to_json` (errors as :meth:`from_dict`).

        A run folder that was copied or moved keeps the old absolute paths in its ``run.json``; they
        are read as the folder that holds the file: ``run_dir`` becomes that folder, and every path
        field inside the old one moves with it (a path outside it, e.g. shared data, stays).
        """
        path = Path(path).expanduser().resolve()
        data = json.loads(path.read_text())
        old, new = data.get("run_dir"), str(path.parent)
        if old and Path(old).expanduser().resolve() != path.parent:
            old = str(Path(old).expanduser().resolve())
            data["run_dir"] = new
            for name in _PATH_FIELDS:
                value = data.get(name)
                if isinstance(value, str) and (value == old or value.startswith(old + os.sep)):
                    data[name] = new + value[len(old):]
        return cls.from_dict(data)

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

    def check(self, world_size: int = 1, *, files: bool = True) -> int:
        """Validate the config for ``world_size`` processes before anything starts
        (``files=False``: the values only, not the data and tokenizer files).

        Returns:
            The data-parallel size: ``world_size`` / (TP x PP).

        Raises:
            TypeError: a field of another type than declared (``train_iters=2.5``,
                ``micro_batch_size="4"``, ``True`` for a number), in this config or its ``model``.
            ValueError: non-positive sizes, a global batch not divisible by micro-batch x
                data-parallel size, TP not dividing the heads / hidden size / MLP width or PP
                not dividing the layers (:func:`helpers.learn.model.check_layout`), warmup not shorter than decay, unknown precision or
                decay style, bf16/fp16 without CUDA.
            FileNotFoundError: the data prefix's ``.bin``/``.idx`` or the tokenizer is missing.
            ValueError: ``split`` leaves a part with no documents (megatron-core would hang).
            ValueError: ``expert_model_parallel_size`` > 1 without ``model.num_experts``, or not dividing both the
                experts and the data-parallel size (Megatron-LM's ``validate_args``, megatron-core's
                ``parallel_state.initialize_model_parallel``).
            ValueError: a float that is not finite, or outside what AdamW training can use
                (``lr`` above 1, ``adam_beta*`` outside [0, 1), ``adam_eps`` not positive,
                negative ``weight_decay`` or ``clip_grad``).
        """
        if isinstance(world_size, bool) or not isinstance(world_size, Integral) or world_size < 1:
            raise ValueError(f"world_size={world_size!r}: the number of processes (nproc_per_node), an integer >= 1")
        for obj, prefix in ((self, ""), (self.model, "model.")):
            for f in fields(obj):
                value = getattr(obj, f.name)
                kinds = _FIELD_TYPES.get(str(f.type), object)
                if not isinstance(value, kinds) or (isinstance(value, bool) and bool not in kinds):
                    raise TypeError(f"{prefix}{f.name}={value!r} is a {type(value).__name__}, not {f.type} (e.g. {f.default!r})")
                if isinstance(value, float) and not math.isfinite(value):
                    raise ValueError(f"{prefix}{f.name}={value} is not a finite number: training would run on NaN")
        if self.override_opt_param_scheduler and self.use_checkpoint_opt_param_scheduler:
            raise ValueError("override_opt_param_scheduler and use_checkpoint_opt_param_scheduler are both set: "
                             "choose one (this config's schedule, or the checkpoint's)")
        rules = {"lr": (self.lr <= 1.0, "is above 1: AdamW diverges at once (the guide uses 5e-4)"),
                 "adam_beta1": (0 <= self.adam_beta1 < 1, "must be in [0, 1) (the guide: 0.9)"),
                 "adam_beta2": (0 <= self.adam_beta2 < 1, "must be in [0, 1) (the guide: 0.999)"),
                 "adam_eps": (self.adam_eps > 0, "must be positive (the guide: 1e-8)"),
                 "weight_decay": (self.weight_decay >= 0, "must be >= 0 (0 turns it off)"),
                 "clip_grad": (self.clip_grad >= 0, "must be >= 0 (0 turns it off)")}
        for name, (ok, rule) in rules.items():
            if not ok:
                raise ValueError(f"{name}={getattr(self, name)} {rule}")
        for name in ("micro_batch_size", "global_batch_size", "train_iters", "log_interval",
                     "eval_iters", "eval_interval", "tensor_model_parallel_size",
                     "pipeline_model_parallel_size", "expert_model_parallel_size"):
            if int(getattr(self, name)) < 1:
                raise ValueError(f"{name}={getattr(self, name)} must be >= 1")
        dp = self.data_parallel_size(world_size)
        num_microbatches(self.global_batch_size, self.micro_batch_size, dp)
        from helpers.learn.model import Layout, check_layout  # TP divides heads/width, PP divides layers

        check_layout(self.model, Layout(self.tensor_model_parallel_size, self.pipeline_model_parallel_size, dp))
        if self.lr_warmup_iters >= self.decay_iters:
            raise ValueError(f"lr_warmup_iters={self.lr_warmup_iters} must be below lr_decay_iters={self.decay_iters}")
        if self.lr_decay_style not in ("constant", "linear", "cosine", "inverse-square-root"):
            raise ValueError(f"lr_decay_style={self.lr_decay_style!r}: use constant, linear, cosine or inverse-square-root")
        if not self.lr > 0:
            raise ValueError(f"lr={self.lr} must be positive (the peak learning rate, e.g. 2e-3)")
        if not 0 <= self.min_lr <= self.lr:
            raise ValueError(f"min_lr={self.min_lr} must be between 0 and lr={self.lr}")
        if self.precision not in ("auto", "fp32", "bf16", "fp16"):  # the device is checked where the flags are written
            raise ValueError(f"precision={self.precision!r}: choose auto, fp32, bf16 or fp16")
        if self.recompute not in RECOMPUTE:
            raise ValueError(f"recompute={self.recompute!r}: choose one of {', '.join(map(repr, RECOMPUTE))}")
        v = self.num_virtual_stages_per_pipeline_rank
        if v is not None:
            stages = v * self.pipeline_model_parallel_size
            if v < 2 or self.pipeline_model_parallel_size < 2 or self.model.num_layers % stages:
                raise ValueError(f"num_virtual_stages_per_pipeline_rank={v}: the interleaved schedule needs at least 2 "
                                 f"virtual stages on each of at least 2 pipeline ranks, and num_layers="
                                 f"{self.model.num_layers} divisible by their product ({stages} here); None: one stage per rank")
        if self.sequence_parallel and self.tensor_model_parallel_size < 2:
            raise ValueError("sequence_parallel=True needs tensor_model_parallel_size >= 2: it splits the activations "
                             "outside attention and the MLP over the tensor-parallel ranks")
        ep, experts = self.expert_model_parallel_size, self.model.num_experts
        if ep > 1 and (not experts or experts % ep or dp % ep):
            raise ValueError(f"expert_model_parallel_size={ep} with model.num_experts={experts} and a data-parallel size of "
                             f"{dp}: expert parallelism splits the experts (model.num_experts, a multiple of {ep}) over "
                             f"{ep} of the data-parallel ranks (their number, world size / (TP x PP), a multiple of {ep}); "
                             "1: every rank holds every expert")
        if not files:
            return dp
        prefix = self.data_prefix_path
        missing = [str(prefix) + ext for ext in (".bin", ".idx") if not Path(str(prefix) + ext).exists()]
        if missing:
            raise FileNotFoundError(
                f"data prefix {prefix} has no {', '.join(missing)}: run notebook 01 "
                "(python -m helpers.runner.series run --only 01) first, or pass data_prefix="
            )
        from helpers.learn import dataloader

        dataloader.check_split(dataloader._sequence_lengths(str(prefix)), self.split)  # empty split: error, not a hang
        if self.pretrained_checkpoint and not (Path(self.pretrained_checkpoint) / "latest_checkpointed_iteration.txt").exists():
            raise FileNotFoundError(f"pretrained_checkpoint={self.pretrained_checkpoint} holds no checkpoint "
                                    "(latest_checkpointed_iteration.txt): pass a checkpoints folder")
        from helpers.learn import tokenizer as tokenizer_lib

        tokenizer_lib.check_folder(self.tokenizer_path)
        tok_size = tokenizer_lib.vocab_size_of(self.tokenizer_path)
        if tok_size != self.model.vocab_size:
            raise ValueError(
                f"model.vocab_size={self.model.vocab_size} but the tokenizer in {self.tokenizer_path} has "
                f"{tok_size} entries: set model vocab_size={tok_size} (Megatron pads it to "
                f"{self.model.padded_vocab_size(self.tensor_model_parallel_size)} rows itself)"
            )
        return dp


#: Training profiles. ``cpu``: notebook 03's defaults, about 3 minutes on 2 cores. ``gpu``: the
#: guide's 110M model on one GPU for 3,000 iterations of 64 x 1,024 tokens (197M tokens; unmeasured:
#: 8-13 minutes at an estimated 250k-400k tokens/s in bf16 on one H100, README "On a GPU machine"),
#: GPT-3 Small's learning rate (Brown et al. 2020, table 2.1). ``codeparrot-small``: the
#: CodeParrot guide's exact hyperparameters (see shared/notes/reference-recipe.md), 12 hours on 8 A100s.
PROFILES: dict[str, TrainingConfig] = {
    "cpu": TrainingConfig(),
    "gpu": TrainingConfig(
        model=MODEL_PROFILES["codeparrot-small"], micro_batch_size=32, global_batch_size=64, train_iters=3000,
        lr=6e-4, min_lr=6e-5, lr_warmup_iters=300, lr_decay_iters=3000, log_interval=50, eval_interval=500,
        eval_iters=10, save_interval=1000),
    "codeparrot-small": TrainingConfig(
        model=MODEL_PROFILES["codeparrot-small"], micro_batch_size=12, global_batch_size=192,
        train_iters=150_000, lr=5e-4, min_lr=0.0, lr_warmup_iters=2000, lr_decay_iters=150_000,
        lr_decay_style="cosine", weight_decay=0.1, adam_beta1=0.9, adam_beta2=0.999, adam_eps=1e-8,
        clip_grad=1.0, seed=1234, log_interval=10, eval_interval=200, eval_iters=10,
        save_interval=2000, split="969,30,1", use_distributed_optimizer=True,
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
        raise ValueError(batch_size_error(global_batch_size, micro_batch_size, data_parallel_size))
    return global_batch_size // per_step


def resolve_precision(precision: str) -> str:
    """``"auto"`` -> fp32 on CPU, bf16 on a GPU that has it in hardware (Ampere, compute capability
    8.0, and later), else fp16 (loss-scaled); a V100 or T4 only emulates bf16, slowly.

    Raises:
        ValueError: unknown name, or bf16/fp16 without CUDA.
    """
    import torch

    if precision == "auto":
        if not torch.cuda.is_available():
            return "fp32"
        return "bf16" if torch.cuda.is_bf16_supported(including_emulation=False) else "fp16"
    if precision not in ("fp32", "bf16", "fp16"):
        raise ValueError(f"precision={precision!r}: choose auto, fp32, bf16 or fp16")
    if precision != "fp32" and not torch.cuda.is_available():
        raise ValueError(f"precision={precision!r} needs a CUDA GPU; use 'fp32' (or 'auto') on CPU")
    return precision


#: The fields that hold paths (rebased by :meth:`TrainingConfig.from_json` when a run folder moved).
_PATH_FIELDS = ("data_prefix", "tokenizer_dir", "checkpoint_dir", "tensorboard_dir", "metrics_path", "pretrained_checkpoint")
