"""CPU throughput levers for the cpu profile: bf16 autocast, torch.compile and thread count.

Each lever is measured on one training step of the cpu profile's model shape
(``helpers.learn.model.profile("cpu")``: notebook 03's model, micro-batch 4), built as
transformers' ``GPT2LMHeadModel`` (the converted form of the same model; megatron-core's
``GPTModel`` enters autocast only on CUDA in this series), forward + backward + AdamW, in one
process with the sides interleaved (A B A B ...) and the median of the timed steps reported:

* ``fp32`` on ``--threads`` threads (the series' setting), and on 1 thread;
* ``bf16 autocast``: ``torch.autocast("cpu", dtype=torch.bfloat16)`` around forward and loss,
  fp32 master weights, as mixed precision runs on GPUs. It pays only where the CPU multiplies
  bf16 in hardware (AVX512-BF16 or AMX, reported from ``/proc/cpuinfo``); elsewhere torch
  converts to fp32 and back around every product;
* ``torch.compile``: the model compiled with the default inductor backend; the compile time
  (first steps) is reported apart from the step time, since a 2-3 minute run must pay it.

Also the matrix product at the step's largest shape (the output layer: ``[b*s, h] x [h, V]``)
in fp32 and bf16, in GFLOP/s, which is what decides the bf16 question.

Run (from the repository root)::

    python -m bench.levers                 # about 2-4 minutes on 2 cores
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path
from typing import Any, Callable

from bench import common


def cpu_flags() -> set[str]:
    """The CPU feature flags of ``/proc/cpuinfo`` that matter for bf16 (empty where unreadable)."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return set()
    flags = next((line.split(":", 1)[1].split() for line in text.splitlines() if line.startswith("flags")), [])
    return {f for f in flags if "bf16" in f or f.startswith("amx") or f == "avx512f"}


def matmul_gflops(dtype, m: int, k: int, n: int, repeats: int = 10) -> float:
    import torch

    a, b = torch.randn(m, k, dtype=dtype), torch.randn(k, n, dtype=dtype)
    a @ b
    t0 = time.perf_counter()
    for _ in range(repeats):
        a @ b
    return 2 * m * k * n * repeats / (time.perf_counter() - t0) / 1e9


def make_step(kind: str, shape, seed: int = 1234) -> Callable[[], float]:
    """A training step of model ``shape`` (a ``helpers.learn.model.ModelConfig``) for side ``kind`` (fp32, bf16, compile)."""
    import torch
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(seed)
    cfg = GPT2Config(vocab_size=shape.vocab_size, n_positions=shape.seq_length, n_embd=shape.hidden_size,
                     n_layer=shape.num_layers, n_head=shape.num_attention_heads, bos_token_id=0, eos_token_id=0,
                     resid_pdrop=0.0, embd_pdrop=0.0,
                     attn_pdrop=0.0)
    model = GPT2LMHeadModel(cfg).train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    run = torch.compile(model) if kind == "compile" else model
    tokens = torch.randint(0, shape.vocab_size, (4, shape.seq_length), generator=torch.Generator().manual_seed(seed))

    def step() -> float:
        t0 = time.perf_counter()
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=kind == "bf16"):
            loss = run(tokens, labels=tokens).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return time.perf_counter() - t0

    return step


def main(argv: list[str] | None = None) -> int:
    import torch

    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--steps", type=int, default=8, help="timed steps per side and round")
    parser.add_argument("--rounds", type=int, default=2, help="interleaved rounds")
    parser.add_argument("--json", default="runs/bench/bench_levers.json")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    load_before = common.load_average()
    result: dict[str, Any] = {"machine": common.machine_info(), "cpu_flags": sorted(cpu_flags()), "threads": args.threads}
    from helpers.learn import model as model_mod

    shape = model_mod.profile("cpu")
    m, k, n = 4 * shape.seq_length, shape.hidden_size, shape.vocab_size
    result["matmul_gflops"] = {"fp32": matmul_gflops(torch.float32, m, k, n), "bf16": matmul_gflops(torch.bfloat16, m, k, n)}
    sides = {name: make_step(kind, shape) for name, kind in (("fp32", "fp32"), ("bf16 autocast", "bf16"),
                                                              ("torch.compile", "compile"))}
    t0 = time.perf_counter()
    for _ in range(3):
        sides["torch.compile"]()  # compiles forward and backward
    result["compile_s"] = time.perf_counter() - t0
    for fn in sides.values():
        fn()  # warm up
    times: dict[str, list[float]] = {name: [] for name in [*sides, "fp32, 1 thread"]}
    for _ in range(args.rounds):
        for name, fn in sides.items():
            times[name] += [fn() for _ in range(args.steps)]
        torch.set_num_threads(1)
        times["fp32, 1 thread"] += [sides["fp32"]() for _ in range(args.steps)]
        torch.set_num_threads(args.threads)
    result["s_per_step"] = {name: statistics.median(ts) for name, ts in times.items()}
    result["load_average"] = {"before": load_before, "after": common.load_average()}
    base = result["s_per_step"]["fp32"]
    print(f"CPU bf16 features: {result['cpu_flags'] or 'none'}; {args.threads} threads; "
          f"load {load_before[0]:.2f} -> {result['load_average']['after'][0]:.2f}")
    print(f"matmul [{m}x{k}] x [{k}x{n}]: fp32 {result['matmul_gflops']['fp32']:.1f} GFLOP/s, "
          f"bf16 {result['matmul_gflops']['bf16']:.1f} GFLOP/s")
    print(common.markdown_table(["side", f"s per step (micro-batch 4 x {shape.seq_length} tokens)", "speed-up over fp32"],
                                [[name, s, base / s] for name, s in result["s_per_step"].items()]))
    print(f"torch.compile: {result['compile_s']:.1f} s for its first 3 steps (compilation)")
    common.write_json(args.json, result)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
