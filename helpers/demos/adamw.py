"""Notebook 04, section 7: AdamW as a for-loop, ``foreach``, fused (torch) and Apex ``FusedAdam``, measured.

Each implementation of :data:`helpers.learn.optimizer.ADAMW_IMPLEMENTATIONS` (built by
:func:`helpers.learn.optimizer.make_adamw`, the series' one AdamW) starts from the parameters of
notebook 03's ``GPTModel`` (:func:`model_parameters`), gets the same gradients, is checked to
agree with the for-loop after N steps, and has its ``optimizer.step()`` timed
(:func:`benchmark_adamw`, :func:`plot_adamw`). Section 10's choice that follows this
measurement is :func:`helpers.demos.model_fusions.adamw_implementation`.

Sources: Loshchilov & Hutter 2019, "Decoupled Weight Decay Regularization" (AdamW);
torch ``torch/optim/adamw.py`` (for-loop, foreach, fused); Apex ``apex/optimizers/fused_adam.py``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Mapping, Sequence

import torch

from helpers.learn import distributed
from helpers.learn import model as model_lib
from helpers.demos.timing import Timing, device_type, synchronize, time_calls
from helpers.learn.optimizer import ADAMW_IMPLEMENTATIONS, adamw_unavailable_reason, make_adamw


def model_parameters(cfg: Any, *, device: str | None = None, seed: int = 1234) -> dict[str, torch.Tensor]:
    """The initial parameters of notebook 03's megatron-core ``GPTModel`` for ``cfg``.

    Builds the model (local layer spec) in :func:`helpers.learn.distributed.single_process` and returns
    detached fp32 copies, tied embeddings counted once.

    Args:
        cfg: a :class:`helpers.learn.model.ModelConfig` (e.g. ``helpers.learn.model.profile("cpu")``).
        device: where the copies live (default: CUDA when available, else CPU).
        seed: the model-parallel seed (Megatron-LM default 1234).

    Returns:
        ``{parameter name: tensor}`` in ``model.named_parameters()`` order.
    """
    device = device_type(device)
    with distributed.single_process(seed):
        gpt = model_lib.build_model(cfg, layer_spec="local")
        return {n: p.detach().to(device=device, dtype=torch.float32).clone() for n, p in gpt.named_parameters()}


@dataclass
class AdamWBenchmark:
    """Result of :func:`benchmark_adamw`.

    Attributes:
        timings: ``{implementation: Timing}`` of one ``optimizer.step()``.
        max_abs_diff: ``{implementation: max |p - p_for_loop|}`` after ``check_steps`` steps.
        agrees: ``{implementation: bool}`` within ``rtol``/``atol`` of the for-loop result.
        skipped: ``{implementation: reason}``.
        num_parameters, num_tensors: what was stepped.
        check_steps, rtol, atol: the agreement check.
        device: ``"cpu"`` or ``"cuda"``.
    """

    timings: dict[str, Timing]
    max_abs_diff: dict[str, float]
    agrees: dict[str, bool]
    skipped: dict[str, str]
    num_parameters: int
    num_tensors: int
    check_steps: int
    rtol: float
    atol: float
    device: str

    @property
    def fastest(self) -> str:
        """The implementation with the lowest median step time among those that agree."""
        return min((k for k in self.timings if self.agrees.get(k)), key=lambda k: self.timings[k].median_s)

    def speedups(self) -> dict[str, float]:
        """``{implementation: for-loop median / its median}``."""
        base = self.timings["for-loop"].median_s
        return {k: base / t.median_s for k, t in self.timings.items()}

    def rows(self) -> list[dict[str, Any]]:
        """One table row per implementation."""
        sp = self.speedups()
        return [{"implementation": k, "median_ms_per_step": t.median_s * 1e3, "q25_ms": t.q25_s * 1e3,
                 "q75_ms": t.q75_s * 1e3, "speedup_vs_for_loop": sp[k],
                 f"max_abs_diff_after_{self.check_steps}_steps": self.max_abs_diff[k], "agrees": self.agrees[k]}
                for k, t in self.timings.items()]


def _grads(params: Sequence[torch.Tensor], seed: int) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    g = torch.Generator(device="cpu").manual_seed(seed)
    one = [1e-2 * torch.randn(p.shape, generator=g).to(p.device) for p in params]
    two = [1e-2 * torch.randn(p.shape, generator=g).to(p.device) for p in params]
    return one, two


def _set_grads(params: Sequence[torch.Tensor], g1: Sequence[torch.Tensor], g2: Sequence[torch.Tensor], k: int) -> None:
    """Step k's gradient: cos(k) * g1 + sin(k) * g2 (a direction that changes every step)."""
    c, s = math.cos(k), math.sin(k)
    for p, a, b in zip(params, g1, g2):
        p.grad = c * a + s * b


def benchmark_adamw(params: Mapping[str, torch.Tensor] | Sequence[torch.Tensor], *,
                    device: str | None = None, implementations: Sequence[str] = ADAMW_IMPLEMENTATIONS,
                    check_steps: int = 10, warmup: int = 3, repeats: int = 15, lr: float = 5e-4,
                    betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8, weight_decay: float = 0.1,
                    rtol: float = 1.3e-6, atol: float = 1e-5, seed: int = 0) -> AdamWBenchmark:
    """Time ``optimizer.step()`` of each AdamW implementation and check they agree.

    Every implementation starts from copies of the same ``params`` (not modified) and gets the same
    gradients (``cos(k) g1 + sin(k) g2`` at step k, seeded). After ``check_steps`` steps each result is
    compared with the for-loop's (always added: the reference) within ``rtol``/``atol`` (torch.testing's
    float32 defaults); timing then steps each copy further, interleaved (:func:`time_calls`).

    Args:
        implementations: subset of :data:`helpers.learn.optimizer.ADAMW_IMPLEMENTATIONS`.
        check_steps, warmup, repeats: steps before the check; timing warm-up and repeats.

    Returns:
        :class:`AdamWBenchmark`.

    Raises:
        ValueError: no parameters, an unknown implementation, or check_steps < 1.
    """
    device = device_type(device)
    base = list(params.values()) if isinstance(params, Mapping) else list(params)
    if not base:
        raise ValueError("params is empty: pass the model's parameters, e.g. adamw.model_parameters(cfg)")
    if check_steps < 1:
        raise ValueError(f"check_steps={check_steps} must be >= 1")
    names = ["for-loop"] + [i for i in implementations if i != "for-loop"]
    skipped = {}
    for name in names:
        reason = adamw_unavailable_reason(name, device)
        if reason:
            skipped[name] = reason
    names = [n for n in names if n not in skipped]
    base = [p.detach().to(device=device, dtype=torch.float32) for p in base]
    g1, g2 = _grads(base, seed)
    copies, opts = {}, {}
    for name in names:
        copies[name] = [p.clone().requires_grad_(True) for p in base]
        opts[name] = make_adamw(copies[name], name, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay)
        for k in range(check_steps):
            _set_grads(copies[name], g1, g2, k)
            opts[name].step()
        synchronize(device)
    ref = copies["for-loop"]
    diffs, agrees = {}, {}
    for name in names:
        diffs[name] = max((a.detach() - b.detach()).abs().max().item() for a, b in zip(copies[name], ref))
        agrees[name] = all(torch.allclose(a.detach(), b.detach(), rtol=rtol, atol=atol)
                           for a, b in zip(copies[name], ref))
    timings = time_calls({n: opts[n].step for n in names}, device=device, warmup=warmup, repeats=repeats,
                         min_repeat_s=0.0)
    return AdamWBenchmark(timings, diffs, agrees, skipped, sum(p.numel() for p in base), len(base),
                          check_steps, rtol, atol, device)


def plot_adamw(bench: AdamWBenchmark, title: str = "AdamW: time per optimizer step"):
    """Bar plot of the median step time per implementation (IQR whiskers); returns the Figure."""
    import matplotlib.pyplot as plt

    names = list(bench.timings)
    med = [bench.timings[n].median_s * 1e3 for n in names]
    err = [[m - bench.timings[n].q25_s * 1e3 for n, m in zip(names, med)],
           [bench.timings[n].q75_s * 1e3 - m for n, m in zip(names, med)]]
    fig, ax = plt.subplots(figsize=(7, 4))
    bars = ax.bar(names, med, yerr=err, capsize=4, color="tab:blue", label="median step (IQR whiskers)")
    for bar, n in zip(bars, names):
        ax.text(bar.get_x() + bar.get_width() * 0.75, bar.get_height(), f"{bench.speedups()[n]:.1f}x",
                ha="left", va="bottom")
    ax.set_ylabel("time per step (ms)")
    ax.set_xlabel(f"implementation ({bench.num_parameters / 1e6:.2f}M parameters in {bench.num_tensors} tensors, "
                  f"{bench.device})")
    ax.set_title(title)
    ax.legend()
    fig.tight_layout()
    return fig
