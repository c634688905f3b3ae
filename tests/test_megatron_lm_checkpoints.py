"""Checkpoints written the way Megatron-LM writes them, converted exactly (helpers.learn.megatron_lm).

Each test builds a tiny GPT (2 layers, hidden 64, 4 heads, vocabulary 300 padded to 384 or 512
rows) with every weight random, writes it in one of Megatron-LM's layouts
(``megatron/training/checkpointing.py``: ``iter_NNNNNNN/mp_rank_XX/model_optim_rng.pt`` with the
old ``language_model.*`` names or megatron-core names, or a torch_dist folder from
``dist_checkpointing.save`` with the ``args`` in its common state), converts it and compares the
transformers model with the megatron-core model the weights came from: logits, greedy tokens,
validation loss. Then the refusals.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import enum
import io
import json
import os
import re
import sys
import types

import pytest
import torch
from test_conversion import VOCAB, randomized_model, tokenizer_dir, tokens, weights  # noqa: F401  (a fixture)
from transformers import AutoModelForCausalLM

from helpers.learn import conversion, megatron_lm
from helpers.support import safe_load
from helpers.learn import model as model_lib
from helpers.demos import conversion_proofs as proofs
from helpers.demos import generation
from helpers.demos.megatron_lm_layout import WE, mlm_args, old_model_dict, write_legacy

pytestmark = [pytest.mark.trains, pytest.mark.timeout(300)]

COLUMN_PARALLEL = ("self_attention.linear_qkv.weight", "self_attention.linear_qkv.bias", "mlp.linear_fc1.weight",
                   "mlp.linear_fc1.bias", WE, "output_layer.weight")
ROW_PARALLEL = ("self_attention.linear_proj.weight", "mlp.linear_fc2.weight")


def cfg_of(gelu: str = "tanh", tied: bool = True) -> model_lib.ModelConfig:
    return model_lib.ModelConfig(num_layers=2, hidden_size=64, num_attention_heads=4, seq_length=32,
                                 max_position_embeddings=32, vocab_size=VOCAB, bias_activation_fusion=gelu == "tanh",
                                 share_embeddings_and_output_weights=tied)


@contextlib.contextmanager
def old_megatron_enums():
    """``megatron.model.enums`` as 2022's Megatron-LM had it, importable only inside the block (as when saving)."""
    class ModelType(enum.Enum):
        encoder_or_decoder = 1

    ModelType.__module__, ModelType.__qualname__ = "megatron.model.enums", "ModelType"
    package, module = types.ModuleType("megatron.model"), types.ModuleType("megatron.model.enums")
    module.ModelType = ModelType
    sys.modules.update({"megatron.model": package, "megatron.model.enums": module})
    try:
        yield ModelType
    finally:
        del sys.modules["megatron.model"], sys.modules["megatron.model.enums"]




def split_tensor_parallel(sd: dict, tp: int, rows: int, seed: int = 0) -> list[dict]:
    """Megatron's TP layout of a local-spec state dict: embedding padded to ``rows``, column/row-parallel chunks."""
    gen = torch.Generator().manual_seed(seed)
    sd = {k: torch.cat([v, torch.randn(rows - v.shape[0], v.shape[1], generator=gen)]) if k in (WE, "output_layer.weight")
          else v for k, v in sd.items()}
    shards = [{} for _ in range(tp)]
    for key, value in sd.items():
        name = re.sub(r"^decoder\.layers\.\d+\.", "", key)
        dim = 0 if name in COLUMN_PARALLEL else 1 if name in ROW_PARALLEL else None
        for rank in range(tp):
            shards[rank][key] = value.chunk(tp, dim)[rank].clone() if dim is not None else value.clone()
    return shards


def assert_exact(hf_dir, model, seed: int = 3) -> None:
    """Logits, greedy tokens and validation loss of the converted model equal megatron-core's."""
    hf = AutoModelForCausalLM.from_pretrained(hf_dir).eval()
    ids = tokens(seq=32, seed=seed)
    reference = proofs.megatron_logits(model, ids)
    cmp = proofs.compare_logits(reference, proofs.hf_logits(hf, ids))
    assert cmp.max_abs_logit > 1.0 and cmp.max_abs_diff <= 1e-4 and cmp.argmax_agreement == 1.0
    prompt = [5, 17, 42, 7]
    assert generation.greedy_generate(model, prompt, 10, vocab_size=VOCAB)[len(prompt):] == \
        generation.greedy_generate_hf(hf, prompt, 10)
    ids = tokens(batch=4, seq=33, seed=seed + 1)
    data = [{"tokens": ids[i, :-1], "labels": ids[i, 1:], "loss_mask": torch.ones(32)} for i in range(4)]
    kw = dict(num_samples=4, micro_batch_size=2)
    hf_loss = proofs.validation_loss(lambda t: proofs.hf_logits(hf, t), data, **kw)
    mc_loss = proofs.validation_loss(lambda t: proofs.megatron_logits(model, t), data, vocab_size=VOCAB, **kw)
    assert abs(hf_loss - mc_loss) <= 1e-5


# --------------------------------------------------------------------------- the legacy format
@pytest.mark.parametrize("version,tp,gelu,era,where", [
    (3.0, 1, "tanh", "2022", "iter"),  # the guide's era: --bias-gelu-fusion (the default), old model's names
    (1.0, 2, "openai", "2022", "iter"),  # [heads, d, 3] rows per rank, merged from mp_rank_00 + mp_rank_01
    (0, 1, "erf", "2022", "release"),  # [3, heads, d] rows, 'transformer'/'attention' names, a release folder
], ids=["v3-tp1-fused-gelu", "v1-tp2-openai-gelu", "v0-release-erf"])
def test_old_megatron_lm_names_convert_exactly(tmp_path, tokenizer_dir, version, tp, gelu, era, where):
    cfg = cfg_of("erf" if gelu == "erf" else "tanh")
    model = randomized_model(cfg, seed=11)
    flags = {"tanh": {}, "openai": dict(openai_gelu=True, bias_gelu_fusion=False), "erf": dict(bias_gelu_fusion=False)}
    shards = [old_model_dict(s, version, cfg.num_attention_heads // tp)
              for s in split_tensor_parallel(weights(model), tp, cfg.padded_vocab_size(tp))]
    with old_megatron_enums() as old_model_type:
        args = mlm_args(cfg, tokenizer_dir, tp, era, model_type=old_model_type.encoder_or_decoder, **flags[gelu])
        save = write_legacy(tmp_path / "codeparrot-small", shards, args, version, folder="release" if where == "release" else None)
    found = conversion.find_checkpoint(save)
    assert found[0].name == ("release" if where == "release" else "iter_0000005") and found[2] == "torch"
    result = conversion.convert_to_hf(save, tmp_path / "hf")  # the tokenizer: args.vocab_file's folder
    info = json.loads((tmp_path / "hf" / conversion.CONVERSION_FILE).read_text())
    assert info["format"] == "torch" and info["iteration"] == 5 and info["tensor_model_parallel_size"] == tp
    assert result.activation_function == ("gelu" if gelu == "erf" else "gelu_new")
    assert result.padded_rows_removed == cfg.padded_vocab_size(tp) - VOCAB
    assert_exact(tmp_path / "hf", model)


def test_megatron_core_names_in_the_torch_format_via_the_command_line(tmp_path, tokenizer_dir, capsys):
    """Today's Megatron-LM with --ckpt-format torch: megatron-core names (Transformer Engine layer norms,
    _extra_state BytesIO), untied output layer, TP=2; the file path of mp_rank_00 stands for both ranks."""
    cfg = cfg_of("tanh", tied=False)
    model = randomized_model(cfg, seed=12)
    shards = split_tensor_parallel(weights(model), 2, cfg.padded_vocab_size(2))
    te = {"input_layernorm": "self_attention.linear_qkv.layer_norm", "pre_mlp_layernorm": "mlp.linear_fc1.layer_norm"}
    for shard in shards:
        for key in list(shard):
            if m := re.match(r"^(decoder\.layers\.\d+\.)(input_layernorm|pre_mlp_layernorm)\.(weight|bias)$", key):
                shard[f"{m[1]}{te[m[2]]}_{m[3]}"] = shard.pop(key)
            if key.endswith("linear_fc2.weight"):
                shard[key.replace(".weight", "._extra_state")] = io.BytesIO(b"te fp8 metadata")
    save = write_legacy(tmp_path / "gpt", shards, mlm_args(cfg, tokenizer_dir, 2), iteration=40)
    rank0 = save / "iter_0000040" / "mp_rank_00" / megatron_lm.MODEL_FILE
    assert conversion.main([str(rank0), str(tmp_path / "hf"), "--tokenizer-dir", str(tokenizer_dir)]) == 0
    assert "wrote" in capsys.readouterr().out
    ckpt = conversion.load_megatron_checkpoint(rank0)
    assert ckpt.iteration == 40 and ckpt.meta["tied_embeddings"] is False and len(ckpt.extra_state_keys) == 2
    assert "optimizer" in ckpt.non_model_keys and ckpt.state_dict[WE].shape == (512, 64)
    assert_exact(tmp_path / "hf", model, seed=5)


# --------------------------------------------------------------------------- torch_dist
@pytest.mark.parametrize("common", ["common_state", "common.pt"])
def test_megatron_lm_torch_dist_converts_exactly(tmp_path, tokenizer_dir, common):
    """generate_state_dict -> dist_checkpointing.save, as save_checkpoint does: the model's ShardedTensors
    under "model" plus args, checkpoint_version, iteration...; megatron-core 0.19 keeps those in the .distcp
    files (common_state), earlier versions in common.pt."""
    from megatron.core import dist_checkpointing

    cfg = cfg_of("tanh")
    model = randomized_model(cfg, seed=13)
    folder = tmp_path / "save" / "iter_0000007"
    folder.mkdir(parents=True)
    extra = {"args": mlm_args(cfg, tokenizer_dir, ckpt_format="torch_dist"), "checkpoint_version": 3.0, "iteration": 7,
             "opt_param_scheduler": {"num_steps": 56}, "num_floating_point_operations_so_far": 2.0e12}
    dist_checkpointing.save({"model": model.sharded_state_dict(), **({} if common == "common.pt" else extra)}, str(folder))
    if common == "common.pt":
        torch.save(extra, folder / "common.pt")
    (tmp_path / "save" / "latest_checkpointed_iteration.txt").write_text("7")
    assert (folder / ".metadata").is_file() and not (folder / "model_config.json").exists()
    assert dist_checkpointing.load_common_state_dict(str(folder))["args"].num_layers == 2  # megatron-core reads it too
    ckpt = conversion.load_megatron_checkpoint(tmp_path / "save")
    assert ckpt.format == "torch_dist" and ckpt.iteration == 7 and ckpt.meta["written_by"] == "Megatron-LM"
    assert all(torch.equal(ckpt.state_dict[k], v) for k, v in weights(model).items())
    conversion.convert_to_hf(ckpt, tmp_path / "hf", tokenizer_dir=tokenizer_dir)
    assert_exact(tmp_path / "hf", model, seed=7)
    if common == "common_state":  # damaged and crafted copies of the same folder
        _check_damaged_and_crafted_metadata(folder, tmp_path)


def _check_damaged_and_crafted_metadata(folder, tmp_path) -> None:
    """A truncated shard or .metadata is a ConversionError; a .metadata whose pickle calls os.system
    is refused without running it (torch's FileSystemReader would run it: plain pickle.load)."""
    import pickle
    import shutil

    for name in (".metadata", "__0_0.distcp"):
        broken = tmp_path / f"broken{name}" / "iter_0000007"
        shutil.copytree(folder, broken)
        data = (broken / name).read_bytes()
        (broken / name).write_bytes(data[:len(data) // 2])
        with pytest.raises(conversion.ConversionError, match="cannot be read"):
            conversion.load_megatron_checkpoint(broken)
    marker = tmp_path / "ran"

    class Payload:
        def __reduce__(self):
            return (os.system, (f"touch {marker}",))

    crafted = tmp_path / "crafted" / "iter_0000007"
    shutil.copytree(folder, crafted)
    (crafted / ".metadata").write_bytes(pickle.dumps(Payload()))
    with pytest.raises(conversion.ConversionError, match=r"\.metadata names posix.system.*--no-weights-only"):
        conversion.load_megatron_checkpoint(crafted)
    assert not marker.exists()


# --------------------------------------------------------------------------- refusals
@pytest.mark.parametrize("override,named", [
    (dict(swiglu=True), "swiglu=True"), (dict(normalization="RMSNorm"), "normalization='RMSNorm'"),
    (dict(position_embedding_type="rope"), "position_embedding_type='rope'"),
    (dict(group_query_attention=True, num_query_groups=2), "num_query_groups=2"),
    (dict(add_bias_linear=False), "add_bias_linear=False"), (dict(num_experts=8), "num_experts=8"),
    (dict(window_size=(16, 0)), "window_size=(16, 0)"), (dict(qk_l2_norm=True), "qk_l2_norm=True"),
    (dict(use_mup=True), "use_mup=True"), (dict(softmax_type="off-by-one"), "softmax_type='off-by-one'"),
    (dict(attention_output_gate=True), "attention_output_gate=True"),
])
def test_architectures_gpt2_lacks_are_refused_by_argument(tokenizer_dir, override, named):
    args = mlm_args(cfg_of(), tokenizer_dir, **override)
    with pytest.raises(conversion.ConversionError, match=re.escape(named)):
        megatron_lm.metadata_from_args(args)
    assert megatron_lm.metadata_from_args(mlm_args(cfg_of(), tokenizer_dir))["gelu"] == "tanh"  # num_query_groups=1 is fine


def test_a_refused_checkpoint_fails_on_the_command_line_with_the_reason(tmp_path, tokenizer_dir, capsys):
    cfg = cfg_of()
    save = write_legacy(tmp_path / "rope", [weights(randomized_model(cfg))], mlm_args(cfg, tokenizer_dir, position_embedding_type="rope"))
    assert conversion.main([str(save), str(tmp_path / "hf")]) == 2
    assert "position_embedding_type='rope'" in capsys.readouterr().err and not (tmp_path / "hf").exists()


def test_weights_only_refuses_other_objects_and_false_reads_them(tmp_path, tokenizer_dir):
    cfg = cfg_of()
    model = randomized_model(cfg, seed=14)
    save = write_legacy(tmp_path / "gpt", [weights(model)], mlm_args(cfg, tokenizer_dir, started=datetime.date(2022, 6, 1)))
    with pytest.raises(conversion.ConversionError, match=r"\['datetime.date'\].*runs code.*weights_only=False"):
        conversion.load_megatron_checkpoint(save)
    ckpt = conversion.load_megatron_checkpoint(save, weights_only=False)
    assert torch.equal(ckpt.state_dict[WE][:VOCAB], weights(model)[WE][:VOCAB])
    with old_megatron_enums() as old:  # a module no longer installed: stand-ins with weights_only=False too
        torch.save({"args": argparse.Namespace(model_type=old.encoder_or_decoder)}, tmp_path / "old.pt")
    loaded = safe_load.load_pickle(tmp_path / "old.pt", weights_only=False)
    assert loaded["args"].model_type.qualified_name == "megatron.model.enums.ModelType"
    assert argparse.Namespace in torch.serialization.get_safe_globals(), "megatron.core's registration was removed"


def test_missing_ranks_pipeline_parallelism_and_bad_trackers_are_clear_errors(tmp_path, tokenizer_dir):
    cfg = cfg_of()
    sd = weights(randomized_model(cfg))
    save = write_legacy(tmp_path / "tp2", [sd], mlm_args(cfg, tokenizer_dir, tp=2))  # args say TP=2, one rank saved
    with pytest.raises(conversion.ConversionError, match=r"tensor_model_parallel_size=2 but 1 rank file"):
        conversion.load_megatron_checkpoint(save)
    (save / "iter_0000005" / "mp_rank_00" / megatron_lm.MODEL_FILE).rename(tmp_path / "away.pt")
    with pytest.raises(conversion.ConversionError, match=r"mp_rank_00/model_optim_rng.pt'\] missing"):
        conversion.load_megatron_checkpoint(save)
    pp = tmp_path / "pp" / "iter_0000005"
    for name in ("mp_rank_00_000", "mp_rank_00_001"):
        (pp / name).mkdir(parents=True)
        torch.save({"model": {}}, pp / name / megatron_lm.MODEL_FILE)
    with pytest.raises(conversion.ConversionError, match=r"pipeline- \(mp_rank_TT_PPP\).*--target-pipeline-parallel-size 1"):
        conversion.load_megatron_checkpoint(pp)
    (tmp_path / "gone").mkdir()
    (tmp_path / "gone" / "latest_checkpointed_iteration.txt").write_text("release")
    with pytest.raises(FileNotFoundError, match="names release, which is missing"):
        conversion.load_megatron_checkpoint(tmp_path / "gone")
    with pytest.raises(conversion.ConversionError, match=r"checkpoint_version=1.5"):
        megatron_lm.qkv_rows_to_current(torch.zeros(12, 4), 1.5, 1)


def test_old_argument_names_missing_sizes_and_relative_paths_in_args(tokenizer_dir):
    """Before checkpoint_version 3.0 the TP size was model_parallel_size (Megatron-LM check_checkpoint_args);
    a missing size is named as missing; a relative vocab_file cannot be found from here, so it is not used."""
    args = mlm_args(cfg_of(), tokenizer_dir, tp=2, era="2022")
    del args.tensor_model_parallel_size
    args.model_parallel_size = 2
    meta = megatron_lm.metadata_from_args(args)
    assert meta["tensor_model_parallel_size"] == 2 and meta["vocab_size_range"] == [257, 512]
    del args.hidden_size
    with pytest.raises(conversion.ConversionError, match=r"lack \['hidden_size'\]"):
        megatron_lm.metadata_from_args(args)
    relative = megatron_lm.metadata_from_args(mlm_args(cfg_of(), tokenizer_dir, vocab_file="vocab.json"))
    assert relative["tokenizer_dir"] is None


def test_a_gap_in_the_rank_folders_and_per_rank_extra_state(tmp_path, tokenizer_dir):
    cfg = cfg_of()
    shards = split_tensor_parallel(weights(randomized_model(cfg)), 2, cfg.padded_vocab_size(2))
    save = write_legacy(tmp_path / "gap", shards, mlm_args(cfg, tokenizer_dir, tp=2))
    (save / "iter_0000005" / "mp_rank_01").rename(save / "iter_0000005" / "mp_rank_02")
    with pytest.raises(conversion.ConversionError, match=r"not \['mp_rank_00', 'mp_rank_01'\]: a tensor-parallel rank is missing"):
        conversion.load_megatron_checkpoint(save)
    key = "decoder.layers.0.self_attention.linear_proj._extra_state"  # FP8 amax history: differs per rank
    merged = megatron_lm.merge_tensor_parallel([{key: torch.tensor([1], dtype=torch.uint8)},
                                                {key: torch.tensor([2], dtype=torch.uint8)}], "x")
    assert merged[key].tolist() == [1]


def test_args_that_do_not_describe_the_weights_are_named_so_not_as_another_architecture(tmp_path, tokenizer_dir):
    """hidden_size=128 in the args over 64-wide weights blamed grouped-query attention (a newcomer found that)."""
    cfg = cfg_of()
    save = write_legacy(tmp_path / "gpt", [weights(randomized_model(cfg))],
                        mlm_args(cfg, tokenizer_dir, hidden_size=128, kv_channels=32, ffn_hidden_size=512))
    with pytest.raises(conversion.ConversionError, match=r"do not match the model's description: linear_qkv is \[192, 64\] "
                                                         r"but hidden_size=128") as err:
        conversion.convert_to_hf(save, tmp_path / "hf")
    assert "grouped-query" not in str(err.value) and not (tmp_path / "hf").exists()
