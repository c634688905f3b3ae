"""Notebook 04: fused kernels and the fused AdamW optimizer, modelled and measured.

Megatron-LM's speed on GPUs comes in part from *kernel fusion*: a chain of element-wise
operations (bias add, GELU, dropout, residual add, scale, mask, softmax, LayerNorm) done in
one pass over memory instead of one pass per operation, and from Apex's fused (multi-tensor)
AdamW. This module holds everything notebook 04 shows:

* a **memory-traffic model** (:func:`traffic_model`): bytes read and written, FLOPs and
  arithmetic intensity of the unfused and fused forms of bias+GELU, bias+dropout+residual-add,
  scale+mask+softmax and LayerNorm;
* a **roofline** of this machine from a measured memory bandwidth (a large copy) and a
  measured matrix-multiply FLOP/s (:func:`measure_roofline`, :func:`plot_roofline`);
* **timings** with warm-up, interleaved repeats, median and spread (:func:`time_calls`;
  ``time.perf_counter`` on CPU, ``torch.cuda.Event`` on CUDA) of eager, megatron-core's fused
  and ``torch.compile``-fused implementations (:func:`benchmark_fusions`), and of a whole
  training step with megatron-core's fusion flags off and on (:func:`benchmark_fusion_flags`);
* **AdamW** as a for-loop, ``foreach`` and ``fused`` (torch), and Apex ``FusedAdam`` where
  present, timed on the parameters of notebook 03's model and checked to agree after N steps
  (:func:`benchmark_adamw`);
* what training should use: :func:`fastest_adamw` / :func:`adamw_implementation` and
  :func:`recommended_fusion_flags`.

Sources: megatron-core 0.19.2 ``megatron/core/fusions/fused_bias_gelu.py``,
``fused_bias_dropout.py``, ``fused_softmax.py``, ``fused_layer_norm.py``,
``megatron/core/jit.py`` (``jit_fuser`` is ``torch.compile`` for torch >= 2.2);
Williams, Waterman, Patterson 2009, "Roofline: an insightful visual performance model"
(CACM 52(4)); Loshchilov & Hutter 2019, "Decoupled Weight Decay Regularization" (AdamW);
Apex ``apex/optimizers/fused_adam.py``; torch ``torch/optim/adamw.py``.
"""

from __future__ import annotations

import contextlib
import inspect
import math
import os
import statistics
import time
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Iterator, Mapping, Sequence

import torch
import torch.nn.functional as F

from helpers import environment, results

NOTEBOOK = "04_fused_kernels"

#: The element-wise chains this module models and measures.
FUSED_OPS = ("bias_gelu", "bias_dropout_add", "scale_mask_softmax", "layernorm")

#: FLOPs per output element, the same for every form (fusion moves bytes, not FLOPs).
#: A transcendental (tanh, exp, rsqrt) counts as 1 FLOP.
#: bias_gelu: bias add 1 + megatron's tanh formula 9 (x*0.5, 0.79788456*x, 0.044715*x, *x,
#: 1+, *, tanh, 1+, *). bias_dropout_add: bias add 1, mask multiply 1, 1/(1-p) scale 1,
#: residual add 1. scale_mask_softmax: scale 1, max 1, subtract 1, exp 1, sum 1, divide 1
#: (the mask is a select). layernorm: mean 1, subtract 1, square 1, sum 1, normalise 1,
#: gamma 1, beta 1.
FLOPS_PER_ELEMENT = {"bias_gelu": 10, "bias_dropout_add": 4, "scale_mask_softmax": 6, "layernorm": 7}

#: Bytes per element of the dropout keep-mask torch saves for the backward pass (bool).
DROPOUT_MASK_BYTES = 1

#: Attention-score scale of the softmax benchmark: 1/sqrt(head dim) with GPT-2's head dim of 64.
SOFTMAX_SCALE = 1.0 / 8.0

#: Bytes per element of each floating dtype the benchmarks use.
DTYPE_BYTES = {torch.float32: 4, torch.bfloat16: 2, torch.float16: 2}


# =========================================================================== traffic model
@dataclass(frozen=True)
class Kernel:
    """One kernel launch of a form: what it reads from and writes to memory, in bytes."""

    name: str
    bytes_read: int
    bytes_written: int


@dataclass(frozen=True)
class FusionForm:
    """One way of computing an op: its kernels, the bytes they move and the FLOPs they do.

    Attributes:
        op: one of :data:`FUSED_OPS`.
        form: ``"unfused"``, ``"unfused_formula"`` (bias_gelu's tanh formula op by op) or
            ``"fused"``.
        description: what runs, in words.
        kernels: the kernel launches, in order.
        flops: floating-point operations (same for every form of one op).
    """

    op: str
    form: str
    description: str
    kernels: tuple[Kernel, ...]
    flops: int

    @property
    def bytes_read(self) -> int:
        """Bytes read from memory by all kernels."""
        return sum(k.bytes_read for k in self.kernels)

    @property
    def bytes_written(self) -> int:
        """Bytes written to memory by all kernels."""
        return sum(k.bytes_written for k in self.kernels)

    @property
    def bytes_moved(self) -> int:
        """Bytes read + written: the memory traffic a memory-bound kernel pays for."""
        return self.bytes_read + self.bytes_written

    @property
    def num_kernels(self) -> int:
        """Kernel launches (each one a full pass over its tensors)."""
        return len(self.kernels)

    @property
    def arithmetic_intensity(self) -> float:
        """FLOPs per byte moved (FLOP/byte): where the form sits on the roofline's x axis."""
        return self.flops / self.bytes_moved


def _numel(shape: Sequence[int]) -> int:
    return math.prod(int(s) for s in shape)


def _check_shape(op: str, shape: Sequence[int]) -> tuple[int, ...]:
    if op not in FUSED_OPS:
        raise ValueError(f"op={op!r} is unknown: choose one of {FUSED_OPS}")
    shape = tuple(int(s) for s in shape)
    want = 4 if op == "scale_mask_softmax" else 2
    if len(shape) != want or min(shape) < 1:
        example = "[batch, heads, sq, sk]" if want == 4 else "[tokens, width]"
        raise ValueError(f"shape={shape} for {op}: pass {want} positive sizes, {example}")
    return shape


def traffic_model(op: str, shape: Sequence[int], dtype_bytes: int = 4) -> dict[str, FusionForm]:
    """Bytes read/written, FLOPs and kernel launches of the unfused and fused forms of ``op``.

    The unfused forms are the kernels megatron-core (0.19.2) launches with its fusion flags
    off; the fused forms are one kernel that reads each input once and writes each output
    once, keeping intermediates in registers. Ideal caching is assumed inside a kernel and
    none between kernels (each intermediate goes to memory and comes back). Dropout is
    modelled as CUDA's one ``native_dropout`` kernel (output plus a 1-byte bool mask); torch's
    eager CPU dropout runs as ``bernoulli_``, ``div_`` and ``mul`` with a float mask, so on a
    CPU the unfused bias_dropout_add moves more than modelled here.

    Args:
        op: one of :data:`FUSED_OPS`.
        shape: bias_gelu, bias_dropout_add, layernorm: ``[tokens, width]`` (the bias /
            LayerNorm weights have ``width`` elements); scale_mask_softmax: ``[batch, heads,
            sq, sk]`` (attention scores; causal mask ``[sq, sk]`` of bools).
        dtype_bytes: bytes per activation element (4 fp32, 2 bf16/fp16).

    Returns:
        ``{form: FusionForm}``: ``"unfused"`` and ``"fused"`` for every op, plus
        ``"unfused_formula"`` for bias_gelu (megatron's tanh formula run op by op in eager
        mode: 10 kernels).

    Raises:
        ValueError: unknown op, or a shape of the wrong rank or with a size below 1.

    Sources: megatron/core/transformer/mlp.py (bias add then ``activation_func``),
    megatron/core/fusions/fused_bias_gelu.py, fused_bias_dropout.py
    (``_bias_dropout_add_func``), fused_softmax.py (``forward_torch_softmax`` and the CUDA
    ``ScaledUpperTriangMaskedSoftmax``), fused_layer_norm.py.
    """
    shape = _check_shape(op, shape)
    if dtype_bytes < 1:
        raise ValueError(f"dtype_bytes={dtype_bytes} must be >= 1 (4 for fp32, 2 for bf16)")
    d, n = int(dtype_bytes), _numel(shape)
    flops = FLOPS_PER_ELEMENT[op] * n
    K = Kernel
    if op == "bias_gelu":
        h = shape[1]
        unfused = (K("y + bias", d * (n + h), d * n), K("F.gelu", d * n, d * n))
        # megatron's bias_gelu formula, left to right: x*0.5 | 0.79788456*x | 0.044715*x |
        # (...)*x | 1+(...) | (0.79788456*x)*(...) | tanh | 1.0+tanh | (x*0.5)*(...)
        reads = [n, n, n, 2 * n, n, 2 * n, n, n, 2 * n]
        formula = (K("x = bias + y", d * (n + h), d * n),) + tuple(
            K(f"op {i + 2}", d * r, d * n) for i, r in enumerate(reads))
        fused = (K("bias_gelu (one kernel)", d * (n + h), d * n),)
        return {
            "unfused": FusionForm(op, "unfused", "bias add, then F.gelu: 2 kernels", unfused, flops),
            "unfused_formula": FusionForm(op, "unfused_formula", "tanh formula op by op: 10 kernels",
                                          formula, flops),
            "fused": FusionForm(op, "fused", "bias add + GELU in one kernel", fused, flops),
        }
    if op == "bias_dropout_add":
        h = shape[1]
        mask = DROPOUT_MASK_BYTES * n
        unfused = (K("x + bias", d * (n + h), d * n),
                   K("dropout", d * n, d * n + mask),
                   K("residual + out", 2 * d * n, d * n))
        fused = (K("bias_dropout_add (one kernel)", d * (2 * n + h), d * n + mask),)
        return {
            "unfused": FusionForm(op, "unfused", "bias add, dropout, residual add: 3 kernels", unfused, flops),
            "fused": FusionForm(op, "fused", "bias + dropout + residual in one kernel", fused, flops),
        }
    if op == "scale_mask_softmax":
        mask = shape[2] * shape[3]  # bool [sq, sk], broadcast over batch and heads
        unfused = (K("scores * scale", d * n, d * n),
                   K("masked_fill_ (in place)", d * n + mask, d * n),
                   K("softmax", d * n, d * n))
        fused = (K("scaled causal softmax (one kernel)", d * n, d * n),)
        return {
            "unfused": FusionForm(op, "unfused", "scale, mask, softmax: 3 kernels", unfused, flops),
            "fused": FusionForm(op, "fused", "scale + causal mask + softmax in one kernel "
                                "(mask from indices)", fused, flops),
        }
    t, h = shape
    unfused = (K("mean", d * n, d * t), K("x - mean", d * (n + t), d * n),
               K("square", d * n, d * n), K("mean of squares", d * n, d * t),
               K("+ eps", d * t, d * t), K("rsqrt", d * t, d * t),
               K("* rstd", d * (n + t), d * n), K("* gamma", d * (n + h), d * n),
               K("+ beta", d * (n + h), d * n))
    fused = (K("layer_norm (one kernel)", d * (n + 2 * h), d * n),)
    return {
        "unfused": FusionForm(op, "unfused", "LayerNorm op by op: 9 kernels", unfused, flops),
        "fused": FusionForm(op, "fused", "LayerNorm in one kernel", fused, flops),
    }


def op_shapes(cfg: Any, micro_batch_size: int) -> dict[str, tuple[int, ...]]:
    """The shapes each fused op sees in one micro-batch of a GPT with config ``cfg``.

    Args:
        cfg: a :class:`helpers.model.ModelConfig` (hidden_size, ffn_size,
            num_attention_heads, seq_length).
        micro_batch_size: sequences per micro-batch.

    Returns:
        ``{"bias_gelu": (tokens, ffn), "bias_dropout_add": (tokens, hidden),
        "scale_mask_softmax": (micro_batch, heads, seq, seq), "layernorm": (tokens, hidden)}``
        with ``tokens = micro_batch_size * seq_length``.

    Raises:
        ValueError: micro_batch_size below 1.
    """
    if int(micro_batch_size) < 1:
        raise ValueError(f"micro_batch_size={micro_batch_size} must be >= 1")
    tokens = micro_batch_size * cfg.seq_length
    return {
        "bias_gelu": (tokens, cfg.ffn_size),
        "bias_dropout_add": (tokens, cfg.hidden_size),
        "scale_mask_softmax": (micro_batch_size, cfg.num_attention_heads, cfg.seq_length, cfg.seq_length),
        "layernorm": (tokens, cfg.hidden_size),
    }


def traffic_table(shapes: Mapping[str, Sequence[int]], dtype_bytes: int = 4) -> list[dict[str, Any]]:
    """One row per (op, form) of :func:`traffic_model`, ready for a table.

    Returns:
        rows with ``op, form, shape, kernels, MB_read, MB_written, MFLOP,
        intensity_flop_per_byte, traffic_vs_fused`` (MB = 10^6 bytes).
    """
    rows = []
    for op, shape in shapes.items():
        forms = traffic_model(op, shape, dtype_bytes)
        fused = forms["fused"].bytes_moved
        for name, f in forms.items():
            rows.append({
                "op": op, "form": name, "shape": list(shape), "kernels": f.num_kernels,
                "MB_read": round(f.bytes_read / 1e6, 2), "MB_written": round(f.bytes_written / 1e6, 2),
                "MFLOP": round(f.flops / 1e6, 2),
                "intensity_flop_per_byte": round(f.arithmetic_intensity, 3),
                "traffic_vs_fused": round(f.bytes_moved / fused, 2),
            })
    return rows


def format_table(rows: Sequence[Mapping[str, Any]], columns: Sequence[str] | None = None,
                 digits: int = 3) -> str:
    """Rows of dicts as a fixed-width text table (floats to ``digits`` significant digits).

    Raises:
        ValueError: no rows.
    """
    if not rows:
        raise ValueError("rows is empty: nothing to tabulate")
    columns = list(columns or rows[0].keys())

    def cell(v: Any) -> str:
        if isinstance(v, bool) or not isinstance(v, float):
            return str(v)
        return f"{v:.{digits}g}" if abs(v) < 10**digits else f"{v:.0f}"

    text = [[str(c) for c in columns]] + [[cell(r.get(c, "")) for c in columns] for r in rows]
    widths = [max(len(line[i]) for line in text) for i in range(len(columns))]
    lines = ["  ".join(v.ljust(w) for v, w in zip(line, widths)).rstrip() for line in text]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


# =========================================================================== timing
@dataclass(frozen=True)
class Timing:
    """Repeated timings of one call, in seconds per call.

    Attributes:
        name: what was timed.
        times_s: one entry per repeat (seconds per call, averaged over ``number`` calls).
        number: calls per repeat.
        device: ``"cpu"`` or ``"cuda"``.
        clock: ``"time.perf_counter"`` or ``"torch.cuda.Event"``.
        first_call_s: the first warm-up call alone (includes any compilation).
    """

    name: str
    times_s: tuple[float, ...]
    number: int
    device: str
    clock: str
    first_call_s: float = float("nan")

    @property
    def median_s(self) -> float:
        """Median seconds per call."""
        return statistics.median(self.times_s)

    def quantile_s(self, q: float) -> float:
        """The ``q`` quantile (0..1) of seconds per call, linear interpolation."""
        xs = sorted(self.times_s)
        pos = q * (len(xs) - 1)
        lo, hi = math.floor(pos), math.ceil(pos)
        return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)

    @property
    def q25_s(self) -> float:
        """25th percentile, seconds per call."""
        return self.quantile_s(0.25)

    @property
    def q75_s(self) -> float:
        """75th percentile, seconds per call."""
        return self.quantile_s(0.75)

    @property
    def spread(self) -> float:
        """Interquartile range relative to the median (0.1 = the middle half within 10%)."""
        return (self.q75_s - self.q25_s) / self.median_s


def _device_type(device: str | torch.device | None) -> str:
    if device is None:
        return "cuda" if torch.cuda.is_available() else "cpu"
    dev = torch.device(device)
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device={str(device)!r} but torch sees no CUDA GPU: pass device='cpu'")
    if dev.type not in ("cpu", "cuda"):
        raise ValueError(f"device={str(device)!r}: choose 'cpu' or 'cuda'")
    return dev.type


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def _time_once(fn: Callable[[], Any], number: int, device: str) -> float:
    """Seconds per call of ``number`` back-to-back calls (CUDA events on a GPU)."""
    if device == "cuda":
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(number):
            fn()
        end.record()
        end.synchronize()
        return start.elapsed_time(end) / 1e3 / number
    t0 = time.perf_counter()
    for _ in range(number):
        fn()
    return (time.perf_counter() - t0) / number


def time_calls(fns: Mapping[str, Callable[[], Any]], *, device: str = "cpu", warmup: int = 3,
               repeats: int = 15, min_repeat_s: float = 0.005,
               progress: bool = False) -> dict[str, Timing]:
    """Time several callables fairly: warm-up, then repeats interleaved round-robin.

    Interleaving (A B C A B C ...) spreads any drift of a shared machine (other processes,
    frequency changes) evenly over the candidates, which back-to-back blocks would not.
    Each repeat makes ``number`` calls, chosen so that a repeat lasts at least
    ``min_repeat_s`` (short kernels are otherwise below the clock's noise).

    Args:
        fns: ``{name: zero-argument callable}``.
        device: ``"cpu"`` (``time.perf_counter``) or ``"cuda"`` (``torch.cuda.Event`` pairs,
            synchronised after each repeat).
        warmup: untimed calls first (compilation, caches, allocator); >= 1.
        repeats: timed repeats per callable; >= 3.
        min_repeat_s: shortest repeat in seconds.
        progress: show a tqdm bar.

    Returns:
        ``{name: Timing}``.

    Raises:
        ValueError: no callables, warmup < 1, repeats < 3, or an unusable device.
    """
    device = _device_type(device)
    if not fns:
        raise ValueError("fns is empty: pass {name: callable}")
    if warmup < 1 or repeats < 3:
        raise ValueError(f"warmup={warmup} must be >= 1 and repeats={repeats} >= 3 (a median needs a few)")
    clock = "torch.cuda.Event" if device == "cuda" else "time.perf_counter"
    first, number = {}, {}
    for name, fn in fns.items():
        _sync(device)
        t0 = time.perf_counter()
        fn()
        _sync(device)
        first[name] = time.perf_counter() - t0
        for _ in range(warmup - 1):
            fn()
        one = _time_once(fn, 1, device)
        number[name] = max(1, math.ceil(min_repeat_s / max(one, 1e-9)))
    times: dict[str, list[float]] = {name: [] for name in fns}
    rounds: Iterable[int] = range(repeats)
    if progress:
        from tqdm.auto import tqdm

        rounds = tqdm(rounds, desc="timing", leave=False)
    for _ in rounds:
        for name, fn in fns.items():
            times[name].append(_time_once(fn, number[name], device))
    return {name: Timing(name, tuple(times[name]), number[name], device, clock, first[name]) for name in fns}


# =========================================================================== roofline
@dataclass(frozen=True)
class Roofline:
    """This machine's roofline: attainable FLOP/s = min(peak, bandwidth x intensity).

    Attributes:
        bandwidth_bytes_per_s: measured memory bandwidth (bytes/s, read + write).
        peak_flops_per_s: measured matrix-multiply throughput (FLOP/s).
        device: ``"cpu"`` or ``"cuda"``.
        dtype: the matmul dtype, e.g. ``"float32"``.
        copy: timing of the bandwidth copy; matmul: timing of the matmul (None if given by hand).
    """

    bandwidth_bytes_per_s: float
    peak_flops_per_s: float
    device: str = "cpu"
    dtype: str = "float32"
    copy: Timing | None = None
    matmul: Timing | None = None

    def __post_init__(self) -> None:
        if not (self.bandwidth_bytes_per_s > 0 and self.peak_flops_per_s > 0):
            raise ValueError("bandwidth_bytes_per_s and peak_flops_per_s must be > 0")

    @property
    def ridge_intensity(self) -> float:
        """FLOP/byte where the memory roof meets the compute roof; below it, memory-bound."""
        return self.peak_flops_per_s / self.bandwidth_bytes_per_s

    def attainable_flops(self, intensity: float) -> float:
        """Upper bound on FLOP/s at ``intensity`` FLOP/byte."""
        return min(self.peak_flops_per_s, self.bandwidth_bytes_per_s * intensity)

    def time_lower_bound_s(self, form: FusionForm) -> float:
        """Fastest possible time of ``form`` on this machine: max(bytes/bandwidth, FLOPs/peak)."""
        return max(form.bytes_moved / self.bandwidth_bytes_per_s, form.flops / self.peak_flops_per_s)

    def predicted_speedup(self, slow: FusionForm, fast: FusionForm) -> float:
        """Roofline-model speedup of ``fast`` over ``slow`` (a model, not a measurement)."""
        return self.time_lower_bound_s(slow) / self.time_lower_bound_s(fast)


def measure_memory_bandwidth(size_mib: int = 256, *, device: str = "cpu", warmup: int = 2,
                             repeats: int = 7) -> tuple[float, Timing]:
    """Memory bandwidth from ``dst.copy_(src)`` of a large fp32 buffer (STREAM's "copy").

    A copy reads ``size`` bytes and writes ``size`` bytes, so bandwidth = 2 x size / time.
    Pick a size well above the last-level cache (tens of MiB on a laptop CPU), or the copy
    measures the cache instead of memory.

    Args:
        size_mib: buffer size in MiB (each of source and destination).
        device, warmup, repeats: see :func:`time_calls`.

    Returns:
        ``(bytes_per_second, timing)`` from the median copy time.

    Raises:
        ValueError: size_mib below 1.

    Source: McCalpin, STREAM benchmark ("Copy" kernel).
    """
    if int(size_mib) < 1:
        raise ValueError(f"size_mib={size_mib} must be >= 1")
    device = _device_type(device)
    numel = int(size_mib) * 2**20 // 4
    src = torch.ones(numel, dtype=torch.float32, device=device)
    dst = torch.empty_like(src)
    timing = time_calls({"copy": lambda: dst.copy_(src)}, device=device, warmup=warmup,
                        repeats=repeats, min_repeat_s=0.0)["copy"]
    return 2 * numel * 4 / timing.median_s, timing


def measure_matmul_flops(n: int = 1024, *, device: str = "cpu", dtype: torch.dtype = torch.float32,
                         warmup: int = 2, repeats: int = 7) -> tuple[float, Timing]:
    """Matrix-multiply throughput: ``2 n^3`` FLOPs per ``[n, n] @ [n, n]``, divided by the time.

    Args:
        n: matrix size.
        device, warmup, repeats: see :func:`time_calls`.
        dtype: matmul dtype (fp32 on CPU; bf16 is what a GPU trains with).

    Returns:
        ``(flops_per_second, timing)`` from the median matmul time.

    Raises:
        ValueError: n below 1.
    """
    if int(n) < 1:
        raise ValueError(f"n={n} must be >= 1")
    device = _device_type(device)
    g = torch.Generator(device="cpu").manual_seed(0)
    a = torch.randn(n, n, generator=g).to(device=device, dtype=dtype)
    b = torch.randn(n, n, generator=g).to(device=device, dtype=dtype)
    out = torch.empty(n, n, device=device, dtype=dtype)
    timing = time_calls({"matmul": lambda: torch.mm(a, b, out=out)}, device=device, warmup=warmup,
                        repeats=repeats, min_repeat_s=0.0)["matmul"]
    return 2 * n**3 / timing.median_s, timing


def measure_roofline(*, device: str = "cpu", copy_mib: int = 256, matmul_n: int = 1024,
                     dtype: torch.dtype = torch.float32, repeats: int = 7) -> Roofline:
    """Measure this machine's roofline (:func:`measure_memory_bandwidth` + :func:`measure_matmul_flops`)."""
    bw, copy = measure_memory_bandwidth(copy_mib, device=device, repeats=repeats)
    peak, mm = measure_matmul_flops(matmul_n, device=device, dtype=dtype, repeats=repeats)
    return Roofline(bw, peak, _device_type(device), str(dtype).replace("torch.", ""), copy, mm)


def plot_roofline(roofline: Roofline, points: Sequence[tuple[str, float, float]] = (),
                  title: str = "Roofline of this machine"):
    """Log-log roofline with measured points.

    Args:
        roofline: the machine.
        points: ``(label, intensity FLOP/byte, achieved FLOP/s)`` per measured kernel.
        title: the plot title.

    Returns:
        a matplotlib ``Figure``.
    """
    import matplotlib.pyplot as plt
    import numpy as np

    lo = min([p[1] for p in points] + [roofline.ridge_intensity / 100]) / 2
    hi = max([p[1] for p in points] + [roofline.ridge_intensity * 10]) * 2
    xs = np.logspace(math.log10(lo), math.log10(hi), 200)
    fig, ax = plt.subplots(figsize=(8, 5))
    ax.loglog(xs, [roofline.attainable_flops(x) / 1e9 for x in xs], "k-", lw=2,
              label=f"roof: {roofline.bandwidth_bytes_per_s / 1e9:.1f} GB/s, "
                    f"{roofline.peak_flops_per_s / 1e9:.0f} GFLOP/s ({roofline.dtype} matmul)")
    ax.axvline(roofline.ridge_intensity, color="grey", ls=":",
               label=f"ridge point {roofline.ridge_intensity:.1f} FLOP/byte")
    markers, cmap = "osD^v<>ph*", plt.get_cmap("tab20")
    for i, (label, x, y) in enumerate(points):
        ax.loglog([x], [y / 1e9], markers[i % len(markers)], ms=8, color=cmap(i % 20), label=label)
    ax.set_xlabel("arithmetic intensity (FLOP/byte)")
    ax.set_ylabel("performance (GFLOP/s)")
    ax.set_title(title)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=7, loc="lower right")
    fig.tight_layout()
    return fig


# =========================================================================== GELU forms
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

    megatron-core's fused bias-GELU (``bias_activation_fusion=True``) computes
    ``x * 0.5 * (1 + tanh(0.79788456 * x * (1 + 0.044715 * x * x)))`` (the tanh
    approximation of Hendrycks & Gimpel 2016), while its unfused path calls ``F.gelu``, the
    exact ``x * 0.5 * (1 + erf(x / sqrt(2)))``. A converted model must name the one training
    computed (transformers: ``"gelu"`` for erf, ``"gelu_new"`` for tanh).

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


# =========================================================================== fused-op candidates
@dataclass
class Candidate:
    """One implementation of a fused op, ready to time.

    Attributes:
        op: one of :data:`FUSED_OPS`.
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

    The first candidate of each op is its eager (unfused) baseline, megatron-core's own
    unfused path where it has one. Inputs are made once (seeded) and reused.

    Args:
        op: one of :data:`FUSED_OPS`.
        shape: see :func:`traffic_model`.
        device: ``"cpu"`` or ``"cuda"``.
        dtype: activation dtype.
        include_compile: add ``torch.compile`` forms (a few seconds of compilation each,
            cached on disk by Inductor afterwards).
        dropout_prob: bias_dropout_add's dropout probability (Megatron-LM default 0.1).
        seed: input seed.

    Returns:
        ``(candidates, skipped)`` with ``skipped = {name: reason}``.

    Raises:
        ValueError: see :func:`traffic_model`; dropout_prob outside [0, 1).
    """
    shape = _check_shape(op, shape)
    device = _device_type(device)
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
        scale = SOFTMAX_SCALE
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


# =========================================================================== fused-op benchmark
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

    For each op the candidates of :func:`fusion_candidates` are timed together with
    :func:`time_calls` (interleaved repeats); speedups are relative to the op's eager baseline
    measured in the same call. Each result is checked against an fp32 reference of the same
    formula (erf or tanh GELU, dropout's kept/dropped values) and the max abs deviation kept.

    Args:
        shapes: ``{op: shape}``, e.g. :func:`op_shapes`.
        device, dtype, include_compile, dropout_prob: see :func:`fusion_candidates`.
        warmup, repeats, min_repeat_s: see :func:`time_calls`.
        progress: show a tqdm bar over the ops.

    Returns:
        :class:`FusionBenchmark`.

    Raises:
        ValueError: an unknown op or bad shape (see :func:`traffic_model`).
    """
    device = _device_type(device)
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


def plot_speedups(bench: FusionBenchmark, title: str = "Measured speedup over eager, per op"):
    """Horizontal bars of :class:`FusionBenchmark` speedups (log scale, IQR whiskers); returns the Figure."""
    import matplotlib.pyplot as plt
    from matplotlib import ticker

    colors = {"unfused": "tab:grey", "unfused_formula": "tab:red", "fused": "tab:blue"}
    rows = bench.rows[::-1]  # first op at the top
    base = {r["op"]: r["median_ms"] for r in bench.rows if r["key"] == "eager"}
    fig, ax = plt.subplots(figsize=(9, 0.45 * len(rows) + 1.5))
    seen: set[str] = set()
    for i, r in enumerate(rows):
        y = r["speedup_vs_eager"]
        b = base.get(r["op"], r["median_ms"])
        err = [[y - b / r["q75_ms"]], [b / r["q25_ms"] - y]]
        label = r["form"] if r["form"] not in seen else None
        seen.add(r["form"])
        ax.barh(i, y, xerr=err, capsize=2, color=colors.get(r["form"], "tab:green"), label=label)
        ax.text(max(y, b / r["q25_ms"]) * 1.06, i, f"{y:.2f}x", va="center", fontsize=7)
    ax.set_yticks(range(len(rows)), [f"{r['op']}: {r['implementation']}" for r in rows], fontsize=7)
    ax.axvline(1.0, color="black", lw=0.8)
    ax.set_ylabel("op: implementation")
    ax.set_xscale("log")
    ax.xaxis.set_major_formatter(ticker.FuncFormatter(lambda v, _: f"{v:g}x"))
    ax.xaxis.set_minor_formatter(ticker.NullFormatter())
    ax.set_xlabel(f"speedup over the op's eager baseline (x, log scale; {bench.device}, {bench.dtype}; "
                  "whiskers: interquartile range)")
    ax.set_title(title)
    ax.legend(title="form", loc="best", fontsize=7)
    fig.tight_layout()
    return fig


# =========================================================================== model parameters
@contextlib.contextmanager
def single_process_model_parallel(seed: int = 1234) -> Iterator[None]:
    """megatron-core model parallelism for this one process (world size 1, TP = PP = 1).

    Initialises ``torch.distributed`` (gloo on CPU, NCCL on CUDA) and ``parallel_state`` only
    when they are not initialised yet, applies :mod:`helpers.cpu_compat` on CPU, seeds the RNG
    tracker (``model_parallel_cuda_manual_seed``), and on exit tears down only what it set up.

    Raises:
        RuntimeError: torch.distributed is already initialised with a world size above 1.
    """
    import torch.distributed as dist
    from megatron.core import parallel_state, tensor_parallel

    from helpers import cpu_compat, launch

    made_group = made_mp = False
    if dist.is_initialized():
        if dist.get_world_size() != 1:
            raise RuntimeError(
                f"torch.distributed already runs with world size {dist.get_world_size()}: "
                "build the model in that job instead of with single_process_model_parallel")
    else:
        backend = "nccl" if torch.cuda.is_available() else "gloo"
        dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{launch.free_port()}",
                                world_size=1, rank=0)
        made_group = True
    try:
        if not parallel_state.model_parallel_is_initialized():
            parallel_state.initialize_model_parallel(1, 1)
            made_mp = True
        cpu_compat.apply()
        tensor_parallel.model_parallel_cuda_manual_seed(seed)
        yield
    finally:
        if made_mp:
            parallel_state.destroy_model_parallel()
        if made_group:
            dist.destroy_process_group()


def model_parameters(cfg: Any, *, device: str | None = None, seed: int = 1234) -> dict[str, torch.Tensor]:
    """The initial parameters of notebook 03's megatron-core ``GPTModel`` for ``cfg``.

    Builds the model (local layer spec) in :func:`single_process_model_parallel` and returns
    detached fp32 copies, tied embeddings counted once.

    Args:
        cfg: a :class:`helpers.model.ModelConfig` (e.g. ``helpers.model.profile("cpu")``).
        device: where the copies live (default: CUDA when available, else CPU).
        seed: the model-parallel seed (Megatron-LM default 1234).

    Returns:
        ``{parameter name: tensor}`` in ``model.named_parameters()`` order.
    """
    from helpers import model as model_lib

    device = _device_type(device)
    with single_process_model_parallel(seed):
        gpt = model_lib.build_model(cfg, layer_spec="local")
        return {n: p.detach().to(device=device, dtype=torch.float32).clone() for n, p in gpt.named_parameters()}


# =========================================================================== AdamW
#: torch / Apex AdamW implementations, slowest-looking first.
ADAMW_IMPLEMENTATIONS = ("for-loop", "foreach", "fused", "apex-fused")

#: The order :func:`adamw_implementation` tries when no measurement is given. Measured in
#: notebook 04 (2 CPU cores, torch 2.13 and 2.14): fused ~4x faster than for-loop and foreach, which
#: are close; on NVIDIA GPUs Apex FusedAdam and torch's fused AdamW are both single
#: multi-tensor kernels (torch's fused is used when Apex is absent).
DEFAULT_ADAMW_PREFERENCE = ("apex-fused", "fused", "foreach", "for-loop")


def adamw_unavailable_reason(implementation: str, device: str | None = None) -> str | None:
    """None when ``implementation`` can run on ``device``, else why not (one sentence).

    Raises:
        ValueError: unknown implementation.
    """
    if implementation not in ADAMW_IMPLEMENTATIONS:
        raise ValueError(f"implementation={implementation!r}: choose one of {ADAMW_IMPLEMENTATIONS}")
    device = _device_type(device)
    if implementation == "apex-fused":
        if device != "cuda":
            return f"needs a CUDA GPU and NVIDIA Apex (this run is on {device})"
        if not environment.nvidia_apex()["FusedAdam"]:
            return ("NVIDIA Apex is not installed (it is not on PyPI: build it from source "
                    "or use the NGC PyTorch container)")
    return None


def make_adamw(params: Iterable[Any], implementation: str = "fused", *, lr: float = 5e-4,
               betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8,
               weight_decay: float = 0.0) -> torch.optim.Optimizer:
    """AdamW (decoupled weight decay) in the named implementation.

    Args:
        params: parameters or parameter groups, as ``torch.optim`` takes them.
        implementation: ``"for-loop"`` (one small kernel per op per tensor), ``"foreach"``
            (torch ``_foreach_*`` ops over lists of tensors), ``"fused"`` (torch's single fused
            kernel per parameter group, CPU and CUDA), ``"apex-fused"`` (Apex ``FusedAdam``
            with ``adam_w_mode=True``, CUDA only).
        lr, betas, eps, weight_decay: AdamW hyper-parameters (the CodeParrot guide: lr 5e-4,
            beta2 0.999, eps 1e-8, weight decay 0.1).

    Returns:
        the optimizer.

    Raises:
        ValueError: unknown or unavailable implementation (the message says why).

    Sources: torch/optim/adamw.py; apex/optimizers/fused_adam.py; Loshchilov & Hutter 2019.
    """
    reason = adamw_unavailable_reason(implementation)
    if reason:
        raise ValueError(f"implementation={implementation!r} is unavailable: {reason}")
    kw = dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay)
    if implementation == "apex-fused":
        from apex.optimizers import FusedAdam

        return FusedAdam(params, adam_w_mode=True, **kw)
    if implementation == "fused":
        return torch.optim.AdamW(params, fused=True, **kw)
    return torch.optim.AdamW(params, foreach=implementation == "foreach", **kw)


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

    Every implementation starts from copies of the same ``params`` and gets the same
    gradients (``cos(k) g1 + sin(k) g2`` at step k, seeded). After ``check_steps`` steps each
    result is compared with the for-loop's, within ``rtol``/``atol`` (torch.testing's float32
    defaults). Timing then steps each copy further, interleaved (:func:`time_calls`).

    Args:
        params: the tensors to optimise, e.g. :func:`model_parameters` (not modified).
        device: where to run (default: CUDA when available).
        implementations: subset of :data:`ADAMW_IMPLEMENTATIONS`; "for-loop" is always added
            (it is the reference).
        check_steps, warmup, repeats: steps before the check; timing warm-up and repeats.
        lr, betas, eps, weight_decay: AdamW hyper-parameters.
        rtol, atol: agreement tolerance.
        seed: gradient seed.

    Returns:
        :class:`AdamWBenchmark`.

    Raises:
        ValueError: no parameters, an unknown implementation, or check_steps < 1.
    """
    device = _device_type(device)
    base = list(params.values()) if isinstance(params, Mapping) else list(params)
    if not base:
        raise ValueError("params is empty: pass the model's parameters, e.g. fusion.model_parameters(cfg)")
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
        _sync(device)
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


# =========================================================================== training-step flags
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
        micro_batch_size, seq_length: the batch timed.
    """

    timings: dict[str, Timing]
    losses: dict[str, float]
    first_step_s: dict[str, float]
    speedup: float
    micro_batch_size: int
    seq_length: int

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

    Two models are built from the same seed (same weights), one with every flag of
    :data:`FUSION_FLAGS` False and one with all True, and stepped interleaved on the same
    random batch. The losses differ only by the GELU form (erf vs tanh).

    Args:
        cfg: a :class:`helpers.model.ModelConfig`; its fusion flags are overridden.
        micro_batch_size: sequences per step.
        warmup, repeats: see :func:`time_calls` (the first flags-on step compiles).
        device: default CUDA when available.
        seed: model-parallel seed.

    Returns:
        :class:`FlagsBenchmark`.

    Raises:
        ValueError: micro_batch_size below 1.
    """
    from dataclasses import replace

    from helpers import model as model_lib

    device = _device_type(device)
    if micro_batch_size < 1:
        raise ValueError(f"micro_batch_size={micro_batch_size} must be >= 1")
    g = torch.Generator(device="cpu").manual_seed(seed)
    tokens = torch.randint(0, cfg.vocab_size, (micro_batch_size, cfg.seq_length), generator=g).to(device)
    position_ids = torch.arange(cfg.seq_length, device=device).expand(micro_batch_size, -1)
    settings = {"flags off": False, "flags on": True}
    models, losses, first = {}, {}, {}
    with single_process_model_parallel(seed):
        for name, on in settings.items():
            from megatron.core import tensor_parallel

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
            _sync(device)
            t0 = time.perf_counter()
            losses[name] = fn()
            first[name] = time.perf_counter() - t0
        timings = time_calls(fns, device=device, warmup=warmup, repeats=repeats, min_repeat_s=0.0)
    speedup = timings["flags off"].median_s / timings["flags on"].median_s
    return FlagsBenchmark(timings, losses, first, speedup, micro_batch_size, cfg.seq_length)


# =========================================================================== recommendations
def _measured(run_dir: str | os.PathLike | None, device: str) -> dict[str, Any]:
    if run_dir is None:
        return {}
    summary = results.load_summary(run_dir).get(NOTEBOOK, {})
    return summary if summary.get("device") == device else {}


def adamw_implementation(device: str | None = None, run_dir: str | os.PathLike | None = None) -> str:
    """The AdamW implementation training should use on ``device``.

    Uses notebook 04's measurement (``summary.json``: ``adamw_fastest``) when ``run_dir`` has
    one for the same device type; otherwise the first available of
    :data:`DEFAULT_ADAMW_PREFERENCE` (Apex FusedAdam on a GPU with Apex, else torch's fused).

    Returns:
        one of :data:`ADAMW_IMPLEMENTATIONS`.
    """
    device = _device_type(device)
    measured = _measured(run_dir, device).get("adamw_fastest")
    if measured in ADAMW_IMPLEMENTATIONS and adamw_unavailable_reason(measured, device) is None:
        return measured
    return next(i for i in DEFAULT_ADAMW_PREFERENCE if adamw_unavailable_reason(i, device) is None)


def fastest_adamw(params: Iterable[Any], device: str | None = None, *, lr: float = 5e-4,
                  betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8, weight_decay: float = 0.0,
                  run_dir: str | os.PathLike | None = None) -> torch.optim.Optimizer:
    """AdamW in the fastest implementation for ``device`` (:func:`adamw_implementation`).

    Args:
        params: parameters or parameter groups (e.g. Megatron's split: no weight decay on
            biases and LayerNorm weights).
        device: where the parameters live (default: CUDA when available).
        lr, betas, eps, weight_decay: AdamW hyper-parameters.
        run_dir: a run folder whose notebook-04 measurement to follow (optional).

    Returns:
        the optimizer.
    """
    impl = adamw_implementation(device, run_dir)
    return make_adamw(params, impl, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay)


def recommended_fusion_flags(device: str | None = None,
                             run_dir: str | os.PathLike | None = None) -> dict[str, bool]:
    """megatron-core fusion flags training should set on ``device``.

    CUDA: all of :data:`FUSION_FLAGS` True (Megatron-LM's defaults in ``pretrain_gpt.py``; on
    a GPU each fused kernel saves memory passes). CPU: from notebook 04's measured training
    step (``fusion_flags_clearly_faster`` in ``summary.json``, see
    :attr:`FlagsBenchmark.flags_clearly_faster`) when ``run_dir`` has one for a CPU; otherwise
    False, because on CPU the softmax kernel does not exist, the step time measured the same
    within noise, every new process pays the compilation, and ``bias_activation_fusion``
    switches GELU from erf to tanh.

    Returns:
        ``{flag: bool}`` for each of :data:`FUSION_FLAGS`, to pass to ``ModelConfig``.
    """
    device = _device_type(device)
    if device == "cuda":
        return {f: True for f in FUSION_FLAGS}
    on = _measured(run_dir, device).get("fusion_flags_clearly_faster") is True
    return {f: on for f in FUSION_FLAGS}


# =========================================================================== core attention (notebook 04, section 9)
@dataclass
class AttentionBenchmark:
    """What :func:`benchmark_core_attention` measured.

    Attributes:
        shape: ``(seq, micro_batch, heads, head_dim)`` of query, key and value.
        timings: ``{"unfused" | "sdpa": helpers.fusion.Timing}``, seconds per forward + backward.
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
        cfg: a :class:`helpers.model.ModelConfig` (heads, width, sequence length).
        micro_batch_size: sequences per call.
        device, dtype: where and in what precision (notebook 04 uses bf16 on CUDA, fp32 on a
            CPU, where bf16 runs but is slow).
        warmup, repeats: see :func:`time_calls` (interleaved repeats).
        seed: of the random query, key, value and output gradient.

    Returns:
        :class:`AttentionBenchmark`.

    Raises:
        ValueError: ``micro_batch_size < 1``; see also :func:`time_calls` and
            :func:`helpers.model.transformer_config`.
    """
    from megatron.core.transformer.enums import AttnMaskType

    from helpers import model
    from helpers.attention import MODULES

    if micro_batch_size < 1:
        raise ValueError(f"micro_batch_size={micro_batch_size}: pass at least 1 sequence per call")

    heads = cfg.num_attention_heads
    shape = (cfg.seq_length, micro_batch_size, heads, cfg.hidden_size // heads)
    with single_process_model_parallel(seed):
        config = model.transformer_config(cfg, precision="fp32")
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

        results = {name: step(name) for name in mods}
        diff = max((a.float() - b.float()).abs().max().item() for a, b in zip(results["unfused"], results["sdpa"]))
        timings = time_calls({name: (lambda n=name: step(n)) for name in mods}, device=device,
                                    warmup=warmup, repeats=repeats)
    b, s = micro_batch_size, cfg.seq_length
    return AttentionBenchmark(shape=shape, timings=timings, max_abs_diff=diff,
                              score_matrix_bytes=b * heads * s * s * torch.tensor([], dtype=dtype).element_size())
