"""helpers.learn.tokenizer (train_tokenizer, load_tokenizer): training, files, round trip, bad input."""

from __future__ import annotations

import json

import pytest

from helpers.learn import corpus, tokenizer

TRICKY = [
    "def f(x):\n\treturn x  # tab, two spaces\r\n",
    "s = 'ünïcödé — 你好 🐍'\n",
    "literal = '<|endoftext|>'  # the EOD string inside a file\n",
    "   leading spaces and trailing   \n\n\n",
    "\x00\x01 control bytes \x7f",
]


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    docs = corpus.collect_corpus(max_files=40, seed=7).documents
    train, held_out = docs[:32], docs[32:]
    out = tmp_path_factory.mktemp("tok") / "tokenizer"
    tokenizer.train_tokenizer([d.content for d in train], out, vocab_size=512)
    return out, [d.content for d in held_out]


def test_folder_has_the_guide_files_and_the_transformers_files(trained):
    out, _ = trained
    for name in tokenizer.TOKENIZER_FILES:
        assert (out / name).is_file(), name
    vocab = json.loads((out / "vocab.json").read_text())
    assert len(vocab) == 512 == tokenizer.vocab_size_of(out)
    assert vocab[tokenizer.EOD_TOKEN] == 0 == tokenizer.eod_id(out)
    merges = (out / "merges.txt").read_text().splitlines()
    assert merges[0].startswith("#version")
    assert len([m for m in merges[1:] if m]) == 512 - 257, "one merge per entry beyond bytes + EOD"
    assert not list(out.parent.glob(".tokenizer.*")), "temporary folder left behind"


def test_autotokenizer_loads_with_checked_size(trained):
    out, _ = trained
    tok = tokenizer.load_tokenizer(out)
    assert len(tok) == 512 and tok.eos_token == tokenizer.EOD_TOKEN and tok.eos_token_id == 0


def test_round_trip_on_held_out_files_and_tricky_text(trained):
    out, held_out = trained
    assert len(held_out) >= 5
    assert tokenizer.round_trip_failures(out, held_out + TRICKY) == []


def test_bpe_compresses_held_out_python(trained):
    out, held_out = trained
    fast = tokenizer.load_fast_tokenizer(out)
    n_bytes = sum(len(t.encode()) for t in held_out)
    n_tokens = sum(len(fast.encode(t).ids) for t in held_out)
    assert n_bytes / n_tokens > 1.6, "a 512-entry BPE merges common Python byte pairs (bytes alone give 1.0)"


def test_eod_string_in_text_is_not_the_eod_token(trained):
    out, _ = trained
    ids = tokenizer.load_fast_tokenizer(out).encode(TRICKY[2]).ids
    assert tokenizer.eod_id(out) not in ids


def test_vocab_size_below_byte_alphabet_is_refused(tmp_path):
    with pytest.raises(ValueError, match=r"vocab_size=200 is too small.*>= 257"):
        tokenizer.train_tokenizer(["x = 1"], tmp_path / "t", vocab_size=200)
    assert not (tmp_path / "t").exists()


def test_existing_tokenizer_is_not_overwritten(trained, tmp_path):
    out, _ = trained
    before = {n: (out / n).read_bytes() for n in tokenizer.TOKENIZER_FILES}
    with pytest.raises(FileExistsError, match="overwrite=True"):
        tokenizer.train_tokenizer(["y = 2\n"] * 10, out, vocab_size=300)
    assert {n: (out / n).read_bytes() for n in tokenizer.TOKENIZER_FILES} == before


def test_missing_parent_and_missing_files(tmp_path):
    with pytest.raises(FileNotFoundError, match="does not exist"):
        tokenizer.train_tokenizer(["x"], tmp_path / "a" / "b", vocab_size=300)
    (tmp_path / "half").mkdir()
    (tmp_path / "half" / "vocab.json").write_text("{}")
    with pytest.raises(FileNotFoundError, match="lacks"):
        tokenizer.load_tokenizer(tmp_path / "half")
    with pytest.raises(ValueError, match="texts is empty"):
        tokenizer.train_tokenizer([], tmp_path / "t2", vocab_size=300)
