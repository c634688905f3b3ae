"""helpers.training: batch arithmetic, LR schedule, weight-decay groups, bad input, a real
torchrun run whose loss falls, and kill-and-resume (SIGTERM and SIGKILL) that reproduces an
uninterrupted run bit for bit on CPU."""

from __future__ import annotations

import json
import math
import os
import signal
import socket
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from helpers import checkpointing, launch, metrics, optimizer, training, training_config

ROOT = Path(__file__).resolve().parent.parent
TINY_MODEL = dict(num_layers=2, hidden_size=64, num_attention_heads=4, seq_length=64, max_position_embeddings=64,
                  vocab_size=1024, hidden_dropout=0.1, attention_dropout=0.1)


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    """A small corpus (120 stdlib files, BPE of 1024) made by helpers.data_stage.build_data."""
    from helpers import data_stage

    run = tmp_path_factory.mktemp("train-data")
    return data_stage.build_data(run, max_files=120, vocab_size=1024, progress=False)


def tiny_config(data, run_dir, **overrides) -> training_config.TrainingConfig:
    """Dropout on (so RNG state matters for resume), 12 iterations of 2 micro-batches."""
    base = dict(model=dict(TINY_MODEL), data_prefix=str(data.data_prefix), tokenizer_dir=str(data.tokenizer_dir),
                split="90,8,2", micro_batch_size=4, global_batch_size=8, train_iters=12, lr_warmup_iters=2,
                log_interval=1, eval_interval=6, eval_iters=2, save_interval=4)
    base.update(overrides)
    return training_config.profile("cpu", str(run_dir), **base)


# --------------------------------------------------------------------------- pure functions
def test_num_microbatches_relates_global_micro_and_data_parallel():
    assert training_config.num_microbatches(192, 12, 8) == 2  # the guide: 8 GPUs -> accumulation 2
    assert training_config.num_microbatches(16, 8, 1) == 2
    assert training_config.num_microbatches(16, 4, 4) == 1
    with pytest.raises(ValueError, match=r"global_batch_size=10 is not divisible by micro_batch_size x data_parallel_size = 4 x 1"):
        training_config.num_microbatches(10, 4, 1)


def test_micro_batch_indices_follow_megatron_sampler():
    # global batch of 8 = 2 micro-batches x 2 samples x 2 data-parallel ranks, starting at sample 16
    assert training.micro_batch_indices(16, 2, 0, 2, 2) == [[16, 17], [20, 21]]
    assert training.micro_batch_indices(16, 2, 1, 2, 2) == [[18, 19], [22, 23]]
    every = sorted(i for r in range(2) for mb in training.micro_batch_indices(16, 2, r, 2, 2) for i in mb)
    assert every == list(range(16, 24))


def test_lr_schedule_is_linear_warmup_then_cosine_to_min():
    cfg = replace(training_config.PROFILES["cpu"], train_iters=100, lr=1e-3, min_lr=1e-4, lr_warmup_iters=10)
    lrs = optimizer.lr_schedule(cfg)
    assert len(lrs) == 100 and lrs[0] == 0.0
    assert math.isclose(lrs[5], 5e-4) and math.isclose(lrs[10], 1e-3)
    assert all(a >= b for a, b in zip(lrs[10:], lrs[11:]))
    assert math.isclose(lrs[55], 1e-4 + 0.5 * (1e-3 - 1e-4), rel_tol=1e-6)  # cosine half-way
    assert lrs[-1] < 1.01e-4 + 1e-6


def test_resumed_scheduler_follows_the_new_config_schedule():
    """A rerun with more train_iters must follow lr_schedule(new cfg), not the checkpoint's decay length."""
    old_cfg = training_config.TrainingConfig(train_iters=10, lr_warmup_iters=2, lr=1e-3, min_lr=1e-4)
    new_cfg = replace(old_cfg, train_iters=20)
    p = torch.nn.Parameter(torch.zeros(1))
    opt = torch.optim.SGD([{"params": [p], "wd_mult": 1.0}], lr=old_cfg.lr)
    old = optimizer.build_scheduler(opt, old_cfg)
    for _ in range(10):
        old.step(1)
    opt2 = torch.optim.SGD([{"params": [p], "wd_mult": 1.0}], lr=new_cfg.lr)
    resumed = optimizer.build_scheduler(opt2, new_cfg)
    resumed.load_state_dict(old.state_dict())
    expected = optimizer.lr_schedule(new_cfg)
    got = []
    for _ in range(10):
        got.append(opt2.param_groups[0]["lr"])
        resumed.step(1)
    assert got == pytest.approx(expected[10:])
    assert got[0] > new_cfg.min_lr


def test_evaluate_without_a_validation_set_is_skipped():
    """split '1,0,0' passes check() and builds no valid dataset; evaluation used to crash with
    TypeError: object of type 'NoneType' has no len() at iteration 0."""
    from types import SimpleNamespace

    trainer = SimpleNamespace(valid_ds=None, cfg=training_config.TrainingConfig(), model=None)
    assert training.evaluate(trainer) is None


def test_codeparrot_small_profile_is_the_guide():
    c = training_config.PROFILES["codeparrot-small"]
    assert (c.micro_batch_size, c.global_batch_size, c.lr, c.train_iters, c.lr_decay_iters, c.lr_warmup_iters,
            c.weight_decay, c.adam_beta2, c.clip_grad, c.seed, c.lr_decay_style, c.min_lr) == \
        (12, 192, 5e-4, 150_000, 150_000, 2000, 0.1, 0.999, 1.0, 1234, "cosine", 0.0)
    assert (c.log_interval, c.save_interval, c.eval_interval, c.eval_iters, c.split) == (10, 2000, 200, 10, "969,30,1")
    assert training_config.num_microbatches(c.global_batch_size, c.micro_batch_size, 8) == 2


def test_config_json_round_trip(tmp_path):
    cfg = training_config.profile("cpu", str(tmp_path), model={"num_layers": 3})
    again = training_config.TrainingConfig.from_json(cfg.to_json(tmp_path / "run.json"))
    assert again == cfg and again.model.num_layers == 3
    with pytest.raises(ValueError, match="unknown TrainingConfig keys"):
        training_config.TrainingConfig.from_dict({"train_iter": 5})


# --------------------------------------------------------------------------- bad input
def test_bad_input_is_a_clear_error(data, tmp_path):
    cfg = tiny_config(data, tmp_path)
    with pytest.raises(ValueError, match="not divisible by micro_batch_size x data_parallel_size = 4 x 2"):
        replace(cfg, global_batch_size=12).check(world_size=2)
    with pytest.raises(ValueError, match="test split 0 of"):  # 119 documents: "969,30,1" leaves no test document
        replace(cfg, split="969,30,1").check()
    with pytest.raises(ValueError, match="pipeline_model_parallel_size=3 is larger than num_layers=2"):
        replace(cfg, pipeline_model_parallel_size=3, global_batch_size=4, micro_batch_size=4).check(world_size=3)
    with pytest.raises(ValueError, match="tensor_model_parallel_size=3 does not divide num_attention_heads"):
        replace(cfg, tensor_model_parallel_size=3, global_batch_size=4, micro_batch_size=4).check(world_size=3)
    with pytest.raises(ValueError, match=r"lr=-0.001 must be positive"):  # blamed min_lr before
        replace(cfg, lr=-1e-3, min_lr=0.0).check()
    with pytest.raises(FileNotFoundError, match="no_such_prefix"):
        replace(cfg, data_prefix=str(tmp_path / "no_such_prefix")).check()
    with pytest.raises(ValueError, match="max_position_embeddings"):
        training_config.profile("cpu", str(tmp_path), model={**TINY_MODEL, "seq_length": 128})
    with pytest.raises(ValueError, match="tokenizer .* has 1024 entries"):
        training_config.profile("cpu", str(tmp_path), model={**TINY_MODEL, "vocab_size": 2000},
                         data_prefix=cfg.data_prefix, tokenizer_dir=cfg.tokenizer_dir, split=cfg.split).check()
    with pytest.raises(ValueError, match="needs a CUDA GPU") if not torch.cuda.is_available() else _nothing():
        replace(cfg, precision="bf16").check()


class _nothing:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def test_port_in_use_is_a_clear_error(data, tmp_path):
    from helpers.launch import LaunchError

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        with pytest.raises(LaunchError, match=f"master_port={port} is already in use"):
            launch.train(tiny_config(data, tmp_path), master_port=port, progress=False)


# --------------------------------------------------------------------------- real runs
def _start(config_path: Path, *extra: str) -> subprocess.Popen:
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")}
    env.update(PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))
    return subprocess.Popen([sys.executable, "-m", "helpers.training", "--config", str(config_path), *extra],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env,
                            cwd=ROOT, start_new_session=True)


def _wait_for(proc: subprocess.Popen, text: str, timeout_s: float = 120) -> list[str]:
    lines, deadline = [], time.monotonic() + timeout_s
    for line in proc.stdout:
        lines.append(line)
        if text in line:
            return lines
        if time.monotonic() > deadline:
            break
    os.killpg(proc.pid, signal.SIGKILL)
    raise AssertionError(f"never saw {text!r}; output:\n{''.join(lines[-30:])}")


def _finish(proc: subprocess.Popen, timeout_s: float = 120) -> str:
    try:
        out, _ = proc.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        raise
    return out


def _train_losses(cfg) -> dict[int, float]:
    return {r["iteration"]: r["lm_loss"] for r in metrics.read_metrics(cfg.metrics_file)["train"]}


@pytest.fixture(scope="module")
def uninterrupted(data, tmp_path_factory):
    """The reference run, launched the notebook's way: torchrun through launch.train."""
    cfg = tiny_config(data, tmp_path_factory.mktemp("run-a"))
    result = launch.train(cfg, nproc_per_node=1, timeout_s=300, progress=False, env={"OMP_NUM_THREADS": "1"})
    return cfg, result


def test_torchrun_training_loss_falls_and_records_everything(uninterrupted):
    cfg, result = uninterrupted
    s = result.summary
    assert s["iterations"] == 12 and s["completed"] and s["parameters"] == cfg.model.to_metadata()["num_parameters"]
    assert s["final_valid_loss"] < s["first_valid_loss"] - 0.1
    assert s["optimizer"].startswith("torch.optim.AdamW") and s["precision"] == "fp32"
    assert s["tokens_per_s"] > 0 and Path(s["checkpoint_path"]).name == "iter_0000012"
    train = result.metrics["train"]
    assert [r["iteration"] for r in train] == list(range(1, 13))
    assert all(math.isfinite(r["grad_norm"]) and r["lr"] >= 0 for r in train)
    assert [r["iteration"] for r in result.metrics["valid"]] == [0, 6, 12]
    assert checkpointing.latest_iteration(cfg.checkpoint_path) == 12
    assert sorted(p.name for p in cfg.checkpoint_path.glob("iter_*")) == ["iter_0000004", "iter_0000008", "iter_0000012"]
    meta = checkpointing.read_model_config(cfg.checkpoint_path)
    assert meta["gelu"] == "erf" and meta["tied_embeddings"] is True and meta["padded_vocab_size"] == 1024
    assert any(p.name.startswith("events.out.tfevents") for p in cfg.tensorboard_path.iterdir())
    again = launch.train(cfg, nproc_per_node=1, progress=False)  # cached: nothing to do
    assert again.skipped and again.summary == s
    assert launch.train(replace(cfg, log_interval=3), progress=False).skipped  # logging changes no weights
    with pytest.raises(ValueError, match=r"already holds a finished run \(train_iters=12\) trained with other "
                                         r"settings \(lr: 0.002 -> 0.001\)"):
        launch.train(replace(cfg, lr=1e-3), progress=False)  # a breaker saw 03 show the old run as the new one's


def test_kill_and_resume_is_bit_identical(uninterrupted, data, tmp_path):
    """SIGTERM (saves, exits), SIGKILL (loses work since the last save), resume each time:
    every logged loss equals the uninterrupted run's, and so does the final checkpoint."""
    ref_cfg, _ = uninterrupted
    cfg = tiny_config(data, tmp_path)
    path = cfg.to_json(tmp_path / "run.json")

    proc = _start(path)
    _wait_for(proc, "saved checkpoint at iteration        4")
    proc.send_signal(signal.SIGTERM)
    out = _finish(proc)
    assert proc.returncode == 0, out
    assert "exiting at iteration" in out and "on signal 15" in out
    stopped = checkpointing.latest_iteration(cfg.checkpoint_path)
    assert 4 <= stopped < 12

    proc = _start(path)
    _wait_for(proc, f"resumed from checkpoint at iteration {stopped}")
    _wait_for(proc, f"iteration {stopped + 2:8d}/")
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait(timeout=30)
    killed_at = checkpointing.latest_iteration(cfg.checkpoint_path)
    assert killed_at >= stopped

    proc = _start(path)
    out = _finish(proc)
    assert proc.returncode == 0, out
    assert f"resumed from checkpoint at iteration {killed_at}" in out
    assert _train_losses(cfg) == _train_losses(ref_cfg)  # bit-identical, every iteration
    valid = lambda c: [(r["iteration"], r["lm_loss"]) for r in metrics.read_metrics(c.metrics_file)["valid"]]
    assert valid(cfg) == valid(ref_cfg)

    # A different model shape refuses to resume and leaves the checkpoint untouched.
    before = {p: p.stat().st_mtime_ns for p in cfg.checkpoint_path.rglob("*")}
    wrong = replace(cfg, model=replace(cfg.model, hidden_size=128), train_iters=16)
    with pytest.raises(checkpointing.CheckpointMismatchError, match="hidden_size: checkpoint 64 vs config 128"):
        launch.train(wrong, progress=False)  # refused before any process starts
    proc = _start(wrong.to_json(tmp_path / "wrong.json"))
    out = _finish(proc)
    assert proc.returncode != 0 and "different model shape" in out and "hidden_size" in out
    assert {p: p.stat().st_mtime_ns for p in cfg.checkpoint_path.rglob("*")} == before


@pytest.mark.gpu
def test_codeparrot_small_trains_on_cuda_in_bf16(data, tmp_path):
    """A few iterations of the guide's model on one GPU in bf16; prints tokens/s and MFU."""
    cfg = training_config.profile("codeparrot-small", str(tmp_path), model={"vocab_size": 1024},
                           data_prefix=str(data.data_prefix), tokenizer_dir=str(data.tokenizer_dir),
                           split="90,8,2", train_iters=6, log_interval=2, eval_interval=6, eval_iters=1,
                           save_interval=None)
    result = launch.train(cfg, nproc_per_node=1, timeout_s=900, progress=False)
    s = result.summary
    assert s["precision"] == "bf16" and s["iterations"] == 6 and math.isfinite(s["final_train_loss"])
    peak = float(os.environ.get("GPU_PEAK_TFLOPS", "989"))  # H100/H200 dense bf16
    mfu = s["tokens_per_s"] * s["flops_per_token"] / (peak * 1e12)
    print(f"codeparrot-small bf16: {s['tokens_per_s']:.0f} tokens/s, MFU {mfu:.1%} of {peak} TFLOP/s, "
          f"optimizer {s['optimizer']}")
    assert 0 < mfu < 1


@pytest.mark.slow
def test_03_results_in_the_smoke_series(series_run):
    """Notebook 03 in the series (smoke profile): trained, loss fell, checkpoint and figure exist."""
    run_dir, _, summary = series_run
    s = summary["03_training"]
    assert s["iterations"] == 12 and s["final_valid_loss"] < s["first_valid_loss"]
    assert s["parameters"] > 0 and s["flops_per_token"] > 6 * s["parameters"] * 0.5
    assert s["optimizer"].startswith(("torch.optim.AdamW", "apex"))
    assert Path(s["checkpoint_path"]).is_dir() and (Path(s["checkpoint_path"]) / "model_config.json").exists()
    assert (Path(run_dir) / "figures" / "03_loss_and_lr.png").stat().st_size > 10_000
    assert isinstance(s["greedy_sample"], str) and s["greedy_sample"].startswith("import os")
    assert s["training_samples"] == 2  # sample_interval=6 in the smoke profile: iterations 6 and 12
    # Section 5's loop in cells and the torchrun script: the same losses, bit for bit (1 process, fp32).
    assert s["cells_vs_script_loss_difference"] == 0.0
    assert s["cells_vs_script_grad_norm_difference"] == 0.0
    assert s["cells_checkpoint_logits_identical"] is True


def test_non_finite_or_absurd_floats_are_refused_before_anything_starts(data, tmp_path):
    """-p lr=1e400 reads as inf; it used to pass every check and train to 'lm loss: NAN' (issue 13)."""
    cfg = tiny_config(data, tmp_path)
    for bad, match in ((dict(lr=float("inf")), r"lr=inf is not a finite number"),
                       (dict(min_lr=float("nan")), r"min_lr=nan is not a finite number"),
                       (dict(lr=5.0), r"lr=5.0 is above 1"), (dict(adam_beta2=1.0), r"adam_beta2=1.0 must be in \[0, 1\)"),
                       (dict(adam_eps=0.0), "adam_eps=0.0 must be positive"), (dict(clip_grad=-1.0), "clip_grad=-1.0 must be >= 0"),
                       (dict(model=replace(cfg.model, init_method_std=float("inf"))), r"model.init_method_std=inf")):
        with pytest.raises(ValueError, match=match):
            replace(cfg, **bad).check()


def test_a_non_finite_loss_or_grad_norm_stops_before_the_optimizer_step():
    from types import SimpleNamespace

    trainer = SimpleNamespace(iteration=41, grad_scaler=None)
    training._stop_on_non_finite(trainer, 2.5, 1.0, 1e-3)  # finite: nothing happens
    training._stop_on_non_finite(trainer, None, 1.0, 1e-3)  # not the last pipeline stage: no loss here
    with pytest.raises(FloatingPointError, match=r"iteration 42: lm loss nan, grad norm 1.0 .*last checkpoint is intact"):
        training._stop_on_non_finite(trainer, float("nan"), 1.0, 1e-3)
    with pytest.raises(FloatingPointError, match=r"grad norm inf"):
        training._stop_on_non_finite(trainer, 3.0, float("inf"), 1e-3)
    training._stop_on_non_finite(SimpleNamespace(iteration=1, grad_scaler=object()), 3.0, float("inf"), 1e-3)  # fp16: the scaler skips


def test_a_resume_with_another_lr_schedule_is_refused_unless_told_which_to_follow():
    """Rerunning 03 with train_iters=400 stretched the cosine and the lr jumped from 2.0e-4 back to
    1.1e-3 (issue 13); Megatron-LM refuses unless --override-opt_param-scheduler or
    --use-checkpoint-opt_param-scheduler says which schedule to follow."""
    old = training_config.TrainingConfig(train_iters=200, lr_warmup_iters=20)
    saved = {"lr_schedule": old.lr_schedule_settings()}
    assert training_config.check_resume_schedule(replace(old, seed=7), saved) is None  # same schedule
    assert training_config.check_resume_schedule(old, {}) is None  # a checkpoint that records none
    longer = replace(old, train_iters=400)
    with pytest.raises(ValueError, match=r"lr_decay_iters 200 -> 400.*override_opt_param_scheduler=True.*"
                                         r"use_checkpoint_opt_param_scheduler=True"):
        training_config.check_resume_schedule(longer, saved)
    assert training_config.check_resume_schedule(replace(longer, override_opt_param_scheduler=True), saved) is None
    assert training_config.check_resume_schedule(replace(longer, use_checkpoint_opt_param_scheduler=True),
                                                 saved) == old.lr_schedule_settings()
    with pytest.raises(ValueError, match="choose one"):
        replace(longer, override_opt_param_scheduler=True, use_checkpoint_opt_param_scheduler=True).check()


def test_samples_during_training_leave_the_losses_unchanged(uninterrupted, data, tmp_path):
    """Issue 16: a sample every sample_interval iterations (temperature 0.8, top-k 50, its own
    seeded generator), as nanoGPT prints them; the training RNG is untouched, so every loss
    equals the run without samples, bit for bit."""
    ref_cfg, _ = uninterrupted
    cfg = tiny_config(data, tmp_path, sample_interval=6, sample_tokens=12)
    result = launch.train(cfg, nproc_per_node=1, timeout_s=300, progress=False, env={"OMP_NUM_THREADS": "1"})
    samples = result.metrics["sample"]
    assert [r["iteration"] for r in samples] == [6, 12]
    assert all(r["text"].startswith("def ") and len(r["text"]) > len("def ") for r in samples)
    assert any(line.startswith(" sample at iteration 6: 'def ") for line in result.log)
    assert _train_losses(cfg) == _train_losses(ref_cfg)
    with pytest.raises(ValueError, match="sample_interval=-1 must be >= 0"):
        replace(cfg, sample_interval=-1).check()
