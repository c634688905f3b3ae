"""JSON Lines -> Megatron ``.bin/.idx``, as Megatron-LM's ``tools/preprocess_data.py`` does (notebook 01 §4, §7).

Written with megatron-core's ``IndexedDatasetBuilder`` (``megatron/core/datasets/indexed_dataset.py``):
every document is tokenized (threads, :mod:`helpers.learn.encoders`), ends with the EOD token
(``--append-eod``) and is one sequence.

* ``<prefix>.bin``: all token ids back to back, uint16 below 65,500 vocabulary entries, else int32;
* ``<prefix>.idx``: a header, the dtype, each sequence's length and byte offset, the document boundaries.

Empty documents are skipped and counted. Notebook 01's whole data stage is
``helpers.runner.data_stage.build_data``.
"""

from __future__ import annotations

import os
import re
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from helpers.learn import corpus as corpus_mod
from helpers.learn import tokenizer as tokenizer_mod
from helpers.learn.encoders import encode_documents, resolve_engine

@dataclass
class PreprocessStats:
    """What :func:`tokenize_to_indexed_dataset` wrote and how fast.

    Attributes:
        prefix: output path prefix (without ``.bin``/``.idx``).
        num_documents: documents written (one sequence each).
        num_skipped_empty: empty documents skipped.
        num_tokens: tokens written, EOD tokens included.
        input_bytes: UTF-8 bytes of the document texts read.
        bin_bytes: size of the ``.bin`` file in bytes.
        dtype: numpy dtype name of the stored token ids (``uint16`` or ``int32``).
        seconds: wall time of tokenizing + writing, in seconds.
        num_workers: worker threads asked for (0: the engine's own thread pool, all cores).
        engine: the tokenizing engine that ran, ``"gigatoken"`` or ``"tokenizers"``.
    """

    prefix: str
    num_documents: int
    num_skipped_empty: int
    num_tokens: int
    input_bytes: int
    bin_bytes: int
    dtype: str
    seconds: float
    num_workers: int
    engine: str = "tokenizers"

    @property
    def documents_per_second(self) -> float:
        return self.num_documents / self.seconds

    @property
    def tokens_per_second(self) -> float:
        return self.num_tokens / self.seconds

    @property
    def megabytes_per_second(self) -> float:
        """Input text throughput in MB/s (1 MB = 10^6 bytes)."""
        return self.input_bytes / 1e6 / self.seconds


def _check_prefix(output_prefix: str | os.PathLike, overwrite: bool) -> Path:
    prefix = Path(output_prefix)
    if not prefix.parent.is_dir():
        raise FileNotFoundError(
            f"output_prefix={str(output_prefix)!r}: folder {prefix.parent} does not exist; create it "
            "first (Megatron's preprocess_data.py does not create it either)"
        )
    existing = [p for p in (Path(f"{prefix}.bin"), Path(f"{prefix}.idx")) if p.exists()]
    if existing and not overwrite:
        raise FileExistsError(f"{[str(p) for p in existing]} exist: pass overwrite=True or another output_prefix")
    return prefix


def tokenize_to_indexed_dataset(
    jsonl: str | os.PathLike,
    tokenizer_dir: str | os.PathLike,
    output_prefix: str | os.PathLike,
    *,
    json_key: str = corpus_mod.CONTENT_KEY,
    append_eod: bool = True,
    num_workers: int = 2,
    chunk_size: int = 16,
    overwrite: bool = False,
    progress: bool = True,
    engine: str = "auto",
) -> PreprocessStats:
    """Tokenize a JSON Lines file into Megatron's ``<output_prefix>.bin/.idx``.

    Equivalent to Megatron-LM's ``tools/preprocess_data.py --json-keys content --tokenizer-type
    HuggingFaceTokenizer --append-eod`` (which appends ``_content_document`` to its prefix; here
    ``output_prefix`` is the full prefix). Token dtype: ``DType.optimal_dtype(vocab_size)``.

    Args:
        jsonl: input file, one JSON object per line with the text under ``json_key``.
        tokenizer_dir: folder written by :func:`helpers.learn.tokenizer.train_tokenizer`.
        output_prefix: output path without extension; its folder must exist (files renamed into place).
        json_key: the key holding the text.
        append_eod: append the EOD token id after each document (the guide's ``--append-eod``).
        num_workers: tokenizing threads (Megatron's ``--workers``); ``0``: the engine's own pool
            over all cores. For gigatoken it sets ``RAYON_NUM_THREADS``; only a process's first
            call decides the pool's size.
        chunk_size: documents sent to a ``tokenizers`` worker at a time (gigatoken encodes
            :data:`GIGATOKEN_BATCH_DOCUMENTS` documents per call).
        overwrite: replace an existing ``.bin/.idx``.
        progress: show a tqdm progress bar (documents).
        engine: ``"auto"``, ``"gigatoken"`` or ``"tokenizers"`` (:func:`resolve_engine`); a literal
            ``<|endoftext|>`` in a document is encoded as text by both, never as the EOD id.

    Returns:
        :class:`PreprocessStats` with counts, sizes and wall seconds.

    Raises:
        FileNotFoundError: the input, the tokenizer or the output folder is missing.
        FileExistsError: the outputs exist and ``overwrite`` is False.
        ValueError: a bad JSON Lines line (file and line number named), a non-UTF-8 line,
            no non-empty document, or an unknown ``engine``.
        ModuleNotFoundError: ``engine="gigatoken"`` and gigatoken is not installed.
    """
    from megatron.core.datasets.indexed_dataset import DType, IndexedDatasetBuilder
    from tqdm.auto import tqdm

    engine = resolve_engine(engine)
    prefix = _check_prefix(output_prefix, overwrite)
    if not Path(jsonl).is_file():
        raise FileNotFoundError(f"jsonl={str(jsonl)!r} not found: write it first (helpers.learn.corpus.write_jsonl)")
    vocab_size = tokenizer_mod.vocab_size_of(tokenizer_mod.check_folder(tokenizer_dir))
    eod = tokenizer_mod.eod_id(tokenizer_dir)
    dtype = DType.optimal_dtype(vocab_size)

    texts = corpus_mod.read_contents(jsonl, json_key)
    kept = [t for t in texts if t]
    if not kept:
        raise ValueError(f"{jsonl}: no non-empty document under key {json_key!r}")
    input_bytes = sum(len(t.encode("utf-8")) for t in kept)

    tag = f".tmp-{os.getpid()}-{time.monotonic_ns()}"
    tmp_bin, tmp_idx = Path(f"{prefix}{tag}.bin"), Path(f"{prefix}{tag}.idx")
    start = time.perf_counter()
    num_tokens = 0
    try:
        builder = IndexedDatasetBuilder(str(tmp_bin), dtype=dtype)
        bar = tqdm(total=len(kept), unit="doc", desc="tokenize", disable=not progress)
        encoded = encode_documents(kept, tokenizer_dir, engine, num_workers, chunk_size)
        for ids_list in encoded:
            for ids in ids_list:
                if append_eod:
                    ids = np.append(ids, eod)
                builder.add_document(ids, [len(ids)])
                num_tokens += len(ids)
            bar.update(len(ids_list))
        bar.close()
        builder.finalize(str(tmp_idx))
        os.replace(tmp_bin, f"{prefix}.bin")
        os.replace(tmp_idx, f"{prefix}.idx")
    finally:
        tmp_bin.unlink(missing_ok=True)
        tmp_idx.unlink(missing_ok=True)
    seconds = time.perf_counter() - start
    return PreprocessStats(
        prefix=str(prefix), num_documents=len(kept), num_skipped_empty=len(texts) - len(kept),
        num_tokens=num_tokens, input_bytes=input_bytes, bin_bytes=Path(f"{prefix}.bin").stat().st_size,
        dtype=np.dtype(dtype).name, seconds=seconds, num_workers=num_workers, engine=engine,
    )


# --------------------------------------------------------------------------- reading back
def split_document_ranges(num_documents: int, split: str, *, parameter: str = "split") -> list[tuple[int, int] | None]:
    """Document ranges ``[begin, end)`` of train/valid/test, computed as megatron-core does.

    Same arithmetic as ``BlendedMegatronDatasetBuilder._build_megatron_dataset_splits``:
    the split string is normalised (``parse_and_normalize_split``), turned into book-ends
    (``convert_split_vector_to_split_matrix``), and each end is ``round(bookend * N)``.
    A split with weight 0 is ``None`` (megatron builds no dataset for it).

    ``parameter`` is the name the caller knows ``split`` by; the errors name it.

    Raises:
        ValueError: ``split`` is not 1-3 non-negative plain decimal numbers with a positive
            sum (megatron-core keeps only the digits and dots of each weight, so ``nan,1,1``
            would read as ``1,1`` and ``1e2,1`` as ``1,2,1``), or ``num_documents < 1``.
    """
    from megatron.core.datasets.blended_megatron_dataset_config import (
        convert_split_vector_to_split_matrix,
        parse_and_normalize_split,
    )

    if num_documents < 1:
        raise ValueError(f"num_documents={num_documents}: the dataset holds no documents")
    parts = [p for p in str(split).replace(" ", "").split(",") if p != ""]
    odd = [p for p in parts if not re.fullmatch(r"-?(?:[0-9]+\.?[0-9]*|\.[0-9]+)", p)]
    if odd:
        raise ValueError(f"{parameter}={split!r}: the weights {odd} are not plain decimal numbers; megatron-core reads "
                         "only their digits and dots ('nan,1,1' as '1,1', '1e2,1' as '1,2,1'): write e.g. '969,30,1'")
    weights = [float(p) for p in parts]
    if not 1 <= len(weights) <= 3 or any(w < 0 for w in weights) or sum(weights) <= 0:
        raise ValueError(f"{parameter}={split!r}: write 1-3 non-negative weights with a positive sum, e.g. '969,30,1'")
    matrix = convert_split_vector_to_split_matrix(parse_and_normalize_split(split))
    return [None if b is None else (int(round(b[0] * num_documents)), int(round(b[1] * num_documents)))
            for b in matrix]


class DamagedDataError(ValueError):
    """A ``.bin/.idx`` pair that cannot be read as one: a damaged ``.idx``, or a ``.bin`` whose size is
    not the one its ``.idx`` gives (a copy cut short, a disk that filled up)."""


def open_indexed_dataset(prefix: str | os.PathLike):
    """megatron-core ``IndexedDataset`` over ``<prefix>.bin/.idx`` (memory-mapped), the pair checked first.

    ``ds[i]`` is document ``i``'s token ids (numpy, the stored dtype); ``ds.sequence_lengths`` in
    tokens. The ``.bin`` must be as long as the ``.idx`` says (``megatron/core/datasets/indexed_dataset.py``,
    ``_IndexReader``); megatron-core itself fails past the end naming no file.

    Raises:
        FileNotFoundError: the ``.bin`` or ``.idx`` is missing.
        DamagedDataError: the ``.idx`` cannot be read, or the ``.bin`` is shorter or longer than it
            says; the message names both files and how to remake them.
    """
    from megatron.core.datasets.indexed_dataset import IndexedDataset

    bin_path, idx_path = Path(f"{prefix}.bin"), Path(f"{prefix}.idx")
    missing = [str(p) for p in (bin_path, idx_path) if not p.is_file()]
    if missing:
        raise FileNotFoundError(f"{missing} not found: run notebook 01 first (python -m helpers.runner.series run --only 01)")
    remake = (f"Delete {bin_path.name} and {idx_path.name} (in {bin_path.parent}) and run notebook 01 again "
              f"(python -m helpers.runner.series run --only 01 --run-dir <this run folder>): it remakes both from the loose JSON.")
    try:
        ds = IndexedDataset(str(prefix))
    except (ValueError, AssertionError, OSError) as err:
        raise DamagedDataError(f"{prefix}.bin/.idx cannot be read ({type(err).__name__}: {err}). {remake}") from None
    index = ds.index
    expected = int(index.sequence_pointers[-1]) + int(index.sequence_lengths[-1]) * index.dtype_size if len(index) else 0
    actual = bin_path.stat().st_size
    if actual != expected:
        del ds
        raise DamagedDataError(
            f"{bin_path} has {actual:,} bytes but {idx_path} describes {expected:,} ({len(index):,} documents of "
            f"{index.dtype.__name__}): the pair does not belong together (a copy cut short, a disk that filled up, "
            f"or files from two runs). {remake}")
    return ds
