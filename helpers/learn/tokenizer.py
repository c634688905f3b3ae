"""Train, save and load the byte-level BPE tokenizer of the series (GPT-2 style; notebook 01 §3).

Trained with Hugging Face ``tokenizers`` (GPT-2's byte-level pre-tokenizer, no prefix space) into
one folder every tool reads: ``vocab.json`` + ``merges.txt`` (Megatron-LM's ``--vocab-file`` /
``--merge-file``) and ``tokenizer.json`` + ``tokenizer_config.json`` (``AutoTokenizer`` and
``--tokenizer-type HuggingFaceTokenizer``). The only special token is ``<|endoftext|>`` (id 0),
the EOD token; any text encodes and ``decode(encode(text)) == text`` exactly.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Iterable

#: The end-of-document token (GPT-2's), also used as bos/eos/unk in ``tokenizer_config.json``.
EOD_TOKEN = "<|endoftext|>"
#: Byte-level BPE starts from the 256 byte symbols; plus the special tokens.
BYTE_ALPHABET_SIZE = 256
SPECIAL_TOKENS: tuple[str, ...] = (EOD_TOKEN,)
MIN_VOCAB_SIZE = BYTE_ALPHABET_SIZE + len(SPECIAL_TOKENS)

#: Files :func:`train_tokenizer` writes into its folder.
TOKENIZER_FILES: tuple[str, ...] = ("vocab.json", "merges.txt", "tokenizer.json", "tokenizer_config.json")


def tokenizer_exists(out_dir: str | os.PathLike) -> bool:
    """True when ``out_dir`` holds every file of :data:`TOKENIZER_FILES`."""
    return all((Path(out_dir) / name).is_file() for name in TOKENIZER_FILES)


def check_folder(tokenizer_dir: str | os.PathLike) -> Path:
    """Check that ``tokenizer_dir`` holds every file of :data:`TOKENIZER_FILES`; the one check every
    reader of the folder makes first (data_paths, the training config, the loaders).

    Returns:
        The folder as a :class:`~pathlib.Path`.

    Raises:
        FileNotFoundError: the folder or a file is missing; the message names them and how to
            rebuild the folder (notebook 01 retrains it from the loose JSON beside it; the
            ``.bin/.idx`` made with the old tokenizer are remade with it).
    """
    folder = Path(tokenizer_dir).expanduser()
    missing = [n for n in TOKENIZER_FILES if not (folder / n).is_file()]
    if not missing:
        return folder
    what = "does not exist" if not folder.is_dir() else f"lacks {', '.join(missing)}"
    raise FileNotFoundError(
        f"the tokenizer folder {folder} {what} (a tokenizer is {', '.join(TOKENIZER_FILES)}). Rebuild it: delete "
        f"{folder} and the .bin/.idx beside it (their token ids come from the tokenizer), then run notebook 01 "
        f"again (python -m helpers.runner.series run --only 01 --run-dir <this run folder>), which retrains it from the "
        f"loose JSON (a TrainingConfig of your own can also point tokenizer_dir at a complete folder).")


def train_tokenizer(
    texts: Iterable[str],
    out_dir: str | os.PathLike,
    *,
    vocab_size: int = 8192,
    min_frequency: int = 2,
    show_progress: bool = False,
    overwrite: bool = False,
) -> Path:
    """Train a byte-level BPE on ``texts`` and save it as a tokenizer folder.

    GPT-2's byte-level BPE (Radford et al. 2019, section 2.2) with ``tokenizers.trainers.BpeTrainer``,
    in the folder Megatron-LM's ``--tokenizer-type HuggingFaceTokenizer`` and ``AutoTokenizer`` read.

    Args:
        texts: training documents (the train split only, so held-out files stay unseen).
        out_dir: folder to write (via a temporary folder); created if missing, its parent must exist.
        vocab_size: entries in the vocabulary, special tokens included (8192 on CPU; the
            guide's CodeParrot used 32768). A small corpus may yield fewer entries.
        min_frequency: a merge must occur at least this often.
        show_progress: show the trainer's progress bar.
        overwrite: replace tokenizer files already in ``out_dir``.

    Returns:
        ``out_dir`` as a :class:`~pathlib.Path`.

    Raises:
        ValueError: ``vocab_size`` is smaller than the byte alphabet plus the special tokens
            (:data:`MIN_VOCAB_SIZE` = 257), or ``texts`` is empty.
        FileNotFoundError: the parent of ``out_dir`` does not exist.
        FileExistsError: ``out_dir`` already holds a tokenizer and ``overwrite`` is False.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    if vocab_size < MIN_VOCAB_SIZE:
        raise ValueError(
            f"vocab_size={vocab_size} is too small: a byte-level BPE needs the {BYTE_ALPHABET_SIZE} "
            f"byte symbols plus {len(SPECIAL_TOKENS)} special token(s); pass vocab_size >= {MIN_VOCAB_SIZE}"
        )
    out = Path(out_dir)
    if not out.parent.is_dir():
        raise FileNotFoundError(f"cannot write the tokenizer to {out}: folder {out.parent} does not exist")
    if any((out / name).exists() for name in TOKENIZER_FILES) and not overwrite:
        raise FileExistsError(f"{out} already holds tokenizer files: pass overwrite=True or another out_dir")

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=min_frequency,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=show_progress,
    )
    texts = list(texts)
    if not texts:
        raise ValueError("texts is empty: pass the training documents")
    tokenizer.train_from_iterator(texts, trainer=trainer, length=len(texts))

    tmp = Path(tempfile.mkdtemp(dir=out.parent, prefix=f".{out.name}."))
    try:
        _save_folder(tokenizer, tmp)
        out.mkdir(exist_ok=True)
        for name in TOKENIZER_FILES:
            os.replace(tmp / name, out / name)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out


def _save_folder(tokenizer, folder: Path) -> None:
    """vocab.json + merges.txt (BPE model) and the transformers files, in ``folder``."""
    from transformers import GPT2TokenizerFast

    tokenizer.model.save(str(folder))
    hf = GPT2TokenizerFast(
        tokenizer_object=tokenizer,
        bos_token=EOD_TOKEN, eos_token=EOD_TOKEN, unk_token=EOD_TOKEN,
        add_prefix_space=False, clean_up_tokenization_spaces=False,
    )
    hf.save_pretrained(str(folder))
    for name in TOKENIZER_FILES:
        if not (folder / name).is_file():
            raise RuntimeError(f"saving the tokenizer did not write {name} in {folder}")


def load_fast_tokenizer(tokenizer_dir: str | os.PathLike):
    """The raw HF ``tokenizers.Tokenizer`` from ``tokenizer_dir/tokenizer.json``.

    It encodes in parallel (``encode_batch``) and is what :mod:`helpers.learn.preprocess` uses.
    ``encode_special_tokens`` is set, so a literal ``<|endoftext|>`` *inside* a document is
    encoded as ordinary text: the only EOD ids in the data are the appended ones.

    Raises:
        FileNotFoundError: a file of the folder is missing (:func:`check_folder`).
    """
    from tokenizers import Tokenizer

    path = check_folder(tokenizer_dir) / "tokenizer.json"
    tokenizer = Tokenizer.from_file(str(path))
    tokenizer.encode_special_tokens = True
    return tokenizer


def vocab_size_of(tokenizer_dir: str | os.PathLike) -> int:
    """Number of entries in ``vocab.json`` (special tokens included).

    Raises:
        FileNotFoundError: no ``vocab.json`` in the folder.
    """
    path = Path(tokenizer_dir) / "vocab.json"
    if not path.is_file():
        raise FileNotFoundError(f"{path} not found: train the tokenizer first (notebook 01)")
    with open(path, encoding="utf-8") as f:
        return len(json.load(f))


def eod_id(tokenizer_dir: str | os.PathLike) -> int:
    """Id of :data:`EOD_TOKEN` in ``vocab.json``.

    Raises:
        KeyError: the vocabulary has no ``<|endoftext|>``.
    """
    with open(Path(tokenizer_dir) / "vocab.json", encoding="utf-8") as f:
        vocab = json.load(f)
    if EOD_TOKEN not in vocab:
        raise KeyError(f"{tokenizer_dir}/vocab.json has no {EOD_TOKEN!r}: retrain with helpers.learn.tokenizer.train_tokenizer")
    return int(vocab[EOD_TOKEN])


def load_tokenizer(tokenizer_dir: str | os.PathLike):
    """The transformers fast tokenizer saved in ``tokenizer_dir``, checked.

    Loads with ``AutoTokenizer.from_pretrained(folder)`` only: with transformers 5.x,
    ``GPT2TokenizerFast(vocab_file=..., merges_file=...)`` silently builds an empty tokenizer,
    so the vocabulary size is checked against ``vocab.json``.

    Returns:
        A ``transformers`` fast tokenizer (``GPT2Tokenizer`` backed by ``tokenizers``).

    Raises:
        FileNotFoundError: the folder lacks a file of :data:`helpers.learn.tokenizer.TOKENIZER_FILES` (:func:`check_folder`).
        ValueError: the loaded tokenizer's size or EOD id differs from ``vocab.json``.
    """
    from transformers import AutoTokenizer

    folder = check_folder(tokenizer_dir)
    tok = AutoTokenizer.from_pretrained(str(folder))
    expected = vocab_size_of(folder)
    if len(tok) != expected:
        raise ValueError(f"tokenizer loaded from {folder} has {len(tok)} entries but vocab.json has {expected}")
    if tok.eos_token_id != eod_id(folder):
        raise ValueError(f"tokenizer loaded from {folder}: eos id {tok.eos_token_id} is not the EOD id of vocab.json")
    return tok


def round_trip_failures(tokenizer_dir: str | os.PathLike, texts: Iterable[str]) -> list[int]:
    """Positions of the texts for which ``decode(encode(text)) != text`` (empty = all exact).

    Uses the transformers tokenizer loaded from the folder (the one a user of the converted
    model gets), without special-token handling of the text.
    """
    tok = load_tokenizer(tokenizer_dir)
    failures = []
    for i, text in enumerate(texts):
        ids = tok(text, split_special_tokens=True, verbose=False)["input_ids"]
        if tok.decode(ids) != text:
            failures.append(i)
    return failures
