"""Pre-train a GPT with Megatron-LM's own training loop: the series' ``pretrain_gpt.py``.

Megatron-LM's ``pretrain_gpt.py`` is a short script around ``megatron.training.pretrain``, the
training loop that parses Megatron-LM's command-line flags, initialises the process groups,
builds the model, the optimizer and the learning-rate schedule, and then trains, evaluates,
logs, checks for NaN, saves, resumes and exits on a signal. The megatron-core wheel the series
installs ships that loop (``megatron/training``); only the script lives in the Megatron-LM
repository. This is the script, for the series' data, with the same flags::

    CUDA_DEVICE_MAX_CONNECTIONS=1 torchrun --nproc-per-node 1 -m helpers.learn.pretrain_gpt \\
        --num-layers 4 --hidden-size 192 --num-attention-heads 4 ... --data-path RUN/data/codeparrot_content_document

``helpers.runner.megatron_args.command(cfg)`` writes that command from a run's configuration; the
same flags run Megatron-LM's ``pretrain_gpt.py`` in the NGC container
(``torchrun --nproc-per-node 8 pretrain_gpt.py ...``).

What it adds to Megatron-LM's script, and why:

* ``cpu_compat.apply()``: the one line a CPU run needs. Megatron-LM asserts CUDA, allocates on
  ``device='cuda'`` and synchronises CUDA streams in about 50 places; the shims send those to
  the CPU (each is named, file and line, in :mod:`helpers.support.cpu_compat`). With CUDA it does nothing.
* ``cpu_compat.use_prebuilt_dataset_helpers()``: the wheel's dataset helpers are prebuilt, but
  ``initialize_megatron`` runs ``make`` for them and exits when that fails (GPU too).
* ``cpu_compat.resume_distributed_optimizer()``: a ``--use-distributed-optimizer`` run resumes
  (megatron-core's distributed optimizer fails to load with torch's AdamW, and in fp32; GPU too).
* Every rank reads its own batches: ``pretrain_gpt.py`` builds the datasets on tensor-parallel
  rank 0 and broadcasts each batch as CUDA tensors (``get_batch_on_this_tp_rank``); here each
  rank reads the same samples from the memory-mapped ``.bin/.idx`` itself.
* A known hang guarded before anything starts: a ``--split`` that leaves a part without
  documents makes megatron-core's index builder loop forever (``dataloader.check_split``).
* ``rank_record.install()``: with ``SERIES_RANK_RECORD=<folder>`` in the environment, each rank
  writes what it held (weights, gradients, optimizer state, the activations saved for backward)
  and when it ran each micro-batch's forward and backward (notebook 05b); unset, nothing changes.
* What a notebook's launch needs (``helpers.support.run_guard``): the job stops when its launcher dies,
  one job at a time per run folder, and checkpoints are written through a forked queue.

Sources: Megatron-LM ``pretrain_gpt.py`` (``core_v0.19.0``: ``loss_func``, ``forward_step``,
``train_valid_test_datasets_provider``, ``__main__``), ``megatron/training/training.py``
(``pretrain``), ``megatron/training/argument_utils.py`` (``gpt_config_from_args``).
"""

from __future__ import annotations

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
from megatron.training import get_args, pretrain, print_rank_0
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
    run_guard.checkpoint_queue_in_process()  # no spawned helper process at the first save
    run_guard.watch_launcher()
    args = parse_and_validate_args(args_defaults={"tokenizer_type": "GPT2BPETokenizer"})
    _check_split(args)
    if args.load and (latest := checkpointing.latest_iteration(args.load)) is not None:  # a whole checkpoint to resume
        checkpointing.check_readable(checkpointing.iteration_dir(args.load, latest))
    full_config = pretrain_cfg_container_from_args(args, gpt_config_from_args(args))
    rank_record.install()  # with SERIES_RANK_RECORD set: each rank's memory and schedule, measured (notebook 05b)
    run_folder = Path(args.save).resolve().parent if args.save else None
    with run_guard.run_folder_lock(run_folder, enabled=run_folder is not None and int(os.environ.get("RANK", "0")) == 0):
        pretrain(full_config, train_valid_test_datasets_provider, ModelType.encoder_or_decoder, forward_step)
    if torch.distributed.is_initialized():
        # End the process group before the interpreter does: a DP=2 rank once aborted at exit, after its
        # last evaluation, with "terminate called without an active exception" (a joinable C++ thread).
        torch.distributed.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
