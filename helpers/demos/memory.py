"""The memory calculator drawn: tables and bar charts of :mod:`helpers.learn.memory` over layouts.

The calculator itself (bytes per GPU of weights, gradients, optimizer state and activations)
is :mod:`helpers.learn.memory`, imported here under the same names. Notebook 05, section 5 ("Memory per GPU: what each layout saves": :func:`memory_per_gpu`,
:func:`memory_table`, :func:`plot_memory`, :data:`MODEL_SHAPES`) and section 2 ("Tensor
parallelism: what each rank holds": :func:`parameters_per_rank`, checked against the
parameters real ranks hold, :mod:`helpers.demos.shards`).

Sources: Megatron-LM ``docs/source/api-guide/distrib_optimizer.md`` (bytes per parameter);
Rajbhandari et al. 2020, "ZeRO" (arXiv:1910.02054) section 5 (optimizer-state sharding);
Korthikanti et al. 2022, "Reducing Activation Recomputation in Large Transformer Models"
(arXiv:2205.05198) sections 4-5 (activation memory); megatron-core 0.19.2
``tensor_parallel/layers.py``, ``models/gpt/gpt_model.py`` (what each rank holds).
"""

from __future__ import annotations

from typing import Any, Sequence

from helpers.learn.memory import (BYTES_PER_PARAMETER, MemoryEstimate, activation_bytes_per_layer, megatron_lm_estimate,
                            memory_per_gpu, parameters_per_rank)
from helpers.learn.model import PROFILES as MODEL_PROFILES
from helpers.learn.model import Layout, ModelConfig

__all__ = ["BYTES_PER_PARAMETER", "MODEL_SHAPES", "MemoryEstimate", "activation_bytes_per_layer", "megatron_lm_estimate",
           "memory_per_gpu", "memory_table", "parameters_per_rank", "plot_memory"]

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
