"""A checkpoint in Megatron-LM's own legacy layout, written from the series' model (notebook 06, section 10).

Notebook 06 writes its trained weights as ``iter_NNNNNNN/mp_rank_XX/model_optim_rng.pt`` and converts
them back with :mod:`helpers.learn.megatron_lm`, which must give the same transformers model.

Layout and names: Megatron-LM ``megatron/training/checkpointing.py`` (``get_checkpoint_name``;
``save_checkpoint`` / ``generate_state_dict``: ``args``, ``checkpoint_version``, ``iteration``, ``model``,
``optimizer``, ``rng_state``), the legacy model's nested state dict (the removed
``megatron/legacy/model/language_model.py`` and ``transformer.py``: ``language_model.embedding.word_embeddings``,
``encoder.layers.N.self_attention.query_key_value``...), the argument names of ``megatron/training/arguments.py``.
"""

from __future__ import annotations

import argparse
import re
import signal

import torch

from helpers.learn import megatron_lm
from helpers.learn import model as model_lib

WE = "embedding.word_embeddings.weight"
#: megatron-core local-spec layer names -> the legacy Megatron-LM model's (inverse of what the reader maps).
OLD_LAYER_NAMES = {"input_layernorm": "input_layernorm", "self_attention.linear_qkv": "self_attention.query_key_value",
                   "self_attention.linear_proj": "self_attention.dense", "pre_mlp_layernorm": "post_attention_layernorm",
                   "mlp.linear_fc1": "mlp.dense_h_to_4h", "mlp.linear_fc2": "mlp.dense_4h_to_h"}


def mlm_args(cfg: model_lib.ModelConfig, tok_dir, tp: int = 1, era: str = "now", **overrides) -> argparse.Namespace:
    """The ``args`` Megatron-LM saves with a checkpoint of ``cfg`` (names of ``megatron/training/arguments.py``).

    Args:
        cfg: the model; ``tok_dir``: the tokenizer folder (``Path``; ``vocab_file`` and ``merge_file``
            point into it, as the guide's ``--vocab-file``/``--merge-file`` did).
        tp: tensor-parallel size (``padded_vocab_size`` is padded for it).
        era: ``"2022"`` (the guide's Megatron-LM) or ``"now"`` (adds the arguments added since, from
            ``cfg``: ``position_embedding_type``, ``normalization``, ``swiglu``, ``num_query_groups``...).
        overrides: any argument, e.g. ``position_embedding_type="rope"`` for a model GPT-2 cannot express.

    Returns:
        ``argparse.Namespace``, pickled into the checkpoint as Megatron-LM does.
    """
    from megatron.core.enums import ModelType
    from megatron.core.transformer.enums import AttnBackend

    a = dict(num_layers=cfg.num_layers, hidden_size=cfg.hidden_size, ffn_hidden_size=cfg.ffn_size,
             num_attention_heads=cfg.num_attention_heads, kv_channels=cfg.hidden_size // cfg.num_attention_heads,
             seq_length=cfg.seq_length, max_position_embeddings=cfg.max_position_embeddings,
             padded_vocab_size=cfg.padded_vocab_size(tp), make_vocab_size_divisible_by=128, vocab_size=None,
             tensor_model_parallel_size=tp, pipeline_model_parallel_size=1,
             untie_embeddings_and_output_weights=not cfg.share_embeddings_and_output_weights,
             layernorm_epsilon=cfg.layernorm_epsilon, hidden_dropout=cfg.hidden_dropout, attention_dropout=cfg.attention_dropout,
             init_method_std=cfg.init_method_std,
             bias_gelu_fusion=cfg.bias_activation_fusion, openai_gelu=False, onnx_safe=None,
             apply_query_key_layer_scaling=True, fp16=False, bf16=False, params_dtype=torch.float32,
             tokenizer_type="GPT2BPETokenizer", vocab_file=str(tok_dir / "vocab.json"),
             merge_file=str(tok_dir / "merges.txt"), micro_batch_size=4, global_batch_size=8, lr=5e-4,
             exit_signal=signal.SIGTERM, data_path=["codeparrot_content_document"], iteration=5)
    if era == "now":  # arguments that did not exist in 2022, as cfg sets them (GPT-2's, or a Llama's)
        gqa = cfg.num_query_groups not in (None, cfg.num_attention_heads)
        a.update(position_embedding_type=cfg.position_embedding_type, normalization=cfg.normalization, swiglu=cfg.swiglu,
                 add_bias_linear=cfg.add_bias_linear, group_query_attention=gqa,
                 num_query_groups=cfg.query_groups if gqa else 1, rotary_base=cfg.rotary_base, num_experts=None,
                 transformer_impl="transformer_engine", ckpt_format="torch", attention_backend=AttnBackend.auto,
                 model_type=ModelType.encoder_or_decoder)
    a.update(overrides)
    return argparse.Namespace(**a)


def qkv_in_version(t: torch.Tensor, version: float, heads: int) -> torch.Tensor:
    """Today's ``[heads, 3, d]`` QKV rows as ``checkpoint_version`` 0 (``[3, heads, d]``) or 1.0
    (``[heads, d, 3]``) stored them (Megatron-LM ``fix_query_key_value_ordering`` undoes it).

    ``t``: ``linear_qkv`` weight ``[3h, h]`` or bias ``[3h]`` of one TP rank; ``heads``: that rank's heads.
    """
    d = t.shape[0] // (3 * heads)
    x = t.reshape(heads, 3, d, *t.shape[1:])
    x = x.transpose(0, 1) if version == 0 else x.transpose(1, 2) if version == 1.0 else x
    return x.reshape(t.shape).contiguous()


def old_model_dict(sd: dict, version: float, heads: int) -> dict:
    """A megatron-core local-spec state dict (TP=1, or one rank's shard) as the legacy model's nested
    ``state_dict_for_save_checkpoint``: ``{"language_model": {"embedding": ..., "encoder": ...}}``
    (version 0: its oldest names, ``transformer`` and ``attention``), QKV rows in ``version``'s order."""
    block, attention = ("transformer", "attention") if version == 0 else ("encoder", "self_attention")
    encoder: dict = {}
    lm = {"embedding": {"word_embeddings": {"weight": sd[WE]},
                        "position_embeddings": {"weight": sd["embedding.position_embeddings.weight"]}}, block: encoder}
    for key, value in sd.items():
        if m := re.match(r"^decoder\.layers\.(\d+)\.(.+)\.(weight|bias)$", key):
            name = OLD_LAYER_NAMES[m[2]].replace("self_attention", attention)
            if m[2] == "self_attention.linear_qkv":
                value = qkv_in_version(value, version, heads)
            encoder[f"layers.{m[1]}.{name}.{m[3]}"] = value
        elif key.startswith("decoder.final_layernorm."):
            encoder[key.replace("decoder.", "")] = value
        elif key == "output_layer.weight":
            lm["output_layer"] = {"weight": value}
    return {"language_model": lm}


def write_legacy(save_dir, shards: list[dict], args, version: float = 3.0, iteration: int = 5, folder: str | None = None):
    """Write ``save_dir/iter_NNNNNNN/mp_rank_XX/model_optim_rng.pt`` (one per entry of ``shards``, a
    model state dict per TP rank) and ``latest_checkpointed_iteration.txt``, as Megatron-LM's
    ``save_checkpoint`` does, with placeholder optimizer, scheduler and RNG states.

    ``folder="release"`` writes a ``release`` folder and tracker instead. Returns ``save_dir``.
    Raises ``FileExistsError`` when a rank's folder exists already.
    """
    import numpy as np

    name = folder or f"iter_{iteration:07d}"
    for rank, model in enumerate(shards):
        path = save_dir / name / f"mp_rank_{rank:02d}" / megatron_lm.MODEL_FILE
        path.parent.mkdir(parents=True)
        torch.save({"args": args, "checkpoint_version": version, "iteration": iteration, "model": model,
                    "optimizer": {"optimizer": {"state": {}, "param_groups": [{"lr": 5e-4}]}},
                    "opt_param_scheduler": {"num_steps": 40}, "num_floating_point_operations_so_far": 1.5e12,
                    "rng_state": [{"random_rng_state": (3, tuple(range(5)), None), "np_rng_state": np.random.get_state(),
                                   "torch_rng_state": torch.get_rng_state()}]}, path)
    (save_dir / "latest_checkpointed_iteration.txt").write_text("release" if folder == "release" else str(iteration))
    return save_dir
