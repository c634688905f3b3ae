"""Notebook 06 section 10: a tensor-parallel (TP=2) megatron-core run, to show it converts to the same model.

:func:`run_tensor_parallel` starts ``torchrun`` processes (gloo on the CPU) that each run
:func:`main` of this module: load a checkpoint into a ``GPTModel`` split over the ranks
(``helpers.learn.checkpointing.load_model``: ``dist_checkpointing`` reshards whatever TP size saved it)
or initialise one randomly, compute the logits of given tokens (all-gathered over the
tensor-parallel group) and save the model in that TP layout. Notebook 06 converts the saved
TP=2 checkpoint and compares it with the TP=1 conversion, tensor by tensor.

Sources: megatron-core 0.19.2 ``tensor_parallel/mappings.py`` (``gather_from_tensor_model_parallel_region``),
``dist_checkpointing/serialization.py``; Shoeybi et al. 2019, section 3.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch

from helpers.learn import checkpointing
from helpers.learn.model import ModelConfig
from helpers.support import environment


@dataclass
class TensorParallelRun:
    """:func:`run_tensor_parallel`: logits ``[b, s, padded_vocab]`` gathered over TP ranks (or None),
    the ``iter_NNNNNNN`` folder saved (or None), the launch's wall seconds."""

    logits: torch.Tensor | None
    saved: Path | None
    wall_seconds: float


def run_tensor_parallel(tensor_model_parallel_size: int, *, load: str | os.PathLike | None = None,
                        model_config: ModelConfig | None = None, tokens: torch.Tensor | None = None,
                        save: str | os.PathLike | None = None, iteration: int | None = None, seed: int = 1234,
                        workdir: str | os.PathLike | None = None, timeout_s: float = 300.0,
                        on_line: Callable[[str], None] | None = None, cpu: bool = True) -> TensorParallelRun:
    """Run a megatron-core GPT with tensor parallelism in ``torchrun`` processes (gloo on CPU).

    Loads a checkpoints folder (any saved TP size) into a ``GPTModel`` split over
    ``tensor_model_parallel_size`` ranks, or initialises one from ``model_config`` and ``seed``; then
    optionally computes the logits of ``tokens`` (int64 ``[b, s]``; vocabulary slices all-gathered) and
    saves the model in this TP layout (``helpers.learn.checkpointing.save_model``).

    Args:
        load: checkpoints folder (its latest iteration); exclusive with ``model_config``.
        save: checkpoints folder to write (must not hold a checkpoint); ``iteration``: default the loaded one, or 0.
        workdir: folder for the exchanged files (default: a temporary folder, removed).
        cpu: run on the CPU over gloo (``CUDA_VISIBLE_DEVICES=""``): fp32 CPU logits like the reference's;
            ``False``: on the GPUs, in IEEE fp32 (TF32 off).

    Returns:
        :class:`TensorParallelRun`.

    Raises:
        ValueError: neither or both of ``load`` / ``model_config``.
        FileExistsError: ``save`` already holds a checkpoint.
        helpers.runner.launch.LaunchError: a rank failed or the job timed out.
    """
    from helpers.runner import launch

    if (load is None) == (model_config is None):
        raise ValueError("pass exactly one of load= (a checkpoint) or model_config= (random initialisation)")
    if save is not None and (Path(save) / checkpointing.TRACKER_FILE).exists():
        raise FileExistsError(f"{save} already holds a checkpoint: choose an empty folder")
    own_tmp = workdir is None
    work = Path(tempfile.mkdtemp(prefix="tp-run-")) if own_tmp else Path(workdir)
    work.mkdir(parents=True, exist_ok=True)
    try:
        args = ["helpers.demos.tensor_parallel_run", "--tp", str(tensor_model_parallel_size), "--seed", str(seed)]
        if load is not None:
            args += ["--load", str(Path(load).resolve())]
        else:
            (work / "model_config.json").write_text(json.dumps(model_config.to_dict()))
            args += ["--init-config", str(work / "model_config.json")]
        logits_path = work / "logits.pt" if tokens is not None else None
        if tokens is not None:
            torch.save(tokens.long(), work / "tokens.pt")
            args += ["--tokens", str(work / "tokens.pt"), "--logits-out", str(logits_path)]
        if save is not None:
            args += ["--save", str(Path(save).resolve())]
        if iteration is not None:
            args += ["--iteration", str(iteration)]
        res = launch.torchrun(args, nproc_per_node=tensor_model_parallel_size, timeout_s=timeout_s, on_line=on_line,
                              env={"CUDA_VISIBLE_DEVICES": ""} if cpu else dict(environment.IEEE_FP32_ENV))
        logits = torch.load(logits_path) if logits_path is not None else None
        saved = checkpointing.iteration_dir(save, checkpointing.latest_iteration(save)) if save is not None else None
        return TensorParallelRun(logits, saved, res.wall_seconds)
    finally:
        if own_tmp:
            shutil.rmtree(work, ignore_errors=True)


def main(argv: list[str] | None = None) -> int:
    """The worker every torchrun rank of :func:`run_tensor_parallel` runs.

    Returns:
        0 (an error raises, and torchrun reports the failed rank).
    """
    import torch.distributed as dist
    from megatron.core import parallel_state

    from helpers.support import run_guard
    from helpers.learn.distributed import destroy_distributed, initialize_distributed

    run_guard.checkpoint_queue_in_process()

    parser = argparse.ArgumentParser(prog="python -m helpers.demos.tensor_parallel_run")
    for name, kind in (("--tp", int), ("--load", str), ("--init-config", str), ("--tokens", str),
                       ("--logits-out", str), ("--save", str), ("--iteration", int), ("--seed", int)):
        parser.add_argument(name, type=kind, default=None)
    args = parser.parse_args(argv)
    initialize_distributed(args.tp, 1, args.seed if args.seed is not None else 1234)
    if args.load:
        model, meta = checkpointing.load_model(args.load)
        iteration = args.iteration if args.iteration is not None else checkpointing.latest_iteration(args.load)
    else:
        meta = ModelConfig.from_dict(json.loads(Path(args.init_config).read_text())).to_metadata(args.tp)
        model, iteration = checkpointing.model_from_checkpoint(meta), args.iteration or 0
    rank = dist.get_rank()
    if args.tokens:
        tokens = torch.load(args.tokens).long()
        position_ids = torch.arange(tokens.shape[1]).unsqueeze(0).expand_as(tokens)
        with torch.no_grad():
            local = model(tokens, position_ids, None).float().contiguous()
        # Each rank holds a vocabulary slice [b, s, V_pad / TP]; gather them in rank order, as
        # gather_from_tensor_model_parallel_region does (it allocates on torch.cuda.current_device()).
        parts = [torch.empty_like(local) for _ in range(args.tp)]
        dist.all_gather(parts, local, group=parallel_state.get_tensor_model_parallel_group())
        full = torch.cat(parts, dim=-1)
        if rank == 0:
            torch.save(full, args.logits_out)
        print(f"> rank {rank}: TP={args.tp} local logits {tuple(local.shape)} -> gathered {tuple(full.shape)}", flush=True)
    if args.save:
        cfg = checkpointing.model_config_from_metadata(meta)
        out_meta = {**meta, **cfg.to_metadata(args.tp), "iteration": iteration, "tensor_model_parallel_size": args.tp,
                    "pipeline_model_parallel_size": 1, "data_parallel_size": parallel_state.get_data_parallel_world_size(),
                    "layer_spec": "local", "checkpoint_format": "torch_dist"}
        folder = checkpointing.save_model(model, args.save, iteration, out_meta)
        if rank == 0:
            print(f"> saved TP={args.tp} checkpoint to {folder}", flush=True)
    dist.barrier()
    destroy_distributed()
    return 0


if __name__ == "__main__":
    sys.exit(main())
