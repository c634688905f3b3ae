"""The memory calculator drawn: notebook 05 section 5's bars of GiB per GPU over layouts.

The numbers are :func:`helpers.learn.memory.memory_table`'s; this module only plots them.
"""

from __future__ import annotations

from typing import Any, Sequence

from helpers.learn.memory import memory_table
from helpers.learn.model import Layout, ModelConfig


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
