"""The two tokenizing engines behind :func:`helpers.learn.preprocess.tokenize_to_indexed_dataset` (01 §7).

Both read the same ``tokenizer.json`` and write byte-identical ``.bin/.idx`` files; they differ in speed:

* ``"gigatoken"``: the Rust BPE encoder of Megatron-LM's ``tools/preprocess_data_fast.py`` (PyPI
  ``gigatoken``), 15-40x faster than ``"tokenizers"`` here (bench/RESULTS.md);
* ``"tokenizers"``: Hugging Face ``tokenizers`` in worker threads, what Megatron-LM's
  ``HuggingFaceTokenizer`` runs inside ``preprocess_data.py``.
"""

from __future__ import annotations

import json
import os
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Iterator, Sequence

import numpy as np

from helpers.support import environment, run_guard
from helpers.learn import tokenizer as tokenizer_mod


def _tokenizers_parallelism(enabled: bool):
    """Set ``TOKENIZERS_PARALLELISM`` for the block (HF tokenizers reads it at every call)."""
    return run_guard.environ("TOKENIZERS_PARALLELISM", "true" if enabled else "false")


def _rayon_threads(num_workers: int):
    """``RAYON_NUM_THREADS=num_workers`` for the block unless already set (0: leave rayon's default).

    gigatoken's Rust thread pool reads it once, when its first parallel call starts the pool;
    the variable is restored afterwards so that it does not cap other Rust libraries (HF
    ``tokenizers`` has a pool of its own) for the rest of the process.
    """
    return run_guard.environ("RAYON_NUM_THREADS", str(num_workers) if num_workers >= 1 else None, keep_existing=True)


#: Tokenizing engines of :func:`tokenize_to_indexed_dataset` (``"auto"`` picks one of the others).
ENGINES = ("auto", "gigatoken", "tokenizers")

#: Documents per gigatoken call: bounds the memory of one batch and paces the progress bar.
GIGATOKEN_BATCH_DOCUMENTS = 4096


def resolve_engine(engine: str = "auto") -> str:
    """The tokenizing engine that ``engine`` stands for: ``"gigatoken"`` or ``"tokenizers"``.

    ``"auto"`` is ``"gigatoken"`` when ``gigatoken`` and ``awkward`` (its array library) are
    importable, else ``"tokenizers"`` (always installed with transformers).

    Raises:
        ValueError: ``engine`` is not one of :data:`ENGINES`.
        ModuleNotFoundError: ``engine="gigatoken"`` but it is not installed (the message says
            how to install it, or to pass ``engine="tokenizers"``).
    """
    if engine not in ENGINES:
        raise ValueError(f"engine={engine!r}: use one of {', '.join(map(repr, ENGINES))}")
    has_gigatoken = environment.gigatoken_available()
    if engine == "gigatoken" and not has_gigatoken:
        raise ModuleNotFoundError("engine='gigatoken' needs the packages gigatoken and awkward: "
                                  "pip install -r requirements.txt (or pass engine='tokenizers')")
    if engine == "auto":
        return "gigatoken" if has_gigatoken else "tokenizers"
    return engine


def _chunks(items: Sequence[str], size: int) -> Iterator[list[str]]:
    for start in range(0, len(items), size):
        yield list(items[start:start + size])


def encode_documents(texts: list[str], tokenizer_dir, engine: str, num_workers: int,
                     chunk_size: int = 16) -> Iterator[list[np.ndarray]]:
    """Token ids (int64 ``[len(doc)]`` arrays) of ``texts`` in input order, chunk by chunk.

    Args:
        engine: ``"gigatoken"`` or ``"tokenizers"`` (see :func:`resolve_engine`).
        num_workers: threads; ``0`` uses the engine's own thread pool over all cores.
        chunk_size: documents per ``tokenizers`` worker call.
    """
    if engine == "gigatoken":
        return _gigatoken_chunks(texts, tokenizer_dir, num_workers)
    return _encoded_chunks(texts, tokenizer_dir, num_workers, chunk_size)


def _encoded_chunks(texts: list[str], tokenizer_dir, num_workers: int, chunk_size: int) -> Iterator[list[np.ndarray]]:
    """Token ids per document, in input order, chunk by chunk.

    ``num_workers >= 1``: that many threads, each encoding whole chunks with one core (HF
    ``tokenizers`` releases the GIL while encoding, so the threads run in parallel, like the
    worker processes of Megatron's tool but without starting processes). ``0``: one call per
    chunk with ``tokenizers``' own thread pool (all cores).
    """
    tok = tokenizer_mod.load_fast_tokenizer(tokenizer_dir)

    def encode(chunk: list[str]) -> list[np.ndarray]:
        return [np.asarray(e.ids, dtype=np.int64) for e in tok.encode_batch(chunk)]

    if num_workers <= 0:
        with _tokenizers_parallelism(True):
            for chunk in _chunks(texts, max(chunk_size, 256)):
                yield encode(chunk)
        return
    with _tokenizers_parallelism(False), ThreadPoolExecutor(num_workers) as pool:
        yield from pool.map(encode, _chunks(texts, chunk_size))


def _gigatoken_chunks(texts: list[str], tokenizer_dir, num_workers: int) -> Iterator[list[np.ndarray]]:
    """Token ids per document, in input order, from gigatoken, :data:`GIGATOKEN_BATCH_DOCUMENTS` at a time.

    As Megatron-LM's ``tools/preprocess_data_fast.py``: a ``gigatoken.Tokenizer`` built from
    the folder's ``tokenizer.json`` encodes a batch on its Rust thread pool (GIL released)
    into one ragged ``awkward`` array, here cut back into one numpy array per document. The
    tokenizer is built without the file's ``added_tokens``, so a literal ``<|endoftext|>``
    in a document stays text, as :func:`helpers.learn.tokenizer.load_fast_tokenizer` encodes it
    (``encode_special_tokens``); with them, gigatoken would turn it into the EOD id.
    """
    import awkward as ak
    import gigatoken

    spec = json.loads((Path(tokenizer_dir) / "tokenizer.json").read_text(encoding="utf-8"))
    spec["added_tokens"] = []
    tok = gigatoken.Tokenizer.from_json(json.dumps(spec))
    for chunk in _chunks(texts, GIGATOKEN_BATCH_DOCUMENTS):
        with _rayon_threads(num_workers):
            docs = tok.encode_batch(chunk, parallel=num_workers != 1)
        flat = np.asarray(ak.flatten(docs)).astype(np.int64)
        ends = np.cumsum(np.asarray(ak.num(docs, axis=1)))
        yield np.split(flat, ends[:-1])
