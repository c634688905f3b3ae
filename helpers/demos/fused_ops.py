"""Notebook 04, sections 3, 4 and 6: megatron-core's fused kernels against eager and ``torch.compile``, measured.

Section 3: megatron's fused bias-GELU computes the tanh GELU, not erf. Section 4: every implementation of
the four element-wise chains this machine can run, timed and checked. Section 6: what was skipped here,
and why. Bytes and FLOPs come from :func:`helpers.demos.roofline.traffic_model`, the clock from
:func:`helpers.demos.timing.time_calls`.

Sources: megatron-core 0.19.2 ``megatron/core/fusions/fused_bias_gelu.py``,
``fused_bias_dropout.py``, ``fused_softmax.py``, ``fused_layer_norm.py``,
``megatron/core/jit.py`` (``jit_fuser`` is ``torch.compile`` for torch >= 2.2);
Hendrycks & Gimpel 2016 (the tanh GELU); Apex ``apex/normalization/fused_layer_norm.py``.
"""

from __future__ import annotations

import inspect
import math
from dataclasses import dataclass
from typing import Any, Callable, Mapping, Sequence

import torch
import torch.nn.functional as F

from helpers.support import environment
from helpers.demos.roofline import DTYPE_BYTES, check_op_shape, traffic_model
from helpers.demos.timing import device_type, time_calls

#: Attention-score scale of the softmax benchmark: 1/sqrt(head dim) with GPT-2's head dim of 64.
_SOFTMAX_SCALE = 1.0 / 8.0


# ------------------------------------------------------------------ GELU forms (section 3)
def _uncompiled(fn: Callable) -> Callable | None:
    """The Python function behind a ``torch.compile``-wrapped one (None for TorchScript)."""
    orig = getattr(fn, "_torchdynamo_orig_callable", None)
    if orig is not None:
        return orig
    unwrapped = inspect.unwrap(fn)
    return None if unwrapped is fn or not inspect.isfunction(unwrapped) else unwrapped


def megatron_jit_fuser() -> str:
    """What megatron-core's ``jit_fuser`` (megatron/core/jit.py) is in this environment.

    Returns:
        ``"torch.compile"``, ``"torch.jit.script"`` or ``"no-op"``.
    """
    from megatron.core import jit

    fuser = jit.jit_fuser
    if fuser is torch.compile:
        return "torch.compile"
    if fuser is torch.jit.script:
        return "torch.jit.script"
    return "no-op"


def gelu_forms(x: torch.Tensor) -> dict[str, torch.Tensor]:
    """GELU of ``x`` three ways: exact erf, torch's tanh approximation, megatron's formula.

    megatron-core's fused bias-GELU computes ``x * 0.5 * (1 + tanh(0.79788456 * x * (1 + 0.044715 * x * x)))``
    (Hendrycks & Gimpel 2016's tanh form); its unfused path calls the exact erf ``F.gelu``. A converted
    model must name the one training computed (transformers: ``"gelu"`` for erf, ``"gelu_new"`` for tanh).

    Args:
        x: any shape, floating dtype.

    Returns:
        ``{"erf": F.gelu(x), "torch_tanh": F.gelu(x, approximate="tanh"),
        "megatron_tanh": megatron's formula with a zero bias}``, each shaped like ``x``.

    Source: megatron/core/fusions/fused_bias_gelu.py ``bias_gelu``.
    """
    from megatron.core.fusions import fused_bias_gelu

    formula = _uncompiled(fused_bias_gelu.bias_gelu) or fused_bias_gelu.bias_gelu
    with torch.no_grad():
        return {
            "erf": F.gelu(x),
            "torch_tanh": F.gelu(x, approximate="tanh"),
            "megatron_tanh": formula(torch.zeros((), dtype=x.dtype, device=x.device), x),
        }


def plot_gelu_difference(x: torch.Tensor, forms: Mapping[str, torch.Tensor],
                         title: str = "Fused bias-GELU (tanh) minus unfused GELU (erf)"):
    """Plot ``megatron_tanh - erf`` against ``x`` (from :func:`gelu_forms`); returns the Figure."""
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 4))
    xs = x.detach().cpu().numpy()
    ax.plot(xs, (forms["megatron_tanh"] - forms["erf"]).cpu().numpy(), label="megatron tanh formula - erf")
    ax.plot(xs, (forms["torch_tanh"] - forms["erf"]).cpu().numpy(), "--", label="F.gelu(approximate='tanh') - erf")
    ax.axhline(0, color="grey", lw=0.5)
    ax.set_xlabel("pre-activation x (dimensionless)")
    ax.set_ylabel("GELU difference (dimensionless)")
    ax.set_title(title)
    ax.legend()
    fig.tight_layout()
    return fig


# ------------------------------------------------------------------ fused-op candidates (section 4)
@dataclass
class Candidate:
    """One implementation of a fused op, ready to time.

    Attributes:
        op: one of :data:`helpers.demos.roofline.FUSED_OPS`.
        key: identifier used in ``summary.json`` (``"eager"``, ``"megatron_fused"``,
            ``"torch_compile"``...).
        name: label for tables and plots.
        fn: zero-argument callable computing the op on prepared inputs.
        form: the :func:`traffic_model` form it implements (``"unfused"``, ``"fused"``...).
        source: the file / library it comes from.
        check: zero-argument callable returning the max abs deviation from its reference.
    """

    op: str
    key: str
    name: str
    fn: Callable[[], torch.Tensor]
    form: str
    source: str
    check: Callable[[], float]


def _gpu_reason(device: str, available: bool, needs: str) -> str | None:
    if device != "cuda":
        return f"needs a CUDA GPU and {needs} (this run is on {device})"
    if not available:
        return f"{needs} is not importable here"
    return None


def _layernorm_by_ops(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, eps: float) -> torch.Tensor:
    """LayerNorm as separate ops (mean, subtract, variance, rsqrt, scale, shift): the unfused form."""
    mean = x.mean(-1, keepdim=True)
    centered = x - mean
    var = (centered * centered).mean(-1, keepdim=True)
    return centered * torch.rsqrt(var + eps) * weight + bias


def fusion_candidates(op: str, shape: Sequence[int], *, device: str = "cpu",
                      dtype: torch.dtype = torch.float32, include_compile: bool = True,
                      dropout_prob: float = 0.1, seed: int = 0) -> tuple[list[Candidate], dict[str, str]]:
    """The implementations of ``op`` this machine can run, and why the others are skipped.

    The first candidate is the eager (unfused) baseline, megatron-core's own unfused path where it has
    one. Inputs are made once (seeded) and reused.

    Args:
        op: one of :data:`helpers.demos.roofline.FUSED_OPS`.
        shape: see :func:`helpers.demos.roofline.traffic_model`.
        include_compile: add ``torch.compile`` forms (a few seconds of compilation each, cached by Inductor).
        dropout_prob: bias_dropout_add's dropout probability (Megatron-LM default 0.1).

    Returns:
        ``(candidates, skipped)`` with ``skipped = {name: reason}``.

    Raises:
        ValueError: see :func:`helpers.demos.roofline.traffic_model`; dropout_prob outside [0, 1).
    """
    shape = check_op_shape(op, shape)
    device = device_type(device)
    if not 0 <= dropout_prob < 1:
        raise ValueError(f"dropout_prob={dropout_prob} must be in [0, 1)")
    g = torch.Generator(device="cpu").manual_seed(seed)

    def rand(*s: int) -> torch.Tensor:
        return torch.randn(*s, generator=g).to(device=device, dtype=dtype)

    cands: list[Candidate] = []
    skipped: dict[str, str] = {}
    apex = environment.nvidia_apex()
    te = environment.transformer_engine_version()

    def diff(a: torch.Tensor, b: torch.Tensor) -> float:
        return (a.float() - b.float()).abs().max().item()

    if op == "bias_gelu":
        from megatron.core.fusions import fused_bias_gelu as fbg

        y, b = rand(*shape), rand(shape[1])
        erf_ref = F.gelu(y.float() + b.float())
        tanh_ref = F.gelu(y.float() + b.float(), approximate="tanh")
        eager = lambda: F.gelu(y + b)  # noqa: E731
        cands.append(Candidate(op, "eager", "eager: bias add + F.gelu (erf)", eager, "unfused",
                               "megatron/core/transformer/mlp.py (bias_activation_fusion=False)",
                               lambda: diff(eager(), erf_ref)))
        formula = _uncompiled(fbg.bias_gelu)
        if formula is not None:
            f_eager = lambda: formula(b, y)  # noqa: E731
            cands.append(Candidate(op, "eager_formula", "eager: megatron tanh formula, op by op", f_eager,
                                   "unfused_formula",
                                   "fused_bias_gelu.py bias_gelu without jit_fuser",
                                   lambda: diff(f_eager(), tanh_ref)))
        else:
            skipped["eager: megatron tanh formula, op by op"] = (
                "megatron's bias_gelu is not a torch.compile wrapper here; its Python source is not reachable")
        fused = lambda: fbg.bias_gelu_impl(y, b)  # noqa: E731
        cands.append(Candidate(op, "megatron_fused", f"megatron fused bias_gelu ({megatron_jit_fuser()}, tanh)",
                               fused, "fused",
                               "megatron/core/fusions/fused_bias_gelu.py (bias_activation_fusion=True)",
                               lambda: diff(fused(), tanh_ref)))
        if include_compile:
            compiled = torch.compile(lambda y_, b_: F.gelu(y_ + b_))
            c = lambda: compiled(y, b)  # noqa: E731
            cands.append(Candidate(op, "torch_compile", "torch.compile: bias add + F.gelu (erf)", c, "fused",
                                   "torch.compile (Inductor)", lambda: diff(c(), erf_ref)))
    elif op == "bias_dropout_add":
        from megatron.core.fusions.fused_bias_dropout import get_bias_dropout_add

        x, b, r = rand(*shape), rand(shape[1]), rand(*shape)
        kept = (r.float() + (x.float() + b.float()) / (1 - dropout_prob))

        def check(fn: Callable[[], torch.Tensor]) -> Callable[[], float]:
            def run() -> float:
                out = fn().float()
                # every element is either dropped (= residual) or kept (= residual + (x+b)/(1-p))
                return torch.minimum((out - r.float()).abs(), (out - kept).abs()).max().item()
            return run

        unfused_fn, fused_fn = get_bias_dropout_add(True, False), get_bias_dropout_add(True, True)
        unfused = lambda: unfused_fn((x, b), r, dropout_prob)  # noqa: E731
        fused = lambda: fused_fn((x, b), r, dropout_prob)  # noqa: E731
        cands.append(Candidate(op, "eager", "eager: megatron unfused bias_dropout_add", unfused, "unfused",
                               "fused_bias_dropout.py bias_dropout_add_unfused (bias_dropout_fusion=False)",
                               check(unfused)))
        cands.append(Candidate(op, "megatron_fused", f"megatron fused bias_dropout_add ({megatron_jit_fuser()})",
                               fused, "fused",
                               "fused_bias_dropout.py bias_dropout_add_fused_train (bias_dropout_fusion=True)",
                               check(fused)))
    elif op == "scale_mask_softmax":
        from megatron.core.fusions.fused_softmax import FusedScaleMaskSoftmax
        from megatron.core.transformer.enums import AttnMaskType
        from megatron.core.transformer.utils import attention_mask_func

        bsz, heads, sq, sk = shape
        scale = _SOFTMAX_SCALE
        x = rand(*shape)
        mask = torch.triu(torch.ones(sq, sk, dtype=torch.bool, device=device), diagonal=1)[None, None]
        ref = torch.softmax((x.float() * scale).masked_fill(mask, -10000.0), dim=-1)
        half = dtype in (torch.float16, torch.bfloat16)

        def softmax_module(fusion: bool) -> FusedScaleMaskSoftmax:
            return FusedScaleMaskSoftmax(dtype == torch.float16, dtype == torch.bfloat16, AttnMaskType.causal,
                                         fusion, attention_mask_func, True, scale)

        eager_mod = softmax_module(False)
        eager = lambda: eager_mod(x, mask)  # noqa: E731
        cands.append(Candidate(op, "eager", "eager: megatron scale, mask, softmax", eager, "unfused",
                               "fused_softmax.py forward_torch_softmax (masked_softmax_fusion=False)",
                               lambda: diff(eager(), ref)))
        fused_mod = softmax_module(True)
        try:
            available = device == "cuda" and half and fused_mod.is_kernel_available(None, bsz, heads, sq, sk)
        except ImportError:  # is_kernel_available imports the CUDA extension
            available = False
        if available:
            fk = lambda: fused_mod(x, None)  # noqa: E731
            cands.append(Candidate(op, "megatron_cuda_kernel",
                                   "megatron fused CUDA kernel (scaled_upper_triang_masked_softmax)", fk,
                                   "fused", "fused_softmax.py ScaledUpperTriangMaskedSoftmax",
                                   lambda: diff(fk(), ref)))
        else:
            skipped["megatron fused softmax CUDA kernel"] = (
                "FusedScaleMaskSoftmax.is_kernel_available() is False: the kernel needs a CUDA GPU, fp16/bf16 "
                f"scores and the scaled_upper_triang_masked_softmax_cuda extension (device={device}, "
                f"dtype={str(dtype).replace('torch.', '')}); with masked_softmax_fusion=True megatron-core "
                "silently runs the same torch path as the unfused form")
        if include_compile:
            compiled = torch.compile(softmax_module(False))
            c = lambda: compiled(x, mask)  # noqa: E731
            cands.append(Candidate(op, "torch_compile", "torch.compile: megatron scale, mask, softmax", c, "fused",
                                   "torch.compile (Inductor) of FusedScaleMaskSoftmax", lambda: diff(c(), ref)))
    else:
        t, h = shape
        x, w, b, eps = rand(*shape), 1 + 0.1 * rand(h), 0.1 * rand(h), 1e-5
        ref = F.layer_norm(x.float(), (h,), w.float(), b.float(), eps)
        eager = lambda: _layernorm_by_ops(x, w, b, eps)  # noqa: E731
        cands.append(Candidate(op, "eager", "eager: LayerNorm op by op", eager, "unfused",
                               "mean / var / rsqrt / affine as separate torch ops", lambda: diff(eager(), ref)))
        native = lambda: F.layer_norm(x, (h,), w, b, eps)  # noqa: E731
        cands.append(Candidate(op, "torch_native", "torch.nn.LayerNorm (native kernel)", native, "fused",
                               "megatron/core/transformer/torch_norm.py (local spec) -> torch.nn.LayerNorm",
                               lambda: diff(native(), ref)))
        if include_compile:
            compiled = torch.compile(_layernorm_by_ops)
            c = lambda: compiled(x, w, b, eps)  # noqa: E731
            cands.append(Candidate(op, "torch_compile", "torch.compile: LayerNorm op by op", c, "fused",
                                   "torch.compile (Inductor)", lambda: diff(c(), ref)))
        reason = _gpu_reason(device, apex["FusedLayerNorm"], "NVIDIA Apex (apex.normalization)")
        if reason:
            skipped["Apex FusedLayerNorm"] = reason
        else:
            from apex.normalization import FusedLayerNorm

            mod = FusedLayerNorm(h, eps=eps).to(device=device, dtype=dtype)
            with torch.no_grad():
                mod.weight.copy_(w), mod.bias.copy_(b)
            a = lambda: mod(x)  # noqa: E731
            cands.append(Candidate(op, "apex", "Apex FusedLayerNorm", a, "fused",
                                   "apex/normalization/fused_layer_norm.py",
                                   lambda: diff(a(), ref)))
        reason = _gpu_reason(device, te is not None, "Transformer Engine")
        if reason:
            skipped["Transformer Engine LayerNorm"] = reason
        else:
            import transformer_engine.pytorch as tep

            mod = tep.LayerNorm(h, eps=eps, params_dtype=dtype)
            with torch.no_grad():
                mod.weight.copy_(w), mod.bias.copy_(b)
            te_fn = lambda: mod(x)  # noqa: E731
            cands.append(Candidate(op, "transformer_engine", "Transformer Engine LayerNorm", te_fn, "fused",
                                   "transformer_engine/pytorch/module/layernorm.py", lambda: diff(te_fn(), ref)))
    return cands, skipped


# ------------------------------------------------------------------ fused-op benchmark (sections 4-6)
@dataclass
class FusionBenchmark:
    """Result of :func:`benchmark_fusions`.

    Attributes:
        rows: one dict per (op, implementation): ``op, key, implementation, form, median_ms,
            q25_ms, q75_ms, spread, first_call_s, speedup_vs_eager, achieved_GB_s,
            achieved_GFLOP_s, intensity_flop_per_byte, max_abs_diff, source``.
        skipped: ``[{"op", "implementation", "reason"}]``.
        shapes: the shape of each op.
        device, dtype: where and in what it ran.
    """

    rows: list[dict[str, Any]]
    skipped: list[dict[str, str]]
    shapes: dict[str, tuple[int, ...]]
    device: str
    dtype: str

    def speedups(self) -> dict[str, float]:
        """``{"<op>_<key>": speedup over the op's eager baseline}`` for every non-baseline row."""
        out = {}
        for op in dict.fromkeys(r["op"] for r in self.rows):
            for r in [r for r in self.rows if r["op"] == op][1:]:
                out[f"{op}_{r['key']}"] = r["speedup_vs_eager"]
        return out

    def best(self, op: str) -> dict[str, Any]:
        """The fastest row of ``op`` (lowest median)."""
        return min((r for r in self.rows if r["op"] == op), key=lambda r: r["median_ms"])


def benchmark_fusions(shapes: Mapping[str, Sequence[int]], *, device: str = "cpu",
                      dtype: torch.dtype = torch.float32, warmup: int = 3, repeats: int = 15,
                      include_compile: bool = True, dropout_prob: float = 0.1,
                      min_repeat_s: float = 0.005, progress: bool = True) -> FusionBenchmark:
    """Time every available implementation of each op (forward, no autograd) and check it.

    The candidates of :func:`fusion_candidates` are timed together with :func:`time_calls`; speedups are
    relative to the op's eager baseline in the same call. Each result is checked against an fp32
    reference of the same formula and the max abs deviation kept.

    Args:
        shapes: ``{op: shape}``, e.g. :func:`op_shapes`.
        device, dtype, include_compile, dropout_prob: see :func:`fusion_candidates`.
        warmup, repeats, min_repeat_s: see :func:`time_calls`.

    Returns:
        :class:`FusionBenchmark`.

    Raises:
        ValueError: an unknown op or bad shape (see :func:`helpers.demos.roofline.traffic_model`).
    """
    device = device_type(device)
    dtype_bytes = DTYPE_BYTES.get(dtype, torch.finfo(dtype).bits // 8)
    rows: list[dict[str, Any]] = []
    skipped: list[dict[str, str]] = []
    ops = list(shapes.items())
    if progress:
        from tqdm.auto import tqdm

        ops = tqdm(ops, desc="fused ops")
    for op, shape in ops:
        cands, skip = fusion_candidates(op, shape, device=device, dtype=dtype,
                                        include_compile=include_compile, dropout_prob=dropout_prob)
        skipped += [{"op": op, "implementation": k, "reason": v} for k, v in skip.items()]
        forms = traffic_model(op, shape, dtype_bytes)
        with torch.no_grad():
            timings = time_calls({c.name: c.fn for c in cands}, device=device, warmup=warmup,
                                 repeats=repeats, min_repeat_s=min_repeat_s)
            checks = {c.name: c.check() for c in cands}
        base = timings[cands[0].name].median_s
        for c in cands:
            t, f = timings[c.name], forms[c.form]
            rows.append({
                "op": op, "key": c.key, "implementation": c.name, "form": c.form,
                "median_ms": t.median_s * 1e3, "q25_ms": t.q25_s * 1e3, "q75_ms": t.q75_s * 1e3,
                "spread": t.spread, "first_call_s": t.first_call_s,
                "speedup_vs_eager": base / t.median_s,
                "achieved_GB_s": f.bytes_moved / t.median_s / 1e9,
                "achieved_GFLOP_s": f.flops / t.median_s / 1e9,
                "intensity_flop_per_byte": f.arithmetic_intensity,
                "max_abs_diff": checks[c.name], "source": c.source,
            })
    return FusionBenchmark(rows, skipped, {k: tuple(v) for k, v in shapes.items()}, device,
                           str(dtype).replace("torch.", ""))


#: Each op of :data:`helpers.demos.roofline.FUSED_OPS` in words, for plots.
OP_WORDS = {"bias_gelu": "bias + GELU", "bias_dropout_add": "bias + dropout + residual add",
            "scale_mask_softmax": "scale + mask + softmax", "layernorm": "LayerNorm"}

#: Each implementation key of :func:`fusion_candidates` in words, for plots.
IMPLEMENTATION_WORDS = {
    "eager": "eager, op by op (unfused)",
    "eager_formula": "megatron's tanh formula, op by op",
    "megatron_fused": "megatron-core fused",
    "torch_compile": "torch.compile of the eager ops",
    "torch_native": "torch's native LayerNorm kernel",
    "megatron_cuda_kernel": "megatron-core fused CUDA kernel",
    "apex": "Apex FusedLayerNorm",
    "transformer_engine": "Transformer Engine LayerNorm",
}

#: Each :func:`helpers.demos.roofline.traffic_model` form in words, for plot legends.
FORM_WORDS = {"unfused": "eager baseline, unfused: one kernel per op", "unfused_formula": "tanh formula, one kernel per op",
              "fused": "fused: one kernel"}


def implementation_words(row: Mapping[str, Any], gelu: bool = True) -> str:
    """A :class:`FusionBenchmark` row's implementation in words (``"megatron-core fused (torch.compile)"``).

    megatron-core's compiled forms name the compiler its ``jit_fuser`` is here (from the row's
    ``implementation``); with ``gelu``, bias + GELU rows also name their GELU (erf or tanh).
    Unknown keys fall back to the row's ``implementation``.
    """
    words = IMPLEMENTATION_WORDS.get(row["key"], row["implementation"])
    if row["key"] == "megatron_fused":
        fuser = next((f for f in ("torch.compile", "torch.jit.script", "no-op") if f in row["implementation"]), None)
        words += f" ({fuser})" if fuser else ""
    if gelu and row["op"] == "bias_gelu" and row["key"] in ("eager", "torch_compile"):
        words += ", erf GELU"
    if gelu and row["op"] == "bias_gelu" and row["key"] == "megatron_fused":
        words += ", tanh GELU"
    return words


def log_ticks(lo: float, hi: float, minimum: int = 4) -> list[float]:
    """Tick values around ``[lo, hi]`` for a log axis: the 1-2-5 series (..., 0.5, 1, 2, 5, 10, ...)
    over up to 2 decades, 1-3 (0.3, 1, 3, 10) up to 3.5 decades, powers of ten beyond (so that
    the labels never crowd).

    Returns at least ``minimum`` ticks: the ticks inside ``[lo, hi]``, the nearest one at or
    below ``lo`` and at or above ``hi``, and, where still too few, more outside (the caller
    widens the axis to the first and last).

    Raises:
        ValueError: ``lo`` or ``hi`` not positive, or ``lo > hi``.
    """
    if not (0 < lo <= hi):
        raise ValueError(f"lo={lo}, hi={hi}: need 0 < lo <= hi")
    decades = math.log10(hi / lo)
    steps = (1, 2, 5) if decades <= 2 else (1, 3) if decades <= 3.5 else (1,)
    series = [float(f"{m * 10.0 ** e:.6g}") for e in range(-6, 7) for m in steps]
    inside = [t for t in series if lo <= t <= hi]
    below = [t for t in series if t < lo][::-1]
    above = [t for t in series if t > hi]
    if below and (not inside or inside[0] > lo):
        inside.insert(0, below.pop(0))
    if above and inside[-1] < hi:
        inside.append(above.pop(0))
    while len(inside) < minimum and (below or above):
        if above and (not below or len(above) >= len(below)):
            inside.append(above.pop(0))
        if len(inside) < minimum and below:
            inside.insert(0, below.pop(0))
    return sorted(inside)


def speedup_bars(bench: FusionBenchmark) -> list[dict[str, Any]]:
    """What :func:`plot_speedups` draws, top bar first: one dict per row of ``bench``.

    Returns:
        ``[{"label": "<op in words>: <implementation in words>", "form": ..., "speedup": speedup
        over the op's eager baseline (x), "low", "high": the speedups at the baseline's median
        over the row's 75th and 25th percentile times, "baseline": True for the op's eager row}]``.
    """
    base = {r["op"]: r["median_ms"] for r in bench.rows if r["key"] == "eager"}
    bars = []
    for r in bench.rows:
        b = base.get(r["op"], r["median_ms"])
        bars.append({"label": f"{OP_WORDS.get(r['op'], r['op'])}: {implementation_words(r)}", "form": r["form"],
                     "speedup": r["speedup_vs_eager"], "low": b / r["q75_ms"], "high": b / r["q25_ms"],
                     "baseline": r["key"] == "eager"})
    return bars


def plot_speedups(bench: FusionBenchmark, title: str = "Measured speedup over eager, per op"):
    """Horizontal bars of :class:`FusionBenchmark` speedups (log scale, IQR whiskers); returns the Figure.

    One bar per row (:func:`speedup_bars`), labelled in words, coloured by form (legend),
    starting at 1x (right: faster than eager, left: slower), the speedup written at its end; each
    eager baseline is a marker at 1x. The x axis has 1-2-5 ticks (:func:`log_ticks`).
    """
    import matplotlib.pyplot as plt
    from matplotlib import ticker

    colors = {"unfused": "tab:grey", "unfused_formula": "tab:red", "fused": "tab:blue"}
    bars = speedup_bars(bench)[::-1]  # first op at the top
    fig, ax = plt.subplots(figsize=(10, 0.42 * len(bars) + 2.2))
    seen: set[str] = set()
    for i, b in enumerate(bars):
        y = b["speedup"]
        label = FORM_WORDS.get(b["form"], b["form"]) if b["form"] not in seen else None
        seen.add(b["form"])
        color = colors.get(b["form"], "tab:green")
        if b["baseline"]:
            ax.plot([1.0], [i], "D", color=color, ms=7, label=label)
            ax.annotate("1x (baseline)", (1.0, i), xytext=(8, 0), textcoords="offset points", va="center", fontsize=8)
            continue
        ax.barh(i, y - 1.0, left=1.0, xerr=[[max(y - b["low"], 0)], [max(b["high"] - y, 0)]], capsize=2,
                color=color, label=label)
        faster = y >= 1
        ax.annotate(f"{y:.2f}x", (max(y, b["high"]) if faster else min(y, b["low"]), i),
                    xytext=(5 if faster else -5, 0), textcoords="offset points", va="center",
                    ha="left" if faster else "right", fontsize=8)
    ax.set_yticks(range(len(bars)), [b["label"] for b in bars], fontsize=8)
    ax.axvline(1.0, color="black", lw=0.8)
    ax.set_ylabel("operation: implementation")
    ax.set_xscale("log")
    lo = min([b["low"] for b in bars] + [b["speedup"] for b in bars] + [1.0])
    hi = max([b["high"] for b in bars] + [b["speedup"] for b in bars] + [1.0])
    ticks = log_ticks(lo, hi)
    room = (hi / lo) ** 0.12  # about an eighth of the axis on each side, for the written speedups
    ax.set_xlim(min(ticks[0], lo) / (room if lo < 1 else 1.15), max(ticks[-1], hi) * room)
    ax.xaxis.set_major_locator(ticker.FixedLocator(ticks))
    ax.xaxis.set_major_formatter(ticker.FuncFormatter(lambda v, _: f"{v:g}x"))
    ax.xaxis.set_minor_locator(ticker.NullLocator())
    ax.grid(True, axis="x", alpha=0.3)
    ax.set_xlabel(f"speedup over the operation's eager baseline (times faster, log scale; {bench.device}, "
                  f"{bench.dtype}; whiskers: interquartile range)")
    ax.set_title(title)
    ax.legend(title="form (bars start at 1x: right of it faster than eager, left of it slower)", loc="upper center",
              bbox_to_anchor=(0.5, -0.14), ncol=3, fontsize=8, title_fontsize=8)
    fig.tight_layout()
    return fig


def roofline_points(bench: FusionBenchmark) -> list[tuple[str, str, float, float]]:
    """Every row of ``bench`` as a point of :func:`helpers.demos.roofline.plot_roofline`.

    Returns:
        ``[(operation in words, implementation in words, intensity FLOP/byte, achieved FLOP/s)]``:
        the roofline colours points by operation and marks them by implementation.
    """
    return [(OP_WORDS.get(r["op"], r["op"]), implementation_words(r, gelu=False), r["intensity_flop_per_byte"],
             r["achieved_GFLOP_s"] * 1e9) for r in bench.rows]
