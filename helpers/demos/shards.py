"""What each rank really holds: parameter shards, process groups and tensor-parallel all-reduces.

Notebook 05, section 2: the model built on real ranks (TP=2 x PP=2, 4 processes under torchrun), every
parameter's full and local shape, and each rank's counts beside the formulas. Entry point::

    python -m torch.distributed.run --nproc_per_node 4 -m helpers.demos.shards \
        --config shards.json --tp 2 --pp 2 --out shards/

Sources: Shoeybi et al. 2019, "Megatron-LM" (arXiv:1909.08053) section 3 (column/row-parallel
MLP and attention, the f and g operators); megatron-core 0.19.2 ``tensor_parallel/layers.py``,
``tensor_parallel/mappings.py``, ``tensor_parallel/cross_entropy.py``, ``parallel_state.py``,
``pipeline_parallel/schedules.py``.
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
import sys
from dataclasses import asdict
from pathlib import Path
from typing import Any

from helpers.demos.layout_runs import launch_env
from helpers.learn.memory import parameters_per_rank
from helpers.learn.model import Layout, ModelConfig, build_model, check_layout


def inspect_shards(base: Any, layout: Layout, *, timeout_s: float = 600.0) -> list[dict[str, Any]]:
    """Build the model on ``layout.world_size`` real ranks and report what each rank holds.

    Launches ``python -m helpers.demos.shards`` (cached in ``{run_dir}/parallelism/shards_<layout>.json``):
    each rank builds megatron-core's GPTModel as training does, runs one forward-only and one
    forward+backward step, and counts ``torch.distributed.all_reduce`` calls on its TP group.

    Returns:
        One dict per rank: ``rank``, ``tp_rank``, ``pp_rank``, ``dp_rank``, ``groups`` (``{"tp", "pp",
        "dp"}`` global ranks), ``params`` (``[name, shape, partition_dim]``; None when replicated across TP),
        ``num_parameters``, ``parameter_bytes``, ``tp_allreduce`` (``{"forward", "forward_backward"}``).

    Raises:
        ValueError: :func:`helpers.learn.model.check_layout` refuses the layout.
        helpers.runner.launch.LaunchError: a rank failed or the job timed out.
    """
    from helpers.runner import launch

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
    launch.torchrun(["helpers.demos.shards", "--config", str(config_path), "--tp",
                     str(layout.tensor_model_parallel_size), "--pp", str(layout.pipeline_model_parallel_size),
                     "--out", str(out)], nproc_per_node=layout.world_size, timeout_s=timeout_s,
                    env=launch_env(layout.world_size), on_line=None, log_path=base.run_path / "shards.log")
    ranks = [json.loads((out / f"rank{r}.json").read_text()) for r in range(layout.world_size)]
    cache.write_text(json.dumps({"key": key, "ranks": ranks}, indent=1) + "\n")
    shutil.rmtree(out)
    return ranks


def shard_table(ranks: list[dict[str, Any]]) -> list[dict[str, str]]:
    """Rows for ``helpers.support.results.markdown_table``: which layers each rank holds, then every kind
    of parameter (``decoder.layers.N.`` stands for each of its layers) with its full (TP=1) shape
    and, per rank, its local shape and split dimension, or "replicated" (``-`` where the rank
    holds none).

    Args:
        ranks: :func:`inspect_shards`.

    Returns:
        ``[{"parameter", "full shape", "rank 0 (tp0 pp0)", ...}]``, all cells strings; the first
        row is ``"transformer layers held"`` (``"0-1"``: layers 0 to 1).
    """
    columns = [f"rank {r['rank']} (tp{r['tp_rank']} pp{r['pp_rank']})" for r in ranks]
    layers = {"parameter": "transformer layers held", "full shape": ""}
    kinds: dict[str, dict[str, str]] = {}
    for column, r in zip(columns, ranks):
        tp = len(r["groups"]["tp"])
        held = sorted({int(m.group(1)) for n, _, _ in r["params"] if (m := re.match(r"decoder\.layers\.(\d+)\.", n))})
        layers[column] = "-" if not held else str(held[0]) if len(held) == 1 else f"{held[0]}-{held[-1]}"
        for name, shape, dim in r["params"]:
            kind = re.sub(r"decoder\.layers\.\d+\.", "decoder.layers.N.", name)
            full = [n * tp if i == dim else n for i, n in enumerate(shape)]
            row = kinds.setdefault(kind, {"parameter": kind, "full shape": str(full)} | dict.fromkeys(columns, "-"))
            if row[column] == "-":
                row[column] = f"{list(shape)} " + (f"split dim {dim}" if dim is not None else "replicated")
    return [layers, *kinds.values()]


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


def _shards_main(config: str, tp: int, pp: int, out: str) -> None:
    """Each rank: build the model, record its parameters (global layer numbers) and groups,
    count TP all-reduces. The micro-batch goes through a ``forward_step`` like
    ``helpers.learn.pretrain_gpt``'s (the same model call; the loss without Megatron-LM's NaN check)."""
    import torch
    import torch.distributed as dist
    from megatron.core import parallel_state
    from megatron.core.pipeline_parallel import get_forward_backward_func

    from helpers.learn import distributed, training_config

    cfg = training_config.TrainingConfig.from_json(config)
    info = distributed.initialize_distributed(tp, pp, cfg.seed)
    model = build_model(cfg.model, precision="fp32", layer_spec="local")
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

    def forward_step(data_iterator, gpt):
        b_ = next(data_iterator)
        out = gpt(b_["tokens"], b_["position_ids"], None, labels=b_["labels"])
        return out, lambda o: (o.float().mean(), {"lm loss": o.float().mean().detach()})

    allreduce = {}
    dist.all_reduce = counting_all_reduce
    try:
        for phase, forward_only in (("forward", True), ("forward_backward", False)):
            counts["n"] = 0
            get_forward_backward_func()(forward_step_func=forward_step, data_iterator=iter([batch]),
                                        model=[model], num_microbatches=1, seq_length=s, micro_batch_size=b,
                                        forward_only=forward_only)
            allreduce[phase] = counts["n"]
    finally:
        dist.all_reduce = real_all_reduce
    n = sum(p.numel() for p in model.parameters())
    record = {**{k: info[k] for k in ("rank", "tp_rank", "pp_rank", "dp_rank")}, "groups": groups, "params": params,
              "num_parameters": n, "parameter_bytes": sum(p.numel() * p.element_size() for p in model.parameters()),
              "tp_allreduce": allreduce}
    Path(out, f"rank{info['rank']}.json").write_text(json.dumps(record) + "\n")
    dist.barrier()
    distributed.destroy_distributed()


def main(argv: list[str] | None = None) -> int:
    """``python -m helpers.demos.shards --config run.json --tp T --pp P --out DIR`` under torchrun
    (what :func:`inspect_shards` launches): every rank writes ``DIR/rank<N>.json``."""
    parser = argparse.ArgumentParser(prog="python -m helpers.demos.shards",
                                     description="report each rank's parameter shards and TP all-reduce counts")
    parser.add_argument("--config", required=True, help="a helpers.learn.training_config.TrainingConfig JSON file")
    parser.add_argument("--tp", type=int, required=True, help="tensor-model-parallel size")
    parser.add_argument("--pp", type=int, required=True, help="pipeline-model-parallel size")
    parser.add_argument("--out", required=True, help="folder for the rank<N>.json files")
    args = parser.parse_args(argv)
    _shards_main(args.config, args.tp, args.pp, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
