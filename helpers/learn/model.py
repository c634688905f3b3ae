"""The GPT model of the series: profiles, megatron-core ``TransformerConfig`` and ``GPTModel`` (03 §3, 05).

Two architectures, each a set of Megatron-LM's own arguments (:data:`ARCHITECTURES`): ``gpt2``,
the guide's CodeParrot (converts to ``GPT2LMHeadModel``), and ``llama`` (Touvron et al. 2023,
arXiv:2302.13971, section 2.2: RoPE, RMSNorm, SwiGLU, grouped-query attention, no biases; converts
to ``LlamaForCausalLM``). :meth:`ModelConfig.to_metadata` holds everything a converter needs.

Sources: Megatron-LM ``pretrain_gpt.py`` / ``gpt_builders.py`` (how GPTModel is built),
``megatron/core/tokenizers/utils/build_tokenizer.py`` ``vocab_size_with_padding`` (vocab padding),
Narayanan et al. 2021, "Efficient Large-Scale Language Model Training on GPU Clusters", section 5.1
(FLOPs; Megatron-LM's ``num_floating_point_operations`` halves its attention term).
"""

from __future__ import annotations

import importlib.util
from dataclasses import asdict, dataclass, fields, replace
from typing import Any

#: GELU variants and the name ``transformers`` gives each (``config.activation_function``).
GELU_HF_NAME = {"erf": "gelu", "tanh": "gelu_new"}


#: Attention kernels of the local layer spec (see ``ModelConfig.core_attention``).
CORE_ATTENTIONS = ("sdpa", "unfused")

#: The two architectures as ModelConfig fields (Megatron-LM's ``--position-embedding-type``,
#: ``--normalization``, ``--swiglu``, ``--disable-bias-linear``). Tying the output layer to the word
#: embeddings (``--untie-embeddings-and-output-weights`` unties) is not part of either: GPT-2 ties, Llama
#: 2 and 3 untie, Llama 3.2's 1B and 3B tie; both converters handle both.
ARCHITECTURES: dict[str, dict[str, Any]] = {
    "gpt2": {"position_embedding_type": "learned_absolute", "normalization": "LayerNorm", "swiglu": False,
             "add_bias_linear": True},
    "llama": {"position_embedding_type": "rope", "normalization": "RMSNorm", "swiglu": True,
              "add_bias_linear": False},
}


@dataclass(frozen=True)
class ModelConfig:
    """Shape and numerics of a GPT-2-style megatron-core ``GPTModel``.

    Attributes:
        num_layers: transformer layers.
        hidden_size: model width h.
        num_attention_heads: attention heads (h must be divisible by it).
        seq_length: training sequence length in tokens.
        max_position_embeddings: rows of the learned position table (>= seq_length).
        vocab_size: the tokenizer's vocabulary size (before padding).
        ffn_hidden_size: MLP width; ``None`` means 4 x hidden_size.
        make_vocab_size_divisible_by: Megatron pads the vocab to a multiple of this x TP size.
        hidden_dropout, attention_dropout: dropout probabilities (Megatron-LM default 0.1).
        init_method_std: std of the normal weight init (Megatron-LM default 0.02).
        layernorm_epsilon: LayerNorm eps (GPT-2: 1e-5).
        bias_activation_fusion: use megatron-core's fused bias-GELU, which computes the
            **tanh** approximation (megatron/core/fusions/fused_bias_gelu.py); unfused is
            ``F.gelu``, the exact **erf** GELU.
        masked_softmax_fusion, bias_dropout_fusion: megatron-core fusion flags (work on CPU).
        share_embeddings_and_output_weights: tie the output layer to the word embeddings.
        position_embedding_type: ``"learned_absolute"`` (GPT-2) or ``"rope"`` (rotary, base
            ``rotary_base``, megatron-core's half-split layout).
        normalization: ``"LayerNorm"`` (weight and bias) or ``"RMSNorm"`` (weight only).
        swiglu: a gated MLP ``fc2(silu(x W_gate) * (x W_up))`` (megatron-core ``gated_linear_unit``
            with SiLU; ``linear_fc1`` holds ``[W_gate; W_up]``) instead of GELU.
        num_query_groups: key/value heads (grouped-query attention); ``None``: one per query head.
        add_bias_linear: biases in every linear layer (GPT-2) or none (Llama).
        core_attention: the local spec's attention kernel: ``"unfused"`` (megatron-core's
            ``DotProductAttention``, as ``--transformer-impl local``) or ``"sdpa"``
            (:class:`helpers.learn.attention.SDPAttention`); ignored by the Transformer Engine spec.
        num_experts: ``None`` for dense MLPs, else a mixture of experts in every layer (Fedus et al. 2022,
            arXiv:2101.03961; Megatron-LM ``--num-experts``; megatron-core 0.19.2 ``transformer/moe/router.py``
            ``TopKRouter``, ``moe_layer.py``): a ``[num_experts, h]`` router sends each token to
            ``moe_router_topk`` experts. Needs ``add_bias_linear=False``: an expert's in-place ``linear_fc2``
            bias add on a view is refused by autograd (megatron-core 0.19.2 ``transformer/mlp.py:354``).
        moe_router_topk: experts each token is sent to (``--moe-router-topk``, Megatron-LM's default 2).
    """

    num_layers: int = 4
    hidden_size: int = 256
    num_attention_heads: int = 4
    seq_length: int = 256
    max_position_embeddings: int = 256
    vocab_size: int = 8192
    ffn_hidden_size: int | None = None
    make_vocab_size_divisible_by: int = 128
    hidden_dropout: float = 0.0
    attention_dropout: float = 0.0
    init_method_std: float = 0.02
    layernorm_epsilon: float = 1e-5
    bias_activation_fusion: bool = False
    masked_softmax_fusion: bool = False
    bias_dropout_fusion: bool = False
    share_embeddings_and_output_weights: bool = True
    core_attention: str = "unfused"
    position_embedding_type: str = "learned_absolute"
    normalization: str = "LayerNorm"
    swiglu: bool = False
    num_query_groups: int | None = None
    add_bias_linear: bool = True
    rotary_base: int = 10000
    num_experts: int | None = None
    moe_router_topk: int = 2

    def __post_init__(self) -> None:
        if self.core_attention not in CORE_ATTENTIONS:
            raise ValueError(f"ModelConfig.core_attention={self.core_attention!r}: choose one of "
                             f"{', '.join(map(repr, CORE_ATTENTIONS))}")
        for name in ("num_layers", "hidden_size", "num_attention_heads", "seq_length",
                     "max_position_embeddings", "vocab_size", "make_vocab_size_divisible_by"):
            if int(getattr(self, name)) < 1:
                raise ValueError(f"ModelConfig.{name}={getattr(self, name)} must be >= 1")
        for name in ("hidden_dropout", "attention_dropout"):
            if not 0.0 <= getattr(self, name) < 1.0:
                raise ValueError(f"ModelConfig.{name}={getattr(self, name)} must be a probability in [0, 1) "
                                 "(the guide used 0.1)")
        choices = {"position_embedding_type": ("learned_absolute", "rope"), "normalization": ("LayerNorm", "RMSNorm")}
        for name, allowed in choices.items():
            if getattr(self, name) not in allowed:
                raise ValueError(f"ModelConfig.{name}={getattr(self, name)!r}: choose one of {', '.join(map(repr, allowed))}")
        if self.num_query_groups is not None and not (0 < self.num_query_groups <= self.num_attention_heads
                                                      and self.num_attention_heads % self.num_query_groups == 0):
            raise ValueError(f"num_query_groups={self.num_query_groups} must divide num_attention_heads="
                             f"{self.num_attention_heads}: each key/value head serves the same number of query heads. "
                             f"Use one of {divisors(self.num_attention_heads)} (or None: one per query head)")
        if self.position_embedding_type == "rope" and self.hidden_size % self.num_attention_heads == 0 \
                and (self.hidden_size // self.num_attention_heads) % 2:
            raise ValueError(f"hidden_size={self.hidden_size} / num_attention_heads={self.num_attention_heads} = "
                             f"{self.hidden_size // self.num_attention_heads} per head is odd: rotary embeddings rotate "
                             "pairs of dimensions, so a head needs an even size; pick heads that give one")
        if self.num_experts is not None:
            if not 1 <= self.moe_router_topk <= self.num_experts:
                raise ValueError(f"moe_router_topk={self.moe_router_topk} must be between 1 and num_experts="
                                 f"{self.num_experts}: each token goes to that many distinct experts")
            if self.add_bias_linear:
                raise ValueError(f"num_experts={self.num_experts} with add_bias_linear=True: megatron-core 0.19.2 adds an "
                                 "expert's fc2 bias in place to a view autograd refuses (transformer/mlp.py:354) when "
                                 "the experts are not split over ranks; set add_bias_linear=False (no linear biases, "
                                 "as in Mixtral)")
        if self.hidden_size % self.num_attention_heads:
            raise ValueError(
                f"hidden_size={self.hidden_size} is not divisible by num_attention_heads="
                f"{self.num_attention_heads}: pick heads that divide the width"
            )
        if self.seq_length > self.max_position_embeddings:  # Megatron-LM's validate_args asserts it with RoPE too
            raise ValueError(
                f"seq_length={self.seq_length} is above max_position_embeddings={self.max_position_embeddings}: "
                + ("the learned position table has no row for positions past it. Lower seq_length or raise "
                   "max_position_embeddings." if self.position_embedding_type == "learned_absolute" else
                   "rotary positions have no table, but Megatron-LM's validate_args asks for max_position_embeddings "
                   ">= seq_length all the same: raise it (it costs no weights).")
            )

    @property
    def ffn_size(self) -> int:
        """MLP width: ``ffn_hidden_size``, else 4 x hidden_size, or with SwiGLU 8h/3 rounded up to a
        multiple of 64 (its three matrices then hold about the 8h^2 parameters of GELU's two; LLaMA
        rounds 8h/3 up to a multiple of 256, Megatron-LM's default down to 64; the flag is always given)."""
        if self.ffn_hidden_size:
            return self.ffn_hidden_size
        return -(-8 * self.hidden_size // 3 // 64) * 64 if self.swiglu else 4 * self.hidden_size

    @property
    def gelu(self) -> str:
        """``"tanh"`` when the fused bias-GELU is used, else ``"erf"`` (exact)."""
        return "tanh" if self.bias_activation_fusion else "erf"

    @property
    def query_groups(self) -> int:
        """Key/value heads: ``num_query_groups``, or one per query head."""
        return self.num_query_groups or self.num_attention_heads

    @property
    def architecture(self) -> str:
        """``"gpt2"`` or ``"llama"`` when the fields are one of :data:`ARCHITECTURES`, else ``"custom"``."""
        return next((name for name, fields_ in ARCHITECTURES.items()
                     if all(getattr(self, k) == v for k, v in fields_.items())), "custom")

    def padded_vocab_size(self, tensor_model_parallel_size: int = 1) -> int:
        """See :func:`padded_vocab_size`."""
        return padded_vocab_size(self.vocab_size, self.make_vocab_size_divisible_by, tensor_model_parallel_size)

    def to_dict(self) -> dict[str, Any]:
        """The dataclass fields as a plain dict (JSON-ready)."""
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "ModelConfig":
        """Inverse of :meth:`to_dict`; unknown keys are an error naming them.

        Raises:
            ValueError: a key that is not a ModelConfig field.
        """
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ValueError(f"unknown ModelConfig keys {unknown}; valid keys: {sorted(known)}")
        return cls(**data)

    def to_metadata(self, tensor_model_parallel_size: int = 1) -> dict[str, Any]:
        """Everything a converter needs, written next to each checkpoint as JSON.

        Includes ``padded_vocab_size``, ``gelu`` (``"erf"``/``"tanh"``) and the matching
        transformers ``activation_function`` name, ``position_embedding_type``,
        ``normalization`` and ``tied_embeddings``.
        """
        return {
            **self.to_dict(),
            "ffn_hidden_size": self.ffn_size,
            "padded_vocab_size": self.padded_vocab_size(tensor_model_parallel_size),
            "gelu": self.gelu,
            "hf_activation_function": "silu" if self.swiglu else GELU_HF_NAME[self.gelu],
            "num_query_groups": self.query_groups,
            "architecture": self.architecture,
            "tied_embeddings": self.share_embeddings_and_output_weights,
            "num_parameters": count_parameters(self),
            "flops_per_token": flops_per_token(self),
        }


def architecture_fields(name: str, hidden_size: int, num_attention_heads: int, num_query_groups: int = 0) -> dict[str, Any]:
    """The :class:`ModelConfig` fields of architecture ``name`` for a model of this width, the Llama
    sized to hold as many weights (and multiply as many per token) as the GPT-2 of the same width.

    For ``"llama"``: :data:`ARCHITECTURES` ``["llama"]``, ``num_query_groups`` key/value heads
    (0: half the heads) and an MLP width f with ``3 h f = 8 h^2 + 2 h (heads - g) d``: SwiGLU's
    three matrices hold GELU's two (f = 8h/3) plus the key/value weights grouped-query attention
    saves (Llama 2 70B likewise widened its MLP when it took GQA); rounded up to a multiple of 64.
    For ``"gpt2"``: :data:`ARCHITECTURES` ``["gpt2"]``, one key/value head per query head, the MLP 4h.

    Raises:
        ValueError: an unknown ``name`` (the choices are listed).
    """
    if name not in ARCHITECTURES:
        raise ValueError(f"architecture={name!r} is unknown: choose one of {sorted(ARCHITECTURES)}")
    if name == "gpt2":
        return {**ARCHITECTURES["gpt2"], "num_query_groups": None, "ffn_hidden_size": None}
    groups = num_query_groups or max(1, num_attention_heads // 2)
    saved = 2 * hidden_size * (num_attention_heads - groups) * (hidden_size // num_attention_heads)
    ffn = -(-(8 * hidden_size ** 2 + saved) // (3 * hidden_size) // 64) * 64
    return {**ARCHITECTURES["llama"], "num_query_groups": groups, "ffn_hidden_size": ffn}


#: Model profiles. ``cpu``: trains in about 3 minutes on 2 cores. ``codeparrot-small``: the
#: CodeParrot guide's 110M model (12 layers, hidden 768, 12 heads, seq 1024, dropout 0.1,
#: GPT-2 BPE of 32,768 tokens in the guide's own tokenizer).
PROFILES: dict[str, ModelConfig] = {
    # notebook 03's defaults: chosen with bench/recipe.py for the most learning in 2-3 CPU minutes
    "cpu": ModelConfig(num_layers=4, hidden_size=192, num_attention_heads=4, seq_length=128,
                       max_position_embeddings=128, vocab_size=8192),
    # the cpu model as the Llama of the same size (architecture_fields): 2 key/value heads for 4 query heads, MLP
    # width 576; the output layer tied as in Llama 3.2 1B (untied it would add V x h = 1.57M weights, +46 %)
    "cpu-llama": ModelConfig(num_layers=4, hidden_size=192, num_attention_heads=4, seq_length=128,
                             max_position_embeddings=128, vocab_size=8192, **architecture_fields("llama", 192, 4, 2)),
    "codeparrot-small": ModelConfig(num_layers=12, hidden_size=768, num_attention_heads=12,
                                    seq_length=1024, max_position_embeddings=1024,
                                    vocab_size=32768, hidden_dropout=0.1, attention_dropout=0.1,
                                    bias_activation_fusion=True, masked_softmax_fusion=True,
                                    bias_dropout_fusion=True),
}


def profile(name: str, **overrides: Any) -> ModelConfig:
    """The model profile ``name`` with ``overrides`` applied (``profile("cpu", num_layers=2)``).

    Raises:
        KeyError: unknown profile name (the message lists the profiles).
    """
    if name not in PROFILES:
        raise KeyError(f"model profile {name!r} is unknown: choose one of {sorted(PROFILES)}")
    return replace(PROFILES[name], **overrides)


def padded_vocab_size(vocab_size: int, make_vocab_size_divisible_by: int = 128,
                      tensor_model_parallel_size: int = 1) -> int:
    """Vocabulary size padded as Megatron pads it: up to a multiple of divisor x TP size.

    Source: megatron-core ``megatron/core/tokenizers/utils/build_tokenizer.py::vocab_size_with_padding``
    (``tests/test_model.py`` compares them).
    The extra rows of the embedding are never produced by the tokenizer; a converter keeps
    or trims them (GPT-2's 50,257 becomes 50,304).

    Raises:
        ValueError: a size below 1.
    """
    if vocab_size < 1 or make_vocab_size_divisible_by < 1 or tensor_model_parallel_size < 1:
        raise ValueError("vocab_size, make_vocab_size_divisible_by and tensor_model_parallel_size must be >= 1")
    multiple = make_vocab_size_divisible_by * tensor_model_parallel_size
    return ((vocab_size + multiple - 1) // multiple) * multiple


def layer_parameters(cfg: ModelConfig) -> dict[str, int]:
    """Parameters of one transformer layer, by part (unsharded), for either architecture.

    With d = h / heads and g key/value heads: QKV ``h*(heads + 2g)*d`` (3h^2 with g = heads),
    projection ``h^2``, MLP ``h*f`` per matrix (two; three with SwiGLU), each linear layer with its
    bias when ``add_bias_linear``; two norms of 2h (LayerNorm) or h (RMSNorm). A mixture of experts
    (``num_experts`` E) holds E copies of fc1 and fc2 and adds ``"router"``, ``E*h`` (megatron-core 0.19.2
    ``transformer/moe/router.py``: ``TopKRouter.weight`` ``[E, h]``, no bias).
    """
    h, f, b = cfg.hidden_size, cfg.ffn_size, int(cfg.add_bias_linear)
    qkv_rows = (cfg.num_attention_heads + 2 * cfg.query_groups) * (h // cfg.num_attention_heads)
    fc1_rows = 2 * f if cfg.swiglu else f
    experts = cfg.num_experts or 1
    parts = {"qkv": qkv_rows * h + b * qkv_rows, "proj": h * h + b * h, "fc1": experts * (fc1_rows * h + b * fc1_rows),
             "fc2": experts * (f * h + b * h), "norms": 2 * norm_parameters(cfg)}
    return parts | ({"router": cfg.num_experts * h} if cfg.num_experts else {})


def norm_parameters(cfg: ModelConfig) -> int:
    """Parameters of one norm: weight and bias (LayerNorm, 2h) or weight (RMSNorm, h)."""
    return (2 if cfg.normalization == "LayerNorm" else 1) * cfg.hidden_size


def count_parameters(cfg: ModelConfig, tensor_model_parallel_size: int = 1) -> int:
    """Number of parameters of the (unsharded) GPTModel, counting tied embeddings once.

    word embeddings V_pad*h, positions P*h (learned absolute only); per layer
    :func:`layer_parameters` (GPT-2: 4h + 3h^2 + 3h + h^2 + h + 2hf + f + h); a final norm; an
    untied output layer adds V_pad*h. Equals ``sum(p.numel())`` of :func:`build_model` (tested).
    """
    h = cfg.hidden_size
    v = cfg.padded_vocab_size(tensor_model_parallel_size)
    positions = cfg.max_position_embeddings * h if cfg.position_embedding_type == "learned_absolute" else 0
    total = v * h + positions + cfg.num_layers * sum(layer_parameters(cfg).values()) + norm_parameters(cfg)
    if not cfg.share_embeddings_and_output_weights:
        total += v * h
    return total


def flops_per_token(cfg: ModelConfig, activation_recompute: bool = False) -> int:
    """Training FLOPs per token (forward + backward) of the GPT, for MFU.

    Per layer, forward matmuls cost 2 FLOPs per multiply-add: QKV and projection 8h^2 (less with
    grouped-query attention: 2h*(heads + 2g)*d + 2h^2), MLP 4hf (6hf with SwiGLU's three matrices),
    attention scores and the weighted sum 4sh; the logits 2hV. Backward costs twice
    the forward (3x in all; 4x for the layers with full activation recomputation). A mixture of experts
    runs each token through ``moe_router_topk`` k experts (the MLP term k times) and its router, ``2hE``. With f=4h:
    ``72*l*h^2*(1 + s/(6h) + V/(12*l*h))`` per token, i.e. 6N plus the attention term 12*l*s*h.

    Source: Narayanan et al. 2021, "Efficient Large-Scale Language Model Training on GPU
    Clusters" (arXiv:2104.04473), section 5.1; PaLM (arXiv:2204.02311) appendix B (6N + 12*l*h*s).
    Megatron-LM's ``num_floating_point_operations`` (``megatron/training/training.py``) counts half of
    the attention term (a causal mask) and no router; ``tests/test_model.py`` checks these are the only differences.
    """
    h, f, s, l = cfg.hidden_size, cfg.ffn_size, cfg.seq_length, cfg.num_layers
    v = cfg.padded_vocab_size()
    qkv_rows = (cfg.num_attention_heads + 2 * cfg.query_groups) * (h // cfg.num_attention_heads)
    k, router = (cfg.moe_router_topk, 2 * h * cfg.num_experts) if cfg.num_experts else (1, 0)
    layer_fwd = 2 * h * qkv_rows + 2 * h * h + k * (6 if cfg.swiglu else 4) * h * f + router + 4 * s * h
    layer_factor = 4 if activation_recompute else 3
    return l * layer_fwd * layer_factor + 3 * 2 * h * v


# =========================================================================== parallel layouts
@dataclass(frozen=True)
class Layout:
    """A parallel layout: tensor-, pipeline- and data-parallel sizes (world size = TP x PP x DP).

    Attributes:
        tensor_model_parallel_size: ranks that split every layer's matrices (Megatron
            ``--tensor-model-parallel-size``).
        pipeline_model_parallel_size: pipeline stages, each a consecutive block of layers
            (``--pipeline-model-parallel-size``).
        data_parallel_size: model replicas, each fed different samples of the global batch.
    """

    tensor_model_parallel_size: int = 1
    pipeline_model_parallel_size: int = 1
    data_parallel_size: int = 1

    def __post_init__(self) -> None:
        for name in ("tensor_model_parallel_size", "pipeline_model_parallel_size", "data_parallel_size"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"Layout.{name}={value!r} must be an integer >= 1")

    @property
    def world_size(self) -> int:
        """Processes (GPUs) the layout needs: TP x PP x DP."""
        return self.tensor_model_parallel_size * self.pipeline_model_parallel_size * self.data_parallel_size

    @property
    def name(self) -> str:
        """``"tp2_pp1_dp1"``: a folder-safe name."""
        return f"tp{self.tensor_model_parallel_size}_pp{self.pipeline_model_parallel_size}_dp{self.data_parallel_size}"

    @property
    def label(self) -> str:
        """``"TP=2 PP=1 DP=1"``: for tables and legends."""
        return f"TP={self.tensor_model_parallel_size} PP={self.pipeline_model_parallel_size} DP={self.data_parallel_size}"


def batch_size_error(global_batch_size: int, micro_batch_size: int, data_parallel_size: int) -> str:
    """The message for a global batch that micro-batch x data-parallel size does not divide, with both fixes.

    A resumed run must keep its global batch (Megatron-LM's scheduler counts samples), so the message
    also names the largest micro-batch that divides it (Megatron-LM ``num_microbatches_calculator.py``).
    """
    step = micro_batch_size * data_parallel_size
    text = (f"global_batch_size={global_batch_size} is not divisible by micro_batch_size x data_parallel_size = "
            f"{micro_batch_size} x {data_parallel_size} = {step}: use a multiple of {step} "
            f"(e.g. {max(step, global_batch_size // step * step)})")
    if global_batch_size % data_parallel_size == 0:
        share = global_batch_size // data_parallel_size
        fits = max(m for m in range(1, min(max(micro_batch_size, 1), share) + 1) if share % m == 0)
        text += f", or micro_batch_size={fits}, which keeps the global batch (as resuming a run needs)"
    return text


def check_layout(model: ModelConfig, layout: Layout, *, world_size: int | None = None,
                 micro_batch_size: int | None = None, global_batch_size: int | None = None) -> None:
    """Refuse a layout megatron-core cannot build, before any process starts.

    Megatron-LM checks the same in ``megatron/training/arguments.py`` (``validate_args``) and
    ``megatron/core/utils.py::divide`` (an ``AssertionError`` deep inside model building).

    Args:
        model: the model shape.
        layout: TP, PP, DP sizes.
        world_size: processes that will be started; must equal ``layout.world_size``.
        micro_batch_size, global_batch_size: when given, the global batch must be a multiple
            of micro-batch x DP (the rest are gradient-accumulation micro-batches).

    Raises:
        ValueError: TP does not divide the attention heads, the hidden size, the key/value heads or the MLP width;
            PP is larger than (or does not divide) the number of layers; the world size is
            not TP x PP x DP; the global batch is not a multiple of micro-batch x DP. The
            message names the values and the fix.
    """
    tp, pp, dp = layout.tensor_model_parallel_size, layout.pipeline_model_parallel_size, layout.data_parallel_size
    for size, name, why in ((model.num_attention_heads, "num_attention_heads", "each TP rank computes whole heads"),
                            (model.hidden_size, "hidden_size", "the row-parallel layers split the hidden dimension"),
                            (model.query_groups, "num_query_groups", "each TP rank holds whole key/value heads"),
                            (model.ffn_size, "ffn_hidden_size", "the MLP's columns are split across the TP ranks")):
        if size % tp:
            raise ValueError(f"tensor_model_parallel_size={tp} does not divide {name}={size}: {why}. "
                             f"Use a TP size among {divisors(size)}.")
    if pp > model.num_layers:
        raise ValueError(
            f"pipeline_model_parallel_size={pp} is larger than num_layers={model.num_layers}: a pipeline stage "
            f"needs at least one layer. Use PP <= {model.num_layers}."
        )
    if model.num_layers % pp:
        raise ValueError(
            f"pipeline_model_parallel_size={pp} does not divide num_layers={model.num_layers}: every stage "
            f"holds the same number of layers. Use a PP size among {divisors(model.num_layers)}."
        )
    if world_size is not None and world_size != layout.world_size:
        raise ValueError(
            f"world size {world_size} != TP x PP x DP = {tp} x {pp} x {dp} = {layout.world_size}: start "
            f"{layout.world_size} processes (nproc_per_node x nnodes), or change the data-parallel size to "
            f"world_size / (TP x PP)" + (f" = {world_size // (tp * pp)}" if world_size % (tp * pp) == 0 else
                                         f" (impossible: {world_size} is not a multiple of TP x PP = {tp * pp})")
        )
    if micro_batch_size is not None and global_batch_size is not None:
        if micro_batch_size < 1 or global_batch_size % (micro_batch_size * dp):
            raise ValueError(batch_size_error(global_batch_size, micro_batch_size, dp))


def divisors(n: int) -> list[int]:
    """The divisors of ``n`` in increasing order: the TP/PP sizes a dimension of length ``n`` allows."""
    return [d for d in range(1, n + 1) if n % d == 0]


def transformer_engine_available() -> bool:
    """True when Transformer Engine can be imported (then the TE layer spec is used)."""
    return importlib.util.find_spec("transformer_engine") is not None


def transformer_config(cfg: ModelConfig, *, tensor_model_parallel_size: int = 1,
                       pipeline_model_parallel_size: int = 1, precision: str = "fp32",
                       use_cpu_initialization: bool | None = None):
    """The megatron-core ``TransformerConfig`` for ``cfg``.

    Args:
        cfg: the model shape.
        tensor_model_parallel_size, pipeline_model_parallel_size: parallel layout (must
            match ``parallel_state.initialize_model_parallel``).
        precision: ``"fp32"``, ``"bf16"`` or ``"fp16"``: the compute dtype. Parameters stay
            fp32 (master weights); bf16/fp16 run under ``torch.autocast`` on CUDA
            (megatron-core's schedules enter it when ``enable_autocast`` is set).
        use_cpu_initialization: initialise weights on the CPU (default: when CUDA is absent).

    Returns:
        ``megatron.core.transformer.TransformerConfig``.

    Raises:
        ValueError: unknown precision, bf16/fp16 without CUDA, or a layout the shape does not
            allow (:func:`check_layout`).
    """
    import torch
    import torch.nn.functional as F
    from megatron.core.transformer import TransformerConfig

    if precision not in ("fp32", "bf16", "fp16"):
        raise ValueError(f"precision={precision!r}: choose 'fp32', 'bf16' or 'fp16'")
    if precision != "fp32" and not torch.cuda.is_available():
        raise ValueError(f"precision={precision!r} needs a CUDA GPU; use precision='fp32' on CPU")
    check_layout(cfg, Layout(tensor_model_parallel_size, pipeline_model_parallel_size, 1))
    if use_cpu_initialization is None:
        use_cpu_initialization = not torch.cuda.is_available()
    autocast_dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(precision)
    return TransformerConfig(
        num_layers=cfg.num_layers,
        hidden_size=cfg.hidden_size,
        num_attention_heads=cfg.num_attention_heads,
        ffn_hidden_size=cfg.ffn_size,
        hidden_dropout=cfg.hidden_dropout,
        attention_dropout=cfg.attention_dropout,
        init_method_std=cfg.init_method_std,
        layernorm_epsilon=cfg.layernorm_epsilon,
        normalization=cfg.normalization,
        activation_func=F.silu if cfg.swiglu else F.gelu,
        add_bias_linear=cfg.add_bias_linear,
        gated_linear_unit=cfg.swiglu,
        num_query_groups=cfg.num_query_groups,
        bias_activation_fusion=cfg.bias_activation_fusion,
        masked_softmax_fusion=cfg.masked_softmax_fusion,
        bias_dropout_fusion=cfg.bias_dropout_fusion,
        apply_rope_fusion=False,
        tensor_model_parallel_size=tensor_model_parallel_size,
        pipeline_model_parallel_size=pipeline_model_parallel_size,
        pipeline_dtype=torch.float32 if pipeline_model_parallel_size > 1 else None,
        use_cpu_initialization=use_cpu_initialization,
        params_dtype=torch.float32,
        enable_autocast=autocast_dtype is not None,
        autocast_dtype=autocast_dtype,
        **({"num_moe_experts": cfg.num_experts, "moe_router_topk": cfg.moe_router_topk, "moe_ffn_hidden_size": cfg.ffn_size,
            "moe_grouped_gemm": False, "moe_token_dispatcher_type": "allgather"} if cfg.num_experts else {}),
    )


def build_model(cfg: ModelConfig, *, tensor_model_parallel_size: int | None = None,
                pipeline_model_parallel_size: int | None = None, precision: str = "fp32",
                pre_process: bool | None = None, post_process: bool | None = None,
                layer_spec: str = "auto"):
    """Build megatron-core's ``GPTModel`` (this rank's part of it) for ``cfg``.

    ``parallel_state.initialize_model_parallel`` and the RNG tracker (on CPU after
    ``helpers.support.cpu_compat.apply()``) must be set up first, as in Megatron-LM's pretrain_gpt.py.

    Args:
        cfg: the model shape.
        tensor_model_parallel_size, pipeline_model_parallel_size: default: what
            ``parallel_state`` was initialised with.
        precision: see :func:`transformer_config`.
        pre_process, post_process: this rank holds the embedding / the output layer;
            default: first / last pipeline stage.
        layer_spec: ``"local"`` (megatron-core's torch modules, with ``cfg.core_attention``
            as the attention kernel), ``"te"`` (Transformer Engine) or ``"auto"`` (TE when
            importable).

    Returns:
        ``megatron.core.models.gpt.GPTModel``; ``model(tokens [b, s] int64, position_ids [b, s],
        attention_mask=None, labels=[b, s])`` returns the per-token loss ``[b, s]`` fp32
        (logits ``[b, s, V_pad / TP]`` without labels).

    Raises:
        RuntimeError: model parallelism is not initialised.
        ValueError: see :func:`transformer_config`; ``layer_spec="te"`` without TE.
    """
    from megatron.core import parallel_state
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import (
        get_gpt_decoder_block_spec,
        get_gpt_layer_local_spec,
        get_gpt_layer_with_transformer_engine_spec,
    )

    if not parallel_state.model_parallel_is_initialized():
        raise RuntimeError(
            "build_model needs megatron-core model parallelism initialised: call "
            "helpers.learn.distributed.initialize_distributed(...) (or parallel_state.initialize_model_parallel) first"
        )
    tp = tensor_model_parallel_size or parallel_state.get_tensor_model_parallel_world_size()
    pp = pipeline_model_parallel_size or parallel_state.get_pipeline_model_parallel_world_size()
    config = transformer_config(cfg, tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp,
                                precision=precision)
    use_te = {"auto": transformer_engine_available(), "local": False, "te": True}.get(layer_spec)
    if use_te is None:
        raise ValueError(f"layer_spec={layer_spec!r}: choose 'auto', 'local' or 'te'")
    if use_te and not transformer_engine_available():
        raise ValueError("layer_spec='te' but Transformer Engine is not importable; use 'local'")
    if cfg.num_experts:  # as Megatron-LM's gpt_builders: a block spec whose layers hold MoE MLPs
        spec = get_gpt_decoder_block_spec(config, use_transformer_engine=use_te, normalization=cfg.normalization)
    else:
        spec = get_gpt_layer_with_transformer_engine_spec() if use_te else get_gpt_layer_local_spec(normalization=cfg.normalization)
    if not use_te and cfg.core_attention == "sdpa":
        from helpers.learn.attention import SDPAttention

        for layer in getattr(spec, "layer_specs", None) or [spec]:
            layer.submodules.self_attention.submodules.core_attention = SDPAttention
    if pre_process is None:
        pre_process = parallel_state.is_pipeline_first_stage()
    if post_process is None:
        post_process = parallel_state.is_pipeline_last_stage()
    model = GPTModel(
        config=config,
        transformer_layer_spec=spec,
        vocab_size=cfg.padded_vocab_size(tp),
        max_sequence_length=cfg.max_position_embeddings,
        pre_process=pre_process,
        post_process=post_process,
        parallel_output=True,
        share_embeddings_and_output_weights=cfg.share_embeddings_and_output_weights,
        position_embedding_type=cfg.position_embedding_type,
        rotary_base=cfg.rotary_base,
    )
    model.layer_spec_name = "te" if use_te else "local"
    return model
