"""Notebook 01's checks of the data stage and notebook 02's second corpus.

* :func:`decode_document`, :func:`verify_read_back`: every stored document decodes back to
  its line of the loose JSON (notebook 01 section 5);
* :func:`megatron_preprocess_command`: today's Megatron-LM command for the same files
  (notebook 01 section 6; ``bench/preprocess.py`` runs it);
* :func:`build_corpus_dataset`: a further corpus tokenized with the run's tokenizer, to blend
  (notebook 02 section 9).

Sources: Megatron-LM ``tools/preprocess_data.py``; megatron-core ``datasets/indexed_dataset.py``.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

from helpers.learn import corpus as corpus_mod
from helpers.learn import tokenizer as tokenizer_mod
from helpers.learn.preprocess import open_indexed_dataset, tokenize_to_indexed_dataset
from helpers.runner.data_stage import DATA_DIR, DataPaths, data_paths

def decode_document(dataset, index: int, tokenizer_dir: str | os.PathLike, *, strip_eod: bool = True,
                    tokenizer=None) -> str:
    """Text of document ``index`` of an ``IndexedDataset``, decoded with the folder's tokenizer.

    With ``strip_eod`` the trailing EOD token appended by preprocessing is removed first.
    Pass ``tokenizer`` (from :func:`helpers.learn.tokenizer.load_fast_tokenizer`) to decode many
    documents without reloading it each time.
    """
    tok = tokenizer if tokenizer is not None else tokenizer_mod.load_fast_tokenizer(tokenizer_dir)
    ids = [int(i) for i in dataset[index]]
    if strip_eod and ids and ids[-1] == tok.token_to_id(tokenizer_mod.EOD_TOKEN):
        ids = ids[:-1]
    return tok.decode(ids, skip_special_tokens=False)


def verify_read_back(prefix: str | os.PathLike, jsonl: str | os.PathLike, tokenizer_dir: str | os.PathLike,
                     indices: Sequence[int] | None = None) -> int:
    """Check that stored documents decode back to the JSON Lines texts; returns how many were checked.

    Args:
        indices: documents to check (default: all).

    Raises:
        ValueError: document counts differ, or a document decodes to a different text (the
            message names its index and the first differing character).
    """
    texts = corpus_mod.read_contents(jsonl)
    ds = open_indexed_dataset(prefix)
    if len(ds) != len(texts):
        raise ValueError(f"{prefix}.idx holds {len(ds)} documents but {jsonl} has {len(texts)} lines")
    tok = tokenizer_mod.load_fast_tokenizer(tokenizer_dir)
    indices = range(len(texts)) if indices is None else indices
    for i in indices:
        decoded = decode_document(ds, i, tokenizer_dir, tokenizer=tok)
        if decoded != texts[i]:
            at = next((k for k, (a, b) in enumerate(zip(decoded, texts[i])) if a != b), min(len(decoded), len(texts[i])))
            raise ValueError(f"document {i} of {prefix} decodes to a different text (first difference at character {at})")
    return len(indices)


@dataclass
class CorpusDataset:
    """A further corpus tokenized with the run's tokenizer (e.g. for blending in notebook 02).

    Attributes:
        jsonl: its loose JSON (``{run_dir}/data/<name>_data.json``).
        data_prefix: its ``.bin/.idx`` prefix (``{run_dir}/data/<name>_content_document``).
        num_documents: documents kept after cleaning.
        removed: documents removed per cleaning filter (empty when the files were reused).
        built: whether this call made the files.
    """

    jsonl: Path
    data_prefix: Path
    num_documents: int
    removed: dict[str, int]
    built: bool


def build_corpus_dataset(
    run_dir: str | os.PathLike,
    name: str,
    *,
    source: str | os.PathLike,
    tokenizer_dir: str | os.PathLike | None = None,
    text_key: str = corpus_mod.CONTENT_KEY,
    max_files: int | None = None,
    seed: int = 1234,
    num_workers: int = 2,
    progress: bool = True,
    engine: str = "auto",
) -> CorpusDataset:
    """Clean ``source`` and tokenize it into ``{run_dir}/data/<name>_content_document.bin/.idx``.

    Cached like ``helpers.runner.data_stage.build_data`` (skipped when the ``.bin/.idx`` exist; ``engine`` as in
    :func:`tokenize_to_indexed_dataset`); the tokenizer is the run's own
    (``{run_dir}/data/tokenizer``, notebook 01's) unless ``tokenizer_dir`` is given, so the
    corpora can be blended.

    Raises:
        ValueError: ``name`` is not a simple file name, or is the main corpus' name.
        FileNotFoundError / ValueError: from :func:`helpers.learn.corpus.collect_corpus`.
    """
    if not name or not name.replace("_", "").replace("-", "").isalnum() or name == "codeparrot":
        raise ValueError(f"name={name!r}: use letters, digits, '_' or '-', and not 'codeparrot' (the main corpus)")
    data_dir = Path(run_dir).expanduser().resolve() / DATA_DIR
    if tokenizer_dir is None:
        tokenizer_dir = data_paths(run_dir).tokenizer_dir
    jsonl, prefix = data_dir / f"{name}_data.json", data_dir / f"{name}_content_document"
    if Path(f"{prefix}.bin").is_file() and Path(f"{prefix}.idx").is_file():
        return CorpusDataset(jsonl, prefix, len(open_indexed_dataset(prefix)), {}, False)
    result = corpus_mod.collect_corpus(source, text_key=text_key, max_files=max_files, seed=seed)
    corpus_mod.write_jsonl(result.documents, jsonl, overwrite=True)
    tokenize_to_indexed_dataset(jsonl, tokenizer_dir, prefix, num_workers=num_workers, progress=progress,
                                overwrite=True, engine=engine)
    return CorpusDataset(jsonl, prefix, len(result.documents), dict(result.removed), True)


def megatron_preprocess_command(paths: DataPaths, *, workers: int = 2, megatron_dir: str = "Megatron-LM") -> str:
    """Today's Megatron-LM command that writes the same ``.bin/.idx`` as ``helpers.runner.data_stage.build_data``.

    The guide's 2022 flags updated: ``--dataset-impl`` and ``--chunk-size`` are gone,
    ``--vocab`` is now an ambiguous prefix, and ``GPT2BPETokenizer`` needs the Hugging Face
    Hub, so the tokenizer folder is passed with ``HuggingFaceTokenizer``. The tool appends
    ``_content_document`` to ``--output-prefix`` itself.
    """
    output = str(paths.data_prefix).removesuffix("_content_document")
    return " \\\n    ".join([
        f"python {megatron_dir}/tools/preprocess_data.py",
        f"--input {paths.jsonl}",
        f"--output-prefix {output}",
        "--tokenizer-type HuggingFaceTokenizer",
        f"--tokenizer-model {paths.tokenizer_dir}",
        "--json-keys content",
        f"--workers {workers}",
        "--append-eod",
    ])
