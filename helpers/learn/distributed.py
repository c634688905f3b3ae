"""The process groups every megatron-core program starts with, in one or many processes.

:func:`initialize_distributed` is what Megatron-LM's ``initialize_megatron`` does for the series:
``torch.distributed`` (NCCL on GPUs, gloo on a CPU with :mod:`helpers.support.cpu_compat`'s shims),
megatron-core's model-parallel groups and the seeded RNG streams. Notebook 03 (section 5.2)
writes the same calls out in cells; the training script, the checkpoint loader and the
converter call this function. :func:`single_process` is the same for one block of a notebook
(world size 1), torn down afterwards: the dataset builder, the benchmarks and the converter's
TP=1 models use it. This is the series' one implementation of a process group.

Sources: Megatron-LM ``megatron/training/initialize.py`` (``_initialize_distributed``,
``_set_random_seed``); megatron-core ``parallel_state.py``, ``tensor_parallel/random.py``.
"""

from __future__ import annotations

import contextlib
import os
from typing import Iterator


def initialize_distributed(tensor_model_parallel_size: int = 1, pipeline_model_parallel_size: int = 1,
                           seed: int = 1234) -> dict[str, int]:
    """Process group, megatron-core model-parallel groups and seeded RNGs, as pretrain_gpt does.

    Uses torchrun's ``RANK``/``WORLD_SIZE``/``LOCAL_RANK``/``MASTER_*``; without them one process
    (an in-memory ``HashStore``, no port). NCCL with CUDA, gloo on CPU (with the
    :mod:`helpers.support.cpu_compat` shims). Seeds ``seed + 100 * pp_rank`` as Megatron-LM's
    ``_set_random_seed``. Existing groups of the same TP x PP are reused, RNGs left as they are.

    Returns:
        ``{"rank", "world_size", "tp", "pp", "dp", "tp_rank", "pp_rank", "dp_rank"}``.

    Raises:
        ValueError: world size not divisible by TP x PP, or this process already runs
            megatron-core with another TP x PP.
    """
    import random

    import numpy as np
    import torch
    import torch.distributed as dist

    from helpers.support import cpu_compat, run_guard

    cpu_compat.apply()
    run_guard.checkpoint_queue_in_process()  # a save starts no helper process that could outlive this one
    under_torchrun = "RANK" in os.environ
    world_size = int(os.environ.get("WORLD_SIZE", "1")) if under_torchrun else 1
    mp = tensor_model_parallel_size * pipeline_model_parallel_size
    if world_size % mp:
        raise ValueError(
            f"{world_size} processes cannot hold tensor_model_parallel_size x pipeline_model_parallel_size "
            f"= {mp}: launch a multiple of {mp} processes (--nproc_per_node)"
        )
    if not dist.is_initialized():
        if torch.cuda.is_available():
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
        backend = "nccl" if torch.cuda.is_available() else "gloo"
        if under_torchrun:
            dist.init_process_group(backend)
        else:  # one process; leave os.environ alone so child processes do not inherit a rendezvous
            dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1)
    from megatron.core import parallel_state, tensor_parallel

    if parallel_state.model_parallel_is_initialized():
        have = (parallel_state.get_tensor_model_parallel_world_size(),
                parallel_state.get_pipeline_model_parallel_world_size())
        if have != (tensor_model_parallel_size, pipeline_model_parallel_size):
            raise ValueError(
                f"this process already runs megatron-core with TP={have[0]}, PP={have[1]}: call "
                "destroy_distributed() first, or use a fresh process for "
                f"TP={tensor_model_parallel_size}, PP={pipeline_model_parallel_size}")
        pp_rank = parallel_state.get_pipeline_model_parallel_rank()
    else:
        parallel_state.initialize_model_parallel(tensor_model_parallel_size, pipeline_model_parallel_size)
        pp_rank = parallel_state.get_pipeline_model_parallel_rank()
        stream_seed = seed + 100 * pp_rank
        random.seed(stream_seed)
        np.random.seed(stream_seed)
        torch.manual_seed(stream_seed)
        tensor_parallel.model_parallel_cuda_manual_seed(stream_seed, force_reset_rng=True)
    return {
        "rank": dist.get_rank(), "world_size": world_size,
        "tp": tensor_model_parallel_size, "pp": pipeline_model_parallel_size,
        "dp": parallel_state.get_data_parallel_world_size(),
        "tp_rank": parallel_state.get_tensor_model_parallel_rank(), "pp_rank": pp_rank,
        "dp_rank": parallel_state.get_data_parallel_rank(),
    }


def destroy_distributed() -> None:
    """Tear down megatron-core's groups and the process group (safe to call twice)."""
    import torch.distributed as dist
    from megatron.core import parallel_state

    parallel_state.destroy_model_parallel()
    if dist.is_initialized():
        dist.destroy_process_group()


@contextlib.contextmanager
def single_process(seed: int = 1234) -> Iterator[dict[str, int]]:
    """:func:`initialize_distributed` (world size 1, TP = PP = 1) for the duration of a block.

    Whatever this block set up (the process group, the model-parallel groups) is torn down on
    exit; what existed before is used as is and kept. Blended datasets need a process group
    (``blended_dataset.py`` calls ``torch.distributed.get_rank()``); building a ``GPTModel``
    needs the model-parallel groups and the RNG tracker.

    Yields:
        The dict of :func:`initialize_distributed`.

    Raises:
        RuntimeError: ``torch.distributed`` already runs with a world size above 1.
    """
    import torch.distributed as dist
    from megatron.core import parallel_state

    had_group = dist.is_initialized()
    if had_group and dist.get_world_size() != 1:
        raise RuntimeError(f"torch.distributed already runs with world size {dist.get_world_size()}: "
                           "use that job's groups instead of single_process()")
    had_mp = parallel_state.model_parallel_is_initialized()
    try:
        yield initialize_distributed(1, 1, seed)
    finally:
        if not had_mp:
            parallel_state.destroy_model_parallel()
        if not had_group and dist.is_initialized():
            dist.destroy_process_group()
