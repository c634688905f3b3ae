"""Rank groups: which global ranks megatron-core puts in each TP, PP and DP group.

Notebook 05, section 1 ("Three ways to split the work": :func:`rank_groups`,
:func:`plot_rank_groups`) and section 5 ("Memory per GPU": :func:`layouts_for`, every layout of
a world size). No ``torch.distributed`` is needed: the groups come from megatron-core's own
``RankGenerator``, the class ``parallel_state.initialize_model_parallel`` uses.

Sources: megatron-core 0.19.2 ``parallel_state.py`` (``RankGenerator``,
``default_embedding_ranks``, the ``order`` argument of ``initialize_model_parallel``);
Narayanan et al. 2021 (arXiv:2104.04473) section 3 (composing TP, PP and DP).
"""

from __future__ import annotations

from helpers.learn.model import Layout, ModelConfig, check_layout, divisors

#: megatron-core 0.19.2's default rank order (``initialize_model_parallel(order=...)``):
#: TP ranks are neighbours (same node), PP is the outermost dimension.
_DEFAULT_ORDER = "tp-cp-ep-dp-pp"


def layouts_for(world_size: int, model: ModelConfig | None = None) -> list[Layout]:
    """Every (TP, PP, DP) with TP x PP x DP = ``world_size`` (valid for ``model`` when given,
    see :func:`helpers.learn.model.check_layout`), ordered by TP, then PP."""
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


def rank_groups(layout: Layout, order: str = _DEFAULT_ORDER) -> dict[str, list[list[int]]]:
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


def rank_coordinates(layout: Layout, order: str = _DEFAULT_ORDER) -> list[dict[str, int]]:
    """``[{"rank", "tp_rank", "pp_rank", "dp_rank"}]`` for every global rank: its position in
    its TP, PP and DP group (as ``parallel_state.get_*_rank()`` would return on that rank)."""
    groups = rank_groups(layout, order)
    coords = [{"rank": r} for r in range(layout.world_size)]
    for kind in ("tp", "pp", "dp"):
        for group in groups[kind]:
            for pos, rank in enumerate(group):
                coords[rank][f"{kind}_rank"] = pos
    return coords


def plot_rank_groups(layout: Layout, gpus_per_node: int = 4, order: str = _DEFAULT_ORDER):
    """Three panels (TP, PP, DP groups): every GPU as a box on its node, coloured by group.

    Args:
        layout: the parallel layout; its world size must be a multiple of ``gpus_per_node``.
        gpus_per_node: GPUs per node (a row of boxes).
        order: megatron-core's rank order (default ``"tp-cp-ep-dp-pp"``).

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
