"""megatron-core GPT <-> Hugging Face transformers GPT-2: one weight map, used in both directions (notebook 06).

It stands in for transformers' ``convert_megatron_gpt2_checkpoint.py``, which reads the legacy key
layout, not megatron-core's torch_dist ``embedding.*`` / ``decoder.layers.*`` keys.
Read in order: :data:`WEIGHT_MAP` (with :data:`TRANSPOSED`, :data:`QKV_PERMUTED`, :data:`VOCAB_ROWS`),
:func:`tensor_to_hf`, :func:`megatron_to_hf_state_dict`, :func:`gpt2_config`,
:func:`load_megatron_checkpoint`, :func:`convert_to_hf`. Notebook 06 proves the result with
``helpers/demos/conversion_proofs.py``. Sources: megatron-core 0.19.2 ``models/gpt/gpt_model.py``,
``transformer/attention.py`` (``get_query_key_value_tensors``), ``dist_checkpointing/serialization.py``;
transformers ``models/gpt2/modeling_gpt2.py`` (``Conv1D``); litgpt ``scripts/convert_lit_checkpoint.py``
(the weight-map style); Megatron-LM ``tools/checkpoint/saver_mcore.py`` (padding rows).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping

import torch

from helpers.learn import checkpointing, llama, megatron_lm
from helpers.support import results, safe_load
from helpers.support.environment import package_version
from helpers.support.safe_load import ConversionError  # the error of every reader below the converter
from helpers.learn.model import GELU_HF_NAME, ModelConfig
from helpers.learn.weight_names import check_keys, layer_template, without_tied_copy

#: Tokenizer files copied into the transformers folder (what ``AutoTokenizer`` reads offline).
TOKENIZER_FILES: tuple[str, ...] = ("vocab.json", "merges.txt", "tokenizer.json", "tokenizer_config.json")
#: Optional tokenizer files copied when present.
OPTIONAL_TOKENIZER_FILES: tuple[str, ...] = ("special_tokens_map.json", "added_tokens.json")
#: Provenance file written next to ``config.json``.
CONVERSION_FILE = "conversion.json"

# =========================================================================== the weight map
#: megatron-core ``GPTModel`` name (local layer spec) -> transformers ``GPT2LMHeadModel`` name; ``{}`` is the layer.
WEIGHT_MAP: dict[str, str] = {
    "embedding.word_embeddings.weight": "transformer.wte.weight",
    "embedding.position_embeddings.weight": "transformer.wpe.weight",
    "decoder.layers.{}.input_layernorm.weight": "transformer.h.{}.ln_1.weight",
    "decoder.layers.{}.input_layernorm.bias": "transformer.h.{}.ln_1.bias",
    "decoder.layers.{}.self_attention.linear_qkv.weight": "transformer.h.{}.attn.c_attn.weight",
    "decoder.layers.{}.self_attention.linear_qkv.bias": "transformer.h.{}.attn.c_attn.bias",
    "decoder.layers.{}.self_attention.linear_proj.weight": "transformer.h.{}.attn.c_proj.weight",
    "decoder.layers.{}.self_attention.linear_proj.bias": "transformer.h.{}.attn.c_proj.bias",
    "decoder.layers.{}.pre_mlp_layernorm.weight": "transformer.h.{}.ln_2.weight",
    "decoder.layers.{}.pre_mlp_layernorm.bias": "transformer.h.{}.ln_2.bias",
    "decoder.layers.{}.mlp.linear_fc1.weight": "transformer.h.{}.mlp.c_fc.weight",
    "decoder.layers.{}.mlp.linear_fc1.bias": "transformer.h.{}.mlp.c_fc.bias",
    "decoder.layers.{}.mlp.linear_fc2.weight": "transformer.h.{}.mlp.c_proj.weight",
    "decoder.layers.{}.mlp.linear_fc2.bias": "transformer.h.{}.mlp.c_proj.bias",
    "decoder.final_layernorm.weight": "transformer.ln_f.weight",
    "decoder.final_layernorm.bias": "transformer.ln_f.bias",
    "output_layer.weight": "lm_head.weight",  # absent when tied to the word embeddings
}
#: The other direction: transformers name -> megatron-core name.
HF_WEIGHT_MAP: dict[str, str] = {hf: mc for mc, hf in WEIGHT_MAP.items()}
#: ``nn.Linear`` weights ``[out, in]``; GPT-2's ``Conv1D`` stores ``[in, out]``: transposed.
TRANSPOSED: frozenset[str] = frozenset({
    "decoder.layers.{}.self_attention.linear_qkv.weight", "decoder.layers.{}.self_attention.linear_proj.weight",
    "decoder.layers.{}.mlp.linear_fc1.weight", "decoder.layers.{}.mlp.linear_fc2.weight"})
#: Rows in megatron-core's per-head q, k, v order: reordered by :func:`qkv_row_permutation`.
QKV_PERMUTED: frozenset[str] = frozenset({
    "decoder.layers.{}.self_attention.linear_qkv.weight", "decoder.layers.{}.self_attention.linear_qkv.bias"})
#: One row per vocabulary entry: Megatron's padding rows are dropped (and added back the other way).
VOCAB_ROWS: frozenset[str] = frozenset({"embedding.word_embeddings.weight", "output_layer.weight"})
#: Transformer Engine layer-norm names (fused into the next linear) -> the local spec's names.
_TE_LAYERNORM_NAMES: dict[str, str] = {
    "self_attention.linear_qkv.layer_norm_weight": "input_layernorm.weight",
    "self_attention.linear_qkv.layer_norm_bias": "input_layernorm.bias",
    "mlp.linear_fc1.layer_norm_weight": "pre_mlp_layernorm.weight",
    "mlp.linear_fc1.layer_norm_bias": "pre_mlp_layernorm.bias",
}
#: Linear layers whose bias a GPT-2 needs (``add_bias_linear=True``).
_LINEARS = ("self_attention.linear_qkv", "self_attention.linear_proj", "mlp.linear_fc1", "mlp.linear_fc2")


def _weight_template(name: str) -> str:
    """The :data:`WEIGHT_MAP` key of a megatron-core weight name (a template or one layer's name).

    Raises:
        ConversionError: no such weight; the message lists the templates.
    """
    if (template := layer_template(name)[0]) in WEIGHT_MAP:
        return template
    raise ConversionError(f"{name!r} is no megatron-core GPT weight: pass one of the WEIGHT_MAP keys {list(WEIGHT_MAP)}")


# =========================================================================== the QKV permutation
def qkv_row_permutation(num_heads: int, head_dim: int) -> torch.Tensor:
    """Row order that turns megatron-core's per-head QKV rows into GPT-2's q | k | v order.

    ``hf_rows = megatron_rows[perm]``: megatron-core stores row ``(head, part, d)`` at
    ``head * 3 * head_dim + part * head_dim + d`` (part 0/1/2 = q/k/v); GPT-2 stores it at
    ``part * hidden + head * head_dim + d``. ``torch.argsort(perm)`` is the way back.

    Returns:
        int64 ``[3 * num_heads * head_dim]``, a permutation.
    """
    idx = torch.arange(3 * num_heads * head_dim).view(num_heads, 3, head_dim)
    return idx.transpose(0, 1).reshape(-1)


def _qkv_permutation_of(tensor: torch.Tensor, num_heads: int, what: str) -> torch.Tensor:
    rows = tensor.shape[0]
    hidden = tensor.shape[1] if tensor.ndim == 2 else rows // 3
    if num_heads < 1 or hidden % num_heads:
        raise ConversionError(f"{what}: hidden size {hidden} is not divisible by num_heads={num_heads}")
    if rows != 3 * hidden:
        raise ConversionError(
            f"{what} has {rows} rows, not 3 x hidden size = {3 * hidden}: queries, keys and values of "
            "different sizes mean grouped-query attention (num_query_groups < heads), which GPT-2 cannot hold")
    return qkv_row_permutation(num_heads, hidden // num_heads)


def tensor_to_hf(template: str, tensor: torch.Tensor, num_heads: int, vocab_size: int | None = None) -> torch.Tensor:
    """One megatron-core weight as GPT-2 holds it: QKV rows regrouped, vocabulary trimmed, Conv1D transpose.

    Args:
        template: its :data:`WEIGHT_MAP` key (``decoder.layers.{}....``), or one layer's name of it.
        tensor: megatron-core layout, e.g. ``linear_qkv.weight`` ``[3h, h]``, ``linear_fc1.weight`` ``[4h, h]``.
        num_heads: attention heads (not inferable from shapes).
        vocab_size: rows to keep of a :data:`VOCAB_ROWS` tensor (the tokenizer's size); None keeps all.

    Returns:
        A new contiguous tensor, same dtype (``c_attn.weight`` ``[h, 3h]``, ``c_fc.weight`` ``[h, 4h]``...).

    Raises:
        ConversionError: QKV shapes of grouped-query attention, or heads not dividing h; a
            ``template`` that names no weight of the map (the message lists the templates).
    """
    template = _weight_template(template)
    if template in QKV_PERMUTED:
        tensor = tensor[_qkv_permutation_of(tensor, num_heads, template)]
    if template in VOCAB_ROWS and vocab_size is not None:
        tensor = tensor[:vocab_size]
    if template in TRANSPOSED:
        tensor = tensor.t()
    return tensor.clone(memory_format=torch.contiguous_format)


def tensor_to_megatron(template: str, tensor: torch.Tensor, num_heads: int,
                       padded_vocab_size: int | None = None) -> torch.Tensor:
    """Inverse of :func:`tensor_to_hf` (``template`` is still the megatron-core name).

    A :data:`VOCAB_ROWS` tensor gets ``padded_vocab_size`` rows (:func:`_resize_vocab_rows`).

    Raises:
        ConversionError: ``c_attn`` not ``[h, 3h]``, or heads not dividing h; an unknown ``template``.
    """
    template = _weight_template(template)
    if template in TRANSPOSED:
        tensor = tensor.t()
    if template in QKV_PERMUTED:
        tensor = tensor[torch.argsort(_qkv_permutation_of(tensor, num_heads, template))]
    if template in VOCAB_ROWS and padded_vocab_size is not None:
        tensor = _resize_vocab_rows(tensor, padded_vocab_size)
    return tensor.clone(memory_format=torch.contiguous_format)


def _resize_vocab_rows(tensor: torch.Tensor, rows: int) -> torch.Tensor:
    """Trim or pad the vocabulary dimension (dim 0) to ``rows``.

    Trimming drops Megatron's padding rows (never a token id). Padding repeats the last row
    (Megatron-LM ``tools/checkpoint/saver_mcore.py``), so padded ids score like the last real one.

    Returns:
        ``[rows, ...]``, same dtype.
    """
    if tensor.shape[0] >= rows:
        return tensor[:rows]
    return torch.cat([tensor, tensor[-1:].expand(rows - tensor.shape[0], *tensor.shape[1:])], dim=0)


# =========================================================================== checks
def _as_metadata(model_config: ModelConfig | Mapping[str, Any]) -> dict[str, Any]:
    return model_config.to_metadata() if isinstance(model_config, ModelConfig) else dict(model_config)


def check_architecture(meta: Mapping[str, Any], state_dict: Mapping[str, Any] | None = None) -> None:
    """Refuse models GPT-2 cannot represent, naming every reason.

    GPT-2 is: learned absolute positions, LayerNorm with bias, 4 projections with biases,
    GELU (erf or tanh) without gating, as many key/value heads as query heads. Checked from
    the metadata (``position_embedding_type``, ``normalization``, ``gated_linear_unit`` /
    ``swiglu``, ``num_query_groups``, ``add_bias_linear``, ``gelu``, ``num_experts``; no other key is looked at)
    and, when given, from the tensors of a (local-spec-named) state dict (no position table = RoPE, LayerNorm without
    bias = RMSNorm, ``linear_fc1`` twice as wide as ``linear_fc2`` = gated MLP, QKV rows
    != 3h = grouped-query attention).

    Raises:
        ConversionError: the reasons, one per line.
    """
    r: list[str] = []
    if meta.get("num_experts"):
        r.append(f"num_experts={meta['num_experts']} (a mixture of experts: GPT2LMHeadModel has one MLP per layer)")
    if meta.get("position_embedding_type", "learned_absolute") != "learned_absolute":
        r.append(f"position_embedding_type={meta['position_embedding_type']!r} (GPT-2 has a learned absolute "
                 "position table; RoPE is not representable)")
    if meta.get("normalization", "LayerNorm") != "LayerNorm":
        r.append(f"normalization={meta['normalization']!r} (GPT-2 uses LayerNorm with a bias; RMSNorm has none)")
    if meta.get("gated_linear_unit") or meta.get("swiglu"):
        r.append("gated linear unit / SwiGLU MLP (GPT-2's MLP is fc -> GELU -> proj without a gate)")
    if meta.get("gelu", "erf") not in GELU_HF_NAME:
        r.append(f"gelu={meta['gelu']!r} (expected 'erf' or 'tanh')")
    if meta.get("num_query_groups") not in (None, meta.get("num_attention_heads")):
        r.append(f"num_query_groups={meta['num_query_groups']} < num_attention_heads={meta.get('num_attention_heads')} "
                 "(grouped-query attention; GPT-2 has one key/value head per query head)")
    if meta.get("add_bias_linear") is False:
        r.append("add_bias_linear=False (GPT-2's linear layers all have biases)")
    if state_dict is not None:
        sd, h, said = state_dict, int(meta.get("hidden_size", 0)), " ".join(r)
        layer0 = {k[len("decoder.layers.0."):] for k in sd if k.startswith("decoder.layers.0.")}
        fc1, fc2 = sd.get("decoder.layers.0.mlp.linear_fc1.weight"), sd.get("decoder.layers.0.mlp.linear_fc2.weight")
        qkv = sd.get("decoder.layers.0.self_attention.linear_qkv.weight")
        if "embedding.word_embeddings.weight" in sd and "embedding.position_embeddings.weight" not in sd and "RoPE" not in said:
            r.append("no embedding.position_embeddings.weight (rotary or no position embedding: GPT-2 needs a learned table)")
        if "input_layernorm.weight" in layer0 and "input_layernorm.bias" not in layer0 and "RMSNorm" not in said:
            r.append("layer norms without bias (RMSNorm): GPT-2's LayerNorm has a bias")
        if fc1 is not None and fc2 is not None and fc1.shape[0] == 2 * fc2.shape[1] and "gated" not in said:
            r.append(f"linear_fc1 has {fc1.shape[0]} rows = 2 x linear_fc2 input {fc2.shape[1]}: a gated (SwiGLU) MLP")
        if qkv is not None and h and qkv.ndim == 2 and qkv.shape[1] != h:  # not an architecture: a wrong description
            raise ConversionError(f"the weights do not match the model's description: linear_qkv is {list(qkv.shape)} but "
                                  f"hidden_size={h} (model_config.json or the checkpoint's args): pass the config they were trained with")
        if qkv is not None and h and qkv.shape[0] != 3 * h and "grouped" not in said:
            r.append(f"linear_qkv has {qkv.shape[0]} rows, not 3 x {h}: grouped-query attention")
        if any(f"{lin}.weight" in layer0 and f"{lin}.bias" not in layer0 for lin in _LINEARS) and "bias_linear" not in said:
            r.append("linear layers without bias (add_bias_linear=False): GPT-2's linear layers all have biases")
    if r:
        raise ConversionError(
            "this checkpoint is not a GPT-2 architecture and cannot become a transformers GPT2LMHeadModel:\n  - "
            + "\n  - ".join(r) + "\nA Llama (all of RoPE, RMSNorm, SwiGLU, no biases) converts to "
            "LlamaForCausalLM: its metadata says architecture='llama' (helpers.learn.model.ARCHITECTURES).")


def _expected_keys(names, num_layers: int, tied: bool) -> list[str]:
    """Every weight name of a GPT-2 of ``num_layers`` layers, from the map's templates."""
    out: list[str] = []
    for name in names:
        if "{}" in name:
            out += [name.format(i) for i in range(num_layers)]
        elif not (tied and name in ("output_layer.weight", "lm_head.weight")):
            out.append(name)
    return out


def _account(found: set[str], expected: list[str], what: str) -> None:
    check_keys(found, expected, what, "a GPT-2 megatron-core model",
               "Check num_layers / tied embeddings in the model config, or the checkpoint's origin.")


def _normalize_megatron_state_dict(state_dict: Mapping[str, Any]) -> tuple[dict[str, torch.Tensor], list[str]]:
    """Local-spec key names, weights only.

    Transformer Engine layer-norm names (:data:`_TE_LAYERNORM_NAMES`) become the local spec's;
    ``_extra_state`` entries (None, or TE's FP8 metadata) carry no weights and are set aside; a
    leading ``model.`` / ``module.`` is stripped (Megatron-LM's ``{"model": ...}``, DDP's ``module.``).

    Returns:
        ``(tensors, extra_state_keys)``.

    Raises:
        ConversionError: a value that is neither a tensor nor ``_extra_state``; a name twice.
    """
    out: dict[str, torch.Tensor] = {}
    extra: list[str] = []
    for key, value in state_dict.items():
        name = key.removeprefix("model.").removeprefix("module.")
        if name.endswith("._extra_state"):
            extra.append(key)
            continue
        m = re.match(r"^decoder\.layers\.(\d+)\.(.+)$", name)
        if m and m[2] in _TE_LAYERNORM_NAMES:
            name = f"decoder.layers.{m[1]}.{_TE_LAYERNORM_NAMES[m[2]]}"
        if not isinstance(value, torch.Tensor):
            raise ConversionError(f"state dict entry {key!r} is a {type(value).__name__}, not a tensor")
        if name in out:
            raise ConversionError(f"state dict has {key!r} twice (after normalising names to {name!r})")
        out[name] = value
    return out, extra


# =========================================================================== whole state dicts
def megatron_to_hf_state_dict(state_dict: Mapping[str, Any], model_config: ModelConfig | Mapping[str, Any],
                              vocab_size: int | None = None) -> dict[str, torch.Tensor]:
    """A megatron-core GPT state dict (TP=1 layout) as a transformers ``GPT2LMHeadModel`` state dict.

    Each key is renamed by :data:`WEIGHT_MAP` and its tensor converted by :func:`tensor_to_hf`.

    Args:
        state_dict: ``GPTModel.state_dict()`` names (local or Transformer Engine spec), or
            ``helpers.learn.checkpointing.read_model_tensors`` of a torch_dist checkpoint. Word embeddings
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
    tensors, _ = _normalize_megatron_state_dict(state_dict)
    check_architecture(meta, tensors)
    num_layers, heads, h = int(meta["num_layers"]), int(meta["num_attention_heads"]), int(meta["hidden_size"])
    tied = bool(meta.get("tied_embeddings", meta.get("share_embeddings_and_output_weights", True)))
    tensors = without_tied_copy(tensors, "output_layer.weight", "embedding.word_embeddings.weight", tied,
                                "set tied_embeddings=False (share_embeddings_and_output_weights=False) in the model config")
    _account(set(tensors), _expected_keys(WEIGHT_MAP, num_layers, tied), "megatron-core state dict")
    vocab = int(vocab_size if vocab_size is not None else meta["vocab_size"])
    wte = tensors["embedding.word_embeddings.weight"]
    if wte.shape[1] != h:
        raise ConversionError(f"embedding.word_embeddings.weight is {tuple(wte.shape)} but hidden_size={h}")
    if wte.shape[0] < vocab:
        raise ConversionError(f"embedding.word_embeddings.weight has {wte.shape[0]} rows, fewer than the tokenizer's "
                              f"{vocab} entries: this checkpoint was trained with another tokenizer")
    out: dict[str, torch.Tensor] = {}
    for key, tensor in tensors.items():
        template, layer = layer_template(key)
        out[WEIGHT_MAP[template].format(layer)] = tensor_to_hf(template, tensor, heads, vocab)
    if tied:
        out["lm_head.weight"] = out["transformer.wte.weight"]
    return out


def hf_to_megatron_state_dict(hf_state_dict: Mapping[str, torch.Tensor], num_attention_heads: int,
                              padded_vocab_size: int, *, tied: bool = True) -> dict[str, torch.Tensor]:
    """Inverse of :func:`megatron_to_hf_state_dict`: :data:`HF_WEIGHT_MAP` and :func:`tensor_to_megatron`.

    Args:
        hf_state_dict: ``GPT2LMHeadModel.state_dict()`` (``transformer.`` prefix optional; the
            attention-mask buffers ``attn.bias`` / ``attn.masked_bias`` are not weights).
        num_attention_heads: heads (``config.n_head``).
        padded_vocab_size: rows of the megatron-core embedding (padding repeats the last row).
        tied: the output layer is the word embedding (no ``output_layer.weight``).

    Returns:
        ``GPTModel.state_dict()`` weights (no ``_extra_state``), TP=1 layout.

    Raises:
        ConversionError: unknown or missing keys (listed); an untied ``lm_head`` when ``tied`` is True.
    """
    sd = {k if k.startswith(("transformer.", "lm_head.")) else f"transformer.{k}": v for k, v in hf_state_dict.items()}
    sd = {k: v for k, v in sd.items() if not re.match(r"^transformer\.h\.\d+\.attn\.(masked_)?bias$", k)}
    layers = [layer for k in sd if (layer := layer_template(k)[1]) is not None]
    sd = without_tied_copy(sd, "lm_head.weight", "transformer.wte.weight", tied, "pass tied=False")
    _account(set(sd), _expected_keys(HF_WEIGHT_MAP, max(layers, default=-1) + 1, tied), "transformers GPT-2 state dict")
    out: dict[str, torch.Tensor] = {}
    for key, tensor in sd.items():
        template, layer = layer_template(key)
        name = HF_WEIGHT_MAP[template]
        out[name.format(layer)] = tensor_to_megatron(name, tensor, num_attention_heads, padded_vocab_size)
    return out


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
    cfg = checkpointing.model_config_from_metadata(meta)
    return GPT2Config(
        vocab_size=int(vocab_size if vocab_size is not None else cfg.vocab_size), n_positions=cfg.max_position_embeddings,
        n_embd=cfg.hidden_size, n_layer=cfg.num_layers, n_head=cfg.num_attention_heads, n_inner=cfg.ffn_size,
        activation_function=GELU_HF_NAME[meta.get("gelu", cfg.gelu)], resid_pdrop=cfg.hidden_dropout,
        embd_pdrop=cfg.hidden_dropout, attn_pdrop=cfg.attention_dropout, layer_norm_epsilon=cfg.layernorm_epsilon,
        initializer_range=cfg.init_method_std, tie_word_embeddings=cfg.share_embeddings_and_output_weights,
        bos_token_id=eod_id, eos_token_id=eod_id, pad_token_id=eod_id, architectures=["GPT2LMHeadModel"],
    )


# =========================================================================== reading megatron-core checkpoints
@dataclass
class MegatronCheckpoint:
    """A megatron-core GPT read from disk (or given in memory), in TP=1 layout.

    Attributes:
        state_dict: local-spec module names -> full (merged) tensors; word embeddings keep the
            padding rows of the saving layout.
        meta: ``model_config.json`` (``ModelConfig.to_metadata`` + iteration, parallel sizes,
            tokenizer_dir, precision when written by the series).
        source: the file or ``iter_NNNNNNN`` folder read.
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


def _is_torch_dist(path: Path) -> bool:
    return path.is_dir() and (path / ".metadata").is_file() and (path / "metadata.json").is_file()


def find_checkpoint(path: str | os.PathLike, iteration: int | None = None) -> tuple[Path, int | None, str]:
    """Resolve ``path`` to the checkpoint to read.

    Accepts a checkpoints folder with ``latest_checkpointed_iteration.txt`` (latest, or
    ``iteration``), an ``iter_NNNNNNN`` torch_dist folder, or a ``.pt``/``.pth`` file holding a
    plain state dict; and Megatron-LM's legacy layouts (``mp_rank_XX/model_optim_rng.pt``, a
    ``release`` tracker: ``helpers.learn.megatron_lm.find_checkpoint``).

    Returns:
        ``(path, iteration or None, "torch_dist" | "state_dict" | "torch")`` (``"torch"``: Megatron-LM's legacy format).

    Raises:
        FileNotFoundError: nothing at ``path``, or a checkpoints folder without that iteration.
        ConversionError: ``path`` exists but is none of the above (the message says what was
            expected and what was found).
    """
    p = Path(path).expanduser()
    if not p.exists():
        raise FileNotFoundError(f"checkpoint path {str(path)!r} does not exist: train first (notebook 03) or fix the path")
    if (legacy := megatron_lm.find_checkpoint(p, iteration)) is not None:
        return legacy
    if p.is_file():
        if p.suffix in (".pt", ".pth", ".bin"):
            return p, None, "state_dict"
        raise ConversionError(f"{p} is a file but not a .pt/.pth state dict: pass a checkpoints folder, an iter_NNNNNNN folder or a .pt file")
    if _is_torch_dist(p):
        return p, checkpointing.iteration_of(p), "torch_dist"
    if (p / checkpointing.TRACKER_FILE).is_file() or iteration is not None:
        it = iteration if iteration is not None else checkpointing.latest_iteration(p)
        folder = checkpointing.iteration_dir(p, it)
        if not folder.is_dir():
            raise FileNotFoundError(f"{p} has no iteration {it} ({folder} missing)")
        if not _is_torch_dist(folder):
            raise ConversionError(f"{folder} is not a torch_dist checkpoint (no .metadata): the save may have been interrupted")
        return folder, it, "torch_dist"
    found = sorted(x.name for x in p.iterdir())[:10]
    raise ConversionError(
        f"{p} is not a megatron-core checkpoint: expected {checkpointing.TRACKER_FILE}, an iter_NNNNNNN folder "
        f"with .metadata (torch_dist), or a .pt state dict file; found {found or 'an empty folder'}")


def _read_meta(folder: Path, model_config: ModelConfig | Mapping[str, Any] | None) -> dict[str, Any] | None:
    """``model_config`` or the ``model_config.json`` next to the checkpoint; None: neither (Megatron-LM's own)."""
    if model_config is not None:
        return _as_metadata(model_config)
    found = [c for c in (folder / checkpointing.MODEL_CONFIG_FILE, folder.parent / checkpointing.MODEL_CONFIG_FILE) if c.is_file()]
    return json.loads(found[0].read_text()) if found else None


def load_megatron_checkpoint(source: str | os.PathLike, *,
                             model_config: ModelConfig | Mapping[str, Any] | None = None,
                             iteration: int | None = None, weights_only: bool = True) -> MegatronCheckpoint:
    """Read a megatron-core GPT: torch_dist checkpoint (any TP size) or plain state dict, the series' or Megatron-LM's.

    Without ``model_config`` and ``model_config.json`` the checkpoint is Megatron-LM's own, read by
    ``helpers.learn.megatron_lm.read_checkpoint`` (architecture from its ``args``, weights merged to TP=1).

    Args:
        source: a checkpoints folder (latest iteration), an ``iter_NNNNNNN`` folder, or a ``.pt``
            file of ``model.state_dict()`` (or ``{"model": state_dict}``; an in-memory state dict
            goes straight to :func:`megatron_to_hf_state_dict`) or Megatron-LM's ``model_optim_rng.pt``.
        model_config: the model's ``ModelConfig`` / metadata; default ``model_config.json`` next
            to the checkpoint (written by ``helpers.learn.checkpointing.save_model``), else Megatron-LM's args.
        iteration: with a checkpoints folder, this iteration instead of the latest.
        weights_only: unpickle only tensors and plain data (``torch.load(weights_only=True)``;
            ``helpers.support.safe_load.load_pickle`` for Megatron-LM's files, which allows their
            ``argparse.Namespace``). False runs any code the file names: only for files you trust.

    Returns:
        :class:`MegatronCheckpoint` in TP=1 layout.

    Raises:
        FileNotFoundError, ConversionError: see :func:`find_checkpoint`; no model config and no
            Megatron-LM args; another architecture (checked before reading tensors, from the
            metadata or the args); a file ``weights_only`` cannot read (the message lists why).
    """
    path, it, fmt = find_checkpoint(source, iteration)
    meta = _read_meta(path if path.is_dir() else path.parent, model_config)
    if meta is None or fmt == "torch":  # Megatron-LM's own checkpoint: the architecture from its args
        raw, meta, it, fmt, non_model = megatron_lm.read_checkpoint(path, fmt, meta, weights_only=weights_only)
    else:
        (llama.check_llama if meta.get("architecture") == "llama" else check_architecture)(meta)
        if fmt == "torch_dist":
            raw, non_model = checkpointing.read_model_tensors(path)
        else:
            raw, non_model = safe_load.load_pickle(path, weights_only=weights_only), []
            if not isinstance(raw, Mapping):
                raise ConversionError(f"{path} holds a {type(raw).__name__}, not a state dict")
            raw = raw["model"] if isinstance(raw.get("model"), Mapping) else raw
    tensors, extra = _normalize_megatron_state_dict(raw)
    return MegatronCheckpoint(tensors, meta, str(path), it if it is not None else meta.get("iteration"), fmt, extra, non_model)


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


def _result(out: Path, info: Mapping[str, Any], seconds: float, skipped: bool = False) -> ConversionResult:
    return ConversionResult(out, info["vocab_size"], info["padded_rows_removed"], info["activation_function"],
                            info["tied_embeddings"], info["num_parameters"], info["source"], info["iteration"],
                            info["tensor_model_parallel_size"], seconds, skipped)


def _tokenizer_dir(given: str | os.PathLike | None, ckpt: MegatronCheckpoint) -> Path:
    """The tokenizer folder: the one given, else the one recorded at training time, else the run
    folder's ``data/tokenizer`` next to ``checkpoints/`` (a run folder that was moved)."""
    if given:
        return Path(given).expanduser()
    recorded, src = ckpt.meta.get("tokenizer_dir"), Path(ckpt.source)
    candidates = ([Path(recorded)] if recorded else []) + [p / "data" / "tokenizer" for p in src.parents[1:3]]
    found = [c for c in candidates if (c / "vocab.json").is_file()] + ([Path(recorded)] if recorded else [])
    if found:
        return found[0]
    raise ConversionError("no tokenizer_dir given, none recorded in model_config.json and no data/tokenizer "
                          "in the run folder: pass tokenizer_dir= (the folder training used)")


def _check_tokenizer(tokenizer_dir: Path, meta: Mapping[str, Any]) -> tuple[int, int]:
    from helpers.learn import tokenizer as tokenizer_lib

    if not tokenizer_dir.is_dir():
        raise FileNotFoundError(f"tokenizer folder {tokenizer_dir} does not exist: pass tokenizer_dir= (the folder training used)")
    missing = [n for n in TOKENIZER_FILES if not (tokenizer_dir / n).is_file()]
    if missing:
        raise FileNotFoundError(f"tokenizer folder {tokenizer_dir} lacks {missing}; a transformers folder needs "
                                f"{list(TOKENIZER_FILES)}. Use the tokenizer folder training used (notebook 01).")
    size = tokenizer_lib.vocab_size_of(tokenizer_dir)
    lo, hi = meta.get("vocab_size_range") or (int(meta["vocab_size"]),) * 2  # a range: Megatron-LM's args (padded size only)
    if not lo <= size <= hi:
        raise ConversionError(f"the tokenizer in {tokenizer_dir} has {size} entries but the model was trained with "
                              f"vocab_size={lo if lo == hi else f'{lo}..{hi}'}: pass the tokenizer folder that training used")
    return size, tokenizer_lib.eod_id(tokenizer_dir)


def _prepare_output(output_dir: Path, overwrite: bool) -> None:
    if output_dir.exists() and not output_dir.is_dir():
        raise FileExistsError(f"output_dir={str(output_dir)!r} is a file: pass a folder path")
    if output_dir.is_dir() and any(output_dir.iterdir()) and not overwrite:
        raise FileExistsError(
            f"output folder {output_dir} already exists and is not empty: pass overwrite=True to replace it "
            "(the old folder is kept until the new one is complete) or choose another output_dir")
    output_dir.parent.mkdir(parents=True, exist_ok=True)


def _publish(tmp: Path, output_dir: Path) -> None:
    """Move a finished temporary folder into place, readable as ``mkdir`` would make it (mkdtemp's
    is 0700, safetensors' file 0600); an old folder is removed only then."""
    if output_dir.exists():
        shutil.rmtree(output_dir)
    os.replace(results.default_modes(tmp), output_dir)


def convert_to_hf(source: str | os.PathLike | MegatronCheckpoint, output_dir: str | os.PathLike, *,
                  tokenizer_dir: str | os.PathLike | None = None,
                  model_config: ModelConfig | Mapping[str, Any] | None = None, iteration: int | None = None,
                  overwrite: bool = False, dtype: torch.dtype = torch.float32, weights_only: bool = True) -> ConversionResult:
    """Convert a megatron-core GPT checkpoint into a transformers ``GPT2LMHeadModel`` folder (a Llama-style
    model, ``architecture="llama"`` in its metadata: a ``LlamaForCausalLM`` folder, :mod:`helpers.learn.llama`).

    Writes ``config.json`` (:func:`gpt2_config`), ``model.safetensors`` (read back and compared bit for
    bit), ``generation_config.json`` (EOS = BOS = PAD = EOD), the tokenizer files byte for byte and
    ``conversion.json``, in a temporary folder moved into place at the end.

    Args:
        source: see :func:`load_megatron_checkpoint` (or an already loaded checkpoint).
        output_dir: the transformers folder to create (e.g. ``{run_dir}/hf_model``).
        tokenizer_dir: the tokenizer training used; default the ``tokenizer_dir`` recorded in
            ``model_config.json`` (or ``data/tokenizer`` of the run folder, if that moved).
        model_config: needed when there is no ``model_config.json`` next to the checkpoint.
        iteration: with a checkpoints folder, a given iteration instead of the latest.
        overwrite: replace an existing non-empty ``output_dir`` (only after the new one is complete).
        dtype: dtype of the saved weights (fp32 keeps the checkpoint's fp32 weights exactly).
        weights_only: see :func:`load_megatron_checkpoint` (False: only for a file you trust).

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
    from transformers import GenerationConfig, GPT2LMHeadModel, LlamaForCausalLM

    start = time.perf_counter()
    out = Path(output_dir).expanduser().resolve()
    _prepare_output(out, overwrite)
    ckpt = source if isinstance(source, MegatronCheckpoint) else load_megatron_checkpoint(
        source, model_config=model_config, iteration=iteration, weights_only=weights_only)
    tok_dir = _tokenizer_dir(tokenizer_dir, ckpt)
    vocab, eod = _check_tokenizer(tok_dir, ckpt.meta)
    if ckpt.meta.get("architecture") == "llama":  # RoPE, RMSNorm, SwiGLU, GQA: helpers.learn.llama's map
        hf_sd = llama.megatron_to_llama_state_dict(ckpt.state_dict, ckpt.meta, vocab)
        config = llama.llama_config(ckpt.meta, vocab_size=vocab, eod_id=eod)
        model = LlamaForCausalLM(config)
    else:
        hf_sd = megatron_to_hf_state_dict(ckpt.state_dict, ckpt.meta, vocab)
        config = gpt2_config(ckpt.meta, vocab_size=vocab, eod_id=eod)
        model = GPT2LMHeadModel(config)
    model.load_state_dict({k: v.to(dtype) for k, v in hf_sd.items()}, strict=True)  # raises on a key mismatch
    model = model.to(dtype).eval()
    rows = ckpt.state_dict["embedding.word_embeddings.weight"].shape[0]
    n_params = sum(p.numel() for p in model.parameters())
    tmp = Path(tempfile.mkdtemp(dir=out.parent, prefix=f".{out.name}.tmp-"))
    try:
        model.save_pretrained(str(tmp), safe_serialization=True)
        GenerationConfig(bos_token_id=eod, eos_token_id=eod, pad_token_id=eod).save_pretrained(str(tmp))
        for name in TOKENIZER_FILES + OPTIONAL_TOKENIZER_FILES:
            if (tok_dir / name).is_file():
                shutil.copyfile(tok_dir / name, tmp / name)
        for key, value in load_file(str(tmp / "model.safetensors")).items():
            if not torch.equal(value, hf_sd[key].to(dtype)):
                raise ConversionError(f"model.safetensors does not hold the converted {key} exactly")
        info = {"source": ckpt.source, "format": ckpt.format, "iteration": ckpt.iteration,
                "checkpoint_written_ns": _written_ns(Path(ckpt.source)) if ckpt.source and Path(ckpt.source).exists() else None,
                "tensor_model_parallel_size": int(ckpt.meta.get("tensor_model_parallel_size", 1)),
                "checkpoint_vocab_rows": rows, "vocab_size": vocab, "padded_rows_removed": rows - vocab,
                "activation_function": getattr(config, "activation_function", None) or config.hidden_act,
                "gelu": ckpt.meta.get("gelu"), "architecture": config.architectures[0],
                "tied_embeddings": config.tie_word_embeddings, "num_parameters": n_params, "tokenizer_dir": str(tok_dir),
                "eod_id": eod, "extra_state_keys_skipped": len(ckpt.extra_state_keys),
                "non_model_keys_not_read": len(ckpt.non_model_keys), "dtype": str(dtype).replace("torch.", ""),
                "megatron_core_version": package_version("megatron-core"),
                "transformers_version": package_version("transformers")}
        (tmp / CONVERSION_FILE).write_text(json.dumps(info, indent=2) + "\n")
        _publish(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return _result(out, info, time.perf_counter() - start)


def convert_to_hf_cached(checkpoint_dir: str | os.PathLike, output_dir: str | os.PathLike, *,
                         tokenizer_dir: str | os.PathLike | None = None) -> ConversionResult:
    """:func:`convert_to_hf` of the latest checkpoint in ``checkpoint_dir``, skipped when already done.

    ``output_dir`` is kept (``skipped=True``) when its ``conversion.json`` names this checkpoint
    folder and iteration, written at the same time (a run trained again into the same folder is
    converted again); otherwise it is converted again (``overwrite=True``).

    Raises:
        FileNotFoundError: no checkpoint (train first: notebook 03), and the errors of :func:`convert_to_hf`.
    """
    folder, it, _ = find_checkpoint(checkpoint_dir)
    out = Path(output_dir).expanduser().resolve()
    info = json.loads((out / CONVERSION_FILE).read_text()) if (out / CONVERSION_FILE).is_file() else {}
    if (out / "model.safetensors").is_file() and info.get("source") == str(folder) and info.get("iteration") == it \
            and info.get("checkpoint_written_ns") == _written_ns(folder) and "num_parameters" in info:
        return _result(out, info, 0.0, skipped=True)
    return convert_to_hf(checkpoint_dir, out, tokenizer_dir=tokenizer_dir, overwrite=True)


def _written_ns(path: Path) -> int:
    """When a checkpoint (an ``iter_NNNNNNN`` folder or a file) was last written: the newest mtime of its files, in ns."""
    path = Path(path)
    return max((p.stat().st_mtime_ns for p in path.rglob("*") if p.is_file()), default=path.stat().st_mtime_ns) \
        if path.is_dir() else path.stat().st_mtime_ns


# =========================================================================== command line
def main(argv: list[str] | None = None) -> int:
    """``python -m helpers.learn.conversion CHECKPOINT OUTPUT_DIR [--tokenizer-dir D] [--iteration N] [--overwrite] [--no-weights-only]``.

    ``CHECKPOINT`` is the series' or Megatron-LM's (legacy ``mp_rank_00/model_optim_rng.pt``, or torch_dist).

    Returns:
        0 on success, 2 on a conversion error (printed to stderr).
    """
    parser = argparse.ArgumentParser(prog="python -m helpers.learn.conversion",
                                     description="megatron-core checkpoint -> transformers GPT-2 or Llama folder")
    parser.add_argument("checkpoint", help="checkpoints folder, iter_NNNNNNN folder, .pt state dict or model_optim_rng.pt")
    parser.add_argument("output_dir", help="the transformers folder to write")
    parser.add_argument("--tokenizer-dir", default=None, help="default: the one recorded at training time")
    parser.add_argument("--iteration", type=int, default=None, help="default: the latest")
    parser.add_argument("--overwrite", action="store_true", help="replace a non-empty output_dir")
    parser.add_argument("--no-weights-only", dest="weights_only", action="store_false",
                        help="unpickle every object of a .pt file, which runs code it names: only for files you trust")
    args = parser.parse_args(argv)
    try:
        r = convert_to_hf(args.checkpoint, args.output_dir, tokenizer_dir=args.tokenizer_dir,
                          iteration=args.iteration, overwrite=args.overwrite, weights_only=args.weights_only)
    except (ValueError, FileExistsError, FileNotFoundError) as err:  # ConversionError is a ValueError
        print(f"error: {err}", file=sys.stderr)
        return 2
    print(f"wrote {r.output_dir} ({r.num_parameters:,} parameters, vocab {r.vocab_size}, "
          f"{r.activation_function}, {r.padded_rows_removed} padding rows removed)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
