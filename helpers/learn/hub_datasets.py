"""Read a 🤗 ``datasets`` dataset as corpus documents: the guide's first step (notebook 01 §7).

The rows become documents of :func:`helpers.learn.corpus.collect_corpus`, so they get the same
cleaning, counts and writer as the other sources. A source starts with :data:`PREFIX` (``hf:``)
and ends in one ``datasets.load_dataset`` call (:func:`load_arguments`):

* ``hf:OWNER/NAME``: a dataset on the Hub;
* ``hf:BUILDER:FILES``: local data files (a path or glob) read by a builder of :data:`BUILDERS`;
* ``hf:FOLDER``: a local folder of data files (FOLDER starts with ``/``, ``.`` or ``~``, or exists).

:func:`check_hub` asks the Hub once with a short timeout, since ``load_dataset`` retries for tens
of seconds offline. Sources: the ``datasets`` documentation, "Load" and "Stream".
"""

from __future__ import annotations

import glob
import itertools
import os
import re
from pathlib import Path
from typing import Any, Iterator

#: Start of a dataset source (notebook 01's ``source`` parameter).
PREFIX = "hf:"
#: ``datasets``' packaged builders that read local files given as ``data_files``.
BUILDERS: tuple[str, ...] = ("json", "parquet", "csv", "text", "arrow")
#: Seconds :func:`check_hub` waits for the Hub to answer.
HUB_TIMEOUT = 5.0
#: Environment variables that switch the Hub off (``huggingface_hub`` and older ``datasets``).
OFFLINE_VARIABLES: tuple[str, ...] = ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE")

#: What a row whose text is missing may do (``missing_text=``): be counted and skipped, as real
#: datasets need (a null here and there), or stop the read, naming the row.
MISSING_TEXT_CHOICES: tuple[str, ...] = ("skip", "refuse")


class MissingText:
    """The text of a row whose text column holds ``None`` (a JSON ``null``): :data:`MISSING_TEXT`.

    :func:`helpers.learn.corpus.rejection_reason` counts it under the filter ``missing`` and skips it.
    """

    __slots__ = ()

    def __repr__(self) -> str:
        return "MISSING_TEXT"


#: The one :class:`MissingText`; compare with ``is``.
MISSING_TEXT = MissingText()


def check_missing_text(missing_text: str) -> str:
    """``missing_text`` if it is one of :data:`MISSING_TEXT_CHOICES`.

    Raises:
        ValueError: another value; the message lists the choices.
    """
    if missing_text not in MISSING_TEXT_CHOICES:
        raise ValueError(f"missing_text={missing_text!r}: choose {' or '.join(map(repr, MISSING_TEXT_CHOICES))} "
                         "(skip counts and skips rows whose text is missing; refuse stops at the first)")
    return missing_text


def missing_text_error(where: str, text_key: str) -> ValueError:
    """The error of a row without text read with ``missing_text="refuse"``."""
    return ValueError(f"{where}: {text_key!r} holds no text (None / null), and missing_text='refuse' stops at such "
                      "a row. Pass missing_text='skip' to count and skip them (the counts table shows how many), "
                      "or fix the data.")


_HUB_ID = re.compile(r"[\w.-]+(/[\w.-]+)?")
_LOCAL_HINT = ("point source at local files instead: 'hf:json:/path/to/files.jsonl' (or hf:parquet:/path/*.parquet) "
               "reads data files with load_dataset, 'hf:/path/to/folder' a local folder of data files, "
               "'/path/to/file.jsonl' a JSON Lines file and '/path/to/folder' its .py files")


def is_dataset_source(source: Any) -> bool:
    """True when ``source`` is a dataset source (a string starting with :data:`PREFIX`)."""
    return isinstance(source, str) and source.startswith(PREFIX)


def load_arguments(source: str, split: str = "train", streaming: bool = True) -> tuple[str, dict[str, Any]]:
    """The ``datasets.load_dataset`` call a dataset source stands for (see the module's table).

    Local paths are made absolute, so the same source read from another folder is the same call.

    Returns:
        ``(path, keyword arguments)``: ``load_dataset(path, **kwargs)`` loads it; the keywords are
        ``split``, ``streaming`` and, for ``hf:BUILDER:FILES``, ``data_files``.

    Raises:
        ValueError: ``source`` does not start with ``hf:``, names no dataset, names a builder
            outside :data:`BUILDERS` or no files after it.
        FileNotFoundError: ``hf:FOLDER`` with a path that is not a folder.
    """
    spec = source[len(PREFIX):] if is_dataset_source(source) else None
    if not spec:
        raise ValueError(f"source={source!r} is not a dataset source: write hf:OWNER/NAME (the Hub), "
                         "hf:json:/path/files.jsonl (local data files) or hf:/path/folder")
    kwargs: dict[str, Any] = {"split": split, "streaming": streaming}
    builder, colon, files = spec.partition(":")
    if colon and builder in BUILDERS and files:
        if "://" in files:  # a URL or hf:// path: datasets fetches it itself
            return builder, {"data_files": files} | kwargs
        files = str(Path(files).expanduser().resolve())
        if not glob.glob(files):
            raise FileNotFoundError(f"source={source!r}: no file matches {files}: check the path (absolute, or "
                                    "relative to the notebooks/ folder papermill runs in) or the glob")
        return builder, {"data_files": files} | kwargs
    if builder in BUILDERS:  # hf:json or hf:json: without files would make load_dataset read the working folder
        raise ValueError(f"source={source!r}: the {builder} builder needs the files after it: "
                         f"hf:{builder}:/path/to/files (a path or a glob)")
    if spec.startswith(("/", ".", "~")) or Path(spec).expanduser().exists():
        folder = Path(spec).expanduser().resolve()
        if not folder.exists():
            raise FileNotFoundError(f"source={source!r}: {folder} does not exist (a relative path is read from the "
                                    "notebooks/ folder papermill runs in: give an absolute one)")
        if not folder.is_dir():
            raise FileNotFoundError(f"source={source!r}: {folder} is not a folder; for data files write "
                                    f"hf:json:{folder} (or another builder of {BUILDERS})")
        return str(folder), kwargs
    if colon or not _HUB_ID.fullmatch(spec):
        raise ValueError(f"source={source!r}: write hf:OWNER/NAME for a Hub dataset, hf:BUILDER:FILES with a "
                         f"builder of {BUILDERS} and the files after it, or hf:/path/to/folder")
    return spec, kwargs


def canonical(source: str) -> str:
    """``source`` with its local paths made absolute (:func:`load_arguments`), as the manifest stores it."""
    path, kwargs = load_arguments(source)
    return PREFIX + (f"{path}:{kwargs['data_files']}" if "data_files" in kwargs else path)


def _offline_error(path: str, reason: str) -> ConnectionError:
    return ConnectionError(f"source='hf:{path}': {reason}, so the Hub dataset {path!r} cannot be loaded. "
                           f"Nothing was written. Connect to the Hub ({OFFLINE_VARIABLES[0]} unset, HF_ENDPOINT "
                           f"reachable), or {_LOCAL_HINT}.")


def check_hub(path: str) -> None:
    """Raise at once when ``path`` (from :func:`load_arguments`) is a Hub dataset the Hub cannot serve.

    Local data passes without a network call, and so does a Hub id when ``huggingface_hub`` was
    imported in offline mode (``load_dataset`` then reads its cache). Offline mode switched on after
    that import (:data:`OFFLINE_VARIABLES`) is refused, as ``datasets`` would not see it. Else one
    ``HEAD`` request to ``HF_ENDPOINT`` must answer within :data:`HUB_TIMEOUT` seconds.

    Raises:
        ConnectionError: offline mode is on, or the Hub could not be reached; the message says
            which, and how to point ``source`` at local files instead.
    """
    if path in BUILDERS or Path(path).is_absolute():
        return
    from huggingface_hub import constants, get_session

    if constants.HF_HUB_OFFLINE:
        return  # load_dataset reads the local cache; a miss is a ConnectionError at once (read_dataset names it)
    flags = [name for name in OFFLINE_VARIABLES if os.environ.get(name, "").strip().upper() in ("1", "ON", "YES", "TRUE")]
    if flags:
        raise _offline_error(path, f"offline mode is on ({flags[0]}=1)")
    try:
        get_session().head(constants.ENDPOINT, timeout=HUB_TIMEOUT)
    except Exception as err:  # noqa: BLE001 - any failure of the one request means "not reachable"
        raise _offline_error(path, f"the Hub at {constants.ENDPOINT} could not be reached within "
                                   f"{HUB_TIMEOUT} s ({type(err).__name__}: {err})") from None


def read_dataset(source: str, text_key: str = "content", max_docs: int | None = None, split: str = "train",
                 streaming: bool = True, missing_text: str = "skip") -> Iterator[tuple[str | MissingText, str]]:
    """Yield ``(text, "PATH:SPLIT:ROW")`` for the first ``max_docs`` rows of a dataset source.

    A row whose text is ``None`` yields :data:`MISSING_TEXT` (``missing_text="skip"``: counted and
    skipped by :func:`helpers.learn.corpus.collect_corpus`) or stops the read (``"refuse"``).

    Makes the ``datasets.load_dataset`` call of :func:`load_arguments` (after :func:`check_hub`);
    ``streaming=True`` reads rows as they arrive, ``False`` caches the split as Arrow first (same rows).

    Raises:
        ConnectionError: see :func:`check_hub`.
        ValueError: a bad spelling (:func:`load_arguments`); ``split`` is not one of the dataset's
            splits (the message lists them and names ``hf_split``); a row lacks the column
            ``text_key`` (the message lists the columns found and names ``text_key``) or it holds
            something other than text (a number, a list), or ``None`` with ``missing_text="refuse"``,
            as in a JSON Lines source; ``missing_text`` is not a choice of :data:`MISSING_TEXT_CHOICES`.
        FileNotFoundError: no local file or folder matches (``datasets``' message).
    """
    check_missing_text(missing_text)
    path, kwargs = load_arguments(source, split, streaming)
    check_hub(path)
    from datasets import load_dataset

    try:
        dataset = load_dataset(path, **kwargs)
    except ConnectionError as err:
        from huggingface_hub import constants

        why = ("offline mode is on (HF_HUB_OFFLINE=1) and the dataset is not in the local cache" if constants.HF_HUB_OFFLINE
               else "the Hub could not be reached")
        raise _offline_error(path, f"{why} ({err})") from None
    except ValueError as err:
        if "split" not in str(err).lower():
            raise
        raise ValueError(f"source={source!r}: {str(err).rstrip('.')}; pass one of those splits as hf_split "
                         f"(split= of collect_corpus), not {split!r}") from None
    for row_number, row in enumerate(itertools.islice(dataset, max_docs)):
        if text_key not in row:
            raise ValueError(f"source={source!r}: split {split!r} has no column {text_key!r} (columns: {sorted(row)}); "
                             "pass the column that holds the text as text_key")
        text = row[text_key]
        if text is None:
            if missing_text == "refuse":
                raise missing_text_error(f"source={source!r}: row {row_number}", text_key)
            yield MISSING_TEXT, f"{path}:{split}:{row_number}"
            continue
        if not isinstance(text, str):
            raise ValueError(f"source={source!r}: row {row_number}: column {text_key!r} holds {text!r:.40} "
                             f"({type(text).__name__}), not text; pass a text column as text_key")
        yield text, f"{path}:{split}:{row_number}"
