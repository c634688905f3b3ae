"""Preprocessing benchmark: the series' ``.bin/.idx`` writer against Megatron-LM's own tool.

Both sides read the same JSON Lines file, use the same tokenizer folder (``vocab.json``,
``merges.txt``, ``tokenizer.json``, ``tokenizer_config.json``), the same number of workers,
``--append-eod``, and write Megatron's ``<prefix>.bin/.idx``:

* ``ours``: :func:`helpers.learn.preprocess.tokenize_to_indexed_dataset` as the series runs it
  (``engine="auto"``: the Rust ``gigatoken`` encoder that Megatron-LM's newer
  ``tools/preprocess_data_fast.py`` uses, + megatron-core ``IndexedDatasetBuilder``), in a
  fresh process of this interpreter;
* ``ours_tokenizers``: the same function with ``engine="tokenizers"`` (HF ``tokenizers`` in
  worker threads), the series' fallback engine, which shows what the engine itself gains;
* ``megatron``: ``tools/preprocess_data.py`` of a Megatron-LM checkout (worker processes,
  ``--tokenizer-type HuggingFaceTokenizer``), run with its own Python (>= 3.12, see
  ``bench/README.md``). Megatron-LM is not a dependency of the series: pass its path.

For each side: wall time of the whole process (imports included), the time of the
tokenizing phase alone, documents/s, tokens/s and peak memory of the process tree; the
repeats are interleaved and the medians compared. Then the outputs are compared: token ids
of every document, and whether the ``.bin`` and ``.idx`` files are byte-identical.

Run (from the repository root)::

    python -m bench.preprocess --megatron-lm /tmp/megatron-lm --megatron-python .venv/bin/python
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import re
import shutil
import sys
import time
from pathlib import Path
from typing import Any, Sequence

from bench import common

#: Where each side writes, under ``{run_dir}/bench_preprocess/``.
OUT_DIR = "bench_preprocess"
#: Megatron-LM's tool names its output ``<output-prefix>_<json key>_document``.
MEGATRON_SUFFIX = "_content_document"
SIDES = ("ours", "ours_tokenizers", "megatron")
#: The ``engine`` of :func:`helpers.learn.preprocess.tokenize_to_indexed_dataset` each of our sides runs.
ENGINE_OF = {"ours": "auto", "ours_tokenizers": "tokenizers"}
#: The oldest Python Megatron-LM's tools import under (``typing.override``, requires-python).
MEGATRON_MIN_PYTHON = (3, 12)

_PROGRESS = re.compile(r"Processed (\d+) documents \(([0-9.eE+-]+) docs/s, ([0-9.eE+-]+) MB/s\)")


# --------------------------------------------------------------------------- Megatron-LM's tool
def check_megatron_checkout(path: str | os.PathLike | None) -> Path:
    """The ``tools/preprocess_data.py`` of a Megatron-LM checkout.

    Raises:
        FileNotFoundError: no path given, or no ``tools/preprocess_data.py`` and
            ``megatron/core`` under it (the message says how to get a checkout).
    """
    hint = ("Megatron-LM is not a dependency of the series: clone it "
            "(git clone https://github.com/NVIDIA/Megatron-LM) and pass --megatron-lm PATH; "
            "bench/README.md has the exact steps.")
    if path is None:
        raise FileNotFoundError(f"no Megatron-LM checkout given. {hint}")
    root = Path(path).expanduser().resolve()
    tool = root / "tools" / "preprocess_data.py"
    if not tool.is_file() or not (root / "megatron" / "core").is_dir():
        raise FileNotFoundError(f"{root} is not a Megatron-LM checkout (no tools/preprocess_data.py "
                                f"and megatron/core there). {hint}")
    return tool


def megatron_command(python: str | os.PathLike, tool: str | os.PathLike, jsonl: str | os.PathLike,
                     tokenizer_dir: str | os.PathLike, output_prefix: str | os.PathLike, workers: int) -> list[str]:
    """Today's Megatron-LM command for the guide's preprocessing step.

    The guide's ``--tokenizer-type GPT2BPETokenizer --vocab ... --merge-file ...`` now loads
    GPT-2 from the Hugging Face Hub even when the files are given, so the tokenizer folder
    is passed with ``HuggingFaceTokenizer``. ``--log-interval 1`` makes the tool print its
    progress after every document, from which :func:`parse_megatron_progress` reads the
    duration of its tokenizing phase. The tool writes ``<output_prefix>_content_document.bin/.idx``.
    """
    return [
        str(python), str(tool), "--input", str(jsonl), "--output-prefix", str(output_prefix),
        "--tokenizer-type", "HuggingFaceTokenizer", "--tokenizer-model", str(tokenizer_dir),
        "--json-keys", "content", "--workers", str(workers), "--append-eod", "--log-interval", "1",
    ]


def parse_megatron_progress(stderr: str) -> tuple[int, float]:
    """Documents processed and seconds of the tokenizing phase, from the tool's last
    ``Processed N documents (X docs/s, Y MB/s).`` line (seconds = N / X).

    The phase starts after the worker pool is created (``proc_start`` in
    ``tools/preprocess_data.py``) and ends with the last document written: it covers reading
    the lines, the workers' tokenizer set-up and encoding, and writing the ``.bin``.

    Raises:
        ValueError: no progress line (the tool failed before its first document).
    """
    matches = _PROGRESS.findall(stderr)
    if not matches:
        raise ValueError("no 'Processed N documents' line in the tool's output: it did not process any document")
    docs, rate, _ = matches[-1]
    return int(docs), int(docs) / float(rate)


# --------------------------------------------------------------------------- the sides, in child processes



def _side_ours(jsonl: str, tokenizer_dir: str, output_prefix: str, workers: int, engine: str) -> None:
    t0 = time.perf_counter()
    import megatron.core.datasets.indexed_dataset  # noqa: F401  (imported inside the call: keep it out of the phase)
    import tqdm.auto  # noqa: F401

    from helpers.learn.encoders import resolve_engine
    from helpers.learn.preprocess import tokenize_to_indexed_dataset

    if resolve_engine(engine) == "gigatoken":
        import awkward  # noqa: F401
        import gigatoken  # noqa: F401
    else:
        import tokenizers  # noqa: F401
    t1 = time.perf_counter()
    stats = tokenize_to_indexed_dataset(jsonl, tokenizer_dir, output_prefix, num_workers=workers,
                                        overwrite=True, progress=False, engine=engine)
    t2 = time.perf_counter()
    common.emit_result({"import_seconds": t1 - t0, "phase_seconds": t2 - t1, "num_documents": stats.num_documents,
                        "num_tokens": stats.num_tokens, "skipped_empty": stats.num_skipped_empty, "engine": stats.engine})


# --------------------------------------------------------------------------- comparing outputs
def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def compare_indexed_datasets(prefix_a: str | os.PathLike, prefix_b: str | os.PathLike) -> dict[str, Any]:
    """Compare two Megatron ``.bin/.idx`` datasets document by document.

    Returns:
        ``{"bin_identical", "idx_identical"}`` (byte-identical files), ``"documents"``
        (``[n_a, n_b]``), ``"tokens"`` (``[n_a, n_b]``), ``"dtype"`` (``[a, b]``),
        ``"documents_with_different_ids"`` (count over the common documents, compared as
        integer sequences), ``"first_different_document"`` (index or ``None``) and
        ``"different_documents"`` (the indices of the first 100).

    Raises:
        FileNotFoundError: a ``.bin`` or ``.idx`` is missing.
    """
    import numpy as np
    from megatron.core.datasets.indexed_dataset import IndexedDataset

    for prefix in (prefix_a, prefix_b):
        missing = [p for p in (f"{prefix}.bin", f"{prefix}.idx") if not Path(p).is_file()]
        if missing:
            raise FileNotFoundError(f"{missing} not found: the side that writes {prefix} did not finish")
    same = {ext: _sha256(Path(f"{prefix_a}.{ext}")) == _sha256(Path(f"{prefix_b}.{ext}")) for ext in ("bin", "idx")}
    a, b = IndexedDataset(str(prefix_a)), IndexedDataset(str(prefix_b))
    docs_a = np.asarray(a.document_indices)
    docs_b = np.asarray(b.document_indices)
    n_a, n_b = len(docs_a) - 1, len(docs_b) - 1

    def document(ds, bounds, i):
        return np.concatenate([ds[j] for j in range(bounds[i], bounds[i + 1])] or [np.zeros(0, np.int64)]).astype(np.int64)

    different, first, listed = 0, None, []
    for i in range(min(n_a, n_b)):
        if not np.array_equal(document(a, docs_a, i), document(b, docs_b, i)):
            different += 1
            first = i if first is None else first
            if len(listed) < 100:
                listed.append(i)
    return {
        "bin_identical": same["bin"], "idx_identical": same["idx"],
        "documents": [int(n_a), int(n_b)],
        "tokens": [int(np.asarray(a.sequence_lengths).sum()), int(np.asarray(b.sequence_lengths).sum())],
        "dtype": [np.dtype(a.index.dtype).name, np.dtype(b.index.dtype).name],
        "documents_with_different_ids": different + abs(n_a - n_b),
        "first_different_document": first if first is not None else (min(n_a, n_b) if n_a != n_b else None),
        "different_documents": listed,
    }


def literal_eod_explains(jsonl: str | os.PathLike, tokenizer_dir: str | os.PathLike, prefix: str | os.PathLike,
                         documents: Sequence[int], json_key: str = "content") -> dict[str, int]:
    """How many of ``documents`` of ``<prefix>.bin/.idx`` differ from the series *only* because
    their text holds a literal ``<|endoftext|>``.

    Megatron-LM's tools encode with transformers' ``tokenize``, which turns a literal
    ``<|endoftext|>`` inside a document into the EOD id; the series encodes it as text (see
    :func:`helpers.learn.tokenizer.load_fast_tokenizer`). For each listed document this re-encodes
    the text the Megatron-LM way (HF ``tokenizers`` with special tokens recognised, EOD
    appended) and checks that it equals the stored ids.

    Returns:
        ``{"checked", "with_literal_eod", "explained"}``: documents checked, how many hold
        the literal, and how many equal the Megatron-LM-style encoding exactly.
    """
    import numpy as np
    from megatron.core.datasets.indexed_dataset import IndexedDataset

    from helpers.learn import corpus, tokenizer

    texts = [t for t in corpus.read_contents(jsonl, json_key) if t]
    tok = tokenizer.load_fast_tokenizer(tokenizer_dir)
    tok.encode_special_tokens = False  # recognise "<|endoftext|>" in the text, as Megatron-LM's tools do
    eod = tokenizer.eod_id(tokenizer_dir)
    ds = IndexedDataset(str(prefix))
    bounds = np.asarray(ds.document_indices)
    with_literal = explained = 0
    for i in documents:
        with_literal += tokenizer.EOD_TOKEN in texts[i]
        stored = np.concatenate([ds[j] for j in range(bounds[i], bounds[i + 1])]).astype(np.int64).tolist()
        explained += stored == tok.encode(texts[i]).ids + [eod]
    return {"checked": len(documents), "with_literal_eod": int(with_literal), "explained": int(explained)}


# --------------------------------------------------------------------------- the benchmark
def input_file(jsonl: Path, copies: int, out_dir: Path) -> Path:
    """``jsonl`` itself, or a file holding its lines ``copies`` times (a larger corpus, so
    that the fixed start-up cost of each process weighs less).

    Raises:
        ValueError: ``copies < 1``.
    """
    if copies < 1:
        raise ValueError(f"--corpus-copies={copies} must be >= 1")
    if copies == 1:
        return jsonl
    target = out_dir / f"{jsonl.stem}_x{copies}.json"
    if not target.is_file() or target.stat().st_size != copies * jsonl.stat().st_size:
        data = jsonl.read_bytes()
        if not data.endswith(b"\n"):
            data += b"\n"
        tmp = target.with_suffix(".tmp")
        with open(tmp, "wb") as f:
            for _ in range(copies):
                f.write(data)
        os.replace(tmp, target)
    return target


def run(args: argparse.Namespace) -> dict[str, Any]:
    """Run the preprocessing benchmark (see the module docstring); returns the result dict."""
    from helpers.runner.data_stage import build_data

    sides = list(SIDES)
    tool = check_megatron_checkout(args.megatron_lm)
    version = common.python_version_of(args.megatron_python)
    if version < MEGATRON_MIN_PYTHON:
        raise SystemExit(
            f"error: --megatron-python {args.megatron_python} is Python {version[0]}.{version[1]}; Megatron-LM's "
            f"tools import typing.override and need Python >= {MEGATRON_MIN_PYTHON[0]}.{MEGATRON_MIN_PYTHON[1]}. "
            "Make the venv of bench/README.md."
        )
    run_dir = Path(args.run_dir).expanduser().resolve()
    paths = build_data(run_dir, stop_after="tokenizer", progress=False, source=args.source,
                        max_files=args.max_files)
    out = run_dir / OUT_DIR
    out.mkdir(parents=True, exist_ok=True)
    jsonl = input_file(paths.jsonl, args.corpus_copies, out)
    tok = paths.tokenizer_dir
    prefixes = {"ours": out / "ours" / "codeparrot_content_document",
                "ours_tokenizers": out / "ours_tokenizers" / "codeparrot_content_document",
                "megatron": out / "megatron" / "codeparrot"}
    outputs = {"ours": prefixes["ours"], "ours_tokenizers": prefixes["ours_tokenizers"],
               "megatron": Path(str(prefixes["megatron"]) + MEGATRON_SUFFIX)}
    for side in sides:
        shutil.rmtree(prefixes[side].parent, ignore_errors=True)
        prefixes[side].parent.mkdir(parents=True)
    threads = str(args.workers)
    commands = {side: [sys.executable, "-m", "bench.preprocess", "_ours", str(jsonl), str(tok), str(prefixes[side]),
                       threads, engine] for side, engine in ENGINE_OF.items()}
    commands["megatron"] = megatron_command(args.megatron_python, tool, jsonl, tok, prefixes["megatron"], args.workers)
    offline = {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    # RAYON_NUM_THREADS (gigatoken's pool) is left to helpers.learn.preprocess, which sets it to --workers.
    envs = {side: common.child_env(offline, drop=("RAYON_NUM_THREADS",)) for side in ENGINE_OF}
    # Megatron-LM's tool runs with the megatron-core of its own commit, not with a wheel the
    # Python may have installed (the tool only appends the checkout to sys.path): the checkout
    # comes first on PYTHONPATH, whatever the Python.
    envs["megatron"] = common.child_env({**offline, "PYTHONPATH": str(tool.parent.parent)}, drop=("VIRTUAL_ENV",))
    machine = common.machine_info()
    print(f"input: {jsonl} ({jsonl.stat().st_size / 1e6:.1f} MB, corpus x{args.corpus_copies}); "
          f"tokenizer {tok}; {args.workers} workers; load average {machine['load_average']}", flush=True)
    stats = {side: common.SideStats(side) for side in sides}
    extra: dict[str, list[dict[str, Any]]] = {side: [] for side in sides}
    for r, order in enumerate(common.interleaved_orders(sides, args.repeats), 1):
        for side in order:
            for p in outputs[side].parent.glob("*"):
                p.unlink()
            m = common.run_measured(commands[side], env=envs[side], cwd=common.ROOT, timeout_s=args.timeout_s,
                                    what=f"the {side} side")
            if side == "megatron":
                docs, phase = parse_megatron_progress(m.stderr)
                info = {"phase_seconds": phase, "num_documents_read": docs}
            else:
                info = common.read_result(m.stdout)
            stats[side].add(m, info["phase_seconds"])
            extra[side].append(info)
            print(f"  repeat {r}/{args.repeats} {side:<15}: {m.wall_seconds:6.2f} s wall, "
                  f"{info['phase_seconds']:6.2f} s tokenizing, peak RSS {m.peak_rss_mb:7.0f} MB, "
                  f"PSS {m.peak_pss_mb:7.0f} MB", flush=True)
    comparisons = {side: compare_indexed_datasets(outputs["ours"], outputs[side]) for side in sides if side != "ours"}
    for side, c in comparisons.items():
        if c["different_documents"]:
            c["literal_eod"] = literal_eod_explains(jsonl, tok, outputs[side], c["different_documents"])
    load_after = common.load_average()
    return summarize(sides, stats, extra, comparisons, machine, load_after, args, jsonl, outputs)


def summarize(sides: Sequence[str], stats: dict[str, common.SideStats], extra: dict[str, list[dict[str, Any]]],
              comparisons: dict[str, dict[str, Any]], machine: dict[str, Any], load_after: list[float],
              args: argparse.Namespace, jsonl: Path, outputs: dict[str, Path]) -> dict[str, Any]:
    """Medians, throughputs and ratios (each side against Megatron-LM's tool)."""
    from megatron.core.datasets.indexed_dataset import IndexedDataset

    import numpy as np

    rows = {}
    for side in sides:
        ds = IndexedDataset(str(outputs[side]))
        n_docs, n_tokens = len(np.asarray(ds.document_indices)) - 1, int(np.asarray(ds.sequence_lengths).sum())
        s = stats[side].summary()
        rows[side] = {
            **s, "documents": n_docs, "tokens": n_tokens,
            "documents_per_second_wall": n_docs / s["wall_seconds_median"],
            "tokens_per_second_wall": n_tokens / s["wall_seconds_median"],
            "tokens_per_second_phase": n_tokens / s["phase_seconds_median"],
            "documents_per_second_phase": n_docs / s["phase_seconds_median"],
            "engine": extra[side][0].get("engine", "HF tokenizers in worker processes") if extra[side] else None,
        }
    ref = rows["megatron"]
    for side in sides:
        rows[side]["speedup_wall_vs_megatron"] = common.ratio(ref["wall_seconds_median"], rows[side]["wall_seconds_median"])
        rows[side]["speedup_phase_vs_megatron"] = common.ratio(ref["phase_seconds_median"], rows[side]["phase_seconds_median"])
    return {
        "benchmark": "preprocess", "machine": machine, "load_average_after": load_after,
        "input": {"path": str(jsonl), "bytes": jsonl.stat().st_size, "corpus_copies": args.corpus_copies,
                  "source": args.source or "standard library", "max_files": args.max_files},
        "workers": args.workers, "repeats": args.repeats, "sides": rows, "outputs_vs_ours": comparisons,
        "raw": extra,
    }


def report(result: dict[str, Any]) -> str:
    """The result as markdown: one row per side, then the output comparison."""
    names = {"ours": "series (helpers.learn.preprocess, engine={engine})",
             "ours_tokenizers": "series, engine={engine} (fallback)",
             "megatron": "Megatron-LM tools/preprocess_data.py"}
    rows = []
    for side, r in result["sides"].items():
        rows.append([names[side].format(engine=r.get("engine")), r["wall_seconds_median"], r["documents_per_second_wall"], r["tokens_per_second_wall"],
                     r["phase_seconds_median"], r["tokens_per_second_phase"], r["peak_rss_mb_median"],
                     r["peak_pss_mb_median"], f"{r['speedup_wall_vs_megatron']:.2f}x", f"{r['speedup_phase_vs_megatron']:.2f}x"])
    table = common.markdown_table(
        ["side", "wall s (median)", "docs/s (wall)", "tokens/s (wall)", "tokenizing s", "tokens/s (tokenizing)",
         "peak RSS MB", "peak PSS MB", "speed-up (wall)", "speed-up (tokenizing)"], rows)
    checks = []
    for side, c in result["outputs_vs_ours"].items():
        checks.append([f"{names[side].format(engine=result['sides'][side].get('engine'))} vs series", f"{c['documents'][1]} / {c['documents'][0]}",
                       f"{c['tokens'][1]} / {c['tokens'][0]}", c["documents_with_different_ids"],
                       "yes" if c["bin_identical"] else "no", "yes" if c["idx_identical"] else "no"])
    table2 = common.markdown_table(["outputs", "documents", "tokens", "documents with different ids",
                                    ".bin identical", ".idx identical"], checks)
    for side, c in result["outputs_vs_ours"].items():
        if "literal_eod" in c:
            e = c["literal_eod"]
            table2 += (f"\n\n{names[side].format(engine=result['sides'][side].get('engine'))}: of the {e['checked']} "
                       f"different documents checked, {e['with_literal_eod']} hold a literal `<|endoftext|>` and "
                       f"{e['explained']} equal the series' encoding with that literal turned into the EOD id "
                       "(what Megatron-LM's tools do; the series keeps it as text).")
    inp = result["input"]
    head = (f"Input: {inp['bytes'] / 1e6:.1f} MB of JSON Lines from {inp.get('source', 'standard library')} "
            f"(corpus x{inp['corpus_copies']}), "
            f"{result['workers']} workers, {result['repeats']} interleaved repeats, medians. "
            f"Load average before {result['machine']['load_average']}, after {result['load_average_after']}.")
    return f"{head}\n\n{table}\n\n{table2}\n"


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] == "_ours":
        _side_ours(argv[1], argv[2], argv[3], int(argv[4]), argv[5])
        return 0
    parser = argparse.ArgumentParser(prog="python -m bench.preprocess", description=__doc__.split("\n\n")[0])
    parser.add_argument("--megatron-lm", default=os.environ.get("MEGATRON_LM"),
                        help="path of a Megatron-LM checkout (default: $MEGATRON_LM)")
    parser.add_argument("--megatron-python", default=os.environ.get("MEGATRON_PYTHON"),
                        help="Python >= 3.12 with Megatron-LM's tool requirements (default: $MEGATRON_PYTHON)")
    parser.add_argument("--run-dir", default=str(common.ROOT / "runs" / "bench"),
                        help="run folder whose data/ holds (or will hold) the corpus and tokenizer")
    parser.add_argument("--source", default=None,
                        help="corpus: a folder of .py files or a JSON Lines file (default: this machine's standard "
                             "library); a run folder keeps the corpus it was first made with")
    parser.add_argument("--max-files", type=int, default=None, help="read at most this many files of --source")
    parser.add_argument("--workers", type=int, default=2, help="workers of both tools (default 2)")
    parser.add_argument("--repeats", type=int, default=3, help="interleaved repeats per side (default 3)")
    parser.add_argument("--corpus-copies", type=int, default=1, help="repeat the corpus N times (default 1)")
    parser.add_argument("--timeout-s", type=float, default=240.0, help="limit per process run, seconds")
    parser.add_argument("--json", default=None, help="write the result here (default {run_dir}/bench_preprocess.json)")
    args = parser.parse_args(argv)
    if args.megatron_python is None:
        if args.megatron_lm is None:
            parser.error("--megatron-lm PATH (a Megatron-LM checkout) and --megatron-python PYTHON (a Python >= 3.12 "
                         "with its tool's requirements) are required: Megatron-LM is not a dependency of the series; "
                         "bench/README.md has the exact steps")
        parser.error("--megatron-python is required (a Python >= 3.12 prepared as in bench/README.md)")
    if args.workers < 1:
        parser.error(f"--workers={args.workers} must be >= 1")
    try:
        result = run(args)
    except FileNotFoundError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    except common.BenchError as err:
        print(f"error: {err}", file=sys.stderr)
        return 1
    return common.finish(result, args.json or Path(args.run_dir) / "bench_preprocess.json", report(result))


if __name__ == "__main__":
    sys.exit(main())
