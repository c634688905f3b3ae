"""helpers.learn.training_config: what TrainingConfig.check() refuses, without training."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest

from helpers.learn import dataloader, training_config

CFG = training_config.TrainingConfig()


@pytest.mark.parametrize("bad, match", [
    (dict(train_iters=2.5), r"^train_iters=2.5 is a float, not int \(e.g. 1000\)"),  # blamed lr_warmup_iters before
    (dict(micro_batch_size="4"), r"^micro_batch_size='4' is a str, not int"),  # a bare "unsupported operand" before
    (dict(global_batch_size=True), r"^global_batch_size=True is a bool, not int"),
    (dict(save_interval=2.5), r"^save_interval=2.5 is a float, not int \| None \(e.g. 250\)"),
    (dict(lr="1e-3"), r"^lr='1e-3' is a str, not float"),
    (dict(override_opt_param_scheduler="false"), r"^override_opt_param_scheduler='false' is a str, not bool"),
    (dict(pretrained_checkpoint=3), r"^pretrained_checkpoint=3 is a int, not str \| None"),
    (dict(model=replace(CFG.model, num_layers=2.0)), r"^model.num_layers=2.0 is a float, not int \(e.g. 4\)"),
    (dict(expert_model_parallel_size=2.0), r"^expert_model_parallel_size=2.0 is a float, not int \(e.g. 1\)"),
])
def test_fields_of_another_type_are_refused_naming_the_field(bad, match):
    with pytest.raises(TypeError, match=match):
        replace(CFG, **bad).check()


def test_numbers_of_the_right_kind_pass_the_type_check(tmp_path):
    """An int for a float field and None for an optional int are fine: check() goes on to the data."""
    cfg = replace(CFG, run_dir=str(tmp_path), lr=1, min_lr=0, save_interval=None, lr_decay_iters=np.int64(200))
    with pytest.raises(FileNotFoundError, match="run notebook 01"):
        cfg.check()


@pytest.mark.parametrize("split", ["nan,1,1", "inf,1,1", "1e400,1,1"])
def test_a_non_finite_split_weight_is_refused_by_check(tmp_path, monkeypatch, split):
    prefix = tmp_path / "corpus"
    for ext in (".bin", ".idx"):
        (tmp_path / f"corpus{ext}").write_bytes(b"")
    monkeypatch.setattr(dataloader, "_sequence_lengths", lambda _: np.full(100, 5))
    with pytest.raises(ValueError, match=rf"^split={split!r}: the weights \['{split.split(',')[0]}'\] are not plain"):
        replace(CFG, data_prefix=str(prefix), split=split).check()


def test_a_copied_run_folder_reads_its_own_paths_not_the_originals(tmp_path):
    """A breaker copied a run folder: its run.json still named the original folder's checkpoints and data."""
    original, copy = tmp_path / "a", tmp_path / "b"
    cfg = training_config.profile("cpu", str(original), checkpoint_dir=str(original / "ck"),
                                  data_prefix=str(tmp_path / "shared" / "data"))
    cfg.to_json(original / "run.json")
    copy.mkdir()
    (copy / "run.json").write_text((original / "run.json").read_text())
    moved = training_config.TrainingConfig.from_json(copy / "run.json")
    assert moved.run_path == copy.resolve() and moved.checkpoint_path == copy.resolve() / "ck"
    assert moved.tokenizer_path == copy.resolve() / "data" / "tokenizer"
    assert moved.data_prefix_path == tmp_path / "shared" / "data"  # outside the run folder: not moved
    assert training_config.TrainingConfig.from_json(original / "run.json") == cfg
