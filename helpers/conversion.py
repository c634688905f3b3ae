"""megatron-core GPT <-> Hugging Face transformers GPT-2, converted exactly and proven so.

The CodeParrot guide ended with ``transformers``' ``convert_megatron_gpt2_checkpoint.py``.
That script is not in today's transformers wheels and reads the legacy key layout
(``model.language_model.encoder...`` inside ``mp_rank_00/model_optim_rng.pt``), while
megatron-core writes a ``dist_checkpointing`` folder (torch_dist: ``*.distcp`` shards plus
``.metadata``) whose keys are ``embedding.*`` / ``decoder.layers.*``. This module is its
replacement, in both directions:

* **megatron-core -> transformers** (:func:`convert_to_hf`): a torch_dist checkpoint of any
  tensor-model-parallel size (its shards are merged by reading every tensor at its global
  shape, :func:`read_checkpoint_tensors`) or a plain ``model.state_dict()`` becomes a
  ``GPT2LMHeadModel`` folder: ``config.json``, ``model.safetensors``, the training tokenizer's
  files copied byte for byte, a ``generation_config.json`` whose EOS is the EOD token, and
  ``conversion.json`` (where it came from).
* **transformers -> megatron-core** (:func:`hf_to_megatron_checkpoint`): a GPT-2 folder
  becomes a torch_dist checkpoint in this series' layout, with a fresh optimizer, so
  ``helpers.training`` continues pre-training from it.

The mapping (:func:`megatron_to_hf_state_dict`, :func:`hf_to_megatron_state_dict`) is
strict: every source key is used or named as carrying no weights (``_extra_state``), and
an unknown or missing key is an error listing the keys. Models that are not GPT-2 (RoPE,
SwiGLU, RMSNorm, grouped-query attention, no biases) are refused with the reason.

Two facts make the mapping more than a renaming:

1. **QKV layout.** megatron-core's ``linear_qkv`` ([3h, h], a ``ColumnParallelLinear``)
   keeps each head's rows together: ``[q_0 k_0 v_0 | q_1 k_1 v_1 | ...]``, so that a
   tensor-parallel rank holds whole heads (``SelfAttention.get_query_key_value_tensors``
   in ``megatron/core/transformer/attention.py`` views it as
   ``[.., heads, 3 * head_dim]``). GPT-2's ``c_attn`` wants ``[all q | all k | all v]``
   and, being a ``Conv1D``, stores ``[in, out]``, the transpose of ``nn.Linear``. The
   bias is permuted the same way (:func:`qkv_megatron_to_hf`).
2. **Vocabulary padding.** Megatron pads the embedding to a multiple of 128 x TP rows
   (``_vocab_size_with_padding``); the extra rows are no token. The transformers model
   gets the tokenizer's real size; the reverse direction pads by repeating the last row,
   as Megatron-LM's ``tools/checkpoint/saver_mcore.py`` does.

The checks that prove the conversion (:func:`compare_logits`, :func:`validation_loss`,
:func:`greedy_generate_megatron`) run megatron-core's own ``GPTModel`` next to the
transformers model on the same token ids.

Sources: megatron-core 0.19.2 ``models/gpt/gpt_model.py``, ``transformer/attention.py``,
``models/gpt/gpt_layer_specs.py`` (``sharded_state_dict_keys_map``),
``dist_checkpointing/serialization.py`` (``load_tensors_metadata``, ``load``);
transformers ``models/gpt2/modeling_gpt2.py``; the legacy converter
``transformers/models/megatron_gpt2/convert_megatron_gpt2_checkpoint.py`` (transformers
source tree); Megatron-LM ``tools/checkpoint/saver_mcore.py`` (vocab padding rows).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import shutil
import sys
import tempfile
import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterator, Mapping, Sequence

import torch

from helpers import checkpointing
from helpers.model import GELU_HF_NAME, ModelConfig

# =========================================================================== constants
#: Tokenizer files copied into the transformers folder (``helpers.tokenizer.TOKENIZER_FILES``):
#: the guide's ``vocab.json``/``merges.txt`` plus what ``AutoTokenizer`` reads offline.
TOKENIZER_FILES: tuple[str, ...] = ("vocab.json", "merges.txt", "tokenizer.json", "tokenizer_config.json")
#: Optional tokenizer files copied when present.
OPTIONAL_TOKENIZER_FILES: tuple[str, ...] = ("special_tokens_map.json", "added_tokens.json")
#: Provenance file written next to ``config.json``.
CONVERSION_FILE = "conversion.json"
#: transformers activation names back to the GELU they compute.
HF_GELU = {"gelu": "erf", "gelu_new": "tanh", "gelu_pytorch_tanh": "tanh", "gelu_fast": "tanh"}
#: Keys of ``dist_checkpointing`` checkpoints that are not the model (training state).
NON_MODEL_KEY_PREFIXES: tuple[str, ...] = ("optimizer.", "rng_state", "opt_param_scheduler")
#: Per-layer megatron-core keys (local spec names) of a GPT-2 layer and their transformers names.
LAYER_KEYS: dict[str, str] = {
    "input_layernorm.weight": "ln_1.weight",
    "input_layernorm.bias": "ln_1.bias",
    "self_attention.linear_qkv.weight": "attn.c_attn.weight",
    "self_attention.linear_qkv.bias": "attn.c_attn.bias",
    "self_attention.linear_proj.weight": "attn.c_proj.weight",
    "self_attention.linear_proj.bias": "attn.c_proj.bias",
    "pre_mlp_layernorm.weight": "ln_2.weight",
    "pre_mlp_layernorm.bias": "ln_2.bias",
    "mlp.linear_fc1.weight": "mlp.c_fc.weight",
    "mlp.linear_fc1.bias": "mlp.c_fc.bias",
    "mlp.linear_fc2.weight": "mlp.c_proj.weight",
    "mlp.linear_fc2.bias": "mlp.c_proj.bias",
}
#: Layer-norm names of the Transformer Engine spec (fused into the following linear) and the
#: sharded checkpoint keys -> local-spec names. megatron-core's
#: ``get_gpt_layer_local_spec().submodules.sharded_state_dict_keys_map`` is the inverse.
TE_LAYERNORM_NAMES: dict[str, str] = {
    "self_attention.linear_qkv.layer_norm_weight": "input_layernorm.weight",
    "self_attention.linear_qkv.layer_norm_bias": "input_layernorm.bias",
    "mlp.linear_fc1.layer_norm_weight": "pre_mlp_layernorm.weight",
    "mlp.linear_fc1.layer_norm_bias": "pre_mlp_layernorm.bias",
}
#: Linear layers whose bias a GPT-2 needs (``add_bias_linear=True``).
_LINEARS = ("self_attention.linear_qkv", "self_attention.linear_proj", "mlp.linear_fc1", "mlp.linear_fc2")
_LAYER_RE = re.compile(r"^decoder\.layers\.(\d+)\.(.+)$")
#: ModelConfig metadata that must agree between a transformers model and a training config.
_MATCH_KEYS = ("num_layers", "hidden_size", "num_attention_heads", "ffn_hidden_size", "max_position_embeddings",
               "vocab_size", "padded_vocab_size", "gelu", "layernorm_epsilon", "tied_embeddings")

#: The guide's 2022 command (transformers source tree, legacy Megatron-LM checkpoint layout).
GUIDE_2022_COMMAND = (
    "python transformers/src/transformers/models/megatron_gpt2/convert_megatron_gpt2_checkpoint.py "
    "experiments/codeparrot-small/iter_0150000/mp_rank_00/model_optim_rng.pt"
)
LEGACY_CONVERTER_MODULE = "transformers.models.megatron_gpt2.convert_megatron_gpt2_checkpoint"


class ConversionError(ValueError):
    """The input cannot be converted exactly; the message says why and what to do."""


# =========================================================================== QKV permutation
def _check_qkv(rows: int, hidden_size: int, num_heads: int, what: str) -> int:
    if num_heads < 1 or hidden_size % num_heads:
        raise ConversionError(f"{what}: hidden size {hidden_size} is not divisible by num_heads={num_heads}")
    if rows != 3 * hidden_size:
        raise ConversionError(
            f"{what} has {rows} rows, not 3 x hidden size = {3 * hidden_size}: queries, keys and values of "
            "different sizes mean grouped-query attention (num_query_groups < heads), which GPT-2 cannot hold"
        )
    return hidden_size // num_heads


def qkv_row_permutation(num_heads: int, head_dim: int) -> torch.Tensor:
    """Row order that turns megatron-core's per-head QKV rows into GPT-2's q | k | v order.

    ``hf_rows = megatron_rows[perm]``: megatron-core stores row ``(head, part, d)`` at
    ``head * 3 * head_dim + part * head_dim + d`` (part 0/1/2 = q/k/v); GPT-2 stores it at
    ``part * hidden + head * head_dim + d``.

    Returns:
        int64 ``[3 * num_heads * head_dim]``, a permutation.
    """
    idx = torch.arange(3 * num_heads * head_dim).view(num_heads, 3, head_dim)
    return idx.transpose(0, 1).reshape(-1)


def qkv_megatron_to_hf(weight: torch.Tensor, bias: torch.Tensor | None, num_heads: int) -> tuple[torch.Tensor, torch.Tensor | None]:
    """megatron-core ``linear_qkv`` -> GPT-2 ``c_attn`` (per-head rows regrouped, Conv1D transpose).

    Args:
        weight: ``[3h, h]`` (``nn.Linear`` layout, rows ``[q_0 k_0 v_0 | q_1 k_1 v_1 | ...]``).
        bias: ``[3h]`` in the same row order, or None.
        num_heads: attention heads (not inferable from shapes).

    Returns:
        ``(c_attn.weight [h, 3h], c_attn.bias [3h])``, columns ``[all q | all k | all v]``,
        same dtype, contiguous.

    Raises:
        ConversionError: shapes of grouped-query attention, or heads not dividing h.
    """
    head_dim = _check_qkv(weight.shape[0], weight.shape[1], num_heads, "linear_qkv.weight")
    perm = qkv_row_permutation(num_heads, head_dim)
    w = weight[perm].t().contiguous()
    b = None if bias is None else bias[perm].contiguous()
    return w, b


def qkv_hf_to_megatron(weight: torch.Tensor, bias: torch.Tensor | None, num_heads: int) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Inverse of :func:`qkv_megatron_to_hf`: ``c_attn`` ``[h, 3h]`` -> ``linear_qkv`` ``[3h, h]``.

    Raises:
        ConversionError: ``weight`` is not ``[h, 3h]`` or heads do not divide h.
    """
    head_dim = _check_qkv(weight.shape[1], weight.shape[0], num_heads, "c_attn.weight (transposed)")
    inverse = torch.argsort(qkv_row_permutation(num_heads, head_dim))
    w = weight.t()[inverse].contiguous()
    b = None if bias is None else bias[inverse].contiguous()
    return w, b


def qkv_head_table(weight: torch.Tensor, num_heads: int) -> list[dict[str, Any]]:
    """Where each head's q, k and v rows of a ``linear_qkv`` weight ``[3h, h]`` land in GPT-2's ``c_attn``.

    Returns:
        One dict per (head, part): ``head``, ``part`` ("q"/"k"/"v"), ``megatron_rows`` and
        ``gpt2_columns`` (``(first, last)`` inclusive), and ``equal``: the converted columns
        hold exactly those rows (transposed).
    """
    c_attn, _ = qkv_megatron_to_hf(weight, None, num_heads)
    h = weight.shape[1]
    d = h // num_heads
    table = []
    for head in range(num_heads):
        for part, name in enumerate("qkv"):
            r0, c0 = head * 3 * d + part * d, part * h + head * d
            equal = torch.equal(c_attn[:, c0:c0 + d], weight[r0:r0 + d].t())
            table.append({"head": head, "part": name, "megatron_rows": (r0, r0 + d - 1),
                          "gpt2_columns": (c0, c0 + d - 1), "equal": equal})
    return table


def qkv_layout_figure(num_heads: int = 3, head_dim: int = 2):
    """A picture of the QKV permutation: which head and part (q/k/v) each row holds, before and after.

    Returns:
        A matplotlib ``Figure`` with two labelled strips (megatron-core ``linear_qkv`` rows and
        GPT-2 ``c_attn`` columns), colours = q/k/v, text = head number, arrows for head 0.
    """
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    n = 3 * num_heads * head_dim
    perm = qkv_row_permutation(num_heads, head_dim).tolist()
    part_of = [(i // head_dim) % 3 for i in range(n)]
    head_of = [i // (3 * head_dim) for i in range(n)]
    colors = ["tab:blue", "tab:orange", "tab:green"]
    fig, ax = plt.subplots(figsize=(max(8.0, n * 0.45), 3.2))
    for y, order, label in ((1.6, list(range(n)), "megatron-core linear_qkv rows"),
                            (0.0, perm, "GPT-2 c_attn columns")):
        for pos, src in enumerate(order):
            ax.add_patch(plt.Rectangle((pos, y), 0.95, 0.8, color=colors[part_of[src]], alpha=0.85))
            ax.text(pos + 0.47, y + 0.4, f"h{head_of[src]}", ha="center", va="center", fontsize=8, color="white")
        ax.text(-0.4, y + 0.4, label, ha="right", va="center", fontsize=9)
    for pos, src in enumerate(perm):
        if head_of[src] == 0:
            ax.annotate("", xy=(pos + 0.47, 0.82), xytext=(src + 0.47, 1.58),
                        arrowprops=dict(arrowstyle="->", color="0.3", lw=0.8))
    ax.set_xlim(-0.2, n + 0.2)
    ax.set_ylim(-0.3, 2.5)
    ax.set_yticks([])
    ax.set_xticks([i + 0.47 for i in range(n)], [str(i) for i in range(n)], fontsize=7)
    ax.set_xlabel("row index in linear_qkv.weight / column index in c_attn.weight (rows of width hidden size)")
    ax.set_title(f"QKV layout: {num_heads} heads x head dim {head_dim} (arrows: head 0)")
    ax.legend(handles=[Patch(color=c, label=p) for c, p in zip(colors, ("query", "key", "value"))],
              loc="upper center", ncol=3, fontsize=8, bbox_to_anchor=(0.5, -0.28))
    for spine in ("left", "right", "top"):
        ax.spines[spine].set_visible(False)
    return fig


# =========================================================================== metadata and architecture
def model_config_from_metadata(meta: Mapping[str, Any]) -> ModelConfig:
    """The :class:`~helpers.model.ModelConfig` fields of a checkpoint's ``model_config.json``.

    Extra keys (``padded_vocab_size``, ``gelu``, iteration, parallel sizes...) are ignored.

    Raises:
        ConversionError: a required field is missing.
    """
    from dataclasses import fields

    names = {f.name for f in fields(ModelConfig)}
    required = ("num_layers", "hidden_size", "num_attention_heads", "max_position_embeddings", "vocab_size")
    missing = [k for k in required if k not in meta]
    if missing:
        raise ConversionError(f"model config lacks {missing}: it must hold ModelConfig.to_metadata() fields")
    data = {k: v for k, v in meta.items() if k in names}
    if "ffn_hidden_size" in data and data["ffn_hidden_size"] == 4 * data["hidden_size"]:
        data["ffn_hidden_size"] = None
    data.setdefault("seq_length", min(int(meta.get("seq_length", meta["max_position_embeddings"])), int(meta["max_position_embeddings"])))
    if "gelu" in meta and "bias_activation_fusion" not in meta:
        data["bias_activation_fusion"] = meta["gelu"] == "tanh"
    if "tied_embeddings" in meta and "share_embeddings_and_output_weights" not in meta:
        data["share_embeddings_and_output_weights"] = bool(meta["tied_embeddings"])
    return ModelConfig(**data)


def _as_metadata(model_config: ModelConfig | Mapping[str, Any]) -> dict[str, Any]:
    if isinstance(model_config, ModelConfig):
        return model_config.to_metadata()
    meta = dict(model_config)
    if "gelu" not in meta:
        cfg = model_config_from_metadata(meta)
        meta = {**cfg.to_metadata(int(meta.get("tensor_model_parallel_size", 1))), **meta}
    return meta


def check_architecture(meta: Mapping[str, Any], state_dict: Mapping[str, Any] | None = None) -> None:
    """Refuse models GPT-2 cannot represent, naming every reason.

    GPT-2 is: learned absolute positions, LayerNorm with bias, 4 projections with biases,
    GELU (erf or tanh) without gating, as many key/value heads as query heads. Checked from
    the metadata (``position_embedding_type``, ``normalization``, ``gated_linear_unit`` /
    ``swiglu``, ``num_query_groups``, ``add_bias_linear``, ``gelu``) and, when given, from the
    tensors of a (local-spec-named) state dict (no position table = RoPE, LayerNorm without
    bias = RMSNorm, ``linear_fc1`` twice as wide as ``linear_fc2`` = gated MLP, QKV rows
    != 3h = grouped-query attention).

    Raises:
        ConversionError: the reasons, one per line.
    """
    reasons: list[str] = []
    pos = meta.get("position_embedding_type", "learned_absolute")
    if pos != "learned_absolute":
        reasons.append(f"position_embedding_type={pos!r} (GPT-2 has a learned absolute position table; RoPE is not representable)")
    norm = meta.get("normalization", "LayerNorm")
    if norm != "LayerNorm":
        reasons.append(f"normalization={norm!r} (GPT-2 uses LayerNorm with a bias; RMSNorm has none and no mean subtraction)")
    if meta.get("gated_linear_unit") or meta.get("swiglu"):
        reasons.append("gated linear unit / SwiGLU MLP (GPT-2's MLP is fc -> GELU -> proj without a gate)")
    activation = meta.get("activation", meta.get("activation_func"))
    if activation not in (None, "gelu", "gelu_erf", "gelu_tanh"):
        reasons.append(f"activation={activation!r} (GPT-2 uses GELU)")
    gelu = meta.get("gelu", "erf")
    if gelu not in GELU_HF_NAME:
        reasons.append(f"gelu={gelu!r} (expected 'erf' or 'tanh')")
    heads = meta.get("num_attention_heads")
    groups = meta.get("num_query_groups")
    if groups not in (None, heads):
        reasons.append(f"num_query_groups={groups} < num_attention_heads={heads} (grouped-query attention; GPT-2 has one key/value head per query head)")
    if meta.get("add_bias_linear") is False:
        reasons.append("add_bias_linear=False (GPT-2's linear layers all have biases)")
    if meta.get("num_moe_experts"):
        reasons.append(f"num_moe_experts={meta['num_moe_experts']} (mixture of experts)")
    if state_dict is not None:
        keys = set(state_dict)
        h = int(meta.get("hidden_size", 0)) or None
        if "embedding.position_embeddings.weight" not in keys and "embedding.word_embeddings.weight" in keys and not any("position" in r for r in reasons):
            reasons.append("no embedding.position_embeddings.weight (rotary or no position embedding: GPT-2 needs a learned table)")
        layer0 = {k[len("decoder.layers.0."):] for k in keys if k.startswith("decoder.layers.0.")}
        if "input_layernorm.weight" in layer0 and "input_layernorm.bias" not in layer0 and not any("RMSNorm" in r for r in reasons):
            reasons.append("layer norms without bias (RMSNorm): GPT-2's LayerNorm has a bias")
        fc1, fc2 = state_dict.get("decoder.layers.0.mlp.linear_fc1.weight"), state_dict.get("decoder.layers.0.mlp.linear_fc2.weight")
        if fc1 is not None and fc2 is not None and fc1.shape[0] == 2 * fc2.shape[1] and not any("gated" in r for r in reasons):
            reasons.append(f"linear_fc1 has {fc1.shape[0]} rows = 2 x linear_fc2 input {fc2.shape[1]}: a gated (SwiGLU) MLP")
        qkv = state_dict.get("decoder.layers.0.self_attention.linear_qkv.weight")
        if qkv is not None and h and qkv.shape[0] != 3 * h and not any("grouped" in r for r in reasons):
            reasons.append(f"linear_qkv has {qkv.shape[0]} rows, not 3 x {h}: grouped-query attention")
        if any(f"{lin}.weight" in layer0 and f"{lin}.bias" not in layer0 for lin in _LINEARS) and not any("bias_linear" in r for r in reasons):
            reasons.append("linear layers without bias (add_bias_linear=False): GPT-2's linear layers all have biases")
    if reasons:
        raise ConversionError(
            "this checkpoint is not a GPT-2 architecture and cannot become a transformers GPT2LMHeadModel:\n  - "
            + "\n  - ".join(reasons)
            + "\nConvert it to a model class that has these features (e.g. LlamaForCausalLM for RoPE + RMSNorm + SwiGLU + GQA)."
        )


# =========================================================================== state-dict mapping
def normalize_megatron_state_dict(state_dict: Mapping[str, Any]) -> tuple[dict[str, torch.Tensor], list[str]]:
    """Local-spec key names, weights only.

    Transformer Engine layer-norm names (``linear_qkv.layer_norm_weight``...) become the
    local spec's (``input_layernorm.weight``...); ``_extra_state`` entries (None, or TE's FP8
    metadata) carry no weights and are set aside; a leading ``model.`` / ``module.`` is
    stripped (Megatron-LM's ``{"model": ...}`` wrapper, DDP's ``module.``).

    Returns:
        ``(tensors, extra_state_keys)``.

    Raises:
        ConversionError: a value that is neither a tensor nor ``_extra_state``.
    """
    out: dict[str, torch.Tensor] = {}
    extra: list[str] = []
    for key, value in state_dict.items():
        name = key
        for prefix in ("model.", "module."):
            if name.startswith(prefix):
                name = name[len(prefix):]
        if name.endswith("._extra_state"):
            extra.append(key)
            continue
        m = _LAYER_RE.match(name)
        if m and m.group(2) in TE_LAYERNORM_NAMES:
            name = f"decoder.layers.{m.group(1)}.{TE_LAYERNORM_NAMES[m.group(2)]}"
        if not isinstance(value, torch.Tensor):
            raise ConversionError(f"state dict entry {key!r} is a {type(value).__name__}, not a tensor")
        if name in out:
            raise ConversionError(f"state dict has {key!r} twice (after normalising names to {name!r})")
        out[name] = value
    return out, extra


def resize_vocab_rows(tensor: torch.Tensor, rows: int) -> torch.Tensor:
    """Trim or pad the vocabulary dimension (dim 0) to ``rows``.

    Trimming drops Megatron's padding rows (never a token id). Padding repeats the last row
    (Megatron-LM ``tools/checkpoint/saver_mcore.py``), so padded ids score like the last real one.

    Returns:
        ``[rows, ...]``, same dtype.
    """
    if tensor.shape[0] == rows:
        return tensor
    if tensor.shape[0] > rows:
        return tensor[:rows].clone()
    pad = tensor[-1:].expand(rows - tensor.shape[0], *tensor.shape[1:])
    return torch.cat([tensor, pad], dim=0)


def _expected_megatron_keys(num_layers: int, tied: bool) -> list[str]:
    keys = ["embedding.word_embeddings.weight", "embedding.position_embeddings.weight"]
    for i in range(num_layers):
        keys += [f"decoder.layers.{i}.{k}" for k in LAYER_KEYS]
    keys += ["decoder.final_layernorm.weight", "decoder.final_layernorm.bias"]
    if not tied:
        keys.append("output_layer.weight")
    return keys


def _account(found: set[str], expected: list[str], allowed_extra: set[str], what: str) -> None:
    unknown = sorted(found - set(expected) - allowed_extra)
    missing = [k for k in expected if k not in found]
    if unknown or missing:
        lines = [f"{what}: the keys do not match a GPT-2 megatron-core model ({len(expected)} weight keys expected)."]
        if unknown:
            lines.append(f"  unknown keys ({len(unknown)}): {unknown}")
        if missing:
            lines.append(f"  missing keys ({len(missing)}): {missing}")
        lines.append("Nothing was converted. Check num_layers / tied embeddings in the model config, or the checkpoint's origin.")
        raise ConversionError("\n".join(lines))


def megatron_to_hf_state_dict(state_dict: Mapping[str, Any], model_config: ModelConfig | Mapping[str, Any],
                              vocab_size: int | None = None) -> dict[str, torch.Tensor]:
    """A megatron-core GPT state dict (TP=1 layout) as a transformers ``GPT2LMHeadModel`` state dict.

    Args:
        state_dict: ``GPTModel.state_dict()`` names (local or Transformer Engine spec), or
            :func:`read_checkpoint_tensors` of a torch_dist checkpoint. Word embeddings
            ``[padded_vocab, h]`` (any padding), per layer ``linear_qkv`` ``[3h, h]`` etc.
        model_config: ``ModelConfig`` or a ``model_config.json`` dict (heads, layers, tied).
        vocab_size: rows to keep (the tokenizer's size); default ``model_config.vocab_size``.

    Returns:
        ``{transformers name: tensor}`` with ``transformer.wte.weight`` ``[vocab_size, h]``,
        ``c_attn.weight`` ``[h, 3h]`` (Conv1D), ..., and ``lm_head.weight`` (the same tensor
        as ``wte`` when tied). Same dtypes as the input.

    Raises:
        ConversionError: another architecture (see :func:`check_architecture`), unknown or
            missing keys (listed), a tied model whose output layer differs from its
            embedding, or a shape that does not match the config.
    """
    meta = _as_metadata(model_config)
    tensors, _extra = normalize_megatron_state_dict(state_dict)
    check_architecture(meta, tensors)
    num_layers, heads, h = int(meta["num_layers"]), int(meta["num_attention_heads"]), int(meta["hidden_size"])
    tied = bool(meta.get("tied_embeddings", meta.get("share_embeddings_and_output_weights", True)))
    allowed = set()
    if tied and "output_layer.weight" in tensors:
        if not torch.equal(tensors["output_layer.weight"], tensors["embedding.word_embeddings.weight"]):
            raise ConversionError(
                "the model config says the output layer is tied to the word embeddings, but the state dict's "
                "output_layer.weight differs from embedding.word_embeddings.weight: set tied_embeddings=False "
                "(share_embeddings_and_output_weights=False) in the model config"
            )
        allowed.add("output_layer.weight")
    _account(set(tensors), _expected_megatron_keys(num_layers, tied), allowed, "megatron-core state dict")
    vocab = int(vocab_size if vocab_size is not None else meta["vocab_size"])
    wte = tensors["embedding.word_embeddings.weight"]
    if wte.shape[1] != h:
        raise ConversionError(f"embedding.word_embeddings.weight is {tuple(wte.shape)} but hidden_size={h}")
    if wte.shape[0] < vocab:
        raise ConversionError(
            f"embedding.word_embeddings.weight has {wte.shape[0]} rows, fewer than the tokenizer's {vocab} "
            "entries: this checkpoint was trained with another tokenizer"
        )
    out: dict[str, torch.Tensor] = {
        "transformer.wte.weight": wte[:vocab].clone(),
        "transformer.wpe.weight": tensors["embedding.position_embeddings.weight"].clone(),
    }
    for i in range(num_layers):
        src = f"decoder.layers.{i}."
        dst = f"transformer.h.{i}."
        w, b = qkv_megatron_to_hf(tensors[src + "self_attention.linear_qkv.weight"],
                                  tensors[src + "self_attention.linear_qkv.bias"], heads)
        out[dst + "attn.c_attn.weight"], out[dst + "attn.c_attn.bias"] = w, b
        for name in ("self_attention.linear_proj", "mlp.linear_fc1", "mlp.linear_fc2"):
            out[dst + LAYER_KEYS[name + ".weight"]] = tensors[src + name + ".weight"].t().contiguous()
            out[dst + LAYER_KEYS[name + ".bias"]] = tensors[src + name + ".bias"].clone()
        for name in ("input_layernorm", "pre_mlp_layernorm"):
            for p in ("weight", "bias"):
                out[dst + LAYER_KEYS[f"{name}.{p}"]] = tensors[f"{src}{name}.{p}"].clone()
    out["transformer.ln_f.weight"] = tensors["decoder.final_layernorm.weight"].clone()
    out["transformer.ln_f.bias"] = tensors["decoder.final_layernorm.bias"].clone()
    out["lm_head.weight"] = out["transformer.wte.weight"] if tied else tensors["output_layer.weight"][:vocab].clone()
    return out


def hf_to_megatron_state_dict(hf_state_dict: Mapping[str, torch.Tensor], num_attention_heads: int,
                              padded_vocab_size: int, *, tied: bool = True) -> dict[str, torch.Tensor]:
    """Inverse of :func:`megatron_to_hf_state_dict`: GPT-2 names -> megatron-core local-spec names.

    Args:
        hf_state_dict: ``GPT2LMHeadModel.state_dict()`` (``transformer.`` prefix optional).
        num_attention_heads: heads (``config.n_head``).
        padded_vocab_size: rows of the megatron-core embedding (padding repeats the last row).
        tied: the output layer is the word embedding (no ``output_layer.weight``).

    Returns:
        ``GPTModel.state_dict()`` weights (no ``_extra_state``), TP=1 layout.

    Raises:
        ConversionError: unknown or missing keys (listed); an untied ``lm_head`` when
            ``tied`` is True.
    """
    sd = {k if k.startswith(("transformer.", "lm_head.")) else f"transformer.{k}": v for k, v in hf_state_dict.items()}
    layers = sorted({int(m.group(1)) for k in sd for m in [re.match(r"^transformer\.h\.(\d+)\.", k)] if m})
    num_layers = (layers[-1] + 1) if layers else 0
    expected = ["transformer.wte.weight", "transformer.wpe.weight", "transformer.ln_f.weight", "transformer.ln_f.bias"]
    expected += [f"transformer.h.{i}.{v}" for i in range(num_layers) for v in LAYER_KEYS.values()]
    allowed = {"lm_head.weight"} if tied else set()
    if not tied:
        expected.append("lm_head.weight")
    found = {k for k in sd if not re.match(r"^transformer\.h\.\d+\.attn\.(masked_)?bias$", k)}
    unknown = sorted(found - set(expected) - allowed)
    missing = [k for k in expected if k not in found]
    if unknown or missing:
        raise ConversionError(
            f"transformers GPT-2 state dict: unknown keys {unknown}, missing keys {missing}. "
            "Only GPT2LMHeadModel checkpoints are supported."
        )
    if tied and "lm_head.weight" in sd and not torch.equal(sd["lm_head.weight"], sd["transformer.wte.weight"]):
        raise ConversionError("lm_head.weight differs from transformer.wte.weight but tied=True: pass tied=False")
    out = {
        "embedding.word_embeddings.weight": resize_vocab_rows(sd["transformer.wte.weight"], padded_vocab_size).contiguous(),
        "embedding.position_embeddings.weight": sd["transformer.wpe.weight"].clone(),
    }
    for i in range(num_layers):
        src, dst = f"transformer.h.{i}.", f"decoder.layers.{i}."
        w, b = qkv_hf_to_megatron(sd[src + "attn.c_attn.weight"], sd[src + "attn.c_attn.bias"], num_attention_heads)
        out[dst + "self_attention.linear_qkv.weight"], out[dst + "self_attention.linear_qkv.bias"] = w, b
        for name in ("self_attention.linear_proj", "mlp.linear_fc1", "mlp.linear_fc2"):
            out[dst + name + ".weight"] = sd[src + LAYER_KEYS[name + ".weight"]].t().contiguous()
            out[dst + name + ".bias"] = sd[src + LAYER_KEYS[name + ".bias"]].clone()
        for name in ("input_layernorm", "pre_mlp_layernorm"):
            for p in ("weight", "bias"):
                out[f"{dst}{name}.{p}"] = sd[src + LAYER_KEYS[f"{name}.{p}"]].clone()
    out["decoder.final_layernorm.weight"] = sd["transformer.ln_f.weight"].clone()
    out["decoder.final_layernorm.bias"] = sd["transformer.ln_f.bias"].clone()
    if not tied:
        out["output_layer.weight"] = resize_vocab_rows(sd["lm_head.weight"], padded_vocab_size).contiguous()
    return out


# =========================================================================== configs
def gpt2_config(model_config: ModelConfig | Mapping[str, Any], *, vocab_size: int | None = None,
                eod_id: int | None = None):
    """The transformers ``GPT2Config`` of a megatron-core GPT.

    ``activation_function`` is the GELU training computed (``gelu`` = erf, ``gelu_new`` =
    tanh, from ``model_config.gelu``); ``layer_norm_epsilon``, dropouts and init std are
    copied; ``n_positions`` is the position table's size; ``vocab_size`` the tokenizer's
    (padding rows removed); BOS/EOS/PAD are the EOD token.

    Raises:
        ConversionError: another architecture (see :func:`check_architecture`).
    """
    from transformers import GPT2Config

    meta = _as_metadata(model_config)
    check_architecture(meta)
    cfg = model_config_from_metadata(meta)
    vocab = int(vocab_size if vocab_size is not None else cfg.vocab_size)
    return GPT2Config(
        vocab_size=vocab,
        n_positions=cfg.max_position_embeddings,
        n_embd=cfg.hidden_size,
        n_layer=cfg.num_layers,
        n_head=cfg.num_attention_heads,
        n_inner=cfg.ffn_size,
        activation_function=GELU_HF_NAME[meta.get("gelu", cfg.gelu)],
        resid_pdrop=cfg.hidden_dropout,
        embd_pdrop=cfg.hidden_dropout,
        attn_pdrop=cfg.attention_dropout,
        layer_norm_epsilon=cfg.layernorm_epsilon,
        initializer_range=cfg.init_method_std,
        tie_word_embeddings=cfg.share_embeddings_and_output_weights,
        bos_token_id=eod_id,
        eos_token_id=eod_id,
        pad_token_id=eod_id,
        architectures=["GPT2LMHeadModel"],
    )


def model_config_from_gpt2(config, *, make_vocab_size_divisible_by: int = 128, seq_length: int | None = None) -> ModelConfig:
    """The :class:`~helpers.model.ModelConfig` of a transformers ``GPT2Config``.

    Raises:
        ConversionError: settings megatron-core's GPT-2 path does not compute the same way
            (``scale_attn_by_inverse_layer_idx``, ``reorder_and_upcast_attn``, cross-attention,
            unscaled attention, a non-GELU activation).
    """
    problems = []
    if config.activation_function not in HF_GELU:
        problems.append(f"activation_function={config.activation_function!r} (expected one of {sorted(HF_GELU)})")
    for name, bad in (("scale_attn_by_inverse_layer_idx", True), ("reorder_and_upcast_attn", True),
                      ("add_cross_attention", True), ("scale_attn_weights", False)):
        if getattr(config, name, not bad) == bad:
            problems.append(f"{name}={bad}")
    if problems:
        raise ConversionError(f"GPT2Config settings megatron-core's GPTModel does not compute: {problems}")
    return ModelConfig(
        num_layers=config.n_layer, hidden_size=config.n_embd, num_attention_heads=config.n_head,
        seq_length=seq_length or config.n_positions, max_position_embeddings=config.n_positions,
        vocab_size=config.vocab_size, ffn_hidden_size=None if config.n_inner in (None, 4 * config.n_embd) else config.n_inner,
        make_vocab_size_divisible_by=make_vocab_size_divisible_by, hidden_dropout=config.resid_pdrop,
        attention_dropout=config.attn_pdrop, init_method_std=config.initializer_range,
        layernorm_epsilon=config.layer_norm_epsilon,
        bias_activation_fusion=HF_GELU[config.activation_function] == "tanh",
        share_embeddings_and_output_weights=bool(getattr(config, "tie_word_embeddings", True)),
    )


# =========================================================================== reading megatron-core checkpoints
@dataclass
class MegatronCheckpoint:
    """A megatron-core GPT read from disk (or given in memory), in TP=1 layout.

    Attributes:
        state_dict: local-spec module names -> full (merged) tensors; word embeddings keep the
            padding rows of the saving layout.
        meta: ``model_config.json`` (``ModelConfig.to_metadata`` + iteration, parallel sizes,
            tokenizer_dir, precision when written by ``helpers.training``).
        source: the file or ``iter_NNNNNNN`` folder read ("<memory>" for a dict).
        iteration: the training iteration, when known.
        format: ``"torch_dist"`` or ``"state_dict"``.
        extra_state_keys: ``_extra_state`` entries found (no weights; not converted).
        non_model_keys: checkpoint keys that are training state (optimizer moments...), not read.
    """

    state_dict: dict[str, torch.Tensor]
    meta: dict[str, Any]
    source: str
    iteration: int | None
    format: str
    extra_state_keys: list[str] = field(default_factory=list)
    non_model_keys: list[str] = field(default_factory=list)

    @property
    def model_config(self) -> ModelConfig:
        return model_config_from_metadata(self.meta)

    @property
    def tensor_model_parallel_size(self) -> int:
        return int(self.meta.get("tensor_model_parallel_size", 1))


def is_torch_dist_checkpoint(path: str | os.PathLike) -> bool:
    """True when ``path`` is a folder written by ``dist_checkpointing.save`` (torch_dist: ``.metadata``)."""
    p = Path(path)
    return p.is_dir() and (p / ".metadata").is_file() and (p / "metadata.json").is_file()


def find_checkpoint(path: str | os.PathLike, iteration: int | None = None) -> tuple[Path, int | None, str]:
    """Resolve ``path`` to the checkpoint to read.

    Accepts a checkpoints folder with ``latest_checkpointed_iteration.txt`` (latest, or
    ``iteration``), an ``iter_NNNNNNN`` torch_dist folder, or a ``.pt``/``.pth`` file holding a
    plain state dict.

    Returns:
        ``(path, iteration or None, "torch_dist" | "state_dict")``.

    Raises:
        FileNotFoundError: nothing at ``path``, or a checkpoints folder without that iteration.
        ConversionError: ``path`` exists but is none of the above (the message says what was
            expected and what was found).
    """
    p = Path(path).expanduser()
    if not p.exists():
        raise FileNotFoundError(f"checkpoint path {str(path)!r} does not exist: train first (notebook 03) or fix the path")
    if p.is_file():
        if p.suffix in (".pt", ".pth", ".bin"):
            return p, None, "state_dict"
        raise ConversionError(f"{p} is a file but not a .pt/.pth state dict: pass a checkpoints folder, an iter_NNNNNNN folder or a .pt file")
    if is_torch_dist_checkpoint(p):
        m = re.match(r"^iter_(\d+)$", p.name)
        return p, int(m.group(1)) if m else None, "torch_dist"
    if (p / checkpointing.TRACKER_FILE).is_file() or iteration is not None:
        it = iteration if iteration is not None else checkpointing.latest_iteration(p)
        folder = checkpointing.iteration_dir(p, it)
        if not folder.is_dir():
            raise FileNotFoundError(f"{p} has no iteration {it} ({folder} missing)")
        if (folder / "mp_rank_00" / "model_optim_rng.pt").is_file():
            raise ConversionError(f"{folder} is a legacy Megatron-LM checkpoint (--ckpt-format torch, mp_rank_00/): "
                                  "pass its model_optim_rng.pt state dict file instead")
        if not is_torch_dist_checkpoint(folder):
            raise ConversionError(f"{folder} is not a torch_dist checkpoint (no .metadata): the save may have been interrupted")
        return folder, it, "torch_dist"
    found = sorted(x.name for x in p.iterdir())[:10]
    raise ConversionError(
        f"{p} is not a megatron-core checkpoint: expected {checkpointing.TRACKER_FILE}, an iter_NNNNNNN folder "
        f"with .metadata (torch_dist), or a .pt state dict file; found {found or 'an empty folder'}"
    )


def _read_meta(folder: Path, model_config: ModelConfig | Mapping[str, Any] | None) -> dict[str, Any]:
    if model_config is not None:
        return _as_metadata(model_config)
    for candidate in (folder / checkpointing.MODEL_CONFIG_FILE, folder.parent / checkpointing.MODEL_CONFIG_FILE):
        if candidate.is_file():
            return json.loads(candidate.read_text())
    raise ConversionError(
        f"no {checkpointing.MODEL_CONFIG_FILE} next to {folder}: pass model_config= (a helpers.model.ModelConfig "
        "or its to_metadata() dict); head count and GELU cannot be read from the tensors"
    )


def read_checkpoint_tensors(folder: str | os.PathLike) -> tuple[dict[str, torch.Tensor], list[str], list[str]]:
    """Every model tensor of a torch_dist checkpoint at its global (merged) shape, as module names.

    The merged-shards path: ``dist_checkpointing.load_tensors_metadata`` lists each sharded
    tensor with its global shape (a TP=2 checkpoint stores each rank's slice with its
    offset), ``dist_checkpointing.load`` reads whole tensors, and the per-layer stacked keys
    (``decoder.layers.self_attention.linear_qkv.weight`` ``[layers, 3h, h]``) are split into
    ``decoder.layers.{i}.*`` with the local spec's names. Optimizer moments and RNG states
    are not read. Works without ``torch.distributed`` (megatron-core's own loader needs a
    process group: a one-process gloo group is created for the call when none exists).

    Returns:
        ``(state_dict, extra_state_keys, non_model_keys)``.

    Raises:
        ConversionError: ``folder`` is not a torch_dist checkpoint.
    """
    from megatron.core import dist_checkpointing

    folder = Path(folder)
    if not is_torch_dist_checkpoint(folder):
        raise ConversionError(f"{folder} is not a torch_dist checkpoint folder (no .metadata / metadata.json)")
    with _process_group():
        metadata = dist_checkpointing.load_tensors_metadata(str(folder))
        model_keys = {k: v for k, v in metadata.items() if not k.startswith(NON_MODEL_KEY_PREFIXES)}
        non_model = sorted(set(metadata) - set(model_keys))
        loaded = dist_checkpointing.load(model_keys, str(folder), validate_access_integrity=False) if model_keys else {}
    # load() also returns the checkpoint's common (non-sharded) entries: keep what was asked for.
    loaded = {k: loaded[k] for k in model_keys}
    layer_map = {**TE_LAYERNORM_NAMES}
    out: dict[str, torch.Tensor] = {}
    extra: list[str] = []
    for key, tensor in loaded.items():
        if key.endswith("._extra_state"):
            extra.append(key)
            continue
        if key.startswith("decoder.layers.") and not _LAYER_RE.match(key):
            local = key[len("decoder.layers."):]
            local = layer_map.get(local, local)
            for i in range(tensor.shape[0]):
                out[f"decoder.layers.{i}.{local}"] = tensor[i].clone()
        else:
            out[key] = tensor
    return out, extra, non_model


@contextmanager
def _process_group() -> Iterator[None]:
    """A one-process gloo group for the block when ``torch.distributed`` is not initialised."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        yield
        return
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


def load_megatron_checkpoint(source: str | os.PathLike | Mapping[str, Any], *,
                             model_config: ModelConfig | Mapping[str, Any] | None = None,
                             iteration: int | None = None, weights_only: bool = True) -> MegatronCheckpoint:
    """Read a megatron-core GPT: torch_dist checkpoint (any TP size) or plain state dict.

    Args:
        source: a checkpoints folder (latest iteration), an ``iter_NNNNNNN`` folder, a ``.pt``
            file of ``model.state_dict()`` (or ``{"model": state_dict}``), or such a dict.
        model_config: the model's ``ModelConfig`` / metadata; default ``model_config.json`` next
            to the checkpoint (written by ``helpers.checkpointing.save_checkpoint``).
        iteration: with a checkpoints folder, this iteration instead of the latest.
        weights_only: unpickle only tensors from a ``.pt`` file (``torch.load(weights_only=True)``).

    Returns:
        :class:`MegatronCheckpoint` in TP=1 layout.

    Raises:
        FileNotFoundError, ConversionError: see :func:`find_checkpoint`; no model config;
            another architecture (checked before reading tensors, from the metadata).
    """
    if isinstance(source, Mapping):
        if model_config is None:
            raise ConversionError("a state dict given in memory needs model_config= (ModelConfig or its metadata)")
        sd = source.get("model", source) if isinstance(source.get("model", None), Mapping) else source
        meta = _as_metadata(model_config)
        check_architecture(meta)
        tensors, extra = normalize_megatron_state_dict(sd)
        return MegatronCheckpoint(tensors, meta, "<memory>", iteration, "state_dict", extra)
    path, it, fmt = find_checkpoint(source, iteration)
    meta = _read_meta(path if path.is_dir() else path.parent, model_config)
    check_architecture(meta)
    if fmt == "torch_dist":
        tensors, extra, non_model = read_checkpoint_tensors(path)
        return MegatronCheckpoint(tensors, meta, str(path), it if it is not None else meta.get("iteration"),
                                  fmt, extra, non_model)
    try:
        raw = torch.load(path, map_location="cpu", weights_only=weights_only)
    except Exception as err:  # torch's unpickling errors have no common public type
        if not weights_only:
            raise
        raise ConversionError(
            f"{path} holds objects besides tensors ({type(err).__name__}); if you trust the file, pass "
            "weights_only=False to unpickle it (legacy Megatron-LM files store their arguments this way)"
        ) from err
    if not isinstance(raw, Mapping):
        raise ConversionError(f"{path} holds a {type(raw).__name__}, not a state dict")
    sd = raw["model"] if isinstance(raw.get("model"), Mapping) else raw
    tensors, extra = normalize_megatron_state_dict(sd)
    return MegatronCheckpoint(tensors, meta, str(path), meta.get("iteration"), fmt, extra)


# =========================================================================== writing transformers folders
@dataclass
class ConversionResult:
    """What :func:`convert_to_hf` wrote.

    Attributes:
        output_dir: the transformers folder.
        vocab_size: rows of the converted embedding (the tokenizer's size).
        padded_rows_removed: Megatron padding rows dropped.
        activation_function: transformers name of the GELU (``gelu`` erf / ``gelu_new`` tanh).
        tied: output layer tied to the word embeddings.
        num_parameters: parameters of the transformers model (tied counted once).
        source: the checkpoint read; ``iteration``, ``tensor_model_parallel_size`` of it.
        seconds: wall time (s); ``skipped``: the folder existed and matched (cached).
    """

    output_dir: Path
    vocab_size: int
    padded_rows_removed: int
    activation_function: str
    tied: bool
    num_parameters: int
    source: str
    iteration: int | None
    tensor_model_parallel_size: int
    seconds: float
    skipped: bool = False


def _check_tokenizer(tokenizer_dir: Path, meta: Mapping[str, Any]) -> tuple[int, int]:
    from helpers import tokenizer as tokenizer_lib

    if not tokenizer_dir.is_dir():
        raise FileNotFoundError(f"tokenizer folder {tokenizer_dir} does not exist: pass tokenizer_dir= (the folder training used)")
    missing = [n for n in TOKENIZER_FILES if not (tokenizer_dir / n).is_file()]
    if missing:
        raise FileNotFoundError(
            f"tokenizer folder {tokenizer_dir} lacks {missing}; a transformers folder needs {list(TOKENIZER_FILES)}. "
            "Use the tokenizer folder training used (helpers.preprocess.ensure_data / notebook 01)."
        )
    size = tokenizer_lib.vocab_size_of(tokenizer_dir)
    eod = tokenizer_lib.eod_id(tokenizer_dir)
    if int(meta["vocab_size"]) != size:
        raise ConversionError(
            f"the tokenizer in {tokenizer_dir} has {size} entries but the model was trained with vocab_size="
            f"{meta['vocab_size']}: pass the tokenizer folder that training used"
        )
    return size, eod


def _tokenizer_dir(given: str | os.PathLike | None, ckpt: MegatronCheckpoint) -> Path:
    """The tokenizer folder: the one given, else the one recorded at training time, else the run
    folder's ``data/tokenizer`` next to ``checkpoints/`` (a run folder that was moved)."""
    if given:
        return Path(given).expanduser()
    recorded = ckpt.meta.get("tokenizer_dir")
    candidates = [Path(recorded)] if recorded else []
    if ckpt.source != "<memory>":
        src = Path(ckpt.source)
        candidates += [p / "data" / "tokenizer" for p in (src.parent.parent, src.parent.parent.parent)]
    for candidate in candidates:
        if (candidate / "vocab.json").is_file():
            return candidate
    if recorded:
        return Path(recorded)
    raise ConversionError("no tokenizer_dir given, none recorded in model_config.json and no data/tokenizer "
                          "in the run folder: pass tokenizer_dir= (the folder training used)")


def _prepare_output(output_dir: Path, overwrite: bool) -> None:
    if output_dir.exists() and not output_dir.is_dir():
        raise FileExistsError(f"output_dir={str(output_dir)!r} is a file: pass a folder path")
    if output_dir.is_dir() and any(output_dir.iterdir()) and not overwrite:
        raise FileExistsError(
            f"output folder {output_dir} already exists and is not empty: pass overwrite=True to replace it "
            "(the old folder is kept until the new one is complete) or choose another output_dir"
        )
    if not output_dir.parent.exists():
        output_dir.parent.mkdir(parents=True, exist_ok=True)


def _publish(tmp: Path, output_dir: Path) -> None:
    """Move a finished temporary folder into place; an old folder is removed only after that."""
    old = None
    if output_dir.exists():
        old = output_dir.with_name(f".{output_dir.name}.old-{os.getpid()}")
        os.replace(output_dir, old)
    os.replace(tmp, output_dir)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


def convert_to_hf(source: str | os.PathLike | Mapping[str, Any] | MegatronCheckpoint, output_dir: str | os.PathLike, *,
                  tokenizer_dir: str | os.PathLike | None = None,
                  model_config: ModelConfig | Mapping[str, Any] | None = None, iteration: int | None = None,
                  overwrite: bool = False, dtype: torch.dtype = torch.float32) -> ConversionResult:
    """Convert a megatron-core GPT checkpoint into a transformers ``GPT2LMHeadModel`` folder.

    Writes ``config.json``, ``model.safetensors``, ``generation_config.json`` (EOS = BOS = PAD
    = the EOD token), the tokenizer files of ``tokenizer_dir`` copied byte for byte, and
    ``conversion.json`` (source, iteration, TP size, padding rows removed, versions). All
    files are written to a temporary folder first and moved into place at the end.

    Args:
        source: see :func:`load_megatron_checkpoint` (or an already loaded checkpoint).
        output_dir: the transformers folder to create (e.g. ``{run_dir}/hf_model``).
        tokenizer_dir: the tokenizer training used; default the ``tokenizer_dir`` recorded in
            ``model_config.json`` (or ``data/tokenizer`` of the run folder, if that moved).
        model_config: needed when there is no ``model_config.json`` next to the checkpoint.
        iteration: with a checkpoints folder, a given iteration instead of the latest.
        overwrite: replace an existing non-empty ``output_dir`` (only after the new one is complete).
        dtype: dtype of the saved weights (fp32 keeps the checkpoint's fp32 weights exactly).

    Returns:
        :class:`ConversionResult`.

    Raises:
        FileExistsError: ``output_dir`` exists, is not empty and ``overwrite`` is False
            (checked before anything is read).
        FileNotFoundError: missing checkpoint, tokenizer folder or tokenizer files (listed).
        ConversionError: not a checkpoint, another architecture, unknown/missing keys, a
            tokenizer of another size than the model's vocabulary.
    """
    from safetensors.torch import load_file
    from transformers import GenerationConfig, GPT2LMHeadModel

    start = time.perf_counter()
    out = Path(output_dir).expanduser().resolve()
    _prepare_output(out, overwrite)
    ckpt = source if isinstance(source, MegatronCheckpoint) else load_megatron_checkpoint(
        source, model_config=model_config, iteration=iteration)
    meta = ckpt.meta
    tok_dir = _tokenizer_dir(tokenizer_dir, ckpt)
    vocab, eod = _check_tokenizer(tok_dir, meta)
    hf_sd = megatron_to_hf_state_dict(ckpt.state_dict, meta, vocab)
    config = gpt2_config(meta, vocab_size=vocab, eod_id=eod)
    model = GPT2LMHeadModel(config)
    result = model.load_state_dict({k: v.to(dtype) for k, v in hf_sd.items()}, strict=True)
    if result.missing_keys or result.unexpected_keys:
        raise ConversionError(f"transformers GPT2LMHeadModel did not take the state dict: {result}")
    model = model.to(dtype).eval()
    tmp = Path(tempfile.mkdtemp(dir=out.parent, prefix=f".{out.name}.tmp-"))
    try:
        model.save_pretrained(str(tmp), safe_serialization=True)
        GenerationConfig(bos_token_id=eod, eos_token_id=eod, pad_token_id=eod).save_pretrained(str(tmp))
        for name in TOKENIZER_FILES + OPTIONAL_TOKENIZER_FILES:
            if (tok_dir / name).is_file():
                shutil.copyfile(tok_dir / name, tmp / name)
        saved = load_file(str(tmp / "model.safetensors"))
        for key, value in saved.items():
            if not torch.equal(value, hf_sd[key].to(dtype)):
                raise ConversionError(f"model.safetensors does not hold the converted {key} exactly")
        rows = ckpt.state_dict["embedding.word_embeddings.weight"].shape[0]
        info = {
            "source": ckpt.source, "format": ckpt.format, "iteration": ckpt.iteration,
            "tensor_model_parallel_size": ckpt.tensor_model_parallel_size,
            "checkpoint_vocab_rows": rows, "vocab_size": vocab, "padded_rows_removed": rows - vocab,
            "activation_function": config.activation_function, "gelu": meta.get("gelu"),
            "tied_embeddings": config.tie_word_embeddings, "tokenizer_dir": str(tok_dir),
            "eod_id": eod, "extra_state_keys_skipped": len(ckpt.extra_state_keys),
            "non_model_keys_not_read": len(ckpt.non_model_keys), "dtype": str(dtype).replace("torch.", ""),
            "megatron_core_version": _version("megatron.core"), "transformers_version": _version("transformers"),
        }
        (tmp / CONVERSION_FILE).write_text(json.dumps(info, indent=2) + "\n")
        _publish(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    n_params = sum(p.numel() for p in model.parameters())
    return ConversionResult(out, vocab, rows - vocab, config.activation_function, config.tie_word_embeddings,
                            n_params, ckpt.source, ckpt.iteration, ckpt.tensor_model_parallel_size,
                            time.perf_counter() - start)


def ensure_hf_model(run_dir: str | os.PathLike, *, checkpoint_dir: str | os.PathLike | None = None,
                    output_dir: str | os.PathLike | None = None) -> ConversionResult:
    """``{run_dir}/hf_model`` from the latest checkpoint of ``{run_dir}/checkpoints``, cached.

    Reconverts when the folder is missing or was converted from another checkpoint or
    iteration (``conversion.json``); otherwise returns what is there (``skipped=True``).

    Raises:
        FileNotFoundError: no checkpoint (train first: notebook 03), and the errors of
            :func:`convert_to_hf`.
    """
    run = Path(run_dir).expanduser().resolve()
    ckpt_dir = Path(checkpoint_dir) if checkpoint_dir else run / "checkpoints"
    out = Path(output_dir) if output_dir else run / "hf_model"
    folder, it, _ = find_checkpoint(ckpt_dir)
    info_path = out / CONVERSION_FILE
    if info_path.is_file() and (out / "model.safetensors").is_file():
        info = json.loads(info_path.read_text())
        if info.get("source") == str(folder) and info.get("iteration") == it:
            return ConversionResult(out, info["vocab_size"], info["padded_rows_removed"], info["activation_function"],
                                    info["tied_embeddings"], _count_safetensors(out), info["source"], it,
                                    info["tensor_model_parallel_size"], 0.0, skipped=True)
    return convert_to_hf(ckpt_dir, out, overwrite=True)


def _count_safetensors(folder: Path) -> int:
    import math

    from safetensors import safe_open

    with safe_open(str(folder / "model.safetensors"), "pt") as f:
        return sum(math.prod(f.get_slice(k).get_shape()) for k in f.keys())


def _version(module: str) -> str:
    import importlib

    try:
        return getattr(importlib.import_module(module), "__version__", "unknown")
    except ImportError:
        return "not installed"


def load_hf_model(hf_dir: str | os.PathLike, dtype: torch.dtype = torch.float32):
    """``AutoModelForCausalLM.from_pretrained(hf_dir)`` in eval mode (``dtype``, CPU)."""
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(hf_dir), dtype=dtype).eval()


def tokenizer_files_identical(hf_dir: str | os.PathLike, tokenizer_dir: str | os.PathLike) -> dict[str, bool]:
    """``{file: bytes equal}`` for each tokenizer file of the training folder vs the transformers folder."""
    a, b = Path(hf_dir), Path(tokenizer_dir)
    return {n: (a / n).is_file() and (a / n).read_bytes() == (b / n).read_bytes()
            for n in TOKENIZER_FILES + OPTIONAL_TOKENIZER_FILES if (b / n).is_file()}


# =========================================================================== megatron-core models in this process
@contextmanager
def _keep_environ(names: Sequence[str] = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")) -> Iterator[None]:
    saved = {n: os.environ.get(n) for n in names}
    try:
        yield
    finally:
        for n, v in saved.items():
            if v is None:
                os.environ.pop(n, None)
            else:
                os.environ[n] = v


def init_megatron_single_process(seed: int = 1234) -> None:
    """One-process megatron-core state (gloo, TP=PP=1, seeded RNG tracker, CPU shims), reused if present.

    Uses ``helpers.training.initialize_distributed``; the ``RANK``/``MASTER_*`` variables it
    sets are restored afterwards, so later ``torchrun`` launches from this process are unaffected.

    Raises:
        ConversionError: this process already runs megatron-core with TP or PP above 1.
    """
    from megatron.core import parallel_state

    from helpers import training

    if parallel_state.model_parallel_is_initialized():
        tp = parallel_state.get_tensor_model_parallel_world_size()
        pp = parallel_state.get_pipeline_model_parallel_world_size()
        if (tp, pp) != (1, 1):
            raise ConversionError(f"this process runs megatron-core with TP={tp}, PP={pp}: build TP=1 models in a fresh process")
        return
    with _keep_environ():
        training.initialize_distributed(1, 1, seed)


def build_megatron_model(ckpt: MegatronCheckpoint | Mapping[str, Any], model_config: ModelConfig | Mapping[str, Any] | None = None):
    """megatron-core ``GPTModel`` (local spec, TP=1, fp32, eval mode) holding a checkpoint's weights.

    Word-embedding rows are trimmed/padded to this layout's padded vocab size (rows past the
    tokenizer's size are padding). Initialises a one-process megatron-core state if needed.

    Args:
        ckpt: a :class:`MegatronCheckpoint`, or a state dict with ``model_config``.

    Returns:
        ``GPTModel``: ``model(tokens [b, s], position_ids [b, s], None)`` -> logits
        ``[b, s, padded_vocab]`` fp32.

    Raises:
        ConversionError: unknown or missing keys (listed).
    """
    from helpers import model as model_lib

    if not isinstance(ckpt, MegatronCheckpoint):
        ckpt = load_megatron_checkpoint(ckpt, model_config=model_config)
    cfg = ckpt.model_config
    init_megatron_single_process()
    model = model_lib.build_model(cfg, layer_spec="local").eval()
    rows = cfg.padded_vocab_size(1)
    sd = dict(ckpt.state_dict)
    sd["embedding.word_embeddings.weight"] = resize_vocab_rows(sd["embedding.word_embeddings.weight"], rows)
    if not cfg.share_embeddings_and_output_weights:
        sd["output_layer.weight"] = resize_vocab_rows(sd["output_layer.weight"], rows)
    else:
        sd.pop("output_layer.weight", None)
    expected = [k for k in model.state_dict() if not k.endswith("._extra_state")]
    _account(set(sd), expected, set(), "megatron-core state dict")
    result = model.load_state_dict(sd, strict=False)
    bad = [k for k in result.missing_keys if not k.endswith("._extra_state")] + list(result.unexpected_keys)
    if bad:
        raise ConversionError(f"GPTModel did not take keys {bad}")
    return model


# =========================================================================== proofs: logits, generation, loss
@torch.no_grad()
def megatron_logits(model, tokens: torch.Tensor) -> torch.Tensor:
    """Logits of a megatron-core ``GPTModel`` (TP=1) for ``tokens`` ``[b, s]`` int64.

    Returns:
        fp32 ``[b, s, padded_vocab]`` on the CPU (causal; positions 0..s-1; the model may be on a GPU).
    """
    device = next(model.parameters()).device
    tokens = tokens.long().to(device)
    position_ids = torch.arange(tokens.shape[1], device=device).unsqueeze(0).expand_as(tokens)
    return model(tokens, position_ids, None).float().cpu()


@torch.no_grad()
def hf_logits(hf_model, tokens: torch.Tensor) -> torch.Tensor:
    """Logits of a transformers causal LM for ``tokens`` ``[b, s]`` int64: fp32 ``[b, s, vocab]`` on the CPU."""
    device = next(hf_model.parameters()).device
    return hf_model(input_ids=tokens.long().to(device)).logits.float().cpu()


@dataclass
class LogitComparison:
    """:func:`compare_logits`: ``max_abs_diff`` over the real vocabulary, argmax agreement (fraction
    of positions), shapes compared, and ``max_abs_logit`` for scale."""

    max_abs_diff: float
    argmax_agreement: float
    shape: tuple[int, ...]
    max_abs_logit: float


def compare_logits(reference: torch.Tensor, converted: torch.Tensor) -> LogitComparison:
    """Compare megatron-core logits ``[b, s, V_pad]`` with transformers logits ``[b, s, V]``.

    Only the first ``V`` (real) columns are compared: padding rows are no token.

    Raises:
        ValueError: batch/sequence shapes differ, or ``V_pad < V``.
    """
    if reference.shape[:-1] != converted.shape[:-1] or reference.shape[-1] < converted.shape[-1]:
        raise ValueError(f"logit shapes {tuple(reference.shape)} vs {tuple(converted.shape)} cannot be compared")
    ref = reference[..., :converted.shape[-1]].float()
    diff = (ref - converted.float()).abs().max().item()
    agree = (ref.argmax(-1) == converted.argmax(-1)).float().mean().item()
    return LogitComparison(diff, agree, tuple(converted.shape), ref.abs().max().item())


@torch.no_grad()
def greedy_generate_megatron(model, prompt_ids: Sequence[int], max_new_tokens: int, *, vocab_size: int,
                             eod_id: int | None = None) -> list[int]:
    """Greedy decoding with a megatron-core ``GPTModel``: argmax of the last position, repeated.

    The full sequence is re-run each step (no KV cache): slow but plainly correct. Padding
    columns (ids >= ``vocab_size``) are excluded, as Megatron's inference restricts sampling
    to the tokenizer's vocabulary. Stops after ``eod_id`` or ``max_new_tokens`` tokens, or at
    the position table's end.

    Returns:
        The new token ids (without the prompt).
    """
    ids = [int(i) for i in prompt_ids]
    limit = model.embedding.position_embeddings.weight.shape[0]
    new: list[int] = []
    for _ in range(max_new_tokens):
        if len(ids) >= limit:
            break
        logits = megatron_logits(model, torch.tensor([ids]))[0, -1, :vocab_size]
        nxt = int(logits.argmax())
        ids.append(nxt)
        new.append(nxt)
        if eod_id is not None and nxt == eod_id:
            break
    return new


@torch.no_grad()
def greedy_generate_hf(hf_model, prompt_ids: Sequence[int], max_new_tokens: int) -> list[int]:
    """Greedy decoding with transformers ``generate(do_sample=False)`` (stops at the EOS of the
    generation config). Returns the new token ids."""
    inp = torch.tensor([list(prompt_ids)], device=next(hf_model.parameters()).device)
    limit = hf_model.config.n_positions
    max_new = max(0, min(max_new_tokens, limit - inp.shape[1]))
    out = hf_model.generate(inp, attention_mask=torch.ones_like(inp), max_new_tokens=max_new, do_sample=False,
                            num_beams=1)
    return out[0, inp.shape[1]:].tolist()


def validation_loss(logits_fn: Callable[[torch.Tensor], torch.Tensor], dataset, *, num_samples: int,
                    micro_batch_size: int, vocab_size: int | None = None, progress: bool = False) -> float:
    """LM loss (nats/token) over samples ``0..num_samples-1`` of a ``GPTDataset``, as training evaluates it.

    Mirrors ``helpers.training.evaluate`` (Megatron-LM ``evaluate``): micro-batches of
    ``micro_batch_size`` consecutive samples, per micro-batch the loss-masked mean of the
    token cross-entropy, then the mean over micro-batches.

    Args:
        logits_fn: ``tokens [b, s]`` -> logits ``[b, s, V']`` (megatron-core or transformers).
        dataset: a megatron-core ``GPTDataset`` (``tokens``, ``labels``, ``loss_mask``).
        num_samples: samples to evaluate (``eval_iters x global_batch_size``); must be a
            multiple of ``micro_batch_size``.
        vocab_size: use only the first ``vocab_size`` logit columns (drops padding columns);
            None keeps all, as megatron-core's own loss does.

    Returns:
        The mean loss (float).

    Raises:
        ValueError: ``num_samples`` not a positive multiple of ``micro_batch_size``.
    """
    import torch.nn.functional as F
    from tqdm.auto import tqdm

    if num_samples < 1 or num_samples % micro_batch_size:
        raise ValueError(f"num_samples={num_samples} must be a positive multiple of micro_batch_size={micro_batch_size}")
    losses = []
    for start in tqdm(range(0, num_samples, micro_batch_size), desc="validation", disable=not progress):
        samples = [dataset[i % len(dataset)] for i in range(start, start + micro_batch_size)]
        tokens = torch.stack([torch.as_tensor(s["tokens"]) for s in samples]).long()
        labels = torch.stack([torch.as_tensor(s["labels"]) for s in samples]).long()
        mask = torch.stack([torch.as_tensor(s["loss_mask"]) for s in samples]).float()
        with torch.no_grad():
            logits = logits_fn(tokens).float()
        if vocab_size is not None:
            logits = logits[..., :vocab_size]
        ce = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1), reduction="none").view_as(mask)
        losses.append(((ce * mask).sum() / mask.sum().clamp(min=1)).item())
    return sum(losses) / len(losses)


@dataclass
class ValidationComparison:
    """:func:`compare_validation_loss`: losses in nats/token on the training run's validation batches.

    Attributes:
        training_loss: what training logged (``metrics.jsonl``) at ``iteration``; None if not logged.
        hf_loss: the transformers model's loss.
        megatron_loss: megatron-core's loss with all padded columns (what training computes);
            None when no megatron-core model was given.
        megatron_loss_real_vocab: megatron-core's loss over the tokenizer's columns only.
        num_samples, seq_length, iteration: what was evaluated.
        padded_columns: logit columns the transformers model does not have.
    """

    training_loss: float | None
    hf_loss: float
    megatron_loss: float | None
    megatron_loss_real_vocab: float | None
    num_samples: int
    seq_length: int
    iteration: int | None
    padded_columns: int


def compare_validation_loss(run_dir: str | os.PathLike, hf_model, megatron_model=None, *,
                            iteration: int | None = None, config_name: str = "run.json",
                            progress: bool = False) -> ValidationComparison:
    """Validation loss of the transformers model on exactly the batches training evaluated.

    Rebuilds the validation ``GPTDataset`` from the run's ``run.json``
    (``helpers.training.build_datasets``: same split, seed, sequence length and index cache)
    and evaluates the first ``eval_iters x global_batch_size`` samples in micro-batches of
    ``micro_batch_size``, as ``helpers.training.evaluate`` does (:func:`validation_loss`).

    The transformers model has no padding columns, so its softmax runs over the real
    vocabulary; megatron-core's runs over the padded one. With padding, training's loss is
    higher by the mean of ``-log(1 - p_pad)`` (``p_pad``: probability the model puts on
    padding ids); ``megatron_loss_real_vocab`` equals the transformers loss exactly.

    Args:
        run_dir: the run folder (``run.json``, ``metrics.jsonl``, data).
        hf_model: the converted transformers model (eval mode).
        megatron_model: optional megatron-core ``GPTModel`` of the same checkpoint.
        iteration: the checkpoint's iteration (its logged validation loss is returned);
            default the last logged one.

    Raises:
        FileNotFoundError: no ``run.json`` in ``run_dir`` (train with helpers.training.launch first).
    """
    from helpers import training

    run = Path(run_dir).expanduser().resolve()
    cfg_path = run / config_name
    if not cfg_path.is_file():
        raise FileNotFoundError(f"{cfg_path} not found: it is written by helpers.training.launch (notebook 03)")
    cfg = training.TrainingConfig.from_json(cfg_path)
    _, valid_ds, _ = training.build_datasets(cfg)
    if valid_ds is None:
        raise ValueError(f"the run's split {cfg.split!r} has no validation part: nothing to compare")
    n = cfg.eval_iters * cfg.global_batch_size
    vocab = hf_model.config.vocab_size
    hf_loss = validation_loss(lambda t: hf_logits(hf_model, t), valid_ds, num_samples=n,
                              micro_batch_size=cfg.micro_batch_size, progress=progress)
    mc_loss = mc_real = None
    padded = 0
    if megatron_model is not None:
        mc_loss = validation_loss(lambda t: megatron_logits(megatron_model, t), valid_ds, num_samples=n,
                                  micro_batch_size=cfg.micro_batch_size, progress=progress)
        mc_real = validation_loss(lambda t: megatron_logits(megatron_model, t), valid_ds, num_samples=n,
                                  micro_batch_size=cfg.micro_batch_size, vocab_size=vocab)
        padded = megatron_model.embedding.word_embeddings.weight.shape[0] - vocab
    valid = training.read_metrics(cfg.metrics_file).get("valid", [])
    if iteration is not None:
        valid = [r for r in valid if r["iteration"] == iteration]
    logged = valid[-1] if valid else None
    return ValidationComparison(logged["lm_loss"] if logged else None, hf_loss, mc_loss, mc_real, n,
                                cfg.model.seq_length, logged["iteration"] if logged else iteration, padded)


def validation_tokens(run_dir: str | os.PathLike, num_samples: int = 2, *, config_name: str = "run.json") -> torch.Tensor:
    """Token ids of the first ``num_samples`` validation samples of a training run (held-out code).

    Returns:
        int64 ``[num_samples, seq_length]``.

    Raises:
        FileNotFoundError: no ``run.json`` (train first: notebook 03).
    """
    from helpers import training

    cfg_path = Path(run_dir).expanduser().resolve() / config_name
    if not cfg_path.is_file():
        raise FileNotFoundError(f"{cfg_path} not found: it is written by helpers.training.launch (notebook 03)")
    _, valid_ds, _ = training.build_datasets(training.TrainingConfig.from_json(cfg_path))
    return torch.stack([torch.as_tensor(valid_ds[i % len(valid_ds)]["tokens"]).long() for i in range(num_samples)])


def compare_hf_folders(first: str | os.PathLike, second: str | os.PathLike) -> dict[str, Any]:
    """Tensor by tensor comparison of two transformers folders' ``model.safetensors``.

    Returns:
        ``{"num_tensors", "identical" (all bit-equal), "max_abs_diff", "same_keys", "same_config"}``.
    """
    from safetensors.torch import load_file

    a, b = load_file(str(Path(first) / "model.safetensors")), load_file(str(Path(second) / "model.safetensors"))
    common = sorted(set(a) & set(b))
    diff = max(((a[k].float() - b[k].float()).abs().max().item() if a[k].shape == b[k].shape else math.inf)
               for k in common) if common else math.inf
    cfg_a, cfg_b = (json.loads((Path(x) / "config.json").read_text()) for x in (first, second))
    return {"num_tensors": len(common), "identical": set(a) == set(b) and all(torch.equal(a[k], b[k]) for k in common),
            "max_abs_diff": diff, "same_keys": set(a) == set(b), "same_config": cfg_a == cfg_b}


def logit_scatter_figure(reference: torch.Tensor, converted: torch.Tensor, max_points: int = 20000):
    """Scatter of megatron-core vs transformers logits (same token ids), plus the histogram of differences.

    Args:
        reference: megatron-core logits ``[b, s, V_pad]``; converted: transformers ``[b, s, V]``.

    Returns:
        A matplotlib ``Figure`` (two panels, titled and labelled).
    """
    import matplotlib.pyplot as plt

    ref = reference[..., :converted.shape[-1]].reshape(-1).float()
    conv = converted.reshape(-1).float()
    idx = torch.randperm(ref.numel(), generator=torch.Generator().manual_seed(0))[:max_points]
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4))
    ax1.scatter(ref[idx], conv[idx], s=2, alpha=0.4, label=f"{len(idx):,} logits")
    lo, hi = float(ref.min()), float(ref.max())
    ax1.plot([lo, hi], [lo, hi], color="black", lw=0.8, label="y = x")
    ax1.set(title="Logits: transformers vs megatron-core", xlabel="megatron-core logit (nats)",
            ylabel="transformers logit (nats)")
    ax1.legend()
    raw = (conv - ref).abs()
    exact = int((raw == 0).sum())
    diff = raw.clamp(min=1e-10)
    ax2.hist(torch.log10(diff).numpy(), bins=60,
             label=f"max {raw.max().item():.2e}; {exact:,} exactly equal (drawn at -10)")
    ax2.axvline(-4, color="red", ls="--", label="tolerance 1e-4")
    ax2.set(title="|difference| per logit", xlabel="log10 |transformers - megatron-core| (nats)", ylabel="logits")
    ax2.legend()
    fig.tight_layout()
    return fig


def ensure_trained_checkpoint(run_dir: str | os.PathLike, *, base_profile: str = "cpu", train_iters: int = 100,
                              model_overrides: Mapping[str, Any] | None = None, max_files: int | None = None,
                              vocab_size: int | None = None, split: str | None = None,
                              timeout_s: float = 3600.0, **training_overrides: Any) -> tuple[Path, Any]:
    """The run's ``checkpoints`` folder, training one first (as notebook 03 does) when there is none.

    Reuses what exists: the data of ``{run_dir}/data`` (otherwise made with ``max_files`` /
    ``vocab_size`` / ``split``) and the latest checkpoint (then nothing is trained).

    Args:
        run_dir: the run folder.
        base_profile: ``helpers.training`` profile the fallback run starts from.
        train_iters, model_overrides, training_overrides: the fallback run (``model_overrides``
            are ModelConfig fields; ``vocab_size`` is set from the tokenizer).
        max_files, vocab_size, split: data settings for a run folder without data.

    Returns:
        ``(checkpoint_dir, TrainingResult or None when a checkpoint existed)``.
    """
    from helpers import preprocess, training

    run = Path(run_dir).expanduser().resolve()
    ckpt_dir = run / "checkpoints"
    if checkpointing.latest_iteration(ckpt_dir) is not None:
        return ckpt_dir, None
    has_data = (run / preprocess.DATA_DIR / preprocess.MANIFEST_NAME).is_file()
    paths = preprocess.ensure_data(run) if has_data else preprocess.ensure_data(
        run, max_files=max_files, vocab_size=vocab_size, split=split)
    model = {**(model_overrides or {}), "vocab_size": paths.vocab_size}
    if "seq_length" in model:
        model.setdefault("max_position_embeddings", model["seq_length"])
    overrides = {"lr_decay_iters": train_iters, **training_overrides}
    if overrides.get("lr_warmup_iters", training.PROFILES[base_profile].lr_warmup_iters) >= overrides["lr_decay_iters"]:
        overrides["lr_warmup_iters"] = max(0, overrides["lr_decay_iters"] - 1)
    cfg = training.profile(base_profile, str(run), split=paths.split, train_iters=train_iters, model=model, **overrides)
    print(f"No checkpoint in {ckpt_dir}: training {train_iters} iterations first, as notebook 03 does.")
    return ckpt_dir, training.launch(cfg, timeout_s=timeout_s)


def continuation_config(run_dir: str | os.PathLike, out_dir: str | os.PathLike, train_iters: int, *,
                        config_name: str = "run.json"):
    """A ``TrainingConfig`` that continues the run of ``run_dir`` for ``train_iters`` iterations in ``out_dir``.

    Same model, data, batch sizes and validation batches as the original run; a constant
    learning rate equal to its ``min_lr`` (where its cosine ended); outputs (checkpoints,
    metrics, TensorBoard) in ``out_dir``. Used with :func:`hf_to_megatron_checkpoint`.

    Raises:
        FileNotFoundError: no ``run.json`` in ``run_dir``.
        ValueError: ``train_iters`` < 1.
    """
    from dataclasses import replace

    from helpers import training

    if train_iters < 1:
        raise ValueError(f"train_iters={train_iters} must be >= 1")
    cfg_path = Path(run_dir).expanduser().resolve() / config_name
    if not cfg_path.is_file():
        raise FileNotFoundError(f"{cfg_path} not found: it is written by helpers.training.launch (notebook 03)")
    cfg = training.TrainingConfig.from_json(cfg_path)
    out = Path(out_dir).expanduser().resolve()
    lr = cfg.min_lr if cfg.min_lr > 0 else cfg.lr * 0.1
    return replace(cfg, run_dir=str(out), data_prefix=str(cfg.data_prefix_path), tokenizer_dir=str(cfg.tokenizer_path),
                   train_iters=train_iters, lr=lr, min_lr=lr, lr_warmup_iters=0, lr_decay_iters=train_iters,
                   lr_decay_style="constant", eval_interval=train_iters, save_interval=train_iters,
                   log_interval=max(1, min(cfg.log_interval, train_iters)), exit_interval=None,
                   checkpoint_dir=None, tensorboard_dir=None, metrics_path=None)


def parameter_devices(model) -> dict[str, int]:
    """``{device: number of parameters}`` of a model, e.g. after ``from_pretrained(..., device_map="auto")``.

    (transformers 5 sets ``model.hf_device_map`` only when the weights span several devices.)
    """
    out: dict[str, int] = {}
    for p in model.parameters():
        out[str(p.device)] = out.get(str(p.device), 0) + p.numel()
    return out


def push_to_hub(hf_dir: str | os.PathLike, repo_id: str, *, private: bool = True) -> str:
    """Upload a converted folder to the Hugging Face Hub (model, tokenizer, generation config).

    Needs network access and a token (``huggingface-cli login`` or ``HF_TOKEN``).

    Returns:
        The URL of the commit.
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(str(hf_dir))
    AutoTokenizer.from_pretrained(str(hf_dir)).push_to_hub(repo_id, private=private)
    return str(model.push_to_hub(repo_id, private=private))


# =========================================================================== transformers -> megatron-core
def hf_to_megatron_checkpoint(hf_dir: str | os.PathLike, checkpoint_dir: str | os.PathLike, *,
                              training_config=None, iteration: int = 0, overwrite: bool = False,
                              make_vocab_size_divisible_by: int = 128) -> Path:
    """Write a transformers GPT-2 folder as a megatron-core torch_dist checkpoint (TP=1).

    The checkpoint has this series' layout (``iter_NNNNNNN/``, ``model_config.json``,
    ``latest_checkpointed_iteration.txt``). With ``training_config`` (a
    ``helpers.training.TrainingConfig`` whose model matches) it also holds a fresh AdamW
    state and LR scheduler built exactly as training builds them, so
    ``helpers.training.launch(training_config)`` with ``checkpoint_dir`` pointing here
    continues pre-training from the transformers weights at iteration ``iteration``.
    Without it the checkpoint holds the model only (for conversion and evaluation).

    Must run in a process whose main module is import-guarded (a notebook, pytest, or
    ``python -m helpers.conversion``): megatron-core's torch_dist writer spawns a helper process.

    Args:
        hf_dir: folder with ``config.json`` + weights of a ``GPT2LMHeadModel``, and
            optionally its tokenizer (recorded as ``tokenizer_dir`` when present).
        checkpoint_dir: the checkpoints folder to create.
        training_config: optional ``TrainingConfig``; its ``model`` must equal the converted one.
        iteration: iteration number of the checkpoint.
        overwrite: replace an existing checkpoint in ``checkpoint_dir``.
        make_vocab_size_divisible_by: Megatron's vocabulary padding multiple.

    Returns:
        The ``iter_NNNNNNN`` folder.

    Raises:
        FileExistsError: ``checkpoint_dir`` already holds a checkpoint and ``overwrite`` is False.
        ConversionError: not a GPT-2, unknown/missing keys, or a training config whose model differs.
    """
    from transformers import AutoConfig, AutoModelForCausalLM

    from helpers import model as model_lib

    ckpt_dir = Path(checkpoint_dir).expanduser().resolve()
    if (ckpt_dir / checkpointing.TRACKER_FILE).exists() and not overwrite:
        raise FileExistsError(f"{ckpt_dir} already holds a checkpoint: pass overwrite=True or another checkpoint_dir")
    config = AutoConfig.from_pretrained(str(hf_dir))
    if config.model_type != "gpt2":
        raise ConversionError(f"{hf_dir} holds a {config.model_type!r} model; only GPT-2 (GPT2LMHeadModel) is supported")
    seq = training_config.model.seq_length if training_config is not None else None
    cfg = model_config_from_gpt2(config, make_vocab_size_divisible_by=make_vocab_size_divisible_by, seq_length=seq)
    if training_config is not None:
        want, have = training_config.model.to_metadata(1), cfg.to_metadata(1)
        diffs = [f"{k}: training {want[k]!r} vs transformers {have[k]!r}" for k in _MATCH_KEYS if want[k] != have[k]]
        if diffs:
            raise ConversionError(f"training_config.model does not describe the transformers model in {hf_dir}: {diffs}")
        cfg = training_config.model
    hf = AutoModelForCausalLM.from_pretrained(str(hf_dir), dtype=torch.float32)
    sd = hf_to_megatron_state_dict(hf.state_dict(), cfg.num_attention_heads, cfg.padded_vocab_size(1),
                                   tied=cfg.share_embeddings_and_output_weights)
    init_megatron_single_process()
    model = model_lib.build_model(cfg, layer_spec="local")
    result = model.load_state_dict(sd, strict=False)
    bad = [k for k in result.missing_keys if not k.endswith("._extra_state")] + list(result.unexpected_keys)
    if bad:
        raise ConversionError(f"GPTModel did not take keys {bad}")
    meta = {**cfg.to_metadata(1), "iteration": iteration, "consumed_train_samples": 0,
            "tensor_model_parallel_size": 1, "pipeline_model_parallel_size": 1, "data_parallel_size": 1,
            "precision": "fp32", "layer_spec": "local", "checkpoint_format": "torch_dist",
            "megatron_core_version": _version("megatron.core"), "converted_from": str(Path(hf_dir).resolve())}
    if (Path(hf_dir) / "vocab.json").is_file():
        meta["tokenizer_dir"] = str(Path(hf_dir).resolve())
    if training_config is not None:
        from helpers import training

        optimizer, _ = training.build_optimizer(model, training_config)
        checkpointing.init_optimizer_state(optimizer)
        scheduler = training.build_scheduler(optimizer, training_config)
        state = checkpointing.sharded_state_dict(model, optimizer, scheduler, iteration=iteration,
                                                 consumed_train_samples=0, layout=(1, 1, 1))
        meta["tokenizer_dir"] = str(training_config.tokenizer_path)
    else:
        state = {"model": model.sharded_state_dict(), "iteration": iteration, "checkpoint_version": 3.0}
    if overwrite and ckpt_dir.exists():
        shutil.rmtree(ckpt_dir)
    return checkpointing.save_checkpoint(ckpt_dir, iteration, state, meta)


# =========================================================================== tensor parallelism under torchrun
@dataclass
class TensorParallelRun:
    """:func:`run_tensor_parallel`: logits ``[b, s, padded_vocab]`` gathered over TP ranks (or None),
    the checkpoint saved (or None), the launch's wall seconds."""

    logits: torch.Tensor | None
    saved: Path | None
    wall_seconds: float


def run_tensor_parallel(tensor_model_parallel_size: int, *, load: str | os.PathLike | None = None,
                        model_config: ModelConfig | None = None, tokens: torch.Tensor | None = None,
                        save: str | os.PathLike | None = None, iteration: int | None = None, seed: int = 1234,
                        workdir: str | os.PathLike | None = None, timeout_s: float = 300.0,
                        on_line: Callable[[str], None] | None = None, cpu: bool = True) -> TensorParallelRun:
    """Run a megatron-core GPT with tensor parallelism in ``torchrun`` processes (gloo on CPU).

    Either loads a torch_dist checkpoint into a ``GPTModel`` split over
    ``tensor_model_parallel_size`` ranks (``dist_checkpointing`` reshards: any saved TP size
    loads), or initialises one randomly from ``model_config`` and ``seed``. Then optionally
    computes the logits of ``tokens`` (each rank holds a vocabulary slice; they are all-gathered
    over the tensor-parallel group) and saves the model in this TP layout
    (``helpers.checkpointing.save_checkpoint``, with ``model_config.json``).

    Args:
        tensor_model_parallel_size: processes = TP size.
        load: checkpoints folder or ``iter_NNNNNNN`` folder to load (exclusive with ``model_config``).
        model_config: random initialisation instead of ``load``.
        tokens: int64 ``[b, s]`` to run forward.
        save: checkpoints folder to write (must not hold a checkpoint).
        iteration: iteration number for ``save`` (default: the loaded one, or 0).
        workdir: folder for the exchanged files (default: a temporary folder, removed).
        timeout_s: launch time limit (s).
        cpu: run on the CPU over gloo (``CUDA_VISIBLE_DEVICES=""``), so a machine with fewer
            GPUs than ranks works too and the logits are fp32 CPU results like the reference's.

    Returns:
        :class:`TensorParallelRun`.

    Raises:
        ValueError: neither or both of ``load`` / ``model_config``.
        FileExistsError: ``save`` already holds a checkpoint.
        helpers.launch.LaunchError: a rank failed or the job timed out.
    """
    from helpers import launch

    if (load is None) == (model_config is None):
        raise ValueError("pass exactly one of load= (a checkpoint) or model_config= (random initialisation)")
    if save is not None and (Path(save) / checkpointing.TRACKER_FILE).exists():
        raise FileExistsError(f"{save} already holds a checkpoint: choose an empty folder")
    own_tmp = workdir is None
    work = Path(tempfile.mkdtemp(prefix="tp-run-")) if own_tmp else Path(workdir)
    work.mkdir(parents=True, exist_ok=True)
    try:
        args = ["helpers.conversion", "tp-run", "--tp", str(tensor_model_parallel_size), "--seed", str(seed)]
        if load is not None:
            args += ["--load", str(Path(load).resolve())]
        else:
            cfg_path = work / "model_config.json"
            cfg_path.write_text(json.dumps(model_config.to_dict()))
            args += ["--init-config", str(cfg_path)]
        logits_path = None
        if tokens is not None:
            torch.save(tokens.long(), work / "tokens.pt")
            logits_path = work / "logits.pt"
            args += ["--tokens", str(work / "tokens.pt"), "--logits-out", str(logits_path)]
        if save is not None:
            args += ["--save", str(Path(save).resolve())]
        if iteration is not None:
            args += ["--iteration", str(iteration)]
        res = launch.torchrun(args, nproc_per_node=tensor_model_parallel_size, timeout_s=timeout_s, on_line=on_line,
                              env={"CUDA_VISIBLE_DEVICES": ""} if cpu else None)
        logits = torch.load(logits_path) if logits_path is not None else None
        saved = checkpointing.iteration_dir(save, checkpointing.latest_iteration(save)) if save is not None else None
        return TensorParallelRun(logits, saved, res.wall_seconds)
    finally:
        if own_tmp:
            shutil.rmtree(work, ignore_errors=True)


def load_into_model(model, folder: str | os.PathLike) -> None:
    """Load a torch_dist checkpoint's model weights into a ``GPTModel`` of any TP layout (resharding).

    ``dist_checkpointing.load`` reads, for each of this rank's ``ShardedTensor`` s, the slice
    at its global offset, whatever tensor-parallel size saved it; vocabulary rows beyond
    this layout's padded size are dropped, missing ones are zero (``allow_shape_mismatch``).
    ``_extra_state`` entries (no weights) are not requested.

    Raises:
        ConversionError: a model weight the checkpoint did not provide.
    """
    from megatron.core import dist_checkpointing

    sharded = {k: v for k, v in model.sharded_state_dict().items() if not k.endswith("._extra_state")}
    loaded = dist_checkpointing.load(sharded, str(folder))
    result = model.load_state_dict({k: loaded[k] for k in sharded}, strict=False)
    bad = [k for k in result.missing_keys if not k.endswith("._extra_state")] + list(result.unexpected_keys)
    if bad:
        raise ConversionError(f"checkpoint {folder} did not provide {bad}")


def _tp_run_main(args: argparse.Namespace) -> int:
    """Worker of :func:`run_tensor_parallel` (every torchrun rank runs it)."""
    import torch.distributed as dist
    from megatron.core import parallel_state

    from helpers import model as model_lib
    from helpers import training

    training.initialize_distributed(args.tp, 1, args.seed)
    iteration = args.iteration
    if args.load:
        folder, it, fmt = find_checkpoint(args.load)
        if fmt != "torch_dist":
            raise ConversionError(f"--load {args.load}: a torch_dist checkpoint is needed")
        meta = _read_meta(folder, None)
        iteration = iteration if iteration is not None else (it or 0)
    else:
        meta = ModelConfig.from_dict(json.loads(Path(args.init_config).read_text())).to_metadata(args.tp)
        iteration = iteration or 0
    cfg = model_config_from_metadata(meta)
    model = model_lib.build_model(cfg, layer_spec="local").eval()
    if args.load:
        load_into_model(model, folder)
    rank = dist.get_rank()
    if args.tokens:
        tokens = torch.load(args.tokens).long()
        position_ids = torch.arange(tokens.shape[1]).unsqueeze(0).expand_as(tokens)
        with torch.no_grad():
            local = model(tokens, position_ids, None).float().contiguous()
        # Each rank holds a vocabulary slice [b, s, V_pad / TP]; gather them in rank order, as
        # megatron-core's gather_from_tensor_model_parallel_region does (mappings.py:91 allocates
        # on torch.cuda.current_device(), so the all-gather is called directly here).
        group = parallel_state.get_tensor_model_parallel_group()
        parts = [torch.empty_like(local) for _ in range(args.tp)]
        dist.all_gather(parts, local, group=group)
        full = torch.cat(parts, dim=-1)
        if rank == 0:
            torch.save(full, args.logits_out)
        print(f"> rank {rank}: TP={args.tp} local logits {tuple(local.shape)} -> gathered {tuple(full.shape)}", flush=True)
    if args.save:
        out_meta = {**meta, **cfg.to_metadata(args.tp), "iteration": iteration, "tensor_model_parallel_size": args.tp,
                    "pipeline_model_parallel_size": 1, "data_parallel_size": parallel_state.get_data_parallel_world_size(),
                    "layer_spec": "local", "checkpoint_format": "torch_dist"}
        state = {"model": model.sharded_state_dict(), "iteration": iteration, "checkpoint_version": 3.0}
        folder_out = checkpointing.save_checkpoint(args.save, iteration, state, out_meta)
        if rank == 0:
            print(f"> saved TP={args.tp} checkpoint to {folder_out}", flush=True)
    dist.barrier()
    training.destroy_distributed()
    return 0


# =========================================================================== the guide's 2022 converter
def legacy_converter_report(checkpoint: str | os.PathLike) -> dict[str, Any]:
    """Why the guide's 2022 command does not apply to a megatron-core checkpoint, as facts.

    Returns:
        ``{"command", "converter_in_installed_transformers" (bool), "legacy_file"
        (mp_rank_00/model_optim_rng.pt present?), "checkpoint_files" (first names),
        "checkpoint_keys" (first model keys), "legacy_keys_present" (any
        ``language_model`` key)}``.
    """
    import importlib.util

    folder, _, fmt = find_checkpoint(checkpoint)
    try:
        converter = importlib.util.find_spec(LEGACY_CONVERTER_MODULE) is not None
    except ModuleNotFoundError:
        converter = False
    keys: list[str] = []
    if fmt == "torch_dist":
        from megatron.core import dist_checkpointing

        with _process_group():
            keys = sorted(k for k in dist_checkpointing.load_tensors_metadata(str(folder))
                          if not k.startswith(NON_MODEL_KEY_PREFIXES))
    return {
        "command": GUIDE_2022_COMMAND,
        "converter_in_installed_transformers": converter,
        "legacy_file": (folder / "mp_rank_00" / "model_optim_rng.pt").is_file() if folder.is_dir() else False,
        "checkpoint_format": fmt,
        "checkpoint_files": sorted(p.name for p in folder.iterdir())[:8] if folder.is_dir() else [folder.name],
        "checkpoint_keys": keys[:6],
        "legacy_keys_present": any("language_model" in k for k in keys),
    }


# =========================================================================== command line
def main(argv: list[str] | None = None) -> int:
    """``python -m helpers.conversion {to-hf,to-megatron,tp-run} ...``."""
    parser = argparse.ArgumentParser(prog="python -m helpers.conversion", description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("to-hf", help="megatron-core checkpoint -> transformers folder")
    p.add_argument("checkpoint")
    p.add_argument("output_dir")
    p.add_argument("--tokenizer-dir", default=None)
    p.add_argument("--iteration", type=int, default=None)
    p.add_argument("--overwrite", action="store_true")
    p = sub.add_parser("to-megatron", help="transformers GPT-2 folder -> megatron-core checkpoint (model only)")
    p.add_argument("hf_dir")
    p.add_argument("checkpoint_dir")
    p.add_argument("--iteration", type=int, default=0)
    p.add_argument("--overwrite", action="store_true")
    p = sub.add_parser("tp-run", help="(torchrun worker) load or init a TP model, logits, save")
    p.add_argument("--tp", type=int, required=True)
    p.add_argument("--load", default=None)
    p.add_argument("--init-config", default=None)
    p.add_argument("--tokens", default=None)
    p.add_argument("--logits-out", default=None)
    p.add_argument("--save", default=None)
    p.add_argument("--iteration", type=int, default=None)
    p.add_argument("--seed", type=int, default=1234)
    args = parser.parse_args(argv)
    if args.command == "tp-run":
        return _tp_run_main(args)
    try:
        if args.command == "to-hf":
            r = convert_to_hf(args.checkpoint, args.output_dir, tokenizer_dir=args.tokenizer_dir,
                              iteration=args.iteration, overwrite=args.overwrite)
            print(f"wrote {r.output_dir} ({r.num_parameters:,} parameters, vocab {r.vocab_size}, "
                  f"{r.activation_function}, {r.padded_rows_removed} padding rows removed)")
        else:
            print(f"wrote {hf_to_megatron_checkpoint(args.hf_dir, args.checkpoint_dir, iteration=args.iteration, overwrite=args.overwrite)}")
    except (ConversionError, FileExistsError, FileNotFoundError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
