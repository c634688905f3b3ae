"""GPU check: what the series does on an NVIDIA GPU, measured in one command of a few minutes.

``make gpu-check`` (or ``python -m bench.gpu_check``) on a machine with a CUDA GPU:

1. **data**: notebook 01's stage with the ``gpu`` profile's vocabulary (32,768) over the standard
   library only (``--package-files 0``: throughput does not depend on how much data there is);
2. **throughput**: the ``gpu`` training profile (the guide's 110M model, micro-batch 32, global
   batch 64, sequence 1,024) for ``--iters`` iterations under torchrun, in bf16 (``precision
   auto``), with Transformer Engine's layer spec and Apex's fused AdamW when they are installed
   (the NGC container) and megatron-core's local spec and torch's fused AdamW otherwise; tokens/s
   (median over the log intervals) and MFU against the GPU's peak dense bf16 FLOP/s
   (:data:`helpers.runner.preflight.PEAK_BF16_FLOPS`); unmeasured so far, the estimate for this model on
   one H100 is 250k-400k tokens/s (400k is 31 % MFU by the series' FLOPs count; llm.c's hand-written CUDA
   reaches about 460k on GPT-2 124M); the guide's own run averaged about 85k tokens/s per A100;
3. **conversion on the GPU**: the trained checkpoint converted to transformers
   (:func:`helpers.learn.conversion.convert_to_hf`), both models in fp32 on the GPU: largest logit
   difference, validation loss of both on training's own validation batches, greedy tokens;
4. **TP=2 = TP=1** when there are two GPUs: the same checkpoint loaded by two tensor-parallel
   ranks (NCCL, fp32), their logits against the TP=1 model's.

It ends with one table and writes ``{run_dir}/gpu_check.json``. Without CUDA it says it could not
run and exits with status 2 (nothing is made).

Run (from the repository root)::

    make gpu-check
    python -m bench.gpu_check --iters 300 --peak-tflops 989
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

from bench import common

GREEDY_TOKENS = 24


#: ``--cpu-smoke``: a tiny model and batch, so that the test suite runs this script end to end on a CPU.
SMOKE = {"model": {"num_layers": 2, "hidden_size": 64, "num_attention_heads": 4, "seq_length": 64,
                   "max_position_embeddings": 64}, "micro_batch_size": 2, "global_batch_size": 4}


def _train(run: Path, data, iters: int, smoke: bool = False, **overrides: Any):
    from helpers.runner import launch
    from helpers.learn import training_config

    settings = dict(data_prefix=str(data.data_prefix), tokenizer_dir=str(data.tokenizer_dir), split=data.split,
                    train_iters=iters, lr_warmup_iters=max(1, iters // 10), lr_decay_iters=iters, log_interval=10,
                    eval_interval=iters, eval_iters=2, save_interval=iters)
    settings |= ({k: v for k, v in SMOKE.items() if k != "model"} if smoke else {}) | overrides
    model = {"vocab_size": data.vocab_size} | (SMOKE["model"] if smoke else {})
    cfg = training_config.profile("gpu", str(run), model=model, **settings)
    return cfg, launch.train(cfg, nproc_per_node=cfg.tensor_model_parallel_size, timeout_s=600, progress=False)


def tensor_parallel_check(checkpoint_dir: Path, tokens, reference, cpu: bool) -> dict[str, Any]:
    """The trained checkpoint loaded by 2 tensor-parallel ranks (resharded on load): their logits
    against the TP=1 model's (``reference``, fp32), :func:`helpers.demos.tensor_parallel_run.run_tensor_parallel`.

    Both sides load the same weights, so the comparison is of the computation alone (two runs
    trained from scratch would differ: on a GPU each TP rank initialises its own slice).
    """
    from helpers.demos import conversion_proofs as proofs
    from helpers.demos import tensor_parallel_run

    tp = tensor_parallel_run.run_tensor_parallel(2, load=checkpoint_dir, tokens=tokens, cpu=cpu)
    cmp = proofs.compare_logits(tp.logits, reference)  # the real vocabulary: the padding rows differ by TP size
    return {"max_logit_difference": cmp.max_abs_diff, "argmax_agreement": cmp.argmax_agreement, "wall_s": tp.wall_seconds}


def conversion_check(run: Path, cfg) -> tuple[dict[str, Any], Any, Any]:
    """Convert the checkpoint and compare transformers with megatron-core on the GPU, both IEEE fp32 (TF32 off).

    Returns:
        ``(figures, tokens, megatron-core logits)``: the figures, and the validation tokens with
        the TP=1 logits over the tokenizer's vocabulary for :func:`tensor_parallel_check`.
    """
    import torch
    from transformers import GPT2LMHeadModel

    from helpers.learn import checkpointing, conversion, tokenizer
    from helpers.demos import conversion_proofs as proofs
    from helpers.demos import generation
    from helpers.support import environment

    conversion.convert_to_hf(cfg.checkpoint_path, run / "hf_model", overwrite=True)
    gpt, _ = checkpointing.load_model(cfg.checkpoint_path)
    device = next(gpt.parameters()).device
    hf = GPT2LMHeadModel.from_pretrained(run / "hf_model", dtype=torch.float32).to(device).eval()
    tokens = proofs.validation_tokens(run, 2)
    with torch.no_grad(), environment.ieee_fp32(device) as arithmetic:  # TF32 off: 06's proofs at 1e-4
        reference, converted = proofs.megatron_logits(gpt, tokens), proofs.hf_logits(hf, tokens)
        logits = proofs.compare_logits(reference, converted)
        loss = proofs.compare_validation_loss(run, hf, gpt)
    tok = tokenizer.load_tokenizer(cfg.tokenizer_path)
    prompt = tok.encode("import os\n\n\ndef main():\n    ")
    mc = generation.greedy_generate(gpt, prompt, max_new_tokens=GREEDY_TOKENS, eod_id=tok.eos_token_id)[len(prompt):]
    hf_ids = generation.greedy_generate_hf(hf, prompt, GREEDY_TOKENS)
    return ({"max_logit_difference": logits.max_abs_diff, "argmax_agreement": logits.argmax_agreement,
             "validation": {k: v for k, v in vars(loss).items() if isinstance(v, (int, float))},
             "greedy_tokens_equal": mc == hf_ids, "greedy_tokens": len(mc), "device": str(device),
             "arithmetic": arithmetic}, tokens,
            reference[..., :converted.shape[-1]])


def run(args: argparse.Namespace) -> dict[str, Any]:
    import torch

    from helpers.runner import data_stage, preflight
    from helpers.support import environment

    if not torch.cuda.is_available() and not args.cpu_smoke:
        raise SystemExit("could not run: CUDA is not available on this machine (the GPU check needs an NVIDIA GPU). "
                         "Nothing was made.")
    start, run_dir = time.perf_counter(), Path(args.run_dir).resolve()
    timings: dict[str, float] = {}
    data = data_stage.build_data(run_dir, vocab_size=1024 if args.cpu_smoke else 32768, package_files=args.package_files,
                                 max_files=80 if args.cpu_smoke else None, split="90,8,2" if args.cpu_smoke else None,
                                 progress=False)
    timings["data_s"] = time.perf_counter() - start
    t = time.perf_counter()
    cfg, res = _train(run_dir / "throughput", data, args.iters, args.cpu_smoke)
    timings["training_s"] = time.perf_counter() - t
    s, name = res.summary, torch.cuda.get_device_name() if torch.cuda.is_available() else "CPU (--cpu-smoke)"
    peak = preflight.peak_flops(name, args.peak_tflops)
    out: dict[str, Any] = {
        "gpu": name, "gpus": torch.cuda.device_count(), "peak_flops": peak, "precision": s["precision"], "smoke": args.cpu_smoke,
        "transformer_engine": environment.transformer_engine_version(), "optimizer": s["optimizer"],
        "iterations": s["iterations"], "tokens_per_s": s["tokens_per_s"], "flops_per_token": s["flops_per_token"],
        "mfu": s["tokens_per_s"] * s["flops_per_token"] / peak if peak else None,
        "final_train_loss": s["final_train_loss"], "parameters": s["parameters"], "seq_length": cfg.model.seq_length,
    }
    t = time.perf_counter()
    out["conversion"], tokens, reference = conversion_check(run_dir / "throughput", cfg)
    timings["conversion_s"] = time.perf_counter() - t
    t = time.perf_counter()
    out["tensor_parallel"] = (tensor_parallel_check(cfg.checkpoint_path, tokens, reference, cpu=args.cpu_smoke)
                              if torch.cuda.device_count() >= 2 or args.cpu_smoke else None)
    timings["tensor_parallel_s"] = time.perf_counter() - t
    out["timings"] = timings | {"total_s": time.perf_counter() - start}
    return out


def report(r: dict[str, Any]) -> str:
    """The summary table (markdown)."""
    conv, tp = r["conversion"], r["tensor_parallel"]
    mfu = f"{r['mfu']:.1%}" if r["mfu"] is not None else "n/a (GPU peak unknown: --peak-tflops)"
    rows = [
        ("GPU", f"{r['gpu']} x {r['gpus']}", ""),
        ("precision, TE, optimizer", f"{r['precision']}, TE {r['transformer_engine'] or 'absent'}, {r['optimizer']}", ""),
        (f"tokens/s ({r['parameters'] / 1e6:.1f}M parameters, seq {r['seq_length']})", f"{r['tokens_per_s']:,.0f}",
         "estimate 250k-400k on one H100 (the 110M model; llm.c: about 460k)"),
        ("MFU (the series' FLOPs per token: attention and logits counted)", mfu,
         "31 % at 400k tokens/s on 989 TFLOP/s"),
        ("TP=2 vs TP=1 (same checkpoint), max logit difference",
         "one GPU: not run" if tp is None else f"{tp['max_logit_difference']:.2e}", "< 1e-3 (fp32)"),
        ("conversion: max logit difference", f"{conv['max_logit_difference']:.2e}", "< 1e-3 (fp32 on the GPU)"),
        ("conversion: greedy tokens equal", str(conv["greedy_tokens_equal"]), "True"),
        ("time: data, training, TP, conversion, total (s)",
         ", ".join(f"{r['timings'][k]:.0f}" for k in ("data_s", "training_s", "tensor_parallel_s", "conversion_s", "total_s")), "<= 480 in all"),
    ]
    return common.markdown_table(["check", "measured", "target"], rows)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--run-dir", default="runs/gpu-check", help="folder for the data, runs and gpu_check.json")
    parser.add_argument("--iters", type=int, default=200, help="iterations of the gpu profile to time (default 200)")
    parser.add_argument("--package-files", type=int, default=0, help="notebook 01's package_files (default 0: stdlib only)")
    parser.add_argument("--peak-tflops", type=float, default=None, help="the GPU's peak dense bf16 TFLOP/s, if not listed")
    parser.add_argument("--cpu-smoke", action="store_true", help="a tiny model on the CPU: tests this script, measures nothing")
    args = parser.parse_args(argv)
    if args.iters < 2:
        parser.error(f"--iters {args.iters}: time at least 2 iterations (default 200)")
    if args.package_files < 0:
        parser.error(f"--package-files {args.package_files}: 0 (the standard library only) or more")
    if args.peak_tflops is not None and not args.peak_tflops > 0:
        parser.error(f"--peak-tflops {args.peak_tflops}: the GPU's peak dense bf16 TFLOP/s, a positive number")
    try:
        result = run(args)
    except SystemExit as err:
        print(err, file=sys.stderr)
        return 2
    path = Path(args.run_dir) / "gpu_check.json"
    path.write_text(json.dumps(result, indent=2, default=str) + "\n")
    print(report(result))
    print(f"written to {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
