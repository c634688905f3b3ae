"""The figures of notebooks 01-03 and the numbers behind them: the tokens of a line of code
(helpers.demos.preprocessing), how GPTDataset packs documents into samples and the shuffle
index (helpers.demos.dataset_indices), throughput, loss curves and the kill-and-resume curve
(helpers.demos.training_curves). No training: the kill and resume itself runs in notebook 03
(tests/test_training.py kills and resumes Megatron-LM's loop too)."""

from __future__ import annotations

import json

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402

from helpers.demos import dataset_indices, training_curves  # noqa: E402
from helpers.demos import preprocessing as preprocessing_demo  # noqa: E402
from helpers.learn import dataloader, tokenizer, training_config  # noqa: E402
from helpers.runner import metrics  # noqa: E402

CODE = ("def makedirs(name, mode=0o777, exist_ok=False):\n"
        "    head, tail = path.split(name)\n"
        "    if not tail:\n"
        "        head, tail = path.split(head)\n")


@pytest.fixture(scope="module")
def bpe(tmp_path_factory):
    """A byte-level BPE of 400 entries trained by helpers.learn.tokenizer on a little Python."""
    texts = [CODE * 3, "import os\n\n\ndef main():\n    return os.getcwd()\n" * 5,
             "class A:\n    def f(self, x):\n        return x + 1\n" * 5]
    return tokenizer.train_tokenizer(texts, tmp_path_factory.mktemp("bpe") / "tok", vocab_size=400)


@pytest.fixture(autouse=True)
def _close_figures():
    yield
    plt.close("all")


# --------------------------------------------------------------------------- notebook 01: tokens of code
def test_token_spans_tile_the_text_exactly_and_match_the_ids(bpe):
    fast = tokenizer.load_fast_tokenizer(bpe)
    spans = preprocessing_demo.token_spans(fast, CODE)
    assert [s.id for s in spans] == fast.encode(CODE, add_special_tokens=False).ids
    assert spans[0].start == 0 and spans[-1].end == len(CODE)
    assert all(a.end == b.start for a, b in zip(spans, spans[1:]))  # contiguous, no gap, no overlap
    assert "".join(CODE[s.start:s.end] for s in spans) == CODE
    assert fast.decode([s.id for s in spans]) == CODE
    for s in spans:  # each span is the text of its token (Ġ a space, Ċ a newline in the byte-level alphabet)
        assert s.token.replace("Ġ", " ").replace("Ċ", "\n") == CODE[s.start:s.end]
    # transformers' fast tokenizer (what notebook 01 calls tok) gives the same spans
    assert preprocessing_demo.token_spans(tokenizer.load_tokenizer(bpe), CODE) == spans



def test_cut_names_lists_the_pieces_of_each_name_split_over_tokens():
    text = "if head and tail_x:"
    spans = [preprocessing_demo.TokenSpan(i, t, a, b) for i, (t, a, b) in enumerate(
        [("if", 0, 2), ("Ġhe", 2, 5), ("ad", 5, 7), ("Ġand", 7, 11), ("Ġtail", 11, 16), ("_", 16, 17), ("x", 17, 18),
         (":", 18, 19)])]
    assert preprocessing_demo.cut_names(text, spans) == {"head": ["he", "ad"], "tail_x": ["tail", "_", "x"]}

def test_a_character_split_over_tokens_gives_them_its_span(bpe):
    fast = tokenizer.load_fast_tokenizer(bpe)
    text = "x = 'é'\n"  # é is two bytes; a 400-entry BPE keeps them apart
    spans = preprocessing_demo.token_spans(fast, text)
    pieces = [s for s in spans if s.start == text.index("é")]
    assert len(pieces) == 2 and all(s.end == s.start + 1 for s in pieces)
    assert fast.decode([s.id for s in spans]) == text


def test_the_token_figure_draws_one_band_cell_per_character_and_counts_tokens_per_line(bpe):
    spans = preprocessing_demo.token_spans(tokenizer.load_fast_tokenizer(bpe), CODE)
    fig = preprocessing_demo.plot_token_spans(CODE, spans, title="t", first_line=10)
    ax = fig.axes[0]
    assert len(ax.patches) == len(CODE)  # every character, the newlines included, lies in one band
    per_line = [int(t.get_text().split()[0]) for t in ax.texts if t.get_text().endswith(" tokens")]
    assert sum(per_line) == len(spans) and len(per_line) == CODE.count("\n")
    assert [t.get_text() for t in ax.get_yticklabels()] == ["10", "11", "12", "13"]
    assert ax.get_title() == "t" and "characters" in ax.get_xlabel() and ax.get_ylabel()
    colours = [p.get_facecolor() for p in ax.patches]
    starts = {s.start for s in spans}
    assert all(colours[i] != colours[i - 1] for i in starts if i > 0)  # neighbouring tokens differ in colour


# --------------------------------------------------------------------------- notebook 02: packing
@pytest.fixture(scope="module")
def train_ds(tmp_path_factory):
    from helpers.runner import data_stage

    run = tmp_path_factory.mktemp("pack") / "run"
    data = data_stage.build_data(run, max_files=40, vocab_size=400, split="8,1,1", progress=False)
    return dataloader.build_gpt_datasets(data.data_prefix, data.tokenizer_dir, seq_length=256, split=data.split,
                                         cache_dir=run / "cache", num_samples=(300, 20, 10))[0]


def test_packing_counts_agree_with_the_spans_megatron_reads(train_ds):
    counts = dataset_indices.packing_counts(train_ds)
    per_sample = counts["documents_per_sample"]
    assert len(per_sample) == len(train_ds.sample_index) - 1
    spans = dataset_indices.sample_spans(train_ds, range(len(per_sample)))
    assert per_sample.tolist() == [len(parts) for parts in spans]
    assert per_sample.max() >= 2  # seq_length 256 on short files: samples cross boundaries
    assert float(np.mean(per_sample > 1)) == pytest.approx(dataset_indices.index_summary(train_ds)["fraction_crossing"],
                                                           abs=1e-4)
    si = np.asarray(train_ds.sample_index)
    brute = np.zeros(len(counts["samples_per_entry"]), dtype=int)
    for j in range(len(si) - 1):
        brute[si[j, 0]:si[j + 1, 0] + 1] += 1
    assert counts["samples_per_entry"].tolist() == brute.tolist()
    docs = np.asarray(train_ds.document_index)[:len(brute)]
    assert counts["entry_lengths"].tolist() == np.asarray(train_ds.dataset.sequence_lengths)[docs].tolist()
    # a document is read by at least length / seq_length samples (whole samples tile it)
    assert np.all(counts["samples_per_entry"][:-1] >= counts["entry_lengths"][:-1] / 256)


def test_packing_figure_shows_the_shares_and_the_lengths(train_ds):
    fig = dataset_indices.plot_packing(train_ds)
    left, right = fig.axes
    heights = [p.get_height() for p in left.patches]
    assert sum(heights) == pytest.approx(100.0)
    per_sample = dataset_indices.packing_counts(train_ds)["documents_per_sample"]
    assert heights[0] == pytest.approx(100 * np.mean(per_sample == 1))
    for ax in (left, right):
        assert ax.get_title() and ax.get_xlabel() and ax.get_ylabel() and ax.get_legend() is not None
    assert "tokens" in right.get_xlabel() and right.get_xscale() == "log"


def _overlap(a, b) -> bool:
    return a.x0 < b.x1 and b.x0 < a.x1 and a.y0 < b.y1 and b.y0 < a.y1


def test_the_shuffle_index_legend_covers_no_point(train_ds):
    fig = dataset_indices.plot_shuffle_index(train_ds)
    fig.canvas.draw()
    ax = fig.axes[0]
    legend = ax.get_legend().get_window_extent()
    assert not _overlap(legend, ax.get_window_extent())  # beside the axes, not on them


# --------------------------------------------------------------------------- notebook 03: throughput, curves
LOG = "\n".join(
    f" [2026-12-04 15:30:58] iteration {it:8d}/     100 | consumed samples: {it * 4:12d} | elapsed time per iteration "
    f"(ms): {ms} | learning rate: 1.0E-03 | global batch size:     4 | lm loss: 6.5E+00 |"
    for it, ms in ((20, "1047.3"), (40, "112.5"), (60, "98.0")))


def test_throughput_is_tokens_over_the_logged_time(tmp_path):
    cfg = training_config.profile("cpu", str(tmp_path))  # no TensorBoard folder: the log lines only
    records = metrics.from_megatron_lm(cfg, LOG, write=False)
    tokens = cfg.global_batch_size * cfg.model.seq_length
    rows = training_curves.throughput(records["train"], tokens)
    assert [(r["first"], r["last"]) for r in rows] == [(1, 20), (21, 40), (41, 60)]
    for row, ms in zip(rows, (1047.3, 112.5, 98.0)):
        assert row["s_per_iter"] == pytest.approx(ms / 1000)
        assert row["tokens_per_s"] == pytest.approx(tokens / (ms / 1000))
        assert row["iterations_per_s"] == pytest.approx(1000 / ms)
    with pytest.raises(ValueError, match="s_per_iter"):
        training_curves.throughput([{"iteration": 5, "s_per_iter": None}], tokens)


def test_throughput_figure_marks_the_median_after_the_start_up(tmp_path):
    cfg = training_config.profile("cpu", str(tmp_path))
    tokens = cfg.global_batch_size * cfg.model.seq_length
    rows = training_curves.throughput(metrics.from_megatron_lm(cfg, LOG, write=False)["train"], tokens)
    fig = training_curves.plot_throughput(rows, tokens)
    ax = fig.axes[0]
    median = [line for line in ax.lines if line.get_linestyle() == "--"][0]
    assert median.get_ydata()[0] == pytest.approx(np.median([tokens / 0.1125, tokens / 0.098]))
    assert "tokens/s" in ax.get_ylabel() and ax.get_title() and ax.get_legend() is not None
    with pytest.raises(ValueError):
        training_curves.plot_throughput([], tokens)


def _records():
    its = range(1, 101)
    loss = [9 * np.exp(-i / 30) + 3 for i in its]
    return {"iteration": [{"iteration": i, "lm_loss": v} for i, v in zip(its, loss)],
            "train": [{"iteration": i, "lm_loss": loss[i - 1], "lr": 1e-3 * min(1, i / 10)} for i in range(10, 101, 10)],
            "valid": [{"iteration": 50, "lm_loss": 4.5, "when": "during"}, {"iteration": 100, "lm_loss": 4.0, "when": "end"}]}


def test_loss_and_lr_labels_overlap_no_tick_label():
    schedule = [1e-3 * min(1, i / 10) for i in range(101)]
    fig = training_curves.plot_loss_and_lr(_records(), schedule)
    fig.canvas.draw()
    renderer = fig.canvas.get_renderer()
    for ax in fig.axes:
        label = ax.yaxis.label.get_window_extent(renderer)
        ticks = [t.get_window_extent(renderer) for t in ax.get_yticklabels() if t.get_text()]
        assert ticks and not any(_overlap(label, t) for t in ticks)
        assert ax.get_title() and ax.get_xlabel() and ax.get_legend() is not None
    lr_ax = fig.axes[1]
    assert max(lr_ax.lines[0].get_ydata()) == pytest.approx(1.0)  # plotted in units of 1e-3, as labelled
    assert "10⁻³" in lr_ax.get_ylabel()
    assert len(fig.axes[0].lines[2].get_xdata()) == 1  # validation during training only


def _result():
    ref = {i: 9.0 - 0.05 * i for i in range(1, 21)}
    return {"uninterrupted": ref, "launches": [{i: ref[i] for i in range(1, 10)}, {i: ref[i] for i in range(10, 21)}],
            "killed_at": 9, "resumed_from": 9, "max_abs_difference": 0.0, "train_iters": 20, "seconds": 1.0}


def test_kill_and_resume_reads_its_record_back_with_integer_iterations(tmp_path):
    record = tmp_path / "kill_and_resume.json"
    record.write_text(json.dumps(_result()))  # JSON turns the iteration keys into strings
    back = training_curves.kill_and_resume(None, record)  # cached: nothing is launched
    assert back == _result()
    with pytest.raises(ValueError, match="kill_after"):
        training_curves.kill_and_resume(None, tmp_path / "new.json", train_iters=10, kill_after=10)


def test_kill_and_resume_figure_marks_the_kill_and_the_zero_difference():
    fig = training_curves.plot_kill_and_resume(_result())
    top, bottom = fig.axes
    kill = [line for line in top.lines if line.get_linestyle() == ":"][0]
    assert kill.get_xdata()[0] == pytest.approx(9.5)
    first, second = top.lines[1], top.lines[2]
    assert list(first.get_xdata()) == list(range(1, 10)) and list(second.get_xdata()) == list(range(10, 21))
    diff = next(line for line in bottom.lines if line.get_label().startswith("killed-and-resumed"))
    assert list(diff.get_xdata()) == list(range(1, 21)) and np.all(np.asarray(diff.get_ydata()) == 0)
    assert top.get_legend() is not None and "nats" in top.get_ylabel() and bottom.get_xlabel() == "iteration"
