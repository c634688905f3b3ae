"""Notebook 06 sections 12-13: the way back, transformers -> megatron-core checkpoint, and training on.

:func:`hf_to_megatron_checkpoint` writes a ``GPT2LMHeadModel`` or ``LlamaForCausalLM`` folder as a
torch_dist checkpoint; :func:`continuation_config` is the ``TrainingConfig`` whose Megatron-LM run starts
from it (``--pretrained-checkpoint``: the weights, a fresh optimizer, iteration 0). Command line::

    python -m helpers.demos.conversion_way_back HF_DIR CHECKPOINT_DIR [--iteration N] [--overwrite]

Sources: Megatron-LM ``tools/checkpoint/saver_mcore.py`` (vocabulary padding repeats the last
row), ``megatron/training/checkpointing.py`` (the layout); transformers ``models/gpt2/configuration_gpt2.py``,
``models/llama/configuration_llama.py``.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
from functools import partial
from pathlib import Path

from helpers.learn import checkpointing, conversion, llama
from helpers.support.environment import package_version
from helpers.learn.model import ARCHITECTURES, ModelConfig

#: transformers activation names back to the GELU they compute.
_HF_GELU = {"gelu": "erf", "gelu_new": "tanh", "gelu_pytorch_tanh": "tanh", "gelu_fast": "tanh"}
#: ModelConfig metadata that must agree between a transformers model and a training config.
_MATCH_KEYS = ("architecture", "num_layers", "hidden_size", "num_attention_heads", "num_query_groups", "ffn_hidden_size",
               "max_position_embeddings", "vocab_size", "padded_vocab_size", "gelu", "layernorm_epsilon",
               "tied_embeddings", "rotary_base")


def _model_config_from_gpt2(config, *, make_vocab_size_divisible_by: int = 128, seq_length: int | None = None) -> ModelConfig:
    """The :class:`~helpers.learn.model.ModelConfig` of a transformers ``GPT2Config``.

    Raises:
        helpers.learn.conversion.ConversionError: settings megatron-core's GPT-2 path does not compute
            the same way (``scale_attn_by_inverse_layer_idx``, ``reorder_and_upcast_attn``,
            cross-attention, unscaled attention, a non-GELU activation).
    """
    problems = []
    if config.activation_function not in _HF_GELU:
        problems.append(f"activation_function={config.activation_function!r} (expected one of {sorted(_HF_GELU)})")
    for name, bad in (("scale_attn_by_inverse_layer_idx", True), ("reorder_and_upcast_attn", True),
                      ("add_cross_attention", True), ("scale_attn_weights", False)):
        if getattr(config, name, not bad) == bad:
            problems.append(f"{name}={bad}")
    if problems:
        raise conversion.ConversionError(f"GPT2Config settings megatron-core's GPTModel does not compute: {problems}")
    return ModelConfig(
        num_layers=config.n_layer, hidden_size=config.n_embd, num_attention_heads=config.n_head,
        seq_length=seq_length or config.n_positions, max_position_embeddings=config.n_positions,
        vocab_size=config.vocab_size, ffn_hidden_size=None if config.n_inner in (None, 4 * config.n_embd) else config.n_inner,
        make_vocab_size_divisible_by=make_vocab_size_divisible_by, hidden_dropout=config.resid_pdrop,
        attention_dropout=config.attn_pdrop, init_method_std=config.initializer_range,
        layernorm_epsilon=config.layer_norm_epsilon, bias_activation_fusion=_HF_GELU[config.activation_function] == "tanh",
        share_embeddings_and_output_weights=bool(getattr(config, "tie_word_embeddings", True)),
    )


def _model_config_from_llama(config, *, make_vocab_size_divisible_by: int = 128, seq_length: int | None = None) -> ModelConfig:
    """The :class:`~helpers.learn.model.ModelConfig` of a transformers ``LlamaConfig``.

    Raises:
        helpers.learn.conversion.ConversionError: what megatron-core's Llama path here does not compute
            (an activation other than SiLU, attention or MLP biases, RoPE scaling, a head size other than
            ``hidden_size / heads``).
    """
    problems = [f"{name}={getattr(config, name, None)!r}" for name, ok in (
        ("hidden_act", config.hidden_act == "silu"), ("attention_bias", not config.attention_bias),
        ("mlp_bias", not getattr(config, "mlp_bias", False)),
        ("rope_scaling", (getattr(config, "rope_scaling", None) or {}).get("rope_type", "default") == "default"),
        ("head_dim", getattr(config, "head_dim", None) in (None, config.hidden_size // config.num_attention_heads))) if not ok]
    if problems:
        raise conversion.ConversionError(f"LlamaConfig settings megatron-core's Llama here does not compute: {problems}")
    theta = getattr(config, "rope_theta", None) or (getattr(config, "rope_parameters", None) or {}).get("rope_theta", 10000)
    heads, groups = config.num_attention_heads, config.num_key_value_heads or config.num_attention_heads
    return ModelConfig(
        num_layers=config.num_hidden_layers, hidden_size=config.hidden_size, num_attention_heads=heads,
        num_query_groups=groups if groups != heads else None, seq_length=seq_length or config.max_position_embeddings,
        max_position_embeddings=config.max_position_embeddings, vocab_size=config.vocab_size,
        ffn_hidden_size=config.intermediate_size, make_vocab_size_divisible_by=make_vocab_size_divisible_by,
        attention_dropout=config.attention_dropout, init_method_std=config.initializer_range,
        layernorm_epsilon=config.rms_norm_eps, rotary_base=int(theta),
        share_embeddings_and_output_weights=bool(config.tie_word_embeddings), **ARCHITECTURES["llama"])


def hf_to_megatron_checkpoint(hf_dir: str | os.PathLike, checkpoint_dir: str | os.PathLike, *,
                              training_config=None, iteration: int = 0, overwrite: bool = False,
                              make_vocab_size_divisible_by: int = 128) -> Path:
    """Write a transformers GPT-2 or Llama folder as a megatron-core torch_dist checkpoint (TP=1).

    Megatron's layout (``iter_NNNNNNN/``, ``latest_checkpointed_iteration.txt``), the model only, with a
    ``model_config.json`` (no Megatron-LM ``args``); Megatron-LM's loop starts from it with
    ``--pretrained-checkpoint`` (:func:`continuation_config`). Must run where the main module is
    import-guarded (a notebook, pytest, ``python -m``): the torch_dist writer spawns a process.

    Args:
        hf_dir: ``config.json`` + weights of a ``GPT2LMHeadModel`` or ``LlamaForCausalLM`` (+ its tokenizer).
        training_config: optional ``TrainingConfig`` whose ``model`` must equal the converted one
            (checked before anything is written).

    Returns:
        The ``iter_NNNNNNN`` folder.

    Raises:
        FileExistsError: ``checkpoint_dir`` already holds a checkpoint and ``overwrite`` is False.
        helpers.learn.conversion.ConversionError: neither a GPT-2 nor a Llama, unknown/missing keys, or a training
            config whose model differs.
    """
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    ckpt_dir = Path(checkpoint_dir).expanduser().resolve()
    if (ckpt_dir / checkpointing.TRACKER_FILE).exists() and not overwrite:
        raise FileExistsError(f"{ckpt_dir} already holds a checkpoint: pass overwrite=True or another checkpoint_dir")
    config = AutoConfig.from_pretrained(str(hf_dir))
    readers = {"gpt2": _model_config_from_gpt2, "llama": _model_config_from_llama}
    if config.model_type not in readers:
        raise conversion.ConversionError(f"{hf_dir} holds a {config.model_type!r} model; only GPT-2 (GPT2LMHeadModel) "
                                         "and Llama (LlamaForCausalLM) are supported")
    seq = training_config.model.seq_length if training_config is not None else None
    cfg = readers[config.model_type](config, make_vocab_size_divisible_by=make_vocab_size_divisible_by, seq_length=seq)
    if training_config is not None:
        want, have = training_config.model.to_metadata(1), cfg.to_metadata(1)
        diffs = [f"{k}: training {want[k]!r} vs transformers {have[k]!r}" for k in _MATCH_KEYS if want[k] != have[k]]
        if diffs:
            raise conversion.ConversionError(f"training_config.model does not describe the transformers model in {hf_dir}: {diffs}")
        cfg = training_config.model
    hf = AutoModelForCausalLM.from_pretrained(str(hf_dir), dtype=torch.float32)
    to_megatron = (partial(llama.llama_to_megatron_state_dict, num_query_groups=cfg.query_groups)
                   if config.model_type == "llama" else conversion.hf_to_megatron_state_dict)
    sd = to_megatron(hf.state_dict(), cfg.num_attention_heads, padded_vocab_size=cfg.padded_vocab_size(1),
                     tied=cfg.share_embeddings_and_output_weights)
    meta = {**cfg.to_metadata(1), "iteration": iteration, "consumed_train_samples": 0,
            "tensor_model_parallel_size": 1, "pipeline_model_parallel_size": 1, "data_parallel_size": 1,
            "precision": "fp32", "layer_spec": "local", "checkpoint_format": "torch_dist",
            "megatron_core_version": package_version("megatron-core"), "converted_from": str(Path(hf_dir).resolve())}
    model = checkpointing.model_from_checkpoint(meta, sd)
    if (Path(hf_dir) / "vocab.json").is_file():
        meta["tokenizer_dir"] = str(Path(hf_dir).resolve())
    if training_config is not None:
        meta["tokenizer_dir"] = str(training_config.tokenizer_path)
    meta["model_only"] = True
    if overwrite and ckpt_dir.exists():
        shutil.rmtree(ckpt_dir)
    return checkpointing.save_model(model, ckpt_dir, iteration, meta)


def continuation_config(run_dir: str | os.PathLike, out_dir: str | os.PathLike, train_iters: int, *,
                        pretrained_checkpoint: str | os.PathLike | None = None, config_name: str = "run.json"):
    """A ``TrainingConfig`` that continues the run of ``run_dir`` for ``train_iters`` iterations in ``out_dir``.

    Same model, data, batch sizes and validation split as the original run; a constant
    learning rate equal to its ``min_lr`` (where its cosine ended); outputs (checkpoints,
    metrics, TensorBoard) in ``out_dir``; the weights of ``pretrained_checkpoint`` (default
    ``{out_dir}/from_transformers``, where :func:`hf_to_megatron_checkpoint` writes them) as
    the start (Megatron-LM's ``--pretrained-checkpoint``).

    Raises:
        FileNotFoundError: no ``run.json`` in ``run_dir``.
        ValueError: ``train_iters`` < 1.
    """
    from dataclasses import replace

    from helpers.learn.training_config import TrainingConfig

    if train_iters < 1:
        raise ValueError(f"train_iters={train_iters} must be >= 1")
    cfg_path = Path(run_dir).expanduser().resolve() / config_name
    if not cfg_path.is_file():
        raise FileNotFoundError(f"{cfg_path} not found: it is written by helpers.runner.launch.train (notebook 03)")
    cfg = TrainingConfig.from_json(cfg_path)
    lr = cfg.min_lr if cfg.min_lr > 0 else cfg.lr * 0.1
    out = Path(out_dir).expanduser().resolve()
    start = Path(pretrained_checkpoint).expanduser().resolve() if pretrained_checkpoint else out / "from_transformers"
    return replace(cfg, run_dir=str(out), pretrained_checkpoint=str(start), data_prefix=str(cfg.data_prefix_path),
                   tokenizer_dir=str(cfg.tokenizer_path), train_iters=train_iters, lr=lr, min_lr=lr, lr_warmup_iters=0,
                   lr_decay_iters=train_iters, lr_decay_style="constant", eval_interval=train_iters,
                   save_interval=train_iters, log_interval=max(1, min(cfg.log_interval, train_iters)), exit_interval=None,
                   checkpoint_dir=None, tensorboard_dir=None, metrics_path=None)


def main(argv: list[str] | None = None) -> int:
    """``python -m helpers.demos.conversion_way_back HF_DIR CHECKPOINT_DIR`` (model only).

    Returns:
        0 on success, 2 on a conversion error (printed to stderr).
    """
    parser = argparse.ArgumentParser(prog="python -m helpers.demos.conversion_way_back",
                                     description="transformers GPT-2 or Llama folder -> megatron-core checkpoint (model only)")
    parser.add_argument("hf_dir")
    parser.add_argument("checkpoint_dir")
    parser.add_argument("--iteration", type=int, default=0)
    parser.add_argument("--overwrite", action="store_true")
    args = parser.parse_args(argv)
    from helpers.support import run_guard

    run_guard.checkpoint_queue_in_process()
    try:
        print(f"wrote {hf_to_megatron_checkpoint(args.hf_dir, args.checkpoint_dir, iteration=args.iteration, overwrite=args.overwrite)}")
    except (conversion.ConversionError, FileExistsError, FileNotFoundError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
