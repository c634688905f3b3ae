"""``make gpu-smoke``: the series' GPU path in one prepared script of at most 5 minutes on one GPU.

Each step runs as its own process with its own time limit, so a failing step is recorded and the
next one still runs. The record goes to ``data/measured_gpu_run.json``, which the README and
notebook 03 quote when it exists. The steps:

1. **stack**: torch and CUDA, Transformer Engine, Apex's ``fused_weight_gradient_mlp_cuda`` and
   ``scaled_masked_softmax_cuda``, TF32's settings, the container's pip constraint file, and the
   target :func:`helpers.runner.megatron_args.probe_target` decides the flags from;
2. **notebook 00** on this machine (papermill; its all-reduce sized to the GPUs present);
3. **training and conversion** (:mod:`bench.gpu_check`): the ``gpu`` profile's Megatron-LM launch for
   ``--iters`` iterations (tokens/s, MFU), conversion on the GPU with notebook 06's proofs, TP=2 on 2 GPUs;
4. **the way back**: the converted transformers model back to a megatron-core checkpoint, trained on;
5. **a 2-process layout**: DP=2 against one process from the same weights (on 2 GPUs, or CPU ranks).

``--dry-run`` (``make gpu-smoke DRY_RUN=1``) prints the plan and imports nothing heavy; ``--cpu-smoke``
runs every step on a CPU with a tiny model (the test suite's check of this script; it measures nothing).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time
from datetime import datetime, timezone
from pathlib import Path

from helpers.support import environment  # the standard library only, at import

ROOT = Path(__file__).resolve().parents[1]
RECORD = ROOT / "data" / "measured_gpu_run.json"

STACK = r"""
import importlib.util, json, os, torch
from helpers.runner import megatron_args
found = lambda m: importlib.util.find_spec(m) is not None
te = None
if found("transformer_engine"):
    import transformer_engine
    te = getattr(transformer_engine, "__version__", "installed")
constraint = os.environ.get("PIP_CONSTRAINT") or None
print(json.dumps({
    "torch": torch.__version__, "cuda": torch.version.cuda, "gpus": torch.cuda.device_count(),
    "gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else None,
    "transformer_engine": te, "apex": found("apex"),
    "fused_weight_gradient_mlp_cuda": found("fused_weight_gradient_mlp_cuda"),
    "scaled_masked_softmax_cuda": found("scaled_masked_softmax_cuda"),
    "tf32_matmul": torch.backends.cuda.matmul.allow_tf32, "tf32_cudnn": torch.backends.cudnn.allow_tf32,
    "float32_matmul_precision": torch.get_float32_matmul_precision(),
    "tf32_overrides": {k: os.environ.get(k) for k in ("TORCH_ALLOW_TF32_CUBLAS_OVERRIDE", "NVIDIA_TF32_OVERRIDE")},
    "pip_constraint": constraint, "pip_constraint_exists": bool(constraint and os.path.isfile(constraint)),
    "ngc": os.environ.get("NVIDIA_PYTORCH_VERSION"), "target": megatron_args.probe_target().describe(),
}))
"""

WAY_BACK = r"""
import json, sys
from pathlib import Path
from helpers.demos import conversion_way_back as way_back
from helpers.runner import launch
run, out = Path(sys.argv[1]), Path(sys.argv[2])
way_back.hf_to_megatron_checkpoint(run / "hf_model", out / "from_transformers", overwrite=True)
cfg = way_back.continuation_config(run, out, int(sys.argv[3]))
res = launch.train(cfg, timeout_s=float(sys.argv[4]), progress=False)
print(json.dumps({"iterations": res.summary["iterations"], "final_train_loss": res.summary["final_train_loss"]}))
"""

LAYOUT = r"""
import json, sys
from dataclasses import replace
from pathlib import Path
from helpers.demos import layout_runs
from helpers.learn import model as model_lib
from helpers.learn.model import Layout
run, iters = Path(sys.argv[1]), int(sys.argv[2])
manifest = json.loads((run / "data" / "data_manifest.json").read_text())
vocab, split = manifest["tokenizer"]["vocab_size"], manifest["settings"]["split"]
tiny = replace(model_lib.PROFILES["cpu"], num_layers=2, hidden_size=64, num_attention_heads=4, seq_length=64,
               max_position_embeddings=64, vocab_size=vocab, hidden_dropout=0.0, attention_dropout=0.0)
base = layout_runs.comparison_config(run, model=tiny, micro_batch_size=2, global_batch_size=4, train_iters=iters,
                                     split=split, folder="gpu_smoke_layouts")
one = layout_runs.run_layout(base, Layout(1, 1, 1), progress=False, timeout_s=float(sys.argv[3]))
two = layout_runs.run_layout(base, Layout(1, 1, 2), progress=False, timeout_s=float(sys.argv[3]))
print(json.dumps({"layout": "DP=2 against 1 process", "losses_1": one.losses, "losses_2": two.losses,
                  "max_difference": max(abs(a - b) for a, b in zip(one.losses, two.losses))}))
"""


#: How much longer each step and launch may take with --cpu-smoke: 2 CPU cores, perhaps shared, run the tiny
#: model slower than a GPU runs the real one.
CPU_SLOWDOWN = 5


def plan(args: argparse.Namespace) -> list[dict]:
    """The steps: ``{"name", "argv", "timeout_s", "what"}``; the commands run from the repository root."""
    py, run = sys.executable, Path(args.run_dir).resolve()
    check = run / "check"
    smoke = ["--cpu-smoke"] if args.cpu_smoke else []
    slow = CPU_SLOWDOWN if args.cpu_smoke else 1  # each launch's own limit, as each step's
    return [
        {"name": "stack", "argv": [py, "-c", STACK], "timeout_s": 30,
         "what": "torch, CUDA, TE, Apex's extensions, TF32, PIP_CONSTRAINT, the probed target"},
        {"name": "notebook_00", "argv": [py, "-m", "helpers.runner.series", "run", "--only", "00", "--run-dir",
                                         str(run / "series"), "--profile", "smoke" if args.cpu_smoke else "gpu"],
         "timeout_s": 60, "what": "notebook 00 on this machine (its all-reduce over the GPUs present)"},
        {"name": "training_and_conversion", "argv": [py, "-m", "bench.gpu_check", "--iters", str(args.iters),
                                                      "--run-dir", str(check), *smoke], "timeout_s": 150,
         "ieee_fp32": True,  # the conversion proofs compare fp32 logits: TF32 off (environment.IEEE_FP32_ENV)
         "what": f"the gpu profile's Megatron-LM launch for {args.iters} iterations (tokens/s, MFU), conversion "
                 "on the GPU with 06's proofs, TP=2 when there are 2 GPUs"},
        {"name": "way_back", "argv": [py, "-c", WAY_BACK, str(check / "throughput"), str(run / "way_back"), "10", str(50 * slow)],
         "timeout_s": 60, "what": "transformers -> megatron-core checkpoint, trained on for 10 iterations"},
        {"name": "layout", "argv": [py, "-c", LAYOUT, str(check), "6", str(25 * slow)], "timeout_s": 60,
         "what": "DP=2 against one process from the same weights (6 iterations)"},
    ]


def _die_with_parent() -> None:
    """In the child, before exec: Linux sends it SIGKILL when this script dies (prctl PR_SET_PDEATHSIG)."""
    import ctypes

    ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)


def _run_step(step: dict) -> dict:
    """One step in its own process group, killed whole past its time limit; its last JSON line is its result."""
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "HELPERS_LAUNCHER_PID": str(os.getpid()),
           **(environment.IEEE_FP32_ENV if step.get("ieee_fp32") else {})}
    start = time.perf_counter()
    proc = subprocess.Popen(step["argv"], cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, start_new_session=True,
                            preexec_fn=_die_with_parent if sys.platform == "linux" else None)
    try:
        out, _ = proc.communicate(timeout=step["timeout_s"])
        timed_out = False
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate()
        timed_out = True
    except BaseException:
        os.killpg(proc.pid, signal.SIGKILL)
        raise
    lines = out.splitlines()
    result = None
    for line in reversed(lines):
        if line.startswith("{"):
            try:
                result = json.loads(line)
                break
            except json.JSONDecodeError:
                pass
    return {"ok": proc.returncode == 0 and not timed_out, "returncode": proc.returncode, "timed_out": timed_out,
            "wall_s": round(time.perf_counter() - start, 1), "result": result, "tail": lines[-15:]}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--dry-run", action="store_true", help="print the plan and exit (any machine)")
    parser.add_argument("--cpu-smoke", action="store_true", help="every step on a CPU with a tiny model: measures nothing")
    parser.add_argument("--iters", type=int, default=60, help="training iterations to time (default 60)")
    parser.add_argument("--budget-s", type=float, default=300.0,
                        help="the whole script's time limit (default 300 s): each step gets at most what is left")
    parser.add_argument("--run-dir", default="runs/gpu-smoke", help="folder for the smoke run's files")
    parser.add_argument("--record", default=str(RECORD), help="where the record goes (default data/measured_gpu_run.json)")
    args = parser.parse_args(argv)
    steps = plan(args)
    print(f"make gpu-smoke: {len(steps)} steps, at most {args.budget_s:.0f} s in all, into {args.record}")
    for i, s in enumerate(steps, 1):
        print(f"  {i}. {s['name']} (<= {s['timeout_s']} s): {s['what']}")
    if args.dry_run:
        print("dry run: nothing was started")
        return 0
    if not args.cpu_smoke:
        import torch

        if not torch.cuda.is_available():
            print("could not run: CUDA is not available here (make gpu-smoke needs an NVIDIA GPU; "
                  "DRY_RUN=1 prints the plan). Nothing was made.", file=sys.stderr)
            return 2
    record = {"date": datetime.now(timezone.utc).isoformat(timespec="seconds"), "cpu_smoke": args.cpu_smoke,
              "iters": args.iters, "steps": {}}
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # a kill reaches _run_step's clean-up: its group dies too
    deadline = time.monotonic() + args.budget_s
    for s in steps:
        left = deadline - time.monotonic()
        if left < 5:
            record["steps"][s["name"]] = {"ok": False, "skipped": f"the {args.budget_s:.0f} s budget was spent"}
            print(f"-- {s['name']}: skipped, the budget was spent")
            continue
        print(f"-- {s['name']} ...", flush=True)
        limit = s["timeout_s"] * (CPU_SLOWDOWN if args.cpu_smoke else 1)
        record["steps"][s["name"]] = r = _run_step({**s, "timeout_s": min(limit, left)})
        print(f"   {'ok' if r['ok'] else 'FAILED'} in {r['wall_s']} s: {r['result']}"[:400]
              + ("" if r["ok"] else "\n   " + "\n   ".join(r["tail"])))
    check = Path(args.run_dir).resolve() / "check" / "gpu_check.json"
    if check.is_file():
        record["gpu_check"] = json.loads(check.read_text())
    Path(args.record).parent.mkdir(parents=True, exist_ok=True)
    Path(args.record).write_text(json.dumps(record, indent=2, default=str) + "\n")
    failed = [n for n, r in record["steps"].items() if not r["ok"]]
    print(f"written to {args.record}; " + (f"failed: {', '.join(failed)}" if failed else "every step passed"))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
