"""helpers.learn.preprocess: .bin/.idx round trip, dtype, workers, bad input, build_data idempotence."""

from __future__ import annotations

import importlib.util

import json
import os

import numpy as np
import pytest

from helpers.learn import corpus, encoders, preprocess, tokenizer
from helpers.runner import data_stage
from helpers.demos import preprocessing as preprocessing_demo


@pytest.fixture(scope="module")
def small(tmp_path_factory):
    """A 30-file stdlib corpus as loose JSON, and a 512-entry tokenizer trained on it."""
    root = tmp_path_factory.mktemp("pre")
    docs = corpus.collect_corpus(max_files=30, seed=3).documents
    jsonl = root / "codeparrot_data.json"
    corpus.write_jsonl(docs, jsonl)
    tok_dir = tokenizer.train_tokenizer([d.content for d in docs], root / "tokenizer", vocab_size=512)
    return root, jsonl, tok_dir, [d.content for d in docs]


def _mtimes(folder):
    return {str(p): p.stat().st_mtime_ns for p in sorted(folder.rglob("*")) if p.is_file()}


def test_bin_idx_round_trip(small, tmp_path):
    _, jsonl, tok_dir, texts = small
    stats = preprocess.tokenize_to_indexed_dataset(jsonl, tok_dir, tmp_path / "doc", num_workers=2, progress=False)
    ds = preprocess.open_indexed_dataset(tmp_path / "doc")
    fast = tokenizer.load_fast_tokenizer(tok_dir)
    assert len(ds) == stats.num_documents == len(texts)
    expected = [fast.encode(t).ids + [0] for t in texts]
    for i in range(len(texts)):
        assert ds[i].tolist() == expected[i]
    assert stats.num_tokens == sum(map(len, expected)) == int(ds.sequence_lengths.sum())
    assert stats.dtype == "uint16" and ds[0].dtype == np.uint16
    assert stats.bin_bytes == 2 * stats.num_tokens == (tmp_path / "doc.bin").stat().st_size
    assert stats.input_bytes == sum(len(t.encode()) for t in texts)
    assert stats.tokens_per_second > 0 and stats.megabytes_per_second > 0
    assert preprocessing_demo.verify_read_back(tmp_path / "doc", jsonl, tok_dir) == len(texts)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["doc.bin", "doc.idx"]


def test_workers_give_identical_files(small, tmp_path):
    _, jsonl, tok_dir, _ = small
    preprocess.tokenize_to_indexed_dataset(jsonl, tok_dir, tmp_path / "w0", num_workers=0, progress=False,
                                           engine="tokenizers")
    preprocess.tokenize_to_indexed_dataset(jsonl, tok_dir, tmp_path / "w2", num_workers=2, chunk_size=3, progress=False,
                                           engine="tokenizers")
    for ext in (".bin", ".idx"):
        assert (tmp_path / f"w0{ext}").read_bytes() == (tmp_path / f"w2{ext}").read_bytes()


def _files(prefix):
    return [open(f"{prefix}{ext}", "rb").read() for ext in (".bin", ".idx")]


@pytest.fixture
def tricky(small, tmp_path):
    """The small corpus plus documents that tokenizers treat specially, and one empty document."""
    _, _, tok_dir, texts = small
    extra = ["s = '<|endoftext|>'  # a literal EOD string inside code\n", "", "π = 3.14159  # naïve unicode 🙂\n",
             "\t\r\n  \n", "x" * 5000]
    jsonl = tmp_path / "tricky.json"
    jsonl.write_text("".join(json.dumps({"content": t}) + "\n" for t in extra[:2] + texts + extra[2:]))
    return jsonl, tok_dir, [t for t in extra[:2] + texts + extra[2:] if t]


@pytest.mark.skipif(encoders.resolve_engine() != "gigatoken", reason="gigatoken is not installed (requirements.txt pins it)")
@pytest.mark.parametrize("num_workers", [0, 1, 2])
def test_gigatoken_writes_the_same_files_as_tokenizers(tricky, tmp_path, monkeypatch, num_workers):
    jsonl, tok_dir, kept = tricky
    monkeypatch.setattr(encoders, "GIGATOKEN_BATCH_DOCUMENTS", 7)  # several batches, the last one short
    monkeypatch.delenv("RAYON_NUM_THREADS", raising=False)
    ref = preprocess.tokenize_to_indexed_dataset(jsonl, tok_dir, tmp_path / "ref", progress=False, engine="tokenizers")
    fast = preprocess.tokenize_to_indexed_dataset(jsonl, tok_dir, tmp_path / "fast", num_workers=num_workers,
                                                  progress=False, engine="gigatoken")
    assert (ref.engine, fast.engine) == ("tokenizers", "gigatoken")
    assert "RAYON_NUM_THREADS" not in os.environ, "the thread setting must not outlive the call"
    assert _files(tmp_path / "fast") == _files(tmp_path / "ref")
    assert (fast.num_documents, fast.num_skipped_empty, fast.num_tokens) == (len(kept), 1, ref.num_tokens)
    ds = preprocess.open_indexed_dataset(tmp_path / "fast")
    literal = ds[0].tolist()
    assert literal[-1] == 0 and 0 not in literal[:-1], "a literal <|endoftext|> must stay text, not become EOD"
    fast_tok = tokenizer.load_fast_tokenizer(tok_dir)
    assert [preprocessing_demo.decode_document(ds, i, tok_dir, tokenizer=fast_tok) for i in range(len(ds))] == kept


def test_auto_engine_and_bad_engine(small, tmp_path, monkeypatch):
    _, jsonl, tok_dir, _ = small
    with pytest.raises(ValueError, match=r"engine='rust': use one of 'auto', 'gigatoken', 'tokenizers'"):
        preprocess.tokenize_to_indexed_dataset(jsonl, tok_dir, tmp_path / "x", progress=False, engine="rust")
    with pytest.raises(ValueError, match=r"engine='rust'"):
        data_stage.build_data(tmp_path / "run", engine="rust")
    assert list(tmp_path.iterdir()) == []
    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "gigatoken" else real_find_spec(name, *a))
    assert encoders.resolve_engine("auto") == "tokenizers"
    with pytest.raises(ModuleNotFoundError, match=r"pip install -r requirements.txt \(or pass engine='tokenizers'\)"):
        preprocess.tokenize_to_indexed_dataset(jsonl, tok_dir, tmp_path / "x", progress=False, engine="gigatoken")
    stats = preprocess.tokenize_to_indexed_dataset(jsonl, tok_dir, tmp_path / "x", progress=False)
    assert stats.engine == "tokenizers" and (tmp_path / "x.bin").is_file()


def test_large_vocab_uses_int32(small, tmp_path, monkeypatch):
    _, jsonl, tok_dir, _ = small
    monkeypatch.setattr(tokenizer, "vocab_size_of", lambda _: 70_000)
    stats = preprocess.tokenize_to_indexed_dataset(jsonl, tok_dir, tmp_path / "big", progress=False)
    assert stats.dtype == "int32" and stats.bin_bytes == 4 * stats.num_tokens


def test_empty_documents_are_skipped_and_counted(small, tmp_path):
    _, _, tok_dir, _ = small
    jsonl = tmp_path / "in.json"
    jsonl.write_text("\n".join(json.dumps({"content": c}) for c in ["a = 1\n", "", "b = 2\n"]) + "\n")
    stats = preprocess.tokenize_to_indexed_dataset(jsonl, tok_dir, tmp_path / "e", progress=False)
    assert stats.num_documents == 2 and stats.num_skipped_empty == 1


def test_missing_output_folder_and_no_overwrite(small, tmp_path):
    _, jsonl, tok_dir, _ = small
    with pytest.raises(FileNotFoundError, match="does not exist; create it"):
        preprocess.tokenize_to_indexed_dataset(jsonl, tok_dir, tmp_path / "nope" / "doc", progress=False)
    preprocess.tokenize_to_indexed_dataset(jsonl, tok_dir, tmp_path / "doc", progress=False)
    before = _mtimes(tmp_path)
    with pytest.raises(FileExistsError, match="overwrite=True"):
        preprocess.tokenize_to_indexed_dataset(jsonl, tok_dir, tmp_path / "doc", progress=False)
    assert _mtimes(tmp_path) == before


@pytest.mark.parametrize("second_line, message", [
    ('{"content": oops}', r"bad\.json:2: line 2 is not valid JSON"),
    ('{"content": "b = \\ud800"}', r"bad\.json:2: line 2: 'content' holds an unpaired surrogate"),
], ids=["not-json", "unpaired-surrogate"])
def test_bad_json_line_is_named_and_leaves_nothing_behind(small, tmp_path, second_line, message):
    _, _, tok_dir, _ = small
    jsonl = tmp_path / "bad.json"
    jsonl.write_text('{"content": "a = 1"}\n' + second_line + "\n")
    with pytest.raises(ValueError, match=message):
        preprocess.tokenize_to_indexed_dataset(jsonl, tok_dir, tmp_path / "doc", progress=False)
    assert [p.name for p in tmp_path.iterdir()] == ["bad.json"]


def test_build_data_is_idempotent_and_protects_existing_data(tmp_path):
    run = tmp_path / "run"
    paths = data_stage.build_data(run, max_files=30, vocab_size=400, split="8,1,1", progress=False)
    assert paths.built == ["corpus", "tokenizer", "bin_idx"]
    assert paths.data_prefix == run / "data" / "codeparrot_content_document"
    assert paths.jsonl == run / "data" / "codeparrot_data.json" and paths.vocab_size == 400
    lines = paths.jsonl.read_text().splitlines()
    assert paths.num_documents == len(lines) >= 25
    manifest = data_stage.data_manifest(run)
    assert manifest["tokenizer"]["train_documents"] == [0, round(0.8 * paths.num_documents)]
    assert sum(manifest["corpus"]["removed"].values()) == 30 - paths.num_documents
    before = _mtimes(run)

    again = data_stage.build_data(run, progress=False)
    assert again.built == [] and again.split == "8,1,1" and again.num_documents == paths.num_documents
    assert data_stage.build_data(run, vocab_size=400, progress=False).built == []
    with pytest.raises(ValueError, match=r"made with vocab_size=400, not 1024.*new run folder"):
        data_stage.build_data(run, vocab_size=1024, progress=False)
    assert _mtimes(run) == before, "a second call rewrote files"

    os.remove(f"{paths.data_prefix}.idx")
    rebuilt = data_stage.build_data(run, progress=False)
    assert rebuilt.built == ["bin_idx"]
    assert preprocessing_demo.verify_read_back(rebuilt.data_prefix, rebuilt.jsonl, rebuilt.tokenizer_dir, indices=[0, 1]) == 2


def test_build_data_rejects_bad_settings_before_writing(tmp_path):
    """A vocab size or split the tokenizer step would reject must not leave a manifest behind
    (it would refuse the corrected rerun with 'was made with vocab_size=100')."""
    run = tmp_path / "run"
    with pytest.raises(ValueError, match=r"vocab_size=100 is too small.*>= 257"):
        data_stage.build_data(run, max_files=5, vocab_size=100, progress=False)
    with pytest.raises(ValueError, match=r"split='0,1,1'.*weight 0"):
        data_stage.build_data(run, max_files=5, split="0,1,1", progress=False)
    with pytest.raises(ValueError, match=r"split='a,b'"):
        data_stage.build_data(run, max_files=5, split="a,b", progress=False)
    assert not run.exists()


def test_build_corpus_dataset_uses_the_run_tokenizer(tmp_path):
    run = tmp_path / "run"
    main = data_stage.build_data(run, max_files=20, vocab_size=300, split="8,1,1", progress=False)
    extra = preprocessing_demo.build_corpus_dataset(run, "stdlib_tests", source=corpus.stdlib_dir() / "json", progress=False)
    assert extra.built and extra.num_documents >= 3
    assert extra.data_prefix == run / "data" / "stdlib_tests_content_document"
    assert preprocessing_demo.verify_read_back(extra.data_prefix, extra.jsonl, main.tokenizer_dir) == extra.num_documents
    assert not preprocessing_demo.build_corpus_dataset(run, "stdlib_tests", source=corpus.stdlib_dir() / "json", progress=False).built
    with pytest.raises(ValueError, match="name="):
        preprocessing_demo.build_corpus_dataset(run, "../x", source=corpus.stdlib_dir() / "json")


def test_data_paths_reads_back_what_build_data_made_and_names_the_command_when_missing(tmp_path):
    run = tmp_path / "run"
    with pytest.raises(FileNotFoundError, match=r"python -m helpers.runner.series run --only 01"):
        data_stage.data_paths(run)
    made = data_stage.build_data(run, max_files=20, vocab_size=300, split="8,1,1", progress=False)
    read = data_stage.data_paths(run)
    assert (read.data_prefix, read.tokenizer_dir, read.jsonl) == (made.data_prefix, made.tokenizer_dir, made.jsonl)
    assert (read.num_documents, read.vocab_size, read.split) == (made.num_documents, made.vocab_size, "8,1,1")
    assert read.built == []


def test_a_damaged_manifest_is_a_clear_error(tmp_path):
    data = tmp_path / "run" / "data"
    data.mkdir(parents=True)
    for text in ('{"settings": {"split"', "[1, 2]"):
        (data / data_stage.MANIFEST_NAME).write_text(text)
        with pytest.raises(ValueError, match=r"is not a data manifest .*rerun notebook 01"):
            data_stage.data_paths(tmp_path / "run")
    (data / data_stage.MANIFEST_NAME).write_text('{"settings": {"split": "8,1,1"}}')  # the corpus step only
    with pytest.raises(FileNotFoundError, match="notebook 01 makes them"):
        data_stage.data_paths(tmp_path / "run")
