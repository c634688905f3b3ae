"""Tensor, pipeline and data parallelism: layouts, rank groups, schedules, memory, launches.

Notebook 05 uses this module to show the three kinds of parallelism Megatron-LM composes
(world size = TP x PP x DP) and to run them for real on CPU (gloo, 2 processes):

* **layouts and bad input**: :class:`Layout`, :func:`check_layout` (a clear error before any
  process starts: TP not dividing the heads / hidden / MLP width, world size not TP x PP x DP,
  PP larger than the number of layers);
* **rank groups** exactly as megatron-core's ``parallel_state`` builds them (its own
  ``RankGenerator``, no ``torch.distributed`` needed): :func:`rank_groups`,
  :func:`plot_rank_groups`;
* **pipeline schedules**: :func:`pipeline_schedule` simulates GPipe and 1F1B
  (megatron-core's ``forward_backward_pipelining_without_interleaving``), :func:`bubble_fraction`,
  :func:`plot_schedule`;
* **memory per GPU**: :func:`parameters_per_rank`, :func:`memory_per_gpu` (weights,
  gradients, optimizer state, activations; distributed optimizer; selective/full recompute),
  :data:`MODEL_SHAPES`, :func:`plot_memory`;
* **launching past one machine**: :class:`LaunchPlan` (torchrun rendezvous per node),
  :func:`sbatch_script`, :func:`megatron_lm_args`;
* **real runs**: :func:`comparison_config`, :func:`ensure_initial_checkpoint`,
  :func:`run_layout` (trains one layout with ``helpers.training`` under the generated torchrun
  command), :func:`compare_losses`, :func:`plot_losses`, :func:`inspect_shards` (each rank's
  parameter shards, groups and tensor-parallel all-reduce counts).

Entry points (started by torchrun through :mod:`helpers.launch`)::

    python -m helpers.parallelism init-checkpoint --config run.json
    python -m torch.distributed.run --nproc_per_node 4 -m helpers.parallelism shards \\
        --config run.json --tp 2 --pp 2 --out shards/

Sources: Shoeybi et al. 2019, "Megatron-LM" (arXiv:1909.08053) section 3 (column/row-parallel
MLP and attention); Narayanan et al. 2021, "Efficient Large-Scale Language Model Training on GPU
Clusters Using Megatron-LM" (arXiv:2104.04473) sections 2.2 (1F1B, bubble) and 3 (composing
PTD-P); Korthikanti et al. 2022, "Reducing Activation Recomputation in Large Transformer
Models" (arXiv:2205.05198) sections 4-5 (activation memory); Rajbhandari et al. 2020, "ZeRO"
(arXiv:1910.02054) section 5 (optimizer-state sharding); Megatron-LM
``docs/source/api-guide/distrib_optimizer.md`` (bytes per parameter); megatron-core
``parallel_state.py`` (``RankGenerator``), ``pipeline_parallel/schedules.py``,
``tensor_parallel/layers.py``, ``tensor_parallel/cross_entropy.py``.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import shutil
import sys
import warnings
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any, Sequence

from helpers.model import Layout, ModelConfig, check_layout, divisors  # noqa: F401  (parallelism.Layout, .check_layout: notebook 05)
from helpers.model import PROFILES as MODEL_PROFILES

#: The notebook's stem (its results go under this key of ``summary.json``).
NOTEBOOK = "05_parallelism"

#: Largest per-iteration |loss difference| (nats) accepted as "the same run" in fp32. Reduction
#: order differs between layouts (a sum split over 2 ranks, then all-reduced), so fp32
#: round-off (about 1e-7 relative) enters every step; AdamW keeps it at that scale.
LOSS_ATOL_FP32 = 1e-4

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

#: GPT shapes for the memory calculator. ``codeparrot-small`` is the guide's 110M model;
#: ``gpt-1.3b`` and ``gpt-7b`` are GPT-3 XL and GPT-3 6.7B (Brown et al. 2020, table 2.1);
#: ``gpt-70b`` is a 70B-class shape: Llama-2-70B's depth and width (80 layers, hidden 8192,
#: 64 heads, sequence 4096) with GPT-2's 4h MLP, which makes 64.9B parameters.
MODEL_SHAPES: dict[str, ModelConfig] = {
    "codeparrot-small": MODEL_PROFILES["codeparrot-small"],
    "gpt-1.3b": ModelConfig(num_layers=24, hidden_size=2048, num_attention_heads=16, seq_length=2048,
                            max_position_embeddings=2048, vocab_size=50257),
    "gpt-7b": ModelConfig(num_layers=32, hidden_size=4096, num_attention_heads=32, seq_length=2048,
                          max_position_embeddings=2048, vocab_size=50257),
    "gpt-70b": ModelConfig(num_layers=80, hidden_size=8192, num_attention_heads=64, seq_length=4096,
                           max_position_embeddings=4096, vocab_size=50257),
}

GIB = 1024 ** 3


# =========================================================================== layouts
def layouts_for(world_size: int, model: ModelConfig | None = None) -> list[Layout]:
    """Every (TP, PP, DP) with TP x PP x DP = ``world_size`` (valid for ``model`` when given),
    ordered by TP, then PP."""
    out = []
    for tp in divisors(world_size):
        for pp in divisors(world_size // tp):
            layout = Layout(tp, pp, world_size // (tp * pp))
            if model is not None:
                try:
                    check_layout(model, layout)
                except ValueError:
                    continue
            out.append(layout)
    return out


# =========================================================================== rank groups
#: megatron-core 0.19.2's default rank order (``initialize_model_parallel(order=...)``):
#: TP ranks are neighbours (same node), PP is the outermost dimension.
DEFAULT_ORDER = "tp-cp-ep-dp-pp"


def rank_groups(layout: Layout, order: str = DEFAULT_ORDER) -> dict[str, list[list[int]]]:
    """The process groups ``parallel_state.initialize_model_parallel`` creates for ``layout``.

    Computed with megatron-core's own ``RankGenerator`` (``parallel_state.py``), which needs no
    ``torch.distributed``: global rank = tp_rank + TP x (dp_rank + DP x pp_rank) in the default
    order. ``"embedding"`` holds the first and last stage of every pipeline (the ranks whose
    tied word-embedding gradients are all-reduced, ``default_embedding_ranks``).

    Returns:
        ``{"tp": [...], "dp": [...], "pp": [...], "mp": [...], "embedding": [...]}``, each a list
        of groups, each a list of global ranks (``"mp"`` is the model-parallel group TP x PP).
    """
    from megatron.core.parallel_state import RankGenerator, default_embedding_ranks

    gen = RankGenerator(tp=layout.tensor_model_parallel_size, ep=1, dp=layout.data_parallel_size,
                        pp=layout.pipeline_model_parallel_size, cp=1, order=order)
    groups = {"tp": gen.get_ranks("tp"), "dp": gen.get_ranks("dp"), "pp": gen.get_ranks("pp"),
              "mp": gen.get_ranks("tp-pp")}
    groups["embedding"] = [default_embedding_ranks(g) for g in groups["pp"]]
    return groups


def rank_coordinates(layout: Layout, order: str = DEFAULT_ORDER) -> list[dict[str, int]]:
    """``[{"rank", "tp_rank", "pp_rank", "dp_rank"}]`` for every global rank: its position in
    its TP, PP and DP group (as ``parallel_state.get_*_rank()`` would return on that rank)."""
    groups = rank_groups(layout, order)
    coords = [{"rank": r} for r in range(layout.world_size)]
    for kind in ("tp", "pp", "dp"):
        for group in groups[kind]:
            for pos, rank in enumerate(group):
                coords[rank][f"{kind}_rank"] = pos
    return coords


def plot_rank_groups(layout: Layout, gpus_per_node: int = 4, order: str = DEFAULT_ORDER):
    """Three panels (TP, PP, DP groups): every GPU as a box on its node, coloured by group.

    Args:
        layout: the parallel layout; its world size must be a multiple of ``gpus_per_node``.
        gpus_per_node: GPUs per node (a row of boxes).

    Returns:
        The matplotlib figure.

    Raises:
        ValueError: the world size is not a multiple of ``gpus_per_node``.
    """
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch, Rectangle

    if layout.world_size % gpus_per_node:
        raise ValueError(f"world size {layout.world_size} is not a multiple of gpus_per_node={gpus_per_node}")
    groups, coords = rank_groups(layout, order), rank_coordinates(layout, order)
    nodes = layout.world_size // gpus_per_node
    cmap = plt.get_cmap("tab10")
    titles = {"tp": "tensor-parallel groups", "pp": "pipeline-parallel groups", "dp": "data-parallel groups"}
    fig, axes = plt.subplots(1, 3, figsize=(4.6 * 3, 1.1 * nodes + 1.6))
    for ax, kind in zip(axes, ("tp", "pp", "dp")):
        for gi, group in enumerate(groups[kind]):
            for rank in group:
                node, slot = divmod(rank, gpus_per_node)
                ax.add_patch(Rectangle((slot, nodes - 1 - node), 0.9, 0.8, color=cmap(gi % 10), alpha=0.75))
                c = coords[rank]
                ax.text(slot + 0.45, nodes - 1 - node + 0.4,
                        f"GPU {rank}\ntp{c['tp_rank']} pp{c['pp_rank']} dp{c['dp_rank']}",
                        ha="center", va="center", fontsize=7)
        ax.set_xlim(-0.1, gpus_per_node)
        ax.set_ylim(-0.1, nodes)
        ax.set_xticks([i + 0.45 for i in range(gpus_per_node)], [str(i) for i in range(gpus_per_node)])
        ax.set_yticks([nodes - 1 - n + 0.4 for n in range(nodes)], [f"node {n}" for n in range(nodes)])
        ax.set_xlabel("local rank (GPU index on the node)")
        ax.set_title(f"{len(groups[kind])} {titles[kind]}")
        ax.legend(handles=[Patch(color=cmap(i % 10), alpha=0.75, label=str(g)) for i, g in enumerate(groups[kind])],
                  fontsize=7, loc="upper center", bbox_to_anchor=(0.5, -0.28), ncol=min(4, len(groups[kind])),
                  title="ranks per group", title_fontsize=7)
    fig.suptitle(f"megatron-core rank groups for {layout.label} (world size {layout.world_size}, order {order})")
    fig.tight_layout()
    return fig


# =========================================================================== pipeline schedules
@dataclass(frozen=True)
class PipelineOp:
    """One forward (``"F"``) or backward (``"B"``) pass of a micro-batch on a stage; times in
    units of one forward pass of one stage."""

    stage: int
    kind: str
    microbatch: int
    start: float
    end: float


def bubble_fraction(pipeline_model_parallel_size: int, num_microbatches: int) -> float:
    """Idle fraction of a pipeline step: (p - 1) / (m + p - 1).

    Each stage idles for (p - 1) forward and (p - 1) backward slots while the pipeline fills and
    drains, out of (m + p - 1) slots in all. Narayanan et al. 2021 (arXiv:2104.04473) section
    2.2.1 state it relative to the ideal time, (p - 1) / m; both are the same bubble.

    Raises:
        ValueError: p or m below 1.
    """
    p, m = pipeline_model_parallel_size, num_microbatches
    if p < 1 or m < 1:
        raise ValueError(f"pipeline_model_parallel_size={p} and num_microbatches={m} must be >= 1")
    return (p - 1) / (m + p - 1)


def pipeline_schedule(pipeline_model_parallel_size: int, num_microbatches: int, *, schedule: str = "1f1b",
                      forward_time: float = 1.0, backward_time: float = 2.0) -> list[PipelineOp]:
    """Simulate a pipeline step: when each stage runs each micro-batch's forward and backward.

    ``"1f1b"`` follows megatron-core ``forward_backward_pipelining_without_interleaving``
    (``pipeline_parallel/schedules.py``): stage r runs ``min(p - r - 1, m)`` warm-up forwards,
    then alternates one forward and one backward, then drains the remaining backwards.
    ``"gpipe"`` runs all forwards, then all backwards (Huang et al. 2019). A forward on stage r
    waits for the same micro-batch's forward on stage r - 1; a backward on stage r for the
    backward on stage r + 1 (or, on the last stage, its own forward). Communication takes no time.

    Args:
        pipeline_model_parallel_size: stages p.
        num_microbatches: micro-batches m per optimizer step.
        schedule: ``"1f1b"`` or ``"gpipe"``.
        forward_time, backward_time: durations (a backward is about 2 forwards).

    Returns:
        The operations of every stage, sorted by start time.

    Raises:
        ValueError: p or m below 1, an unknown schedule, or non-positive durations.
    """
    p, m = pipeline_model_parallel_size, num_microbatches
    if p < 1 or m < 1:
        raise ValueError(f"pipeline_model_parallel_size={p} and num_microbatches={m} must be >= 1")
    if forward_time <= 0 or backward_time <= 0:
        raise ValueError("forward_time and backward_time must be > 0")
    if schedule == "1f1b":
        orders = []
        for r in range(p):
            warmup = min(p - r - 1, m)
            order = [("F", i) for i in range(warmup)]
            for i in range(m - warmup):
                order += [("F", warmup + i), ("B", i)]
            order += [("B", i) for i in range(m - warmup, m)]
            orders.append(order)
    elif schedule == "gpipe":
        orders = [[("F", i) for i in range(m)] + [("B", i) for i in range(m)] for _ in range(p)]
    else:
        raise ValueError(f"schedule={schedule!r}: choose '1f1b' or 'gpipe'")
    done: dict[tuple[str, int, int], float] = {}
    free = [0.0] * p
    pos = [0] * p
    ops: list[PipelineOp] = []
    while any(pos[r] < len(orders[r]) for r in range(p)):
        progressed = False
        for r in range(p):
            if pos[r] == len(orders[r]):
                continue
            kind, i = orders[r][pos[r]]
            dep = ("F", r - 1, i) if kind == "F" and r > 0 else ("B", r + 1, i) if kind == "B" and r < p - 1 else (
                ("F", r, i) if kind == "B" else None)
            if dep is not None and dep not in done:
                continue
            start = max(free[r], done[dep] if dep is not None else 0.0)
            end = start + (forward_time if kind == "F" else backward_time)
            done[(kind, r, i)] = free[r] = end
            ops.append(PipelineOp(r, kind, i, start, end))
            pos[r] += 1
            progressed = True
        if not progressed:  # pragma: no cover - the orders above never deadlock
            raise RuntimeError("pipeline schedule deadlocked")
    return sorted(ops, key=lambda o: (o.start, o.stage))


def schedule_stats(ops: list[PipelineOp]) -> dict[str, Any]:
    """Makespan, idle (bubble) fraction and the peak number of micro-batches whose activations
    a stage holds at once (forward done, backward not yet), from :func:`pipeline_schedule`.

    Returns:
        ``{"makespan", "bubble_fraction", "peak_in_flight": [per stage]}``.
    """
    stages = sorted({o.stage for o in ops})
    makespan = max(o.end for o in ops)
    busy = sum(o.end - o.start for o in ops)
    peaks = []
    for s in stages:
        events = sorted([(o.end, 1) for o in ops if o.stage == s and o.kind == "F"]
                        + [(o.end, -1) for o in ops if o.stage == s and o.kind == "B"])
        level = peak = 0
        for _, delta in events:
            level += delta
            peak = max(peak, level)
        peaks.append(peak)
    return {"makespan": makespan, "bubble_fraction": 1 - busy / (makespan * len(stages)), "peak_in_flight": peaks}


def plot_schedule(pipeline_model_parallel_size: int, num_microbatches: int,
                  schedules: Sequence[str] = ("gpipe", "1f1b")):
    """Timelines (one row per stage) of the simulated schedules, with their bubble fractions.

    Returns:
        The matplotlib figure.
    """
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    p, m = pipeline_model_parallel_size, num_microbatches
    fig, axes = plt.subplots(len(schedules), 1, figsize=(11, 1.0 + 0.55 * p * len(schedules)), squeeze=False)
    colors = {"F": "tab:blue", "B": "tab:orange"}
    for ax, name in zip(axes[:, 0], schedules):
        ops = pipeline_schedule(p, m, schedule=name)
        stats = schedule_stats(ops)
        for o in ops:
            ax.broken_barh([(o.start, o.end - o.start)], (p - 1 - o.stage - 0.4, 0.8),
                           facecolors=colors[o.kind], edgecolor="white")
            ax.text((o.start + o.end) / 2, p - 1 - o.stage, str(o.microbatch + 1), ha="center", va="center",
                    fontsize=7, color="white")
        ax.set_yticks(range(p), [f"stage {p - 1 - i}" for i in range(p)])
        ax.set_xlim(0, stats["makespan"])
        ax.set_xlabel("time (units of one stage's forward pass; backward = 2)")
        ax.set_title(f"{name.upper()}: p={p} stages, m={m} micro-batches | bubble {stats['bubble_fraction']:.1%} "
                     f"(formula (p-1)/(m+p-1) = {bubble_fraction(p, m):.1%}) | peak micro-batches held "
                     f"{max(stats['peak_in_flight'])}", fontsize=9)
        ax.legend(handles=[Patch(color=colors["F"], label="forward (micro-batch no.)"),
                           Patch(color=colors["B"], label="backward")], fontsize=7, loc="upper left",
                  bbox_to_anchor=(1.0, 1.0))
    fig.tight_layout()
    return fig


def bubble_table(pipeline_model_parallel_size: int, microbatches: Sequence[int] = (1, 2, 4, 8, 16, 32)
                 ) -> list[dict[str, Any]]:
    """Per micro-batch count m: the bubble by formula and by simulation (1F1B), and the most
    micro-batches a stage holds at once with 1F1B and with GPipe."""
    rows = []
    p = pipeline_model_parallel_size
    for m in microbatches:
        one_f_one_b = schedule_stats(pipeline_schedule(p, m))
        gpipe = schedule_stats(pipeline_schedule(p, m, schedule="gpipe"))
        rows.append({"micro-batches m": m, f"bubble (p-1)/(m+p-1), p={p}": f"{bubble_fraction(p, m):.1%}",
                     "simulated 1F1B bubble": f"{one_f_one_b['bubble_fraction']:.1%}",
                     "1F1B peak micro-batches held": max(one_f_one_b["peak_in_flight"]),
                     "GPipe peak": max(gpipe["peak_in_flight"])})
    return rows


# =========================================================================== memory calculator
def parameters_per_rank(model: ModelConfig, tensor_model_parallel_size: int = 1,
                        pipeline_model_parallel_size: int = 1, pipeline_rank: int = 0) -> int:
    """Parameters held by one GPU: its tensor-parallel shard of its pipeline stage.

    Per layer (h hidden, f MLP width, t TP size): column-parallel QKV (3h^2 + 3h)/t and fc1
    (hf + f)/t, row-parallel projection h^2/t and fc2 hf/t whose biases (h each) are replicated,
    and two LayerNorms (4h) replicated on every TP rank. The first stage adds the vocab-parallel
    word embeddings V_pad*h/t and the position embeddings P*h (replicated); the last stage the
    final LayerNorm (2h) and the output layer V_pad*h/t, which, with tied embeddings, is a
    *copy* of the word embeddings when PP > 1 and absent when PP = 1 (megatron-core
    ``LanguageModule.setup_embeddings_and_output_layer``). Source: megatron-core
    ``tensor_parallel/layers.py``, ``models/gpt/gpt_model.py``. Equals ``sum(p.numel())`` on
    that rank (checked in notebook 05 on real ranks).

    Raises:
        ValueError: a layout :func:`check_layout` refuses, or ``pipeline_rank`` out of range.
    """
    t, p = tensor_model_parallel_size, pipeline_model_parallel_size
    check_layout(model, Layout(t, p, 1))
    if not 0 <= pipeline_rank < p:
        raise ValueError(f"pipeline_rank={pipeline_rank} must be in [0, {p})")
    h, f = model.hidden_size, model.ffn_size
    v = model.padded_vocab_size(t)
    per_layer = 4 * h + (3 * h * h + 3 * h) // t + h * h // t + h + (h * f + f) // t + h * f // t + h
    total = model.num_layers // p * per_layer
    if pipeline_rank == 0:
        total += v * h // t + model.max_position_embeddings * h
    if pipeline_rank == p - 1:
        total += 2 * h
        if not model.share_embeddings_and_output_weights or p > 1:
            total += v * h // t
    return total


def activation_bytes_per_layer(model: ModelConfig, micro_batch_size: int, tensor_model_parallel_size: int = 1, *,
                               recompute: str = "none", sequence_parallel: bool = False) -> float:
    """Activation memory one transformer layer keeps for the backward pass, per micro-batch (bytes).

    Korthikanti et al. 2022 (arXiv:2205.05198), 16-bit activations and 1-byte dropout masks,
    s sequence, b micro-batch, h hidden, a heads, t TP size:

    * no recompute: s*b*h*(10 + 24/t + 5*a*s/(h*t)) (equation 2); with sequence parallelism
      s*b*h/t*(34 + 5*a*s/h) (equation 4);
    * selective recompute (attention scores, softmax and its dropout recomputed; section 5):
      s*b*h*(10 + 24/t), or 34*s*b*h/t with sequence parallelism;
    * full recompute (only each layer's input kept; section 4.4): 2*s*b*h, or 2*s*b*h/t.

    The formulas assume f = 4h. Raises:
        ValueError: unknown ``recompute``.
    """
    s, b, h, a, t = model.seq_length, micro_batch_size, model.hidden_size, model.num_attention_heads, tensor_model_parallel_size
    sbh = s * b * h
    if recompute == "none":
        return sbh / t * (34 + 5 * a * s / h) if sequence_parallel else sbh * (10 + 24 / t + 5 * a * s / (h * t))
    if recompute == "selective":
        return 34 * sbh / t if sequence_parallel else sbh * (10 + 24 / t)
    if recompute == "full":
        return 2 * sbh / t if sequence_parallel else 2 * sbh
    raise ValueError(f"recompute={recompute!r}: choose 'none', 'selective' or 'full'")


@dataclass(frozen=True)
class MemoryEstimate:
    """Bytes per GPU of one pipeline stage (see :func:`memory_per_gpu`).

    Attributes:
        stage: the pipeline rank described.
        parameters: parameters on this GPU.
        weights, gradients, optimizer_state, activations: bytes.
        microbatches_in_flight: micro-batches whose activations the stage holds at its peak.
    """

    stage: int
    parameters: int
    weights: float
    gradients: float
    optimizer_state: float
    activations: float
    microbatches_in_flight: int

    @property
    def total(self) -> float:
        """Sum of the four parts, in bytes (no allocator overhead, no communication buffers)."""
        return self.weights + self.gradients + self.optimizer_state + self.activations

    def gib(self) -> dict[str, float]:
        """The parts and the total in GiB (2^30 bytes), rounded to 2 decimals."""
        keys = ("weights", "gradients", "optimizer_state", "activations")
        return {k: round(getattr(self, k) / GIB, 2) for k in keys} | {"total": round(self.total / GIB, 2)}


def memory_per_gpu(model: ModelConfig, layout: Layout, *, micro_batch_size: int = 1, num_microbatches: int = 1,
                   precision: str = "bf16", distributed_optimizer: bool = False, recompute: str = "none",
                   sequence_parallel: bool = False, stage: int | None = None) -> MemoryEstimate:
    """Bytes per GPU of weights, gradients, optimizer state and activations for one layout.

    * weights, gradients, optimizer state: :func:`parameters_per_rank` x
      :data:`BYTES_PER_PARAMETER` (Megatron-LM ``distrib_optimizer.md``); the distributed
      optimizer divides the optimizer state by DP (ZeRO stage 1, Rajbhandari et al. 2020, section
      5.1: 4 + 12/N_d bytes per parameter in their fp16 accounting);
    * activations: :func:`activation_bytes_per_layer` x layers per stage x micro-batches in
      flight. With the 1F1B schedule stage r holds min(p - r, m) micro-batches at its peak, so
      the first stage holds p x L/p layers' worth: the whole model's (Korthikanti et al. 2022,
      section 4.2.3). The first stage adds the embedding dropout mask s*b*h (/t with sequence
      parallelism) per micro-batch held, the last stage the output layer's
      4*s*b*h/t*(1 + V/h) (section 4.3: LayerNorm input and fp32 logits).

    Args:
        model: the model shape; layout: TP, PP, DP.
        micro_batch_size: samples per micro-batch b; num_microbatches: m per optimizer step.
        precision: ``"bf16"``, ``"fp16"`` or ``"fp32"`` (mixed precision keeps fp32 master weights).
        distributed_optimizer: shard the optimizer state over the DP ranks.
        recompute: ``"none"``, ``"selective"`` or ``"full"`` activation recomputation.
        sequence_parallel: split LayerNorm/dropout activations over the TP ranks (needs TP > 1).
        stage: the pipeline rank to describe; default: the stage with the largest total.

    Returns:
        :class:`MemoryEstimate`.

    Raises:
        ValueError: a layout :func:`check_layout` refuses, an unknown precision or recompute,
            a micro-batch count or size below 1.
    """
    check_layout(model, layout)
    if precision not in BYTES_PER_PARAMETER:
        raise ValueError(f"precision={precision!r}: choose one of {sorted(BYTES_PER_PARAMETER)}")
    if micro_batch_size < 1 or num_microbatches < 1:
        raise ValueError(f"micro_batch_size={micro_batch_size} and num_microbatches={num_microbatches} must be >= 1")
    t, p, d = layout.tensor_model_parallel_size, layout.pipeline_model_parallel_size, layout.data_parallel_size
    per_param = BYTES_PER_PARAMETER[precision]
    layer = activation_bytes_per_layer(model, micro_batch_size, t, recompute=recompute, sequence_parallel=sequence_parallel)
    s, b, h = model.seq_length, micro_batch_size, model.hidden_size
    estimates = []
    for r in range(p) if stage is None else [stage]:
        n = parameters_per_rank(model, t, p, r)
        in_flight = min(p - r, num_microbatches)
        act = layer * (model.num_layers // p) * in_flight
        if r == 0:
            act += s * b * h / (t if sequence_parallel else 1) * in_flight
        if r == p - 1:
            act += 4 * s * b * h / t * (1 + model.padded_vocab_size(t) / h)
        estimates.append(MemoryEstimate(
            stage=r, parameters=n, weights=float(n * per_param["weights"]), gradients=float(n * per_param["gradients"]),
            optimizer_state=n * per_param["optimizer_state"] / (d if distributed_optimizer else 1),
            activations=float(act), microbatches_in_flight=in_flight))
    return max(estimates, key=lambda e: e.total)


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


def plot_memory(model: ModelConfig, layouts: Sequence[Layout], variants: dict[str, dict[str, Any]], *,
                title: str, gpu_memory_gib: float | None = 80.0):
    """Stacked bars of GiB per GPU (weights, gradients, optimizer state, activations) for each
    layout, one panel per variant (``{"panel title": memory_per_gpu kwargs}``), with a line at
    ``gpu_memory_gib``.

    Returns:
        The matplotlib figure.
    """
    import matplotlib.pyplot as plt

    parts = ("weights", "gradients", "optimizer_state", "activations")
    colors = ("tab:blue", "tab:orange", "tab:green", "tab:red")
    fig, axes = plt.subplots(1, len(variants), figsize=(5.2 * len(variants), 4.2), sharey=True, squeeze=False)
    for ax, (name, kwargs) in zip(axes[0], variants.items()):
        rows = memory_table(model, layouts, **kwargs)
        labels = [r["layout"].replace(" ", "\n") for r in rows]
        bottom = [0.0] * len(rows)
        for part, color in zip(parts, colors):
            vals = [r[part] for r in rows]
            ax.bar(labels, vals, bottom=bottom, color=color, label=part.replace("_", " "))
            bottom = [b + v for b, v in zip(bottom, vals)]
        if gpu_memory_gib:
            ax.axhline(gpu_memory_gib, color="black", ls="--", lw=1, label=f"{gpu_memory_gib:g} GiB GPU")
        ax.set_title(name, fontsize=9)
        ax.set_xlabel("layout")
        ax.tick_params(axis="x", labelsize=7)
    axes[0, 0].set_ylabel("memory per GPU (GiB)")
    axes[0, 0].legend(fontsize=7)
    fig.suptitle(title)
    fig.tight_layout()
    return fig


# =========================================================================== launching
@dataclass(frozen=True)
class LaunchPlan:
    """A torchrun launch of ``target`` for a layout on ``nnodes`` machines.

    Attributes:
        layout: the parallel layout (its world size = nnodes x nproc_per_node).
        nnodes, nproc_per_node: machines and processes (GPUs) per machine.
        master_addr, master_port: the rendezvous (node 0's address and a free port on it).
        target: the module and its arguments, e.g. ``["helpers.training", "--config", "run.json"]``.
    """

    layout: Layout
    nnodes: int
    nproc_per_node: int
    master_addr: str
    master_port: int
    target: tuple[str, ...]

    def node_command(self, node_rank: int, torchrun: Sequence[str] = ("torchrun",)) -> list[str]:
        """The command to start on machine ``node_rank`` (static rendezvous, as
        ``helpers.launch.torchrun_command`` writes it). ``torchrun`` is the launcher's argv
        prefix: ``("torchrun",)`` on a cluster, ``(sys.executable, "-m", "torch.distributed.run")``
        here.

        Raises:
            ValueError: ``node_rank`` outside [0, nnodes).
        """
        from helpers import launch

        if not 0 <= node_rank < self.nnodes:
            raise ValueError(f"node_rank={node_rank} must be in [0, {self.nnodes})")
        cmd = launch.torchrun_command(list(self.target), nproc_per_node=self.nproc_per_node, nnodes=self.nnodes,
                                      node_rank=node_rank, master_addr=self.master_addr, master_port=self.master_port)
        return list(torchrun) + cmd[3:]

    def commands(self) -> list[str]:
        """One shell line per node (``torchrun ...``)."""
        return [shlex.join(self.node_command(n)) for n in range(self.nnodes)]

    def local_command(self) -> list[str]:
        """Node 0's command with this Python's ``-m torch.distributed.run`` (what
        ``helpers.launch.torchrun`` executes on one machine)."""
        return self.node_command(0, (sys.executable, "-m", "torch.distributed.run"))


def launch_plan(layout: Layout, target: Sequence[str], *, nnodes: int = 1, nproc_per_node: int | None = None,
                master_addr: str = "127.0.0.1", master_port: int | None = None,
                warn_tp_across_nodes: bool = True) -> LaunchPlan:
    """Plan the torchrun launch of ``target`` for ``layout`` on ``nnodes`` machines.

    Args:
        layout: TP, PP, DP sizes; world size = nnodes x nproc_per_node.
        target: module and arguments run by every process.
        nnodes: machines; ``nproc_per_node`` GPUs each (default world size / nnodes).
        master_addr, master_port: node 0's address and port (a free local port by default).

    Raises:
        ValueError: the world size is not nnodes x nproc_per_node.

    Warns:
        UserWarning: a TP group spans machines (TP all-reduces twice per layer in forward and
            backward, so Megatron keeps TP inside a node's NVLink domain; Narayanan et al. 2021,
            section 3.3).
    """
    from helpers import launch

    if nnodes < 1:
        raise ValueError(f"nnodes={nnodes} must be >= 1")
    if nproc_per_node is None:
        if layout.world_size % nnodes:
            raise ValueError(f"world size {layout.world_size} ({layout.label}) is not divisible by nnodes={nnodes}")
        nproc_per_node = layout.world_size // nnodes
    if nnodes * nproc_per_node != layout.world_size:
        raise ValueError(
            f"nnodes x nproc_per_node = {nnodes} x {nproc_per_node} = {nnodes * nproc_per_node} processes, but "
            f"{layout.label} needs TP x PP x DP = {layout.world_size}: change nnodes, nproc_per_node or the DP size"
        )
    if warn_tp_across_nodes and layout.tensor_model_parallel_size > nproc_per_node:
        warnings.warn(f"tensor_model_parallel_size={layout.tensor_model_parallel_size} > {nproc_per_node} GPUs per "
                      "node: each TP group spans machines and its all-reduces cross the network", stacklevel=2)
    port = master_port if master_port is not None else launch.free_port()
    return LaunchPlan(layout, nnodes, nproc_per_node, master_addr, int(port), tuple(target))


def megatron_lm_args(layout: Layout, *, micro_batch_size: int, global_batch_size: int,
                     distributed_optimizer: bool = False, recompute: str = "none",
                     sequence_parallel: bool = False) -> list[str]:
    """Megatron-LM ``pretrain_gpt.py`` arguments for a layout (DP is implied: world / (TP x PP)).

    Raises:
        ValueError: the global batch is not a multiple of micro-batch x DP; unknown recompute.
    """
    if global_batch_size % (micro_batch_size * layout.data_parallel_size):
        raise ValueError(f"global_batch_size={global_batch_size} is not a multiple of micro_batch_size x DP = "
                         f"{micro_batch_size} x {layout.data_parallel_size}")
    args = [f"--tensor-model-parallel-size {layout.tensor_model_parallel_size}",
            f"--pipeline-model-parallel-size {layout.pipeline_model_parallel_size}",
            f"--micro-batch-size {micro_batch_size}", f"--global-batch-size {global_batch_size}"]
    if sequence_parallel:
        args.append("--sequence-parallel")
    if distributed_optimizer:
        args.append("--use-distributed-optimizer")
    if recompute == "selective":
        args.append("--recompute-activations")
    elif recompute == "full":
        args.append("--recompute-granularity full --recompute-method uniform --recompute-num-layers 1")
    elif recompute != "none":
        raise ValueError(f"recompute={recompute!r}: choose 'none', 'selective' or 'full'")
    return args


def sbatch_script(plan: LaunchPlan, *, job_name: str = "megatron-gpt", time_limit: str = "24:00:00",
                  partition: str | None = None, container_image: str | None = None,
                  workdir: str = "$SLURM_SUBMIT_DIR", rdzv_port: int = 29500) -> str:
    """A SLURM batch script that starts ``plan`` with one torchrun per node.

    ``srun`` runs one task per node; every torchrun meets the others through the c10d
    rendezvous on the first node of the allocation (``--rdzv-backend c10d --rdzv-endpoint
    head:port --rdzv-id $SLURM_JOB_ID``), so no node needs its rank written in. With
    ``container_image`` the tasks run inside it (pyxis/enroot ``--container-image``, as on
    NVIDIA's clusters).

    Returns:
        The script text (submit it with ``sbatch``).
    """
    lines = [
        "#!/bin/bash",
        f"#SBATCH --job-name={job_name}",
        f"#SBATCH --nodes={plan.nnodes}",
        "#SBATCH --ntasks-per-node=1",
        f"#SBATCH --gpus-per-node={plan.nproc_per_node}",
        "#SBATCH --exclusive",
        f"#SBATCH --time={time_limit}",
    ]
    if partition:
        lines.append(f"#SBATCH --partition={partition}")
    lines += [
        f"#SBATCH --output={job_name}-%j.out",
        "",
        f"# {plan.layout.label}: world size {plan.layout.world_size} = {plan.nnodes} nodes x {plan.nproc_per_node} GPUs",
        "set -euo pipefail",
        'HEAD_NODE=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)',
        "export OMP_NUM_THREADS=1",
        f"cd {workdir}",
        "",
    ]
    container = f" --container-image={container_image} --container-mounts={workdir}:{workdir}" if container_image else ""
    torchrun = [
        "torchrun", f"--nnodes={plan.nnodes}", f"--nproc_per_node={plan.nproc_per_node}",
        "--rdzv_backend=c10d", f"--rdzv_endpoint=$HEAD_NODE:{rdzv_port}", "--rdzv_id=$SLURM_JOB_ID",
        "-m " + shlex.join(plan.target),
    ]
    lines.append(f"srun{container} " + " \\\n    ".join(torchrun))
    return "\n".join(lines) + "\n"


# =========================================================================== real runs
@dataclass
class LayoutRun:
    """One layout trained by :func:`run_layout`.

    Attributes:
        layout, name: the layout and its folder name under ``{run_dir}/parallelism``.
        losses: LM loss (nats/token) of iterations 1..train_iters, in order.
        s_per_iter: seconds per iteration as logged.
        valid_losses: validation loss at iteration 0 and at the end.
        wall_seconds: the torchrun job's wall time (imports, set-up, training, saving).
        command: the command executed; generated_command: the one :class:`LaunchPlan` wrote.
        checkpoint_dir: where its checkpoints are.
        initial: ``"shared"`` (started from the shared initial checkpoint) or ``"own"``.
        skipped: the result was read from an earlier run (nothing launched).
    """

    layout: Layout
    name: str
    losses: list[float]
    s_per_iter: list[float]
    valid_losses: list[float]
    wall_seconds: float
    command: list[str]
    generated_command: list[str]
    checkpoint_dir: str
    initial: str
    skipped: bool = False

    def to_dict(self) -> dict[str, Any]:
        data = asdict(self)
        data["layout"] = asdict(self.layout)
        return data

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "LayoutRun":
        return cls(**{**data, "layout": Layout(**data["layout"])})


def ensure_run_data(run_dir: str | os.PathLike, *, max_files: int | None = None, vocab_size: int | None = None,
                    split: str | None = None, progress: bool = True) -> Any:
    """The run folder's data (notebook 01), made with these settings only if it has none yet.

    When ``{run_dir}/data`` already has a manifest, its own settings are used and the arguments
    are ignored (so a notebook's defaults never clash with what notebook 01 made).

    Returns:
        ``helpers.preprocess.DataPaths``.
    """
    from helpers import preprocess

    if (Path(run_dir).expanduser().resolve() / preprocess.DATA_DIR / preprocess.MANIFEST_NAME).is_file():
        return preprocess.ensure_data(run_dir, progress=progress)
    return preprocess.ensure_data(run_dir, max_files=max_files, vocab_size=vocab_size, split=split, progress=progress)


def comparison_config(run_dir: str | os.PathLike, *, model: ModelConfig, micro_batch_size: int, global_batch_size: int,
                      train_iters: int, split: str = "969,30,1", lr: float = 1e-3, seed: int = 1234) -> Any:
    """The training config every layout of notebook 05 shares (a ``helpers.training.TrainingConfig``).

    The ``cpu`` training profile with the given model and batch, fp32, no dropout required but
    checked, the data of ``{run_dir}/data`` (notebook 01), a loss logged every iteration, one
    validation batch at the start and the end, no intermediate checkpoints. Its own outputs go
    to ``{run_dir}/parallelism/``.

    Raises:
        ValueError: dropout is not 0 (per-rank dropout streams make layouts differ by design),
            or the vocabulary padding would differ between TP=1 and TP=2 (extra logits rows
            change the softmax): the message says how to set ``make_vocab_size_divisible_by``.
    """
    from helpers import training

    run = Path(run_dir).expanduser().resolve()
    if model.hidden_dropout or model.attention_dropout:
        raise ValueError(
            f"hidden_dropout={model.hidden_dropout}, attention_dropout={model.attention_dropout}: layouts draw "
            "dropout masks from different RNG streams (one per TP rank), so their losses cannot be compared step by "
            "step. Use dropout 0 for this comparison."
        )
    if model.padded_vocab_size(1) != model.padded_vocab_size(2):
        raise ValueError(
            f"vocab_size={model.vocab_size} pads to {model.padded_vocab_size(1)} rows at TP=1 but "
            f"{model.padded_vocab_size(2)} at TP=2 (Megatron pads to a multiple of make_vocab_size_divisible_by x TP), "
            "so the models differ. Use a vocabulary that is a multiple of "
            f"{2 * model.make_vocab_size_divisible_by}, or a smaller make_vocab_size_divisible_by."
        )
    warmup = max(1, min(10, train_iters // 5))
    return training.profile(
        "cpu", str(run / "parallelism"), model=model, data_prefix=str(run / "data" / "codeparrot_content_document"),
        tokenizer_dir=str(run / "data" / "tokenizer"), split=split, micro_batch_size=micro_batch_size,
        global_batch_size=global_batch_size, train_iters=train_iters, lr=lr, min_lr=lr / 10,
        lr_warmup_iters=warmup if warmup < train_iters else 0, seed=seed, precision="fp32",
        log_interval=1, eval_interval=train_iters, eval_iters=1, save_interval=None, layer_spec="local",
    )


def _launch_env(world_size: int) -> dict[str, str]:
    """Hide the GPUs from a launch when there are fewer than ``world_size`` or than 2 (the largest
    layout compared), so that every layout of a comparison runs on the same kind of device: all
    on the CPU (gloo, fp32), or all on GPUs (NCCL, fp32)."""
    import torch

    if torch.cuda.is_available() and torch.cuda.device_count() < max(world_size, 2):
        return {"CUDA_VISIBLE_DEVICES": ""}
    return {}


def _progress_handler(total: int, desc: str, progress: bool):
    from tqdm.auto import tqdm

    bar = tqdm(total=total, desc=desc, unit="it") if progress else None

    def on_line(line: str) -> None:
        s = line.strip()
        if bar is not None and s.startswith("iteration "):
            try:
                bar.update(int(s.split()[1].split("/")[0]) - bar.n)
            except (IndexError, ValueError):
                pass
            if "lm loss:" in s:
                bar.set_postfix(loss=s.split("lm loss:")[1].split("|")[0].strip())

    return bar, on_line


def ensure_initial_checkpoint(base: Any, *, timeout_s: float = 600.0, progress: bool = True) -> Path:
    """Save the TP=1 model's initial weights once, as ``iter_0000000`` (cached).

    Every layout of the comparison starts from this checkpoint, loaded and resharded by
    ``dist_checkpointing`` into its own layout, so all start from identical weights. (From
    scratch, a pipeline stage r > 0 seeds with seed + 100 r and initialises only its own layers,
    as Megatron-LM's ``_set_random_seed`` does, so its layers differ from the TP=1 model's.)
    One process: ``python -m helpers.parallelism init-checkpoint --config ...``.

    Args:
        base: :func:`comparison_config`.

    Returns:
        The checkpoint folder ``{run_dir}/parallelism/initial`` (holding ``iter_0000000``).

    Raises:
        checkpointing.CheckpointMismatchError: a cached initial checkpoint of another model shape.
        helpers.launch.LaunchError: the job failed or timed out.
    """
    from helpers import checkpointing, launch

    folder = base.run_path / "initial"
    cfg = replace(base, checkpoint_dir=str(folder), tensor_model_parallel_size=1, pipeline_model_parallel_size=1)
    if checkpointing.latest_iteration(folder) == 0:
        checkpointing.check_compatible(checkpointing.read_model_config(folder, 0), cfg.model.to_metadata(1), folder)
        return folder
    cfg.check(1)
    config_path = cfg.to_json(base.run_path / "initial.json")
    launch.torchrun(["helpers.parallelism", "init-checkpoint", "--config", str(config_path)], nproc_per_node=1,
                    timeout_s=timeout_s, env=_launch_env(1), on_line=None if not progress else _print_marked,
                    log_path=base.run_path / "initial.log")
    return folder


def _print_marked(line: str) -> None:
    if line.startswith(">"):
        print(line, flush=True)


def run_layout(base: Any, layout: Layout, *, initial: str = "shared", checkpoint_dir: str | os.PathLike | None = None,
               name: str | None = None, timeout_s: float = 900.0, progress: bool = True) -> LayoutRun:
    """Train ``base`` with ``layout`` under torchrun on this machine and collect its losses.

    The launch is the node-0 command of a one-node :class:`LaunchPlan`; the command
    ``helpers.launch.torchrun`` executed is checked to be exactly that one. Cached: when the
    layout already finished ``train_iters`` with the same config, its stored result is returned
    (``skipped=True``).

    Args:
        base: :func:`comparison_config`.
        layout: the layout; ``layout.world_size`` processes are started.
        initial: ``"shared"``: start from :func:`ensure_initial_checkpoint` (made if missing);
            ``"own"``: let the layout initialise its own weights (Megatron's per-stage seeds).
        checkpoint_dir: where to save (default ``{run_dir}/parallelism/<name>/checkpoints``).
        name: folder name (default ``layout.name``, plus ``_own_init`` for ``initial="own"``).
        timeout_s: wall-clock limit of the job (s); past it every process is killed.

    Returns:
        :class:`LayoutRun`.

    Raises:
        ValueError: :func:`check_layout` refuses the layout, or the folder holds a run of
            another config (nothing is launched or deleted); an unknown ``initial``.
        FileNotFoundError: the data of notebook 01 is missing.
        helpers.launch.LaunchError: a rank failed (named) or the job timed out.
    """
    from helpers import checkpointing, launch, training

    if initial not in ("shared", "own"):
        raise ValueError(f"initial={initial!r}: choose 'shared' or 'own'")
    check_layout(base.model, layout, world_size=layout.world_size, micro_batch_size=base.micro_batch_size,
                 global_batch_size=base.global_batch_size)
    name = name or layout.name + ("_own_init" if initial == "own" else "")
    folder = base.run_path / name
    ckpt = Path(checkpoint_dir).expanduser().resolve() if checkpoint_dir else folder / "checkpoints"
    cfg = replace(base, tensor_model_parallel_size=layout.tensor_model_parallel_size,
                  pipeline_model_parallel_size=layout.pipeline_model_parallel_size, checkpoint_dir=str(ckpt),
                  metrics_path=str(folder / "metrics.jsonl"),
                  tensorboard_dir=str(base.run_path.parent / "tensorboard" / f"{NOTEBOOK}_{name}"))
    cfg.check(layout.world_size)
    config_path, result_path = folder / "run.json", folder / "layout_run.json"
    if config_path.exists() and json.loads(config_path.read_text()) != cfg.to_dict():
        raise ValueError(
            f"{folder} holds a run of another config ({config_path}). Nothing was launched or changed: use another "
            f"run_dir, or delete {folder}" + (f" and {ckpt}" if checkpoint_dir else "") + " to rerun."
        )
    latest = checkpointing.latest_iteration(ckpt)
    if latest is not None and not config_path.exists():
        raise ValueError(
            f"{ckpt} already holds a checkpoint (iteration {latest}) that run_layout did not make for {name}: "
            "nothing was launched or changed. Pass another checkpoint_dir, or delete that folder to rerun."
        )
    if latest is not None:
        saved = checkpointing.read_model_config(ckpt, latest)
        checkpointing.check_compatible(saved, cfg.model.to_metadata(layout.tensor_model_parallel_size), ckpt)
        if latest >= cfg.train_iters and result_path.exists():
            return replace(LayoutRun.from_dict(json.loads(result_path.read_text())), skipped=True)
    folder.mkdir(parents=True, exist_ok=True)
    cfg.to_json(config_path)
    linked = None
    if initial == "shared" and latest is None:
        init_dir = ensure_initial_checkpoint(base, timeout_s=timeout_s, progress=progress)
        ckpt.mkdir(parents=True, exist_ok=True)
        linked = checkpointing.iteration_dir(ckpt, 0)
        if linked.is_symlink():
            linked.unlink()
        linked.symlink_to(checkpointing.iteration_dir(init_dir, 0), target_is_directory=True)
        (ckpt / checkpointing.TRACKER_FILE).write_text("0\n")
    plan = launch_plan(layout, ["helpers.training", "--config", str(config_path)])
    bar, on_line = _progress_handler(cfg.train_iters, layout.label, progress)
    try:
        res = launch.torchrun(list(plan.target), nproc_per_node=plan.nproc_per_node, timeout_s=timeout_s,
                              master_port=plan.master_port, env=_launch_env(layout.world_size), on_line=on_line,
                              log_path=folder / "training.log")
    finally:
        if bar is not None:
            bar.close()
    if res.command != plan.local_command():
        raise RuntimeError(f"executed {shlex.join(res.command)} but the plan generated {shlex.join(plan.local_command())}")
    initial_link = checkpointing.iteration_dir(ckpt, 0)
    if initial_link.is_symlink():  # the shared initial weights stay in {run_dir}/parallelism/initial only
        initial_link.unlink()
    metrics = training.read_metrics(cfg.metrics_file)
    train = sorted(metrics["train"], key=lambda r: r["iteration"])
    run = LayoutRun(layout=layout, name=name, losses=[r["lm_loss"] for r in train],
                    s_per_iter=[r["s_per_iter"] for r in train], valid_losses=[r["lm_loss"] for r in metrics["valid"]],
                    wall_seconds=round(res.wall_seconds, 2), command=res.command,
                    generated_command=plan.local_command(), checkpoint_dir=str(ckpt), initial=initial)
    result_path.write_text(json.dumps(run.to_dict(), indent=2) + "\n")
    return run


def compare_losses(reference: LayoutRun, runs: Sequence[LayoutRun], atol: float = LOSS_ATOL_FP32) -> list[dict[str, Any]]:
    """Per run: the largest |loss - reference loss| over the iterations, and whether it is <= atol.

    Raises:
        ValueError: a run has a different number of iterations than the reference.
    """
    rows = []
    for run in runs:
        if len(run.losses) != len(reference.losses):
            raise ValueError(f"{run.name} logged {len(run.losses)} iterations, the reference {len(reference.losses)}")
        diffs = [abs(a - b) for a, b in zip(run.losses, reference.losses)]
        rows.append({"run": run.name, "layout": run.layout.label, "initial weights": run.initial,
                     "max_abs_diff": max(diffs), "first_iteration_diff": diffs[0], "within_atol": max(diffs) <= atol})
    return rows


def loss_table(runs: Sequence[LayoutRun]) -> tuple[list[str], list[list[str]]]:
    """Headers and rows (one per iteration) of every run's loss, for ``markdown_table``."""
    headers = ["iteration"] + [r.name for r in runs]
    rows = [[str(i + 1)] + [f"{r.losses[i]:.6f}" for r in runs] for i in range(len(runs[0].losses))]
    return headers, rows


def records_table(rows: Sequence[dict[str, Any]]) -> str:
    """A Markdown table of dicts that share their keys (the keys are the headers); floats
    below 1e-3 are written in scientific notation."""
    from helpers.corpus import markdown_table

    def fmt(v: Any) -> Any:
        return f"{v:.3g}" if isinstance(v, float) and v != 0 and abs(v) < 1e-3 else v

    return markdown_table(list(rows[0]), [[fmt(v) for v in r.values()] for r in rows])


def timing_table(runs: Sequence[LayoutRun], tokens_per_iteration: int) -> list[dict[str, Any]]:
    """Per run: processes, the launch's wall seconds, the median seconds per iteration and the
    tokens per second it implies (``tokens_per_iteration`` = global batch x sequence length)."""
    rows = []
    for run in runs:
        per_iter = sorted(run.s_per_iter)[len(run.s_per_iter) // 2]
        rows.append({"run": run.name, "processes": run.layout.world_size, "wall_s": run.wall_seconds,
                     "cached": run.skipped, "median_s_per_iter": round(per_iter, 4),
                     "tokens_per_s": round(tokens_per_iteration / per_iter)})
    return rows


def plot_losses(reference: LayoutRun, runs: Sequence[LayoutRun]):
    """Left: loss per iteration of every run; right: |difference| to the reference (log scale)."""
    import matplotlib.pyplot as plt

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(12, 4))
    its = range(1, len(reference.losses) + 1)
    ax1.plot(its, reference.losses, "k-", lw=3, alpha=0.4, label=f"{reference.name} (reference)")
    markers = "os^vDx"
    for i, run in enumerate(runs):
        ax1.plot(its, run.losses, marker=markers[i % 6], ls="--", ms=4, label=run.name)
        diffs = [max(abs(a - b), 1e-12) for a, b in zip(run.losses, reference.losses)]
        ax2.semilogy(its, diffs, marker=markers[i % 6], ms=4, label=run.name)
    ax2.axhline(LOSS_ATOL_FP32, color="red", ls=":", label=f"tolerance {LOSS_ATOL_FP32:g}")
    ax1.set(title="LM loss per iteration", xlabel="iteration", ylabel="loss (nats/token)")
    ax2.set(title=f"|loss - {reference.name} loss| (1e-12 = identical)", xlabel="iteration",
            ylabel="absolute difference (nats/token)")
    ax1.legend(fontsize=8)
    ax2.legend(fontsize=8, loc="center right")
    fig.tight_layout()
    return fig


# =========================================================================== shards on real ranks
def inspect_shards(base: Any, layout: Layout, *, timeout_s: float = 600.0) -> list[dict[str, Any]]:
    """Build the model on ``layout.world_size`` real ranks and report what each rank holds.

    Launches ``python -m helpers.parallelism shards`` (cached in
    ``{run_dir}/parallelism/shards_<layout>.json``). Each rank builds megatron-core's GPTModel
    exactly as training does, then runs one forward-only and one forward+backward step of a
    random micro-batch through megatron-core's schedule, counting ``torch.distributed.all_reduce``
    calls on its tensor-parallel group.

    Returns:
        One dict per rank: ``rank``, ``tp_rank``, ``pp_rank``, ``dp_rank``, ``groups``
        (``{"tp", "pp", "dp"}``: global ranks of this rank's groups, from ``parallel_state``),
        ``params`` (``[name, shape, partition_dim]``; partition_dim is None for parameters
        replicated across TP), ``num_parameters``, ``parameter_bytes``, ``tp_allreduce``
        (``{"forward", "forward_backward"}`` counts).

    Raises:
        ValueError: :func:`check_layout` refuses the layout.
        helpers.launch.LaunchError: a rank failed or the job timed out.
    """
    from helpers import launch

    check_layout(base.model, layout, world_size=layout.world_size)
    cache = base.run_path / f"shards_{layout.name}.json"
    key = {"model": base.model.to_dict(), "layout": asdict(layout), "micro_batch_size": base.micro_batch_size}
    if cache.exists():
        stored = json.loads(cache.read_text())
        if stored.get("key") == key:
            return stored["ranks"]
    out = base.run_path / f"shards_{layout.name}"
    if out.exists():
        shutil.rmtree(out)
    out.mkdir(parents=True)
    config_path = base.to_json(base.run_path / "shards.json")
    launch.torchrun(["helpers.parallelism", "shards", "--config", str(config_path), "--tp",
                     str(layout.tensor_model_parallel_size), "--pp", str(layout.pipeline_model_parallel_size),
                     "--out", str(out)], nproc_per_node=layout.world_size, timeout_s=timeout_s,
                    env=_launch_env(layout.world_size), on_line=None, log_path=base.run_path / "shards.log")
    ranks = [json.loads((out / f"rank{r}.json").read_text()) for r in range(layout.world_size)]
    cache.write_text(json.dumps({"key": key, "ranks": ranks}, indent=1) + "\n")
    shutil.rmtree(out)
    return ranks


def shard_table(ranks: list[dict[str, Any]]) -> tuple[list[str], list[list[str]]]:
    """Headers and rows for ``markdown_table``: which layers each rank holds, then every kind of
    parameter (``decoder.layers.N.`` stands for each of its layers) with its full (TP=1) shape
    and, per rank, its local shape and split dimension, or "replicated" (``-`` where the rank
    holds none)."""
    import re

    headers = ["parameter", "full shape"] + [f"rank {r['rank']} (tp{r['tp_rank']} pp{r['pp_rank']})" for r in ranks]
    layers_row = ["transformer layers held", ""]
    kinds: dict[str, list[str]] = {}
    for col, r in enumerate(ranks):
        tp = len(r["groups"]["tp"])
        held = sorted({int(m.group(1)) for n, _, _ in r["params"] if (m := re.match(r"decoder\.layers\.(\d+)\.", n))})
        layers_row.append("-" if not held else str(held[0]) if len(held) == 1 else f"{held[0]}-{held[-1]}")
        for name, shape, dim in r["params"]:
            kind = re.sub(r"decoder\.layers\.\d+\.", "decoder.layers.N.", name)
            full = [n * tp if i == dim else n for i, n in enumerate(shape)]
            cells = kinds.setdefault(kind, [str(full)] + ["-"] * len(ranks))
            if cells[col + 1] == "-":
                cells[col + 1] = f"{list(shape)} " + (f"split dim {dim}" if dim is not None else "replicated")
    return headers, [layers_row] + [[kind] + cells for kind, cells in kinds.items()]


def rank_summary(ranks: list[dict[str, Any]], model: ModelConfig) -> list[dict[str, Any]]:
    """Per rank of :func:`inspect_shards`: its groups, parameters and TP all-reduces, each next to
    the formula (:func:`parameters_per_rank`, :func:`expected_tp_allreduces`), and whether they match.

    Returns:
        ``[{"rank", "tp group", "pp group", "parameters", "formula", "MiB", "all-reduces",
        "expected", "match"}]`` (MiB = 2^20 bytes of fp32 parameters).
    """
    rows = []
    for r in ranks:
        tp, pp = len(r["groups"]["tp"]), len(r["groups"]["pp"])
        formula = parameters_per_rank(model, tp, pp, r["pp_rank"])
        expected = expected_tp_allreduces(model.num_layers // pp, r["pp_rank"] == 0, r["pp_rank"] == pp - 1) if tp > 1 \
            else {"forward": 0, "forward_backward": 0}
        rows.append({"rank": r["rank"], "tp group": r["groups"]["tp"], "pp group": r["groups"]["pp"],
                     "parameters": r["num_parameters"], "formula": formula,
                     "MiB": round(r["parameter_bytes"] / 2 ** 20, 3), "all-reduces": r["tp_allreduce"],
                     "expected": expected,
                     "match": r["num_parameters"] == formula and r["tp_allreduce"] == expected})
    return rows


def expected_tp_allreduces(layers_on_stage: int, first_stage: bool, last_stage: bool) -> dict[str, int]:
    """Tensor-parallel all-reduces of one micro-batch on one rank (TP > 1, no sequence parallelism).

    Forward: 2 per layer (after the row-parallel ``linear_proj`` and ``linear_fc2``), 1 for the
    vocab-parallel embedding on the first stage, 3 in the vocab-parallel cross-entropy on the
    last stage (max logit, target logit, sum of exponentials). Backward: 2 per layer (the input
    gradients of the column-parallel ``linear_qkv`` and ``linear_fc1``), 1 for the output layer's
    input gradient on the last stage. Sources: Shoeybi et al. 2019 section 3 (the f and g
    operators); megatron-core ``tensor_parallel/layers.py``, ``mappings.py``, ``cross_entropy.py``.

    Returns:
        ``{"forward": n, "forward_backward": n}`` (the latter counts both passes).
    """
    forward = 2 * layers_on_stage + int(first_stage) + 3 * int(last_stage)
    return {"forward": forward, "forward_backward": forward + 2 * layers_on_stage + int(last_stage)}


# =========================================================================== torchrun entry points
def _init_checkpoint_main(config: str) -> None:
    """Build the TP=1 trainer (model, DDP, optimizer, scheduler) and save it at iteration 0."""
    from helpers import training

    cfg = training.TrainingConfig.from_json(config)
    trainer = training.setup(cfg)
    folder = training.save(trainer)
    n = sum(p.numel() for p in trainer.bare_model.parameters())
    print(f"> saved the initial weights ({n:,} parameters) to {folder}", flush=True)
    training.destroy_distributed()


def _shards_main(config: str, tp: int, pp: int, out: str) -> None:
    """Each rank: build the model, record its parameters (global layer numbers) and groups,
    count TP all-reduces."""
    import re
    from functools import partial

    import torch
    import torch.distributed as dist
    from megatron.core import parallel_state
    from megatron.core.pipeline_parallel import get_forward_backward_func

    from helpers import model as model_lib
    from helpers import training

    cfg = training.TrainingConfig.from_json(config)
    info = training.initialize_distributed(tp, pp, cfg.seed)
    model = model_lib.build_model(cfg.model, precision="fp32", layer_spec="local")
    offset = info["pp_rank"] * (cfg.model.num_layers // pp)
    params = [[re.sub(r"^decoder\.layers\.(\d+)\.", lambda m: f"decoder.layers.{int(m.group(1)) + offset}.", n),
               list(p.shape), int(p.partition_dim) if getattr(p, "tensor_model_parallel", False) else None]
              for n, p in model.named_parameters()]
    groups = {k: dist.get_process_group_ranks(g()) for k, g in (
        ("tp", parallel_state.get_tensor_model_parallel_group), ("pp", parallel_state.get_pipeline_model_parallel_group),
        ("dp", parallel_state.get_data_parallel_group))}
    tp_group = parallel_state.get_tensor_model_parallel_group()
    counts = {"n": 0}
    real_all_reduce = dist.all_reduce

    def counting_all_reduce(tensor, *args, **kwargs):
        group = kwargs.get("group", args[1] if len(args) > 1 else None)
        if group is tp_group:
            counts["n"] += 1
        return real_all_reduce(tensor, *args, **kwargs)

    s, b = cfg.model.seq_length, cfg.micro_batch_size
    gen = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, cfg.model.vocab_size, (b, s), generator=gen)
    batch = {"tokens": tokens, "labels": torch.roll(tokens, -1, 1), "position_ids": torch.arange(s).repeat(b, 1),
             "loss_mask": torch.ones(b, s)}

    def forward_step(data_iterator, m):
        data = next(data_iterator)
        output = m(data["tokens"], data["position_ids"], None, labels=data["labels"])
        return output, partial(_masked_mean_loss, data["loss_mask"])

    allreduce = {}
    dist.all_reduce = counting_all_reduce
    try:
        for phase, forward_only in (("forward", True), ("forward_backward", False)):
            counts["n"] = 0
            get_forward_backward_func()(forward_step_func=forward_step, data_iterator=iter([batch]), model=[model],
                                        num_microbatches=1, seq_length=s, micro_batch_size=b, forward_only=forward_only)
            allreduce[phase] = counts["n"]
    finally:
        dist.all_reduce = real_all_reduce
    n = sum(p.numel() for p in model.parameters())
    record = {**{k: info[k] for k in ("rank", "tp_rank", "pp_rank", "dp_rank")}, "groups": groups, "params": params,
              "num_parameters": n, "parameter_bytes": sum(p.numel() * p.element_size() for p in model.parameters()),
              "tp_allreduce": allreduce}
    Path(out, f"rank{info['rank']}.json").write_text(json.dumps(record) + "\n")
    dist.barrier()
    training.destroy_distributed()


def _masked_mean_loss(loss_mask, output_tensor):
    loss = (output_tensor.float() * loss_mask).sum() / loss_mask.sum()
    return loss, {"lm loss": loss.detach().clone()}


def main(argv: list[str] | None = None) -> int:
    """``python -m helpers.parallelism {init-checkpoint,shards} --config run.json ...``."""
    parser = argparse.ArgumentParser(prog="python -m helpers.parallelism", description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    p_init = sub.add_parser("init-checkpoint", help="save the TP=1 model's initial weights as iter_0000000")
    p_init.add_argument("--config", required=True)
    p_shards = sub.add_parser("shards", help="report each rank's parameter shards and TP all-reduce counts")
    p_shards.add_argument("--config", required=True)
    p_shards.add_argument("--tp", type=int, required=True)
    p_shards.add_argument("--pp", type=int, required=True)
    p_shards.add_argument("--out", required=True)
    args = parser.parse_args(argv)
    if args.command == "init-checkpoint":
        _init_checkpoint_main(args.config)
    else:
        _shards_main(args.config, args.tp, args.pp, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
