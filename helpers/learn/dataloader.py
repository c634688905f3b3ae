"""megatron-core's ``GPTDataset``: its config, the builder call, and a guard for its known hang (notebook 02).

``BlendedMegatronDatasetBuilder`` (``megatron/core/datasets/blended_megatron_dataset_builder.py``)
cuts the ``.bin/.idx`` documents into contiguous train/valid/test ranges by the ``split`` weights;
``GPTDataset`` (``megatron/core/datasets/gpt_dataset.py``) builds the document, sample
(``[num_samples + 1, 2]``) and shuffle indices for each, cached as ``.npy``. A sample is
``seq_length + 1`` tokens: ``tokens`` the first ``seq_length``, ``labels`` the last.

Known hang (megatron-core 0.19.2): a split range with zero documents makes
``GPTDataset._get_num_epochs`` (gpt_dataset.py:693) add epochs of 0 tokens forever.
:func:`check_split` computes the ranges exactly as the builder does and raises first.
"""

from __future__ import annotations

import hashlib
import itertools
import os
from collections import OrderedDict
from pathlib import Path
from typing import Any, Sequence

import numpy as np

from helpers.learn import tokenizer as tokenizer_mod
from helpers.learn.distributed import single_process
from helpers.learn.preprocess import open_indexed_dataset, split_document_ranges

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
        tokenizer_dir: folder written by :func:`helpers.learn.tokenizer.train_tokenizer`.
    """

    def __init__(self, tokenizer_dir: str | os.PathLike) -> None:
        folder = tokenizer_mod.check_folder(tokenizer_dir).resolve()  # a missing file: named, with the fix
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
def check_split(sequence_lengths: np.ndarray | int, split: str, *, parameter: str = "split") -> list[tuple[int, int] | None]:
    """Raise before megatron-core hangs on a split range without tokens; return the ranges.

    megatron-core 0.19.2's ``GPTDataset._get_num_epochs`` (gpt_dataset.py:693) never ends when a
    split's range holds 0 tokens (e.g. 300 documents with split ``949,50,1``), even for 0 samples.

    Args:
        sequence_lengths: ``[num_documents]`` tokens per document (``IndexedDataset.sequence_lengths``),
            or a number of documents, each taken to hold at least one token (notebook 01 checks
            its loose JSON before tokenizing; the corpus writer never writes an empty document).
        split: Megatron's split weights, e.g. ``"969,30,1"``.
        parameter: the name the caller knows ``split`` by (e.g. notebook 02's ``"blend_split"``);
            the error message names it.

    Returns:
        The ranges of :func:`split_document_ranges`.

    Raises:
        ValueError: a split with a positive weight gets no documents (or no tokens); the
            message names the split, the document count, and the fixes; the errors of
            :func:`split_document_ranges` (weights megatron-core would misread: ``nan``, ``1e2``).
    """
    if isinstance(sequence_lengths, (int, np.integer)):
        if sequence_lengths < 0:
            raise ValueError(f"num_documents={sequence_lengths} must be >= 0")
        sequence_lengths = np.ones(int(sequence_lengths), dtype=np.int64)
    n = len(sequence_lengths)
    ranges = split_document_ranges(n, split, parameter=parameter)
    for name, rng in zip(SPLIT_NAMES, ranges):
        if rng is None:
            continue
        docs = rng[1] - rng[0]
        tokens = int(np.sum(sequence_lengths[rng[0]:rng[1]], dtype=np.int64))
        if docs == 0 or tokens == 0:
            i = SPLIT_NAMES.index(name)  # the fewest documents that give this split one (its weight is > 0)
            need = next(m for m in itertools.count(n + 1) if np.diff(split_document_ranges(m, split)[i])[0] > 0)
            raise ValueError(
                f"{parameter}={split!r} gives the {name} split {docs} of {n} documents "
                f"(range [{rng[0]}, {rng[1]}), {tokens} tokens): megatron-core 0.19.2 would loop "
                f"forever in GPTDataset._get_num_epochs (gpt_dataset.py). Fix: use more documents "
                f"(at least {need} for this split), raise the {name} weight, or set it to 0 "
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


def _gpt_dataset_config(
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
    config = _gpt_dataset_config(
        tokenizer_dir, seq_length=seq_length, blend=([prefix], None), split=split, seed=seed,
        cache_dir=cache_dir if cache_dir is not None else _default_cache(prefix),
        eod_mask_loss=eod_mask_loss, create_attention_mask=create_attention_mask,
    )
    return BlendedMegatronDatasetBuilder(GPTDataset, sizes, lambda: True, config).build()


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
    weights as closely as possible. Runs inside ``helpers.learn.distributed.single_process`` (``blended_dataset.py`` calls
    ``torch.distributed.get_rank()``).

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
    config = _gpt_dataset_config(
        tokenizer_dir, seq_length=seq_length, blend=(prefixes, [float(w) for w in weights]), split=split,
        seed=seed, cache_dir=cache_dir if cache_dir is not None else _default_cache(prefixes[0]),
    )
    with single_process():
        return BlendedMegatronDatasetBuilder(GPTDataset, sizes, lambda: True, config).build()


# --------------------------------------------------------------------------- a run's datasets and micro-batches
def build_run_datasets(cfg) -> list:
    """The ``GPTDataset`` s Megatron-LM's loop builds for a run (``helpers.learn.training_config.TrainingConfig``).

    Same data, split, seed, sequence length and index cache (``{run}/data/cache``) as
    ``--data-path``, ``--split``, ``--seed``, ``--seq-length`` and ``--data-cache-path``, and the
    sizes ``megatron/training/training.py`` asks for (:func:`megatron_num_samples`); so sample
    ``i`` of each split is the sample the loop reads as its ``i``-th.

    Returns:
        ``[train, valid, test]`` (a split of weight 0 is ``None``).
    """
    return build_gpt_datasets(
        str(cfg.data_prefix_path), str(cfg.tokenizer_path), seq_length=cfg.model.seq_length, split=cfg.split,
        num_samples=megatron_num_samples(cfg.train_iters, cfg.global_batch_size, cfg.eval_interval, cfg.eval_iters),
        seed=cfg.seed, cache_dir=str(cfg.run_path / "data" / "cache"))


def micro_batch_indices(consumed_samples: int, micro_batch_size: int, data_parallel_rank: int,
                        data_parallel_size: int, num_micro_batches: int) -> list[list[int]]:
    """Sample ids of this rank's micro-batches for the global batch starting at ``consumed_samples``.

    As Megatron-LM's ``MegatronPretrainingSampler`` (``megatron/training/datasets/data_samplers.py``):
    consecutive blocks of ``micro_batch_size x data_parallel_size`` samples, each split across
    the data-parallel ranks. Resuming at ``consumed_samples`` continues exactly where training stopped.

    Returns:
        ``num_micro_batches`` lists of ``micro_batch_size`` sample ids.
    """
    block = micro_batch_size * data_parallel_size
    return [
        [consumed_samples + m * block + data_parallel_rank * micro_batch_size + j for j in range(micro_batch_size)]
        for m in range(num_micro_batches)
    ]


def collate(dataset, indices: list[int], device: Any = "cpu") -> dict[str, Any]:
    """Stack samples ``indices`` of a GPTDataset into a micro-batch (torch's default collate, as the loop's DataLoader).

    Returns:
        ``tokens``, ``labels``, ``position_ids`` int64 ``[micro_batch, seq]`` and ``loss_mask``
        fp32 ``[micro_batch, seq]`` on ``device``.
    """
    import torch

    samples = [dataset[i % len(dataset)] for i in indices]
    out = {}
    for key in ("tokens", "labels", "loss_mask", "position_ids"):
        t = torch.stack([torch.as_tensor(s[key]) for s in samples])
        out[key] = (t.float() if key == "loss_mask" else t.long()).to(device)
    return out
