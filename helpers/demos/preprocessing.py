"""Notebook 01's checks of the data stage and notebook 02's second corpus.

Notebook 01: every stored document decodes back to its line of the loose JSON (section 5), today's
Megatron-LM command for the same files (section 6; ``bench/preprocess.py`` runs it), how the trained BPE
cuts a few lines of code (section 3). Notebook 02 section 9: a further corpus tokenized to blend.

Sources: Megatron-LM ``tools/preprocess_data.py``; megatron-core ``datasets/indexed_dataset.py``;
Hugging Face ``tokenizers`` ``Encoding.offsets``.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

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

    The guide's 2022 flags as today's tool takes them: it has no ``--dataset-impl`` or ``--chunk-size``,
    ``--vocab`` is an ambiguous prefix, and ``GPT2BPETokenizer`` needs the Hugging Face
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


@dataclass(frozen=True)
class TokenSpan:
    """One token of a text: its id, its entry in the vocabulary and the characters it covers.

    Attributes:
        id: token id.
        token: its vocabulary entry (byte-level: ``Ġ`` a space, ``Ċ`` a newline).
        start, end: its characters are ``text[start:end]`` (Python string indices).
    """

    id: int
    token: str
    start: int
    end: int


def token_spans(tokenizer: Any, text: str) -> list[TokenSpan]:
    """The tokens of ``text`` with the character span of each, from the tokenizer's offsets.

    Args:
        tokenizer: a Hugging Face ``tokenizers.Tokenizer`` (:func:`helpers.learn.tokenizer.load_fast_tokenizer`)
            or a transformers fast tokenizer (:func:`helpers.learn.tokenizer.load_tokenizer`).
        text: the text to encode (no special tokens are added).

    Returns:
        One :class:`TokenSpan` per token, in order. For a byte-level BPE with ``trim_offsets=False``
        (notebook 01's) the spans are contiguous and cover ``text`` exactly; where one character's
        bytes are split over several tokens, those tokens share the character's span.
    """
    from tokenizers import Tokenizer

    if isinstance(tokenizer, Tokenizer):
        enc = tokenizer.encode(text, add_special_tokens=False)
        ids, tokens, offsets = enc.ids, enc.tokens, enc.offsets
    else:  # transformers' fast tokenizer
        enc = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
        ids, offsets = enc["input_ids"], enc["offset_mapping"]
        tokens = tokenizer.convert_ids_to_tokens(ids)
    return [TokenSpan(int(i), t, int(a), int(b)) for i, t, (a, b) in zip(ids, tokens, offsets)]



def cut_names(text: str, spans: Sequence[TokenSpan]) -> dict[str, list[str]]:
    """The names (identifiers and keywords) of ``text`` that the tokenizer cuts into several pieces.

    Args:
        text: the encoded text. spans: :func:`token_spans` of it.

    Returns:
        ``{name: [piece, ...]}`` in the order the names first appear, each piece the part of the
        name one token covers (``"makedirs"`` -> ``["ma", "ked", "ir", "s"]``); names that lie
        within one token are left out.
    """
    import re

    out: dict[str, list[str]] = {}
    for match in re.finditer(r"[A-Za-z_][A-Za-z0-9_]*", text):
        a, b = match.span()
        pieces = [text[max(s.start, a):min(s.end, b)] for s in spans if s.start < b and s.end > a]
        if len(pieces) > 1 and match.group() not in out:
            out[match.group()] = pieces
    return out

#: Colours of the token bands, cycled so that neighbouring tokens differ (matplotlib's tab20, light shades).
_BAND_COLOURS = ("#aec7e8", "#ffbb78", "#98df8a", "#ff9896", "#c5b0d5", "#c49c94", "#f7b6d2", "#dbdb8d", "#9edae5")


def plot_token_spans(text: str, spans: Sequence[TokenSpan], *, title: str = "How the BPE cuts the code",
                     first_line: int = 1):
    """The characters of ``text`` on a grid, one colour band behind each token's characters.

    Each character takes one cell of a monospace grid (row = line, column = character); a space
    is drawn as ``·`` and a newline as ``↵`` at the end of its line, so a token made of
    indentation or of a newline and the next line's indentation shows as a band over those
    marks. The number of tokens that start on each line is written at its right.

    Args:
        text: the text that was encoded. spans: :func:`token_spans` of it.
        first_line: number of the first line in its file (for the y-axis labels).

    Returns:
        The matplotlib figure.
    """
    import matplotlib.pyplot as plt
    from matplotlib.patches import Rectangle

    cells, row, col = [], 0, 0  # (row, column) of every character
    for ch in text:
        cells.append((row, col))
        row, col = (row + 1, 0) if ch == "\n" else (row, col + 1)
    rows = max(r for r, _ in cells) + 1 if cells else 1
    cols = max(c for _, c in cells) + 1 if cells else 1
    fig, ax = plt.subplots(figsize=(max(6.0, 0.14 * cols + 1.6), 0.42 * rows + 1.3))
    starts_per_row = [0] * rows
    for k, span in enumerate(spans):
        colour = _BAND_COLOURS[k % len(_BAND_COLOURS)]
        if span.start < len(cells):
            starts_per_row[cells[span.start][0]] += 1
        for i in range(span.start, min(span.end, len(cells))):
            r, c = cells[i]
            ax.add_patch(Rectangle((c, r - 0.42), 1, 0.84, facecolor=colour, edgecolor="none"))
        if span.start < len(cells):  # a thin white gap where a token starts
            r, c = cells[span.start]
            ax.plot([c, c], [r - 0.42, r + 0.42], color="white", lw=1.5)
    for ch, (r, c) in zip(text, cells):
        shown, colour = {" ": ("·", "0.45"), "\n": ("↵", "0.45"), "\t": ("→", "0.45")}.get(ch, (ch, "black"))
        ax.text(c + 0.5, r, shown, ha="center", va="center", family="monospace", fontsize=10, color=colour)
    for r, n in enumerate(starts_per_row):
        ax.text(cols + 0.8, r, f"{n} tokens", va="center", fontsize=8, color="0.3")
    ax.set(xlim=(0, cols + 6), ylim=(rows - 0.5, -0.5), title=title,
           xlabel="column (characters; · a space, ↵ a newline; one colour band per token)", ylabel="line of the file")
    ax.set_yticks(range(rows), [str(first_line + r) for r in range(rows)])
    for side in ("top", "right"):
        ax.spines[side].set_visible(False)
    return fig
