"""helpers.learn.model: GPT-2 architecture on megatron-core's GPTModel, padding, sizes, FLOPs, GELU."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from helpers.learn import model
from helpers.demos import generation


@pytest.fixture(scope="module")
def dist1():
    from helpers.learn import distributed

    info = distributed.initialize_distributed(1, 1, seed=1234)
    yield info
    distributed.destroy_distributed()


TINY = dict(num_layers=2, hidden_size=64, num_attention_heads=4, seq_length=32, max_position_embeddings=48,
            vocab_size=500)


def test_build_model_needs_parallel_state():
    from megatron.core import parallel_state

    if parallel_state.model_parallel_is_initialized():
        pytest.skip("model parallelism already initialised in this process")
    with pytest.raises(RuntimeError, match="initialize_distributed"):
        model.build_model(model.ModelConfig(**TINY))


@pytest.mark.parametrize("vocab, divisor, tp, expected", [
    (50257, 128, 1, 50304),  # GPT-2's vocabulary, as Megatron pads it
    (8192, 128, 1, 8192),
    (8192, 128, 3, 8448),
    (1000, 128, 2, 1024),
    (1, 128, 1, 128),
])
def test_padded_vocab_size(vocab, divisor, tp, expected):
    assert model.padded_vocab_size(vocab, divisor, tp) == expected


def test_bad_shapes_are_clear_errors():
    with pytest.raises(ValueError, match="max_position_embeddings"):
        model.ModelConfig(seq_length=2048, max_position_embeddings=1024)
    with pytest.raises(ValueError, match="num_attention_heads"):
        model.ModelConfig(hidden_size=100, num_attention_heads=3)
    with pytest.raises(ValueError, match=r"hidden_dropout=1.5 must be a probability"):
        model.ModelConfig(hidden_dropout=1.5)  # was accepted; torch failed later inside GPTModel
    with pytest.raises(ValueError, match=r"attention_dropout=-0.1 must be a probability"):
        model.ModelConfig(attention_dropout=-0.1)
    with pytest.raises(ValueError, match="unknown ModelConfig keys"):
        model.ModelConfig.from_dict({"num_layer": 2})
    with pytest.raises(KeyError, match="codeparrot-small"):
        model.profile("gpt-9")


def test_codeparrot_small_matches_the_guide():
    cfg = model.PROFILES["codeparrot-small"]
    assert (cfg.num_layers, cfg.hidden_size, cfg.num_attention_heads, cfg.seq_length,
            cfg.max_position_embeddings) == (12, 768, 12, 1024, 1024)
    assert cfg.hidden_dropout == cfg.attention_dropout == 0.1 and cfg.init_method_std == 0.02
    n = model.count_parameters(cfg)
    assert 105e6 < n < 115e6, n  # "CodeParrot small, 110M parameters"
    # 6N + attention: Narayanan et al.'s 72*l*h^2*(1 + s/(6h) + V/(12*l*h))
    l, h, s, v = 12, 768, 1024, cfg.padded_vocab_size()
    assert model.flops_per_token(cfg) == 72 * l * h * h + 12 * l * s * h + 6 * h * v
    assert math.isclose(72 * l * h * h * (1 + s / (6 * h) + v / (12 * l * h)), model.flops_per_token(cfg))
    non_embedding = n - (v + 1024) * h
    assert 6 * non_embedding < model.flops_per_token(cfg) < 6 * n + 12 * l * s * h + 1


def test_flops_grow_with_recompute():
    cfg = model.ModelConfig(**TINY)
    assert model.flops_per_token(cfg, activation_recompute=True) > model.flops_per_token(cfg)


@pytest.mark.parametrize("tied", [True, False])
def test_parameter_count_matches_built_model(dist1, tied):
    cfg = model.ModelConfig(**TINY, share_embeddings_and_output_weights=tied)
    gpt = model.build_model(cfg)
    assert sum(p.numel() for p in gpt.parameters()) == model.count_parameters(cfg)
    assert gpt.embedding.word_embeddings.weight.shape == (cfg.padded_vocab_size(), 64)
    assert gpt.embedding.position_embeddings.weight.shape == (48, 64)  # learned absolute positions
    if tied:
        assert gpt.output_layer.weight is None
        assert gpt.shared_embedding_or_output_weight() is gpt.embedding.word_embeddings.weight


def test_gpt2_blocks_layernorm_bias_and_logits_shape(dist1):
    cfg = model.ModelConfig(**TINY)
    gpt = model.build_model(cfg, layer_spec="local")
    layer = gpt.decoder.layers[0]
    assert isinstance(layer.input_layernorm, torch.nn.LayerNorm) or "LayerNorm" in type(layer.input_layernorm).__name__
    assert layer.self_attention.linear_qkv.bias.shape == (3 * 64,)
    names = {n for n, _ in gpt.named_parameters()}
    assert "decoder.final_layernorm.bias" in names
    tokens = torch.randint(0, 500, (2, 32))
    logits = gpt(tokens, torch.arange(32).expand(2, 32), None)
    assert logits.shape == (2, 32, cfg.padded_vocab_size()) and logits.dtype == torch.float32
    loss = gpt(tokens, torch.arange(32).expand(2, 32), None, labels=tokens)
    assert loss.shape == (2, 32)
    assert abs(loss.mean().item() - math.log(cfg.padded_vocab_size())) < 1.0  # near-uniform at init


@pytest.mark.parametrize("fused, expected", [(False, "erf"), (True, "tanh")])
def test_gelu_variant_is_the_one_recorded(dist1, fused, expected):
    """Unfused MLP = exact erf GELU; megatron's fused bias-GELU = tanh approximation. The
    metadata names the one training computed, so conversion can match it."""
    cfg = model.ModelConfig(**TINY, bias_activation_fusion=fused)
    assert cfg.gelu == expected
    assert cfg.to_metadata()["hf_activation_function"] == {"erf": "gelu", "tanh": "gelu_new"}[expected]
    mlp = model.build_model(cfg).decoder.layers[0].mlp
    x = torch.randn(5, 2, 64) * 3
    with torch.no_grad():
        out, out_bias = mlp(x)
        out = out + (out_bias if out_bias is not None else 0)
        pre = x @ mlp.linear_fc1.weight.T + mlp.linear_fc1.bias
        act = F.gelu(pre, approximate="tanh" if fused else "none")
        ref = act @ mlp.linear_fc2.weight.T + mlp.linear_fc2.bias
        other = F.gelu(pre, approximate="none" if fused else "tanh") @ mlp.linear_fc2.weight.T + mlp.linear_fc2.bias
    assert torch.allclose(out, ref, atol=1e-5)
    assert not torch.allclose(out, other, atol=1e-5)


def test_sdpa_attention_equals_megatron_unfused_attention(dist1):
    """Same weights, same loss and gradients whichever kernel computes the attention."""
    torch.manual_seed(0)
    models = {}
    for kind in model.CORE_ATTENTIONS:
        models[kind] = model.build_model(model.ModelConfig(**TINY, core_attention=kind), layer_spec="local")
    sdpa, unfused = models["sdpa"], models["unfused"]
    assert type(sdpa.decoder.layers[0].self_attention.core_attention).__name__ == "SDPAttention"
    assert type(unfused.decoder.layers[0].self_attention.core_attention).__name__ == "DotProductAttention"
    assert sdpa.state_dict().keys() == unfused.state_dict().keys()
    unfused.load_state_dict(sdpa.state_dict())
    tokens = torch.randint(0, 500, (2, 32))
    positions = torch.arange(32).expand(2, 32)
    losses = {}
    for kind, gpt in models.items():
        gpt.zero_grad()
        losses[kind] = gpt(tokens, positions, None, labels=tokens)
        losses[kind].mean().backward()
    assert torch.allclose(losses["sdpa"], losses["unfused"], atol=1e-5)
    for (name, a), (_, b) in zip(sdpa.named_parameters(), unfused.named_parameters()):
        assert torch.allclose(a.grad, b.grad, atol=1e-5), name


def test_sdpa_attention_masks_and_fallbacks(dist1):
    """An explicit megatron mask (True = masked) and a query shorter than the keys both match the parent."""
    from megatron.core.transformer.dot_product_attention import DotProductAttention

    torch.manual_seed(1)
    gpt = model.build_model(model.ModelConfig(**TINY), layer_spec="local")
    core = gpt.decoder.layers[0].self_attention.core_attention
    q, k, v = (torch.randn(32, 2, 4, 16) for _ in range(3))
    causal = torch.triu(torch.ones(32, 32, dtype=torch.bool), diagonal=1).expand(2, 1, 32, 32)
    random_mask = causal | (torch.rand(2, 1, 32, 32) < 0.3)
    random_mask[..., 0] = False  # every query keeps one key
    with torch.no_grad():
        for mask in (None, causal, random_mask):
            ref = DotProductAttention.forward(core, q, k, v, mask if mask is not None else causal)
            assert torch.allclose(core(q, k, v, mask), ref, atol=1e-5)
        blind = random_mask.clone()
        blind[0, 0, 5] = True  # query 5 of sequence 0 may see no key: the parent's -10000 fill decides
        assert torch.allclose(core(q, k, v, blind), DotProductAttention.forward(core, q, k, v, blind), atol=1e-6)
        shorter = DotProductAttention.forward(core, q[-4:], k, v, causal[..., -4:, :])
        assert torch.allclose(core(q[-4:], k, v, causal[..., -4:, :]), shorter, atol=1e-6)
    core.attention_dropout.p = 0.5  # an override given to the constructor lands here, in the parent's Dropout
    core.train()
    assert not torch.allclose(core(q, k, v, None), core(q, k, v, None))
    core.attention_dropout.p = 0.0
    with pytest.raises(ValueError, match=r"core_attention='flash': choose one of 'sdpa', 'unfused'"):
        model.ModelConfig(**TINY, core_attention="flash")


def test_metadata_has_what_a_converter_needs():
    meta = model.profile("cpu").to_metadata(tensor_model_parallel_size=2)
    for key in ("num_layers", "hidden_size", "num_attention_heads", "ffn_hidden_size", "padded_vocab_size",
                "max_position_embeddings", "gelu", "hf_activation_function", "tied_embeddings",
                "layernorm_epsilon", "position_embedding_type", "num_parameters", "flops_per_token"):
        assert key in meta
    assert meta["padded_vocab_size"] == 8192 and meta["ffn_hidden_size"] == 4 * 192


def test_precision_needs_cuda():
    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    with pytest.raises(ValueError, match="fp32"):
        model.transformer_config(model.ModelConfig(**TINY), precision="bf16")


def test_greedy_generate_is_deterministic_and_skips_padded_rows(dist1):
    torch.manual_seed(1234)  # the weights, whatever the tests before this one drew
    gpt = model.build_model(model.ModelConfig(**TINY)).eval()
    gpt.tokenizer_vocab_size = 10  # rows 10..511 are padding: never chosen
    a = generation.greedy_generate(gpt, [1, 2, 3], max_new_tokens=6)
    assert a == generation.greedy_generate(gpt, [1, 2, 3], max_new_tokens=6)
    assert a[:3] == [1, 2, 3] and len(a) == 9 and all(0 <= t < 10 for t in a[3:])
    penalised = generation.greedy_generate(gpt, [1, 2, 3], max_new_tokens=6, repetition_penalty=1e6)
    # A huge penalty pushes every token already in the text below the unseen ones, unless all
    # of those have negative logits (CTRL's rule multiplies them): true for these weights.
    assert len(set(penalised[3:])) == 6
    with pytest.raises(ValueError, match="prompt_ids is empty"):
        generation.greedy_generate(gpt, [], 4)
    with pytest.raises(ValueError, match="repetition_penalty"):
        generation.greedy_generate(gpt, [1], 4, repetition_penalty=0)


@pytest.mark.parametrize("profile,extra", [("cpu", {}), ("cpu-llama", {}), ("cpu-llama", {"num_experts": 4, "moe_router_topk": 2}),
                                           ("codeparrot-small", {})], ids=["gpt2", "llama", "moe", "codeparrot-small"])
def test_flops_per_token_is_megatron_lms_count_plus_the_causal_half_and_the_router(profile, extra, tmp_path):
    """Megatron-LM's num_floating_point_operations (megatron/training/training.py) on the flags the series runs:
    it counts half of the attention scores (causal mask) and no router; model.flops_per_token counts both."""
    from megatron.core.tokenizers.utils.build_tokenizer import vocab_size_with_padding
    from megatron.training.training import num_floating_point_operations

    from helpers.learn import training_config
    from helpers.runner import megatron_args

    cfg = training_config.profile("cpu", str(tmp_path), model=model.profile(profile, **extra).to_dict())
    args = megatron_args.parsed_args(cfg)
    assert args.padded_vocab_size == cfg.model.padded_vocab_size()
    args.tensor_model_parallel_size = 2
    for vocab in (cfg.model.vocab_size + 1, 50_257):  # one past a multiple of 128 x TP, and GPT-2's
        assert vocab_size_with_padding(vocab, args, logging_enabled=False) == model.padded_vocab_size(vocab, tensor_model_parallel_size=2)
    args.tensor_model_parallel_size = 1
    m = cfg.model
    theirs = num_floating_point_operations(args, batch_size=1) / m.seq_length
    causal_half = 3 * 2 * m.num_layers * m.seq_length * m.hidden_size  # half of the 12*l*s*h attention term
    router = 3 * 2 * m.hidden_size * (m.num_experts or 0) * m.num_layers
    assert model.flops_per_token(m) == theirs + causal_half + router
