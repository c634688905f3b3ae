"""Training benchmark: the series' megatron-core loop against transformers' ``Trainer``.

Both sides train the same GPT-2 shape (the ``cpu`` model profile, notebook 03's model: 4 layers,
hidden 192, 4 heads, sequence length 128, vocabulary 8,192; until 2026-12-01 hidden 256 and
sequence 256, the shape of the RESULTS.md tables of that date; ``helpers.learn.conversion.gpt2_config`` gives
``GPT2LMHeadModel`` identical dimensions) on the same samples (the same megatron-core
``GPTDataset``, read in order) with the same batch (the ``cpu`` training profile's: micro-batch
4, global batch 8, i.e. two micro-batches of gradient accumulation, when RESULTS.md was
measured), optimizer settings (fused AdamW, the profile's lr, weight decay 0.1 without decay
on biases and LayerNorm, clip 1.0), fp32 on CPU. The parent builds one ``TrainingConfig``
and hands it to every run:

* ``megatron``: :func:`helpers.demos.core_loop.setup` + :func:`helpers.demos.core_loop.train_step` (GPTModel
  with the local layer spec and megatron-core's own ``DotProductAttention``, megatron-core DDP,
  ``get_forward_backward_func`` schedule, ``get_megatron_optimizer``, ``OptimizerParamScheduler``),
  notebook 03's loop, whose losses equal Megatron-LM's own loop's;
* ``megatron_sdpa`` (with ``--with-sdpa-attention``): the same loop with torch's fused attention
  kernel (``core_attention="sdpa"``, :class:`helpers.learn.attention.SDPAttention`) in the local spec's
  core-attention slot, to show what the kernel choice is worth in a whole step;
* ``megatron_lm`` (unless ``--without-megatron-lm``): Megatron-LM's own loop,
  ``helpers.learn.pretrain_gpt`` under torchrun with the config's flags, logging every iteration;
  its times are the ``elapsed time per iteration`` of its log lines;
* ``trainer``: ``transformers.Trainer`` + ``GPT2LMHeadModel`` (``sdpa`` attention by
  default, ``--hf-attention eager`` for the unfused path), the labels given as
  ``shift_labels`` so both sides predict the same ``seq_length`` tokens per sample.

Besides the medians, each repeat gives one ratio per side against the Trainer (the sides of a
repeat run back to back, so slow drift of a shared machine cancels in it); the report gives
their median and range. After its timed iterations, each run of the ``megatron`` and
``trainer`` sides takes ``--profile-steps`` more steps under ``torch.profiler``; the report
sums their self CPU time per operator into groups (:data:`OP_CATEGORIES`) and lists the
operators that differ most, so that every millisecond of the difference has a name.

Each side runs in its own process (``torch.set_num_threads(--threads)``), the runs are
interleaved, and the first ``--warmup`` iterations of each run are left out of the timing.
Reported: seconds per iteration (median over the timed iterations of every run, then over
runs), tokens/s, peak memory of the process, and the losses (both must fall from about
ln(vocab)).

On a CUDA GPU (``--device cuda``) the same comparison runs the ``codeparrot-small``
profile (12 layers, hidden 768, sequence 1024, micro-batch 12) in bf16 for a fixed number
of iterations and adds MFU (model FLOPs utilisation: ``flops_per_token x tokens/s`` over
the GPU's peak dense bf16 FLOP/s). Without CUDA it stops with a message saying so.

Run (from the repository root)::

    python -m bench.training                    # CPU, about 3.5 minutes on 2 cores
    python -m bench.training --device cuda      # a GPU machine
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

from bench import common
from helpers.runner import preflight

OUT_DIR = "bench_training"
SIDES = ("megatron", "megatron_sdpa", "megatron_lm", "trainer")

def mfu(flops_per_token: float, tokens_per_second: float, peak: float | None) -> float | None:
    """Model FLOPs utilisation: achieved model FLOP/s over the peak (a fraction, 0..1).

    Source: Chowdhery et al. 2022 (PaLM), appendix B; ``flops_per_token`` from
    :func:`helpers.learn.model.flops_per_token` (forward + backward, no recomputation counted).
    """
    if not peak:
        return None
    return flops_per_token * tokens_per_second / peak


def timed_iterations(step_end_times: list[float], start_time: float, warmup: int) -> list[float]:
    """Seconds of each iteration after the first ``warmup`` ones.

    Args:
        step_end_times: ``time.perf_counter()`` at the end of every iteration, in order.
        start_time: ``time.perf_counter()`` just before the first iteration.
        warmup: iterations to leave out (allocator and thread-pool warm-up).

    Raises:
        ValueError: fewer than ``warmup + 1`` iterations.
    """
    if len(step_end_times) <= warmup:
        raise ValueError(f"{len(step_end_times)} iterations ran but warmup={warmup}: run more iterations")
    ends = [start_time] + list(step_end_times)
    durations = [b - a for a, b in zip(ends[:-1], ends[1:])]
    return durations[warmup:]


# --------------------------------------------------------------------------- configuration
def training_config(opts: dict[str, Any]):
    """The :class:`helpers.learn.training_config.TrainingConfig` both sides use, from the benchmark options.

    The parent process builds it once and passes it to both sides as a dict
    (``opts["config"]``), so every run of the benchmark trains with the same settings even if
    the profiles in ``helpers.learn.training_config`` change while it runs. Batch sizes left ``None`` in
    ``opts`` are the profile's own.
    """
    from helpers.learn.training_config import TrainingConfig, profile, resolve_precision

    if "config" in opts:
        return TrainingConfig.from_dict(opts["config"])
    batch = {k: opts[k] for k in ("micro_batch_size", "global_batch_size") if opts.get(k)}
    model_overrides: dict[str, Any] = {"vocab_size": opts["vocab_size"]}
    if opts.get("seq_length"):
        model_overrides.update(seq_length=opts["seq_length"], max_position_embeddings=max(opts["seq_length"], 256))
    if opts["profile"] == "codeparrot-small":
        model_overrides.update(max_position_embeddings=max(1024, opts.get("seq_length") or 1024))
    return profile(
        opts["profile"], opts["run_dir"], model=model_overrides, **batch, train_iters=opts["iters"] + opts.get("profile_steps", 0), lr_warmup_iters=1,
        lr_decay_iters=max(opts["iters"] + opts.get("profile_steps", 0), 2), save_interval=None,
        eval_interval=opts["iters"] + opts.get("profile_steps", 0), eval_iters=1,
        precision=resolve_precision("auto"), split="969,30,1", checkpoint_dir=str(Path(opts["out_dir"]) / "checkpoints"),
        tensorboard_dir=str(Path(opts["out_dir"]) / "tensorboard"),
        metrics_path=str(Path(opts["out_dir"]) / "metrics.jsonl"),
    )


def op_milliseconds(prof, steps: int) -> dict[str, float]:
    """``{operator: self CPU milliseconds per step}`` from a finished ``torch.profiler.profile``."""
    return {e.key: e.self_cpu_time_total / 1e3 / steps for e in prof.key_averages() if e.self_cpu_time_total > 0}


def _profiler():
    from torch.profiler import ProfilerActivity, profile

    return profile(activities=[ProfilerActivity.CPU])


def _set_threads(threads: int) -> None:
    import torch

    torch.set_num_threads(threads)


# --------------------------------------------------------------------------- the two sides (child processes)
def _side_megatron(opts: dict[str, Any], core_attention: str | None = None) -> dict[str, Any]:
    import torch

    from helpers.demos import core_loop
    from helpers.learn import distributed
    from helpers.learn.training_config import resolve_precision

    _set_threads(opts["threads"])
    cfg = training_config(opts)
    if core_attention is not None:
        cfg = replace(cfg, model=replace(cfg.model, core_attention=core_attention))
    t0 = time.perf_counter()
    loop = core_loop.setup(cfg)
    setup_s = time.perf_counter() - t0
    n_params = sum(p.numel() for p in loop.model.module.parameters())
    ends, losses = [], []
    if torch.cuda.is_available():
        torch.cuda.reset_peak_memory_stats()
        torch.cuda.synchronize()
    start = time.perf_counter()
    profile_steps = opts.get("profile_steps", 0)
    for _ in range(cfg.train_iters - profile_steps):
        out = core_loop.train_step(loop)
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        ends.append(time.perf_counter())
        losses.append(out["lm_loss"])
    ops = None
    if profile_steps:  # after the timed iterations, so the profiler's own cost stays out of them
        with _profiler() as prof:
            for _ in range(profile_steps):
                core_loop.train_step(loop)
        ops = op_milliseconds(prof, profile_steps)
    gpu_peak = torch.cuda.max_memory_allocated() if torch.cuda.is_available() else None
    optimizer = f"{type(loop.optimizer.optimizer).__module__}.{type(loop.optimizer.optimizer).__name__}"
    distributed.destroy_distributed()
    return {"setup_seconds": setup_s, "iteration_seconds": timed_iterations(ends, start, opts["warmup"]), "op_ms": ops,
            "losses": losses, "parameters": n_params, "precision": resolve_precision(cfg.precision),
            "optimizer": optimizer, "gpu_peak_allocated_bytes": gpu_peak,
            "implementation": f"megatron-core GPTModel (local spec, {cfg.model.core_attention} attention), notebook 03's loop"}


def _side_megatron_lm(opts: dict[str, Any]) -> dict[str, Any]:
    """Megatron-LM's own loop (``helpers.learn.pretrain_gpt`` under torchrun, one process) on the same
    config, logging every iteration; its per-iteration times are the ``elapsed time per iteration``
    of its log lines (Megatron-LM's ``training_log``, timers included)."""
    from helpers.runner import launch, megatron_args, metrics
    from helpers.learn.model import count_parameters

    out = Path(opts["out_dir"])
    cfg = replace(training_config(opts), log_interval=1, checkpoint_dir=str(out / "megatron_lm_checkpoints"),
                  tensorboard_dir=str(out / "megatron_lm_tensorboard"))
    for folder in (cfg.checkpoint_path, cfg.tensorboard_path):  # a fresh run every time, never a resume
        shutil.rmtree(folder, ignore_errors=True)
    t0 = time.perf_counter()
    res = launch.torchrun([megatron_args.SCRIPT[1], *megatron_args.arguments(cfg)], nproc_per_node=1,
                          timeout_s=float(opts.get("timeout_s", 280)), on_line=None,
                          env={**os.environ, **megatron_args.ENV, "OMP_NUM_THREADS": str(opts["threads"])})
    records = metrics.from_megatron_lm(cfg, res.output, write=False)  # its log's times, TensorBoard's losses
    if len(records["train"]) < cfg.train_iters:
        raise common.BenchError(f"Megatron-LM's loop logged {len(records['train'])} of {cfg.train_iters} iterations:\n"
                                + "\n".join(res.output.splitlines()[-25:]))
    seconds = [r["s_per_iter"] for r in records["train"]]
    losses = [r["lm_loss"] for r in records["iteration"]]
    shutil.rmtree(cfg.checkpoint_path, ignore_errors=True)
    return {"setup_seconds": time.perf_counter() - t0 - sum(seconds), "iteration_seconds": seconds[opts["warmup"]:],
            "losses": losses, "parameters": count_parameters(cfg.model), "precision": "fp32" if cfg.precision != "bf16" else "bf16",
            "optimizer": "Megatron-LM get_megatron_optimizer", "gpu_peak_allocated_bytes": None,
            "implementation": "Megatron-LM's own loop (pretrain_gpt under torchrun, local spec)"}


class _ShiftedGPTDataset:
    """A megatron-core ``GPTDataset`` as transformers ``Trainer`` samples.

    ``input_ids`` = the sample's ``tokens`` ``[seq]`` and ``shift_labels`` = its ``labels``
    (the next tokens), so ``GPT2LMHeadModel``'s loss (``ForCausalLMLoss`` with
    ``shift_labels``) covers the same ``seq`` predictions as megatron-core's.
    """

    def __init__(self, dataset, num_samples: int):
        self.dataset, self.num_samples = dataset, num_samples

    def __len__(self) -> int:
        return self.num_samples

    def __getitem__(self, i: int) -> dict[str, Any]:
        import torch

        s = self.dataset[i % len(self.dataset)]
        labels = torch.as_tensor(s["labels"]).long()
        return {"input_ids": torch.as_tensor(s["tokens"]).long(), "labels": labels, "shift_labels": labels}


def _side_trainer(opts: dict[str, Any]) -> dict[str, Any]:
    import torch
    from transformers import GPT2LMHeadModel, Trainer, TrainerCallback, TrainingArguments

    from helpers.learn import conversion, dataloader
    from helpers.learn import tokenizer as tokenizer_mod

    _set_threads(opts["threads"])
    cfg = training_config(opts)
    cuda = torch.cuda.is_available()
    t0 = time.perf_counter()
    train_ds, _, _ = dataloader.build_run_datasets(cfg)
    hf_config = conversion.gpt2_config(cfg.model, eod_id=tokenizer_mod.eod_id(cfg.tokenizer_path))
    hf_config._attn_implementation = opts["hf_attention"]
    torch.manual_seed(cfg.seed)
    model = GPT2LMHeadModel(hf_config)
    n_params = sum(p.numel() for p in model.parameters())
    ends: list[float] = []
    marks: dict[str, Any] = {}
    profile_steps = opts.get("profile_steps", 0)

    class Clock(TrainerCallback):
        def on_train_begin(self, args, state, control, **kwargs):
            if cuda:
                torch.cuda.synchronize()
            marks["start"] = time.perf_counter()

        def on_step_end(self, args, state, control, **kwargs):
            if cuda:
                torch.cuda.synchronize()
            ends.append(time.perf_counter())
            if profile_steps and state.global_step == cfg.train_iters - profile_steps:
                marks["profiler"] = _profiler()  # the last profile_steps steps run under the profiler, untimed
                marks["profiler"].start()

        def on_train_end(self, args, state, control, **kwargs):
            if "profiler" in marks:
                marks["profiler"].stop()

    accumulation = cfg.global_batch_size // cfg.micro_batch_size
    args = TrainingArguments(
        output_dir=str(Path(opts["out_dir"]) / "trainer"), max_steps=cfg.train_iters,
        per_device_train_batch_size=cfg.micro_batch_size, gradient_accumulation_steps=accumulation,
        learning_rate=cfg.lr, weight_decay=cfg.weight_decay, adam_beta1=cfg.adam_beta1, adam_beta2=cfg.adam_beta2,
        adam_epsilon=cfg.adam_eps, max_grad_norm=cfg.clip_grad, warmup_steps=cfg.lr_warmup_iters,
        lr_scheduler_type="cosine_with_min_lr", lr_scheduler_kwargs={"min_lr": cfg.min_lr},
        optim="adamw_torch_fused", logging_strategy="steps", logging_steps=1, save_strategy="no",
        eval_strategy="no", report_to="none", disable_tqdm=True, seed=cfg.seed, data_seed=cfg.seed,
        train_sampling_strategy="sequential", remove_unused_columns=False, dataloader_num_workers=0,
        dataloader_pin_memory=cuda, use_cpu=not cuda, bf16=cfg.precision == "bf16", fp16=cfg.precision == "fp16",
    )
    dataset = _ShiftedGPTDataset(train_ds, cfg.train_iters * cfg.global_batch_size)
    trainer = Trainer(model=model, args=args, train_dataset=dataset, callbacks=[Clock()])
    setup_s = time.perf_counter() - t0
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    trainer.train()
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    timed = ends[:len(ends) - profile_steps]
    return {"setup_seconds": setup_s, "iteration_seconds": timed_iterations(timed, marks["start"], opts["warmup"]),
            "op_ms": op_milliseconds(marks["profiler"], profile_steps) if "profiler" in marks else None,
            "losses": losses, "parameters": n_params, "precision": "bf16" if args.bf16 else "fp16" if args.fp16 else "fp32",
            "optimizer": f"Trainer optim={args.optim}",
            "gpu_peak_allocated_bytes": torch.cuda.max_memory_allocated() if cuda else None,
            "implementation": f"transformers GPT2LMHeadModel ({opts['hf_attention']} attention)"}


# --------------------------------------------------------------------------- the benchmark



def op_medians(per_run: list[dict[str, float]]) -> dict[str, float]:
    """Each operator's median over the runs of its milliseconds per step (0 in a run that lacks it)."""
    keys = {k for run_ in per_run for k in run_}
    return {k: common.median(run_.get(k, 0.0) for run_ in per_run) for k in keys}


#: Operator groups of :func:`category_table`, first match wins (``torch.profiler`` keys, by prefix).
OP_CATEGORIES: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("matrix multiplies", ("aten::mm", "aten::addmm", "aten::bmm", "aten::baddbmm", "aten::matmul")),
    ("attention: softmax, mask, SDPA", ("aten::_scaled_dot_product", "aten::_softmax", "aten::masked_fill")),
    ("cross-entropy over the vocabulary", ("aten::_log_softmax", "aten::nll_loss", "aten::max", "aten::exp",
                                           "aten::sub_", "aten::div_", "_VocabParallelCrossEntropy")),
    ("AdamW and the gradient norm", ("aten::_fused_adamw_", "aten::linalg_vector_norm", "Optimizer.", "aten::_foreach")),
    ("GELU and LayerNorm", ("aten::gelu", "aten::native_layer_norm")),
    ("gradient buffers: zero, copy, accumulate", ("aten::fill_", "aten::zero_", "aten::copy_", "aten::add_",
                                                  "autograd::engine::evaluate_function: torch::autograd::AccumulateGrad",
                                                  "torch::autograd::AccumulateGrad")),
    ("other element-wise (add, mul, sum, cat)", ("aten::add", "aten::mul", "aten::sum", "aten::cat")),
    ("communication (gloo)", ("c10d::",)),
)


def op_category(key: str) -> str:
    """The :data:`OP_CATEGORIES` group of a ``torch.profiler`` operator key, else the catch-all group."""
    return next((name for name, prefixes in OP_CATEGORIES if key.startswith(prefixes)),
                "autograd, views, Megatron's autograd functions, Python, the rest")


def category_table(ops: dict[str, dict[str, float]], a: str = "megatron", b: str = "trainer") -> str:
    """Markdown: self CPU milliseconds per step of sides ``a`` and ``b`` summed by :func:`op_category`,
    so that every millisecond of the difference lands in a named group; then the totals."""
    groups = [name for name, _ in OP_CATEGORIES] + [op_category("")]
    sums = {side: {g: 0.0 for g in groups} for side in (a, b)}
    for side in (a, b):
        for key, ms in ops[side].items():
            sums[side][op_category(key)] += ms
    rows = [[g, sums[a][g], sums[b][g]] for g in groups]
    rows.append(["**total self CPU time per step**", sum(sums[a].values()), sum(sums[b].values())])
    return common.markdown_table(["group", f"{a} ms/step", f"{b} ms/step", "difference ms"],
                                 [[r[0], f"{r[1]:.2f}", f"{r[2]:.2f}", f"{r[1] - r[2]:+.2f}"] for r in rows])


def attribution_table(ops: dict[str, dict[str, float]], a: str = "megatron", b: str = "trainer", top: int = 12) -> str:
    """Markdown: the operators whose self CPU time per step differs most between sides ``a`` and
    ``b`` (torch.profiler, milliseconds), then every other operator summed, then the totals."""
    keys = set(ops[a]) | set(ops[b])
    diff = sorted(keys, key=lambda k: abs(ops[a].get(k, 0.0) - ops[b].get(k, 0.0)), reverse=True)
    rows = [[k, ops[a].get(k, 0.0), ops[b].get(k, 0.0), ops[a].get(k, 0.0) - ops[b].get(k, 0.0)] for k in diff[:top]]
    rest = [sum(ops[side].get(k, 0.0) for k in diff[top:]) for side in (a, b)]
    rows.append([f"the other {len(diff) - top} operators", rest[0], rest[1], rest[0] - rest[1]])
    total = [sum(ops[side].values()) for side in (a, b)]
    rows.append(["**total self CPU time per step**", total[0], total[1], total[0] - total[1]])
    return common.markdown_table(["operator", f"{a} ms/step", f"{b} ms/step", "difference ms"],
                                 [[r[0], f"{r[1]:.2f}", f"{r[2]:.2f}", f"{r[3]:+.2f}"] for r in rows])


def cuda_available() -> bool:
    """True when torch sees a CUDA GPU."""
    import torch

    return torch.cuda.is_available()


def prepare(args: argparse.Namespace) -> dict[str, Any]:
    """Data (cached), options for the children, and the checks that must pass before any run.

    Raises:
        SystemExit: ``--device cuda`` without a CUDA GPU (the message says what runs instead).
    """
    from helpers.runner.data_stage import build_data

    if args.device == "cuda" and not cuda_available():
        raise SystemExit(
            "CUDA is not available on this machine: the GPU benchmark (codeparrot-small profile, bf16, MFU) "
            "needs an NVIDIA GPU and a CUDA build of torch. Nothing was run. On this machine run the CPU "
            "benchmark: python -m bench.training"
        )
    profile = "codeparrot-small" if args.device == "cuda" else "cpu"
    run_dir = Path(args.run_dir or common.ROOT / "runs" / ("bench" if profile == "cpu" else "bench-codeparrot-small"))
    vocab = 8192 if profile == "cpu" else 32768
    paths = build_data(run_dir, vocab_size=vocab, progress=False)
    out = run_dir / OUT_DIR
    out.mkdir(parents=True, exist_ok=True)
    opts = {"run_dir": str(run_dir), "out_dir": str(out), "profile": profile, "vocab_size": paths.vocab_size,
            "iters": args.iters or 30, "warmup": args.warmup, "timeout_s": args.timeout_s, "profile_steps": args.profile_steps,
            "micro_batch_size": args.micro_batch_size, "global_batch_size": args.global_batch_size,
            "threads": args.threads, "seq_length": args.seq_length, "hf_attention": args.hf_attention,
            "device": args.device}
    cfg = training_config(opts)
    cfg.check()
    opts.update(micro_batch_size=cfg.micro_batch_size, global_batch_size=cfg.global_batch_size, config=cfg.to_dict())
    return opts


def run(args: argparse.Namespace) -> dict[str, Any]:
    """Run both sides ``--repeats`` times, interleaved; returns the result dict."""
    import torch

    opts = prepare(args)
    config_path = Path(opts["out_dir"]) / "bench_options.json"
    config_path.write_text(json.dumps(opts, indent=2) + "\n")
    env = common.child_env({"OMP_NUM_THREADS": str(args.threads), "TOKENIZERS_PARALLELISM": "false",
                            "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"})
    env.pop("WORLD_SIZE", None), env.pop("RANK", None), env.pop("MASTER_PORT", None)
    machine = common.machine_info()
    cfg = training_config(opts)
    tokens_per_iter = cfg.global_batch_size * cfg.model.seq_length
    print(f"profile {opts['profile']}: {cfg.model.num_layers} layers, hidden {cfg.model.hidden_size}, "
          f"{cfg.model.num_attention_heads} heads, seq {cfg.model.seq_length}, vocab {cfg.model.vocab_size}; "
          f"micro-batch {cfg.micro_batch_size}, global batch {cfg.global_batch_size} ({tokens_per_iter} tokens/iteration); "
          f"{opts['iters']} iterations ({opts['warmup']} warm-up) per run, {args.threads} threads; "
          f"load average {machine['load_average']}", flush=True)
    active = [side for side in SIDES if (side != "megatron_sdpa" or args.with_sdpa_attention)
              and (side != "megatron_lm" or not args.without_megatron_lm)]
    runs: dict[str, list[dict[str, Any]]] = {side: [] for side in active}
    stats = {side: common.SideStats(side) for side in active}
    for r, order in enumerate(common.interleaved_orders(active, args.repeats), 1):
        for side in order:
            m = common.run_measured([sys.executable, "-m", "bench.training", f"_{side}", str(config_path)],
                                    env=env, cwd=common.ROOT, timeout_s=args.timeout_s, what=f"the {side} side")
            res = common.read_result(m.stdout)
            per_iter = common.median(res["iteration_seconds"])
            stats[side].add(m, per_iter)
            runs[side].append(res | {"wall_seconds": m.wall_seconds, "peak_rss_mb": m.peak_rss_mb})
            print(f"  repeat {r}/{args.repeats} {side:<16}: {per_iter:.3f} s/iteration "
                  f"({tokens_per_iter / per_iter:,.0f} tokens/s), loss {res['losses'][0]:.3f} -> {res['losses'][-1]:.3f}, "
                  f"set-up {res['setup_seconds']:.1f} s, process {m.wall_seconds:.1f} s, peak RSS {m.peak_rss_mb:.0f} MB",
                  flush=True)
    from helpers.learn.model import flops_per_token

    # one ratio per repeat: the sides of a repeat ran minutes apart at most, so drift cancels in each
    pair_ratios = {side: [t / m for t, m in zip(stats["trainer"].summary()["phase_seconds"], stats[side].summary()["phase_seconds"])]
                   for side in active if side != "trainer"}

    fpt = flops_per_token(cfg.model)
    peak = preflight.peak_flops(torch.cuda.get_device_name(), args.peak_tflops) if args.device == "cuda" else None
    sides = {}
    for side in active:
        s = stats[side].summary()
        all_iters = [x for run_ in runs[side] for x in run_["iteration_seconds"]]
        s_per_iter = common.median(all_iters)
        tps = tokens_per_iter / s_per_iter
        sides[side] = {
            "implementation": runs[side][0]["implementation"], "optimizer": runs[side][0]["optimizer"],
            "precision": runs[side][0]["precision"], "parameters": runs[side][0]["parameters"],
            "seconds_per_iteration_median": s_per_iter,
            "seconds_per_iteration_run_medians": [round(x, 4) for x in s["phase_seconds"]],
            "tokens_per_second": tps, "peak_rss_mb_median": s["peak_rss_mb_median"],
            "peak_pss_mb_median": s["peak_pss_mb_median"],
            "setup_seconds_median": common.median(r_["setup_seconds"] for r_ in runs[side]),
            "process_seconds_median": s["wall_seconds_median"],
            "first_loss": runs[side][0]["losses"][0], "last_loss": runs[side][0]["losses"][-1],
            "losses_first_run": runs[side][0]["losses"],
            "gpu_peak_allocated_gb": (runs[side][0]["gpu_peak_allocated_bytes"] or 0) / 2**30 or None,
            "mfu": mfu(fpt, tps, peak),
        }
    if len({s["precision"] for s in sides.values()}) != 1:
        raise common.BenchError(f"the sides trained in different precisions ({ {k: v['precision'] for k, v in sides.items()} }): "
                                "the comparison needs one dtype on both")
    return {
        "benchmark": "training", "machine": machine, "load_average_after": common.load_average(),
        "options": {k: v for k, v in opts.items() if k != "config"}, "config": opts["config"],
        "tokens_per_iteration": tokens_per_iter, "flops_per_token": fpt,
        "model": cfg.model.to_dict(), "repeats": args.repeats, "sides": sides,
        "speedup_tokens_per_second_megatron_vs_trainer": common.ratio(sides["megatron"]["tokens_per_second"],
                                                                      sides["trainer"]["tokens_per_second"]),
        "op_ms_per_step": {side: op_medians([r_["op_ms"] for r_ in runs[side] if r_.get("op_ms")])
                           for side in active if any(r_.get("op_ms") for r_ in runs[side])},
        "per_repeat_ratio_vs_trainer": {side: {"ratios": [round(r, 4) for r in rs], "median": common.median(rs),
                                               "min": min(rs), "max": max(rs)} for side, rs in pair_ratios.items()},
        "speedup_tokens_per_second_megatron_sdpa_vs_trainer": common.ratio(
            sides["megatron_sdpa"]["tokens_per_second"], sides["trainer"]["tokens_per_second"])
        if "megatron_sdpa" in sides else None,
        "gpu": torch.cuda.get_device_name() if args.device == "cuda" else None, "peak_flops": peak,
    }


def report(result: dict[str, Any]) -> str:
    """The result as a markdown table plus the ratio."""
    rows = []
    for side, s in result["sides"].items():
        mfu_cell = f"{100 * s['mfu']:.1f} %" if s["mfu"] is not None else "n/a (CPU)"
        rows.append([s["implementation"], s["seconds_per_iteration_median"], s["tokens_per_second"],
                     s["peak_rss_mb_median"], f"{s['first_loss']:.3f} -> {s['last_loss']:.3f}",
                     s["setup_seconds_median"], mfu_cell])
    table = common.markdown_table(["side", "s/iteration (median)", "tokens/s", "peak RSS MB", "loss first -> last",
                                   "set-up s", "MFU"], rows)
    o = result["options"]
    head = (f"Profile `{o['profile']}` on {o['device']}: {result['tokens_per_iteration']} tokens per iteration "
            f"(micro-batch {o['micro_batch_size']}, global batch {o['global_batch_size']}), {o['iters']} iterations "
            f"per run of which {o['warmup']} warm-up, {result['repeats']} interleaved runs per side, "
            f"{o['threads']} threads. Load average before {result['machine']['load_average']}, "
            f"after {result['load_average_after']}.")
    ratio = result["speedup_tokens_per_second_megatron_vs_trainer"]
    text = f"{head}\n\n{table}\n\nmegatron-core / Trainer tokens/s: **{ratio:.2f}x** (medians of all timed iterations)\n"
    for side, r in result.get("per_repeat_ratio_vs_trainer", {}).items():
        text += (f"{side} / Trainer, one ratio per interleaved repeat: median **{r['median']:.2f}x**, range "
                 f"{r['min']:.2f}-{r['max']:.2f}x ({', '.join(f'{x:.2f}' for x in r['ratios'])})\n")
    ops = result.get("op_ms_per_step", {})
    if "megatron" in ops and "trainer" in ops:
        text += ("\nWhere the time goes (torch.profiler over the steps after the timed ones, self CPU time per "
                 "operator, median over the repeats), by group:\n\n" + category_table(ops)
                 + "\n\nand the operators that differ most:\n\n" + attribution_table(ops) + "\n")
    sdpa = result.get("speedup_tokens_per_second_megatron_sdpa_vs_trainer")
    if sdpa is not None:
        text += f"megatron-core with torch's fused SDPA attention / Trainer tokens/s: {sdpa:.2f}x\n"
    return text


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] in ("_megatron", "_megatron_sdpa", "_megatron_lm", "_trainer"):
        opts = json.loads(Path(argv[1]).read_text())
        if argv[0] == "_trainer":
            common.emit_result(_side_trainer(opts))
        elif argv[0] == "_megatron_lm":
            common.emit_result(_side_megatron_lm(opts))
        else:
            common.emit_result(_side_megatron(opts, "sdpa" if argv[0] == "_megatron_sdpa" else None))
        return 0
    parser = argparse.ArgumentParser(prog="python -m bench.training", description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu",
                        help="cpu: the `cpu` profile in fp32; cuda: `codeparrot-small` in bf16 with MFU")
    parser.add_argument("--run-dir", default=None, help="run folder for data and outputs (default runs/bench)")
    parser.add_argument("--iters", type=int, default=None, help="iterations per run (default 30)")
    parser.add_argument("--warmup", type=int, default=3, help="iterations per run left out of the timing (default 3)")
    parser.add_argument("--repeats", type=int, default=6, help="interleaved runs per side (default 6)")
    parser.add_argument("--micro-batch-size", type=int, default=None, help="default: the training profile's")
    parser.add_argument("--global-batch-size", type=int, default=None, help="default: the training profile's")
    parser.add_argument("--seq-length", type=int, default=None, help="default: the profile's (256 / 1024)")
    parser.add_argument("--threads", type=int, default=2, help="torch threads per side (default 2)")
    parser.add_argument("--hf-attention", choices=("sdpa", "eager"), default="sdpa",
                        help="GPT2LMHeadModel attention (default sdpa, what transformers picks)")
    parser.add_argument("--with-sdpa-attention", action="store_true",
                        help="also run the megatron-core loop with torch's fused SDPA attention in the local spec")
    parser.add_argument("--profile-steps", type=int, default=3,
                        help="steps after the timed ones that run under torch.profiler, for the per-operator table "
                             "(megatron and trainer sides; 0: none)")
    parser.add_argument("--without-megatron-lm", action="store_true",
                        help="leave out Megatron-LM's own loop (pretrain_gpt under torchrun)")
    parser.add_argument("--peak-tflops", type=float, default=None, help="GPU peak dense bf16 TFLOP/s for MFU")
    parser.add_argument("--timeout-s", type=float, default=280.0, help="limit per run, seconds")
    parser.add_argument("--json", default=None, help="write the result here (default {run_dir}/bench_training.json)")
    args = parser.parse_args(argv)
    if args.iters is not None and args.iters <= args.warmup:
        parser.error(f"--iters={args.iters} must be above --warmup={args.warmup}")
    for name in ("repeats", "threads"):
        if getattr(args, name) < 1:
            parser.error(f"--{name}={getattr(args, name)} must be at least 1")
    for name in ("warmup", "profile_steps"):
        if getattr(args, name) < 0:
            parser.error(f"--{name.replace('_', '-')}={getattr(args, name)} must be 0 or more")
    try:
        result = run(args)
    except common.BenchError as err:
        print(f"error: {err}", file=sys.stderr)
        return 1
    return common.finish(result, args.json or Path(result["options"]["run_dir"]) / "bench_training.json", report(result))


if __name__ == "__main__":
    sys.exit(main())
