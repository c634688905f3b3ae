"""helpers.learn.attention (the SDPA core attention) against megatron-core's unfused one, and notebook 04's benchmark of both (helpers.demos.model_fusions)."""

from __future__ import annotations

import pytest

from helpers.learn import attention, model
from helpers.demos import model_fusions


def test_benchmark_core_attention_measures_both_and_they_agree():
    cfg = model.ModelConfig(num_layers=1, hidden_size=64, num_attention_heads=4, seq_length=32,
                            max_position_embeddings=32, vocab_size=300)
    bench = model_fusions.benchmark_core_attention(cfg, 2, warmup=1, repeats=3)
    assert bench.shape == (32, 2, 4, 16)
    assert set(bench.timings) == {"unfused", "sdpa"}
    assert all(t.median_s > 0 and len(t.times_s) == 3 for t in bench.timings.values())
    assert 0 <= bench.max_abs_diff < 1e-5
    assert bench.score_matrix_bytes == 2 * 4 * 32 * 32 * 4
    assert bench.speedup == bench.timings["unfused"].median_s / bench.timings["sdpa"].median_s
    with pytest.raises(ValueError, match="micro_batch_size=0"):
        model_fusions.benchmark_core_attention(cfg, 0)


def test_every_core_attention_name_has_a_module():
    """ModelConfig accepts exactly the names the benchmark (and build_model) can build."""
    assert set(attention.MODULES) == set(model.CORE_ATTENTIONS)
    assert attention.MODULES["unfused"] is attention.DotProductAttention
    assert issubclass(attention.MODULES["sdpa"], attention.DotProductAttention)
