"""Issue 28 (first steps): a Llama-style GPT in megatron-core on a CPU, and its exact conversion to
``LlamaForCausalLM`` and back (RoPE, RMSNorm, SwiGLU, grouped-query attention, no biases, the output
layer untied or tied)."""

from __future__ import annotations

import json

import pytest
import torch

from helpers.learn import checkpointing, conversion, llama, memory, training_config
from helpers.runner import megatron_args
from helpers.learn import model as model_lib
from helpers.demos import conversion_proofs as proofs
from test_conversion import VOCAB, tokenizer_dir, tokens  # noqa: F401 (fixture)

pytestmark = [pytest.mark.trains, pytest.mark.timeout(300)]


def tiny_llama(**overrides) -> model_lib.ModelConfig:
    base = dict(num_layers=2, hidden_size=48, num_attention_heads=4, num_query_groups=2, seq_length=32,
                max_position_embeddings=32, vocab_size=VOCAB, share_embeddings_and_output_weights=False,
                **model_lib.ARCHITECTURES["llama"])
    return model_lib.ModelConfig(**{**base, **overrides})


def test_the_llama_profile_is_the_cpu_model_with_todays_blocks():
    gpt2, lam = model_lib.profile("cpu"), model_lib.profile("cpu-llama")
    assert (gpt2.architecture, lam.architecture, tiny_llama(add_bias_linear=True).architecture) == ("gpt2", "llama", "custom")
    assert model_lib.profile("cpu-llama", ffn_hidden_size=None).ffn_size == 512  # SwiGLU's 8h/3 keeps GELU's 8h^2:
    assert 3 * 192 * 512 == 2 * gpt2.hidden_size * gpt2.ffn_size
    parts = model_lib.layer_parameters(lam)  # and 576 = 512 + 64 spends what GQA saves: 3 x 192 x 64 = 2 x 96 x 192
    assert parts["qkv"] == 192 * (4 + 2 * 2) * 48 and parts["norms"] == 2 * 192 and parts["fc1"] == 2 * 576 * 192
    assert sum(parts.values()) == 4 * 192 ** 2 + 3 * 192 * 576 - 2 * 96 * 192 + 2 * 192
    assert model_lib.count_parameters(lam) == model_lib.count_parameters(gpt2) - 128 * 192 - 4 * (
        sum(model_lib.layer_parameters(gpt2).values()) - sum(parts.values())) - 192  # no position table, no norm biases
    assert model_lib.flops_per_token(lam) == model_lib.flops_per_token(gpt2)  # the same multiplies per token
    meta = lam.to_metadata()
    assert (meta["hf_activation_function"], meta["num_query_groups"], meta["tied_embeddings"]) == ("silu", 2, True)
    with pytest.raises(ValueError, match=r"num_query_groups=3 must divide num_attention_heads=4.*\[1, 2, 4\]"):
        tiny_llama(num_query_groups=3)
    with pytest.raises(ValueError, match="15 per head is odd: rotary embeddings rotate pairs of dimensions"):
        tiny_llama(hidden_size=60, num_query_groups=None)
    with pytest.raises(ValueError, match="normalization='rms'"):
        tiny_llama(normalization="rms")
    with pytest.raises(ValueError, match=r"tensor_model_parallel_size=4 does not divide num_query_groups=2"):
        model_lib.check_layout(tiny_llama(), model_lib.Layout(4, 1, 1))
    with pytest.raises(ValueError, match="seq_length=64 is above max_position_embeddings=32"):
        tiny_llama(seq_length=64)  # no table to outgrow, but Megatron-LM's validate_args asks for it with RoPE too
    gpu_flags = megatron_args.arguments(training_config.profile("cpu", "/tmp/x", model=tiny_llama().to_dict(), layer_spec="local"),
                                        cpu=False)
    assert "--no-rope-fusion" in gpu_flags and "--use-cpu-initialization" not in gpu_flags  # the fused RoPE is TE's


def test_a_llama_trains_on_a_cpu_and_its_parameter_count_is_the_formula():
    cfg = tiny_llama()
    gpt = proofs.randomized_model(cfg, seed=5).train()
    assert sum(p.numel() for p in gpt.parameters()) == model_lib.count_parameters(cfg) == memory.parameters_per_rank(cfg)
    assert "embedding.position_embeddings.weight" not in gpt.state_dict()
    ids = tokens(vocab=VOCAB)
    loss = gpt(ids, torch.arange(ids.shape[1]).expand_as(ids), attention_mask=None, labels=ids).mean()
    loss.backward()
    assert torch.isfinite(loss) and all(p.grad is not None and torch.isfinite(p.grad).all() for p in gpt.parameters())


@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
def test_a_llama_converts_to_llamaforcausallm_with_the_same_logits_and_back_bit_for_bit(tmp_path, tokenizer_dir, tied):  # noqa: F811
    from transformers import AutoModelForCausalLM, LlamaForCausalLM

    cfg = tiny_llama(share_embeddings_and_output_weights=tied)
    gpt = proofs.randomized_model(cfg, seed=7)
    meta = {**cfg.to_metadata(), "tokenizer_dir": str(tokenizer_dir)}
    mc = {k: v for k, v in gpt.state_dict().items() if not k.endswith("_extra_state")}
    folder = checkpointing.save_model(gpt, tmp_path / "ckpt", 3, meta)
    result = conversion.convert_to_hf(folder, tmp_path / "hf")
    hf = AutoModelForCausalLM.from_pretrained(tmp_path / "hf").eval()
    assert isinstance(hf, LlamaForCausalLM) and (hf.config.num_key_value_heads, hf.config.tie_word_embeddings) == (2, tied)
    assert ("output_layer.weight" in mc) is not tied and (hf.lm_head.weight is hf.model.embed_tokens.weight) is tied
    assert json.loads((tmp_path / "hf" / "conversion.json").read_text())["architecture"] == "LlamaForCausalLM"
    assert result.vocab_size == VOCAB and result.padded_rows_removed == cfg.padded_vocab_size() - VOCAB
    ids = tokens(vocab=VOCAB)
    with torch.no_grad():
        ours = gpt(ids, torch.arange(ids.shape[1]).expand_as(ids), attention_mask=None)[..., :VOCAB]
        theirs = hf(ids).logits
    assert (ours - theirs).abs().max().item() < 1e-5
    back = llama.llama_to_megatron_state_dict(hf.state_dict(), 4, 2, cfg.padded_vocab_size(), tied=tied)
    assert set(back) == set(mc)
    for key, tensor in mc.items():
        rows = VOCAB if key in llama.VOCAB_ROWS else tensor.shape[0]  # Megatron's padding rows are not a token
        assert torch.equal(back[key][:rows], tensor[:rows]), key
    assert torch.equal(back["embedding.word_embeddings.weight"][VOCAB:], mc["embedding.word_embeddings.weight"][VOCAB - 1].expand(
        cfg.padded_vocab_size() - VOCAB, -1))  # padding repeats the last row
    if tied:  # an lm_head of its own is not a tied model
        untied = {**hf.state_dict(), "lm_head.weight": hf.lm_head.weight + 1}
        with pytest.raises(conversion.ConversionError, match="lm_head.weight differs from model.embed_tokens.weight"):
            llama.llama_to_megatron_state_dict(untied, 4, 2, cfg.padded_vocab_size(), tied=True)


def test_the_qkv_split_follows_megatron_cores_groups_and_the_converter_refuses_the_other_architecture():
    h, heads, groups, d = 8, 4, 2, 2
    rows = torch.arange((heads + 2 * groups) * d, dtype=torch.float32)[:, None].expand(-1, h)
    q, k, v = llama.split_qkv(rows, heads, groups)
    # group 0: q heads 0-1 (rows 0-3), k (4-5), v (6-7); group 1: q heads 2-3 (8-11), k (12-13), v (14-15)
    assert q[:, 0].tolist() == [0, 1, 2, 3, 8, 9, 10, 11] and k[:, 0].tolist() == [4, 5, 12, 13]
    assert v[:, 0].tolist() == [6, 7, 14, 15] and torch.equal(llama.merge_qkv(q, k, v, heads, groups), rows)
    with pytest.raises(conversion.ConversionError, match=r"not \[\(heads \+ 2 x groups\) x head_dim, h\]"):
        llama.split_qkv(rows[:-2], heads, groups)
    with pytest.raises(conversion.ConversionError, match="position_embedding_type='learned_absolute' .a Llama has 'rope'"):
        llama.check_llama(model_lib.profile("cpu").to_metadata())
    with pytest.raises(conversion.ConversionError, match="LlamaForCausalLM"):
        conversion.check_architecture(tiny_llama().to_metadata())


def test_a_llama_megatron_lm_wrote_converts_from_its_args(tmp_path, tokenizer_dir):  # noqa: F811
    """A torch_dist checkpoint as Megatron-LM's save_checkpoint writes it for --position-embedding-type rope
    --normalization RMSNorm --swiglu --disable-bias-linear --untie-embeddings-and-output-weights
    --group-query-attention --num-query-groups 2: the architecture comes from its args alone."""
    from megatron.core import dist_checkpointing
    from transformers import AutoModelForCausalLM

    from helpers.demos.megatron_lm_layout import mlm_args
    from helpers.learn import megatron_lm

    cfg = tiny_llama()
    gpt = proofs.randomized_model(cfg, seed=11)
    llama_args = dict(position_embedding_type="rope", normalization="RMSNorm", swiglu=True, add_bias_linear=False,
                      group_query_attention=True, num_query_groups=2, rotary_base=10000, ckpt_format="torch_dist")
    folder = tmp_path / "save" / "iter_0000005"
    folder.mkdir(parents=True)
    dist_checkpointing.save({"model": gpt.sharded_state_dict(), "args": mlm_args(cfg, tokenizer_dir, **llama_args),
                             "checkpoint_version": 3.0, "iteration": 5}, str(folder))
    (tmp_path / "save" / "latest_checkpointed_iteration.txt").write_text("5")
    ckpt = conversion.load_megatron_checkpoint(tmp_path / "save")
    assert ckpt.meta["architecture"] == "llama" and ckpt.meta["num_query_groups"] == 2 and ckpt.meta["written_by"] == "Megatron-LM"
    conversion.convert_to_hf(ckpt, tmp_path / "hf", tokenizer_dir=tokenizer_dir)
    hf = AutoModelForCausalLM.from_pretrained(tmp_path / "hf").eval()
    ids = tokens(vocab=VOCAB)
    with torch.no_grad():
        diff = (gpt(ids, torch.arange(ids.shape[1]).expand_as(ids), attention_mask=None)[..., :VOCAB] - hf(ids).logits)
    assert diff.abs().max().item() < 1e-5
    gpt2 = model_lib.profile("cpu", num_layers=2, vocab_size=VOCAB)
    half = mlm_args(gpt2, tokenizer_dir, position_embedding_type="rope", normalization="RMSNorm")  # a Llama's parts, not all
    with pytest.raises(conversion.ConversionError, match="neither GPT-2 nor a Llama.*position_embedding_type='rope'"):
        megatron_lm.metadata_from_args(half)


def test_megatron_lms_loop_trains_the_llama_choice_and_its_checkpoint_converts_exactly(tmp_path):
    """launch.train with the llama blocks: Megatron-LM's own loop (rotary embeddings need one more CPU flag,
    --no-rope-fusion), its losses fall, and its torch_dist checkpoint is a LlamaForCausalLM within 1e-5."""
    from transformers import AutoModelForCausalLM

    from helpers.runner import data_stage, launch, megatron_args
    from test_training import TINY_MODEL, tiny_config

    data = data_stage.build_data(tmp_path / "data-run", max_files=120, vocab_size=1024, progress=False)
    cfg = tiny_config(data, tmp_path / "run", model={**TINY_MODEL, **model_lib.ARCHITECTURES["llama"], "num_query_groups": 1},
                      lr=5e-3)
    assert cfg.model.architecture == "llama"
    flags = megatron_args.arguments(cfg, cpu=True)
    assert {"--swiglu", "--disable-bias-linear", "--group-query-attention", "--no-rope-fusion"} <= set(flags)
    assert flags[flags.index("--normalization") + 1] == "RMSNorm" and flags[flags.index("--num-query-groups") + 1] == "1"
    result = launch.train(cfg, progress=False)
    losses = [r["lm_loss"] for r in result.metrics["train"]]
    assert len(losses) == 12 and losses[-1] < losses[0] - 0.5
    assert checkpointing.read_model_config(cfg.checkpoint_path)["architecture"] == "llama"
    conversion.convert_to_hf(cfg.checkpoint_path, tmp_path / "hf")
    hf = AutoModelForCausalLM.from_pretrained(tmp_path / "hf").eval()
    gpt, _ = checkpointing.load_model(cfg.checkpoint_path)
    ids = torch.randint(0, data.vocab_size, (2, 32), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        diff = gpt(ids, torch.arange(32).expand_as(ids), attention_mask=None)[..., :data.vocab_size] - hf(ids).logits
    assert type(hf).__name__ == "LlamaForCausalLM" and diff.abs().max().item() < 1e-5


def test_a_tensor_parallel_llama_in_megatron_lms_legacy_format_joins_gates_then_ups(tmp_path, tokenizer_dir):  # noqa: F811
    """Review (issue 28): each TP rank's SwiGLU linear_fc1 is its own [gate_r; up_r]; joined rank after rank it
    would give [g0; u0; g1; u1] and a wrong MLP of the right shape. Two mp_rank_XX files, as --ckpt-format torch writes."""
    from transformers import AutoModelForCausalLM

    from helpers.demos.megatron_lm_layout import mlm_args, write_legacy

    cfg, tp = tiny_llama(), 2
    gpt = proofs.randomized_model(cfg, seed=13)
    sd = {k: v for k, v in gpt.state_dict().items() if not k.endswith("_extra_state")}
    rows = cfg.padded_vocab_size(tp)
    shards = [{} for _ in range(tp)]
    for key, value in sd.items():
        if key in llama.VOCAB_ROWS:
            value = torch.cat([value, torch.randn(rows - value.shape[0], value.shape[1])])
        if key.endswith("linear_fc1.weight"):
            gate, up = value.chunk(2)
            parts = [torch.cat([g, u]) for g, u in zip(gate.chunk(tp), up.chunk(tp))]
        elif key.endswith(("linear_qkv.weight", "word_embeddings.weight", "output_layer.weight")):
            parts = value.chunk(tp, 0)
        elif key.endswith(("linear_proj.weight", "linear_fc2.weight")):
            parts = value.chunk(tp, 1)
        else:
            parts = [value] * tp
        for rank in range(tp):
            shards[rank][key] = parts[rank].clone()
    args = mlm_args(cfg, tokenizer_dir, tp, position_embedding_type="rope", normalization="RMSNorm", swiglu=True,
                    add_bias_linear=False, group_query_attention=True, num_query_groups=2, ckpt_format="torch")
    save = write_legacy(tmp_path / "save", shards, args)
    conversion.convert_to_hf(save, tmp_path / "hf")
    hf = AutoModelForCausalLM.from_pretrained(tmp_path / "hf").eval()
    ids = tokens(vocab=VOCAB)
    with torch.no_grad():
        diff = gpt(ids, torch.arange(ids.shape[1]).expand_as(ids), attention_mask=None)[..., :VOCAB] - hf(ids).logits
    assert diff.abs().max().item() < 1e-5
    from helpers.learn import megatron_lm

    for slipped in (dict(glu_linear_offset=1.0), dict(rotary_seq_len_interpolation_factor=2.0), dict(add_qkv_bias=True)):
        with pytest.raises(conversion.ConversionError, match=next(iter(slipped))):
            megatron_lm.metadata_from_args(mlm_args(cfg, tokenizer_dir, **{**vars(args), **slipped, "tensor_model_parallel_size": 1}))
    gpt2 = model_lib.profile("cpu", num_layers=2, vocab_size=VOCAB)  # Megatron-LM sets add_qkv_bias with add_bias_linear
    assert megatron_lm.metadata_from_args(mlm_args(gpt2, tokenizer_dir, add_qkv_bias=True))["architecture"] == "gpt2"
