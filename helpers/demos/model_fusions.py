"""Notebook 04, sections 8-10: fusion inside notebook 03's whole model, and what its training uses.

Section 8 times a forward + backward step of notebook 03's ``GPTModel`` with megatron-core's fusion flags
(:data:`FUSION_FLAGS`) off and on, in paired rounds. Section 9 times megatron-core's op-by-op
``DotProductAttention`` against the fused SDPA one of :mod:`helpers.learn.attention`. Section 10 says
what training should use on this device, following the run folder's recorded measurement when there is one.

Sources: megatron-core 0.19.2 ``megatron/core/transformer/transformer_config.py`` (the fusion
flags), ``megatron/core/transformer/dot_product_attention.py``; Megatron-LM
``pretrain_gpt.py`` (flags on by default on GPUs); Dao et al. 2022 (FlashAttention);
``torch.nn.functional.scaled_dot_product_attention``.
"""

from __future__ import annotations

import os
import statistics
import time
from dataclasses import dataclass, replace
from typing import Any, Callable

import torch
from megatron.core import tensor_parallel
from megatron.core.transformer.enums import AttnMaskType

from helpers.learn import distributed
from helpers.support import results
from helpers.learn import model as model_lib
from helpers.learn.attention import MODULES
from helpers.demos.timing import Timing, device_type, synchronize, time_calls
from helpers.learn.optimizer import ADAMW_IMPLEMENTATIONS, DEFAULT_ADAMW_PREFERENCE, adamw_unavailable_reason

#: The notebook whose ``summary.json`` entries section 10's choices follow.
NOTEBOOK = "04_fused_kernels"

# ------------------------------------------------------------------ training step, fusion flags off and on (section 8)
#: megatron-core TransformerConfig fusion flags that work on CPU (0.16.1 and 0.19.2).
FUSION_FLAGS = ("bias_activation_fusion", "bias_dropout_fusion", "masked_softmax_fusion")


@dataclass
class FlagsBenchmark:
    """Result of :func:`benchmark_fusion_flags`: one training step (forward + backward).

    Attributes:
        timings: ``{"flags off": Timing, "flags on": Timing}``.
        losses: the mean loss of the same batch under each setting.
        first_step_s: the first step of each setting alone (includes torch.compile's
            compilation of megatron's fused functions, paid once per process).
        speedup: flags-off median / flags-on median.
        micro_batch_size, seq_length: the batch timed; architecture: the model's (``gpt2`` or ``llama``).
    """

    timings: dict[str, Timing]
    losses: dict[str, float]
    first_step_s: dict[str, float]
    speedup: float
    micro_batch_size: int
    seq_length: int
    architecture: str = "gpt2"

    @property
    def paired_speedups(self) -> list[float]:
        """flags-off time / flags-on time, round by round (the two run back to back each round)."""
        return [a / b for a, b in zip(self.timings["flags off"].times_s, self.timings["flags on"].times_s)]

    @property
    def flags_clearly_faster(self) -> bool:
        """True when the median paired speedup is >= 1.05 and flags-on won at least 80% of the rounds.

        Pairing each round's two steps cancels slow drift of a shared machine; requiring most
        rounds to agree keeps one burst of load from deciding.
        """
        ratios = self.paired_speedups
        wins = sum(r > 1.0 for r in ratios)
        return statistics.median(ratios) >= 1.05 and wins >= 0.8 * len(ratios)


def benchmark_fusion_flags(cfg: Any, *, micro_batch_size: int = 2, warmup: int = 2, repeats: int = 3,
                           device: str | None = None, seed: int = 1234) -> FlagsBenchmark:
    """Time a forward+backward step of notebook 03's GPTModel with the fusion flags off and on.

    Two models from the same seed (same weights), every flag of :data:`FUSION_FLAGS` False in one and True
    in the other, stepped interleaved on the same random batch. The losses differ only by the GELU form.

    Args:
        cfg: a :class:`helpers.learn.model.ModelConfig`; its fusion flags are overridden.
        micro_batch_size: sequences per step.
        warmup, repeats: see :func:`time_calls` (the first flags-on step compiles).

    Returns:
        :class:`FlagsBenchmark`.

    Raises:
        ValueError: micro_batch_size below 1.
    """
    device = device_type(device)
    if micro_batch_size < 1:
        raise ValueError(f"micro_batch_size={micro_batch_size} must be >= 1")
    g = torch.Generator(device="cpu").manual_seed(seed)
    tokens = torch.randint(0, cfg.vocab_size, (micro_batch_size, cfg.seq_length), generator=g).to(device)
    position_ids = torch.arange(cfg.seq_length, device=device).expand(micro_batch_size, -1)
    settings = {"flags off": False, "flags on": True}
    models, losses, first = {}, {}, {}
    with distributed.single_process(seed):
        for name, on in settings.items():
            tensor_parallel.model_parallel_cuda_manual_seed(seed)
            c = replace(cfg, **{f: on for f in FUSION_FLAGS})
            models[name] = model_lib.build_model(c, layer_spec="local").to(device)

        def step(model: Any) -> Callable[[], float]:
            def run() -> float:
                model.zero_grad(set_to_none=True)
                loss = model(tokens, position_ids, None, labels=tokens).float().mean()
                loss.backward()
                return loss.item()
            return run

        fns = {name: step(m) for name, m in models.items()}
        for name, fn in fns.items():
            synchronize(device)
            t0 = time.perf_counter()
            losses[name] = fn()
            first[name] = time.perf_counter() - t0
        timings = time_calls(fns, device=device, warmup=warmup, repeats=repeats, min_repeat_s=0.0)
    speedup = timings["flags off"].median_s / timings["flags on"].median_s
    return FlagsBenchmark(timings, losses, first, speedup, micro_batch_size, cfg.seq_length, cfg.architecture)


# ------------------------------------------------------------------ core attention (section 9)
@dataclass
class AttentionBenchmark:
    """What :func:`benchmark_core_attention` measured.

    Attributes:
        shape: ``(seq, micro_batch, heads, head_dim)`` of query, key and value.
        timings: ``{"unfused" | "sdpa": helpers.demos.timing.Timing}``, seconds per forward + backward.
        max_abs_diff: largest difference between the two, over the output and the three input gradients.
        score_matrix_bytes: bytes of one ``[b, heads, s, s]`` matrix in the dtype used; the
            unfused module keeps two of them (scores and probabilities) for the backward pass.
    """

    shape: tuple[int, int, int, int]
    timings: dict[str, Any]
    max_abs_diff: float
    score_matrix_bytes: int

    @property
    def speedup(self) -> float:
        """Median time of the unfused module over SDPA's (> 1: SDPA is faster)."""
        return self.timings["unfused"].median_s / self.timings["sdpa"].median_s


def benchmark_core_attention(cfg: Any, micro_batch_size: int, *, device: str = "cpu",
                             dtype: torch.dtype = torch.float32, warmup: int = 3, repeats: int = 15,
                             seed: int = 1234) -> AttentionBenchmark:
    """Time forward + backward of both core-attention modules at ``cfg``'s shapes (causal, no dropout).

    Args:
        cfg: a :class:`helpers.learn.model.ModelConfig` (heads, width, sequence length).
        micro_batch_size: sequences per call.
        device, dtype: notebook 04 uses bf16 on CUDA, fp32 on a CPU (where bf16 is slow).
        warmup, repeats: see :func:`time_calls` (interleaved repeats).

    Returns:
        :class:`AttentionBenchmark`.

    Raises:
        ValueError: ``micro_batch_size < 1``; see also :func:`time_calls` and
            :func:`helpers.learn.model.transformer_config`.
    """
    if micro_batch_size < 1:
        raise ValueError(f"micro_batch_size={micro_batch_size}: pass at least 1 sequence per call")

    heads = cfg.num_attention_heads
    shape = (cfg.seq_length, micro_batch_size, heads, cfg.hidden_size // heads)
    with distributed.single_process(seed):
        config = model_lib.transformer_config(cfg, precision="fp32")
        mods = {name: cls(config, layer_number=1, attn_mask_type=AttnMaskType.causal,
                          attention_type="self").to(device) for name, cls in MODULES.items()}
        gen = torch.Generator().manual_seed(seed)
        qkv = [torch.randn(shape, generator=gen).to(device=device, dtype=dtype) for _ in range(3)]
        grad_out = torch.randn(shape[0], shape[1], shape[2] * shape[3], generator=gen).to(device=device, dtype=dtype)

        def step(name: str) -> list[torch.Tensor]:
            q, k, v = (t.detach().requires_grad_() for t in qkv)
            out = mods[name](q, k, v, None)
            out.backward(grad_out)
            return [out.detach(), q.grad, k.grad, v.grad]

        outputs = {name: step(name) for name in mods}
        diff = max((a.float() - b.float()).abs().max().item() for a, b in zip(outputs["unfused"], outputs["sdpa"]))
        timings = time_calls({name: (lambda n=name: step(n)) for name in mods}, device=device,
                             warmup=warmup, repeats=repeats)
    b, s = micro_batch_size, cfg.seq_length
    return AttentionBenchmark(shape=shape, timings=timings, max_abs_diff=diff,
                              score_matrix_bytes=b * heads * s * s * torch.tensor([], dtype=dtype).element_size())


# ------------------------------------------------------------------ both measurements as bars (sections 8 and 9)
#: The configurations :func:`step_time_bars` draws, in words: ``{(panel key, timing key): label}``.
STEP_CONFIGURATIONS = {
    ("flags", "flags off"): "fusion flags off: unfused element-wise kernels",
    ("flags", "flags on"): "fusion flags on: fused bias + GELU,\nbias + dropout + add, softmax",
    ("attention", "unfused"): "megatron-core DotProductAttention\n(op by op: scores, mask, softmax, x V)",
    ("attention", "sdpa"): "fused: torch scaled_dot_product_attention",
}


def step_time_bars(flags: FlagsBenchmark, attn: AttentionBenchmark) -> list[dict[str, Any]]:
    """The bars of :func:`plot_step_times`: one per configuration measured in sections 8 and 9.

    Args:
        flags: :func:`benchmark_fusion_flags` (a whole training step, flags off and on).
        attn: :func:`benchmark_core_attention` (core attention alone, op by op and SDPA).

    Returns:
        ``[{"panel": "flags" | "attention", "configuration": words, "median_ms", "q25_ms", "q75_ms":
        milliseconds per forward + backward, "speedup": the panel's first configuration's median
        over this one's (1.0 for the first; > 1: faster)}]``, flags first.
    """
    bars = []
    for panel, timings in (("flags", flags.timings), ("attention", attn.timings)):
        first = None
        for key, t in timings.items():
            first = first or t.median_s
            bars.append({"panel": panel, "configuration": STEP_CONFIGURATIONS.get((panel, key), key),
                         "median_ms": t.median_s * 1e3, "q25_ms": t.q25_s * 1e3, "q75_ms": t.q75_s * 1e3,
                         "speedup": first / t.median_s})
    return bars


def plot_step_times(flags: FlagsBenchmark, attn: AttentionBenchmark, *, device: str = "cpu",
                    title: str = "Fusion in a training step and in attention, measured"):
    """Horizontal bars of milliseconds per forward + backward (median, IQR whiskers), one per configuration.

    Top panel: a whole training step of the model at notebook 03's size with the fusion flags off and on
    (section 8); bottom panel: core attention alone, megatron-core's op-by-op module and SDPA
    (section 9). Each bar carries its time and its speedup over its panel's first bar.

    Returns:
        a matplotlib ``Figure`` with two axes.
    """
    import matplotlib.pyplot as plt

    bars = step_time_bars(flags, attn)
    s, b, heads, head_dim = attn.shape
    stepped = "the guide's GPT-2" if flags.architecture == "gpt2" else "the Llama"
    titles = {"flags": f"One training step of {stepped} at notebook 03's size (forward + backward, micro-batch "
                       f"{flags.micro_batch_size} x {flags.seq_length} tokens)",
              "attention": f"Core attention alone (forward + backward, {b} x {heads} heads x {s} tokens, "
                           f"head dim {head_dim}, causal)"}
    fig, axes = plt.subplots(2, 1, figsize=(10, 5.2))
    for ax, panel in zip(axes, ("flags", "attention")):
        rows = [r for r in bars if r["panel"] == panel][::-1]  # first configuration at the top
        ys = range(len(rows))
        colors = ["tab:grey" if r is rows[-1] else "tab:blue" for r in rows]
        ax.barh(ys, [r["median_ms"] for r in rows], color=colors, height=0.6,
                xerr=[[r["median_ms"] - r["q25_ms"] for r in rows], [r["q75_ms"] - r["median_ms"] for r in rows]],
                capsize=3)
        right = max(r["q75_ms"] for r in rows)
        for y, r in zip(ys, rows):
            what = "baseline" if r is rows[-1] else f"speed-up {r['speedup']:.2f}x" + (" = slower" if r["speedup"] < 1 else "")
            ax.text(max(r["q75_ms"], r["median_ms"]) + 0.02 * right, y, f"{r['median_ms']:.1f} ms ({what})",
                    va="center", fontsize=8)
        ax.set_yticks(list(ys), [r["configuration"] for r in rows], fontsize=8)
        ax.set_xlim(0, right * 1.45)
        ax.set_xlabel(f"time per forward + backward (ms; {device}, median, whiskers: interquartile range)", fontsize=8)
        ax.set_title(titles[panel], fontsize=9)
        ax.grid(True, axis="x", alpha=0.3)
    fig.suptitle(title)
    fig.tight_layout()
    return fig


# ------------------------------------------------------------------ what notebook 03's training uses (section 10)
def _measured(run_dir: str | os.PathLike | None, device: str) -> dict[str, Any]:
    if run_dir is None:
        return {}
    summary = results.load_summary(run_dir).get(NOTEBOOK, {})
    return summary if summary.get("device") == device else {}


def adamw_implementation(device: str | None = None, run_dir: str | os.PathLike | None = None) -> str:
    """The AdamW implementation training should use on ``device``.

    Uses notebook 04's measurement (``summary.json``: ``adamw_fastest``) when ``run_dir`` has
    one for the same device type; otherwise the first available of
    :data:`helpers.learn.optimizer.DEFAULT_ADAMW_PREFERENCE` (Apex FusedAdam on a GPU with Apex, else torch's fused).

    Returns:
        one of :data:`helpers.learn.optimizer.ADAMW_IMPLEMENTATIONS`.
    """
    device = device_type(device)
    measured = _measured(run_dir, device).get("adamw_fastest")
    if measured in ADAMW_IMPLEMENTATIONS and adamw_unavailable_reason(measured, device) is None:
        return measured
    return next(i for i in DEFAULT_ADAMW_PREFERENCE if adamw_unavailable_reason(i, device) is None)


def recommended_fusion_flags(device: str | None = None,
                             run_dir: str | os.PathLike | None = None) -> dict[str, bool]:
    """megatron-core fusion flags training should set on ``device``.

    CUDA: all of :data:`FUSION_FLAGS` True (Megatron-LM's ``pretrain_gpt.py`` defaults). CPU: notebook 04's
    measurement (``fusion_flags_clearly_faster`` in ``run_dir``'s ``summary.json``) when there is one, else
    False: on a CPU the softmax kernel does not exist, the step time is the same within noise, every
    process pays the compilation, and ``bias_activation_fusion`` switches GELU from erf to tanh.

    Returns:
        ``{flag: bool}`` for each of :data:`FUSION_FLAGS`, to pass to ``ModelConfig``.
    """
    device = device_type(device)
    if device == "cuda":
        return {f: True for f in FUSION_FLAGS}
    on = _measured(run_dir, device).get("fusion_flags_clearly_faster") is True
    return {f: on for f in FUSION_FLAGS}
