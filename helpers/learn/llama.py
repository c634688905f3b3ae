"""megatron-core's Llama-style GPT <-> transformers ``LlamaForCausalLM``: one weight map, both directions (notebook 06).

The converter of :mod:`helpers.learn.conversion` for the ``llama`` architecture (RoPE, RMSNorm,
SwiGLU, grouped-query attention, no biases). Both are ``nn.Linear`` throughout, so nothing is
transposed; two fused matrices are cut: ``linear_qkv.weight`` ``[(heads + 2g) * d, h]`` per query
group (:func:`split_qkv` / :func:`merge_qkv`) and ``linear_fc1.weight`` ``[2f, h]`` = ``[W_gate; W_up]``.
RoPE rotates the two halves of each head in both, so the query and key rows need no permutation.

Sources: megatron-core 0.19.2 ``transformer/attention.py`` (``get_query_key_value_tensors``),
``transformer/mlp.py`` (``glu``), ``models/common/embeddings/rotary_pos_embedding.py``;
transformers ``models/llama/modeling_llama.py``; Megatron-LM ``tools/checkpoint/loader_llama_mistral.py``.
"""

from __future__ import annotations

from typing import Any, Mapping

import torch

from helpers.learn.weight_names import check_keys, layer_template, without_tied_copy
from helpers.support.safe_load import ConversionError

#: megatron-core ``GPTModel`` name (local spec) -> ``LlamaForCausalLM`` name(s); ``{}`` is the layer.
#: A tuple: the megatron-core tensor is cut into these, in order (:func:`split_qkv`, the gate/up halves).
LLAMA_WEIGHT_MAP: dict[str, str | tuple[str, ...]] = {
    "embedding.word_embeddings.weight": "model.embed_tokens.weight",
    "decoder.layers.{}.input_layernorm.weight": "model.layers.{}.input_layernorm.weight",
    "decoder.layers.{}.self_attention.linear_qkv.weight": ("model.layers.{}.self_attn.q_proj.weight",
                                                           "model.layers.{}.self_attn.k_proj.weight",
                                                           "model.layers.{}.self_attn.v_proj.weight"),
    "decoder.layers.{}.self_attention.linear_proj.weight": "model.layers.{}.self_attn.o_proj.weight",
    "decoder.layers.{}.pre_mlp_layernorm.weight": "model.layers.{}.post_attention_layernorm.weight",
    "decoder.layers.{}.mlp.linear_fc1.weight": ("model.layers.{}.mlp.gate_proj.weight", "model.layers.{}.mlp.up_proj.weight"),
    "decoder.layers.{}.mlp.linear_fc2.weight": "model.layers.{}.mlp.down_proj.weight",
    "decoder.final_layernorm.weight": "model.norm.weight",
    "output_layer.weight": "lm_head.weight",
}
#: One row per vocabulary entry: Megatron's padding rows are dropped (and added back the other way).
VOCAB_ROWS = frozenset({"embedding.word_embeddings.weight", "output_layer.weight"})


def split_qkv(weight: torch.Tensor, num_heads: int, num_query_groups: int) -> tuple[torch.Tensor, ...]:
    """``linear_qkv.weight`` ``[(heads + 2g) * d, h]`` -> ``(q [heads*d, h], k [g*d, h], v [g*d, h])``.

    Raises:
        ConversionError: rows that are not ``(heads + 2g) x d`` for ``d = h / heads``.
    """
    h = weight.shape[1]
    d, per_group = h // num_heads, num_heads // num_query_groups
    if weight.shape[0] != (num_heads + 2 * num_query_groups) * d:
        raise ConversionError(f"linear_qkv.weight is {list(weight.shape)}, not [(heads + 2 x groups) x head_dim, h] = "
                              f"[({num_heads} + 2 x {num_query_groups}) x {d}, {h}]: check num_attention_heads and num_query_groups")
    grouped = weight.view(num_query_groups, per_group + 2, d, h)
    return (grouped[:, :per_group].reshape(num_heads * d, h), grouped[:, per_group].reshape(num_query_groups * d, h),
            grouped[:, per_group + 1].reshape(num_query_groups * d, h))


def merge_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, num_heads: int, num_query_groups: int) -> torch.Tensor:
    """Inverse of :func:`split_qkv`: ``[(heads + 2g) * d, h]`` in megatron-core's per-group order."""
    h = q.shape[1]
    d, per_group = h // num_heads, num_heads // num_query_groups
    return torch.cat([q.view(num_query_groups, per_group, d, h), k.view(num_query_groups, 1, d, h),
                      v.view(num_query_groups, 1, d, h)], dim=1).reshape(-1, h)


def check_llama(meta: Mapping[str, Any]) -> None:
    """Refuse a model ``LlamaForCausalLM`` cannot hold exactly, naming every reason.

    A Llama here is: rotary position embeddings, RMSNorm, a SwiGLU MLP, no linear biases, the output
    layer tied or not (``meta``: ``ModelConfig.to_metadata()`` or what the checkpoint's args give).

    Raises:
        ConversionError: the reasons, one per line.
    """
    wanted = {"position_embedding_type": "rope", "normalization": "RMSNorm", "swiglu": True, "add_bias_linear": False}
    r = [f"{k}={meta.get(k)!r} (a Llama has {v!r})" for k, v in wanted.items() if meta.get(k) != v]
    if meta.get("num_experts"):
        r.append(f"num_experts={meta['num_experts']} (a mixture of experts: LlamaForCausalLM has one MLP per layer; "
                 "transformers' MixtralForCausalLM holds experts, which the series does not convert to)")
    if r:
        raise ConversionError("this checkpoint is not a Llama architecture and cannot become a transformers "
                              "LlamaForCausalLM exactly:\n  - " + "\n  - ".join(r))


def megatron_to_llama_state_dict(state_dict: Mapping[str, torch.Tensor], meta: Mapping[str, Any],
                                 vocab_size: int | None = None) -> dict[str, torch.Tensor]:
    """A megatron-core Llama state dict (local-spec names, TP=1) as ``LlamaForCausalLM``'s.

    Args:
        state_dict: local-spec names (``helpers.learn.conversion`` normalises Transformer Engine's).
        meta: ``ModelConfig.to_metadata()`` (heads, ``num_query_groups``, layers, ``vocab_size``).
        vocab_size: rows to keep of the embeddings (the tokenizer's size); default ``meta["vocab_size"]``.

    Returns:
        ``{transformers name: tensor}``, contiguous copies, the input's dtype; when
        ``meta["tied_embeddings"]``, ``lm_head.weight`` is ``embed_tokens`` (as ``state_dict()`` lists it).

    Raises:
        ConversionError: not a Llama (:func:`check_llama`); unknown or missing keys (listed); QKV shapes;
            a tied model whose ``output_layer.weight`` differs from its word embeddings.
    """
    check_llama(meta)
    heads, groups = int(meta["num_attention_heads"]), int(meta.get("num_query_groups") or meta["num_attention_heads"])
    vocab = int(vocab_size if vocab_size is not None else meta["vocab_size"])
    tied = bool(meta.get("tied_embeddings"))
    state_dict = without_tied_copy(state_dict, "output_layer.weight", "embedding.word_embeddings.weight", tied,
                                   "set share_embeddings_and_output_weights=False in the model config")
    expected = {t.format(i) for t in LLAMA_WEIGHT_MAP for i in range(int(meta["num_layers"]))} - ({"output_layer.weight"} if tied else set())
    _account(state_dict, expected, "megatron-core Llama state dict")
    out: dict[str, torch.Tensor] = {}
    for key, tensor in state_dict.items():
        template, layer = layer_template(key)
        names = LLAMA_WEIGHT_MAP[template]
        if "linear_qkv" in template:
            parts = split_qkv(tensor, heads, groups)
        elif "linear_fc1" in template:
            parts = tensor.chunk(2, dim=0)
        else:
            parts, names = (tensor[:vocab] if template in VOCAB_ROWS else tensor,), (names,)
        for name, part in zip(names, parts):
            out[name.format(layer)] = part.clone(memory_format=torch.contiguous_format)
    if tied:
        out["lm_head.weight"] = out["model.embed_tokens.weight"]
    return out


def llama_to_megatron_state_dict(hf_state_dict: Mapping[str, torch.Tensor], num_attention_heads: int,
                                 num_query_groups: int, padded_vocab_size: int, *, tied: bool = False) -> dict[str, torch.Tensor]:
    """Inverse of :func:`megatron_to_llama_state_dict`: ``GPTModel.state_dict()`` weights, TP=1.

    The embeddings get ``padded_vocab_size`` rows, the padding repeating the last row (Megatron-LM
    ``tools/checkpoint/saver_mcore.py``). ``tied``: the model ties ``lm_head`` to ``embed_tokens``
    (``model.state_dict()`` still lists it; it must equal them) and megatron-core gets no ``output_layer``.

    Raises:
        ConversionError: unknown or missing keys (listed); ``tied`` with an ``lm_head.weight`` of its own.
    """
    inverse = {}
    for mc, hf in LLAMA_WEIGHT_MAP.items():
        for i, name in enumerate(hf if isinstance(hf, tuple) else (hf,)):
            inverse[name] = (mc, i)
    sd = {k: v for k, v in hf_state_dict.items() if not k.endswith("rotary_emb.inv_freq")}
    sd = without_tied_copy(sd, "lm_head.weight", "model.embed_tokens.weight", tied, "pass tied=False")
    layers = {layer for k in sd if (layer := layer_template(k)[1]) is not None}
    _account(sd, {t.format(i) for t in inverse for i in range(max(layers, default=-1) + 1)} - ({"lm_head.weight"} if tied else set()),
             "transformers Llama state dict")
    parts: dict[str, dict[int, torch.Tensor]] = {}
    for key, tensor in sd.items():
        template, layer = layer_template(key)
        mc, i = inverse[template]
        parts.setdefault(mc.format(layer), {})[i] = tensor
    out = {}
    for name, pieces in parts.items():
        if name.endswith("linear_qkv.weight"):
            out[name] = merge_qkv(pieces[0], pieces[1], pieces[2], num_attention_heads, num_query_groups)
        elif name.endswith("linear_fc1.weight"):
            out[name] = torch.cat([pieces[0], pieces[1]], dim=0)
        elif name in VOCAB_ROWS:
            t = pieces[0]
            out[name] = torch.cat([t, t[-1:].expand(padded_vocab_size - t.shape[0], -1)]) if t.shape[0] < padded_vocab_size \
                else t[:padded_vocab_size].clone()
        else:
            out[name] = pieces[0].clone(memory_format=torch.contiguous_format)
    return out


def llama_config(meta: Mapping[str, Any], *, vocab_size: int | None = None, eod_id: int | None = None):
    """The transformers ``LlamaConfig`` of a megatron-core Llama (``meta``: ``ModelConfig.to_metadata()``).

    ``rms_norm_eps`` is ``layernorm_epsilon``, ``rope_theta`` the ``rotary_base``,
    ``max_position_embeddings`` the training length's table size, ``vocab_size`` the tokenizer's;
    BOS/EOS/PAD are the EOD token. Raises ``ConversionError`` for another architecture.
    """
    from transformers import LlamaConfig

    check_llama(meta)
    return LlamaConfig(
        vocab_size=int(vocab_size if vocab_size is not None else meta["vocab_size"]), hidden_size=int(meta["hidden_size"]),
        intermediate_size=int(meta["ffn_hidden_size"]), num_hidden_layers=int(meta["num_layers"]),
        num_attention_heads=int(meta["num_attention_heads"]),
        num_key_value_heads=int(meta.get("num_query_groups") or meta["num_attention_heads"]),
        max_position_embeddings=int(meta["max_position_embeddings"]), rms_norm_eps=float(meta["layernorm_epsilon"]),
        rope_theta=float(meta.get("rotary_base", 10000)), hidden_act="silu", tie_word_embeddings=bool(meta.get("tied_embeddings")),
        attention_bias=False, mlp_bias=False, attention_dropout=float(meta.get("attention_dropout", 0.0)),
        initializer_range=float(meta.get("init_method_std", 0.02)),
        bos_token_id=eod_id, eos_token_id=eod_id, pad_token_id=eod_id, architectures=["LlamaForCausalLM"])


def _account(found, expected: set[str], what: str) -> None:
    check_keys(found, sorted(expected), what, "a Llama of this shape",
               "Check num_layers, num_query_groups, tied embeddings and the checkpoint's origin.")
