"""helpers.learn.dataloader: GPTDataset samples and indices, the empty-split guard, cache, blending."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from helpers.learn import corpus, dataloader, preprocess
from helpers.runner import data_stage
from helpers.demos import dataset_indices
from helpers.demos import preprocessing as preprocessing_demo

SEQ = 32


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    run = tmp_path_factory.mktemp("dl") / "run"
    return data_stage.build_data(run, max_files=40, vocab_size=400, split="8,1,1", progress=False)


def _build(data, cache, **kw):
    kw.setdefault("num_samples", (200, 20, 10))
    return dataloader.build_gpt_datasets(data.data_prefix, data.tokenizer_dir, seq_length=SEQ,
                                         split=data.split, cache_dir=cache, **kw)


def test_split_ranges_match_megatron(data, tmp_path):
    n = data.num_documents
    ranges = preprocess.split_document_ranges(n, "8,1,1")
    assert ranges[0] == (0, round(0.8 * n)) and ranges[2][1] == n
    train, valid, test = _build(data, tmp_path)
    for ds, rng in zip((train, valid, test), ranges):
        assert ds.indices.tolist() == list(range(*rng))
    assert preprocess.split_document_ranges(300, "949,50,1")[2] == (300, 300)
    assert preprocess.split_document_ranges(10, "9,1,0")[2] is None
    with pytest.raises(ValueError, match="split="):
        preprocess.split_document_ranges(10, "a,b")


def test_samples_are_megatron_shaped_and_read_the_bin(data, tmp_path):
    train = _build(data, tmp_path)[0]
    ds = preprocess.open_indexed_dataset(data.data_prefix)
    for i in (0, 5, len(train) - 1):
        s = train[i]
        assert sorted(s) == ["labels", "loss_mask", "position_ids", "tokens"]
        assert all(v.shape == (SEQ,) for v in s.values())
        assert s["tokens"].dtype == torch.int64 and s["loss_mask"].dtype == torch.float32
        assert torch.equal(s["tokens"][1:], s["labels"][:-1])
        assert torch.equal(s["position_ids"], torch.arange(SEQ)) and bool((s["loss_mask"] == 1).all())
        j = int(train.shuffle_index[i])
        parts = dataset_indices.sample_spans(train, [j])[0]
        window = np.concatenate([ds[doc][off:off + n] for doc, off, n in parts]).astype(np.int64)
        assert window.tolist() == s["tokens"].tolist() + [int(s["labels"][-1])]


def test_epochs_follow_the_requested_samples(data, tmp_path):
    one = dataset_indices.index_summary(_build(data, tmp_path / "one", num_samples=(10, 20, 10))[0])
    tokens = one["num_tokens_per_epoch"]
    assert one["num_epochs"] == 1 and one["num_samples"] == (tokens - 1) // SEQ
    for fraction, separate in ((2.5, True), (2.9, False)):
        request = int(fraction * tokens / SEQ)
        train = _build(data, tmp_path / str(fraction), num_samples=(request, 20, 10))[0]
        info = dataset_indices.index_summary(train)
        assert info["num_epochs"] == 3 == -(-(request * SEQ + 1) // tokens)
        assert info["separate_final_epoch"] is separate
        assert info["num_samples"] >= request
        assert info["document_index_len"] == 3 * info["num_documents"]
        assert sorted(np.asarray(train.shuffle_index).tolist()) == list(range(len(train)))
        assert len(info["cache_files"]) == 4


@pytest.mark.timeout(60)
def test_empty_split_guard_raises_promptly(data, tmp_path):
    with pytest.raises(ValueError, match=rf"gives the test split 0 of {data.num_documents} documents.*loop\s+forever"):
        dataloader.build_gpt_datasets(data.data_prefix, data.tokenizer_dir, seq_length=SEQ,
                                      split="969,30,1", num_samples=(10, 10, 0), cache_dir=tmp_path)
    assert not list(tmp_path.iterdir()), "nothing is built before the guard"
    with pytest.raises(ValueError, match="valid split 0 of 300"):
        dataloader.check_split(np.full(300, 5), "99999,1,0")
    with pytest.raises(ValueError, match="0 tokens"):
        dataloader.check_split(np.array([4, 4, 0]), "2,1")


def test_zero_weight_split_is_none(data, tmp_path):
    train, valid, test = dataloader.build_gpt_datasets(
        data.data_prefix, data.tokenizer_dir, seq_length=SEQ, split="9,1,0", num_samples=(10, 10, 0), cache_dir=tmp_path)
    assert test is None and len(train) >= 10 and len(valid) >= 10


def test_cache_is_reused(data, tmp_path):
    out = dataset_indices.timed_build_and_reuse(data.data_prefix, data.tokenizer_dir, tmp_path / "c",
                                           seq_length=SEQ, split=data.split, num_samples=(100, 10, 10))
    assert len(out["files_written"]) == 12 and out["files_after_reuse"] == out["files_written"]
    assert {f.split("-", 2)[2] for f in out["files_written"]} >= {"train-document_index.npy", "test-shuffle_index.npy"}
    mtimes = {p.name: p.stat().st_mtime_ns for p in (tmp_path / "c").iterdir()}
    _build(data, tmp_path / "c", num_samples=(100, 10, 10))
    assert {p.name: p.stat().st_mtime_ns for p in (tmp_path / "c").iterdir()} == mtimes
    with pytest.raises(FileExistsError, match="not empty"):
        dataset_indices.timed_build_and_reuse(data.data_prefix, data.tokenizer_dir, tmp_path / "c", seq_length=SEQ)


def test_bad_arguments(data, tmp_path):
    with pytest.raises(ValueError, match="num_samples"):
        _build(data, tmp_path, num_samples=(10, 10))
    with pytest.raises(ValueError, match="seq_length"):
        dataloader.build_gpt_datasets(data.data_prefix, data.tokenizer_dir, seq_length=0, split=data.split)
    with pytest.raises(FileNotFoundError, match="notebook 01"):
        dataloader.build_gpt_datasets(tmp_path / "missing", data.tokenizer_dir, seq_length=SEQ)


def test_megatron_num_samples():
    assert dataloader.megatron_num_samples(300, 8, 100, 10) == (2400, 320, 80)
    with pytest.raises(ValueError, match="eval_interval"):
        dataloader.megatron_num_samples(300, 8, 0, 10)


def test_tokenizer_adapter(data):
    tok = dataloader.MegatronTokenizerAdapter(data.tokenizer_dir)
    assert tok.vocab_size == 400 and tok.eod == 0 and tok.pad == -1
    assert tok.detokenize(tok.tokenize("def f():\n    pass\n")) == "def f():\n    pass\n"
    assert tok.unique_identifiers["sha256"] and tok.unique_identifiers["tokenizer_path"] == str(data.tokenizer_dir)


def test_blend_follows_the_weights(data, tmp_path):
    extra = preprocessing_demo.build_corpus_dataset(data.data_prefix.parent.parent, "email_pkg",
                                             source=corpus.stdlib_dir() / "email", progress=False)
    train, _, _ = dataloader.build_blended_gpt_datasets(
        [data.data_prefix, extra.data_prefix], [0.7, 0.3], data.tokenizer_dir, seq_length=SEQ,
        split="8,1,1", num_samples=(400, 20, 10), cache_dir=tmp_path)
    ids = np.asarray(train.dataset_index)
    assert len(train) == 400 and abs(float(np.mean(ids == 1)) - 0.3) < 0.01
    assert int(train[0]["dataset_id"]) == int(ids[0])
    assert not torch.distributed.is_initialized(), "the temporary process group is torn down"


def test_naive_loop_counts_epochs(data):
    ds = preprocess.open_indexed_dataset(data.data_prefix)
    lengths = np.array(ds.sequence_lengths)
    docs = list(range(*preprocess.split_document_ranges(len(lengths), data.split)[0]))
    per_epoch = (int(lengths[docs].sum()) - 1) // SEQ
    out = dataset_indices.naive_epoch_loop(lengths, docs, ds, seq_length=SEQ, num_samples=per_epoch * 2 + 1)
    assert out["epochs"] == 3 and out["samples"] == per_epoch * 2 + 1
    assert out["tokens_read"] == 3 * int(lengths[docs].sum())


def test_check_split_takes_a_document_count_and_names_the_empty_part():
    assert dataloader.check_split(10, "8,1,1") == [(0, 8), (8, 9), (9, 10)]
    with pytest.raises(ValueError, match=r"gives the valid split 0 of 3 documents"):
        dataloader.check_split(3, "969,30,1")
    assert dataloader.check_split(3, "1,0,0")[1:] == [None, None]
    with pytest.raises(ValueError, match="num_documents=-3 must be >= 0"):
        dataloader.check_split(-3, "1,1,1")


def test_check_split_names_the_callers_parameter():
    with pytest.raises(ValueError, match=r"^blend_split='90,9,1' gives the valid split 0 of 3 documents .range \[3, 3\)"):
        dataloader.check_split(3, "90,9,1", parameter="blend_split")




@pytest.mark.parametrize("split, odd", [("nan,1,1", "nan"), ("inf,1,1", "inf"), ("1e400,1,1", "1e400"),
                                        ("1e2,1", "1e2"), ("1, -inf", "-inf")])
def test_split_weights_megatron_would_misread_are_refused(split, odd):
    """megatron-core keeps only the digits and dots of --split: 'nan,1,1' and 'inf,1,1' gave
    [(0, 50), (50, 100), None] for 100 documents without a word, '1e2,1' three weights (1, 2, 1)
    and '1e400,1,1' a bare AssertionError."""
    with pytest.raises(ValueError, match=rf"^blend_split={split!r}: the weights \['{odd}'\] are not plain decimal"):
        dataloader.check_split(100, split, parameter="blend_split")
    assert dataloader.check_split(100, "9.5, .5") == [(0, 95), (95, 100), None]
