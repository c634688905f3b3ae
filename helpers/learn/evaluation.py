"""Does the model learn Python? Compression, sampling, syntax validity and pass@k (notebook 07).

Every scorer takes the model as ``logits_fn(tokens) -> logits`` (``LongTensor [batch, seq]`` ->
``FloatTensor [batch, seq, vocab]``, causal, model in eval mode), so the same code scores
megatron-core's ``GPTModel`` and the converted ``GPT2LMHeadModel``::

    hf_fn = lambda t: hf_model(t.to(dev)).logits

:func:`score_texts` gives bits per byte next to gzip, xz and a unigram model; :func:`sample` follows
nanoGPT's ``model.generate``; :func:`pass_at_k` is HumanEval's unbiased estimator (Chen et al. 2021,
section 2.1; openai/human-eval ``human_eval/execution.py``, ``evaluation.py``).
"""

from __future__ import annotations

import ast
import gzip
import inspect
import json
import lzma
import math
import os
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterable, Sequence

import torch

LogitsFn = Callable[[torch.Tensor], torch.Tensor]

#: The shipped tasks (``data/function_tasks.jsonl``, described in ``data/README.md``).
FUNCTION_TASKS_FILE = Path(__file__).resolve().parents[2] / "data" / "function_tasks.jsonl"
#: Where a function body ends: the ``EOF_STRINGS`` of transformers'
#: ``examples/research_projects/codeparrot/scripts/human_eval.py`` (which also lists ``"\n@"``).
STOP_STRINGS: tuple[str, ...] = ("\nclass", "\ndef", "\n#", "\n@", "\nprint", "\nif")
TASK_FIELDS: tuple[str, ...] = ("task_id", "prompt", "entry_point", "test", "canonical_solution")


# ---------------------------------------------------------------- compression

def bits_per_byte(nats: float, num_bytes: int) -> float:
    """``nats / ln 2 / num_bytes``: a code length in nats spread over the bytes it encodes.

    Raises:
        ValueError: ``num_bytes`` is not positive.
    """
    if num_bytes <= 0:
        raise ValueError(f"num_bytes={num_bytes}: bits per byte needs at least one byte")
    return nats / math.log(2) / num_bytes


@dataclass(frozen=True)
class Compression:
    """What a model spends on a text: ``nats`` summed over ``tokens`` predicted tokens, which
    decode to exactly ``bytes`` UTF-8 bytes."""

    nats: float
    tokens: int
    bytes: int

    @property
    def nats_per_token(self) -> float:
        """Mean negative log-likelihood per predicted token (nats): the training loss."""
        return self.nats / self.tokens

    @property
    def perplexity(self) -> float:
        """``exp(nats_per_token)``: tokenizer-dependent."""
        return math.exp(self.nats_per_token)

    @property
    def bits_per_byte(self) -> float:
        """Bits per UTF-8 byte: comparable across tokenizers and with gzip/xz."""
        return bits_per_byte(self.nats, self.bytes)


def encode(tokenizer, text: str) -> list[int]:
    """Token ids of ``text`` with a transformers tokenizer, a literal ``<|endoftext|>`` in it
    encoded as ordinary text (as :func:`helpers.learn.tokenizer.round_trip_failures`)."""
    return tokenizer(text, split_special_tokens=True, add_special_tokens=False, verbose=False)["input_ids"]


@torch.no_grad()
def score_texts(logits_fn: LogitsFn, tokenizer, texts: Sequence[str], seq_length: int, *,
                batch_size: int = 8, vocab_size: int | None = None, stride: int | None = None) -> Compression:
    """Negative log-likelihood of ``texts`` under the model, in nats, tokens and bytes.

    Each text is the stream ``[eod] + encode(text)``, read in windows of ``seq_length`` tokens that
    start every ``stride`` tokens; each window scores only targets no earlier one scored, so every
    token is predicted once (``stride < seq_length``: Hugging Face's "Perplexity of fixed-length
    models" sliding window). Bytes are the text's UTF-8 bytes. Windows are right-padded with EOD,
    unscored.

    Args:
        logits_fn: ``[batch, seq] int64 -> [batch, seq, vocab] float`` (see the module docstring).
        tokenizer: a transformers tokenizer (``helpers.learn.tokenizer.load_tokenizer``) with ``eos_token_id``.
        texts: held-out documents (not seen in training).
        seq_length: tokens per window (the model's sequence length).
        batch_size: windows per ``logits_fn`` call.
        vocab_size: score only the first ``vocab_size`` logits (the tokenizer's size, without
            Megatron's padded vocab rows); default all.
        stride: tokens between window starts, ``1 <= stride <= seq_length``; ``None``: ``seq_length``.

    Returns:
        :class:`Compression` (float64 sum of nats).

    Raises:
        ValueError: no texts, an empty text, ``seq_length``, ``batch_size`` or ``vocab_size`` < 1, a stride outside
            ``1..seq_length``, or a text the tokenizer does not round-trip (its bytes would not
            be the bytes scored).
    """
    if not texts or seq_length < 1 or batch_size < 1 or (vocab_size is not None and vocab_size < 1):
        raise ValueError(f"need texts (got {len(texts)}), seq_length={seq_length}, batch_size={batch_size} >= 1, vocab_size={vocab_size} >= 1 or None")
    stride = seq_length if stride is None else stride
    if not 1 <= stride <= seq_length:
        raise ValueError(f"stride={stride}: pass 1 <= stride <= seq_length ({seq_length}), or None for seq_length")
    eod, windows, num_bytes = tokenizer.eos_token_id, [], 0
    for i, text in enumerate(texts):
        ids = encode(tokenizer, text)
        if not ids or tokenizer.decode(ids) != text:
            raise ValueError(f"text {i} is empty or does not round-trip through the tokenizer")
        stream, num_bytes, scored = [eod] + ids, num_bytes + len(text.encode("utf-8")), 0
        for start in range(0, len(ids), stride):  # (window, index of its first target not scored before)
            window = stream[start:start + seq_length + 1]
            windows.append((window, scored - start))
            scored = start + len(window) - 1
            if scored == len(ids):
                break
    nats, tokens = 0.0, 0
    for b in range(0, len(windows), batch_size):
        chunk = [w for w, _ in windows[b:b + batch_size]]
        width = max(len(w) for w in chunk) - 1
        rows = torch.tensor([w + [eod] * (width + 1 - len(w)) for w in chunk])
        positions = torch.arange(width)
        mask = ((positions < torch.tensor([len(w) - 1 for w in chunk])[:, None])
                & (positions >= torch.tensor([first for _, first in windows[b:b + batch_size]])[:, None]))
        logits = logits_fn(rows[:, :-1])[..., :vocab_size].float()
        nll = -torch.log_softmax(logits, dim=-1).gather(-1, rows[:, 1:, None].to(logits.device))[..., 0]
        nats += float(nll[mask.to(logits.device)].double().sum())
        tokens += int(mask.sum())
    return Compression(nats=nats, tokens=tokens, bytes=num_bytes)


def joined_bytes(texts: Iterable[str]) -> bytes:
    """The baselines' input: the texts joined by one ``"\\n"`` each, UTF-8 encoded."""
    return "\n".join(texts).encode("utf-8")


def gzip_bits_per_byte(texts: Iterable[str]) -> float:
    """``8 * len(gzip.compress(data, 9, mtime=0)) / len(data)``, ``data = joined_bytes(texts)``.

    The whole gzip file is counted: its 10-byte header and 8-byte trailer (CRC-32, size) too.
    Deflate (RFC 1951) sees a 32 KiB window only.
    """
    data = joined_bytes(texts)
    return 8 * len(gzip.compress(data, 9, mtime=0)) / len(data)


def xz_bits_per_byte(texts: Iterable[str]) -> float:
    """``8 * len(lzma.compress(data, preset=9 | lzma.PRESET_EXTREME)) / len(data)`` (``xz -9e``).

    The whole .xz file is counted: stream header, block header, CRC-64 check, index and footer
    (about 60 bytes); ``data = joined_bytes(texts)``.
    """
    data = joined_bytes(texts)
    return 8 * len(lzma.compress(data, preset=9 | lzma.PRESET_EXTREME)) / len(data)


def unigram_nats(train_ids, heldout_ids, vocab_size: int) -> float:
    """Nats a unigram model of token ids spends on ``heldout_ids``, fit on ``train_ids``.

    ``p(v) = (count_train(v) + 1) / (len(train_ids) + vocab_size)`` (add-one, Laplace smoothing:
    no id has probability 0); returns ``-sum(log p(v) for v in heldout_ids)``. Use
    ``bits_per_byte(unigram_nats(...), Compression.bytes)`` with the held-out tokens of
    :func:`score_texts` (``encode`` of each text, no EOD) to compare with the model.

    Args:
        train_ids, heldout_ids: token ids (lists, numpy arrays or tensors), each < ``vocab_size``.
        vocab_size: the tokenizer's size.

    Raises:
        ValueError: an id outside ``[0, vocab_size)``.
    """
    train = torch.as_tensor(train_ids, dtype=torch.int64).reshape(-1)
    held = torch.as_tensor(heldout_ids, dtype=torch.int64).reshape(-1)
    for name, ids in (("train_ids", train), ("heldout_ids", held)):
        if ids.numel() and (ids.min() < 0 or ids.max() >= vocab_size):
            raise ValueError(f"{name} holds ids outside [0, {vocab_size})")
    counts = torch.bincount(train, minlength=vocab_size).double()
    log_p = torch.log(counts + 1) - math.log(train.numel() + vocab_size)
    return float(-log_p[held].sum())


# ---------------------------------------------------------------- the unseen set
def cut_at_line(text: str, max_chars: int) -> str:
    """``text`` if it has at most ``max_chars`` characters, else its start up to the last full line
    within them (``""`` when the first line alone is longer)."""
    return text if len(text) <= max_chars else text[:text.rfind("\n", 0, max_chars) + 1]


def heldout_package_files(packages: Sequence[str], tokenizer, seen_hashes: Iterable[str], *, max_files: int,
                          more_filtering: bool, seed: int = 1234) -> list[dict]:
    """Read installed packages' ``.py`` files as an unseen set, cleaned as notebook 01 cleaned its corpus.

    Each package (``importlib.util.find_spec``) gives its non-test ``.py`` files in sorted order to
    :func:`helpers.learn.corpus.rejection_reason` (``seen_hashes`` marks copies of corpus documents
    ``duplicate``) and, with ``more_filtering``, :func:`helpers.learn.corpus.heuristic_reason`, until
    ``max_files`` of them pass.

    Returns:
        One dict per file read, in order: ``package``, ``file`` (path inside the package),
        ``bytes`` (UTF-8), ``removed by`` (the filter's name, ``""`` when kept) and ``text``.

    Raises:
        ValueError: a package is not installed, or has no ``.py`` source (a built-in or compiled
            module; the message names it); ``packages`` is a string; ``max_files`` < 1.
    """
    import importlib.util

    from helpers.learn import corpus

    if isinstance(packages, str) or max_files < 1:
        raise ValueError(f"packages={packages!r}, max_files={max_files!r}: pass a list of package names and max_files >= 1")
    if missing := [p for p in packages if importlib.util.find_spec(p) is None]:
        raise ValueError(f"heldout_packages names {missing}, not installed here: name installed packages (pip list)")
    seen, files = set(seen_hashes), []
    for package in packages:
        spec = importlib.util.find_spec(package)
        if spec.submodule_search_locations:
            folder = Path(next(iter(spec.submodule_search_locations)))
            paths = sorted(p for p in folder.rglob("*.py")
                           if not set(corpus.STDLIB_EXCLUDED_DIRS).intersection(p.relative_to(folder).parts[:-1]))
        elif spec.origin and spec.origin.endswith(".py"):
            folder, paths = Path(spec.origin).parent, [Path(spec.origin)]
        else:
            raise ValueError(f"heldout_packages names {package!r}, a built-in or compiled module with no .py source ({spec.origin})")
        kept = 0
        for path in paths:
            text = corpus.decode_utf8(raw := path.read_bytes())
            reason = corpus.rejection_reason(text, seen) or (  # heuristics only for a text the six filters kept
                corpus.heuristic_reason(text, len(text) / max(len(encode(tokenizer, text)), 1), seed) if more_filtering else None)
            files.append({"package": package, "file": str(path.relative_to(folder)), "bytes": len(raw),
                          "removed by": reason or "", "text": text or ""})
            kept += reason is None
            if kept == max_files:
                break
    return files


# ---------------------------------------------------------------- sampling

@torch.no_grad()
def sample(logits_fn: LogitsFn, prompt_ids: Sequence[int], max_new_tokens: int, *, temperature: float = 1.0,
           top_k: int | None = None, generator: torch.Generator | None = None, eod_id: int | None = None,
           seq_length: int | None = None, vocab_size: int | None = None, num_samples: int | None = None):
    """Sample a continuation token by token, as nanoGPT's ``model.generate`` (called by ``sample.py``).

    Each step: logits of the last position / ``temperature``; with ``top_k``, logits below the
    k-th largest set to ``-inf``; softmax; ``torch.multinomial(probs, 1, generator=generator)``.
    ``temperature == 0`` is greedy (argmax, first index on ties). No KV cache: the (cropped)
    context is recomputed every step.

    Args:
        logits_fn: ``[1, seq] int64 -> [1, seq, vocab] float``.
        prompt_ids: token ids of the prompt (at least one).
        max_new_tokens: most tokens to add.
        temperature: > 1 flattens, < 1 sharpens, 0 = greedy.
        top_k: keep the k most likely tokens only (None = all).
        generator: a seeded ``torch.Generator`` (on the logits' device): the same seed gives
            the same sample.
        eod_id: stop when this token is drawn (it is not returned).
        seq_length: keep only the last ``seq_length`` tokens as context (the position table).
        vocab_size: never draw ids >= this (Megatron's padded vocab rows).
        num_samples: draw this many continuations at once, as rows ``[num_samples, seq]``; a row
            that draws ``eod_id`` stops while the others go on (samples differ from one-at-a-time calls).

    Returns:
        The new token ids, without the prompt; with ``num_samples``, a list of such lists.

    Raises:
        ValueError: an empty prompt, a negative temperature, ``top_k`` < 1 or ``num_samples`` < 1.
    """
    if not prompt_ids or temperature < 0 or (top_k is not None and top_k < 1) or (num_samples is not None and num_samples < 1):
        raise ValueError(f"need a prompt (got {len(prompt_ids)} ids), temperature >= 0 (got {temperature}), "
                         f"top_k >= 1 or None (got {top_k}) and num_samples >= 1 or None (got {num_samples})")
    rows = torch.tensor([list(prompt_ids)] * (num_samples or 1))
    new: list[list[int]] = [[] for _ in range(len(rows))]
    done = [False] * len(rows)
    for _ in range(max_new_tokens):
        logits = logits_fn(rows[:, -seq_length:] if seq_length else rows)[:, -1, :vocab_size].float()
        if temperature == 0:
            nxt = logits.argmax(-1)
        else:
            logits = logits / temperature
            if top_k is not None:
                kth = torch.topk(logits, min(top_k, logits.shape[-1]), dim=-1).values[:, -1:]
                logits = logits.masked_fill(logits < kth, float("-inf"))
            nxt = torch.multinomial(torch.softmax(logits, -1), 1, generator=generator)[:, 0]
        nxt = nxt.cpu()
        for r, token in enumerate(nxt.tolist()):
            done[r] = done[r] or token == eod_id
            if not done[r]:
                new[r].append(token)
        if all(done):
            break
        rows = torch.cat([rows, nxt[:, None]], dim=1)
    return new if num_samples is not None else new[0]


def distinct_n(ids: Sequence[int], n: int = 1) -> float:
    """Share of distinct n-grams among the n-grams of ``ids`` (distinct-n: Li et al. 2016, "A
    Diversity-Promoting Objective Function for Neural Conversation Models"): 1.0 when no n-gram
    repeats, near 0 for a text that loops on itself; 0.0 with fewer than ``n`` tokens."""
    grams = [tuple(ids[i:i + n]) for i in range(len(ids) - n + 1)]
    return len(set(grams)) / len(grams) if grams else 0.0


# ---------------------------------------------------------------- syntax

def parses(prompt: str, completion: str) -> bool:
    """Is ``prompt + completion`` Python, allowing for a completion cut off mid-block?

    The rule: ``ast.parse(prompt + completion)`` succeeds; or else, the text trimmed
    to its last full line (everything up to and including the last ``"\\n"``; the unfinished
    line after it is dropped) still holds a non-blank line of the completion and parses, after
    closing a trailing open block: if the last non-blank kept line ends with ``":"``, a line
    ``pass`` indented 4 spaces deeper than it is appended.
    """
    text = prompt + completion
    try:
        ast.parse(text)
        return True
    except (SyntaxError, ValueError):
        pass
    kept = text[:text.rfind("\n") + 1]
    if not kept[len(prompt):].strip():
        return False
    last = kept.rstrip().splitlines()[-1]
    if last.endswith(":"):
        kept = kept.rstrip() + "\n" + last[:len(last) - len(last.lstrip())] + "    pass\n"
    try:
        ast.parse(kept)
        return True
    except (SyntaxError, ValueError):
        return False


def syntax_validity(prompts: Sequence[str], completions: Sequence[str]) -> float:
    """Fraction of ``(prompt, completion)`` pairs that :func:`parses` (0..1).

    Raises:
        ValueError: no pairs, or the two sequences differ in length.
    """
    if not prompts or len(prompts) != len(completions):
        raise ValueError(f"need as many completions as prompts, at least one (got {len(prompts)}, {len(completions)})")
    return sum(parses(p, c) for p, c in zip(prompts, completions)) / len(prompts)


# ---------------------------------------------------------------- function tasks and pass@k

@dataclass(frozen=True)
class FunctionTask:
    """A HumanEval-style task: ``prompt`` (a def line and docstring), the function's name
    ``entry_point``, ``test`` (a ``def check(candidate):`` with asserts) and a body that passes."""

    task_id: str
    prompt: str
    entry_point: str
    test: str
    canonical_solution: str


def load_function_tasks(path: str | os.PathLike = FUNCTION_TASKS_FILE) -> list[FunctionTask]:
    """The tasks of a JSON Lines file (one object per line with :data:`TASK_FIELDS`, strings).

    Raises:
        FileNotFoundError: no such file.
        ValueError: naming ``file:line``: not JSON, a field missing or not a string, a repeated
            ``task_id``, a prompt not defining ``entry_point``, or prompt + canonical_solution +
            test that is not Python.
    """
    tasks: list[FunctionTask] = []
    for n, line in enumerate(Path(path).read_text(encoding="utf-8").splitlines(), start=1):
        if not line.strip():
            continue
        where = f"{path}:{n}"
        try:
            row = json.loads(line)
        except json.JSONDecodeError as e:
            raise ValueError(f"{where}: not a JSON object ({e})") from None
        bad = [f for f in TASK_FIELDS if not isinstance(row, dict) or not isinstance(row.get(f), str)]
        if bad:
            raise ValueError(f"{where}: field(s) {bad} missing or not a string (need {list(TASK_FIELDS)})")
        task = FunctionTask(**{f: row[f] for f in TASK_FIELDS})
        if any(t.task_id == task.task_id for t in tasks):
            raise ValueError(f"{where}: task_id {task.task_id!r} appears twice")
        if f"def {task.entry_point}(" not in task.prompt:
            raise ValueError(f"{where}: the prompt does not define entry_point {task.entry_point!r}")
        try:
            ast.parse(task.prompt + task.canonical_solution + "\n" + task.test)
        except SyntaxError as e:
            raise ValueError(f"{where}: prompt + canonical_solution + test is not Python ({e})") from None
        tasks.append(task)
    return tasks


def truncate_at_stop(completion: str, stop: Sequence[str] = STOP_STRINGS) -> str:
    """``completion`` up to the first occurrence of any stop string (which is dropped)."""
    cuts = [i for i in (completion.find(s) for s in stop) if i >= 0]
    return completion[:min(cuts)] if cuts else completion


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k from ``n`` samples of which ``c`` pass: ``1 - C(n-c, k) / C(n, k)``.

    Computed as human-eval's ``estimate_pass_at_k``: ``1 - prod(1 - k / i for i in n-c+1..n)``,
    1.0 when ``n - c < k`` (Chen et al. 2021, section 2.1 and figure 3).

    Raises:
        ValueError: unless ``0 <= c <= n`` and ``1 <= k <= n``.
    """
    if not (0 <= c <= n and 1 <= k <= n):
        raise ValueError(f"pass_at_k needs 0 <= c <= n and 1 <= k <= n (got n={n}, c={c}, k={k})")
    if n - c < k:
        return 1.0
    return 1.0 - math.prod(1.0 - k / i for i in range(n - c + 1, n + 1))


@dataclass(frozen=True)
class CheckResult:
    """``status`` is ``"passed"``, ``"failed"`` or ``"timed out"``; ``reason`` says why (empty
    when passed); ``seconds`` is the wall time of the subprocess."""

    status: str
    reason: str
    seconds: float

    @property
    def passed(self) -> bool:
        return self.status == "passed"


def _guarded_run(program_file: str, memory_bytes: int, cpu_seconds: int) -> None:
    """The child's main (its source is sent with ``python -c``): stdlib only, no outer names.

    Lowers resource limits, disables what human-eval's ``reliability_guard`` sets to None
    (here replaced by a function raising ``PermissionError`` that names it), then adds
    an audit hook (PEP 578) that no later code can remove, refusing: deleting, renaming,
    re-permissioning or linking files; opening for writing or making folders outside the
    working folder; processes and signals; sockets; importing ctypes, subprocess, socket,
    multiprocessing and the like. Runs the program with its output swallowed and writes one
    JSON line ``{"status", "reason"}`` to the real stdout.
    """
    import builtins, contextlib, io, json, linecache, os, resource, shutil, signal, sys, traceback
    workdir = os.path.realpath(os.getcwd())
    with open(program_file, encoding="utf-8") as f:
        source = f.read()
    linecache.cache["<candidate>"] = (len(source), None, source.splitlines(True), "<candidate>")
    for limit, value in ((resource.RLIMIT_AS, memory_bytes), (resource.RLIMIT_DATA, memory_bytes),
                         (resource.RLIMIT_CPU, cpu_seconds), (resource.RLIMIT_FSIZE, 1 << 24), (resource.RLIMIT_CORE, 0)):
        hard = resource.getrlimit(limit)[1]
        value = value if hard == resource.RLIM_INFINITY else min(value, hard)
        resource.setrlimit(limit, (value, value))
    signal.alarm(cpu_seconds + 1)

    def disabled(name):
        def refuse(*args, **kwargs):
            raise PermissionError(f"the evaluation guard disables {name}")
        return refuse

    for module, names in ((os, "kill killpg system putenv remove removedirs rmdir unlink rename renames replace "
                                "truncate chmod fchmod lchmod chown fchown lchown chroot chdir fchdir fork forkpty "
                                "setuid execv execve spawnv posix_spawn"),
                          (shutil, "rmtree move chown"), (builtins, "exit quit help")):
        for name in names.split():
            if hasattr(module, name):
                setattr(module, name, disabled(f"{module.__name__}.{name}"))
    refused = frozenset("os.remove os.rmdir os.rename os.truncate os.chmod os.chown os.chflags os.link os.symlink "
                        "os.utime os.chdir os.chroot os.system os.exec os.posix_spawn os.spawn os.fork os.forkpty "
                        "os.kill os.killpg os.setxattr os.removexattr shutil.rmtree shutil.move subprocess.Popen "
                        "socket.__new__ socket.connect socket.bind socket.getaddrinfo ctypes.dlopen".split())
    no_import = frozenset("ctypes _ctypes subprocess _posixsubprocess socket _socket ssl _ssl multiprocessing "
                          "_multiprocessing pty resource".split())
    writing = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_APPEND

    def guard(event, args):
        outside = (event in ("open", "os.mkdir") and isinstance(args[0], (str, bytes, os.PathLike))
                   and (event == "os.mkdir" or (isinstance(args[2], int) and args[2] & writing))
                   and os.path.commonpath([workdir, os.path.realpath(os.fsdecode(args[0]))]) != workdir)
        if event in refused or outside or (event == "import" and args[0].split(".")[0] in no_import):
            raise PermissionError(f"the evaluation guard refuses {event} {args[0]!r}"[:200])

    sys.modules["resource"] = None  # imported above: 'import resource' now fails, as in human-eval
    sys.addaudithook(guard)
    out, sink = sys.stdout, io.StringIO()
    try:
        with contextlib.redirect_stdout(sink), contextlib.redirect_stderr(sink):
            sys.stdin = io.StringIO()
            exec(compile(source, "<candidate>", "exec"), {"__name__": "__candidate__"})
        result = {"status": "passed", "reason": ""}
    except BaseException as e:  # SystemExit and KeyboardInterrupt too: the program failed
        frames = [fr for fr in traceback.extract_tb(e.__traceback__) if fr.filename == "<candidate>"]
        where = f" at line {frames[-1].lineno}: {frames[-1].line}" if frames else ""
        result = {"status": "failed", "reason": f"{type(e).__name__}{': ' if str(e) else ''}{e}{where}"[:500]}
    out.write(json.dumps(result) + "\n")
    out.flush()


def _library_path() -> dict[str, str]:
    """``LD_LIBRARY_PATH`` when set: an interpreter built with a shared libpython may need it."""
    return {k: os.environ[k] for k in ("LD_LIBRARY_PATH",) if k in os.environ}


def check_candidate(task: FunctionTask, completion: str, timeout_s: float = 3.0, *,
                    memory_bytes: int = 1 << 30) -> CheckResult:
    """Run ``prompt + completion + "\\n" + test + "\\n" + "check(entry_point)"`` (human-eval's
    ``check_correctness`` program) in a separate, guarded Python process.

    The child is ``sys.executable -I -S -B`` in its own session and a fresh temporary folder, with
    only ``PATH``, ``HOME`` and ``TMPDIR`` in its environment. :func:`_guarded_run` limits memory and
    CPU time, disables human-eval's ``reliability_guard`` list and adds an audit hook (no deletes,
    writes outside the folder, sockets or subprocesses). It stops the accidents of generated code,
    not a deliberate attacker: run untrusted code in a container.

    Args:
        task: a :class:`FunctionTask`.
        completion: the model's body for ``task.prompt`` (already :func:`truncate_at_stop`-ped).
        timeout_s: wall-clock limit in seconds; on expiry the whole process group is killed.
        memory_bytes: address-space limit of the child (bytes).

    Returns:
        :class:`CheckResult`: passed; failed with the exception and the failing line (e.g.
        ``AssertionError at line 9: assert candidate(2, 3) == 5``) or how the process died;
        or timed out.
    """
    program = f"{task.prompt}{completion}\n{task.test}\ncheck({task.entry_point})\n"
    start = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="candidate-") as tmp:
        path = Path(tmp) / "program.py"
        path.write_text(program, encoding="utf-8")
        code = inspect.getsource(_guarded_run) + f"\n_guarded_run({str(path)!r}, {memory_bytes}, {math.ceil(timeout_s) + 1})\n"
        proc = subprocess.Popen([sys.executable, "-I", "-S", "-B", "-c", code], cwd=tmp, stdin=subprocess.DEVNULL,
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True,
                                env={"PATH": os.defpath, "HOME": tmp, "TMPDIR": tmp, **_library_path()})
        try:
            out, err = proc.communicate(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            proc.communicate()
            return CheckResult("timed out", f"still running after {timeout_s} s: process group killed",
                               time.perf_counter() - start)
    seconds = time.perf_counter() - start
    lines = out.decode("utf-8", "replace").strip().splitlines()
    try:
        result = json.loads(lines[-1])
        return CheckResult(result["status"], result["reason"], seconds)
    except (IndexError, ValueError, KeyError, TypeError):
        died = f"killed by {signal.Signals(-proc.returncode).name}" if proc.returncode < 0 else f"exit code {proc.returncode}"
        return CheckResult("failed", f"no result ({died}): {err.decode('utf-8', 'replace')[-300:]}", seconds)


def mean_pass_at_k(passed: Sequence[Sequence[bool]], k: int) -> float:
    """pass@k averaged over tasks; ``passed[t]`` holds one bool per sample of task ``t``
    (HumanEval's ``evaluate_functional_correctness``).

    Raises:
        ValueError: no tasks, or a task with fewer than ``k`` samples.
    """
    if not passed:
        raise ValueError("no tasks")
    return sum(pass_at_k(len(p), sum(map(bool, p)), k) for p in passed) / len(passed)
