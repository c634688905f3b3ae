"""megatron-core's ``GPTDataset``: build it, look inside its indices, and guard its known hang.

``BlendedMegatronDatasetBuilder`` (``megatron/core/datasets/blended_megatron_dataset_builder.py``)
cuts the ``.bin/.idx`` documents into contiguous train/valid/test ranges by the ``split``
weights, and for each range ``GPTDataset`` (``megatron/core/datasets/gpt_dataset.py``) builds
three index arrays, cached as ``.npy`` files keyed by an MD5 of the config:

* **document index**: the range's document ids, tiled once per epoch and shuffled;
* **sample index**: ``[num_samples + 1, 2]`` (position in the document index, token offset)
  boundaries every ``seq_length`` tokens, so samples run across document boundaries;
* **shuffle index**: a permutation of the sample ids.

A sample is ``seq_length + 1`` consecutive tokens; ``tokens`` are the first ``seq_length``
and ``labels`` the last ``seq_length`` (shifted by one).

Known hang (megatron-core 0.19.2, as in 0.16.1): a split range with zero documents makes
``GPTDataset._get_num_epochs`` (gpt_dataset.py:693) add epochs of 0 tokens forever.
:func:`check_split` computes the ranges exactly as the builder does and raises first.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import time
from collections import OrderedDict
from pathlib import Path
from typing import Any, Iterator, Sequence

import numpy as np

from helpers import tokenizer as tokenizer_mod
from helpers.preprocess import open_indexed_dataset, split_document_ranges
from helpers.tokenizer import load_tokenizer  # noqa: F401  (notebooks call dataloader.load_tokenizer)

SPLIT_NAMES: tuple[str, str, str] = ("train", "valid", "test")


# --------------------------------------------------------------------------- tokenizers
def _folder_digest(folder: Path) -> str:
    h = hashlib.sha256()
    for name in ("vocab.json", "merges.txt"):
        h.update((folder / name).read_bytes())
    return h.hexdigest()[:16]


try:  # megatron-core's tokenizer base class, when available (it is in 0.16.1 and 0.19.2)
    from megatron.core.tokenizers import MegatronTokenizerBase as _TokenizerBase
except ImportError:  # pragma: no cover
    _TokenizerBase = object  # type: ignore[misc,assignment]


class MegatronTokenizerAdapter(_TokenizerBase):  # type: ignore[misc,valid-type]
    """What ``GPTDatasetConfig.tokenizer`` needs from a tokenizer, over the series' BPE folder.

    megatron-core reads ``.vocab_size`` (token dtype), ``.eod`` (masks and position ids),
    ``.pad`` (padding; -1 here, megatron's own "no pad token" value, since ``<|endoftext|>``
    is the only special token) and ``.unique_identifiers`` (hashed into the index cache name:
    the class, the folder, the vocabulary size and a SHA-256 of vocab.json + merges.txt,
    so a retrained tokenizer never reuses stale indices).

    Args:
        tokenizer_dir: folder written by :func:`helpers.tokenizer.train_tokenizer`.
    """

    def __init__(self, tokenizer_dir: str | os.PathLike) -> None:
        folder = Path(tokenizer_dir).expanduser().resolve()
        self.path = str(folder)
        self._vocab_size = tokenizer_mod.vocab_size_of(folder)
        self._eod = tokenizer_mod.eod_id(folder)
        self._digest = _folder_digest(folder)
        self._tok = tokenizer_mod.load_fast_tokenizer(folder)

    @property
    def vocab_size(self) -> int:  # type: ignore[override]
        """Entries in the vocabulary (not padded)."""
        return self._vocab_size

    @property
    def eod(self) -> int:
        """Id of ``<|endoftext|>``."""
        return self._eod

    @property
    def pad(self) -> int:
        """-1: there is no pad token (megatron-core's ``_PAD_TOKEN_ID``)."""
        return -1

    @property
    def unique_identifiers(self) -> OrderedDict:
        return OrderedDict(
            [("class", type(self).__name__), ("tokenizer_path", self.path),
             ("vocab_size", self._vocab_size), ("sha256", self._digest)]
        )

    def tokenize(self, text: str) -> list[int]:  # type: ignore[override]
        """Token ids of ``text`` (no EOD appended)."""
        return self._tok.encode(text).ids

    def detokenize(self, ids: Sequence[int]) -> str:  # type: ignore[override]
        """Text of token ids."""
        return self._tok.decode([int(i) for i in ids], skip_special_tokens=False)

    @property
    def vocab(self) -> dict[str, int]:  # type: ignore[override]
        return self._tok.get_vocab()

    def apply_chat_template(self, *args: Any, **kwargs: Any):  # type: ignore[override]
        raise NotImplementedError("the series' code tokenizer has no chat template")


# --------------------------------------------------------------------------- splits and the guard
def check_split(sequence_lengths: np.ndarray, split: str) -> list[tuple[int, int] | None]:
    """Raise before megatron-core hangs on a split range without tokens; return the ranges.

    megatron-core 0.19.2's ``GPTDataset._get_num_epochs`` (gpt_dataset.py:693) loops
    ``while num_tokens < num_tokens_requested: num_tokens += num_tokens_per_epoch`` and never
    ends when a split's range holds 0 tokens (e.g. 300 documents with split ``949,50,1``:
    the test range is empty). Even 0 requested samples ask for 1 token (the extra label token).

    Args:
        sequence_lengths: ``[num_documents]`` tokens per document (``IndexedDataset.sequence_lengths``).
        split: Megatron's split weights, e.g. ``"969,30,1"``.

    Returns:
        The ranges of :func:`split_document_ranges`.

    Raises:
        ValueError: a split with a positive weight gets no documents (or no tokens); the
            message names the split, the document count, and the fixes.
    """
    n = len(sequence_lengths)
    ranges = split_document_ranges(n, split)
    for name, rng in zip(SPLIT_NAMES, ranges):
        if rng is None:
            continue
        docs = rng[1] - rng[0]
        tokens = int(np.sum(sequence_lengths[rng[0]:rng[1]], dtype=np.int64))
        if docs == 0 or tokens == 0:
            weights = [float(w) for w in str(split).split(",")] + [0.0] * 3
            i = SPLIT_NAMES.index(name)
            need = int(np.ceil(0.5 * sum(weights[:3]) / weights[i])) if weights[i] > 0 else 0
            raise ValueError(
                f"split={split!r} gives the {name} split {docs} of {n} documents "
                f"(range [{rng[0]}, {rng[1]}), {tokens} tokens): megatron-core 0.19.2 would loop "
                f"forever in GPTDataset._get_num_epochs (gpt_dataset.py). Fix: use more documents "
                f"(about {need} or more for this split), raise the {name} weight, or set it to 0 "
                f"to build no {name} dataset (megatron then returns None for it)."
            )
    return ranges


# --------------------------------------------------------------------------- building datasets
def megatron_num_samples(train_iters: int, global_batch_size: int, eval_interval: int, eval_iters: int) -> tuple[int, int, int]:
    """Samples Megatron-LM requests per split: ``(train, valid, test)``.

    As ``megatron/training/training.py`` (``get_train_valid_test_num_samples``):
    train = train_iters x global batch size; valid = (train_iters // eval_interval + 1)
    x eval_iters x global batch size; test = eval_iters x global batch size.
    """
    for name, value in (("train_iters", train_iters), ("global_batch_size", global_batch_size),
                        ("eval_interval", eval_interval), ("eval_iters", eval_iters)):
        if value < 0 or (name in ("global_batch_size", "eval_interval") and value < 1):
            raise ValueError(f"{name}={value}: must be positive")
    return (train_iters * global_batch_size,
            (train_iters // eval_interval + 1) * eval_iters * global_batch_size,
            eval_iters * global_batch_size)


def gpt_dataset_config(
    tokenizer_dir: str | os.PathLike,
    *,
    seq_length: int,
    blend: tuple[list[str], list[float] | None],
    split: str = "969,30,1",
    seed: int = 1234,
    cache_dir: str | os.PathLike | None = None,
    eod_mask_loss: bool = False,
    create_attention_mask: bool = False,
):
    """A ``GPTDatasetConfig`` as Megatron-LM's ``pretrain_gpt.py`` builds it (no reset of
    position ids or attention masks, megatron-core's defaults otherwise).

    ``create_attention_mask=False``: megatron-core's attention applies the causal mask itself,
    so samples carry no ``[1, seq, seq]`` mask (Megatron-LM's
    ``--no-create-attention-mask-in-dataloader``).
    """
    from megatron.core.datasets.gpt_dataset import GPTDatasetConfig

    if seq_length < 1:
        raise ValueError(f"seq_length={seq_length}: must be a positive number of tokens")
    return GPTDatasetConfig(
        random_seed=seed, sequence_length=seq_length, blend=blend, split=split,
        path_to_cache=None if cache_dir is None else str(cache_dir),
        tokenizer=MegatronTokenizerAdapter(tokenizer_dir),
        reset_position_ids=False, reset_attention_mask=False, eod_mask_loss=eod_mask_loss,
        create_attention_mask=create_attention_mask,
    )


def _default_cache(data_prefix: str | os.PathLike) -> Path:
    return Path(data_prefix).expanduser().resolve().parent / "cache"


def _check_num_samples(num_samples: Sequence[int | None]) -> list[int | None]:
    sizes = list(num_samples)
    if len(sizes) != 3 or any(s is not None and (not isinstance(s, (int, np.integer)) or s < 0) for s in sizes):
        raise ValueError(f"num_samples={num_samples!r}: give (train, valid, test) sample counts, e.g. (2400, 320, 80)")
    return [None if s is None else int(s) for s in sizes]


def _sequence_lengths(prefix: str) -> np.ndarray:
    """A copy of the ``.idx``'s sequence lengths ``[num_sequences]`` (int32).

    Copied on purpose: ``IndexedDataset.sequence_lengths`` is a view into the ``.idx``
    memory map, which the dataset closes when it is garbage collected; reading the view
    after that crashes the process (segmentation fault).
    """

    ds = open_indexed_dataset(prefix)
    lengths = np.array(ds.sequence_lengths, copy=True)
    del ds
    return lengths


def build_gpt_datasets(
    data_prefix: str | os.PathLike,
    tokenizer_dir: str | os.PathLike,
    *,
    seq_length: int,
    split: str = "969,30,1",
    num_samples: Sequence[int | None] = (None, None, None),
    seed: int = 1234,
    cache_dir: str | os.PathLike | None = None,
    eod_mask_loss: bool = False,
    create_attention_mask: bool = False,
) -> list:
    """Train/valid/test ``GPTDataset``s over one ``.bin/.idx``, via ``BlendedMegatronDatasetBuilder``.

    Args:
        data_prefix: ``.bin/.idx`` path without extension.
        tokenizer_dir: the tokenizer folder (vocab size, EOD id, cache key).
        seq_length: sequence length in tokens (each sample reads ``seq_length + 1`` tokens).
        split: Megatron's ``--split`` weights; must give every split with a positive weight at
            least one document (checked first, see :func:`check_split`).
        num_samples: ``(train, valid, test)`` samples to draw at least (epochs are added
            until they fit); ``None`` for one epoch. See :func:`megatron_num_samples`.
        seed: ``random_seed`` of the document and shuffle indices.
        cache_dir: where the index ``.npy`` files go; default ``<data folder>/cache``.
        eod_mask_loss: zero the loss mask at EOD tokens.
        create_attention_mask: also return an ``attention_mask`` ``[1, seq, seq]`` (bool).

    Returns:
        ``[train, valid, test]``: ``GPTDataset`` or ``None`` (a split of weight 0). Sample
        ``ds[i]`` is a dict of int64 ``tokens``, ``labels``, ``position_ids`` and float32
        ``loss_mask``, each ``[seq_length]``.

    Raises:
        FileNotFoundError: the ``.bin/.idx`` or tokenizer is missing.
        ValueError: an empty split (would hang megatron-core), a bad ``split`` or ``num_samples``.
    """
    from megatron.core.datasets.blended_megatron_dataset_builder import BlendedMegatronDatasetBuilder
    from megatron.core.datasets.gpt_dataset import GPTDataset

    sizes = _check_num_samples(num_samples)
    prefix = str(Path(data_prefix).expanduser().resolve())
    check_split(_sequence_lengths(prefix), split)
    config = gpt_dataset_config(
        tokenizer_dir, seq_length=seq_length, blend=([prefix], None), split=split, seed=seed,
        cache_dir=cache_dir if cache_dir is not None else _default_cache(prefix),
        eod_mask_loss=eod_mask_loss, create_attention_mask=create_attention_mask,
    )
    return BlendedMegatronDatasetBuilder(GPTDataset, sizes, lambda: True, config).build()


@contextlib.contextmanager
def single_process_group() -> Iterator[None]:
    """A one-process ``gloo`` ``torch.distributed`` group for the duration of the block.

    Blended datasets need ``torch.distributed`` (``blended_dataset.py`` calls
    ``torch.distributed.get_rank()``). An already initialised group is used as is and kept.
    """
    import torch.distributed as dist

    from helpers.launch import free_port

    if dist.is_initialized():
        yield
        return
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


def build_blended_gpt_datasets(
    data_prefixes: Sequence[str | os.PathLike],
    weights: Sequence[float],
    tokenizer_dir: str | os.PathLike,
    *,
    seq_length: int,
    split: str = "969,30,1",
    num_samples: Sequence[int],
    seed: int = 1234,
    cache_dir: str | os.PathLike | None = None,
) -> list:
    """Train/valid/test ``BlendedDataset``s drawing from several ``.bin/.idx`` by ``weights``.

    Megatron-LM's ``--data-path 0.7 A 0.3 B``: each corpus is split by ``split`` and gets a
    ``GPTDataset`` of ``ceil(weight x num_samples x 1.005)`` samples; ``BlendedDataset``
    (``blended_dataset.py``) then interleaves them so every prefix of the blend matches the
    weights as closely as possible. Runs inside :func:`single_process_group` when no group exists.

    Returns:
        ``[train, valid, test]`` ``BlendedDataset`` (or ``None``); a sample is a
        ``GPTDataset`` sample plus ``dataset_id`` (index into ``data_prefixes``).

    Raises:
        ValueError: prefixes and weights differ in number, a weight is not positive, a
            corpus has an empty split, or ``num_samples`` holds ``None``.
    """
    from megatron.core.datasets.blended_megatron_dataset_builder import BlendedMegatronDatasetBuilder
    from megatron.core.datasets.gpt_dataset import GPTDataset

    if len(data_prefixes) != len(weights) or not data_prefixes:
        raise ValueError(f"{len(data_prefixes)} data_prefixes but {len(weights)} weights: give one weight per corpus")
    if any(w <= 0 for w in weights):
        raise ValueError(f"weights={list(weights)}: every weight must be positive")
    sizes = _check_num_samples(num_samples)
    if any(s is None for s in sizes):
        raise ValueError("num_samples: weighted blends need a number for every split (megatron-core's rule)")
    prefixes = [str(Path(p).expanduser().resolve()) for p in data_prefixes]
    for p in prefixes:
        check_split(_sequence_lengths(p), split)
    config = gpt_dataset_config(
        tokenizer_dir, seq_length=seq_length, blend=(prefixes, [float(w) for w in weights]), split=split,
        seed=seed, cache_dir=cache_dir if cache_dir is not None else _default_cache(prefixes[0]),
    )
    with single_process_group():
        return BlendedMegatronDatasetBuilder(GPTDataset, sizes, lambda: True, config).build()


# --------------------------------------------------------------------------- looking inside
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

    Each epoch it shuffles the documents, reads and concatenates all their tokens, cuts them
    into ``seq_length + 1`` windows and shuffles those, then yields samples until
    ``num_samples`` were drawn. Everything is recomputed per epoch, on every restart, and to
    resume at sample k it must replay the first k samples.

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

    Returns:
        The matplotlib figure.
    """
    import matplotlib.pyplot as plt

    shuffle = np.asarray(dataset.shuffle_index)
    step = max(1, len(shuffle) // max_points)
    x = np.arange(len(shuffle))[::step]
    fig, ax = plt.subplots(figsize=(5, 4))
    ax.scatter(x, shuffle[::step], s=2, label=f"{len(shuffle):,} samples" + (f" (1 in {step} shown)" if step > 1 else ""))
    ax.set(xlabel="position i (order the trainer reads)", ylabel="shuffle_index[i] (sample id)",
           title="The shuffle index is a permutation")
    ax.legend(loc="upper left")
    return fig
