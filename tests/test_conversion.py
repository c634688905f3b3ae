"""megatron-core <-> transformers conversion: exact on awkward shapes, strict on bad input.

Tiny randomly initialised models (2 layers, hidden 48, 3 or 6 heads, vocabulary 300 or 301
padded to 384/512 rows) with every weight and bias randomised, so a mis-permuted bias or a
swapped layer norm changes the logits. One 2-process torchrun job proves the TP=2 path
(``helpers.demos.tensor_parallel_run``); the proofs of notebook 06 come from
``helpers.demos.conversion_proofs`` and the way back from ``helpers.demos.conversion_way_back``.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import shutil

import pytest
import torch
from transformers import AutoModelForCausalLM

from helpers.learn import checkpointing, conversion
from helpers.learn import model as model_lib
from helpers.learn import tokenizer as tokenizer_lib
from helpers.demos import conversion_proofs as proofs
from helpers.demos import conversion_way_back, generation, tensor_parallel_run
from helpers.learn.distributed import initialize_distributed

pytestmark = [pytest.mark.trains, pytest.mark.timeout(300)]

VOCAB = 300
QKV_W, QKV_B = "decoder.layers.{}.self_attention.linear_qkv.weight", "decoder.layers.{}.self_attention.linear_qkv.bias"


def tiny(**overrides) -> model_lib.ModelConfig:
    base = dict(num_layers=2, hidden_size=48, num_attention_heads=3, seq_length=32,
                max_position_embeddings=32, vocab_size=VOCAB)
    return model_lib.ModelConfig(**{**base, **overrides})


randomized_model = proofs.randomized_model  # test_megatron_lm_checkpoints.py imports it from here


def weights(model) -> dict[str, torch.Tensor]:
    return {k: v for k, v in model.state_dict().items() if not k.endswith("._extra_state")}


def hf_from_state_dict(hf_sd, cfg, vocab=VOCAB, **config_overrides):
    from transformers import GPT2LMHeadModel

    config = conversion.gpt2_config(cfg, vocab_size=vocab, eod_id=0)
    for k, v in config_overrides.items():
        setattr(config, k, v)
    hf = GPT2LMHeadModel(config).eval()
    result = hf.load_state_dict(hf_sd, strict=True)
    assert not result.missing_keys and not result.unexpected_keys
    return hf


def tokens(batch: int = 2, seq: int = 32, vocab: int = VOCAB, seed: int = 1) -> torch.Tensor:
    return torch.randint(0, vocab, (batch, seq), generator=torch.Generator().manual_seed(seed))


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory):
    """A byte-level BPE of exactly 300 entries (not a multiple of 128) trained on stdlib files."""
    from helpers.learn import corpus

    files = corpus.list_python_files(corpus.stdlib_dir())[:40]
    texts = [f.read_text(encoding="utf-8", errors="replace") for f in files]
    folder = tokenizer_lib.train_tokenizer(texts, tmp_path_factory.mktemp("tok") / "tokenizer", vocab_size=VOCAB)
    assert tokenizer_lib.vocab_size_of(folder) == VOCAB
    return folder


@pytest.fixture(scope="module")
def plain_checkpoint(tmp_path_factory, tokenizer_dir):
    """A tied, erf-GELU model saved as a plain state dict (.pt) with its model_config.json."""
    cfg = tiny()
    model = randomized_model(cfg, seed=3)
    folder = tmp_path_factory.mktemp("plain")
    torch.save(model.state_dict(), folder / "model.pt")
    meta = {**cfg.to_metadata(), "tokenizer_dir": str(tokenizer_dir), "iteration": 7}
    (folder / checkpointing.MODEL_CONFIG_FILE).write_text(json.dumps(meta))
    return folder / "model.pt", model, cfg


@pytest.fixture(scope="module")
def hf_folder(tmp_path_factory, plain_checkpoint):
    path, _, _ = plain_checkpoint
    out = tmp_path_factory.mktemp("hf") / "hf_model"
    result = conversion.convert_to_hf(path, out)
    return out, result


# --------------------------------------------------------------------------- the weight map
def test_weight_map_inverts_to_itself_and_names_every_gpt2_weight():
    from transformers import GPT2LMHeadModel

    assert {mc: hf for hf, mc in conversion.HF_WEIGHT_MAP.items()} == conversion.WEIGHT_MAP
    assert len(set(conversion.WEIGHT_MAP.values())) == len(conversion.WEIGHT_MAP), "two keys map to one name"
    rules = conversion.TRANSPOSED | conversion.QKV_PERMUTED | conversion.VOCAB_ROWS
    assert rules <= set(conversion.WEIGHT_MAP)
    cfg = tiny(share_embeddings_and_output_weights=False)
    hf_keys = {k for k in GPT2LMHeadModel(conversion.gpt2_config(cfg)).state_dict()
               if not re.search(r"\.attn\.(masked_)?bias$", k)}  # the causal-mask buffers, not weights
    mapped = {hf.format(i) for hf in conversion.WEIGHT_MAP.values() for i in range(cfg.num_layers)}
    assert hf_keys == mapped
    mc_keys = set(weights(randomized_model(cfg)))
    assert mc_keys == {mc.format(i) for mc in conversion.WEIGHT_MAP for i in range(cfg.num_layers)}


def test_one_layer_by_hand_equals_the_state_dict_function():
    """What notebook 06 section 4 does in cells: a loop over the map, the permutation, a transpose."""
    cfg = tiny(num_attention_heads=6)
    model = randomized_model(cfg, seed=2)
    sd = weights(model)
    hf_sd = conversion.megatron_to_hf_state_dict(sd, cfg)
    perm = conversion.qkv_row_permutation(cfg.num_attention_heads, cfg.hidden_size // cfg.num_attention_heads)
    for mc, hf in conversion.WEIGHT_MAP.items():
        if "{}" not in mc:
            continue
        tensor = sd[mc.format(1)]
        tensor = tensor[perm] if mc in conversion.QKV_PERMUTED else tensor
        tensor = tensor.t() if mc in conversion.TRANSPOSED else tensor
        assert torch.equal(tensor, hf_sd[hf.format(1)]), mc
    assert torch.equal(sd["embedding.word_embeddings.weight"][:VOCAB], hf_sd["transformer.wte.weight"])


# --------------------------------------------------------------------------- the QKV permutation
def test_qkv_permutation_puts_each_heads_rows_where_gpt2_reads_them():
    heads, head_dim = 3, 4
    h = heads * head_dim
    weight = torch.randn(3 * h, h)
    bias = torch.randn(3 * h)
    c_attn_w, c_attn_b = conversion.tensor_to_hf(QKV_W, weight, heads), conversion.tensor_to_hf(QKV_B, bias, heads)
    assert c_attn_w.shape == (h, 3 * h)
    for head in range(heads):
        for part in range(3):  # q, k, v
            rows = slice(head * 3 * head_dim + part * head_dim, head * 3 * head_dim + (part + 1) * head_dim)
            cols = slice(part * h + head * head_dim, part * h + (head + 1) * head_dim)
            assert torch.equal(c_attn_w[:, cols], weight[rows].t()), (head, part)
            assert torch.equal(c_attn_b[cols], bias[rows]), (head, part)
    back_w, back_b = conversion.tensor_to_megatron(QKV_W, c_attn_w, heads), conversion.tensor_to_megatron(QKV_B, c_attn_b, heads)
    assert torch.equal(back_w, weight) and torch.equal(back_b, bias)
    perm = conversion.qkv_row_permutation(heads, head_dim)
    assert sorted(perm.tolist()) == list(range(3 * h))
    with pytest.raises(conversion.ConversionError, match="grouped-query"):
        conversion.tensor_to_hf(QKV_W, torch.randn(2 * h, h), heads)



def test_a_name_outside_the_weight_map_is_refused_and_a_layers_name_is_converted():
    """tensor_to_hf / tensor_to_megatron returned an unknown name's tensor unchanged, and a layer's
    own name ('decoder.layers.0...linear_qkv.weight') too: no permutation, no transpose."""
    weight = torch.randn(36, 12)
    for fn in (conversion.tensor_to_hf, conversion.tensor_to_megatron):
        for name in ("decoder.layers.{}.mlp.linear_fc3.weight", "transformer.h.{}.attn.c_attn.weight"):
            with pytest.raises(conversion.ConversionError, match=rf"^'{re.escape(name)}' is no megatron-core GPT "
                                                                 r"weight: pass one of the WEIGHT_MAP keys \['embedding\."):
                fn(name, weight, 3)
    assert torch.equal(conversion.tensor_to_hf(QKV_W.format(0), weight, 3), conversion.tensor_to_hf(QKV_W, weight, 3))
    assert conversion.tensor_to_hf(QKV_W.format(0), weight, 3).shape == (12, 36)


# --------------------------------------------------------------------------- exact logits
@pytest.mark.parametrize("overrides", [
    dict(),  # tied, erf GELU, 3 heads, vocab 300 -> 384 rows
    dict(num_attention_heads=6, vocab_size=301, share_embeddings_and_output_weights=False,
         bias_activation_fusion=True),  # untied, tanh GELU (fused bias-GELU), 6 heads
], ids=["tied-erf-3heads", "untied-tanh-6heads"])
def test_converted_logits_equal_megatron_core(overrides):
    cfg = tiny(**overrides)
    model = randomized_model(cfg)
    vocab = cfg.vocab_size
    hf_sd = conversion.megatron_to_hf_state_dict(model.state_dict(), cfg)
    assert hf_sd["transformer.wte.weight"].shape == (vocab, cfg.hidden_size)
    assert (hf_sd["lm_head.weight"] is hf_sd["transformer.wte.weight"]) == cfg.share_embeddings_and_output_weights
    hf = hf_from_state_dict(hf_sd, cfg, vocab)
    ids = tokens(vocab=vocab)
    reference = proofs.megatron_logits(model, ids)
    assert reference.shape[-1] == cfg.padded_vocab_size()
    cmp = proofs.compare_logits(reference, proofs.hf_logits(hf, ids))
    assert cmp.max_abs_logit > 1.0, "logits too small for the comparison to mean anything"
    assert cmp.max_abs_diff <= 1e-4
    assert cmp.argmax_agreement == 1.0
    # The comparison can fail: the other GELU, or QKV rows without the per-head permutation.
    other = "gelu" if cfg.gelu == "tanh" else "gelu_new"
    wrong_gelu = hf_from_state_dict(hf_sd, cfg, vocab, activation_function=other)
    assert proofs.compare_logits(reference, proofs.hf_logits(wrong_gelu, ids)).max_abs_diff > 1e-4
    unpermuted = dict(hf_sd)
    for i in range(cfg.num_layers):
        unpermuted[f"transformer.h.{i}.attn.c_attn.weight"] = model.state_dict()[f"decoder.layers.{i}.self_attention.linear_qkv.weight"].t()
    wrong_qkv = hf_from_state_dict(unpermuted, cfg, vocab)
    assert proofs.compare_logits(reference, proofs.hf_logits(wrong_qkv, ids)).max_abs_diff > 1e-2


def test_greedy_generation_and_validation_loss_agree():
    cfg = tiny(num_attention_heads=6)
    model = randomized_model(cfg, seed=5)
    hf = hf_from_state_dict(conversion.megatron_to_hf_state_dict(model.state_dict(), cfg), cfg)
    prompt = [5, 17, 42, 7]
    mc = generation.greedy_generate(model, prompt, 12, vocab_size=VOCAB)[len(prompt):]
    assert mc == generation.greedy_generate_hf(hf, prompt, 12)
    assert len(mc) == 12
    ids = tokens(batch=8, seq=33, seed=9)
    mask = torch.ones(8, 32)
    mask[:, :5] = 0.0
    dataset = [{"tokens": ids[i, :-1], "labels": ids[i, 1:], "loss_mask": mask[i]} for i in range(8)]
    kwargs = dict(num_samples=8, micro_batch_size=4)
    hf_loss = proofs.validation_loss(lambda t: proofs.hf_logits(hf, t), dataset, **kwargs)
    mc_real = proofs.validation_loss(lambda t: proofs.megatron_logits(model, t), dataset, vocab_size=VOCAB, **kwargs)
    mc_full = proofs.validation_loss(lambda t: proofs.megatron_logits(model, t), dataset, **kwargs)
    assert abs(hf_loss - mc_real) <= 1e-5
    # Megatron's softmax also spans the 84 padding columns: its loss is higher by -log(1 - p_pad).
    terms = []
    for start in (0, 4):
        probs = proofs.megatron_logits(model, ids[start:start + 4, :-1]).softmax(-1)
        gap = -torch.log1p(-probs[..., VOCAB:].sum(-1))
        m = mask[start:start + 4]
        terms.append(((gap * m).sum() / m.sum()).item())
    assert mc_full - hf_loss > 1e-3
    assert mc_full - hf_loss == pytest.approx(sum(terms) / 2, abs=1e-5)
    with pytest.raises(ValueError, match="multiple of micro_batch_size"):
        proofs.validation_loss(lambda t: proofs.hf_logits(hf, t), dataset, num_samples=6, micro_batch_size=4)


# --------------------------------------------------------------------------- the transformers folder
def test_convert_to_hf_writes_a_complete_exact_folder(plain_checkpoint, hf_folder, tokenizer_dir):
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, GenerationConfig, pipeline

    _, model, cfg = plain_checkpoint
    out, result = hf_folder
    assert result.vocab_size == VOCAB and result.padded_rows_removed == 384 - VOCAB
    assert result.activation_function == "gelu" and result.tied and result.iteration == 7
    config = AutoConfig.from_pretrained(out)
    assert (config.n_layer, config.n_embd, config.n_head, config.n_positions, config.vocab_size) == (2, 48, 3, 32, VOCAB)
    assert config.activation_function == "gelu" and config.layer_norm_epsilon == cfg.layernorm_epsilon
    assert config.tie_word_embeddings is True
    assert all(proofs.tokenizer_files_identical(out, tokenizer_dir).values())
    eod = tokenizer_lib.eod_id(tokenizer_dir)
    assert GenerationConfig.from_pretrained(out).eos_token_id == eod
    assert json.loads((out / conversion.CONVERSION_FILE).read_text())["padded_rows_removed"] == 84
    hf = AutoModelForCausalLM.from_pretrained(out).eval()
    ids = tokens(seed=4)
    ckpt = conversion.load_megatron_checkpoint(plain_checkpoint[0])
    rebuilt = checkpointing.model_from_checkpoint(ckpt.meta, ckpt.state_dict)
    assert torch.equal(proofs.megatron_logits(rebuilt, ids), proofs.megatron_logits(model, ids))
    assert proofs.compare_logits(proofs.megatron_logits(model, ids), proofs.hf_logits(hf, ids)).max_abs_diff <= 1e-4
    tok = AutoTokenizer.from_pretrained(out)
    prompt = "def hello_world():"
    generator = pipeline("text-generation", model=str(out), device="cpu")
    text = generator(prompt, max_new_tokens=6, do_sample=False)[0]["generated_text"]
    prompt_ids = tok(prompt)["input_ids"]
    expected = generation.greedy_generate(model, prompt_ids, 6, eod_id=eod, vocab_size=VOCAB)[len(prompt_ids):]
    assert text == prompt + tok.decode(expected)


def test_existing_output_is_kept_unless_overwrite(plain_checkpoint, hf_folder):
    path, _, _ = plain_checkpoint
    out, _ = hf_folder
    before = (out / "model.safetensors").read_bytes()
    (out / "marker.txt").write_text("keep me")
    with pytest.raises(FileExistsError, match="overwrite=True"):
        conversion.convert_to_hf(path, out)
    assert (out / "marker.txt").read_text() == "keep me"
    result = conversion.convert_to_hf(path, out, overwrite=True)
    assert result.output_dir == out and not (out / "marker.txt").exists()
    assert (out / "model.safetensors").read_bytes() == before



def test_the_converted_folder_has_mkdirs_mode_not_mkdtemps(plain_checkpoint, tmp_path):
    """The folder was mkdtemp's 0700 after the move: no other user, web server or container uid could read it."""
    import stat

    old = os.umask(0o027)
    try:
        out = conversion.convert_to_hf(plain_checkpoint[0], tmp_path / "hf_model").output_dir
    finally:
        os.umask(old)
    assert stat.S_IMODE(out.stat().st_mode) == 0o750
    assert stat.S_IMODE((out / "model.safetensors").stat().st_mode) == 0o640
    assert [p.name for p in tmp_path.iterdir()] == ["hf_model"]  # no temporary folder left


def test_round_trip_hf_megatron_hf_is_bit_identical(hf_folder, tmp_path):
    from safetensors.torch import load_file

    out, _ = hf_folder
    folder = conversion_way_back.hf_to_megatron_checkpoint(out, tmp_path / "checkpoints", iteration=11)
    assert folder.name == "iter_0000011" and checkpointing.latest_iteration(tmp_path / "checkpoints") == 11
    with pytest.raises(FileExistsError, match="already holds a checkpoint"):
        conversion_way_back.hf_to_megatron_checkpoint(out, tmp_path / "checkpoints")
    back = tmp_path / "hf_again"
    result = conversion.convert_to_hf(tmp_path / "checkpoints", back, tokenizer_dir=out)
    assert result.iteration == 11 and result.padded_rows_removed == 84
    first, second = load_file(out / "model.safetensors"), load_file(back / "model.safetensors")
    assert first.keys() == second.keys()
    assert all(torch.equal(first[k], second[k]) for k in first)
    assert json.loads((out / "config.json").read_text()) == json.loads((back / "config.json").read_text())
    report = proofs.legacy_converter_report(tmp_path / "checkpoints")
    assert report["converter_in_installed_transformers"] is False
    assert report["legacy_file"] is False and report["legacy_keys_present"] is False
    assert report["checkpoint_keys"][0].startswith("decoder.")


# --------------------------------------------------------------------------- tensor parallelism
def test_tp2_checkpoint_converts_to_the_same_model_as_tp1(tmp_path, tokenizer_dir):
    """TP=1 checkpoint -> (torchrun, 2 ranks) resharded TP=2 checkpoint + TP=2 logits -> both to HF."""
    cfg = tiny(num_attention_heads=6, share_embeddings_and_output_weights=False)
    model = randomized_model(cfg, seed=8)
    meta = {**cfg.to_metadata(), "tokenizer_dir": str(tokenizer_dir), "tensor_model_parallel_size": 1}
    checkpointing.save_model(model, tmp_path / "tp1", 4, meta)
    ids = tokens(seed=12)
    run = tensor_parallel_run.run_tensor_parallel(2, load=tmp_path / "tp1", tokens=ids, save=tmp_path / "tp2", on_line=None)
    assert run.saved.name == "iter_0000004"
    assert run.logits.shape == (2, 32, cfg.padded_vocab_size(2)) == (2, 32, 512)
    tp2 = conversion.load_megatron_checkpoint(tmp_path / "tp2")
    assert tp2.meta["tensor_model_parallel_size"] == 2
    assert tp2.state_dict["embedding.word_embeddings.weight"].shape[0] == 512
    hf_tp1 = conversion.megatron_to_hf_state_dict(model.state_dict(), cfg)
    hf_tp2 = conversion.megatron_to_hf_state_dict(tp2.state_dict, tp2.meta, VOCAB)
    assert hf_tp1.keys() == hf_tp2.keys()
    assert all(torch.equal(hf_tp1[k], hf_tp2[k]) for k in hf_tp1)
    hf = hf_from_state_dict(hf_tp2, cfg)
    assert proofs.compare_logits(run.logits, proofs.hf_logits(hf, ids)).max_abs_diff <= 1e-4
    resharded, _ = checkpointing.load_model(tmp_path / "tp2")
    assert all(torch.equal(v, weights(model)[k]) for k, v in weights(resharded).items())


# --------------------------------------------------------------------------- refusals and bad input
@pytest.mark.parametrize("variant,reason", [
    ("rope", "rotary"), ("rmsnorm", "RMSNorm"), ("swiglu", "SwiGLU"), ("gqa", "grouped-query"),
])
def test_other_architectures_are_refused_with_the_reason(variant, reason):
    import torch.nn.functional as F
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    initialize_distributed(1, 1)
    cfg = tiny(num_attention_heads=6)
    tc = model_lib.transformer_config(cfg)
    tc = {"rope": tc, "rmsnorm": dataclasses.replace(tc, normalization="RMSNorm"),
          "swiglu": dataclasses.replace(tc, gated_linear_unit=True, activation_func=F.silu),
          "gqa": dataclasses.replace(tc, num_query_groups=2)}[variant]
    other = GPTModel(config=tc, transformer_layer_spec=get_gpt_layer_local_spec(normalization=tc.normalization),
                     vocab_size=384, max_sequence_length=32,
                     position_embedding_type="rope" if variant == "rope" else "learned_absolute")
    with pytest.raises(conversion.ConversionError, match=reason):
        conversion.megatron_to_hf_state_dict(other.state_dict(), cfg)  # metadata claiming GPT-2 does not help
    meta = {**cfg.to_metadata(), "position_embedding_type": "rope", "normalization": "RMSNorm", "num_query_groups": 2}
    with pytest.raises(conversion.ConversionError) as err:
        conversion.check_architecture(meta)
    assert all(word in str(err.value) for word in ("RoPE", "RMSNorm", "grouped-query"))


def test_unknown_missing_and_inconsistent_keys_are_listed(plain_checkpoint):
    _, model, cfg = plain_checkpoint
    sd = model.state_dict()
    with pytest.raises(conversion.ConversionError, match=r"unknown keys \(1\): \['decoder.layers.0.mlp.router.weight'\]"):
        conversion.megatron_to_hf_state_dict({**sd, "decoder.layers.0.mlp.router.weight": torch.zeros(2, 48)}, cfg)
    missing = {k: v for k, v in sd.items() if k != "decoder.layers.1.pre_mlp_layernorm.bias"}
    with pytest.raises(conversion.ConversionError, match=r"missing keys \(1\): \['decoder.layers.1.pre_mlp_layernorm.bias'\]"):
        conversion.megatron_to_hf_state_dict(missing, cfg)
    with pytest.raises(conversion.ConversionError, match="missing keys .*output_layer.weight"):
        conversion.megatron_to_hf_state_dict(sd, tiny(share_embeddings_and_output_weights=False))
    untied = {**sd, "output_layer.weight": torch.randn_like(sd["embedding.word_embeddings.weight"])}
    with pytest.raises(conversion.ConversionError, match="tied_embeddings=False"):
        conversion.megatron_to_hf_state_dict(untied, cfg)
    with pytest.raises(conversion.ConversionError, match="fewer than the tokenizer"):
        conversion.megatron_to_hf_state_dict(sd, cfg, vocab_size=400)


def test_bad_paths_and_tokenizers_are_clear_errors(plain_checkpoint, tokenizer_dir, tmp_path):
    path, _, cfg = plain_checkpoint
    with pytest.raises(FileNotFoundError, match="does not exist"):
        conversion.convert_to_hf(tmp_path / "nowhere", tmp_path / "out")
    (tmp_path / "empty").mkdir()
    with pytest.raises(conversion.ConversionError, match="not a megatron-core checkpoint"):
        conversion.convert_to_hf(tmp_path / "empty", tmp_path / "out")
    (tmp_path / "notes.txt").write_text("hello")
    with pytest.raises(conversion.ConversionError, match="not a .pt/.pth state dict"):
        conversion.convert_to_hf(tmp_path / "notes.txt", tmp_path / "out")
    lone = tmp_path / "lone"
    lone.mkdir()
    shutil.copy(path, lone / "model.pt")
    with pytest.raises(conversion.ConversionError, match="pass model_config="):
        conversion.convert_to_hf(lone / "model.pt", tmp_path / "out")
    partial = tmp_path / "partial_tokenizer"
    partial.mkdir()
    for name in ("vocab.json", "merges.txt"):
        shutil.copy(tokenizer_dir / name, partial / name)
    with pytest.raises(FileNotFoundError, match=r"lacks \['tokenizer.json', 'tokenizer_config.json'\]"):
        conversion.convert_to_hf(path, tmp_path / "out", tokenizer_dir=partial)
    small = tokenizer_lib.train_tokenizer(["def f(x):\n    return x + 1\n"] * 50, tmp_path / "small", vocab_size=280)
    with pytest.raises(conversion.ConversionError, match="pass the tokenizer folder that training used"):
        conversion.convert_to_hf(path, tmp_path / "out", tokenizer_dir=small)
    assert not (tmp_path / "out").exists(), "a failed conversion leaves no output folder"


# --------------------------------------------------------------------------- a real (tiny) training run
@pytest.fixture(scope="module")
def trained_run(tmp_path_factory):
    """What notebooks 01 and 03 leave: 60 stdlib files, BPE of 300 entries, 6 iterations of a 2-layer GPT."""
    from helpers.runner import data_stage, launch
    from helpers.learn.training_config import TrainingConfig

    run = tmp_path_factory.mktemp("run")
    paths = data_stage.build_data(run, max_files=60, vocab_size=VOCAB, split="90,10,0", progress=False)
    cfg = TrainingConfig(
        run_dir=str(run), model=tiny(vocab_size=paths.vocab_size), split=paths.split, micro_batch_size=4,
        global_batch_size=8, train_iters=6, lr_warmup_iters=1, lr_decay_iters=6, eval_interval=3, eval_iters=2,
        save_interval=6, log_interval=3)
    result = launch.train(cfg, timeout_s=600, progress=False)
    assert result.summary["iterations"] == 6
    return run, cfg.checkpoint_path, result


def test_training_run_converts_with_its_validation_loss(trained_run):
    run, ckpt_dir, result = trained_run
    conv = conversion.convert_to_hf_cached(ckpt_dir, run / "hf_model")
    assert not conv.skipped and conv.iteration == 6 and conv.output_dir == run / "hf_model"
    again = conversion.convert_to_hf_cached(ckpt_dir, run / "hf_model")
    assert again.skipped and again.num_parameters == conv.num_parameters and again.vocab_size == conv.vocab_size
    megatron_model, _ = checkpointing.load_model(ckpt_dir)
    hf = AutoModelForCausalLM.from_pretrained(conv.output_dir, dtype=torch.float32).eval()
    ids = proofs.validation_tokens(run, num_samples=2)
    assert ids.shape == (2, 32)
    assert proofs.compare_logits(proofs.megatron_logits(megatron_model, ids), proofs.hf_logits(hf, ids)).max_abs_diff <= 1e-4
    val = proofs.compare_validation_loss(run, hf, megatron_model, iteration=6)
    assert val.training_loss == pytest.approx(result.summary["final_valid_loss"], abs=0)
    assert abs(val.megatron_loss - val.training_loss) <= 1e-5
    assert abs(val.hf_loss - val.megatron_loss_real_vocab) <= 1e-5
    assert val.padded_columns == 84 and val.training_loss - val.hf_loss > 1e-3  # padding columns' share, see above
    moved = run.parent / (run.name + "_moved")
    shutil.copytree(run, moved)
    away = run / "data" / "tokenizer_away"
    (run / "data" / "tokenizer").rename(away)  # the path recorded in model_config.json no longer exists
    try:
        redo = conversion.convert_to_hf(moved / "checkpoints", moved / "hf_again")
    finally:
        away.rename(run / "data" / "tokenizer")
    assert proofs.compare_hf_folders(conv.output_dir, redo.output_dir)["identical"]


def test_the_conversion_cache_follows_a_checkpoint_written_again_at_the_same_iteration(tmp_path, tokenizer_dir):
    """Review (issue 28): a run trained again into the same folder (another architecture, the same iteration) must be
    converted again, not served from the earlier conversion's cache."""
    first_cfg, second_cfg = tiny(), tiny(num_layers=1)
    for cfg, seed in ((first_cfg, 1), (second_cfg, 2)):
        gpt = proofs.randomized_model(cfg, seed=seed)
        checkpointing.save_model(gpt, tmp_path / "ckpt", 3, {**cfg.to_metadata(), "tokenizer_dir": str(tokenizer_dir)})
        conv = conversion.convert_to_hf_cached(tmp_path / "ckpt", tmp_path / "hf")
        assert not conv.skipped and json.loads((tmp_path / "hf" / "config.json").read_text())["n_layer"] == cfg.num_layers
    assert conversion.convert_to_hf_cached(tmp_path / "ckpt", tmp_path / "hf").skipped


def test_continuation_starts_from_the_transformers_weights(trained_run, tmp_path):
    """Notebook 06 sections 12-13: HF -> megatron-core checkpoint with a fresh optimizer -> back, bit for bit."""
    run, ckpt_dir, _ = trained_run
    hf_dir = conversion.convert_to_hf_cached(ckpt_dir, tmp_path / "hf").output_dir
    cont = conversion_way_back.continuation_config(run, tmp_path / "continued", 2)
    assert cont.train_iters == 2 and cont.lr == cont.min_lr and cont.lr_decay_style == "constant"
    folder = conversion_way_back.hf_to_megatron_checkpoint(hf_dir, cont.checkpoint_path, training_config=cont)
    assert folder == checkpointing.iteration_dir(cont.checkpoint_path, 0)
    back = conversion.convert_to_hf(cont.checkpoint_path, tmp_path / "back", iteration=0)
    assert proofs.compare_hf_folders(hf_dir, back.output_dir)["identical"]
    with pytest.raises(conversion.ConversionError, match="does not describe the transformers model"):
        conversion_way_back.hf_to_megatron_checkpoint(
            hf_dir, tmp_path / "other", training_config=dataclasses.replace(cont, model=tiny(num_layers=3)))
    with pytest.raises(ValueError, match="train_iters=0"):
        conversion_way_back.continuation_config(run, tmp_path / "x", 0)


def test_megatron_lms_loop_starts_from_the_way_back_with_the_transformers_weights(trained_run, tmp_path):
    """The way back writes the weights only; Megatron-LM's loop starts from them with --pretrained-checkpoint
    (a fresh optimizer, iteration 0): its first loss, before any update, is the transformers model's on the
    same training samples (notebook 06, section 13)."""
    from helpers.learn import dataloader
    from helpers.runner import launch

    run, ckpt_dir, _ = trained_run
    hf_dir = conversion.convert_to_hf_cached(ckpt_dir, tmp_path / "hf").output_dir
    cont = conversion_way_back.continuation_config(run, tmp_path / "continued", 2)
    assert cont.pretrained_checkpoint == str(tmp_path / "continued" / "from_transformers")
    conversion_way_back.hf_to_megatron_checkpoint(hf_dir, cont.pretrained_checkpoint, training_config=cont)
    assert checkpointing.read_model_config(cont.pretrained_checkpoint)["model_only"] is True
    out = launch.train(cont, timeout_s=600, progress=False)
    assert out.summary["iterations"] == 2 and checkpointing.latest_iteration(cont.checkpoint_path) == 2
    assert any("attempting to finetune with checkpoint in" in line for line in out.log)  # Megatron-LM's own words
    hf = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()
    start, _ = checkpointing.load_model(cont.pretrained_checkpoint)  # the way back's weights, padded rows included
    train_ds = dataloader.build_run_datasets(cont)[0]
    kw = dict(num_samples=cont.global_batch_size, micro_batch_size=cont.micro_batch_size)
    hf_loss = proofs.validation_loss(lambda t: proofs.hf_logits(hf, t), train_ds, **kw)
    mc_loss = proofs.validation_loss(lambda t: proofs.megatron_logits(start, t), train_ds, **kw)
    mc_real = proofs.validation_loss(lambda t: proofs.megatron_logits(start, t), train_ds, vocab_size=VOCAB, **kw)
    assert abs(out.metrics["iteration"][0]["lm_loss"] - mc_loss) < 1e-5  # Megatron-LM's iteration 1: those weights
    assert abs(hf_loss - mc_real) < 1e-5  # and transformers scores them alike over the real vocabulary