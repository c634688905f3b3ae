"""helpers.learn.evaluation on real values: a real (tiny) byte-level BPE, real subprocesses."""

from __future__ import annotations

import gzip
import json
import lzma
import math
import textwrap
from pathlib import Path

import pytest
import torch

from helpers.learn import evaluation as ev
from helpers.learn import tokenizer as tk

TEXT = 'def greet(name):\n    """Say héllo → to name."""\n    return f"hello {name}!"\n'


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    """A 400-entry byte-level BPE trained with helpers.learn.tokenizer on three stdlib modules."""
    texts = [Path(m.__file__).read_text(encoding="utf-8") for m in (textwrap, gzip, json.decoder)]
    folder = tk.train_tokenizer(texts, tmp_path_factory.mktemp("eval") / "tokenizer", vocab_size=400)
    return tk.load_tokenizer(folder)


@pytest.fixture(scope="module")
def held_out():
    return [TEXT, Path(lzma.__file__).read_text(encoding="utf-8")[:3000]]


def oracle(stream: list[int], seq_length: int, vocab: int):
    """logits_fn (for batch_size=1) with +1e4 on the true next token of ``stream``; it finds the
    window the row is by the documented windowing: starts at multiples of seq_length, the last
    window shorter."""
    def logits_fn(tokens):
        out = torch.zeros(*tokens.shape, vocab)
        for b, row in enumerate(tokens.tolist()):
            start = next(s for s in range(0, len(stream) - 1, seq_length)
                         if stream[s:s + len(row)] == row and min(seq_length, len(stream) - 1 - s) == len(row))
            for j in range(len(row)):
                out[b, j, stream[start + j + 1]] = 1e4
        return out
    return logits_fn


def bigram(vocab: int, seed: int = 0):
    """A causal logits_fn whose logits depend on the current token only."""
    table = torch.randn(vocab, vocab, generator=torch.Generator().manual_seed(seed))
    return lambda tokens: table[tokens]


def test_bits_per_byte_definition():
    assert ev.bits_per_byte(8 * math.log(2), 8) == pytest.approx(1.0)
    with pytest.raises(ValueError, match="num_bytes=0"):
        ev.bits_per_byte(1.0, 0)


def test_a_perfect_predictor_spends_almost_nothing(tok):
    ids = ev.encode(tok, TEXT)
    for seq_length in (5, 64):
        result = ev.score_texts(oracle([tok.eos_token_id] + ids, seq_length, len(tok)), tok, [TEXT], seq_length, batch_size=1)
        assert result.tokens == len(ids) and result.bytes == len(TEXT.encode("utf-8")) > len(TEXT)
        assert result.bits_per_byte < 1e-3 and result.perplexity == pytest.approx(1.0)


def test_a_uniform_predictor_spends_log2_vocab_per_token(tok, held_out):
    vocab = len(tok)
    uniform = lambda t: torch.zeros(*t.shape, vocab)  # noqa: E731
    result = ev.score_texts(uniform, tok, held_out, seq_length=32, batch_size=3)
    tokens = sum(len(ev.encode(tok, t)) for t in held_out)
    assert result.tokens == tokens and result.bytes == sum(len(t.encode("utf-8")) for t in held_out)
    assert abs(result.bits_per_byte - math.log2(vocab) * tokens / result.bytes) < 1e-6
    assert result.nats_per_token == pytest.approx(math.log(vocab))
    padded = lambda t: torch.cat([torch.zeros(*t.shape, vocab), torch.full((*t.shape, 7), 5.0)], -1)  # noqa: E731
    assert ev.score_texts(padded, tok, held_out, 32, vocab_size=vocab).nats == pytest.approx(result.nats)


def test_windows_and_batches_do_not_change_a_causal_score(tok, held_out):
    fn = bigram(len(tok))
    one = ev.score_texts(fn, tok, held_out, seq_length=16, batch_size=1)
    many = ev.score_texts(fn, tok, held_out, seq_length=16, batch_size=7)
    other_windows = ev.score_texts(fn, tok, held_out, seq_length=50, batch_size=4)
    assert many.nats == pytest.approx(one.nats, rel=1e-9) and one.tokens == many.tokens
    assert other_windows.nats == pytest.approx(one.nats, rel=1e-6)


def test_a_sliding_window_scores_every_token_once_with_more_context(tok, held_out):
    fn = bigram(len(tok))
    plain = ev.score_texts(fn, tok, held_out, seq_length=16)
    for stride in (1, 5, 8, 16):
        slid = ev.score_texts(fn, tok, held_out, seq_length=16, stride=stride, batch_size=3)
        assert slid.tokens == plain.tokens and slid.bytes == plain.bytes
        assert slid.nats == pytest.approx(plain.nats, rel=1e-9)
    seen = []  # the context each scored token gets: with stride 8 of 16, at least 8 tokens after the first window
    def context_fn(t):
        seen.append(t.shape[1])
        return fn(t)
    ev.score_texts(context_fn, tok, [held_out[0]], seq_length=16, stride=8, batch_size=1)
    n = len(ev.encode(tok, held_out[0]))
    assert len(seen) == max(1, -(-(n - 16) // 8) + 1)
    with pytest.raises(ValueError, match="stride=17"):
        ev.score_texts(fn, tok, held_out, seq_length=16, stride=17)


def test_score_texts_refuses_bad_input(tok):
    with pytest.raises(ValueError, match="text 0 is empty"):
        ev.score_texts(bigram(len(tok)), tok, [""], 8)
    with pytest.raises(ValueError, match="batch_size=-1 >= 1"):  # batch_size -1 scored nothing: 0 bits per byte
        ev.score_texts(bigram(len(tok)), tok, [TEXT], 8, batch_size=-1)
    with pytest.raises(ValueError, match="seq_length"):
        ev.score_texts(bigram(len(tok)), tok, [TEXT], 0)


def test_gzip_and_xz_baselines_are_the_direct_computation(held_out):
    data = "\n".join(held_out).encode("utf-8")
    assert ev.gzip_bits_per_byte(held_out) == 8 * len(gzip.compress(data, 9, mtime=0)) / len(data)
    assert ev.xz_bits_per_byte(held_out) == 8 * len(lzma.compress(data, preset=9 | lzma.PRESET_EXTREME)) / len(data)
    assert 0 < ev.xz_bits_per_byte(held_out) < 8 and 0 < ev.gzip_bits_per_byte(held_out) < 8


def test_unigram_with_add_one_smoothing_is_the_hand_value():
    # train counts over a vocab of 4: id0 x3, id1 x1, id2 x0, id3 x0 -> p = (4, 2, 1, 1) / 8
    nats = ev.unigram_nats([0, 0, 0, 1], [0, 2, 1], vocab_size=4)
    assert nats == pytest.approx(-(math.log(4 / 8) + math.log(1 / 8) + math.log(2 / 8)))
    assert ev.bits_per_byte(nats, 3) == pytest.approx((1 + 3 + 2) / 3)
    with pytest.raises(ValueError, match="heldout_ids holds ids outside"):
        ev.unigram_nats([0], [4], vocab_size=4)


def test_temperature_zero_and_top_k_one_are_greedy_and_a_seed_fixes_the_sample():
    fn, ids = bigram(50), [3]
    for _ in range(20):
        ids.append(int(fn(torch.tensor([ids]))[0, -1].argmax()))
    assert ev.sample(fn, [3], 20, temperature=0) == ids[1:]
    assert ev.sample(fn, [3], 20, temperature=1.3, top_k=1, generator=torch.Generator().manual_seed(1)) == ids[1:]
    draw = lambda seed: ev.sample(fn, [3], 30, temperature=1.0, generator=torch.Generator().manual_seed(seed))  # noqa: E731
    assert draw(7) == draw(7) and draw(7) != draw(8) and len(draw(7)) == 30


def test_top_k_draws_only_among_the_k_best_and_eod_stops():
    fn = bigram(50)
    out = ev.sample(fn, [3], 40, temperature=2.0, top_k=3, generator=torch.Generator().manual_seed(0))
    for prev, nxt in zip([3] + out, out):
        assert nxt in torch.topk(fn(torch.tensor(prev)), 3).indices.tolist()
    eod_first = lambda t: torch.nn.functional.one_hot(torch.zeros_like(t), 50).float() * 9  # noqa: E731
    assert ev.sample(eod_first, [3], 10, temperature=0, eod_id=0) == []
    with pytest.raises(ValueError, match="temperature >= 0"):
        ev.sample(fn, [3], 1, temperature=-1)


def test_a_batch_of_samples_is_many_single_samples():
    fn = bigram(50)
    greedy = ev.sample(fn, [3], 12, temperature=0)
    assert ev.sample(fn, [3], 12, temperature=0, num_samples=3) == [greedy] * 3
    batch = ev.sample(fn, [3], 30, temperature=1.5, top_k=4, generator=torch.Generator().manual_seed(1), num_samples=5)
    assert len(batch) == 5 and len({tuple(b) for b in batch}) > 1  # the rows draw their own tokens
    for out in batch:
        for prev, nxt in zip([3] + out, out):
            assert nxt in torch.topk(fn(torch.tensor(prev)), 4).indices.tolist()
    stop_after_7 = lambda t: torch.nn.functional.one_hot(torch.where(t == 7, 0, 7), 50).float() * 9  # noqa: E731
    assert ev.sample(stop_after_7, [3], 10, temperature=0, eod_id=0, num_samples=2) == [[7], [7]]
    with pytest.raises(ValueError, match="num_samples >= 1"):
        ev.sample(fn, [3], 1, num_samples=0)


def test_parses_good_bad_and_trimmed_completions():
    prompt = "def f(x):\n"
    assert ev.parses(prompt, "    return x + 1\n")
    assert not ev.parses(prompt, "    return )x(\n")
    assert not ev.parses(prompt, "    return x +")  # no full line of the completion is left to judge
    assert ev.parses(prompt, "    if x > 0:\n        return x\n    for i in ra")  # cut mid-line: trimmed
    cut_open = "    for i in range(x):\n        if i"
    assert not ev.parses(prompt, "    return )(\n    x = 1\n    y = (")  # trimmed, still broken
    assert ev.parses(prompt, cut_open)  # trimmed to "for ...:" and closed by an indented pass
    assert ev.syntax_validity([prompt] * 4, ["    return 1\n", "    return )(\n", cut_open, "  pass\n"]) == 0.75
    with pytest.raises(ValueError, match="as many completions"):
        ev.syntax_validity([prompt], [])


def test_truncate_at_the_first_stop_string():
    assert ev.truncate_at_stop("    return a\n\ndef g():\n    pass\nprint(1)") == "    return a\n"
    assert ev.truncate_at_stop("    return a\n# done\nif x:") == "    return a"  # the stop string's \n goes too
    assert ev.truncate_at_stop("    return a\n") == "    return a\n"


def test_pass_at_k_hand_values():
    assert ev.pass_at_k(10, 3, 1) == pytest.approx(0.3)
    assert ev.pass_at_k(10, 0, 1) == 0.0
    assert ev.pass_at_k(5, 3, 3) == 1.0  # n - c < k: every k-subset holds a pass
    assert ev.pass_at_k(20, 5, 10) == pytest.approx(1 - math.comb(15, 10) / math.comb(20, 10))
    assert ev.mean_pass_at_k([[True, False], [False, False]], 1) == pytest.approx(0.25)
    with pytest.raises(ValueError, match="1 <= k <= n"):
        ev.pass_at_k(3, 1, 4)


def test_the_shipped_tasks_load_and_every_canonical_solution_passes():
    tasks = ev.load_function_tasks()
    assert 8 <= len(tasks) <= 10 and len({t.task_id for t in tasks}) == len(tasks)
    for task in tasks:
        result = ev.check_candidate(task, task.canonical_solution)
        assert result.passed, (task.task_id, result)
        assert ev.parses(task.prompt, task.canonical_solution)


def test_loader_names_the_file_and_line(tmp_path):
    good = ev.FUNCTION_TASKS_FILE.read_text(encoding="utf-8").splitlines()[0]
    broken = json.loads(good)
    del broken["test"]
    path = tmp_path / "tasks.jsonl"
    path.write_text(good + "\n" + json.dumps(broken) + "\n")
    with pytest.raises(ValueError, match=r"tasks\.jsonl:2: field\(s\) \['test'\] missing"):
        ev.load_function_tasks(path)
    path.write_text(good + "\n{not json\n")
    with pytest.raises(ValueError, match=r"tasks\.jsonl:2: not a JSON object"):
        ev.load_function_tasks(path)
    path.write_text(good + "\n" + good + "\n")
    with pytest.raises(ValueError, match="appears twice"):
        ev.load_function_tasks(path)


@pytest.fixture(scope="module")
def add_task():
    return next(t for t in ev.load_function_tasks() if t.entry_point == "add")


def test_a_wrong_completion_fails_naming_the_assertion(add_task):
    result = ev.check_candidate(add_task, "    return a - b\n")
    assert result.status == "failed" and "AssertionError" in result.reason
    assert "assert candidate(2, 3) == 5" in result.reason


def test_an_infinite_loop_times_out(add_task):
    result = ev.check_candidate(add_task, "    while True:\n        pass\n", timeout_s=1.0)
    assert result.status == "timed out" and 1.0 <= result.seconds < 3.0


ATTACKS = {
    "os.remove": "    import os\n    os.remove({p!r})\n    return a + b\n",
    "posix.unlink": "    import posix\n    posix.unlink({p!r})\n    return a + b\n",
    "os.rename": "    import os\n    os.rename({p!r}, {p!r} + '.x')\n    return a + b\n",
    "open for writing": "    open({p!r}, 'w').close()\n    return a + b\n",
    "shutil.rmtree": "    import shutil, os\n    shutil.rmtree(os.path.dirname({p!r}))\n    return a + b\n",
    "subprocess": "    import subprocess\n    subprocess.run(['rm', {p!r}])\n    return a + b\n",
    "os.system": "    import os\n    os.system('rm ' + {p!r})\n    return a + b\n",
}


@pytest.mark.parametrize("attack", sorted(ATTACKS))
def test_generated_code_cannot_touch_files_outside_its_folder(add_task, tmp_path, attack):
    precious = tmp_path / "keep" / "precious.txt"
    precious.parent.mkdir()
    precious.write_text("the learner's work")
    result = ev.check_candidate(add_task, ATTACKS[attack].format(p=str(precious)))
    assert result.status == "failed" and "PermissionError" in result.reason, result
    assert precious.read_text() == "the learner's work" and sorted(precious.parent.iterdir()) == [precious]


def test_generated_code_cannot_open_a_socket(add_task):
    for code in ("    import socket\n    socket.socket()\n    return a + b\n",
                 "    import _socket\n    _socket.socket()\n    return a + b\n"):
        result = ev.check_candidate(add_task, code)
        assert result.status == "failed" and "PermissionError" in result.reason and "socket" in result.reason, result


def test_a_file_in_its_own_folder_and_its_output_are_fine(add_task):
    result = ev.check_candidate(add_task, "    open('scratch.txt', 'w').write('x')\n    print('hi')\n    return a + b\n")
    assert result.passed, result


def test_score_texts_agrees_with_transformers_own_loss(tok):
    """One window: our nats per token is GPT2LMHeadModel's loss on [eod] + ids (labels = inputs)."""
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    hf = GPT2LMHeadModel(GPT2Config(vocab_size=len(tok), n_positions=64, n_embd=16, n_layer=1, n_head=2)).eval()
    stream = torch.tensor([[tok.eos_token_id] + ev.encode(tok, TEXT)])
    with torch.no_grad():
        expected = float(hf(stream, labels=stream).loss)
    result = ev.score_texts(lambda t: hf(t).logits, tok, [TEXT], seq_length=64)
    assert result.tokens == stream.shape[1] - 1 and result.nats_per_token == pytest.approx(expected, rel=1e-5)


def test_distinct_n_counts_repeated_ngrams():
    assert ev.distinct_n([5, 5, 5, 5]) == 0.25
    assert ev.distinct_n([1, 2, 3, 4]) == 1.0
    assert ev.distinct_n([1, 2, 1, 2, 1], n=2) == 0.5  # (1,2) (2,1) (1,2) (2,1)
    assert ev.distinct_n([7], n=2) == 0.0


def test_heldout_package_files_cleans_like_the_corpus(tok):
    from helpers.learn import corpus

    files = ev.heldout_package_files(["packaging"], tok, set(), max_files=3, more_filtering=False)
    kept = [f for f in files if not f["removed by"]]
    assert len(kept) == 3 and all(f["package"] == "packaging" and f["bytes"] == len(f["text"].encode()) for f in files)
    assert [f["file"] for f in files] == sorted(f["file"] for f in files)
    # a file whose content the corpus holds is a duplicate, and the next file takes its place
    again = ev.heldout_package_files(["packaging"], tok, {corpus.content_hash(kept[0]["text"])}, max_files=3,
                                     more_filtering=False)
    assert next(f for f in again if f["file"] == kept[0]["file"])["removed by"] == "duplicate"
    assert len([f for f in again if not f["removed by"]]) == 3
    with pytest.raises(ValueError, match="'math', a built-in or compiled module"):
        ev.heldout_package_files(["math"], tok, set(), max_files=3, more_filtering=False)
    with pytest.raises(ValueError, match="max_files >= 1"):
        ev.heldout_package_files(["packaging"], tok, set(), max_files=0, more_filtering=False)
    with pytest.raises(ValueError, match=r"\['no_such_package_here'\], not installed"):
        ev.heldout_package_files(["no_such_package_here"], tok, set(), max_files=3, more_filtering=False)


def test_cut_at_line_keeps_whole_lines():
    assert ev.cut_at_line("ab\ncd\nef\n", 100) == "ab\ncd\nef\n"
    assert ev.cut_at_line("ab\ncd\nef\n", 7) == "ab\ncd\n"
    assert ev.cut_at_line("abcdef\n", 3) == ""
