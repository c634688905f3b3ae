"""Notebook 02's look inside megatron-core's ``GPTDataset``: its index numbers, the documents
each sample reads, the loop the indices replace, and the figures.

Serves notebook 02 sections 3-8 and 01 section 5 (document lengths, how the documents are packed into
samples, the three indices, cache reuse, the naive epoch loop). The dataset itself is built by :mod:`helpers.learn.dataloader`; nothing on the
learner's path imports this module.

Sources: megatron-core ``datasets/gpt_dataset.py`` (``_get_num_tokens_per_epoch``,
``_get_num_epochs``, ``_query_document_sample_shuffle_indices``, the index caching).
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any, Sequence

import numpy as np

from helpers.learn.dataloader import build_gpt_datasets

def index_summary(dataset) -> dict[str, Any]:
    """Numbers behind a ``GPTDataset``'s indices.

    Returns:
        ``{"num_documents", "num_tokens_per_epoch", "num_epochs", "num_samples_requested",
        "num_samples", "separate_final_epoch", "document_index_len", "fraction_crossing",
        "cache_files"}`` where
        ``num_epochs`` is what ``GPTDataset._get_num_epochs`` computed (enough epochs that
        epochs x tokens per epoch >= samples x seq_length + 1) and ``separate_final_epoch``
        tells whether the last epoch was shuffled on its own (it would contribute < 80 %
        of an epoch's samples). ``fraction_crossing`` is the share of samples that start in
        one document and end in a later one.
    """
    tokens_per_epoch = dataset._get_num_tokens_per_epoch()
    epochs = dataset._get_num_epochs(tokens_per_epoch)
    separate = False
    if epochs > 1:
        seq, extra = dataset.config.sequence_length, dataset.config.add_extra_token_to_sequence
        sans_final = ((epochs - 1) * tokens_per_epoch - extra) // seq
        per_epoch = (tokens_per_epoch - extra) // seq
        separate = dataset.num_samples - sans_final < int(0.80 * per_epoch)
    si = np.asarray(dataset.sample_index)
    crossing = float(np.mean(si[1:, 0] > si[:-1, 0])) if len(si) > 1 else 0.0
    cache = dataset.config.path_to_cache
    files = sorted(str(p.name) for p in Path(cache).glob(f"{dataset.unique_description_hash}-*")) if cache else []
    return {
        "num_documents": int(len(dataset.indices)),
        "num_tokens_per_epoch": int(tokens_per_epoch),
        "num_epochs": int(epochs),
        "num_samples_requested": dataset.num_samples,
        "num_samples": int(len(dataset)),
        "separate_final_epoch": bool(separate),
        "document_index_len": int(len(dataset.document_index)),
        "fraction_crossing": round(crossing, 4),
        "cache_files": files,
    }


def sample_spans(dataset, sample_ids: Sequence[int]) -> list[list[tuple[int, int, int]]]:
    """Which documents each sample reads, in sample-index order (before the shuffle index).

    Returns:
        For each id in ``sample_ids``: a list of ``(document id, token offset, tokens read)``
        read from the sample index and document index exactly as
        ``GPTDataset._query_document_sample_shuffle_indices`` does (the extra label token
        included).
    """
    extra = dataset.config.add_extra_token_to_sequence
    lengths = dataset.dataset.sequence_lengths
    out = []
    for j in sample_ids:
        (beg, beg_off), (end, end_off) = dataset.sample_index[j], dataset.sample_index[j + 1]
        parts = []
        for i in range(int(beg), int(end) + 1):
            doc = int(dataset.document_index[i])
            offset = int(beg_off) if i == beg else 0
            stop = int(end_off) + extra if i == end else int(lengths[doc])
            parts.append((doc, offset, stop - offset))
        out.append(parts)
    return out


def packing_counts(dataset) -> dict[str, np.ndarray]:
    """How ``GPTDataset`` packs documents into samples, counted from its sample and document indices.

    Sample ``j`` reads the document-index entries ``sample_index[j][0]`` to ``sample_index[j + 1][0]``
    (both included), as ``GPTDataset._query_document_sample_shuffle_indices`` reads them.

    Returns:
        ``{"documents_per_sample"}``: ``[num_samples]`` int64, the documents sample ``j`` reads
        (sample-index order); ``{"samples_per_entry", "entry_lengths"}``: ``[entries]`` int64, for
        every document-index entry up to the last one read, the samples reading it (a document of
        several epochs counts once per epoch) and its length in tokens (EOD included).
    """
    si = np.asarray(dataset.sample_index, dtype=np.int64)
    beg, end = si[:-1, 0], si[1:, 0]
    entries = int(end.max()) + 1 if len(end) else 0
    change = np.zeros(entries + 1, dtype=np.int64)
    np.add.at(change, beg, 1)  # a sample starts reading at entry beg ...
    np.add.at(change, end + 1, -1)  # ... and stops after entry end
    docs = np.asarray(dataset.document_index)[:entries]
    return {"documents_per_sample": end - beg + 1, "samples_per_entry": np.cumsum(change)[:entries],
            "entry_lengths": np.asarray(dataset.dataset.sequence_lengths, dtype=np.int64)[docs]}


def timed_build_and_reuse(data_prefix: str | os.PathLike, tokenizer_dir: str | os.PathLike, cache_dir: str | os.PathLike,
                          **kwargs: Any) -> dict[str, Any]:
    """Build the datasets into an empty ``cache_dir``, then again reusing the cache; time both.

    Returns:
        ``{"build_seconds", "reuse_seconds", "files_written", "files_after_reuse"}``.

    Raises:
        FileExistsError: ``cache_dir`` already has files (the first build would not be a build).
    """
    cache = Path(cache_dir)
    if cache.exists() and any(cache.iterdir()):
        raise FileExistsError(f"cache_dir={str(cache)!r} is not empty: pass an empty or new folder")
    start = time.perf_counter()
    build_gpt_datasets(data_prefix, tokenizer_dir, cache_dir=cache, **kwargs)
    build = time.perf_counter() - start
    written = sorted(p.name for p in cache.iterdir())
    start = time.perf_counter()
    build_gpt_datasets(data_prefix, tokenizer_dir, cache_dir=cache, **kwargs)
    reuse = time.perf_counter() - start
    return {"build_seconds": build, "reuse_seconds": reuse, "files_written": written,
            "files_after_reuse": sorted(p.name for p in cache.iterdir())}


def naive_epoch_loop(sequence_lengths: np.ndarray, documents: Sequence[int], dataset, *, seq_length: int,
                     num_samples: int, seed: int = 1234) -> dict[str, Any]:
    """The loop Megatron's indices replace: reshuffle, concatenate and cut again every epoch.

    Each epoch shuffles the documents, concatenates their tokens, cuts them into ``seq_length + 1``
    windows and shuffles those, until ``num_samples`` were drawn; resuming at sample k replays k samples.

    Args:
        sequence_lengths: tokens per document (for the counts only).
        documents: the split's document ids.
        dataset: the ``IndexedDataset`` (token ids per document).

    Returns:
        ``{"seconds", "epochs", "samples", "tokens_read"}``.
    """
    rng = np.random.RandomState(seed)
    start = time.perf_counter()
    drawn = epochs = tokens_read = 0
    window = seq_length + 1
    while drawn < num_samples:
        epochs += 1
        order = rng.permutation(np.asarray(documents))
        stream = np.concatenate([np.asarray(dataset[int(d)], dtype=np.int64) for d in order])
        tokens_read += len(stream)
        starts = np.arange(0, len(stream) - window + 1, seq_length)
        rng.shuffle(starts)
        for s in starts:
            _ = stream[s:s + window]
            drawn += 1
            if drawn >= num_samples:
                break
        if len(starts) == 0:
            raise ValueError("the documents hold fewer tokens than one sample")
    return {"seconds": time.perf_counter() - start, "epochs": epochs, "samples": drawn, "tokens_read": tokens_read}


# --------------------------------------------------------------------------- figures
def plot_document_lengths(sequence_lengths: np.ndarray, seq_length: int | None = None, *, title: str = "Tokens per document"):
    """Histogram of document lengths in tokens (log-spaced bins), with ``seq_length`` marked.

    Returns:
        The matplotlib figure.
    """
    import matplotlib.pyplot as plt

    lengths = np.asarray(sequence_lengths)
    fig, ax = plt.subplots(figsize=(7, 3.5))
    bins = np.geomspace(max(1, lengths.min()), lengths.max() + 1, 40)
    ax.hist(lengths, bins=bins, color="tab:blue", alpha=0.8, label=f"{len(lengths)} documents")
    ax.axvline(np.median(lengths), color="black", ls="--", label=f"median {int(np.median(lengths)):,} tokens")
    if seq_length:
        ax.axvline(seq_length, color="tab:red", label=f"seq_length = {seq_length}")
    ax.set(xscale="log", xlabel="document length (tokens, log scale)", ylabel="documents", title=title)
    ax.legend()
    return fig


def first_crossing_sample(dataset) -> int | None:
    """Id (sample-index order) of the first sample that reads from two or more documents, or None."""
    si = np.asarray(dataset.sample_index)
    crossing = np.nonzero(si[1:, 0] > si[:-1, 0])[0]
    return int(crossing[0]) if len(crossing) else None


def plot_sample_spans(dataset, num: int = 12, start: int | None = None):
    """Horizontal bars: the documents that ``num`` consecutive samples (sample-index order) read.

    Each row is one sample of ``seq_length + 1`` tokens; each colour one document; a row with
    several colours runs across an EOD boundary. ``start=None`` begins two samples before
    the first sample that crosses a document boundary.

    Returns:
        The matplotlib figure.
    """
    import matplotlib.pyplot as plt

    if start is None:
        start = max(0, (first_crossing_sample(dataset) or 0) - 2)
    ids = list(range(start, min(start + num, len(dataset))))
    spans = sample_spans(dataset, ids)
    docs = list(dict.fromkeys(d for parts in spans for d, _, _ in parts))
    colours = {d: plt.cm.tab20(i % 20) for i, d in enumerate(docs)}
    fig, ax = plt.subplots(figsize=(8, 0.3 * len(ids) + 1.2))
    for row, parts in zip(ids, spans):
        left = 0
        for doc, offset, length in parts:
            ax.barh(row, length, left=left, color=colours[doc], edgecolor="white")
            ax.text(left + length / 2, row, f"doc {doc} @{offset}", ha="center", va="center", fontsize=7)
            left += length
    ax.invert_yaxis()
    ax.set(xlabel="token position in the sample", ylabel="sample id (sample-index order)",
           title=f"Samples of {dataset.config.sequence_length} + 1 tokens cut from the document index")
    handles = [plt.Rectangle((0, 0), 1, 1, color=colours[d]) for d in docs[:8]]
    ax.legend(handles, [f"document {d}" for d in docs[:8]], fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1))
    return fig


def plot_shuffle_index(dataset, max_points: int = 5000):
    """Scatter of the shuffle index: position in the epoch (x) against the sample read (y).

    At most ``max_points`` points are drawn (every k-th position); the legend sits below the axes.

    Returns:
        The matplotlib figure.
    """
    import matplotlib.pyplot as plt

    shuffle = np.asarray(dataset.shuffle_index)
    step = max(1, len(shuffle) // max_points)
    x = np.arange(len(shuffle))[::step]
    fig, ax = plt.subplots(figsize=(5, 4.4))
    ax.scatter(x, shuffle[::step], s=2, label=f"{len(shuffle):,} samples" + (f" (1 in {step} shown)" if step > 1 else ""))
    ax.set(xlabel="position i (order the trainer reads)", ylabel="shuffle_index[i] (sample id)",
           title="The shuffle index is a permutation")
    ax.legend(loc="upper center", bbox_to_anchor=(0.5, -0.14), frameon=False, markerscale=4)  # below: covers no point
    return fig


def plot_packing(dataset):
    """Two panels on how ``GPTDataset`` packs documents into samples of ``seq_length + 1`` tokens.

    Left: the share of samples that read 1, 2, 3... documents (a sample with two or more runs
    across an EOD boundary). Right: every document-index entry's length in tokens (x) against
    the samples that read it (y), with the line ``length / seq_length`` a document would span
    alone and ``seq_length`` marked. Counts from :func:`packing_counts`.

    Returns:
        The matplotlib figure.
    """
    import matplotlib.pyplot as plt

    counts = packing_counts(dataset)
    seq = dataset.config.sequence_length
    per_sample, spans, lengths = counts["documents_per_sample"], counts["samples_per_entry"], counts["entry_lengths"]
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4), gridspec_kw={"width_ratios": [1, 1.8]})
    k = np.arange(1, int(per_sample.max()) + 1)
    share = np.array([np.mean(per_sample == n) for n in k])
    bars = left.bar(k, 100 * share, color="tab:blue", label=f"{len(per_sample):,} samples")
    left.bar_label(bars, labels=[f"{100 * v:.1f} %" for v in share], fontsize=8, padding=2)
    left.set(xticks=k, xlabel="documents read by one sample", ylabel="share of the samples (%)",
             ylim=(0, 100 * share.max() * 1.15), title=f"Documents per sample of {seq} + 1 tokens")
    left.legend(loc="upper right")
    right.scatter(lengths, spans, s=6, alpha=0.4, color="tab:blue", label=f"{len(spans):,} document-index entries")
    grid = np.geomspace(max(1, lengths.min()), lengths.max(), 100)
    right.plot(grid, grid / seq, color="black", ls="--", label="length / seq_length")
    right.axvline(seq, color="tab:red", label=f"seq_length = {seq} tokens")
    right.set(xscale="log", yscale="log", xlabel="document length (tokens, log scale)",
              ylabel="samples that read the document (log scale)", title="Samples each document is cut into")
    right.legend(loc="upper left")
    fig.tight_layout()
    return fig
