"""Megatron-style checkpoints with megatron-core ``dist_checkpointing`` (torch_dist format).

Layout, as Megatron-LM writes it (``megatron/training/checkpointing.py``)::

    checkpoints/latest_checkpointed_iteration.txt   # "300", written atomically after a save
    checkpoints/iter_0000300/                        # torch_dist: *.distcp shards, .metadata, metadata.json

Each tensor is stored with its global shape and offset, so a TP=2 checkpoint loads with TP=1.
:func:`save_model` writes the series' model-only checkpoints, with a ``model_config.json`` beside
the shards (notebooks 03 §8, 05 §8, 06, 07). Sources: Megatron-LM ``megatron/training/checkpointing.py``
(tracker file, ``iter_%07d``), megatron-core ``dist_checkpointing/serialization.py`` (``save``/``load``).
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Any

from helpers.support import results, safe_load
from helpers.learn.megatron_lm import TRACKER_FILE, iteration_dir, iteration_of, latest_iteration  # noqa: F401 (Megatron's layout)

MODEL_CONFIG_FILE = "model_config.json"
#: Keys of a checkpoint that are training state, not the model.
NON_MODEL_KEY_PREFIXES: tuple[str, ...] = ("optimizer.", "rng_state", "opt_param_scheduler")

#: ModelConfig fields that must match to resume: a different value means a different model shape.
SHAPE_KEYS = ("num_layers", "hidden_size", "num_attention_heads", "ffn_hidden_size",
              "max_position_embeddings", "padded_vocab_size", "tied_embeddings", "gelu", "num_experts")


class CheckpointMismatchError(ValueError):
    """The checkpoint in the folder was written for a different model; it is left untouched."""


class CheckpointReadError(RuntimeError):
    """A checkpoint folder could not be read (damaged shard, missing keys); it is left untouched."""


def read_model_config(checkpoint_dir: str | os.PathLike, iteration: int | None = None) -> dict[str, Any]:
    """The model a checkpoint holds, as ``ModelConfig.to_metadata()`` (latest iteration by default).

    A ``model_config.json`` beside the shards (the series' own saves) is read when present; else the
    ``args`` of Megatron-LM's loop (``helpers.learn.megatron_lm.metadata_from_args``), with the
    vocabulary size from the ``--tokenizer-model`` tokenizer.

    Returns:
        ``ModelConfig.to_metadata()`` of the model that was trained, plus ``iteration``,
        ``tensor_model_parallel_size`` and ``pipeline_model_parallel_size`` (and, for a checkpoint of
        Megatron-LM's loop, ``data_parallel_size``, ``use_distributed_optimizer`` and its optimizer format).

    Raises:
        FileNotFoundError: no checkpoint in ``checkpoint_dir``.
        helpers.learn.megatron_lm.ConversionError: the args describe a model the series cannot build.
    """
    if iteration is None:
        iteration = latest_iteration(checkpoint_dir)
    if iteration is None:
        raise FileNotFoundError(
            f"no checkpoint in {checkpoint_dir} ({TRACKER_FILE} missing): train first (notebook 03)"
        )
    folder = iteration_dir(checkpoint_dir, iteration)
    if (folder / MODEL_CONFIG_FILE).exists():
        return json.loads((folder / MODEL_CONFIG_FILE).read_text())
    from helpers.learn import megatron_lm, tokenizer

    state = megatron_lm.read_common_state(folder)
    meta = megatron_lm.metadata_from_args(state["args"])
    if meta.get("tokenizer_dir") and (Path(meta["tokenizer_dir"]) / "vocab.json").exists():
        meta["vocab_size"] = tokenizer.vocab_size_of(meta["tokenizer_dir"])
    args = megatron_lm._args_dict(state["args"])
    return {**meta, "iteration": int(state.get("iteration", iteration)),
            "consumed_train_samples": args.get("consumed_train_samples"),
            "data_parallel_size": args.get("data_parallel_size"),
            "use_distributed_optimizer": bool(args.get("use_distributed_optimizer")),
            "dist_ckpt_optim_fully_reshardable": bool(args.get("dist_ckpt_optim_fully_reshardable"))}


def check_readable(folder: str | os.PathLike) -> None:
    """Check, without loading a tensor, that every shard of a torch_dist ``iter_NNNNNNN`` folder is whole.

    The folder's ``.metadata`` (torch.distributed.checkpoint's index, read with
    ``helpers.support.safe_load``'s restricted unpickler) records the file, offset and length of every
    stored item; a shard shorter than its last item is a partly copied or damaged file, which
    Megatron-LM's loop would only report as a bare ``EOFError`` deep in its load.

    Raises:
        CheckpointReadError: a missing or short shard, no ``metadata.json``, or an unreadable ``.metadata`` (named, with the fix).
    """
    folder = Path(folder)
    fix = (f"delete {folder.name} and its line in {TRACKER_FILE} (training resumes from the checkpoint before it, "
           "or from scratch), or copy the folder again")
    try:
        storage = safe_load.dcp_reader(folder, True).read_metadata().storage_data
    except (OSError, safe_load.ConversionError) as err:
        raise CheckpointReadError(f"could not read the checkpoint {folder}: {err}. Fix: {fix}") from None
    if not (folder / "metadata.json").is_file():  # dist_checkpointing's description of the format: without it
        # Megatron-LM's load fails after start-up with "Missing key in checkpoint state_dict: args"
        raise CheckpointReadError(f"could not read the checkpoint {folder}: metadata.json is missing. Fix: {fix}")
    needed: dict[str, int] = {}
    for info in storage.values():
        needed[info.relative_path] = max(needed.get(info.relative_path, 0), info.offset + info.length)
    for name, size in sorted(needed.items()):
        have = (folder / name).stat().st_size if (folder / name).exists() else None
        if have is None or have < size:
            raise CheckpointReadError(
                f"could not read the checkpoint {folder}: {name} {'is missing' if have is None else f'holds {have:,} bytes'}, "
                f"its index (.metadata) expects {size:,}: a partly copied or damaged shard. Fix: {fix}")


def check_compatible(saved: dict[str, Any], current: dict[str, Any], checkpoint_dir: str | os.PathLike) -> None:
    """Raise when the checkpoint's model shape differs from the current one.

    Raises:
        CheckpointMismatchError: lists every differing field and the two ways out.
    """
    diffs = [f"{k}: checkpoint {saved.get(k)!r} vs config {current.get(k)!r}"
             for k in SHAPE_KEYS if saved.get(k) != current.get(k)]
    if diffs:
        raise CheckpointMismatchError(
            f"the checkpoint in {checkpoint_dir} was trained with a different model shape "
            f"({'; '.join(diffs)}). It was not loaded and will not be overwritten. Use a new "
            "run_dir (or checkpoint_dir) for this model, or delete that folder to start over."
        )


def check_layout(saved: dict[str, Any], tensor_model_parallel_size: int, pipeline_model_parallel_size: int,
                 use_distributed_optimizer: bool, checkpoint_dir: str | os.PathLike) -> None:
    """Refuse, before any process starts, a resume that Megatron-LM's load would refuse after start-up.

    A ``--use-distributed-optimizer`` checkpoint (format ``dp_reshardable``,
    megatron/core/optimizer/distrib_optimizer.py) reshards over data-parallel ranks only: another TP or
    PP size stops with "(TP, PP) mismatch after resume", and switching the distributed optimizer on or
    off cannot read the other's optimizer state.

    Args:
        saved: :func:`read_model_config` of the checkpoint to resume.
        tensor_model_parallel_size, pipeline_model_parallel_size, use_distributed_optimizer: the new run's.

    Raises:
        CheckpointMismatchError: names both layouts, the cause and the ways out; the checkpoint is untouched.
    """
    if "use_distributed_optimizer" in saved and saved["use_distributed_optimizer"] != use_distributed_optimizer:
        state = "with" if saved["use_distributed_optimizer"] else "without"
        raise CheckpointMismatchError(
            f"the checkpoint in {checkpoint_dir} (iteration {saved.get('iteration')}) holds an optimizer state "
            f"saved {state} the distributed optimizer, and this run asks for use_distributed_optimizer="
            f"{use_distributed_optimizer}. The two store AdamW's moments in different layouts, and Megatron-LM's "
            "load fails after start-up on either change. Nothing was loaded or changed. Fix: resume with "
            f"use_distributed_optimizer={saved['use_distributed_optimizer']}, or use a new run_dir.")
    was = (saved.get("tensor_model_parallel_size", 1), saved.get("pipeline_model_parallel_size", 1))
    now = (tensor_model_parallel_size, pipeline_model_parallel_size)
    if (saved.get("use_distributed_optimizer") and use_distributed_optimizer and was != now
            and not saved.get("dist_ckpt_optim_fully_reshardable")):
        raise CheckpointMismatchError(
            f"the checkpoint in {checkpoint_dir} (iteration {saved.get('iteration')}) was saved by the distributed "
            f"optimizer at TP={was[0]}, PP={was[1]}, and this run asks for TP={now[0]}, PP={now[1]}. Its optimizer "
            "state is in Megatron-LM's default dp_reshardable format, which reshards over data-parallel ranks only, "
            "so Megatron-LM would refuse it after start-up. Nothing was loaded or changed. Fix: resume at "
            f"tensor_model_parallel_size={was[0]}, pipeline_model_parallel_size={was[1]} (any number of processes "
            "that is a multiple of their product), or use a new run_dir for the new layout. Megatron-LM's "
            "--dist-ckpt-optim-fully-reshardable, set when a run saves, writes a format meant to change TP and PP; "
            "the series does not set it.")


# --------------------------------------------------------------------------- RNG states
def save_model(model, checkpoint_dir: str | os.PathLike, iteration: int, model_config: dict[str, Any]) -> Path:
    """Save a ``GPTModel``'s weights (no optimizer) as ``iter_NNNNNNN`` with torch_dist, in Megatron's layout.

    ``model.sharded_state_dict()`` under ``"model"``, as Megatron-LM's ``save_checkpoint`` stores it
    (``--pretrained-checkpoint`` starts from it; any TP/PP layout reads it). Every rank calls this.
    ``model_config.json`` goes next to the shards; rank 0 then updates ``latest_checkpointed_iteration.txt``
    atomically. A half-written folder of the same iteration is removed first, a failed save's after.

    Must run in a process whose main module is import-guarded (a notebook, pytest, ``python -m``):
    megatron-core's torch_dist writer starts a helper process.

    Returns:
        The ``iter_NNNNNNN`` folder.
    """
    state = {"model": model.sharded_state_dict(), "iteration": iteration, "checkpoint_version": 3.0}
    import torch.distributed as dist
    from megatron.core import dist_checkpointing

    folder = iteration_dir(checkpoint_dir, iteration)
    rank = dist.get_rank()
    if rank == 0:
        Path(checkpoint_dir).mkdir(parents=True, exist_ok=True)
        if folder.exists() and latest_iteration(checkpoint_dir) != iteration:
            shutil.rmtree(folder)
        folder.mkdir(parents=True, exist_ok=True)
    dist.barrier()
    try:
        dist_checkpointing.save(state, str(folder))
    except BaseException:
        if rank == 0 and latest_iteration(checkpoint_dir) != iteration:  # cut short (a full disk): not a checkpoint
            shutil.rmtree(folder, ignore_errors=True)
        raise
    dist.barrier()
    if rank == 0:
        results.write_atomic(folder / MODEL_CONFIG_FILE, json.dumps(model_config, indent=2, sort_keys=True) + "\n")
        results.write_atomic(Path(checkpoint_dir) / TRACKER_FILE, f"{iteration}\n")
    dist.barrier()
    return folder


def read_model_tensors(folder: str | os.PathLike) -> tuple[dict[str, Any], list[str]]:
    """Every model tensor of a torch_dist ``iter_NNNNNNN`` folder at its global (merged) shape, in this process.

    ``dist_checkpointing.load_tensors_metadata`` / ``load`` read whole tensors, whatever TP size saved
    them. Stacked keys (``decoder.layers.self_attention.linear_qkv.weight`` ``[layers, 3h, h]``) are
    split into ``decoder.layers.{i}....``; other names stay the checkpoint's. Optimizer and RNG states
    are not read. ``helpers.learn.distributed.single_process`` provides a process group if none exists.

    Returns:
        ``(tensors, non_model_keys)``: ``{name: tensor}`` (``_extra_state`` entries included as
        loaded) and the training-state keys left unread.
    """
    import re

    from megatron.core import dist_checkpointing

    from helpers.learn.distributed import single_process

    with single_process():
        metadata = dist_checkpointing.load_tensors_metadata(str(folder))
        model_keys = {k: v for k, v in metadata.items() if not k.startswith(NON_MODEL_KEY_PREFIXES)}
        loaded = dist_checkpointing.load(model_keys, str(folder), validate_access_integrity=False) if model_keys else {}
    out: dict[str, Any] = {}
    for key in model_keys:  # load() also returns the common (non-sharded) entries: keep what was asked for
        if key.startswith("decoder.layers.") and not re.match(r"^decoder\.layers\.\d+\.", key) \
                and not key.endswith("._extra_state"):
            for i in range(loaded[key].shape[0]):
                out[f"decoder.layers.{i}.{key[len('decoder.layers.'):]}"] = loaded[key][i].clone()
        else:
            out[key] = loaded[key]
    return out, sorted(set(metadata) - set(model_keys))


def model_config_from_metadata(meta: dict[str, Any]):
    """The :class:`~helpers.learn.model.ModelConfig` of a checkpoint's ``model_config.json`` (``ModelConfig.to_metadata()``).

    Extra keys (``padded_vocab_size``, ``gelu``, iteration, parallel sizes...) are ignored.

    Raises:
        ValueError: a required field (layers, hidden size, heads, positions, vocabulary) is missing.
    """
    from helpers.learn.model import ModelConfig

    required = ("num_layers", "hidden_size", "num_attention_heads", "max_position_embeddings", "vocab_size")
    missing = [k for k in required if k not in meta]
    if missing:
        raise ValueError(f"model config lacks {missing}: it must hold ModelConfig.to_metadata() fields")
    return ModelConfig(**{k: v for k, v in meta.items() if k in ModelConfig.__dataclass_fields__})


def model_from_checkpoint(meta: dict[str, Any], weights: str | os.PathLike | dict | None = None, *,
                          seed: int = 1234, layer_spec: str | None = None):
    """The ``GPTModel`` that ``meta`` describes, holding a checkpoint's weights: the series' one way to build it.

    Builds this process's part of the model (its TP/PP layout; a one-process group, TP=PP=1,
    is initialised when none exists, ``helpers.learn.distributed.initialize_distributed``), then:

    ``weights`` is a torch_dist ``iter_NNNNNNN`` folder (``dist_checkpointing.load``, any saved TP size;
    surplus vocabulary rows dropped), a state dict of full TP=1 tensors (``load_state_dict``), or None
    (the seeded random initialisation).

    Args:
        meta: ``model_config.json`` (``ModelConfig.to_metadata()`` and more).
        layer_spec: default ``"local"`` for a state dict or when ``meta`` says so, else ``"auto"``.

    Returns:
        megatron-core ``GPTModel`` in eval mode (fp32; on the current GPU if there is one), with
        ``tokenizer_vocab_size`` = ``meta["vocab_size"]``: ``model(tokens [b, s], position_ids [b, s], None)``
        -> logits ``[b, s, padded_vocab / TP]``.

    Raises:
        ValueError: a weight the source did not provide, or a key the model does not have (listed).
    """
    import torch
    from megatron.core import dist_checkpointing, parallel_state

    from helpers.learn import model as model_lib
    from helpers.learn.distributed import initialize_distributed

    if not parallel_state.model_parallel_is_initialized():
        initialize_distributed(1, 1, seed=seed)
    cfg = model_config_from_metadata(meta)
    spec = layer_spec or ("local" if isinstance(weights, dict) or meta.get("layer_spec") == "local" else "auto")
    gpt = model_lib.build_model(cfg, layer_spec=spec)
    if torch.cuda.is_available():
        gpt.cuda()
    if weights is not None:
        if not isinstance(weights, dict):
            sharded = {k: v for k, v in gpt.sharded_state_dict().items() if not k.endswith("._extra_state")}
            loaded = dist_checkpointing.load(sharded, str(weights))
            weights = {k: loaded[k] for k in sharded}
        result = gpt.load_state_dict(weights, strict=False)
        bad = [k for k in result.missing_keys if not k.endswith("._extra_state")] + list(result.unexpected_keys)
        if bad:
            raise ValueError(f"GPTModel and the weights of {meta.get('iteration', 'the checkpoint')} do not match: "
                             f"missing or unexpected keys {bad}")
    gpt.tokenizer_vocab_size = cfg.vocab_size
    return gpt.eval()


def load_model(checkpoint_dir: str | os.PathLike, iteration: int | None = None, *, seed: int = 1234):
    """Build the GPTModel a checkpoint was trained with and load its weights (model only).

    :func:`model_from_checkpoint` of ``model_config.json`` and the ``iter_NNNNNNN`` folder, in the
    calling process (a one-process group when none exists, so a notebook or a converter can use
    it; under ``torchrun`` with TP/PP the checkpoint is resharded on load).

    Returns:
        ``(gpt_model, metadata)``: megatron-core ``GPTModel`` in eval mode (fp32, CPU or the
        current GPU) and the checkpoint's ``model_config.json``.

    Raises:
        FileNotFoundError: no checkpoint in ``checkpoint_dir``.
    """
    meta = read_model_config(checkpoint_dir, iteration)
    iteration = latest_iteration(checkpoint_dir) if iteration is None else iteration
    return model_from_checkpoint(meta, iteration_dir(checkpoint_dir, iteration), seed=seed), meta
