"""Notebook 06's proofs that the conversion is exact, and its pictures.

* section 2: why the guide's 2022 converter does not apply; section 3: the QKV layouts of GPT-2 and a
  grouped-query Llama, drawn and checked; section 5: the tokenizer files identical;
* section 7: the same logits; section 8: the same validation loss (also 07 §2); section 9: the same greedy
  tokens (``helpers.demos.generation``); sections 10 and 12: bit-identical folders; section 11: the hub push.

Sources: Megatron-LM ``megatron/training/training.py`` (``evaluate``: per micro-batch loss-masked
mean, then the mean); transformers ``generation/utils.py`` (``generate``), ``modeling_utils.py``
(``from_pretrained(device_map=...)``, ``push_to_hub``).
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import torch

from helpers.learn import checkpointing, conversion

#: The guide's 2022 command (transformers source tree, legacy Megatron-LM checkpoint layout).
_GUIDE_2022_COMMAND = (
    "python transformers/src/transformers/models/megatron_gpt2/convert_megatron_gpt2_checkpoint.py "
    "experiments/codeparrot-small/iter_0150000/mp_rank_00/model_optim_rng.pt"
)
_LEGACY_CONVERTER_MODULE = "transformers.models.megatron_gpt2.convert_megatron_gpt2_checkpoint"


# =========================================================================== section 2: the guide's 2022 converter
def randomized_model(cfg, seed: int = 0):
    """A local-spec megatron-core ``GPTModel`` of ``cfg`` (a :class:`helpers.learn.model.ModelConfig`) in eval
    mode with every parameter random: weights and biases ``N(0, 0.2^2)``, LayerNorm weights ``1 + N(0, 0.1^2)``.
    megatron-core initialises biases to 0 and LayerNorms to 1, which would hide a wrong bias or GELU in a
    conversion. Sets up one-process model parallelism if it is not set up yet."""
    from helpers.learn import model as model_lib
    from helpers.learn.distributed import initialize_distributed

    initialize_distributed(1, 1)
    gpt = model_lib.build_model(cfg, layer_spec="local").eval()
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in gpt.named_parameters():
            noise = torch.randn(p.shape, generator=gen) * 0.1
            p.copy_(1.0 + noise if "layernorm" in name and name.endswith("weight") else noise * 2)
    return gpt


def legacy_converter_report(checkpoint: str | os.PathLike) -> dict[str, Any]:
    """Why the guide's 2022 command does not apply to a megatron-core checkpoint, as facts.

    Returns:
        ``{"command", "converter_in_installed_transformers" (bool), "legacy_file"
        (mp_rank_00/model_optim_rng.pt present?), "checkpoint_format", "checkpoint_files" (first
        names), "checkpoint_keys" (first model keys), "legacy_keys_present" (any ``language_model`` key)}``.

    Raises:
        FileNotFoundError, helpers.learn.conversion.ConversionError: see ``conversion.find_checkpoint``.
    """
    import importlib.util

    from megatron.core import dist_checkpointing

    from helpers.learn.distributed import single_process

    folder, _, fmt = conversion.find_checkpoint(checkpoint)
    try:
        converter = importlib.util.find_spec(_LEGACY_CONVERTER_MODULE) is not None
    except ModuleNotFoundError:
        converter = False
    keys: list[str] = []
    if fmt == "torch_dist":
        with single_process():
            keys = sorted(k for k in dist_checkpointing.load_tensors_metadata(str(folder))
                          if not k.startswith(checkpointing.NON_MODEL_KEY_PREFIXES))
    return {
        "command": _GUIDE_2022_COMMAND,
        "converter_in_installed_transformers": converter,
        "legacy_file": (folder / "mp_rank_00" / "model_optim_rng.pt").is_file() if folder.is_dir() else False,
        "checkpoint_format": fmt,
        "checkpoint_files": sorted(p.name for p in folder.iterdir())[:8] if folder.is_dir() else [folder.name],
        "checkpoint_keys": keys[:6],
        "legacy_keys_present": any("language_model" in k for k in keys),
    }


# =========================================================================== section 3: the QKV permutation
def qkv_rows(num_heads: int, head_dim: int, num_query_groups: int | None = None) -> list[tuple[str, int, int]]:
    """What each row of megatron-core's ``linear_qkv.weight`` holds: ``(part, head or group, dim)``.

    Per key/value group, its ``heads / g`` query heads, then its key head, then its value head
    (``SelfAttention.get_query_key_value_tensors``); with one group per head (GPT-2) that is each
    head's ``q, k, v`` in turn. Sorting the rows by ``(part, index, dim)`` gives transformers' order:
    all queries, then all keys, then all values (GPT-2's ``c_attn``, Llama's ``q_proj | k_proj | v_proj``).
    """
    groups = num_query_groups or num_heads
    per_group = num_heads // groups
    rows: list[tuple[str, int, int]] = []
    for group in range(groups):
        for head in range(group * per_group, (group + 1) * per_group):
            rows += [("q", head, x) for x in range(head_dim)]
        rows += [("k", group, x) for x in range(head_dim)] + [("v", group, x) for x in range(head_dim)]
    return rows


def qkv_order(num_heads: int, head_dim: int, num_query_groups: int | None = None) -> list[int]:
    """The megatron-core row of each transformers row (GPT-2: each ``c_attn`` column), in transformers' order."""
    rows = qkv_rows(num_heads, head_dim, num_query_groups)
    return sorted(range(len(rows)), key=lambda i: ("qkv".index(rows[i][0]), rows[i][1], rows[i][2]))


def qkv_head_table(weight: torch.Tensor, num_heads: int, num_query_groups: int | None = None) -> list[dict[str, Any]]:
    """Where each head's q, k and v rows of a ``linear_qkv`` weight land in transformers.

    Args:
        weight: ``linear_qkv.weight`` ``[(heads + 2g) * d, h]`` (``[3h, h]`` without grouped-query attention).
        num_heads, num_query_groups: query heads, key/value heads (``None``: one per query head).

    Returns:
        One dict per (part, head or key/value group): ``head``, ``part`` ("q"/"k"/"v"),
        ``megatron_rows`` and ``target_rows`` (``(first, last)`` inclusive), ``target`` (GPT-2:
        ``"c_attn columns"``; Llama: ``"q_proj rows"``, ``"k_proj rows"``, ``"v_proj rows"``) and
        ``equal``: the converted tensor (``conversion.tensor_to_hf``, transposed back; or
        ``llama.split_qkv``) holds exactly those rows.
    """
    from helpers.learn import llama

    h = weight.shape[1]
    d = h // num_heads
    if num_query_groups:
        parts = dict(zip("qkv", llama.split_qkv(weight, num_heads, num_query_groups)))
    else:
        c_attn = conversion.tensor_to_hf("decoder.layers.{}.self_attention.linear_qkv.weight", weight, num_heads).t()
        parts = dict(zip("qkv", c_attn.split(h)))
    rows = qkv_rows(num_heads, d, num_query_groups)
    table = []
    for part in "qkv":
        for index in sorted({i for p, i, _ in rows if p == part}):
            r0 = rows.index((part, index, 0))
            target = "c_attn columns" if not num_query_groups else f"{part}_proj rows"
            t0 = (("qkv".index(part) * h) if not num_query_groups else 0) + index * d
            table.append({"head": index, "part": part, "megatron_rows": (r0, r0 + d - 1), "target": target,
                          "target_rows": (t0, t0 + d - 1),
                          "equal": torch.equal(parts[part][index * d:(index + 1) * d], weight[r0:r0 + d])})
    return table


def qkv_layout_figure(num_heads: int = 3, head_dim: int = 2, num_query_groups: int | None = None):
    """A picture of the QKV layouts: which head and part (q/k/v) each row holds, before and after.

    Returns:
        A matplotlib ``Figure`` with two labelled strips (megatron-core ``linear_qkv`` rows, and GPT-2
        ``c_attn`` columns or, with ``num_query_groups``, Llama's ``q_proj | k_proj | v_proj`` rows),
        colours = q/k/v, text = query head (``h``) or key/value group (``g``), arrows for the first head's rows.
    """
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    rows = qkv_rows(num_heads, head_dim, num_query_groups)
    order, n = qkv_order(num_heads, head_dim, num_query_groups), len(rows)
    grouped = num_query_groups not in (None, num_heads)
    label = lambda r: f"{'g' if grouped and r[0] != 'q' else 'h'}{r[1]}"
    colors = {"q": "tab:blue", "k": "tab:orange", "v": "tab:green"}
    target = "Llama q_proj | k_proj | v_proj rows" if num_query_groups else "GPT-2 c_attn columns"
    fig, ax = plt.subplots(figsize=(max(8.0, n * 0.45), 3.2))
    for y, sequence, name in ((1.6, list(range(n)), "megatron-core linear_qkv rows"), (0.0, order, target)):
        for pos, src in enumerate(sequence):
            ax.add_patch(plt.Rectangle((pos, y), 0.95, 0.8, color=colors[rows[src][0]], alpha=0.85))
            ax.text(pos + 0.47, y + 0.4, label(rows[src]), ha="center", va="center", fontsize=8, color="white")
        ax.text(-0.4, y + 0.4, name, ha="right", va="center", fontsize=9)
    for pos, src in enumerate(order):
        if rows[src][1] == 0:
            ax.annotate("", xy=(pos + 0.47, 0.82), xytext=(src + 0.47, 1.58),
                        arrowprops=dict(arrowstyle="->", color="0.3", lw=0.8))
    ax.set_xlim(-0.2, n + 0.2)
    ax.set_ylim(-0.3, 2.5)
    ax.set_yticks([])
    ax.set_xticks([i + 0.47 for i in range(n)], [str(i) for i in range(n)], fontsize=7)
    ax.set_xlabel("row index (rows of width hidden size)")
    ax.set_title(f"QKV rows: {num_heads} query heads, {num_query_groups or num_heads} key/value heads, head dim {head_dim} "
                 f"(arrows: {'head 0 and group 0' if grouped else 'head 0'})")
    ax.legend(handles=[Patch(color=c, label=p) for c, p in zip(colors.values(), ("query", "key", "value"))],
              loc="upper center", ncol=3, fontsize=8, bbox_to_anchor=(0.5, -0.28))
    for spine in ("left", "right", "top"):
        ax.spines[spine].set_visible(False)
    return fig


# =========================================================================== section 5: the folder
def tokenizer_files_identical(hf_dir: str | os.PathLike, tokenizer_dir: str | os.PathLike) -> dict[str, bool]:
    """``{file: bytes equal}`` for each tokenizer file of the training folder vs the transformers folder."""
    a, b = Path(hf_dir), Path(tokenizer_dir)
    return {n: (a / n).is_file() and (a / n).read_bytes() == (b / n).read_bytes()
            for n in conversion.TOKENIZER_FILES + conversion.OPTIONAL_TOKENIZER_FILES if (b / n).is_file()}


# =========================================================================== section 7: the same logits
@torch.no_grad()
def megatron_logits(model, tokens: torch.Tensor) -> torch.Tensor:
    """Logits of a megatron-core ``GPTModel`` (TP=1) for ``tokens`` ``[b, s]`` int64.

    Returns:
        fp32 ``[b, s, padded_vocab]`` on the CPU (causal; positions 0..s-1; the model may be on a GPU).
    """
    device = next(model.parameters()).device
    tokens = tokens.long().to(device)
    position_ids = torch.arange(tokens.shape[1], device=device).unsqueeze(0).expand_as(tokens)
    return model(tokens, position_ids, None).float().cpu()


@torch.no_grad()
def hf_logits(hf_model, tokens: torch.Tensor) -> torch.Tensor:
    """Logits of a transformers causal LM for ``tokens`` ``[b, s]`` int64: fp32 ``[b, s, vocab]`` on the CPU."""
    device = next(hf_model.parameters()).device
    return hf_model(input_ids=tokens.long().to(device)).logits.float().cpu()


@dataclass
class LogitComparison:
    """:func:`compare_logits`: ``max_abs_diff`` over the real vocabulary, argmax agreement (fraction
    of positions), shapes compared, and ``max_abs_logit`` for scale."""

    max_abs_diff: float
    argmax_agreement: float
    shape: tuple[int, ...]
    max_abs_logit: float


def compare_logits(reference: torch.Tensor, converted: torch.Tensor) -> LogitComparison:
    """Compare megatron-core logits ``[b, s, V_pad]`` with transformers logits ``[b, s, V]``.

    Only the first ``V`` (real) columns are compared: padding rows are no token.

    Raises:
        ValueError: batch/sequence shapes differ, or ``V_pad < V``.
    """
    if reference.shape[:-1] != converted.shape[:-1] or reference.shape[-1] < converted.shape[-1]:
        raise ValueError(f"logit shapes {tuple(reference.shape)} vs {tuple(converted.shape)} cannot be compared")
    ref = reference[..., :converted.shape[-1]].float()
    diff = (ref - converted.float()).abs().max().item()
    agree = (ref.argmax(-1) == converted.argmax(-1)).float().mean().item()
    return LogitComparison(diff, agree, tuple(converted.shape), ref.abs().max().item())


def logit_differences(reference: torch.Tensor, converted: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Every compared logit's value and its disagreement: what :func:`logit_difference_figure` draws.

    Args:
        reference: megatron-core logits ``[b, s, V_pad]``; converted: transformers ``[b, s, V]``.

    Returns:
        ``(values, differences)``, both float32 ``[b * s * V]``: the megatron-core logit (nats) and
        ``transformers - megatron-core`` (nats, signed), over the real vocabulary only.

    Raises:
        ValueError: see :func:`compare_logits`.
    """
    if reference.shape[:-1] != converted.shape[:-1] or reference.shape[-1] < converted.shape[-1]:
        raise ValueError(f"logit shapes {tuple(reference.shape)} vs {tuple(converted.shape)} cannot be compared")
    ref = reference[..., :converted.shape[-1]].reshape(-1).float()
    return ref, converted.reshape(-1).float() - ref


#: Where :func:`logit_difference_figure` draws differences of exactly 0 on its log axes (nats).
ZERO_FLOOR = 1e-10


def logit_difference_figure(reference: torch.Tensor, converted: torch.Tensor, max_points: int = 20000,
                            tolerance: float = 1e-4):
    """How far transformers' logits are from megatron-core's: |difference| against the logit, and its histogram.

    Left: ``|transformers - megatron-core|`` (log scale) against the megatron-core logit for ``max_points``
    logits sampled with a fixed seed, beside the float32 spacing at that value (``|x| * 2**-23``) and the
    ``tolerance`` (nats). Right: the histogram of ``log10 |difference|`` over every logit. Differences of
    exactly 0 are drawn at :data:`ZERO_FLOOR`.

    Args:
        reference: megatron-core logits ``[b, s, V_pad]``; converted: transformers ``[b, s, V]``.

    Returns:
        A matplotlib ``Figure`` (two panels); the left panel's first collection holds the sampled
        ``(logit, |difference|)`` points.

    Raises:
        ValueError: see :func:`compare_logits`.
    """
    import matplotlib.pyplot as plt
    import numpy as np

    values, diffs = logit_differences(reference, converted)
    raw = diffs.abs()
    idx = torch.randperm(values.numel(), generator=torch.Generator().manual_seed(0))[:max_points]
    exact = int((raw == 0).sum())
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(12, 4.4))
    ax1.scatter(values[idx].numpy(), raw[idx].clamp(min=ZERO_FLOOR).numpy(), s=3, alpha=0.35, color="tab:blue",
                label=f"{len(idx):,} of {values.numel():,} logits")
    xs = np.linspace(float(values.min()), float(values.max()), 400)
    ax1.plot(xs, np.maximum(np.abs(xs) * 2.0 ** -23, ZERO_FLOOR), color="black", lw=1,
             label="float32 spacing at that logit, |x| * 2^-23")
    ax1.axhline(tolerance, color="red", ls="--", label=f"tolerance {tolerance:g}")
    ax1.set_yscale("log")
    ax1.set(title=f"|difference| against the logit (0 drawn at {ZERO_FLOOR:g})", xlabel="megatron-core logit (nats)",
            ylabel="|transformers - megatron-core| (nats)")
    ax1.legend(fontsize=8, loc="upper center", bbox_to_anchor=(0.5, -0.16), ncol=2)
    ax2.hist(torch.log10(raw.clamp(min=ZERO_FLOOR)).numpy(), bins=60, color="tab:blue",
             label=f"max {raw.max().item():.2e}, median {raw.median().item():.1e};\n"
                   f"{exact:,} exactly equal (drawn at {ZERO_FLOOR:g})")
    ax2.axvline(np.log10(tolerance), color="red", ls="--", label=f"tolerance {tolerance:g}")
    ax2.set(title="|difference| per logit, every logit", xlabel="log10 |transformers - megatron-core| (log10 nats)",
            ylabel="number of logits")
    ax2.legend(fontsize=8, loc="upper center", bbox_to_anchor=(0.5, -0.16), ncol=2)
    fig.suptitle(f"Converted model: transformers' logits minus megatron-core's, at most {raw.max().item():.1e} nats "
                 f"(largest |logit| {values.abs().max().item():.1f})")
    fig.tight_layout()
    return fig


def _run_config(run_dir: str | os.PathLike, config_name: str):
    from helpers.learn.training_config import TrainingConfig

    path = Path(run_dir).expanduser().resolve() / config_name
    if not path.is_file():
        raise FileNotFoundError(f"{path} not found: it is written by helpers.runner.launch.train (notebook 03)")
    return TrainingConfig.from_json(path)


def validation_tokens(run_dir: str | os.PathLike, num_samples: int = 2, *, config_name: str = "run.json") -> torch.Tensor:
    """Token ids of the first ``num_samples`` validation samples of a training run (held-out code).

    Returns:
        int64 ``[num_samples, seq_length]``.

    Raises:
        FileNotFoundError: no ``run.json`` (train first: notebook 03).
    """
    from helpers.learn import dataloader

    _, valid_ds, _ = dataloader.build_run_datasets(_run_config(run_dir, config_name))
    return torch.stack([torch.as_tensor(valid_ds[i % len(valid_ds)]["tokens"]).long() for i in range(num_samples)])


# =========================================================================== section 8: the same validation loss
def validation_loss(logits_fn: Callable[[torch.Tensor], torch.Tensor], dataset, *, num_samples: int,
                    micro_batch_size: int, vocab_size: int | None = None, progress: bool = False,
                    first_sample: int = 0) -> float:
    """LM loss (nats/token) over samples ``first_sample ..`` ``first_sample + num_samples - 1`` of a
    ``GPTDataset``, as Megatron-LM's ``evaluate`` computes it.

    Micro-batches of ``micro_batch_size`` consecutive samples; the loss-masked token cross-entropy summed
    over all of them, divided by the tokens counted (``pretrain_gpt.loss_func``'s ``[loss sum, tokens]``).

    Args:
        logits_fn: ``tokens [b, s]`` -> logits ``[b, s, V']`` (megatron-core or transformers).
        dataset: a megatron-core ``GPTDataset`` (``tokens``, ``labels``, ``loss_mask``).
        num_samples: ``eval_iters x global_batch_size``; a multiple of ``micro_batch_size``.
        vocab_size: use only the first ``vocab_size`` logit columns (drops padding); None keeps all.

    Returns:
        The mean loss (float).

    Raises:
        ValueError: ``num_samples`` not a positive multiple of ``micro_batch_size``.
    """
    import torch.nn.functional as F
    from tqdm.auto import tqdm

    if num_samples < 1 or num_samples % micro_batch_size:
        raise ValueError(f"num_samples={num_samples} must be a positive multiple of micro_batch_size={micro_batch_size}")
    total, count = 0.0, 0.0
    for start in tqdm(range(first_sample, first_sample + num_samples, micro_batch_size), desc="validation",
                      disable=not progress):
        samples = [dataset[i % len(dataset)] for i in range(start, start + micro_batch_size)]
        tokens, labels, mask = (torch.stack([torch.as_tensor(s[k]) for s in samples]) for k in ("tokens", "labels", "loss_mask"))
        with torch.no_grad():
            logits = logits_fn(tokens.long()).float()
        if vocab_size is not None:
            logits = logits[..., :vocab_size]
        ce = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.long().reshape(-1), reduction="none")
        mask = mask.float()
        total += (ce.view_as(mask) * mask).sum().item()
        count += mask.sum().item()
    return total / max(count, 1.0)


@dataclass
class ValidationComparison:
    """:func:`compare_validation_loss`: losses in nats/token on the training run's validation batches.

    Attributes:
        training_loss: what training logged (``metrics.jsonl``) at ``iteration``; None if not logged.
        hf_loss: the transformers model's loss.
        megatron_loss: megatron-core's loss with all padded columns (what training computes);
            None when no megatron-core model was given.
        megatron_loss_real_vocab: megatron-core's loss over the tokenizer's columns only.
        num_samples, seq_length, iteration: what was evaluated.
        padded_columns: logit columns the transformers model does not have.
    """

    training_loss: float | None
    hf_loss: float
    megatron_loss: float | None
    megatron_loss_real_vocab: float | None
    num_samples: int
    seq_length: int
    iteration: int | None
    padded_columns: int


def compare_validation_loss(run_dir: str | os.PathLike, hf_model, megatron_model=None, *,
                            iteration: int | None = None, config_name: str = "run.json",
                            progress: bool = False) -> ValidationComparison:
    """Validation loss of the transformers model on exactly the batches training evaluated.

    Rebuilds the validation ``GPTDataset`` from the run's ``run.json`` (same split, seed, sequence length
    and index cache) and evaluates the samples Megatron-LM's evaluation at ``iteration`` read (the
    ``k``-th block of ``eval_iters x global_batch_size``, ``k = iteration // eval_interval``) with
    :func:`validation_loss`. megatron-core's softmax runs over the padded vocabulary, so training's loss
    is higher by the mean of ``-log(1 - p_pad)``; ``megatron_loss_real_vocab`` equals the transformers loss.

    Args:
        megatron_model: optional megatron-core ``GPTModel`` of the same checkpoint.
        iteration: a multiple of ``eval_interval``; default the last evaluation during training.

    Raises:
        FileNotFoundError: no ``run.json`` in ``run_dir`` (train with helpers.runner.launch.train first).
        ValueError: the run's split has no validation part.
    """
    from helpers.learn import dataloader
    from helpers.runner.metrics import read_metrics

    cfg = _run_config(run_dir, config_name)
    _, valid_ds, _ = dataloader.build_run_datasets(cfg)
    if valid_ds is None:
        raise ValueError(f"the run's split {cfg.split!r} has no validation part: nothing to compare")
    valid = [r for r in read_metrics(cfg.metrics_file).get("valid", []) if r.get("when", "during") == "during"]
    if iteration is None and valid:
        iteration = valid[-1]["iteration"]
    if iteration is None or iteration < cfg.eval_interval or iteration % cfg.eval_interval:
        raise ValueError(f"iteration={iteration}: training evaluated every eval_interval={cfg.eval_interval} "
                         "iterations; pass one of those")
    per_eval = cfg.eval_iters * cfg.global_batch_size
    kw = dict(num_samples=per_eval, micro_batch_size=cfg.micro_batch_size,
              first_sample=(iteration // cfg.eval_interval - 1) * per_eval)
    vocab = hf_model.config.vocab_size
    hf_loss = validation_loss(lambda t: hf_logits(hf_model, t), valid_ds, progress=progress, **kw)
    mc_loss = mc_real = None
    padded = 0
    if megatron_model is not None:
        mc_loss = validation_loss(lambda t: megatron_logits(megatron_model, t), valid_ds, progress=progress, **kw)
        mc_real = validation_loss(lambda t: megatron_logits(megatron_model, t), valid_ds, vocab_size=vocab, **kw)
        padded = megatron_model.embedding.word_embeddings.weight.shape[0] - vocab
    logged = next((r for r in valid if r["iteration"] == iteration), None)
    return ValidationComparison(logged["lm_loss"] if logged else None, hf_loss, mc_loss, mc_real, kw["num_samples"],
                                cfg.model.seq_length, logged["iteration"] if logged else iteration, padded)


# =========================================================================== sections 10 and 12: identical folders
def compare_hf_folders(first: str | os.PathLike, second: str | os.PathLike) -> dict[str, Any]:
    """Tensor by tensor comparison of two transformers folders' ``model.safetensors``.

    Returns:
        ``{"num_tensors", "identical" (all bit-equal), "max_abs_diff", "same_keys", "same_config"}``.
    """
    from safetensors.torch import load_file

    a, b = load_file(str(Path(first) / "model.safetensors")), load_file(str(Path(second) / "model.safetensors"))
    common = sorted(set(a) & set(b))
    diff = max(((a[k].float() - b[k].float()).abs().max().item() if a[k].shape == b[k].shape else math.inf)
               for k in common) if common else math.inf
    cfg_a, cfg_b = (json.loads((Path(x) / "config.json").read_text()) for x in (first, second))
    return {"num_tensors": len(common), "identical": set(a) == set(b) and all(torch.equal(a[k], b[k]) for k in common),
            "max_abs_diff": diff, "same_keys": set(a) == set(b), "same_config": cfg_a == cfg_b}


# =========================================================================== section 11: the guide's ending
def parameter_devices(model) -> dict[str, int]:
    """``{device: number of parameters}`` of a model, e.g. after ``from_pretrained(..., device_map="auto")``.

    (transformers 5 sets ``model.hf_device_map`` only when the weights span several devices.)
    """
    out: dict[str, int] = {}
    for p in model.parameters():
        out[str(p.device)] = out.get(str(p.device), 0) + p.numel()
    return out


def push_to_hub(hf_dir: str | os.PathLike, repo_id: str, *, private: bool = True) -> str:
    """Upload a converted folder to the Hugging Face Hub (model, tokenizer, generation config).

    Needs network access and a token (``huggingface-cli login`` or ``HF_TOKEN``).

    Returns:
        The URL of the commit.

    Raises:
        huggingface_hub.errors.HfHubHTTPError (or an OSError): no network, no token, no access.
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(str(hf_dir))
    AutoTokenizer.from_pretrained(str(hf_dir)).push_to_hub(repo_id, private=private)
    return str(model.push_to_hub(repo_id, private=private))
