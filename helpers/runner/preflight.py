"""Preflight: what a training run will cost, worked out before any process starts (notebook 03, the runner).

Tokens per epoch of the training split, epochs, tokens in all, memory per GPU
(:func:`helpers.learn.memory.memory_per_gpu`) and an estimated wall time. A run that would repeat its
training data more than ``max_epochs`` times raises :class:`RepeatedDataError` (``max_epochs=0``: no
limit); the guide's full recipe (150,000 x 192 x 1024 tokens) over this corpus would make thousands.

Sources: Muennighoff et al. 2023, "Scaling Data-Constrained Language Models"
(arXiv:2305.16264), sections 5-6 (up to about 4 epochs are worth nearly as much as new data;
the value of further repeats decays to almost nothing past about 16): :data:`MAX_EPOCHS`.
Narayanan et al. 2021 (FLOPs per token, :func:`helpers.learn.model.flops_per_token`); Chowdhery et
al. 2022 (PaLM), appendix B (MFU); NVIDIA data sheets (:data:`PEAK_BF16_FLOPS`).
"""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from helpers.learn import checkpointing, preprocess
from helpers.runner import data_stage, readiness, timings
from helpers.learn import model as model_lib
from helpers.learn.memory import checkpoint_bytes, memory_per_gpu
from helpers.learn.training_config import TrainingConfig, num_microbatches, resolve_precision
from helpers.support import run_guard
from helpers.support.run_guard import check_free_space, free_bytes, human_bytes

#: Default limit on epochs over the training split (Muennighoff et al. 2023: past about 16
#: repeats, more compute on the same data is worth almost nothing).
MAX_EPOCHS = 16.0

#: Peak dense bf16 tensor-core FLOP/s (no sparsity) of common GPUs. Sources: NVIDIA data sheets
#: (A100: 312 TFLOP/s; H100/H200 SXM: 989; H100 PCIe: 756; H100 NVL: 835; L40S: 362; L40: 181;
#: A10G: 125; L4: 121). The longest name found in the device name wins ("L40S" before "L4").
PEAK_BF16_FLOPS: dict[str, float] = {
    "H200": 989e12, "H100 SXM": 989e12, "H100 80GB HBM3": 989e12, "H100 PCIe": 756e12, "H100 NVL": 835e12,
    "H100": 989e12, "A100": 312e12, "L40S": 362e12, "L40": 181e12, "A10G": 125e12, "L4": 121e12,
}

#: The stated throughput behind the time estimate on a GPU (not measured on the machine at hand): this
#: share of its peak (the issue's target for the guide's model on one H100/H200 is about 40 %; 30 %
#: leaves headroom). On a CPU the estimate is the recorded cpu run's launch scaled by this machine's
#: matrix-multiply speed (:func:`helpers.runner.timings.training_estimate`).
STATED_GPU_MFU = 0.30


#: Bytes a run writes beside its checkpoints, allowed for in :attr:`Preflight.disk_bytes`: the
#: log, metrics, TensorBoard events and the dataset's index cache (a few MB for the cpu profile).
DISK_MARGIN_BYTES = 16 * 1000 ** 2


class RepeatedDataError(ValueError):
    """The run would read its training data more than ``max_epochs`` times."""


def peak_flops(device_name: str, override_tflops: float | None = None) -> float | None:
    """Peak dense bf16 FLOP/s of ``device_name`` (``torch.cuda.get_device_name()``), or
    ``override_tflops x 1e12``; ``None`` when the GPU is not in :data:`PEAK_BF16_FLOPS`."""
    if override_tflops is not None:
        if not override_tflops > 0:
            raise ValueError(f"override_tflops={override_tflops}: give the GPU's peak dense bf16 TFLOP/s, a positive number")
        return override_tflops * 1e12
    for key in sorted(PEAK_BF16_FLOPS, key=len, reverse=True):
        if key in device_name:
            return PEAK_BF16_FLOPS[key]
    return None


def train_tokens_per_epoch(data_prefix: str | Path, split: str) -> int:
    """Tokens in the training part of ``split`` of the ``.bin/.idx`` at ``data_prefix``.

    The training documents are the first range of :func:`helpers.learn.preprocess.split_document_ranges`
    (megatron-core's ``get_split_indices``); their lengths are read from the ``.idx``
    (megatron-core ``IndexedDataset.sequence_lengths``). One epoch of a ``GPTDataset`` is these
    tokens cut into samples of ``seq_length + 1`` (megatron-core ``gpt_dataset.py``).

    Raises:
        FileNotFoundError: no ``.bin/.idx`` at ``data_prefix`` (run notebook 01).
        helpers.learn.preprocess.DamagedDataError: the ``.idx`` cannot be read, or the ``.bin`` does not match it
            (the message says how to remake them); ValueError: ``split`` is malformed.
    """
    ds = preprocess.open_indexed_dataset(data_prefix)  # kept alive: its __del__ closes the mmap the lengths view
    lengths = ds.sequence_lengths
    train = preprocess.split_document_ranges(len(lengths), split)[0]
    return 0 if train is None else int(lengths[train[0]:train[1]].sum())


def _epochs(epochs: float) -> str:
    return f"{epochs:,.2f}" if epochs >= 0.01 else f"{epochs:.1e}"


@dataclass
class Preflight:
    """What a run will do (units in the names: tokens, bytes, seconds, FLOP/s).

    ``tokens_per_epoch``, ``epochs``: None when the data is not made yet. ``memory_per_gpu_bytes``:
    weights, gradients, optimizer state and activations of the largest stage (no allocator or
    communication buffers). ``checkpoint_bytes``: one save (:func:`helpers.learn.memory.checkpoint_bytes`);
    ``checkpoint_saves``: the saves still to come (Megatron-LM keeps them all) from
    ``start_iteration``, the checkpoint it resumes from (None: a fresh start); ``free_bytes``: free
    space on the checkpoint folder's disk now. ``flops_per_s``: the model FLOP/s behind ``estimated_seconds``
    (a GPU: stated; a CPU: the recorded run's, scaled; None for a GPU missing from :data:`PEAK_BF16_FLOPS`), with
    ``rate_source`` saying which.
    """

    device: str
    precision: str
    tokens_per_iteration: int
    train_tokens: int
    tokens_per_epoch: int | None
    epochs: float | None
    memory_per_gpu_bytes: float
    checkpoint_bytes: int
    checkpoint_saves: int
    start_iteration: int | None
    free_bytes: int
    flops_per_token: int
    flops_per_s: float | None
    rate_source: str
    estimated_seconds: float | None

    @property
    def disk_bytes(self) -> int:
        """Bytes the run will write: its checkpoints plus :data:`DISK_MARGIN_BYTES` (logs, TensorBoard, index cache)."""
        return self.checkpoint_saves * self.checkpoint_bytes + DISK_MARGIN_BYTES

    def rows(self) -> list[tuple[str, str]]:
        """``(what, value)`` pairs for a printed table."""
        sec = self.estimated_seconds
        est = ("unknown" if sec is None else "under 1 s" if sec < 1 else f"{sec:,.0f} s" if sec < 120 else f"{sec / 60:,.1f} min" if sec < 7200
               else f"{sec / 3600:,.1f} h" if sec < 172800 else f"{sec / 86400:,.0f} days")
        per = "GPU" if self.device.startswith("cuda") else "process"
        return [("device, precision", f"{self.device}, {self.precision}"),
                ("tokens per iteration", f"{self.tokens_per_iteration:,}"),
                ("tokens in all", f"{self.train_tokens:,}"),
                ("training tokens per epoch", "not made yet" if self.tokens_per_epoch is None else f"{self.tokens_per_epoch:,}"),
                ("epochs over the training data", "unknown" if self.epochs is None else _epochs(self.epochs)),
                (f"memory per {per} (estimate)", f"{self.memory_per_gpu_bytes / 2**30:,.2f} GiB"),
                ("checkpoints to write (estimate)", f"{self.checkpoint_saves} x {human_bytes(self.checkpoint_bytes)}; "
                                                    f"{human_bytes(self.free_bytes)} free on that disk"),
                ("estimated training time", f"{est} ({self.rate_source})")]

    def text(self) -> str:
        """The rows as aligned lines."""
        return "\n".join(f"{k:<32} {v}" for k, v in self.rows())


def preflight(cfg, *, nproc: int = 1, tokens_per_epoch: int | None = None, device: str | None = None,
              matmul_gflops: float | None = None) -> Preflight:
    """Work out ``cfg``'s run (a :class:`helpers.learn.training_config.TrainingConfig`) on ``nproc`` processes.

    Args:
        tokens_per_epoch: training tokens of the data; default read from ``cfg.data_prefix_path``'s ``.idx``
            and the data manifest when they exist (else unknown).
        device: ``"cuda:<name>"`` or ``"cpu"``; default this machine's.
        matmul_gflops: on a CPU, GFLOP/s of a 512x512 fp32 matrix multiply for the time estimate
            (default measured now, 0.5 s: :func:`helpers.runner.readiness.matmul_gflops`).

    Raises:
        TypeError, ValueError: values :meth:`TrainingConfig.check` refuses (without its file
            checks); on this machine's GPUs, more processes than GPUs; an unreadable ``.idx``.
    """
    dp = cfg.check(world_size=nproc, files=False)
    return _plan(cfg, nproc, dp, checkpointing.latest_iteration(cfg.checkpoint_path), tokens_per_epoch, device, matmul_gflops)


def _plan(cfg, nproc: int, dp: int, start: int | None, tokens_per_epoch: int | None = None, device: str | None = None,
          matmul_gflops: float | None = None) -> Preflight:
    """:func:`preflight` of a config already checked (``dp``: its data-parallel size), resuming from
    iteration ``start`` (None: a fresh start)."""
    import torch

    if device is None:
        device = f"cuda:{torch.cuda.get_device_name()}" if torch.cuda.is_available() else "cpu"
        if torch.cuda.is_available() and nproc > torch.cuda.device_count():
            raise ValueError(f"nproc_per_node={nproc} but this machine has {torch.cuda.device_count()} GPU(s): "
                             "use at most one process per GPU")
    precision = resolve_precision(cfg.precision)
    layout = model_lib.Layout(cfg.tensor_model_parallel_size, cfg.pipeline_model_parallel_size, dp)
    memory = memory_per_gpu(cfg.model, layout, micro_batch_size=cfg.micro_batch_size, precision=precision,
                            num_microbatches=num_microbatches(cfg.global_batch_size, cfg.micro_batch_size, dp),
                            distributed_optimizer=cfg.use_distributed_optimizer, recompute=cfg.recompute,
                            sequence_parallel=cfg.sequence_parallel,
                            num_virtual_stages=cfg.num_virtual_stages_per_pipeline_rank,
                            fused=device != "cpu" and cfg.layer_spec != "local")  # a CPU runs the local (unfused) layers
    if tokens_per_epoch is None and Path(f"{cfg.data_prefix_path}.idx").is_file():
        tokens_per_epoch = train_tokens_per_epoch(cfg.data_prefix_path, cfg.split)
    per_iteration = cfg.global_batch_size * cfg.model.seq_length
    total = per_iteration * cfg.train_iters
    fpt = model_lib.flops_per_token(cfg.model)
    if device.startswith("cuda"):
        peak = peak_flops(device)
        rate = None if peak is None else peak * STATED_GPU_MFU * nproc
        source = (f"stated: {STATED_GPU_MFU:.0%} MFU of {peak / 1e12:.0f} TFLOP/s x {nproc} GPU" if peak else
                  f"no peak known for {device}: add it to preflight.PEAK_BF16_FLOPS")
        seconds = total * fpt / rate if rate else None
    else:  # the recorded cpu run's launch, scaled by this machine's matrix-multiply speed against that run's
        measured = timings.load()
        speed = matmul_gflops or _cpu_speed()
        seconds, rate = timings.training_estimate(total, fpt, speed, measured) if measured else (None, None)
        source = (f"the cpu run of {measured['started'][:10]} ({measured['machine']['cpu_model']}) scaled by this "
                  f"CPU's matmul, {speed:,.0f} against {measured['machine']['matmul_gflops']:,.0f} GFLOP/s" if measured
                  else f"no recorded run ({timings.MEASURED_FILE.name}) to scale by")
    return Preflight(device=device, precision=precision, tokens_per_iteration=per_iteration, train_tokens=total,
                     tokens_per_epoch=tokens_per_epoch, epochs=total / tokens_per_epoch if tokens_per_epoch else None,
                     memory_per_gpu_bytes=memory.total, checkpoint_bytes=checkpoint_bytes(cfg.model, precision, nproc),
                     checkpoint_saves=checkpoint_saves(cfg, start or 0), start_iteration=start,
                     free_bytes=free_bytes(cfg.checkpoint_path), flops_per_token=fpt, flops_per_s=rate, rate_source=source,
                     estimated_seconds=seconds)


@functools.lru_cache(maxsize=1)
def _cpu_speed() -> float:
    """This machine's matrix-multiply GFLOP/s, measured once per process (0.5 s)."""
    return readiness.matmul_gflops(0.5)


def check_run(cfg, *, nproc: int = 1, max_epochs: float = MAX_EPOCHS, config_name: str = "run.json") -> Preflight | None:
    """Every check of one training run, in one pass, before anything starts (what :func:`helpers.runner.launch.train` runs).

    In order: the configuration (:meth:`TrainingConfig.check`), the run and checkpoint folders, the
    checkpoint to resume from, then the plan (:func:`preflight`): epochs and the checkpoints' disk.

    Returns:
        The :class:`Preflight` of the run, or ``None`` when the checkpoint folder already holds this run, finished.

    Raises:
        TypeError / ValueError / FileNotFoundError: the configuration (:meth:`TrainingConfig.check`).
        helpers.support.run_guard.RunFolderNotWritableError, RunFolderBusyError: the folders.
        helpers.learn.checkpointing.CheckpointMismatchError: the checkpoint holds another model shape, or a
            distributed-optimizer state that cannot move to this run's TP x PP layout.
        helpers.learn.checkpointing.CheckpointReadError: the checkpoint to resume from has a missing or short shard.
        ValueError: the folder holds a finished run trained with other settings.
        RepeatedDataError: more than ``max_epochs`` epochs (:func:`check_repeats`).
        helpers.support.run_guard.DiskFullError: the checkpoints to come need more space than the disk has free.
    """
    _check_max_epochs(max_epochs)
    dp = cfg.check(nproc)
    for folder in dict.fromkeys([cfg.run_path, cfg.checkpoint_path]):
        run_guard.check_writable(folder)  # a read-only folder: refused before anything is written
    run_guard.check_run_folder_free(cfg.run_path)  # another job training this folder: refused now
    latest = checkpointing.latest_iteration(cfg.checkpoint_path)
    if latest is not None:
        checkpointing.check_readable(checkpointing.iteration_dir(cfg.checkpoint_path, latest))  # Megatron-LM would say only "EOFError"
        saved = checkpointing.read_model_config(cfg.checkpoint_path, latest)
        checkpointing.check_compatible(saved, cfg.model.to_metadata(cfg.tensor_model_parallel_size), cfg.checkpoint_path)
        checkpointing.check_layout(saved, cfg.tensor_model_parallel_size, cfg.pipeline_model_parallel_size,
                                   cfg.use_distributed_optimizer, cfg.checkpoint_path)
        if latest >= cfg.train_iters and cfg.summary_file.exists():
            if (cfg.run_path / config_name).exists():  # a finished run's results must be this config's
                try:
                    saved_run = TrainingConfig.from_json(cfg.run_path / config_name).to_dict()
                except ValueError as err:  # not JSON, or keys no TrainingConfig has
                    raise ValueError(f"{cfg.run_path / config_name} cannot be read ({err}): it should describe the "
                                     f"finished run in {cfg.checkpoint_path}. Train into a new run folder (run_dir=...), "
                                     "or delete the file to take this config as the finished run's") from None
                check_same_run(cfg, saved_run)
            return None
    plan = _plan(cfg, nproc, dp, latest)
    check_repeats(plan, max_epochs)
    check_disk(plan, cfg.checkpoint_path)
    return plan


def checkpoint_saves(cfg, start: int = 0) -> int:
    """Checkpoints Megatron-LM writes training ``cfg`` from iteration ``start``: one every
    ``save_interval`` iterations and one at the end when ``train_iters`` is not a multiple of it
    (``megatron/training/training.py``: ``train`` and the end of ``pretrain``); it deletes none."""
    interval = cfg.save_interval or cfg.train_iters
    if start >= cfg.train_iters:
        return 0
    return cfg.train_iters // interval - start // interval + (1 if cfg.train_iters % interval else 0)


def check_disk(plan: Preflight, folder: str | Path) -> None:
    """Refuse a run whose checkpoints would not fit on the disk of ``folder`` (the checkpoint folder).

    Raises:
        helpers.support.run_guard.DiskFullError: ``plan.disk_bytes`` is more than the free space there;
            the message names the folder, both amounts and the fixes. Nothing was started.
    """
    check_free_space(folder, plan.disk_bytes,
                     f"training ({plan.checkpoint_saves} checkpoints of about {human_bytes(plan.checkpoint_bytes)} each, "
                     f"all kept, plus {human_bytes(DISK_MARGIN_BYTES)} for the log, TensorBoard and the index cache)",
                     "train into a run folder on a bigger disk (run_dir=, or --run-dir), or save fewer checkpoints "
                     "(a larger save_interval)")


def plan_for_parameters(parameters: dict[str, Any], vocab_size: int, run_dir: str | Path) -> Preflight:
    """The preflight of notebook 03 run with ``parameters`` (its parameters cell's names and values).

    Every parameter named like a :class:`~helpers.learn.training_config.TrainingConfig` or
    :class:`~helpers.learn.model.ModelConfig` field is used as such, and ``architecture`` (with
    ``num_query_groups``) as :func:`helpers.learn.model.architecture_fields`, on the training profile named by
    ``parameters["profile"]`` (``cpu`` for profiles that have none); the series runner calls
    this before the first notebook starts.
    """
    import torch

    from helpers.learn import training_config

    base = parameters.get("profile") if parameters.get("profile") in training_config.PROFILES else "cpu"
    model_names = {f.name for f in dataclasses.fields(model_lib.ModelConfig)}
    names = {f.name for f in dataclasses.fields(training_config.TrainingConfig)} - {"model", "run_dir"}
    model = {k: v for k, v in parameters.items() if k in model_names} | {"vocab_size": vocab_size}
    model["max_position_embeddings"] = model.get("seq_length", training_config.PROFILES[base].model.seq_length)
    if "architecture" in parameters:  # as notebook 03's configuration cell adds them (groups only for a Llama)
        model.pop("num_query_groups", None)
        base_model = training_config.PROFILES[base].model
        model |= model_lib.architecture_fields(parameters["architecture"], model.get("hidden_size", base_model.hidden_size),
                                               model.get("num_attention_heads", base_model.num_attention_heads),
                                               parameters.get("num_query_groups", 0))
    settings = {k: v for k, v in parameters.items() if k in names}
    base_cfg = training_config.PROFILES[base]
    iters, warmup = settings.get("train_iters", base_cfg.train_iters), settings.get("lr_warmup_iters", base_cfg.lr_warmup_iters)
    if isinstance(iters, int) and isinstance(warmup, int):
        settings.setdefault("lr_decay_iters", max(iters, warmup + 1))  # as notebook 03 sets it
    try:  # notebook 03 trains on the data's own split
        settings["split"] = data_stage.data_paths(run_dir).split
    except FileNotFoundError:
        pass
    cfg = training_config.profile(base, str(run_dir), model=model, **settings)
    return preflight(cfg, nproc=parameters.get("nproc_per_node") or max(1, torch.cuda.device_count()))


def check_repeats(plan: Preflight, max_epochs: float = MAX_EPOCHS) -> None:
    """Refuse a run that reads its training data more than ``max_epochs`` times (0: no limit).

    Raises:
        RepeatedDataError: ``plan.epochs > max_epochs`` (the message gives both ways out).
        ValueError: ``max_epochs`` is not a finite number >= 0.
    """
    _check_max_epochs(max_epochs)
    if max_epochs and plan.epochs is not None and plan.epochs > max_epochs:
        raise RepeatedDataError(
            f"this run reads {plan.train_tokens:,} tokens, {_epochs(plan.epochs)} epochs of the {plan.tokens_per_epoch:,} "
            f"training tokens, more than max_epochs={max_epochs:g} (Muennighoff et al. 2023: the value of repeated "
            "data falls off steeply past about 16 epochs). Train fewer iterations or on more data (notebook 01: "
            "source=, package_files=, in a new run folder), or set max_epochs=0 (the runner: -p max_epochs=0) to run it "
            "anyway. Nothing was started.")


def _check_max_epochs(max_epochs: float) -> None:
    if isinstance(max_epochs, bool) or not isinstance(max_epochs, (int, float)) or not 0 <= max_epochs < float("inf"):
        raise ValueError(f"max_epochs={max_epochs!r} must be a finite number >= 0 (0: no limit; default {MAX_EPOCHS:g})")


def summary(plan: Preflight) -> dict[str, Any]:
    """The plan as a JSON-ready dict (recorded in the run's results)."""
    return dataclasses.asdict(plan)


#: TrainingConfig fields that do not change what a run trains (logging, saving, paths, resume flags).
RUN_ONLY_FIELDS = {"run_dir", "data_prefix", "tokenizer_dir", "checkpoint_dir", "tensorboard_dir", "metrics_path",
                   "log_interval", "eval_interval", "eval_iters", "save_interval", "exit_interval",
                   "override_opt_param_scheduler", "use_checkpoint_opt_param_scheduler",
                   "recompute"}  # recomputation changes memory and time, not the arithmetic


def training_differences(cfg, saved: dict[str, Any], also_ignore: frozenset[str] = frozenset()) -> list[str]:
    """``"field: saved -> cfg"`` for every field outside :data:`RUN_ONLY_FIELDS` (and ``also_ignore``)
    in which ``cfg`` would train differently from a saved ``run.json`` (``saved``)."""
    ignored = RUN_ONLY_FIELDS | also_ignore
    defaults = {f.name: f.default for f in dataclasses.fields(cfg) if f.default is not dataclasses.MISSING}
    return [f"{k}: {saved.get(k, defaults.get(k))!r} -> {v!r}" for k, v in cfg.to_dict().items()
            if k not in ignored and saved.get(k, defaults.get(k)) != v]  # a field older run.json files lack: its default


def check_same_run(cfg, saved: dict[str, Any]) -> None:
    """Refuse to hand back a finished run's results (``saved``: its ``run.json``) for a config
    that would train differently.

    Raises:
        ValueError: a field outside :data:`RUN_ONLY_FIELDS` differs; the message lists them and the fixes.
    """
    diffs = training_differences(cfg, saved)
    if diffs:
        raise ValueError(
            f"{cfg.run_path} already holds a finished run (train_iters={saved.get('train_iters')}) trained with other "
            f"settings ({'; '.join(diffs)}); its results would be shown as this config's. Train into a new run "
            f"folder (run_dir=...), or delete {cfg.checkpoint_path} to train again.")
