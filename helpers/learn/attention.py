"""Core attention for megatron-core's local layer spec: torch's fused SDPA, and how it compares.

megatron-core 0.19.2 has two core-attention modules: ``DotProductAttention``
(``megatron/core/transformer/dot_product_attention.py``), which computes attention op by op
(``baddbmm`` for the scores, the mask, softmax, dropout, ``bmm`` with the values), and
Transformer Engine's fused attention, which needs TE and a GPU. :class:`SDPAttention` is the
first module computed by one call of ``torch.nn.functional.scaled_dot_product_attention``
(Vaswani et al. 2017 for the math; Dao et al. 2022, *FlashAttention*, for the fused,
memory-saving kernel), so the local spec gets a fused attention on any device.
:func:`helpers.demos.model_fusions.benchmark_core_attention` times both on a model's shapes (notebook 04).
"""

from __future__ import annotations


import torch
from megatron.core import tensor_parallel
from megatron.core.transformer.dot_product_attention import DotProductAttention
from megatron.core.transformer.enums import AttnMaskType


class SDPAttention(DotProductAttention):
    """megatron-core's ``DotProductAttention`` computed by ``torch.nn.functional.scaled_dot_product_attention``.

    Same parameters, checkpoint keys and math as the parent (softmax(Q K^T / sqrt(head dim) + mask) V,
    dropout on the probabilities); one fused call keeps no ``[b, heads, s, s]`` matrices for backward.

    Shapes: ``query/key/value [s, b, heads/TP, head_dim]`` (fp32, bf16 or fp16) -> ``[s, b, hidden/TP]``;
    ``attention_mask`` ``None`` (causal) or bool ``[b or 1, 1, s, s]``, True where forbidden. Cases the
    fused call would treat differently (unequal query/key lengths, softmax offset, attention bias,
    packed sequences, query-key layer scaling, sliding windows, a mask hiding every key from a
    query) run the parent's unfused code.
    """

    def forward(self, query, key, value, attention_mask, attn_mask_type=None, attention_bias=None,
                packed_seq_params=None):
        mask_type = attn_mask_type if attn_mask_type is not None else self.attn_mask_type
        if (query.size(0) != key.size(0) or attention_bias is not None or packed_seq_params is not None
                or getattr(self, "softmax_offset", None) is not None
                or self.config.apply_query_key_layer_scaling or self.config.window_size is not None
                or (attention_mask is None and mask_type != AttnMaskType.causal)
                or (attention_mask is not None and bool(attention_mask.all(dim=-1).any()))):
            return super().forward(query, key, value, attention_mask, attn_mask_type, attention_bias,
                                   packed_seq_params)
        sq, b, heads, head_dim = query.shape
        groups = heads // key.size(2)
        if groups > 1:  # grouped-query attention: repeat the key/value heads, as the parent does
            key, value = key.repeat_interleave(groups, dim=2), value.repeat_interleave(groups, dim=2)
        q, k, v = (t.permute(1, 2, 0, 3) for t in (query, key, value))  # [b, heads, s, head_dim]
        dropout_p = self.attention_dropout.p if self.training else 0.0  # the parent's Dropout: config or override
        # megatron's mask is True where attention is forbidden; SDPA's boolean mask is True where allowed
        kwargs = {"is_causal": True} if attention_mask is None else {"attn_mask": ~attention_mask.bool()}
        with tensor_parallel.get_cuda_rng_tracker().fork():
            context = torch.nn.functional.scaled_dot_product_attention(
                q, k, v, dropout_p=dropout_p, scale=self.softmax_scale, **kwargs)
        return context.permute(2, 0, 1, 3).reshape(sq, b, heads * head_dim)


#: The two modules :func:`helpers.demos.model_fusions.benchmark_core_attention` compares, by ``ModelConfig.core_attention`` name.
MODULES = {"unfused": DotProductAttention, "sdpa": SDPAttention}
