"""Pre-train a GPT with Megatron-LM's own training loop: the series' ``pretrain_gpt.py`` (03 §6, 05 §4).

Megatron-LM's script around ``megatron.training.pretrain``, for the series' data, with the same
flags (``helpers.runner.megatron_args.command(cfg)`` writes them)::

    CUDA_DEVICE_MAX_CONNECTIONS=1 torchrun --nproc-per-node 1 -m helpers.learn.pretrain_gpt --num-layers 4 ...

Additions: :mod:`helpers.support.cpu_compat` (CPU shims; on GPU too its prebuilt dataset helpers and
distributed-optimizer resume), every rank reading its own batches, ``dataloader.check_split``
(megatron-core's index builder hangs otherwise), ``rank_record.install()`` (05b) and ``run_guard``.
Sources: Megatron-LM ``pretrain_gpt.py`` (``core_v0.19.0``: ``loss_func``, ``forward_step``,
``train_valid_test_datasets_provider``), ``megatron/training/training.py`` (``pretrain``).
"""

from __future__ import annotations

import time

_PROGRAM_START_TIME = time.time()  # before the heavy imports, as Megatron-LM's script takes it

import os
import sys
from functools import partial
from pathlib import Path

import torch
from megatron.core.datasets.blended_megatron_dataset_builder import BlendedMegatronDatasetBuilder
from megatron.core.datasets.gpt_dataset import GPTDataset, GPTDatasetConfig
from megatron.core.enums import ModelType
from megatron.core.rerun_state_machine import get_rerun_state_machine
from megatron.core.tokenizers.utils.build_tokenizer import build_tokenizer
from megatron.training import get_args, pretrain, print_rank_0, set_startup_timestamps
from megatron.training.argument_utils import gpt_config_from_args, pretrain_cfg_container_from_args
from megatron.training.arguments import parse_and_validate_args
from megatron.training.utils import get_blend_and_blend_per_split
from torch.distributed.elastic.multiprocessing.errors import record

from helpers.learn import checkpointing, dataloader, rank_record
from helpers.support import cpu_compat, run_guard

cpu_compat.apply()  # the one line a CPU needs: megatron-core's and megatron.training's CUDA-only calls (none with CUDA)
cpu_compat.use_prebuilt_dataset_helpers()
cpu_compat.resume_distributed_optimizer()


def loss_func(loss_mask: torch.Tensor, output_tensor: torch.Tensor):
    """The summed LM loss of a micro-batch, its token count, and what the loop logs.

    Args:
        loss_mask: ``[micro_batch, seq]`` fp32, 0 where a token does not count.
        output_tensor: ``[micro_batch, seq]`` fp32 per-token cross-entropy (nats) from ``GPTModel``.

    Returns:
        ``(loss_sum, num_tokens, {"lm loss": [loss_sum, num_tokens]})``: the schedule divides
        ``loss_sum`` by ``num_tokens`` (a per-token mean) before backward; the loop sums the
        report over micro-batches and data-parallel ranks and logs their ratio.

    Raises:
        RuntimeError: the loss is NaN or infinite (``--check-for-nan-in-loss-and-grad``,
            Megatron-LM's rerun state machine).
    """
    losses = output_tensor.view(-1).float()
    mask = loss_mask.view(-1).float()
    loss = torch.sum(losses * mask)
    num_tokens = mask.sum().clone().detach().to(torch.int)
    if get_args().check_for_nan_in_loss_and_grad:
        rerun = get_rerun_state_machine()
        for bad, what in ((torch.isnan, "NaN"), (torch.isinf, "Inf")):
            rerun.validate_result(result=loss, rejection_func=bad, tolerance=0.0, fatal=True,
                                  message=f"found {what} in local forward loss calculation")
    return loss, num_tokens, {"lm loss": torch.cat([loss.clone().detach().view(1), num_tokens.view(1)])}


def forward_step(data_iterator, model):
    """One micro-batch through the model: Megatron's ``forward_step(data_iterator, model)``.

    Returns:
        ``(output_tensor, loss_function)``: the per-token loss ``[micro_batch, seq]`` on the last
        pipeline stage (hidden states elsewhere) and :func:`loss_func` bound to this batch's mask.
    """
    device = torch.cuda.current_device() if torch.cuda.is_available() else "cpu"
    batch = {k: v.to(device) for k, v in next(data_iterator).items() if torch.is_tensor(v)}
    output = model(batch["tokens"], batch["position_ids"], None, labels=batch["labels"])
    return output, partial(loss_func, batch["loss_mask"])


def train_valid_test_datasets_provider(train_val_test_num_samples, vp_stage=None):
    """megatron-core ``GPTDataset`` s over ``--data-path``, split by ``--split``.

    Args:
        train_val_test_num_samples: samples each split must provide, from the loop
            (``train_iters x global_batch_size``; ``eval_iters x global_batch_size`` per evaluation).

    Returns:
        ``(train, valid, test)``; a part whose ``--split`` weight is 0 is ``None``.
    """
    args = get_args()
    blend, blend_per_split = get_blend_and_blend_per_split(args)
    config = GPTDatasetConfig(
        random_seed=args.seed, sequence_length=args.seq_length, blend=blend, blend_per_split=blend_per_split,
        split=args.split, path_to_cache=args.data_cache_path, tokenizer=build_tokenizer(args),
        reset_position_ids=args.reset_position_ids, reset_attention_mask=args.reset_attention_mask,
        eod_mask_loss=args.eod_mask_loss, create_attention_mask=False, mmap_bin_files=args.mmap_bin_files,
        mid_level_dataset_surplus=args.mid_level_dataset_surplus,
    )
    print_rank_0("> building train, validation, and test datasets for GPT ...")
    return BlendedMegatronDatasetBuilder(GPTDataset, train_val_test_num_samples, lambda: True, config).build()


train_valid_test_datasets_provider.is_distributed = True  # every rank builds (and reads) its datasets


def _check_split(args) -> None:
    """Refuse a ``--split`` that leaves a part without documents (megatron-core would hang)."""
    if args.data_path and len(args.data_path) == 1 and args.split:
        prefix = args.data_path[0]
        if Path(prefix + ".idx").exists():
            dataloader.check_split(dataloader._sequence_lengths(prefix), args.split)


@record
def main() -> int:
    """Parse Megatron-LM's flags from ``sys.argv`` and run ``megatron.training.pretrain``.

    Raises:
        ValueError: ``--split`` leaves a part without documents (named, with a split that works).
        checkpointing.CheckpointReadError: the checkpoint ``--load`` resumes from has a missing or short shard.
        run_guard.RunFolderBusyError: another job trains into the folder above ``--save``.
    """
    main_entry = time.time()
    run_guard.checkpoint_queue_in_process()  # no spawned helper process at the first save
    run_guard.watch_launcher()
    args = parse_and_validate_args(args_defaults={"tokenizer_type": "GPT2BPETokenizer"})
    _check_split(args)
    if args.load and (latest := checkpointing.latest_iteration(args.load)) is not None:  # a whole checkpoint to resume
        checkpointing.check_readable(checkpointing.iteration_dir(args.load, latest))
    full_config = pretrain_cfg_container_from_args(args, gpt_config_from_args(args))
    rank_record.install()  # with SERIES_RANK_RECORD set: each rank's memory and schedule, measured (notebook 05b)
    run_folder = Path(args.save).resolve().parent if args.save else None
    # Megatron-LM's start-up report (timers startup-library-setup, startup-initialize-megatron, ...), as its script asks
    set_startup_timestamps(program_start=_PROGRAM_START_TIME, main_entry=main_entry)
    with run_guard.run_folder_lock(run_folder, enabled=run_folder is not None and int(os.environ.get("RANK", "0")) == 0):
        pretrain(full_config, train_valid_test_datasets_provider, ModelType.encoder_or_decoder, forward_step)
    if torch.distributed.is_initialized():
        # End the process group before the interpreter does: a DP=2 rank once aborted at exit, after its
        # last evaluation, with "terminate called without an active exception" (a joinable C++ thread).
        torch.distributed.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
