"""helpers.demos for notebook 04: traffic model and roofline, timing, fused-op candidates, AdamW,
the fusion flags on a training step, and the recommendations (core attention: tests/test_attention.py)."""

from __future__ import annotations

import math
import time

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from helpers.learn import model, optimizer
from helpers.support import results
from helpers.demos import adamw, fused_ops, model_fusions, roofline, timing

TINY = model.profile("cpu", num_layers=1, hidden_size=32, num_attention_heads=2, seq_length=16,
                     max_position_embeddings=16, vocab_size=256)


class _AtenLog(TorchDispatchMode):
    """Records the aten ops (kernels) a call dispatches."""

    def __init__(self):
        super().__init__()
        self.ops: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops.append(str(func.overloadpacket).replace("aten.", ""))
        return func(*args, **(kwargs or {}))


def _aten_ops(fn) -> list[str]:
    with torch.no_grad(), _AtenLog() as log:
        fn()
    return log.ops


# ------------------------------------------------------------------------------ traffic model
def test_traffic_model_bytes_by_hand():
    t, h, d = 4, 8, 4
    n = t * h
    g = roofline.traffic_model("bias_gelu", (t, h), d)
    assert g["fused"].bytes_read == d * (n + h) and g["fused"].bytes_written == d * n
    assert g["unfused"].bytes_read == d * (2 * n + h) and g["unfused"].bytes_written == d * 2 * n
    assert g["unfused_formula"].num_kernels == 10
    assert g["unfused_formula"].bytes_read == d * (13 * n + h) and g["unfused_formula"].bytes_written == d * 10 * n
    bda = roofline.traffic_model("bias_dropout_add", (t, h), d)
    assert bda["fused"].bytes_read == d * (2 * n + h) and bda["fused"].bytes_written == d * n + n
    assert bda["unfused"].bytes_moved == d * (4 * n + h) + d * 3 * n + n
    sm = roofline.traffic_model("scale_mask_softmax", (2, 3, 5, 5), d)
    m = 2 * 3 * 5 * 5
    assert sm["fused"].bytes_moved == 2 * d * m
    assert sm["unfused"].bytes_moved == 6 * d * m + 25
    ln = roofline.traffic_model("layernorm", (t, h), d)
    assert ln["fused"].bytes_moved == d * (2 * n + 2 * h)
    assert ln["unfused"].num_kernels == 9


def test_flops_are_the_same_for_every_form_and_intensity_is_flops_per_byte():
    for op, shape in roofline.op_shapes(model.profile("cpu"), 8).items():
        forms = roofline.traffic_model(op, shape, 2)
        assert len({f.flops for f in forms.values()}) == 1
        assert forms["fused"].flops == roofline.FLOPS_PER_ELEMENT[op] * math.prod(shape)
        for f in forms.values():
            assert f.arithmetic_intensity == pytest.approx(f.flops / f.bytes_moved)
            assert f.bytes_moved >= forms["fused"].bytes_moved


def test_fused_bias_gelu_halves_traffic_for_wide_tensors():
    forms = roofline.traffic_model("bias_gelu", (8192, 3072), 2)
    assert forms["unfused"].bytes_moved / forms["fused"].bytes_moved == pytest.approx(2.0, abs=1e-3)


def test_model_kernel_counts_match_the_kernels_the_code_dispatches():
    shapes = roofline.op_shapes(TINY, 2)
    counts = {}
    for op, shape in shapes.items():
        cands, _ = fused_ops.fusion_candidates(op, shape, include_compile=False)
        for c in cands:
            if c.form.startswith("unfused"):
                counts[(op, c.form)] = _aten_ops(c.fn)
    for (op, form), ops in counts.items():
        expected = roofline.traffic_model(op, shapes[op])[form].num_kernels
        if op == "bias_dropout_add":  # CPU eager dropout decomposes (bernoulli_, div_, mul): documented
            assert "bernoulli_" in ops and len(ops) >= expected
        else:
            assert len(ops) == expected, (op, form, ops)


def test_op_shapes_follow_the_model_config():
    cfg = model.profile("cpu")
    s = roofline.op_shapes(cfg, 8)
    assert s["bias_gelu"] == (8 * cfg.seq_length, 4 * cfg.hidden_size)
    assert s["scale_mask_softmax"] == (8, cfg.num_attention_heads, cfg.seq_length, cfg.seq_length)
    with pytest.raises(ValueError, match="micro_batch_size"):
        roofline.op_shapes(cfg, 0)


@pytest.mark.parametrize("op, shape, match", [
    ("gelu", (2, 2), "unknown"), ("bias_gelu", (2, 2, 2), "2 positive sizes"),
    ("scale_mask_softmax", (2, 2), "4 positive sizes"), ("layernorm", (0, 4), "positive"),
])
def test_traffic_model_rejects_bad_input(op, shape, match):
    with pytest.raises(ValueError, match=match):
        roofline.traffic_model(op, shape)


def test_traffic_table_and_its_markdown_table():
    rows = roofline.traffic_table({"layernorm": (4, 8)})
    assert [r["form"] for r in rows] == ["unfused", "fused"]
    assert rows[1]["traffic_vs_fused"] == 1.0 and rows[0]["traffic_vs_fused"] > 1
    text = results.markdown_table(rows, ["op", "form", "kernels"])
    assert text.splitlines()[0] == "| op | form | kernels |" and "| layernorm | unfused | 9 |" in text
    with pytest.raises(ValueError):
        results.markdown_table([])


# ------------------------------------------------------------------------------ timing, roofline
def test_timing_statistics():
    t = timing.Timing("x", (5.0, 1.0, 3.0, 2.0, 4.0), 1, "cpu", "time.perf_counter")
    assert (t.median_s, t.q25_s, t.q75_s) == (3.0, 2.0, 4.0)
    assert t.spread == pytest.approx(2 / 3)


def test_time_calls_measures_and_interleaves():
    order = []
    fns = {"slow": lambda: (order.append("slow"), time.sleep(0.004)),
           "fast": lambda: order.append("fast")}
    t = timing.time_calls(fns, warmup=1, repeats=3, min_repeat_s=0.0)
    assert 0.004 <= t["slow"].median_s < 0.05
    assert t["fast"].median_s < t["slow"].median_s
    assert order[-6:] == ["slow", "fast"] * 3  # round robin after warm-up
    assert t["slow"].clock == "time.perf_counter" and len(t["slow"].times_s) == 3
    with pytest.raises(ValueError, match="repeats"):
        timing.time_calls(fns, repeats=2)
    with pytest.raises(ValueError, match="empty"):
        timing.time_calls({})


def test_roofline_model():
    r = roofline.Roofline(bandwidth_bytes_per_s=10e9, peak_flops_per_s=100e9)
    assert r.ridge_intensity == 10
    assert r.attainable_flops(1.0) == 10e9 and r.attainable_flops(100.0) == 100e9
    forms = roofline.traffic_model("bias_gelu", (1024, 1024))
    assert r.time_lower_bound_s(forms["fused"]) == pytest.approx(forms["fused"].bytes_moved / 10e9)
    # memory-bound forms: the predicted speedup is the traffic ratio
    assert r.predicted_speedup(forms["unfused_formula"], forms["fused"]) == pytest.approx(
        forms["unfused_formula"].bytes_moved / forms["fused"].bytes_moved)
    with pytest.raises(ValueError):
        roofline.Roofline(0.0, 1.0)


def test_measured_roofline_is_plausible_and_plots():
    r = roofline.measure_roofline(copy_mib=16, matmul_n=256, repeats=3)
    assert 1e8 < r.bandwidth_bytes_per_s < 1e13
    assert 1e8 < r.peak_flops_per_s < 1e15
    assert r.copy is not None and r.copy.median_s > 0
    fig = roofline.plot_roofline(r, [("point", 0.5, 1e9)])
    ax = fig.axes[0]
    assert ax.get_title() and "FLOP/byte" in ax.get_xlabel() and "GFLOP/s" in ax.get_ylabel()
    assert len(ax.get_legend().get_texts()) == 3
    with pytest.raises(ValueError):
        roofline.measure_memory_bandwidth(0)


# ------------------------------------------------------------------------------ GELU, candidates
def test_megatron_fuser_is_torch_compile_in_this_environment():
    assert fused_ops.megatron_jit_fuser() == "torch.compile"


def test_fused_gelu_is_the_tanh_approximation():
    x = torch.linspace(-6, 6, 10001)
    g = fused_ops.gelu_forms(x)
    tanh_vs_erf = (g["megatron_tanh"] - g["erf"]).abs().max().item()
    assert 1e-4 < tanh_vs_erf < 1e-3
    assert (g["megatron_tanh"] - g["torch_tanh"]).abs().max().item() < 1e-6
    fig = fused_ops.plot_gelu_difference(x, g)
    assert fig.axes[0].get_legend() is not None


def test_candidates_compute_what_they_claim_on_cpu():
    shapes = roofline.op_shapes(TINY, 2)
    for op, shape in shapes.items():
        cands, skipped = fused_ops.fusion_candidates(op, shape, include_compile=False)
        assert cands[0].form == "unfused" and cands[0].key == "eager"
        for c in cands:
            assert c.check() < 1e-5, (op, c.name)
        if op == "layernorm":
            assert "needs a CUDA GPU" in skipped["Apex FusedLayerNorm"]
        if op == "scale_mask_softmax":
            assert "is_kernel_available() is False" in skipped["megatron fused softmax CUDA kernel"]


def test_dropout_drops_about_p_and_keeps_the_rest_exactly():
    p = 0.25
    torch.manual_seed(0)
    x, b, r = torch.randn(256, 64), torch.randn(64), torch.randn(256, 64)
    from megatron.core.fusions.fused_bias_dropout import get_bias_dropout_add

    for fused in (False, True):
        out = get_bias_dropout_add(True, fused)((x, b), r, p)
        dropped = out == r
        assert abs(dropped.float().mean().item() - p) < 0.03, fused
        kept = r + (x + b) / (1 - p)
        assert (out - kept)[~dropped].abs().max().item() < 1e-5
    with pytest.raises(ValueError, match="dropout_prob"):
        fused_ops.fusion_candidates("bias_dropout_add", (4, 4), dropout_prob=1.0)


def test_benchmark_fusions_rows_are_consistent():
    shapes = {"layernorm": (64, 32), "bias_gelu": (64, 32)}
    bench = fused_ops.benchmark_fusions(shapes, include_compile=False, warmup=1, repeats=3,
                                     min_repeat_s=0.0, progress=False)
    ln = [r for r in bench.rows if r["op"] == "layernorm"]
    assert ln[0]["speedup_vs_eager"] == 1.0
    for r in bench.rows:
        form = roofline.traffic_model(r["op"], shapes[r["op"]])[r["form"]]
        assert r["achieved_GB_s"] == pytest.approx(form.bytes_moved / (r["median_ms"] / 1e3) / 1e9)
        assert r["q25_ms"] <= r["median_ms"] <= r["q75_ms"]
        assert r["max_abs_diff"] < 1e-5
    assert set(bench.speedups()) == {"layernorm_torch_native", "bias_gelu_eager_formula",
                                     "bias_gelu_megatron_fused"}
    assert bench.best("layernorm")["median_ms"] == min(r["median_ms"] for r in ln)
    fig = fused_ops.plot_speedups(bench)  # a bar per non-baseline row; each eager baseline is a marker at 1x
    baselines = sum(r["key"] == "eager" for r in bench.rows)
    assert "speedup" in fig.axes[0].get_xlabel() and len(fig.axes[0].patches) == len(bench.rows) - baselines


# ------------------------------------------------------------------------------ AdamW
def _adamw_by_hand(p, grads, lr, betas, eps, wd):
    """AdamW (Loshchilov & Hutter 2019, algorithm 2) in float64."""
    p = p.double().clone()
    m = torch.zeros_like(p)
    v = torch.zeros_like(p)
    for k, g in enumerate(grads, 1):
        g = g.double()
        p = p * (1 - lr * wd)
        m = betas[0] * m + (1 - betas[0]) * g
        v = betas[1] * v + (1 - betas[1]) * g * g
        mhat, vhat = m / (1 - betas[0] ** k), v / (1 - betas[1] ** k)
        p = p - lr * mhat / (vhat.sqrt() + eps)
    return p


@pytest.mark.parametrize("impl", ["for-loop", "foreach", "fused"])
def test_each_adamw_matches_the_paper(impl):
    torch.manual_seed(0)
    p0 = torch.randn(50, 20)
    grads = [torch.randn(50, 20) for _ in range(5)]
    p = p0.clone().requires_grad_(True)
    opt = optimizer.make_adamw([p], impl, lr=1e-2, weight_decay=0.1)
    for g in grads:
        p.grad = g.clone()
        opt.step()
    expected = _adamw_by_hand(p0, grads, 1e-2, (0.9, 0.999), 1e-8, 0.1)
    assert (p.detach().double() - expected).abs().max().item() < 1e-5
    assert (p.detach() - p0).abs().max().item() > 1e-3  # it moved


def test_make_adamw_flags_and_errors():
    p = [torch.zeros(3, requires_grad=True)]
    assert optimizer.make_adamw(p, "fused").defaults["fused"] is True
    assert optimizer.make_adamw(p, "foreach").defaults["foreach"] is True
    assert optimizer.make_adamw(p, "for-loop").defaults["foreach"] is False
    with pytest.raises(ValueError, match="choose one of"):
        optimizer.make_adamw(p, "lamb")
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="needs a CUDA GPU"):
            optimizer.make_adamw(p, "apex-fused")


def test_benchmark_adamw_on_model_parameters_agrees_and_leaves_no_process_group():
    import torch.distributed as dist

    params = adamw.model_parameters(TINY)
    assert sum(p.numel() for p in params.values()) == model.count_parameters(TINY)
    assert "decoder.layers.0.mlp.linear_fc1.weight" in params
    assert not dist.is_initialized()
    before = {k: v.clone() for k, v in params.items()}
    bench = adamw.benchmark_adamw(params, check_steps=3, warmup=1, repeats=3)
    assert all(torch.equal(before[k], params[k]) for k in params)  # inputs untouched
    assert list(bench.timings) == ["for-loop", "foreach", "fused"]
    assert all(bench.agrees.values()) and max(bench.max_abs_diff.values()) < 1e-5
    assert bench.max_abs_diff["for-loop"] == 0.0
    assert bench.speedups()["for-loop"] == 1.0 and bench.fastest in bench.timings
    if not torch.cuda.is_available():
        assert "needs a CUDA GPU" in bench.skipped["apex-fused"]
    assert bench.rows()[0]["implementation"] == "for-loop"
    assert adamw.plot_adamw(bench).axes[0].get_ylabel() == "time per step (ms)"
    with pytest.raises(ValueError, match="empty"):
        adamw.benchmark_adamw([])


# ------------------------------------------------------------------------------ training step, recommendations
def test_fusion_flags_change_only_the_gelu():
    fb = model_fusions.benchmark_fusion_flags(TINY, micro_batch_size=1, warmup=1, repeats=3)
    off, on = fb.losses["flags off"], fb.losses["flags on"]
    assert math.isfinite(off) and abs(off - on) < 1e-3
    assert fb.speedup == pytest.approx(fb.timings["flags off"].median_s / fb.timings["flags on"].median_s)
    assert fb.first_step_s["flags on"] > 0
    ratios = [a / b for a, b in zip(fb.timings["flags off"].times_s, fb.timings["flags on"].times_s)]
    assert fb.paired_speedups == pytest.approx(ratios)
    clear = sorted(ratios)[1] >= 1.05 and all(r > 1.0 for r in ratios)  # 3 rounds: median, and 3 of 3 wins
    assert fb.flags_clearly_faster == clear


def test_recommendations_default_and_follow_the_measurement(tmp_path):
    if torch.cuda.is_available():
        pytest.skip("the CPU defaults are tested on CPU")
    assert model_fusions.adamw_implementation("cpu") == "fused"
    assert model_fusions.recommended_fusion_flags("cpu") == {f: False for f in model_fusions.FUSION_FLAGS}
    assert model_fusions.adamw_implementation("cpu", tmp_path) == "fused"  # no summary yet
    results.record(tmp_path, model_fusions.NOTEBOOK, "device", "cpu")
    results.record(tmp_path, model_fusions.NOTEBOOK, "adamw_fastest", "foreach")
    results.record(tmp_path, model_fusions.NOTEBOOK, "fusion_flags_clearly_faster", True)
    assert model_fusions.adamw_implementation("cpu", tmp_path) == "foreach"
    assert model_fusions.recommended_fusion_flags("cpu", tmp_path) == {f: True for f in model_fusions.FUSION_FLAGS}
    results.record(tmp_path, model_fusions.NOTEBOOK, "adamw_fastest", "apex-fused")  # unavailable here
    assert model_fusions.adamw_implementation("cpu", tmp_path) == "fused"
    results.record(tmp_path, model_fusions.NOTEBOOK, "device", "cuda")  # measured elsewhere: ignored
    assert model_fusions.recommended_fusion_flags("cpu", tmp_path) == {f: False for f in model_fusions.FUSION_FLAGS}
    opt = optimizer.make_adamw([torch.zeros(2, requires_grad=True)], model_fusions.adamw_implementation("cpu"), lr=1e-3)
    assert isinstance(opt, torch.optim.AdamW) and opt.defaults["fused"] is True and opt.implementation == "fused"


def test_unusable_device_is_a_clear_error():
    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    with pytest.raises(ValueError, match="no CUDA GPU"):
        timing.time_calls({"a": lambda: None}, device="cuda")


@pytest.mark.gpu
def test_cuda_timing_uses_events_and_fused_adamw_agrees():
    t = timing.time_calls({"mm": lambda: torch.ones(512, 512, device="cuda") @ torch.ones(512, 512, device="cuda")},
                          device="cuda", repeats=3)
    assert t["mm"].clock == "torch.cuda.Event" and t["mm"].median_s > 0
    params = [torch.randn(256, 256, device="cuda") for _ in range(4)]
    bench = adamw.benchmark_adamw(params, device="cuda", check_steps=3, warmup=1, repeats=3)
    assert all(bench.agrees.values())
