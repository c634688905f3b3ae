"""Notebook 04, sections 1, 2 and 5: what fusion saves in memory traffic, and this machine's roofline.

Section 1: bytes read and written, FLOPs and arithmetic intensity of the unfused and fused forms of
bias+GELU, bias+dropout+residual-add, scale+mask+softmax and LayerNorm at one micro-batch's shapes.
Section 2: this machine's roofline from a measured copy bandwidth and matrix-multiply FLOP/s.
Section 5: the measured kernels on it.

Sources: megatron-core 0.19.2 ``megatron/core/fusions/fused_bias_gelu.py``,
``fused_bias_dropout.py``, ``fused_softmax.py``, ``fused_layer_norm.py``; Williams, Waterman,
Patterson 2009, "Roofline: an insightful visual performance model" (CACM 52(4)); McCalpin,
STREAM benchmark ("Copy").
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Mapping, Sequence

import torch

from helpers.demos.timing import Timing, device_type, time_calls

#: The element-wise chains notebook 04 models (here) and measures (:mod:`helpers.demos.fused_ops`).
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
_DROPOUT_MASK_BYTES = 1

#: Bytes per element of each floating dtype the benchmarks use.
DTYPE_BYTES = {torch.float32: 4, torch.bfloat16: 2, torch.float16: 2}


# ------------------------------------------------------------------ traffic model (section 1)
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


def check_op_shape(op: str, shape: Sequence[int]) -> tuple[int, ...]:
    """``shape`` as a tuple of ints after checking it suits ``op`` (see :func:`traffic_model`).

    Raises:
        ValueError: unknown op, or a shape of the wrong rank or with a size below 1.
    """
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

    Unfused: the kernels megatron-core 0.19.2 launches with its fusion flags off, each intermediate going
    to memory and back; fused: one kernel reading each input and writing each output once. Dropout is
    CUDA's one ``native_dropout`` kernel (1-byte bool mask); torch's eager CPU dropout moves more.

    Args:
        shape: bias_gelu, bias_dropout_add, layernorm: ``[tokens, width]``; scale_mask_softmax: ``[batch,
            heads, sq, sk]`` (causal mask ``[sq, sk]`` of bools).
        dtype_bytes: bytes per activation element (4 fp32, 2 bf16/fp16).

    Returns:
        ``{form: FusionForm}``: ``"unfused"`` and ``"fused"``, plus ``"unfused_formula"`` for bias_gelu
        (megatron's tanh formula op by op in eager mode: 10 kernels).

    Raises:
        ValueError: unknown op, or a shape of the wrong rank or with a size below 1.

    Sources: megatron/core/transformer/mlp.py, megatron/core/fusions/fused_bias_gelu.py,
    fused_bias_dropout.py (``_bias_dropout_add_func``), fused_softmax.py (``forward_torch_softmax``,
    ``ScaledUpperTriangMaskedSoftmax``), fused_layer_norm.py.
    """
    shape = check_op_shape(op, shape)
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
        mask = _DROPOUT_MASK_BYTES * n
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


# ------------------------------------------------------------------ roofline (sections 2 and 5)
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
    """Memory bandwidth from ``dst.copy_(src)`` of a large fp32 buffer (STREAM's "copy"): 2 x size / time.

    Pick ``size_mib`` (each of source and destination) well above the last-level cache, or the copy
    measures the cache instead of memory.

    Returns:
        ``(bytes_per_second, timing)`` from the median copy time.

    Raises:
        ValueError: size_mib below 1.

    Source: McCalpin, STREAM benchmark ("Copy" kernel).
    """
    if int(size_mib) < 1:
        raise ValueError(f"size_mib={size_mib} must be >= 1")
    device = device_type(device)
    numel = int(size_mib) * 2**20 // 4
    src = torch.ones(numel, dtype=torch.float32, device=device)
    dst = torch.empty_like(src)
    timing = time_calls({"copy": lambda: dst.copy_(src)}, device=device, warmup=warmup,
                        repeats=repeats, min_repeat_s=0.0)["copy"]
    return 2 * numel * 4 / timing.median_s, timing


def _measure_matmul_flops(n: int = 1024, *, device: str = "cpu", dtype: torch.dtype = torch.float32,
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
    device = device_type(device)
    g = torch.Generator(device="cpu").manual_seed(0)
    a = torch.randn(n, n, generator=g).to(device=device, dtype=dtype)
    b = torch.randn(n, n, generator=g).to(device=device, dtype=dtype)
    out = torch.empty(n, n, device=device, dtype=dtype)
    timing = time_calls({"matmul": lambda: torch.mm(a, b, out=out)}, device=device, warmup=warmup,
                        repeats=repeats, min_repeat_s=0.0)["matmul"]
    return 2 * n**3 / timing.median_s, timing


def measure_roofline(*, device: str = "cpu", copy_mib: int = 256, matmul_n: int = 1024,
                     dtype: torch.dtype = torch.float32, repeats: int = 7) -> Roofline:
    """Measure this machine's roofline: the bandwidth of a ``copy_mib`` MiB fp32 copy
    (:func:`measure_memory_bandwidth`) and the FLOP/s of a ``[matmul_n, matmul_n]`` matmul in ``dtype``
    (``2 n^3`` FLOPs per product), each the median of ``repeats`` timed repeats.

    Raises:
        ValueError: ``copy_mib`` or ``matmul_n`` below 1, or an unusable device.
    """
    bw, copy = measure_memory_bandwidth(copy_mib, device=device, repeats=repeats)
    peak, mm = _measure_matmul_flops(matmul_n, device=device, dtype=dtype, repeats=repeats)
    return Roofline(bw, peak, device_type(device), str(dtype).replace("torch.", ""), copy, mm)


def plot_roofline(roofline: Roofline, points: Sequence[tuple] = (),
                  title: str = "Roofline of this machine"):
    """Log-log roofline with measured points, every point identifiable from the legends beside the plot.

    Args:
        points: ``(label, intensity FLOP/byte, achieved FLOP/s)`` per kernel (one legend entry each), or
            ``(group, kind, intensity, achieved FLOP/s)`` (colour by group, marker by kind: two legends,
            :func:`helpers.demos.fused_ops.roofline_points`).

    Returns:
        a matplotlib ``Figure``.

    Raises:
        ValueError: points mixing 3- and 4-element tuples.
    """
    import matplotlib.pyplot as plt
    import numpy as np
    from matplotlib.lines import Line2D

    sizes = {len(p) for p in points}
    if sizes - {3, 4} or len(sizes) > 1:
        raise ValueError(f"points: pass all (label, x, y) or all (group, kind, x, y) tuples, not sizes {sorted(sizes)}")
    grouped = sizes == {4}
    xs_pts = [p[-2] for p in points]
    lo = min(xs_pts + [roofline.ridge_intensity / 100]) / 2
    hi = max(xs_pts + [roofline.ridge_intensity * 10]) * 2
    xs = np.logspace(math.log10(lo), math.log10(hi), 200)
    fig, ax = plt.subplots(figsize=(11, 5.5))
    roof, = ax.loglog(xs, [roofline.attainable_flops(x) / 1e9 for x in xs], "k-", lw=2,
                      label=f"roof: {roofline.bandwidth_bytes_per_s / 1e9:.1f} GB/s, "
                            f"{roofline.peak_flops_per_s / 1e9:.0f} GFLOP/s ({roofline.dtype} matmul)")
    ridge = ax.axvline(roofline.ridge_intensity, color="grey", ls=":",
                       label=f"ridge point {roofline.ridge_intensity:.1f} FLOP/byte")
    markers, cmap = "osD^Xv<>ph", plt.get_cmap("tab10")
    if grouped:
        groups = list(dict.fromkeys(p[0] for p in points))
        kinds = list(dict.fromkeys(p[1] for p in points))
        for (group, kind, _, y), x in zip(points, spread_intensities(xs_pts)):
            ax.loglog([x], [y / 1e9], markers[kinds.index(kind) % len(markers)], ms=9, mfc="none", mew=2,
                      color=cmap(groups.index(group) % 10))
        first = ax.legend(handles=[roof, ridge], loc="lower right", fontsize=8)
        ax.add_artist(first)
        by_group = [Line2D([], [], ls="none", marker="s", ms=9, color=cmap(i % 10), label=g)
                    for i, g in enumerate(groups)]
        by_kind = [Line2D([], [], ls="none", marker=markers[i % len(markers)], ms=9, mfc="none", mew=2,
                          color="black", label=k) for i, k in enumerate(kinds)]
        colour_legend = ax.legend(handles=by_group, title="colour: operation", loc="upper left",
                                  bbox_to_anchor=(1.02, 1.0), fontsize=8, title_fontsize=8)
        ax.add_artist(colour_legend)
        ax.legend(handles=by_kind, title="marker: implementation", loc="upper left",
                  bbox_to_anchor=(1.02, 0.64), fontsize=8, title_fontsize=8)
    else:
        for i, (label, x, y) in enumerate(points):
            ax.loglog([x], [y / 1e9], markers[i % len(markers)], ms=8, color=plt.get_cmap("tab20")(i % 20),
                      label=label)
        ax.legend(loc="upper left", bbox_to_anchor=(1.02, 1.0), fontsize=8)
    ax.set_xlabel("arithmetic intensity (FLOP/byte)" + (
        f"\npoints of equal intensity spread sideways by factors of {SPREAD_FACTOR:g}, so that none hides another"
        if grouped and spread_intensities(xs_pts) != xs_pts else ""))
    ax.set_ylabel("performance (GFLOP/s)")
    ax.set_title(title)
    ax.grid(True, which="both", alpha=0.3)
    fig.tight_layout()
    return fig


#: Factor between neighbouring points of equal intensity in :func:`plot_roofline` (log x axis).
SPREAD_FACTOR = 1.15


def spread_intensities(xs: Sequence[float]) -> list[float]:
    """``xs`` with the points of equal value spread around it by powers of :data:`SPREAD_FACTOR`.

    Forms of one op that share a traffic model (``torch.compile`` and a native kernel, say) have
    the same intensity and, often, similar FLOP/s: on a log axis their markers would cover each
    other. The ``n`` points of one value ``x`` are drawn at ``x * SPREAD_FACTOR ** (j - (n - 1) / 2)``,
    in their order; single points stay where they are.
    """
    out, seen = list(xs), {}
    for i, x in enumerate(xs):
        seen.setdefault(x, []).append(i)
    for x, idx in seen.items():
        for j, i in enumerate(idx):
            out[i] = x * SPREAD_FACTOR ** (j - (len(idx) - 1) / 2) if len(idx) > 1 else x
    return out
