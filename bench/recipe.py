"""Recipe sweep: which cpu-profile training settings learn the most Python per CPU-second?

Every candidate trains notebook 03's loop (:func:`helpers.runner.launch.train`, megatron-core under
torchrun, one process) on the same data, notebook 01's defaults made once in
``{run_dir}/data`` (standard library plus 8 files of each installed package, CodeParrot's
filters). The base every candidate's overrides apply to is the cpu recipe the sweep started
from (:data:`BASE`: 4 layers, hidden 256, sequence 256, global batch 8, 200 iterations, lr 2e-3;
notebook 03's defaults before the sweep); the built-in ``h192-s128-gbs4-1000it`` is the
winner, notebook 03's defaults now. Each is then
judged as notebook 07 judges the series' model, on the megatron-core checkpoint:

* bits per byte on the **unseen set** (:data:`helpers.learn.corpus.HELDOUT_PACKAGES`, the first 5
  files of each package that pass the corpus filters, cut to 2,500 characters; never in the
  corpus) and on the first 8 documents of the validation split, windows every half sequence
  (notebook 07's default), next to ``gzip -9`` on the same bytes;
* the syntax validity of 12 sampled completions (``def``, ``import``, ``class``; 4 each, 64
  new tokens, temperature 0.8, top-k 50, seeded), :func:`helpers.learn.evaluation.parses`.

The candidates run one after the other (not interleaved: each is one whole training run), so
the load average is printed before and after each; on a shared machine compare within one
sweep. Reported per candidate: training wall time (the torchrun launch), seconds per
iteration, tokens seen, validation loss, the bits per byte and the syntax validity.

Run (from the repository root)::

    python -m bench.recipe                                   # the built-in candidates
    python -m bench.recipe --candidate lr4e-3:lr=4e-3 --candidate wide:hidden_size=320
    python -m bench.recipe --run-dir runs/recipe-v4096 --vocab-size 4096 --only baseline
    python -m bench.recipe --run-dir runs/architectures --architectures --repeats 2   # GPT-2 vs Llama, A B B A

``--architectures`` (issue 28) trains notebook 03's recipe as GPT-2 and as the Llama of the same size and
FLOPs per token, and records each run's training and validation curves with the seconds per iteration.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path
from typing import Any

from bench import common

#: Built-in candidates: {name: overrides of notebook 03's parameters}. Model fields go to the
#: model; every other key to the TrainingConfig.
CANDIDATES: dict[str, dict[str, Any]] = {
    "baseline": {},
    "lr4e-3": {"lr": 4e-3, "min_lr": 4e-4},
    "gbs16-100it": {"global_batch_size": 16, "train_iters": 100},
    "h192": {"hidden_size": 192},
    "s128-gbs16": {"seq_length": 128, "global_batch_size": 16},
    "300it": {"train_iters": 300},
    "gbs4-400it": {"global_batch_size": 4, "train_iters": 400, "lr_warmup_iters": 40},
    "h192-s128-gbs4-1000it": {"hidden_size": 192, "seq_length": 128, "global_batch_size": 4, "train_iters": 1000,
                              "lr_warmup_iters": 100},
}
#: Issue 28's comparison: notebook 03's recipe as GPT-2 and as the Llama of the same size and FLOPs per token
#: (``helpers.learn.model.architecture_fields``), validation loss every 100 iterations for the curves.
NOTEBOOK_03 = {**CANDIDATES["h192-s128-gbs4-1000it"], "eval_interval": 100}
#: ``llama-equal-time``: the Llama for the iterations that fit GPT-2's 1,000 in time, 880 = 1,000 x 0.0717 / 0.0816 s
#: per iteration (the medians of the first comparison, bench/RESULTS.md 2026-12-04), with its own full cosine schedule.
ARCHITECTURE_CANDIDATES: dict[str, dict[str, Any]] = {"gpt2": NOTEBOOK_03, "llama": {**NOTEBOOK_03, "architecture": "llama"},
                                                      "llama-equal-time": {**NOTEBOOK_03, "architecture": "llama",
                                                                           "train_iters": 880}}
#: What the overrides apply to: the cpu recipe before the sweep (4 layers, 4 heads, micro-batch 4).
BASE: dict[str, Any] = {"num_layers": 4, "hidden_size": 256, "num_attention_heads": 4, "seq_length": 256,
                        "micro_batch_size": 4, "global_batch_size": 8, "train_iters": 200, "lr": 2e-3, "min_lr": 2e-4,
                        "lr_warmup_iters": 20}
MODEL_FIELDS = ("num_layers", "hidden_size", "num_attention_heads", "seq_length")
PROMPTS = ("def", "import", "class")


def held_out_sets(paths) -> dict[str, list[str]]:
    """The two sets notebook 07 scores (its defaults): validation documents and the unseen packages."""
    from helpers.learn import corpus, evaluation, preprocess, tokenizer

    documents = corpus.read_contents(paths.jsonl)
    valid_range = preprocess.split_document_ranges(paths.num_documents, paths.split)[1]
    tok = tokenizer.load_tokenizer(paths.tokenizer_dir)
    files = evaluation.heldout_package_files(corpus.HELDOUT_PACKAGES, tok, {corpus.content_hash(d) for d in documents},
                                             max_files=5, more_filtering=paths.settings["more_filtering"],
                                             seed=paths.settings["seed"])
    return {"valid": [evaluation.cut_at_line(d, 2500) for d in documents[valid_range[0]:valid_range[1]][:8]],
            "unseen": [evaluation.cut_at_line(f["text"], 2500) for f in files if not f["removed by"]]}


def judge(checkpoint_dir: Path, paths, sets: dict[str, list[str]], seed: int = 1234) -> dict[str, Any]:
    """Bits per byte on both sets and the syntax validity of 12 samples, for the latest checkpoint."""
    import torch

    from helpers.learn import checkpointing, evaluation, tokenizer

    tok = tokenizer.load_tokenizer(paths.tokenizer_dir)
    gpt, meta = checkpointing.load_model(checkpoint_dir)
    fn = lambda t: gpt(t, torch.arange(t.shape[1]).expand(t.shape), None)
    out: dict[str, Any] = {}
    for name, texts in sets.items():
        s = evaluation.score_texts(fn, tok, texts, meta["max_position_embeddings"], vocab_size=meta["vocab_size"],
                                   stride=meta["max_position_embeddings"] // 2)
        out[f"{name}_bpb"], out[f"{name}_gzip_bpb"] = s.bits_per_byte, evaluation.gzip_bits_per_byte(texts)
    gen = torch.Generator().manual_seed(seed)
    eod = tok.eos_token_id
    samples = []
    for prompt in PROMPTS:
        for _ in range(4):
            new = evaluation.sample(fn, [eod] + evaluation.encode(tok, prompt), 64, temperature=0.8, top_k=50,
                                    generator=gen, eod_id=eod, seq_length=meta["max_position_embeddings"],
                                    vocab_size=meta["vocab_size"])
            samples.append((prompt, tok.decode(new)))
    out["syntax_validity"] = evaluation.syntax_validity(*zip(*samples))
    out["sample"] = next((p + c for p, c in samples if evaluation.parses(p, c)), samples[0][0] + samples[0][1])
    return out


def run_candidate(name: str, overrides: dict[str, Any], out_dir: Path, paths, sets: dict[str, list[str]]) -> dict[str, Any]:
    from helpers.runner import launch
    from helpers.learn import training_config

    from helpers.learn import model as model_lib

    settings = {**BASE, **overrides}
    shape = {k: settings[k] for k in MODEL_FIELDS}
    architecture = settings.pop("architecture", "gpt2")  # the Llama of the same size, as notebook 03 makes it
    model = {**model_lib.profile("cpu").to_dict(), **shape,
             **model_lib.architecture_fields(architecture, shape["hidden_size"], shape["num_attention_heads"])}
    rest = {k: v for k, v in settings.items() if k not in MODEL_FIELDS}
    iters, seq = rest.pop("train_iters"), model["seq_length"]
    rest = {"eval_interval": iters, "save_interval": iters, "log_interval": 10, **rest}
    cfg = training_config.profile(
        "cpu", str(out_dir / name), data_prefix=str(paths.data_prefix), tokenizer_dir=str(paths.tokenizer_dir),
        split=paths.split, train_iters=iters, lr_decay_iters=iters,
        model={**model, "vocab_size": paths.vocab_size, "max_position_embeddings": seq}, **rest)
    load_before = common.load_average()
    started = time.perf_counter()
    result = launch.train(cfg, timeout_s=3600, progress=False)
    wall = time.perf_counter() - started
    s = result.summary
    row = {"candidate": name, "overrides": overrides, "train_wall_s": wall, "cached": result.skipped,
           "s_per_iter": cfg.global_batch_size * cfg.model.seq_length / s["tokens_per_s"],
           "tokens_seen": iters * cfg.global_batch_size * cfg.model.seq_length, "valid_loss": s["final_valid_loss"],
           "load_before": load_before, "architecture": cfg.model.architecture,
           "num_parameters": model_lib.count_parameters(cfg.model), "flops_per_token": model_lib.flops_per_token(cfg.model),
           "train_curve": [{k: r[k] for k in ("iteration", "lm_loss", "s_per_iter")} for r in result.metrics["train"]],
           "valid_curve": [{k: r[k] for k in ("iteration", "lm_loss")} for r in result.metrics["valid"] if r["when"] == "during"]}
    row |= judge(cfg.checkpoint_path, paths, sets)
    row["load_after"] = common.load_average()
    return row


def main(argv: list[str] | None = None) -> int:
    from helpers.runner import data_stage, series

    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--run-dir", default="runs/recipe", help="folder of the data and one run folder per candidate")
    parser.add_argument("--candidate", action="append", default=None,
                        help="NAME:key=value,key=value (notebook 03's parameter names); repeat; default: the built-in list")
    parser.add_argument("--only", default=None, help="comma-separated names of built-in candidates to run")
    parser.add_argument("--vocab-size", type=int, default=8192, help="notebook 01's vocab_size for the data (default 8192)")
    parser.add_argument("--architectures", action="store_true",
                        help="issue 28: notebook 03's recipe as GPT-2 and as Llama (ARCHITECTURE_CANDIDATES)")
    parser.add_argument("--repeats", type=int, default=1,
                        help="run the candidates this often, in alternating order (A B, B A, ...), named NAME-rN after the first")
    args = parser.parse_args(argv)
    out_dir = Path(args.run_dir).resolve()
    built_in = {**CANDIDATES, **ARCHITECTURE_CANDIDATES}
    candidates = dict(ARCHITECTURE_CANDIDATES if args.architectures else CANDIDATES)
    if args.only:
        candidates = {k: built_in[k] for k in args.only.split(",")}
    if args.candidate:
        candidates = {}
        for text in args.candidate:
            name, _, spec = text.partition(":")
            candidates[name] = dict(series.parse_override(item) for item in spec.split(",") if item)
    paths = data_stage.build_data(out_dir, more_filtering=True, package_files=8, vocab_size=args.vocab_size, progress=False)
    sets = held_out_sets(paths)
    print(f"unseen set: {len(sets['unseen'])} files, {sum(len(t.encode()) for t in sets['unseen']):,} bytes; "
          f"validation set: {len(sets['valid'])} documents", flush=True)
    rows, order = [], []
    for r in range(args.repeats):
        names = list(candidates) if r % 2 == 0 else list(reversed(candidates))
        order += [(n, n if r == 0 else f"{n}-r{r + 1}") for n in names]
    for base_name, name in order:
        rows.append(run_candidate(name, candidates[base_name], out_dir, paths, sets))
        r = rows[-1]
        print(f"{name}: {r['train_wall_s']:.0f} s, {r['s_per_iter']:.3f} s/iter, valid loss {r['valid_loss']:.3f}, "
              f"unseen {r['unseen_bpb']:.3f} bits/byte (gzip {r['unseen_gzip_bpb']:.3f}), syntax {r['syntax_validity']:.2f}, "
              f"load {r['load_before'][0]:.2f} -> {r['load_after'][0]:.2f}", flush=True)
    headers = ["candidate", "train s", "s/iter", "tokens", "valid loss", "valid bits/byte", "unseen bits/byte",
               "unseen gzip -9", "syntax valid", "load before/after"]
    print(common.markdown_table(headers, [
        [r["candidate"], r["train_wall_s"], r["s_per_iter"], r["tokens_seen"], r["valid_loss"], r["valid_bpb"],
         r["unseen_bpb"], r["unseen_gzip_bpb"], r["syntax_validity"],
         f"{r['load_before'][0]:.2f} / {r['load_after'][0]:.2f}"] for r in rows]))
    stamp = time.strftime("%Y%m%d-%H%M%S")
    print(f"written to {common.write_json(out_dir / f'bench_recipe-{stamp}.json', {'machine': common.machine_info(), 'rows': rows})}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
