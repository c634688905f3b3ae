"""Issue 29: a mixture of experts trained by Megatron-LM's loop on a CPU, its experts split over two gloo ranks
(expert parallelism, EP=2, carved out of DP=2), trains what one process with every expert trains; and what
TrainingConfig and ModelConfig refuse for one."""

from __future__ import annotations

from dataclasses import replace

import pytest

from helpers.learn import model as model_lib
from helpers.learn import training_config
from helpers.runner import launch, megatron_args
from tests.test_training import TINY_MODEL, data, tiny_config  # noqa: F401 (data: the module's corpus fixture)

#: The tiny model of tests/test_training.py with 4 experts per layer, 2 per token, no linear biases
#: (ModelConfig.num_experts explains why).
MOE_MODEL = {**TINY_MODEL, "num_experts": 4, "moe_router_topk": 2, "add_bias_linear": False}


def _moe_config(data, run_dir, **overrides) -> training_config.TrainingConfig:  # noqa: F811 (data: the fixture's value)
    return tiny_config(data, run_dir, model=dict(MOE_MODEL), save_interval=None, eval_interval=12, **overrides)


def _rows(result) -> list[tuple[int, float, float]]:
    return [(r["iteration"], r["lm_loss"], r["grad_norm"]) for r in result.metrics["iteration"]]


@pytest.mark.trains
def test_expert_parallelism_on_two_ranks_trains_what_one_process_trains(data, tmp_path):  # noqa: F811
    """EP=2 (each rank holds 2 of the 4 experts of each layer; the all-gather dispatcher brings every token to the
    rank of its experts and back) against one process holding all 4, both from the same initial weights: the one
    process's model, saved once and resharded into EP=2 by dist_checkpointing (Megatron-LM's
    --pretrained-checkpoint). Seeded from scratch they would differ: each EP rank draws only its own experts.
    Every loss and gradient norm agrees to float32 rounding: measured, 10 of 12 losses bit-identical, the others one
    float32 step apart (4.8e-7 at 6.7), gradient norms at most 8.7e-8 apart relatively (the two ranks' mean losses
    are averaged where one process averages its two micro-batches', and their gradients are summed in another order)."""
    from helpers.demos import layout_runs

    one = _moe_config(data, tmp_path / "ep1")
    initial = layout_runs.initial_checkpoint(one, progress=False)
    one = replace(one, pretrained_checkpoint=str(initial))
    two = replace(one, run_dir=str(tmp_path / "ep2"), expert_model_parallel_size=2)
    flags = megatron_args.arguments(two, cpu=True)
    for flag, value in (("--num-experts", "4"), ("--moe-router-topk", "2"), ("--expert-model-parallel-size", "2"),
                        ("--moe-token-dispatcher-type", "allgather")):
        assert flags[flags.index(flag) + 1] == value
    reference = launch.train(one, nproc_per_node=1, timeout_s=300, progress=False, env={"OMP_NUM_THREADS": "1"})
    result = launch.train(two, nproc_per_node=2, timeout_s=300, progress=False, env={"OMP_NUM_THREADS": "1"})
    log = (two.run_path / "training.log").read_text()
    assert "expert_model_parallel_size ...................... 2" in log and "load_balancing_loss" in log
    ours, theirs = _rows(result), _rows(reference)
    assert len(ours) == len(theirs) == 12
    for (it, loss, norm), (_, ref_loss, ref_norm) in zip(ours, theirs):
        assert loss == pytest.approx(ref_loss, abs=2e-6) and norm == pytest.approx(ref_norm, rel=1e-6), it
    assert result.summary["parameters"] == model_lib.count_parameters(one.model) == 365_696


def test_experts_are_counted_and_built_as_megatron_core_builds_them():
    """count_parameters counts every expert and the router; build_model builds Megatron-LM's MoE block."""
    from helpers.learn import distributed, memory
    from helpers.support import cpu_compat

    cfg = model_lib.ModelConfig(**MOE_MODEL)
    dense = replace(cfg, num_experts=None)
    router, per_expert = 4 * 64, 2 * 64 * 256
    assert model_lib.count_parameters(cfg) - model_lib.count_parameters(dense) == 2 * (router + 3 * per_expert)
    assert model_lib.flops_per_token(cfg) - model_lib.flops_per_token(dense) == 3 * 2 * (2 * 64 * 4 + 4 * 64 * 256)
    cpu_compat.apply()
    distributed.initialize_distributed(1, 1, seed=1234)
    try:
        gpt = model_lib.build_model(cfg, layer_spec="local")
        assert sum(p.numel() for p in gpt.parameters()) == model_lib.count_parameters(cfg) == memory.parameters_per_rank(cfg)
        assert "decoder.layers.1.mlp.experts.local_experts.3.linear_fc2.weight" in gpt.state_dict()
    finally:
        distributed.destroy_distributed()


@pytest.mark.parametrize("model, ep, world, match", [
    ({}, 2, 2, r"expert_model_parallel_size=2 with model.num_experts=None"),
    ({"num_experts": 3}, 2, 2, r"expert_model_parallel_size=2 with model.num_experts=3 .* a multiple of 2"),
    ({"num_experts": 4}, 2, 1, r"a data-parallel size of 1"),
    ({"num_experts": 4}, 0, 1, r"expert_model_parallel_size=0 must be >= 1"),
])
def test_expert_parallelism_the_layout_cannot_hold_is_refused(model, ep, world, match):
    cfg = training_config.profile("cpu", "runs/unused", model={**MOE_MODEL, "num_experts": None, **model},
                                  micro_batch_size=4, global_batch_size=8, expert_model_parallel_size=ep)
    with pytest.raises(ValueError, match=match):
        cfg.check(world, files=False)


def test_a_mixture_of_experts_the_model_cannot_hold_is_refused():
    with pytest.raises(ValueError, match=r"moe_router_topk=5 must be between 1 and num_experts=4"):
        model_lib.ModelConfig(**{**MOE_MODEL, "moe_router_topk": 5})
    with pytest.raises(ValueError, match=r"add_bias_linear=True: .*transformer/mlp.py:354.*add_bias_linear=False"):
        model_lib.ModelConfig(**{**MOE_MODEL, "add_bias_linear": True})
    with pytest.raises(TypeError, match=r"^model.num_experts=4.0 is a float, not int \| None"):
        training_config.TrainingConfig(model=replace(model_lib.ModelConfig(**MOE_MODEL), num_experts=4.0)).check()


def test_a_llama_with_experts_is_read_back_from_megatron_lms_args_and_the_converters_refuse_it():
    """A finished MoE run is read back (to resume it, or to find it cached) from the args Megatron-LM saved; the
    converters to transformers' one-MLP GPT-2 and Llama refuse it by name, as do MoE variants the series cannot build."""
    from helpers.learn import conversion, llama, megatron_lm

    args = {"num_layers": 2, "hidden_size": 64, "num_attention_heads": 4, "seq_length": 64, "padded_vocab_size": 1024,
            "ffn_hidden_size": 192, "position_embedding_type": "rope", "normalization": "RMSNorm", "swiglu": True,
            "add_bias_linear": False, "num_experts": 4, "moe_router_topk": 2}
    meta = megatron_lm.metadata_from_args(args)
    assert (meta["num_experts"], meta["moe_router_topk"], meta["ffn_hidden_size"]) == (4, 2, 192)
    assert meta["num_parameters"] == model_lib.count_parameters(model_lib.ModelConfig(
        num_layers=2, hidden_size=64, num_attention_heads=4, seq_length=64, max_position_embeddings=64, vocab_size=1024,
        ffn_hidden_size=192, **{**model_lib.ARCHITECTURES["llama"], "num_experts": 4}))
    with pytest.raises(conversion.ConversionError, match=r"num_experts=4 \(a mixture of experts: LlamaForCausalLM"):
        llama.check_llama(meta)
    with pytest.raises(conversion.ConversionError, match=r"num_experts=4 \(a mixture of experts: GPT2LMHeadModel"):
        conversion.check_architecture(meta)
    for extra, named in (({"moe_layer_freq": 2}, "moe_layer_freq=2"), ({"moe_ffn_hidden_size": 96}, "moe_ffn_hidden_size=96"),
                         ({"moe_shared_expert_intermediate_size": 64}, "moe_shared_expert_intermediate_size=64")):
        with pytest.raises(conversion.ConversionError, match=named):
            megatron_lm.metadata_from_args({**args, **extra})
