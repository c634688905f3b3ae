"""Notebook 01's stage in one call: corpus -> loose JSON -> tokenizer -> ``.bin/.idx``, cached.

Plumbing around the three steps notebook 01 teaches (:func:`helpers.learn.corpus.collect_corpus`,
:func:`helpers.learn.tokenizer.train_tokenizer`, :func:`helpers.learn.preprocess.tokenize_to_indexed_dataset`):
each step runs only when its output is missing from ``{run_dir}/data``, and what it did is
recorded in ``data/data_manifest.json``, which :func:`data_paths` reads back
and ``helpers.runner.series.PRODUCES`` names as this stage's output.
"""

from __future__ import annotations

import os
import statistics
import json
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from helpers.learn import corpus as corpus_mod
from helpers.learn import hub_datasets
from helpers.support import results, run_guard
from helpers.learn import tokenizer as tokenizer_mod
from helpers.learn.encoders import resolve_engine
from helpers.learn.preprocess import open_indexed_dataset, split_document_ranges, tokenize_to_indexed_dataset

#: Names inside ``{run_dir}/data`` (the guide's names; see the run-folder layout in the README).
DATA_DIR = "data"
JSONL_NAME = "codeparrot_data.json"
TOKENIZER_DIR = "tokenizer"
PREFIX_NAME = "codeparrot_content_document"
MANIFEST_NAME = "data_manifest.json"


@dataclass
class DataPaths:
    """The data stage's outputs in a run folder.

    Attributes:
        jsonl: the cleaned loose JSON (``codeparrot_data.json``).
        tokenizer_dir: the tokenizer folder (vocab.json, merges.txt, tokenizer.json, ...).
        data_prefix: ``.bin/.idx`` path without extension (``.../codeparrot_content_document``).
        num_documents: documents in the ``.bin/.idx`` (= lines of ``jsonl``).
        vocab_size: tokenizer entries (not padded; Megatron pads to a multiple of 128 x TP).
        split: the train/valid/test split the tokenizer was trained under; pass it on to
            :func:`helpers.learn.dataloader.build_gpt_datasets`.
        settings: everything the data was made with (``data_manifest.json``).
        built: the steps this call ran (empty when everything was reused).
    """

    jsonl: Path
    tokenizer_dir: Path
    data_prefix: Path
    num_documents: int
    vocab_size: int
    split: str
    settings: dict[str, Any] = field(default_factory=dict)
    built: list[str] = field(default_factory=list)


def _load_manifest(data_dir: Path) -> dict[str, Any] | None:
    path = data_dir / MANIFEST_NAME
    if not path.is_file():
        return None
    try:
        manifest = json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        manifest = err
    if not isinstance(manifest, dict) or not isinstance(manifest.get("settings"), dict):
        why = manifest if isinstance(manifest, Exception) else f"no 'settings' object in {type(manifest).__name__}"
        raise ValueError(f"{path} is not a data manifest ({why}): delete {data_dir} and rerun notebook 01 "
                         f"(python -m helpers.runner.series run --only 01 --run-dir {data_dir.parent})")
    return manifest


def data_manifest(run_dir: str | os.PathLike) -> dict[str, Any]:
    """``{run_dir}/data/data_manifest.json`` (settings, cleaning counts, preprocessing stats).

    Raises:
        FileNotFoundError: the data stage has not run in this folder (the message is the command).
    """
    manifest = _load_manifest(Path(run_dir).expanduser().resolve() / DATA_DIR)
    if manifest is None:
        raise FileNotFoundError(f"{run_dir}/data/{MANIFEST_NAME} not found: notebook 01 makes it "
                                f"(python -m helpers.runner.series run --only 01 --run-dir {run_dir})")
    return manifest


def data_paths(run_dir: str | os.PathLike) -> DataPaths:
    """What notebook 01 left in ``{run_dir}/data``, read back without building anything.

    Raises:
        FileNotFoundError: notebook 01 has not finished in this folder (the message is the command),
            or its tokenizer folder lacks a file (:func:`helpers.learn.tokenizer.check_folder`).
    """
    manifest = data_manifest(run_dir)
    data_dir = Path(run_dir).expanduser().resolve() / DATA_DIR
    prefix = data_dir / PREFIX_NAME
    if not {"preprocess", "tokenizer"} <= set(manifest) or not Path(f"{prefix}.idx").is_file():
        raise FileNotFoundError(f"{prefix}.bin/.idx not found: notebook 01 makes them "
                                f"(python -m helpers.runner.series run --only 01 --run-dir {run_dir})")
    return DataPaths(jsonl=data_dir / JSONL_NAME, tokenizer_dir=tokenizer_mod.check_folder(data_dir / TOKENIZER_DIR), data_prefix=prefix,
                     num_documents=manifest["preprocess"]["num_documents"],
                     vocab_size=manifest["tokenizer"]["vocab_size"], split=manifest["settings"]["split"],
                     settings=manifest["settings"])


#: Defaults of :func:`build_data` when neither the caller nor an existing run folder says otherwise.
DEFAULT_SETTINGS: dict[str, Any] = {
    "source": None, "text_key": "content", "max_files": None, "vocab_size": 8192,
    "split": "969,30,1", "seed": 1234, "more_filtering": False, "package_files": 0, "hf_split": "train",
}

#: What a manifest written before a setting existed was made with.
SETTINGS_BEFORE_THEY_EXISTED: dict[str, Any] = {"more_filtering": False, "package_files": 0, "hf_split": "train"}


def _write_manifest(data_dir: Path, manifest: dict[str, Any]) -> None:
    results.write_json(data_dir / MANIFEST_NAME, manifest)


#: Bytes the data stage writes per byte of corpus text, with headroom: the loose JSON (1.04 measured
#: for the cpu profile: escapes and paths) and the ``.bin`` (2 bytes per ``uint16`` token: 0.54 measured
#: at 3.7 characters per token; 1.0 allows for 2 characters per token), plus 10 %.
DATA_BYTES_PER_TEXT_BYTE = 2.3

#: Bytes beside those: the tokenizer (about 1 MB at vocab 8192), the manifest and the ``.idx``.
DATA_MARGIN_BYTES = 8 * 1000 ** 2


def _space_needed(text_bytes: int) -> tuple[float, str, str]:
    """``(bytes, what, fix)`` for :func:`helpers.support.run_guard.check_free_space` of the data stage."""
    return (DATA_BYTES_PER_TEXT_BYTE * text_bytes + DATA_MARGIN_BYTES,
            f"notebook 01's data (the loose JSON and the .bin/.idx of {run_guard.human_bytes(text_bytes)} of code)",
            "make the run folder on a bigger disk (run_dir=, or --run-dir), or read fewer files (max_files=)")


def _corpus_record(result: corpus_mod.CorpusResult) -> dict[str, Any]:
    """The manifest's ``corpus`` section: counts, removed paths by filter, near-duplicate pairs, and
    the characters per token of the files the later filters removed (the kept ones summarized)."""
    removed_later = {p for name in corpus_mod.MORE_FILTERS for p in result.removed_paths[name]}
    kept = sorted(r for p, r in result.char_token_ratios.items() if p not in removed_later)
    return {"source": result.source, "packages": result.packages, "packages_dir": result.packages_dir,
            "num_read": result.num_read, "removed": result.removed,
            "num_documents": len(result.documents), "num_bytes": result.num_bytes,
            "removed_files": result.removed_paths, "near_duplicate_of": result.near_duplicate_of,
            "char_token_ratio": {p: round(r, 3) for p, r in result.char_token_ratios.items() if p in removed_later},
            "char_token_ratio_kept": {"min": round(kept[0], 3), "median": round(statistics.median(kept), 3),
                                      "max": round(kept[-1], 3)} if kept else None}


def build_data(
    run_dir: str | os.PathLike,
    *,
    source: str | os.PathLike | None = None,
    text_key: str | None = None,
    max_files: int | None = None,
    vocab_size: int | None = None,
    split: str | None = None,
    more_filtering: bool | None = None,
    package_files: int | None = None,
    hf_split: str | None = None,
    hf_streaming: bool = True,
    num_workers: int = 2,
    seed: int | None = None,
    progress: bool = True,
    stop_after: str | None = None,
    engine: str = "auto",
    missing_text: str = "skip",
) -> DataPaths:
    """Notebook 01's stage: make (or reuse) the whole data stage in ``{run_dir}/data``; cached.

    Steps, each skipped when its output exists: the cleaned corpus ``codeparrot_data.json``
    (:func:`helpers.learn.corpus.collect_corpus`) -> a BPE trained on the *train-split* documents only
    (:func:`helpers.learn.tokenizer.train_tokenizer`) -> ``codeparrot_content_document.bin/.idx``
    (:func:`tokenize_to_indexed_dataset`). The settings are stored in ``data/data_manifest.json``; a setting
    left ``None`` means the run folder's, or :data:`DEFAULT_SETTINGS` for a new folder. Later notebooks call
    ``helpers.runner.series.require`` and :func:`data_paths` instead.

    Args:
        source, text_key, max_files, seed, more_filtering, package_files, hf_split, hf_streaming:
            see :func:`helpers.learn.corpus.collect_corpus`.
        missing_text: rows without text: ``"skip"`` counts them, ``"refuse"`` stops. It, ``engine``,
            ``num_workers`` and ``hf_streaming`` are not data settings (the files do not depend on them).
        vocab_size: tokenizer size (:func:`helpers.learn.tokenizer.train_tokenizer`).
        split: Megatron's ``--split`` weights "train,valid,test".
        stop_after: ``"corpus"`` or ``"tokenizer"`` to run only up to that step; ``None`` runs them all.

    Returns:
        :class:`DataPaths`.

    Raises:
        ValueError: a given setting differs from the one the existing data was made with
            (the message names it and the fix: a new run folder).
        helpers.support.run_guard.DiskFullError: the data would not fit on the run folder's disk (checked
            once the corpus is read, before a file is written), or the disk filled up.
        FileNotFoundError / ValueError: from the corpus, tokenizer and preprocessing steps.
    """

    if stop_after not in (None, "corpus", "tokenizer"):
        raise ValueError(f"stop_after={stop_after!r}: use 'corpus', 'tokenizer' or None")
    resolve_engine(engine)
    hub_datasets.check_missing_text(missing_text)
    # Check the settings later steps use before anything is written: a bad one found only at
    # the tokenizer step would leave a manifest that refuses the corrected rerun.
    if vocab_size is not None and vocab_size < tokenizer_mod.MIN_VOCAB_SIZE:
        raise ValueError(f"vocab_size={vocab_size} is too small: a byte-level BPE needs the byte "
                         f"alphabet plus special tokens; pass vocab_size >= {tokenizer_mod.MIN_VOCAB_SIZE}")
    if split is not None and split_document_ranges(1000, split)[0] is None:
        raise ValueError(f"split={split!r} gives the train part weight 0: the tokenizer is trained on it")
    data_dir = run_guard.check_writable(Path(run_dir).expanduser() / DATA_DIR)  # read-only: refused, nothing made
    data_dir.mkdir(parents=True, exist_ok=True)
    jsonl, tok_dir, prefix = data_dir / JSONL_NAME, data_dir / TOKENIZER_DIR, data_dir / PREFIX_NAME
    from_hub = hub_datasets.is_dataset_source(source)
    requested = {"source": None if source is None else hub_datasets.canonical(source) if from_hub  # type: ignore[arg-type]
                 else str(Path(source).expanduser().resolve()), "hf_split": hf_split if from_hub else None,
                 "text_key": text_key, "max_files": max_files, "vocab_size": vocab_size,
                 "split": split, "seed": seed, "more_filtering": more_filtering,
                 "package_files": 0 if source is not None and package_files is not None else package_files}
    manifest = data_manifest(run_dir) if (data_dir / MANIFEST_NAME).is_file() else None  # a damaged one: ValueError
    if manifest is not None:
        for name, value in requested.items():
            made = manifest["settings"].get(name, SETTINGS_BEFORE_THEY_EXISTED.get(name))
            if value is not None and made != value:
                raise ValueError(
                    f"{data_dir} was made with {name}={made!r}, not {value!r}. "
                    f"Nothing was changed. Use a new run folder for other data settings, or delete {data_dir}."
                )
        settings = dict(manifest["settings"])
    else:
        settings = {k: (v if v is not None else DEFAULT_SETTINGS[k]) for k, v in requested.items()}
        manifest = {"settings": settings}
    built: list[str] = []

    if not jsonl.is_file():
        more = settings.get("more_filtering", SETTINGS_BEFORE_THEY_EXISTED["more_filtering"])
        result = corpus_mod.collect_corpus(settings["source"], text_key=settings["text_key"],
                                           max_files=settings["max_files"], seed=settings["seed"],
                                           more_filtering=more, vocab_size=settings["vocab_size"],
                                           package_files=settings.get("package_files", 0),
                                           hf_split=settings.get("hf_split", "train"), hf_streaming=hf_streaming,
                                           missing_text=missing_text)
        run_guard.check_free_space(data_dir, *_space_needed(result.num_bytes))  # before the first file is written
        with run_guard.explain_disk_full(data_dir, *_space_needed(result.num_bytes)):
            corpus_mod.write_jsonl(result.documents, jsonl)
            manifest["corpus"] = _corpus_record(result)
            _write_manifest(data_dir, manifest)
        built.append("corpus")
    text_bytes = manifest.get("corpus", {}).get("num_bytes") or jsonl.stat().st_size
    with run_guard.explain_disk_full(data_dir, *_space_needed(text_bytes)):
        if not (data_dir / MANIFEST_NAME).is_file():
            _write_manifest(data_dir, manifest)
        if stop_after != "corpus" and not tokenizer_mod.tokenizer_exists(tok_dir):
            texts = corpus_mod.read_contents(jsonl)
            train_range = split_document_ranges(len(texts), settings["split"])[0]
            if train_range is None or train_range[1] == train_range[0]:
                raise ValueError(f"split={settings['split']!r} leaves no training documents out of {len(texts)}: give train a weight")
            tokenizer_mod.train_tokenizer(texts[train_range[0]:train_range[1]], tok_dir,
                                          vocab_size=settings["vocab_size"], show_progress=progress)
            manifest["tokenizer"] = {"train_documents": list(train_range), "vocab_size": tokenizer_mod.vocab_size_of(tok_dir)}
            _write_manifest(data_dir, manifest)
            built.append("tokenizer")
        if stop_after is None and not (Path(f"{prefix}.bin").is_file() and Path(f"{prefix}.idx").is_file()):
            stats = tokenize_to_indexed_dataset(jsonl, tok_dir, prefix, num_workers=num_workers,
                                                progress=progress, overwrite=True, engine=engine)
            manifest["preprocess"] = asdict(stats) | {"tokens_per_second": stats.tokens_per_second,
                                                      "documents_per_second": stats.documents_per_second,
                                                      "megabytes_per_second": stats.megabytes_per_second}
            _write_manifest(data_dir, manifest)
            built.append("bin_idx")
    has_idx = Path(f"{prefix}.idx").is_file()
    num_documents = len(open_indexed_dataset(prefix)) if has_idx else manifest.get("corpus", {}).get(
        "num_documents", len(corpus_mod.read_contents(jsonl)))
    has_tok = tokenizer_mod.tokenizer_exists(tok_dir)
    vocab = tokenizer_mod.vocab_size_of(tok_dir) if has_tok else settings["vocab_size"]
    if built:
        print(f"build_data: built {', '.join(built)} in {data_dir}")
    else:
        print(f"build_data: reusing {data_dir} ({num_documents} documents, vocab {vocab}, split {settings['split']})")
    return DataPaths(jsonl=jsonl, tokenizer_dir=tok_dir, data_prefix=prefix, num_documents=num_documents,
                     vocab_size=vocab, split=settings["split"], settings=settings, built=built)
