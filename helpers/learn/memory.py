"""The memory calculator: bytes per GPU of weights, gradients, optimizer state and activations.

What one GPU holds for a model, a parallel layout, a micro-batch and a precision, for the GPT
shapes of :data:`MODEL_SHAPES`; notebook 05 section 5 tabulates it (:func:`memory_table`) and draws it
(:mod:`helpers.demos.memory_plot`), notebook 03's preflight (:mod:`helpers.runner.preflight`) prints it.

Sources: Megatron-LM ``docs/source/api-guide/distrib_optimizer.md`` (bytes per parameter);
Rajbhandari et al. 2020, "ZeRO" (arXiv:1910.02054) section 5 (optimizer-state sharding);
Korthikanti et al. 2022, "Reducing Activation Recomputation in Large Transformer Models"
(arXiv:2205.05198) sections 4-5 (activation memory); megatron-core 0.19.2
``tensor_parallel/layers.py``, ``models/gpt/gpt_model.py`` (what each rank holds).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

from helpers.learn.model import PROFILES as MODEL_PROFILES
from helpers.learn.model import Layout, ModelConfig, check_layout, count_parameters, layer_parameters, norm_parameters

#: Bytes of one parameter, its gradient and its optimizer state (Adam) by training precision,
#: as Megatron-LM's ``docs/source/api-guide/distrib_optimizer.md`` tabulates them:
#: fp16: fp16 param (2) + fp16 grad (2) + fp32 main grad, master param, Adam m and v (16);
#: bf16: bf16 param (2) + fp32 main grad (4) + fp32 master param, m, v (12);
#: fp32: param (4) + grad (4) + m, v (8). The distributed optimizer shards the last column
#: over the data-parallel ranks (ZeRO stage 1, Rajbhandari et al. 2020).
BYTES_PER_PARAMETER: dict[str, dict[str, int]] = {
    "fp16": {"weights": 2, "gradients": 2, "optimizer_state": 16},
    "bf16": {"weights": 2, "gradients": 4, "optimizer_state": 12},
    "fp32": {"weights": 4, "gradients": 4, "optimizer_state": 8},
}

_GIB = 1024 ** 3

#: Bytes per parameter in one Megatron-LM checkpoint (``--ckpt-format torch_dist``): the weights in
#: the training precision plus Adam's state (m and v, and the fp32 master weights in mixed precision,
#: ``--bf16``/``--fp16``); gradients are not saved. Tied embeddings are saved once.
CHECKPOINT_BYTES_PER_PARAMETER: dict[str, int] = {"fp16": 2 + 12, "bf16": 2 + 12, "fp32": 4 + 8}

#: Bytes per rank beside the tensors (``.metadata``, ``common.pt``: arguments, RNG states,
#: scheduler), plus 1 % of the tensors for their index: measured 0.25-0.39 MB per save for the
#: series' smoke and cpu models (0.17M and 3.4M parameters, fp32, one rank).
CHECKPOINT_OVERHEAD_BYTES_PER_RANK = 512 * 1024


def parameters_per_rank(model: ModelConfig, tensor_model_parallel_size: int = 1,
                        pipeline_model_parallel_size: int = 1, pipeline_rank: int = 0,
                        expert_model_parallel_size: int = 1) -> int:
    """Parameters held by one GPU: its tensor-parallel shard of its pipeline stage.

    Per layer (h hidden, f MLP width, t TP size): column-parallel QKV (3h^2 + 3h)/t and fc1
    (hf + f)/t, row-parallel projection h^2/t and fc2 hf/t whose biases (h each) are replicated,
    and two LayerNorms (4h) replicated on every TP rank (a Llama, :func:`helpers.learn.model.layer_parameters`:
    grouped-query QKV, SwiGLU's gate and up in fc1, no biases, RMSNorms of h). The first stage adds
    the vocab-parallel word embeddings V_pad*h/t and the position embeddings P*h (replicated; none
    with RoPE); the last stage the final norm (2h; h for RMSNorm) and the output layer V_pad*h/t, which, with tied embeddings, is a
    *copy* of the word embeddings when PP > 1 and absent when PP = 1 (megatron-core
    ``LanguageModule.setup_embeddings_and_output_layer``). A mixture of experts (``model.num_experts`` E):
    each layer's router, E*h, replicated, and E/EP of the experts (``expert_model_parallel_size`` EP),
    each split over TP like a dense MLP. Source: megatron-core
    ``tensor_parallel/layers.py``, ``models/gpt/gpt_model.py``. Equals ``sum(p.numel())`` on
    that rank (checked in notebook 05 on real ranks).

    Raises:
        ValueError: a layout :func:`check_layout` refuses, ``pipeline_rank`` out of range, or an expert-parallel
            size that does not divide the experts.
    """
    t, p = tensor_model_parallel_size, pipeline_model_parallel_size
    check_layout(model, Layout(t, p, 1))
    if not 0 <= pipeline_rank < p:
        raise ValueError(f"pipeline_rank={pipeline_rank} must be in [0, {p})")
    return _parameters_per_rank(model, t, p, pipeline_rank, expert_model_parallel_size)


def _parameters_per_rank(model: ModelConfig, t: int, p: int, pipeline_rank: int, ep: int = 1) -> int:
    """:func:`parameters_per_rank` of a layout already checked."""
    if ep > 1 and (not model.num_experts or model.num_experts % ep):
        raise ValueError(f"expert_model_parallel_size={ep} must divide model.num_experts={model.num_experts}")
    h = model.hidden_size
    v = model.padded_vocab_size(t)
    part = layer_parameters(model)
    replicated_bias = h * int(model.add_bias_linear)  # the row-parallel layers' (projection, fc2) biases
    per_layer = (part["qkv"] + part["proj"] - replicated_bias + (part["fc1"] + part["fc2"]) // ep - replicated_bias) // t \
        + 2 * replicated_bias + part["norms"] + part.get("router", 0)
    total = model.num_layers // p * per_layer
    if pipeline_rank == 0:
        total += v * h // t + (model.max_position_embeddings * h if model.position_embedding_type == "learned_absolute" else 0)
    if pipeline_rank == p - 1:
        total += norm_parameters(model)
        if not model.share_embeddings_and_output_weights or p > 1:
            total += v * h // t
    return total


#: Bytes of one activation value by training precision: mixed precision computes in 16 bits
#: (Korthikanti et al.'s accounting); an fp32 run (the series on a CPU) in 32.
ACTIVATION_BYTES: dict[str, int] = {"fp16": 2, "bf16": 2, "fp32": 4}


def activation_bytes_per_layer(model: ModelConfig, micro_batch_size: int, tensor_model_parallel_size: int = 1, *,
                               recompute: str = "none", sequence_parallel: bool = False,
                               bytes_per_value: int = 2, dropout: bool | None = None, fused: bool = True) -> float:
    """Activation memory one transformer layer keeps for the backward pass, per micro-batch (bytes).

    Korthikanti et al. 2022 (arXiv:2205.05198) section 4.1, term by term (s sequence, b micro-batch,
    h hidden, a heads, t TP size, e = ``bytes_per_value``, f the MLP width, g key/value heads of
    size d = h/a):

    * kept whole on every TP rank: the inputs of the two norms and of the QKV and fc1 linears,
      ``4*e*s*b*h``, and with dropout its two 1-byte masks, ``2*s*b*h``;
    * split over TP: Q ``e*s*b*h``, K and V ``2*e*s*b*g*d``, the projection's input ``e*s*b*h``,
      the MLP's ``2*e*s*b*f`` (GELU: its input and output) or ``4*e*s*b*f`` (SwiGLU: the fc1
      output of width 2f, the SiLU output and the product);
    * attention: the softmax output ``e*a*s^2*b``, plus with dropout its mask and output
      ``(1 + e)*a*s^2*b``, split over TP.

    With e = 2, dropout, g = a and a GELU MLP of f = 4h this is the paper's equation 2,
    ``s*b*h*(10 + 24/t + 5*a*s/(h*t))``; sequence parallelism splits the first group too
    (equation 4: ``s*b*h/t*(34 + 5*a*s/h)``). Selective recomputation drops the attention term
    (section 5); full recomputation keeps only the layer's input, ``e*s*b*h`` (/t with sequence
    parallelism; section 4.4).

    ``fused=False`` counts what megatron-core's local layers (``layer_spec="local"``, plain torch
    operations: the series on a CPU) save beyond the fused kernels the paper assumes, measured in
    notebook 05b: torch's RMSNorm also keeps its normalized output (``e*s*b*h``) and both norms
    their fp32 statistics (``4*s*b`` each: RMSNorm's rstd; LayerNorm's mean and rstd, ``8*s*b``);
    the unfused attention repeats grouped K and V to every head (``2*e*s*b*h`` instead of
    ``2*e*s*b*g*d``) and builds a boolean causal mask per layer (``s^2`` bytes); SwiGLU's
    ``x_up + glu_linear_offset`` is one more ``e*s*b*f`` copy; RoPE keeps a cos and a sin for Q and for K
    (``4*e*s*d``).

    A mixture of experts (``model.num_experts``) runs each token through ``moe_router_topk`` k experts: the
    MLP's term counts k times (an estimate by the same accounting, not measured against megatron-core's
    ``MoELayer``, whose router probabilities and permuted token copies add a little more).

    Args:
        bytes_per_value: 2 for bf16/fp16 training, 4 for fp32 (:data:`ACTIVATION_BYTES`).
        dropout: whether dropout masks are kept; default: the model's dropout is not 0.
        fused: the fused kernels' accounting (Transformer Engine, the paper); False: the local layers'.

    Raises:
        ValueError: unknown ``recompute``.
    """
    if recompute not in ("none", "selective", "full"):
        raise ValueError(f"recompute={recompute!r}: choose 'none', 'selective' or 'full'")
    s, b, h, a, t = model.seq_length, micro_batch_size, model.hidden_size, model.num_attention_heads, tensor_model_parallel_size
    e = bytes_per_value
    if dropout is None:
        dropout = bool(model.hidden_dropout or model.attention_dropout)
    whole_t = t if sequence_parallel else 1
    if recompute == "full":
        return e * s * b * h / whole_t
    kv = 2 * s * b * (model.query_groups if fused else a) * (h // a)
    mlp = (4 + (0 if fused else 1) if model.swiglu else 2) * s * b * model.ffn_size \
        * (model.moe_router_topk if model.num_experts else 1)
    whole = (4 * e + (2 if dropout else 0)) * s * b * h / whole_t
    split = e * (2 * s * b * h + kv + mlp) / t
    attention = (e + (1 + e if dropout else 0)) * a * s * s * b / t
    if not fused:
        rms = model.normalization == "RMSNorm"
        whole += 2 * ((e * s * b * h if rms else 0) + (4 if rms else 8) * s * b) / whole_t
        whole += s * s + (4 * e * s * (h // a) if model.position_embedding_type == "rope" else 0)
    return whole + split + (0 if recompute == "selective" else attention)


def microbatches_in_flight(pipeline_model_parallel_size: int, num_microbatches: int, pipeline_rank: int = 0,
                           num_virtual_stages: int | None = None) -> float:
    """Micro-batches whose activations a pipeline rank holds at its peak, in whole-stage units.

    1F1B (Narayanan et al. 2021, section 2.2.1): rank r runs ``p - r - 1`` warm-up forwards, then
    one more before its first backward: ``min(p - r, m)`` micro-batches of its ``L/p`` layers.
    Interleaved (section 2.2.2, megatron-core ``schedules.py``,
    ``get_pp_rank_microbatches``): ``2*(p - r - 1) + (v - 1)*p`` warm-up forwards of model chunks
    of ``L/(p*v)`` layers, plus one: divided by v to count whole stages (rank 0: ``p + (p - 1)/v``,
    the ``1 + (p - 1)/(p*v)`` penalty Megatron-LM's calculator applies). No pipeline: 1.

    Raises:
        ValueError: ``pipeline_rank`` outside ``[0, p)``.
    """
    p, m, v = pipeline_model_parallel_size, num_microbatches, num_virtual_stages or 1
    if not 0 <= pipeline_rank < p:
        raise ValueError(f"pipeline_rank={pipeline_rank} must be in [0, {p})")
    if p == 1:
        return 1
    if v == 1:
        return min(p - pipeline_rank, m)
    return min(2 * (p - pipeline_rank - 1) + (v - 1) * p + 1, m * v) / v


@dataclass(frozen=True)
class MemoryEstimate:
    """Bytes per GPU of one pipeline stage (see :func:`memory_per_gpu`).

    Attributes:
        stage: the pipeline rank described.
        parameters: parameters on this GPU.
        weights, gradients, optimizer_state, activations: bytes.
        microbatches_in_flight: micro-batches whose activations the stage holds at its peak (whole
            stages; fractional with the interleaved schedule).
    """

    stage: int
    parameters: int
    weights: float
    gradients: float
    optimizer_state: float
    activations: float
    microbatches_in_flight: float

    @property
    def total(self) -> float:
        """Sum of the four parts, in bytes (no allocator overhead, no communication buffers)."""
        return self.weights + self.gradients + self.optimizer_state + self.activations

    def gib(self) -> dict[str, float]:
        """The parts and the total in GiB (2^30 bytes), rounded to 2 decimals."""
        keys = ("weights", "gradients", "optimizer_state", "activations")
        return {k: round(getattr(self, k) / _GIB, 2) for k in keys} | {"total": round(self.total / _GIB, 2)}


def checkpoint_bytes(model: ModelConfig, precision: str = "bf16", world_size: int = 1) -> int:
    """Bytes one checkpoint of ``model`` takes on disk, all ranks together (an estimate).

    :func:`helpers.learn.model.count_parameters` x :data:`CHECKPOINT_BYTES_PER_PARAMETER` x 1.01, plus
    :data:`CHECKPOINT_OVERHEAD_BYTES_PER_RANK` per rank. The parameters are counted once however
    the model is split: a distributed checkpoint saves each shard once (megatron-core
    ``dist_checkpointing``). Checked against Megatron-LM's real saves in ``tests/test_training.py``
    (never below; at most 15 % above for the tests' smallest model, where the fixed overhead weighs
    most; 1.3 % above for the cpu profile's 41 MB save, measured 2026-12-03).

    Raises:
        ValueError: an unknown ``precision``.
    """
    if precision not in CHECKPOINT_BYTES_PER_PARAMETER:
        raise ValueError(f"precision={precision!r}: choose one of {sorted(CHECKPOINT_BYTES_PER_PARAMETER)}")
    tensors = count_parameters(model) * CHECKPOINT_BYTES_PER_PARAMETER[precision]
    return int(tensors * 1.01) + CHECKPOINT_OVERHEAD_BYTES_PER_RANK * world_size


def memory_per_gpu(model: ModelConfig, layout: Layout, *, micro_batch_size: int = 1, num_microbatches: int = 1,
                   precision: str = "bf16", distributed_optimizer: bool = False, recompute: str = "none",
                   sequence_parallel: bool = False, num_virtual_stages: int | None = None,
                   fused: bool = True, expert_model_parallel_size: int = 1, stage: int | None = None) -> MemoryEstimate:
    """Bytes per GPU of weights, gradients, optimizer state and activations for one layout.

    * weights, gradients, optimizer state: :func:`parameters_per_rank` x
      :data:`BYTES_PER_PARAMETER` (Megatron-LM ``distrib_optimizer.md``); the distributed
      optimizer divides the optimizer state by DP (ZeRO stage 1, Rajbhandari et al. 2020, section
      5.1: 4 + 12/N_d bytes per parameter in their fp16 accounting);
    * activations: :func:`activation_bytes_per_layer` (values of :data:`ACTIVATION_BYTES` for
      ``precision``) x layers per stage x :func:`microbatches_in_flight`. With the 1F1B schedule
      stage r holds min(p - r, m) micro-batches at its peak, so the first stage holds p x L/p
      layers' worth: the whole model's (Korthikanti et al. 2022, section 4.2.3); the interleaved
      schedule (``num_virtual_stages`` v) holds (p - 1)/v stages more. With dropout the first
      stage adds the embedding dropout mask s*b*h (/t with sequence parallelism) per micro-batch
      held; the last stage the output layer's 2*e*s*b*h (the final norm's and the output layer's
      inputs; /t with sequence parallelism) + 4*s*b*V/t (fp32 logits; section 4.3: 4*s*b*h/t*(1 + V/h) for 16 bits).

    Args:
        model: the model shape; layout: TP, PP, DP.
        micro_batch_size: samples per micro-batch b; num_microbatches: m per optimizer step.
        precision: ``"bf16"``, ``"fp16"`` or ``"fp32"`` (mixed precision keeps fp32 master weights).
        distributed_optimizer: shard the optimizer state over the DP ranks.
        recompute: ``"none"``, ``"selective"`` or ``"full"`` activation recomputation.
        sequence_parallel: split LayerNorm/dropout activations over the TP ranks (needs TP > 1).
        num_virtual_stages: model chunks per pipeline rank (the interleaved schedule); None: 1F1B.
        fused: the fused kernels' activations (GPUs with Transformer Engine); False: megatron-core's
            local layers' (:func:`activation_bytes_per_layer`; on the last stage also the final
            norm's extra tensors and the fp32 loss mask, ``4*s*b``).
        expert_model_parallel_size: the experts of a mixture split over this many ranks (:func:`parameters_per_rank`).
        stage: the pipeline rank to describe; default: the stage with the largest total.

    Returns:
        :class:`MemoryEstimate`.

    Raises:
        ValueError: a layout :func:`check_layout` refuses, an unknown precision or recompute,
            a micro-batch count or size below 1, virtual stages the layout cannot hold, an expert-parallel
            size that does not divide the data-parallel size (or the experts), a ``stage`` outside the pipeline.
    """
    check_layout(model, layout)
    if precision not in BYTES_PER_PARAMETER:
        raise ValueError(f"precision={precision!r}: choose one of {sorted(BYTES_PER_PARAMETER)}")
    if micro_batch_size < 1 or num_microbatches < 1:
        raise ValueError(f"micro_batch_size={micro_batch_size} and num_microbatches={num_microbatches} must be >= 1")
    t, p, d = layout.tensor_model_parallel_size, layout.pipeline_model_parallel_size, layout.data_parallel_size
    v, ep = num_virtual_stages, expert_model_parallel_size
    if v is not None and (v < 2 or p < 2 or model.num_layers % (p * v)):
        raise ValueError(f"num_virtual_stages={v}: the interleaved schedule needs at least 2 chunks on each of at least 2 "
                         f"pipeline ranks (PP={p}) and num_layers={model.num_layers} a multiple of PP x chunks; None: 1F1B")
    if ep < 1 or (ep > 1 and d % ep):
        raise ValueError(f"expert_model_parallel_size={ep}: it must be >= 1 and divide the data-parallel size {d} "
                         "(expert parallelism is carved out of the data-parallel ranks)")
    if stage is not None and not 0 <= stage < p:
        raise ValueError(f"stage={stage}: a pipeline rank in [0, {p})")
    per_param = BYTES_PER_PARAMETER[precision]
    e = ACTIVATION_BYTES[precision]
    layer = activation_bytes_per_layer(model, micro_batch_size, t, recompute=recompute, sequence_parallel=sequence_parallel,
                                       bytes_per_value=e, fused=fused)
    s, b, h = model.seq_length, micro_batch_size, model.hidden_size
    dropout = bool(model.hidden_dropout or model.attention_dropout)
    estimates = []
    for r in range(p) if stage is None else [stage]:
        n = _parameters_per_rank(model, t, p, r, expert_model_parallel_size)
        in_flight = microbatches_in_flight(p, num_microbatches, r, num_virtual_stages)
        act = layer * (model.num_layers // p) * in_flight
        if r == 0 and dropout:
            act += s * b * h / (t if sequence_parallel else 1) * in_flight
        if r == p - 1:
            act += 2 * e * s * b * h / (t if sequence_parallel else 1) + 4 * s * b * model.padded_vocab_size(t) / t
            if not fused:
                rms = model.normalization == "RMSNorm"
                act += ((e * s * b * h if rms else 0) + (4 if rms else 8) * s * b) / (t if sequence_parallel else 1) + 4 * s * b
        estimates.append(MemoryEstimate(
            stage=r, parameters=n, weights=float(n * per_param["weights"]), gradients=float(n * per_param["gradients"]),
            optimizer_state=n * per_param["optimizer_state"] / (d if distributed_optimizer else 1),
            activations=float(act), microbatches_in_flight=in_flight))
    return max(estimates, key=lambda e: e.total)


def megatron_lm_estimate(args, *, num_microbatches: int = 1) -> dict[str, float]:
    """What Megatron-LM's own calculator predicts per GPU for a run's ``args`` (bf16 mixed precision).

    Megatron-LM prints this at the start of a run (``megatron/training/theoretical_memory_usage.py``,
    ``report_theoretical_memory``): ``compute_weight_and_optimizer_memory`` (18 bytes per parameter
    of the most loaded shard, 6 + 12/DP with the distributed optimizer) and, for activations,
    ``compute_activation_memory`` (Korthikanti et al.'s table 2, when sequence parallelism and
    selective recomputation are both on) or ``compute_activation_memory_without_sp``, which counts
    ``s*b*h*(10 + 24/t)`` per layer (no attention-score term, as with selective recomputation or a
    fused attention kernel) and adds 5 % for temporaries. Full recomputation is not modelled.

    Args:
        args: Megatron-LM's ``args`` (``helpers.runner.megatron_args.parsed_args`` makes them from a config).
        num_microbatches: micro-batches per step (the first pipeline stage holds up to PP of them).

    Returns:
        ``{"weights_and_optimizer", "activations", "total"}`` in bytes.
    """
    import logging

    root = logging.getLogger()
    level, handlers = root.level, root.handlers[:]
    from megatron.training import theoretical_memory_usage as tmu  # megatron/training/training.py sets INFO logging

    root.setLevel(level)
    root.handlers[:] = handlers
    weights = tmu.compute_weight_and_optimizer_memory(args)
    if args.sequence_parallel and args.recompute_granularity == "selective":
        acts = tmu.compute_activation_memory(args, num_microbatches=num_microbatches)
    else:
        acts = tmu.compute_activation_memory_without_sp(args, num_microbatches=num_microbatches)
    return {"weights_and_optimizer": float(weights), "activations": float(acts), "total": float(weights + acts)}


#: GPT shapes for the memory calculator. ``codeparrot-small`` is the guide's 110M model;
#: ``gpt-1.3b`` and ``gpt-7b`` are GPT-3 XL and GPT-3 6.7B (Brown et al. 2020, table 2.1);
#: ``gpt-70b`` is a 70B-class shape: Llama-2-70B's depth and width (80 layers, hidden 8192,
#: 64 heads, sequence 4096) with GPT-2's 4h MLP, which makes 64.9B parameters. All with
#: Megatron-LM's default dropout, 0.1 (the masks Korthikanti et al. count).
_DROPOUT = {"hidden_dropout": 0.1, "attention_dropout": 0.1}
MODEL_SHAPES: dict[str, ModelConfig] = {
    "codeparrot-small": MODEL_PROFILES["codeparrot-small"],
    "gpt-1.3b": ModelConfig(num_layers=24, hidden_size=2048, num_attention_heads=16, seq_length=2048,
                            max_position_embeddings=2048, vocab_size=50257, **_DROPOUT),
    "gpt-7b": ModelConfig(num_layers=32, hidden_size=4096, num_attention_heads=32, seq_length=2048,
                          max_position_embeddings=2048, vocab_size=50257, **_DROPOUT),
    "gpt-70b": ModelConfig(num_layers=80, hidden_size=8192, num_attention_heads=64, seq_length=4096,
                           max_position_embeddings=4096, vocab_size=50257, **_DROPOUT),
}



def memory_table(model: ModelConfig, layouts: Sequence[Layout], **kwargs: Any) -> list[dict[str, Any]]:
    """One row per layout: the layout and :meth:`MemoryEstimate.gib` of :func:`memory_per_gpu`
    (``kwargs`` are passed on). Layouts :func:`check_layout` refuses are left out."""
    rows = []
    for layout in layouts:
        try:
            est = memory_per_gpu(model, layout, **kwargs)
        except ValueError:
            continue
        rows.append({"layout": layout.label, "stage": est.stage, "parameters": est.parameters, **est.gib()})
    return rows

