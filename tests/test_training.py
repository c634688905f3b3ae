"""Training with Megatron-LM's own loop (helpers.learn.pretrain_gpt, launched by helpers.runner.launch.train):
the generated flags are Megatron-LM's, a real run's loss falls and everything is recorded,
notebook 03's megatron-core loop (helpers.demos.core_loop) gives the same weights bit for bit,
kill-and-resume (SIGTERM and SIGKILL) reproduces an uninterrupted run bit for bit, the
checkpoint converts to transformers exactly, and Megatron-LM's checks (NaN, a resume with
another schedule) stop a run with their message."""

from __future__ import annotations

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

from helpers.learn import checkpointing, training_config
from helpers.runner import launch, megatron_args, metrics
from helpers.support import run_guard

pytestmark = pytest.mark.trains

ROOT = Path(__file__).resolve().parent.parent
TINY_MODEL = dict(num_layers=2, hidden_size=64, num_attention_heads=4, seq_length=64, max_position_embeddings=64,
                  vocab_size=1024)


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    """A small corpus (120 stdlib files, BPE of 1024) made by helpers.runner.data_stage.build_data."""
    from helpers.runner import data_stage

    run = tmp_path_factory.mktemp("train-data")
    return data_stage.build_data(run, max_files=120, vocab_size=1024, progress=False)


def tiny_config(data, run_dir, **overrides) -> training_config.TrainingConfig:
    """12 iterations of 2 micro-batches, a checkpoint every 4, an evaluation every 6."""
    base = dict(model=dict(TINY_MODEL), data_prefix=str(data.data_prefix), tokenizer_dir=str(data.tokenizer_dir),
                split="90,8,2", micro_batch_size=4, global_batch_size=8, train_iters=12, lr_warmup_iters=2,
                log_interval=1, eval_interval=6, eval_iters=2, save_interval=4)
    base.update(overrides)
    return training_config.profile("cpu", str(run_dir), **base)


# --------------------------------------------------------------------------- pure functions
def test_num_microbatches_relates_global_micro_and_data_parallel():
    assert training_config.num_microbatches(192, 12, 8) == 2  # the guide: 8 GPUs -> accumulation 2
    assert training_config.num_microbatches(16, 8, 1) == 2
    with pytest.raises(ValueError, match="not divisible"):
        training_config.num_microbatches(10, 4, 1)


def test_micro_batch_indices_follow_megatrons_sampler():
    from helpers.learn import dataloader

    # global batch 8 = micro 2 x DP 2 x 2 accumulation steps, resuming at sample 16
    assert dataloader.micro_batch_indices(16, 2, 1, 2, 2) == [[18, 19], [22, 23]]
    assert dataloader.micro_batch_indices(0, 4, 0, 1, 2) == [[0, 1, 2, 3], [4, 5, 6, 7]]


def test_lr_schedule_is_linear_warmup_then_cosine_to_min():
    from helpers.learn import optimizer

    cfg = training_config.TrainingConfig(train_iters=100, lr_warmup_iters=10, lr=1e-3, min_lr=1e-4)
    lrs = optimizer.lr_schedule(cfg)
    assert len(lrs) == 101 and lrs[0] == 0.0 and lrs[5] == pytest.approx(5e-4) and lrs[10] == pytest.approx(1e-3)
    assert lrs[55] == pytest.approx(1e-4 + 0.5 * 9e-4, rel=1e-6)  # cosine half-way
    assert lrs[100] == pytest.approx(1e-4)


def test_codeparrot_small_profile_is_the_guide():
    c = training_config.PROFILES["codeparrot-small"]
    assert (c.micro_batch_size, c.global_batch_size, c.lr, c.train_iters, c.lr_decay_iters, c.lr_warmup_iters,
            c.weight_decay, c.adam_beta2, c.clip_grad, c.seed, c.lr_decay_style, c.min_lr) == \
        (12, 192, 5e-4, 150_000, 150_000, 2000, 0.1, 0.999, 1.0, 1234, "cosine", 0.0)
    assert (c.log_interval, c.save_interval, c.eval_interval, c.eval_iters, c.split) == (10, 2000, 200, 10, "969,30,1")


# --------------------------------------------------------------------------- the command line
def _parse(argv: list[str]):
    """Megatron-LM's own parser (``megatron.training.arguments.parse_args``) on ``argv``."""
    from megatron.training.arguments import parse_args

    saved = sys.argv
    sys.argv = ["pretrain_gpt.py", *argv]
    try:
        return parse_args()
    finally:
        sys.argv = saved


@pytest.mark.parametrize("cpu", [True, False], ids=["for-a-cpu", "for-gpus"])
def test_every_generated_flag_is_megatron_lms_own(cpu, tmp_path):
    """The flags parse with Megatron-LM's parser and carry the config's values (a wrong name would
    fail to parse: argparse refuses unknown flags)."""
    cfg = training_config.PROFILES["codeparrot-small"]
    cfg = replace(cfg, run_dir=str(tmp_path), precision="fp32" if cpu else "auto")
    args = _parse(megatron_args.arguments(cfg, cpu=cpu))
    assert (args.num_layers, args.hidden_size, args.num_attention_heads, args.seq_length) == (12, 768, 12, 1024)
    assert (args.micro_batch_size, args.global_batch_size, args.lr, args.train_iters) == (12, 192, 5e-4, 150_000)
    assert (args.lr_decay_style, args.lr_warmup_iters, args.weight_decay, args.split) == ("cosine", 2000, 0.1, "969,30,1")
    assert (args.hidden_dropout, args.layernorm_epsilon, args.tokenizer_type) == (0.1, 1e-5, "HuggingFaceTokenizer")
    assert args.save == args.load == str(cfg.checkpoint_path) and args.data_path == [str(cfg.data_prefix_path)]
    assert args.bias_gelu_fusion is True and args.exit_signal_handler is True
    assert (args.distributed_backend, args.transformer_impl, args.num_workers) == \
        (("gloo", "local", 0) if cpu else ("nccl", "transformer_engine", 2))
    tiny = replace(cfg, model=replace(cfg.model, bias_activation_fusion=False, share_embeddings_and_output_weights=False))
    args = _parse(megatron_args.arguments(tiny, cpu=cpu))
    assert args.bias_gelu_fusion is False and args.untie_embeddings_and_output_weights is True


def test_the_flag_table_sets_the_guides_2022_command_beside_todays(tmp_path):
    rows = megatron_args.flag_table(training_config.profile("cpu", str(tmp_path)), cpu=True)
    by_flag = {r["today"]: r for r in rows if r["today"]}
    assert by_flag["--num-layers"]["the guide (2022)"] == "--num-layers 12" and by_flag["--num-layers"]["change"] == "same"
    assert by_flag["--tokenizer-type"]["the guide (2022)"].startswith("--vocab-file")
    assert by_flag["--tokenizer-model"]["the guide (2022)"].startswith("--merge-file")
    assert by_flag["--norm-epsilon"]["change"] == "new" and by_flag["--distributed-backend"]["change"] == "CPU only"
    guide_flags = {r["the guide (2022)"].split()[0] for r in rows if r["the guide (2022)"]}
    assert guide_flags == set(megatron_args.GUIDE_2022), "every flag of the guide has a row"
    assert [r["the guide (2022)"] for r in rows if r["change"] == "not used"] == ["--fp16"]  # fp32 on a CPU
    text = megatron_args.shell_command(training_config.profile("cpu", str(tmp_path)), script="pretrain_gpt.py", cpu=True)
    assert text.startswith("# written for target cpu: no GPU (gloo, megatron-core's local layers, fp32)\n"
                           "CUDA_DEVICE_MAX_CONNECTIONS=1 torchrun --nproc-per-node=1 pretrain_gpt.py \\\n")
    assert "    --num-layers 4 \\\n" in text and text.rstrip().endswith("--num-workers 0")


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
    with pytest.raises(ValueError, match=r"lr=-0.001 must be positive"):
        replace(cfg, lr=-1e-3, min_lr=0.0).check()
    with pytest.raises(FileNotFoundError, match="no_such_prefix"):
        replace(cfg, data_prefix=str(tmp_path / "no_such_prefix")).check()
    with pytest.raises(FileNotFoundError, match="pretrained_checkpoint=.*holds no checkpoint"):
        replace(cfg, pretrained_checkpoint=str(tmp_path)).check()
    with pytest.raises(ValueError, match="max_position_embeddings"):
        training_config.profile("cpu", str(tmp_path), model={**TINY_MODEL, "seq_length": 128})
    with pytest.raises(ValueError, match="tokenizer .* has 1024 entries"):
        training_config.profile("cpu", str(tmp_path), model={**TINY_MODEL, "vocab_size": 2000},
                                data_prefix=cfg.data_prefix, tokenizer_dir=cfg.tokenizer_dir, split=cfg.split).check()
    if not torch.cuda.is_available():  # a bf16 config may be written here for a GPU; running it here is refused
        replace(cfg, precision="bf16").check()
        from helpers.runner import preflight

        with pytest.raises(ValueError, match="needs a CUDA GPU"):
            preflight.check_run(replace(cfg, precision="bf16"), nproc=1)
        with pytest.raises(ValueError, match="needs a CUDA GPU, and target cpu: no GPU"):
            megatron_args.arguments(replace(cfg, precision="bf16"), target="cpu")
    with pytest.raises(ValueError, match="precision='bf17': choose auto, fp32, bf16 or fp16"):
        replace(cfg, precision="bf17").check()
    for bad, match in ((dict(lr=float("inf")), r"lr=inf is not a finite number"), (dict(lr=5.0), r"lr=5.0 is above 1"),
                       (dict(adam_beta2=1.0), r"adam_beta2=1.0 must be in \[0, 1\)"),
                       (dict(model=replace(cfg.model, init_method_std=float("inf"))), r"model.init_method_std=inf")):
        with pytest.raises(ValueError, match=match):
            replace(cfg, **bad).check()
    with pytest.raises(ValueError, match="choose one"):
        replace(cfg, override_opt_param_scheduler=True, use_checkpoint_opt_param_scheduler=True).check()


def test_run_json_of_an_earlier_version_reads_without_its_retired_fields(tmp_path):
    cfg = training_config.profile("cpu", str(tmp_path), model={"num_layers": 3})
    old = {**cfg.to_dict(), "sample_interval": 200, "sample_prompt": "def ", "sample_tokens": 48, "use_megatron_ddp": True}
    assert training_config.TrainingConfig.from_dict(old) == cfg
    with pytest.raises(ValueError, match="unknown TrainingConfig keys"):
        training_config.TrainingConfig.from_dict({"train_iter": 5})


def test_port_in_use_is_a_clear_error(data, tmp_path):
    from helpers.runner.launch import LaunchError

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        with pytest.raises(LaunchError, match=f"master_port={port} is already in use"):
            launch.train(tiny_config(data, tmp_path), master_port=port, progress=False)


# --------------------------------------------------------------------------- real runs
def _losses(cfg) -> dict[int, float]:
    return {r["iteration"]: r["lm_loss"] for r in metrics.read_metrics(cfg.metrics_file)["iteration"]}


def _weights(cfg, iteration: int) -> dict[str, torch.Tensor]:
    tensors, _ = checkpointing.read_model_tensors(checkpointing.iteration_dir(cfg.checkpoint_path, iteration))
    return tensors


@pytest.fixture(scope="module")
def uninterrupted(data, tmp_path_factory):
    """The reference run, launched the notebook's way: Megatron-LM's loop under torchrun, through launch.train."""
    cfg = tiny_config(data, tmp_path_factory.mktemp("run-a"))
    result = launch.train(cfg, nproc_per_node=1, timeout_s=300, progress=False, env={"OMP_NUM_THREADS": "1"})
    return cfg, result


@pytest.mark.parametrize("recompute", ["selective", "full"])
def test_activation_recomputation_trains_the_same_losses_and_gradients(uninterrupted, data, tmp_path, recompute):
    """Issue 29, first step: recomputing activations in backward (Megatron-LM's --recompute-activations, or
    --recompute-granularity full) repeats the forward's arithmetic, so every loss and gradient norm equals the
    reference run's exactly; only memory and time change. Recorded by helpers.learn.rank_record (notebook 05b's
    probe), which changes nothing either: the run held the states the calculator predicts, and the activations."""
    from helpers.learn import memory, rank_record
    from helpers.learn import model as model_lib
    from helpers.runner import megatron_args

    cfg = tiny_config(data, tmp_path / recompute, recompute=recompute)
    flags = megatron_args.arguments(cfg, cpu=True)
    assert ("--recompute-activations" in flags) == (recompute == "selective")
    assert (flags[flags.index("--recompute-granularity") + 1] == "full") if recompute == "full" else "--recompute-granularity" not in flags
    result = launch.train(cfg, nproc_per_node=1, timeout_s=300, progress=False,
                          env={"OMP_NUM_THREADS": "1", rank_record.ENV: str(tmp_path / "ranks")})
    ours = [(r["iteration"], r["lm_loss"], r["grad_norm"]) for r in result.metrics["iteration"]]
    reference = [(r["iteration"], r["lm_loss"], r["grad_norm"]) for r in uninterrupted[1].metrics["iteration"]]
    assert len(ours) == 12 and ours == reference
    (rec,) = rank_record.read(tmp_path / "ranks")
    n = result.summary["parameters"]
    assert rec["parameters"] == n and rec["weights"] == 4 * n and rec["gradient_values"] == 4 * n <= rec["gradients"]
    steps = rec["optimizer_state"] - 8 * n  # Adam's moments, 8 bytes per parameter, and a 4-byte step per tensor
    assert 0 < steps <= 4 * 64 and steps % 4 == 0
    assert [e["kind"] for e in rec["events"] if e["iteration"] == 12] == ["forward", "backward"] * 2  # 2 micro-batches
    predicted = memory.memory_per_gpu(cfg.model, model_lib.Layout(1, 1, 1), micro_batch_size=4, num_microbatches=2, precision="fp32",
                                      recompute=recompute, fused=False).activations
    assert rank_record.activation_peak(rec)["bytes"] == pytest.approx(predicted, rel=0.02)
    with pytest.raises(ValueError, match="recompute='some': choose one of 'none', 'selective', 'full'"):
        tiny_config(data, tmp_path / "bad", recompute="some").check(world_size=1)


def test_the_distributed_optimizer_on_two_ranks_trains_what_one_process_trains(uninterrupted, data, tmp_path):
    """Issue 29: --use-distributed-optimizer (ZeRO-1) over gloo, DP=2: the gradients are reduce-scattered, each
    rank keeps and steps half the optimizer state, the weights are all-gathered; every loss and gradient norm
    equals the one-process run's (this small model's sums come out the same in either order of addition)."""
    from helpers.runner import megatron_args

    cfg = tiny_config(data, tmp_path / "zero1", use_distributed_optimizer=True)
    assert "--use-distributed-optimizer" in megatron_args.arguments(cfg, cpu=True)
    result = launch.train(cfg, nproc_per_node=2, timeout_s=300, progress=False)
    assert "Using reduce-scatter for gradient reductions" in (cfg.run_path / "training.log").read_text()
    ours = [(r["iteration"], r["lm_loss"], r["grad_norm"]) for r in result.metrics["iteration"]]
    reference = [(r["iteration"], r["lm_loss"], r["grad_norm"]) for r in uninterrupted[1].metrics["iteration"]]
    assert len(ours) == 12
    for (it, loss, norm), (_, ref_loss, ref_norm) in zip(ours, reference):
        assert loss == pytest.approx(ref_loss, abs=1e-6) and norm == pytest.approx(ref_norm, rel=1e-5), it


def test_sequence_parallelism_with_tp2_trains_what_one_process_trains(uninterrupted, data, tmp_path):
    """Issue 29: --sequence-parallel at TP=2 (the norms and dropouts on each rank's half of the sequence, their
    gradients summed over the ranks): every loss and gradient norm equals the one-process run's to float32
    rounding (TP's partial sums are added in another order)."""
    cfg = tiny_config(data, tmp_path / "sp", tensor_model_parallel_size=2, sequence_parallel=True)
    result = launch.train(cfg, nproc_per_node=2, timeout_s=300, progress=False)
    ours = [(r["iteration"], r["lm_loss"], r["grad_norm"]) for r in result.metrics["iteration"]]
    reference = [(r["iteration"], r["lm_loss"], r["grad_norm"]) for r in uninterrupted[1].metrics["iteration"]]
    assert len(ours) == 12
    for (it, loss, norm), (_, ref_loss, ref_norm) in zip(ours, reference):
        assert loss == pytest.approx(ref_loss, abs=1e-5) and norm == pytest.approx(ref_norm, rel=1e-4), it
    with pytest.raises(ValueError, match="sequence_parallel=True needs tensor_model_parallel_size >= 2"):
        tiny_config(data, tmp_path / "bad", sequence_parallel=True).check(world_size=1)


def test_megatron_lms_loop_trains_and_records_everything(uninterrupted):
    cfg, result = uninterrupted
    s = result.summary
    assert s["iterations"] == 12 and s["completed"] and s["parameters"] == cfg.model.to_metadata()["num_parameters"]
    assert s["final_valid_loss"] < s["first_valid_loss"] - 0.05 and s["final_train_loss"] < 6.9  # ln(1024) = 6.93
    assert s["optimizer"] == "torch.optim.AdamW(fused=True)" and s["precision"] == "fp32"
    assert s["tokens_per_s"] > 0 and Path(s["checkpoint_path"]).name == "iter_0000012"
    assert "Megatron-LM" in s["trained_by"]
    per_iteration = result.metrics["iteration"]
    assert [r["iteration"] for r in per_iteration] == list(range(1, 13))
    assert all(math.isfinite(r["lm_loss"]) and math.isfinite(r["grad_norm"]) for r in per_iteration)
    assert [r["iteration"] for r in result.metrics["train"]] == list(range(1, 13))
    assert [(r["iteration"], r["when"]) for r in result.metrics["valid"]] == [(6, "during"), (12, "during"), (12, "end")]
    assert [r["iteration"] for r in result.metrics["test"]] == [12]
    assert any("iteration       12/      12 |" in line for line in result.log)  # Megatron-LM's own log line
    assert checkpointing.latest_iteration(cfg.checkpoint_path) == 12
    assert sorted(p.name for p in cfg.checkpoint_path.glob("iter_*")) == ["iter_0000004", "iter_0000008", "iter_0000012"]
    meta = checkpointing.read_model_config(cfg.checkpoint_path)  # from the args Megatron-LM stored
    assert meta["gelu"] == "erf" and meta["tied_embeddings"] is True and meta["padded_vocab_size"] == 1024
    assert meta["vocab_size"] == 1024 and meta["iteration"] == 12 and meta["written_by"] == "Megatron-LM"
    assert any(p.name.startswith("events.out.tfevents") for p in cfg.tensorboard_path.iterdir())
    again = launch.train(cfg, nproc_per_node=1, progress=False)  # cached: nothing to do
    assert again.skipped and again.summary == s
    assert launch.train(replace(cfg, log_interval=3), progress=False).skipped  # logging changes no weights
    with pytest.raises(ValueError, match=r"already holds a finished run \(train_iters=12\) trained with other "
                                         r"settings \(lr: 0.002 -> 0.001\)"):
        launch.train(replace(cfg, lr=1e-3), progress=False)


def test_the_preflights_checkpoint_estimate_matches_the_saves_megatron_lm_made(uninterrupted):
    """Issue 24 item 1: the disk check counts the saves Megatron-LM makes and sizes them from above,
    close enough not to refuse a run that fits (at most 15 % above for this smallest model, where
    the fixed overhead weighs most)."""
    from helpers.learn import memory
    from helpers.runner import preflight

    cfg, _ = uninterrupted
    saves = sorted(cfg.checkpoint_path.glob("iter_*"))
    assert preflight.checkpoint_saves(cfg) == len(saves) == 3
    assert preflight.checkpoint_saves(cfg, 4) == 2 and preflight.checkpoint_saves(cfg, 12) == 0
    assert preflight.checkpoint_saves(replace(cfg, save_interval=5)) == 3  # 5, 10 and the end, 12
    estimate = memory.checkpoint_bytes(cfg.model, "fp32")
    for folder in saves:
        actual = sum(p.stat().st_size for p in folder.rglob("*") if p.is_file())
        assert actual <= estimate <= 1.15 * actual, (folder.name, actual, estimate)


def test_the_core_loop_of_notebook_03_trains_the_same_weights_bit_for_bit(uninterrupted):
    """helpers.demos.core_loop (notebook 03 section 5 as functions) against Megatron-LM's loop, same config:
    the iteration-4 weights are bit-identical, and every loss agrees to one float32 rounding."""
    from helpers.demos import core_loop
    from helpers.learn import distributed

    cfg, _ = uninterrupted
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as the reference run (OMP_NUM_THREADS=1): the reduction order depends on it
    try:
        loop = core_loop.setup(cfg)
        mine = [core_loop.train_step(loop) for _ in range(4)]
        weights = {k: p.detach().clone() for k, p in loop.model.module.named_parameters()}
    finally:
        distributed.destroy_distributed()
        torch.set_num_threads(threads)
    theirs = _weights(cfg, 4)
    shared = [k for k in weights if k in theirs]
    assert len(shared) >= 20 and all(torch.equal(weights[k], theirs[k]) for k in shared)
    logged = _losses(cfg)
    assert all(abs(m["lm_loss"] - logged[i + 1]) <= 5e-7 for i, m in enumerate(mine))


def _start(cfg) -> subprocess.Popen:
    """Megatron-LM's loop for ``cfg`` under torchrun, in its own process group, output piped."""
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")}
    env.update(PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT), **megatron_args.ENV)
    cmd = launch.torchrun_command([megatron_args.SCRIPT[1], *megatron_args.arguments(cfg)], nproc_per_node=1,
                                  master_port=launch.free_port())
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env, cwd=ROOT,
                            start_new_session=True)


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


def test_kill_and_resume_is_bit_identical(uninterrupted, data, tmp_path):
    """SIGTERM (Megatron-LM's --exit-signal-handler saves, then exits), SIGKILL (loses the work since
    the last save), resume each time (--load): every iteration's loss equals the uninterrupted
    run's, and so does the final checkpoint, tensor for tensor."""
    ref_cfg, _ = uninterrupted
    cfg = tiny_config(data, tmp_path)

    proc = _start(cfg)
    _wait_for(proc, "successfully saved checkpoint from iteration       4")
    os.killpg(proc.pid, signal.SIGTERM)
    out = _finish(proc)
    assert "exiting program after receiving SIGTERM" in out, out[-3000:]
    stopped = checkpointing.latest_iteration(cfg.checkpoint_path)
    assert 4 <= stopped < 12

    proc = _start(cfg)
    _wait_for(proc, f"loading distributed checkpoint from {cfg.checkpoint_path} at iteration {stopped}")
    _wait_for(proc, f"iteration {stopped + 2:8d}/")
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait(timeout=30)
    # torchrun's worker runs in a session of its own: it sees its launcher gone (run_guard.watch_launcher),
    # saves at the end of its iteration and exits, freeing the run folder.
    deadline = time.monotonic() + 90
    while True:
        try:
            run_guard.check_run_folder_free(cfg.run_path)
            break
        except run_guard.RunFolderBusyError:
            assert time.monotonic() < deadline, "the orphaned worker did not stop within 90 s"
            time.sleep(0.5)
    killed_at = checkpointing.latest_iteration(cfg.checkpoint_path)
    assert killed_at >= stopped

    result = launch.train(cfg, progress=False, env={"OMP_NUM_THREADS": "1"})
    assert any(f"at iteration {killed_at}" in line and "loading distributed checkpoint" in line for line in result.log)
    assert _losses(cfg) == _losses(ref_cfg)  # bit-identical, every iteration (TensorBoard, the last launch's)
    mine, theirs = _weights(cfg, 12), _weights(ref_cfg, 12)
    assert mine.keys() == theirs.keys() and all(torch.equal(mine[k], theirs[k]) for k in mine)

    # A different model shape refuses to resume and leaves the checkpoint untouched.
    before = {p: p.stat().st_mtime_ns for p in cfg.checkpoint_path.rglob("*")}
    wrong = replace(cfg, model=replace(cfg.model, hidden_size=128), train_iters=16)
    with pytest.raises(checkpointing.CheckpointMismatchError, match="hidden_size: checkpoint 64 vs config 128"):
        launch.train(wrong, progress=False)  # refused before any process starts
    assert {p: p.stat().st_mtime_ns for p in cfg.checkpoint_path.rglob("*")} == before


def test_the_checkpoint_converts_to_transformers_exactly(uninterrupted, tmp_path):
    """Megatron-LM's torch_dist checkpoint, read from its args, through helpers.learn.conversion: the
    same logits (1e-5), the same greedy tokens and the same validation loss as megatron-core."""
    from transformers import AutoModelForCausalLM

    from helpers.learn import conversion
    from helpers.demos import conversion_proofs as proofs
    from helpers.demos import generation

    cfg, _ = uninterrupted
    conv = conversion.convert_to_hf(cfg.checkpoint_path, tmp_path / "hf")
    hf = AutoModelForCausalLM.from_pretrained(conv.output_dir).eval()
    gpt, meta = checkpointing.load_model(cfg.checkpoint_path)
    tokens = proofs.validation_tokens(cfg.run_path, 2)
    diff = (proofs.hf_logits(hf, tokens) - proofs.megatron_logits(gpt, tokens)[..., :meta["vocab_size"]]).abs().max()
    assert diff < 1e-5
    prompt = tokens[0, :8].tolist()
    assert generation.greedy_generate(gpt, prompt, max_new_tokens=8)[8:] == generation.greedy_generate_hf(hf, prompt, 8)
    val = proofs.compare_validation_loss(cfg.run_path, hf, gpt, iteration=12)
    assert abs(val.hf_loss - val.megatron_loss) < 1e-5
    assert abs(val.megatron_loss - val.training_loss) < 1e-5  # the batches Megatron-LM's evaluation at 12 read


def test_megatron_lms_checks_stop_a_bad_run_with_their_message(uninterrupted, data, tmp_path):
    """A loss that is NaN from the first step (an absurd initialisation) stops at Megatron-LM's
    NaN check; a resume whose learning-rate schedule differs is refused by Megatron-LM unless
    --override-opt_param-scheduler says to follow the new one."""
    from helpers.runner.launch import LaunchError

    bad = tiny_config(data, tmp_path / "nan", model={**TINY_MODEL, "init_method_std": 1e30}, train_iters=2, lr_warmup_iters=1,
                      save_interval=2, eval_interval=2)
    with pytest.raises(LaunchError, match=r"found (NaN|Inf) in local forward loss calculation.*rerun state machine.*"
                                          r"Fix: the loss is not finite"):
        launch.train(bad, progress=False, timeout_s=300)
    # Megatron-LM saved the step before the bad loss, for a diagnostic rerun, and stopped at iteration 1 of 2.
    assert checkpointing.latest_iteration(bad.checkpoint_path) == 1

    ref_cfg, _ = uninterrupted
    longer = replace(ref_cfg, train_iters=16, run_dir=str(tmp_path / "longer"), checkpoint_dir=str(tmp_path / "ck"))
    import shutil

    shutil.copytree(ref_cfg.checkpoint_path, longer.checkpoint_path)
    (longer.run_path / "run.json").parent.mkdir(parents=True, exist_ok=True)
    ref_cfg.to_json(longer.run_path / "run.json")  # the finished run's record, as in a run folder
    before = (longer.run_path / "run.json").read_text()
    with pytest.raises(LaunchError, match=r"OptimizerParamScheduler: class input value 128 and checkpoint ?value 96 .*"
                                          r"Fix: the checkpoint was trained with another learning-rate schedule"):
        launch.train(longer, progress=False, timeout_s=300)
    assert (longer.run_path / "run.json").read_text() == before  # refused before a step: run.json still the checkpoint's
    result = launch.train(replace(longer, override_opt_param_scheduler=True), progress=False, timeout_s=300)
    assert result.summary["iterations"] == 16
    with pytest.raises(ValueError, match=r"already holds a finished run \(train_iters=16\) trained with other settings "
                                         r"\(train_iters: 16 -> 12"):
        launch.train(replace(longer, train_iters=12, override_opt_param_scheduler=True), progress=False)


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


@pytest.mark.parametrize("first, second", [(2, 1), (1, 2)], ids=["dp2-to-dp1", "dp1-to-dp2"])
def test_a_distributed_optimizer_run_resumes_at_another_data_parallel_size(uninterrupted, data, tmp_path, first, second):
    """Issue 39: --use-distributed-optimizer trained to iteration 6 (--exit-interval, which saves), then resumed to
    12 on another number of ranks: Megatron-LM's default dp_reshardable checkpoint reshards the optimizer state over
    the new data-parallel group (cpu_compat.resume_distributed_optimizer makes that load work with torch's AdamW),
    and every loss equals the uninterrupted one-process run's within 1e-5 nats."""
    cfg = tiny_config(data, tmp_path / "zero1", use_distributed_optimizer=True)
    launch.train(replace(cfg, exit_interval=6), nproc_per_node=first, timeout_s=300, progress=False)
    assert checkpointing.latest_iteration(cfg.checkpoint_path) == 6
    result = launch.train(cfg, nproc_per_node=second, timeout_s=300, progress=False)
    assert any(f"loading distributed checkpoint from {cfg.checkpoint_path} at iteration 6" in line for line in result.log)
    ours, reference = _losses(cfg), _losses(uninterrupted[0])
    assert sorted(ours) == list(range(1, 13))
    for it in ours:
        assert ours[it] == pytest.approx(reference[it], abs=1e-5), it

    # Another TP (or PP) size: Megatron-LM would refuse the optimizer state after start-up; refused up front.
    log = (cfg.run_path / "training.log").stat().st_mtime_ns
    with pytest.raises(checkpointing.CheckpointMismatchError,
                       match=r"at TP=1, PP=1, and this run asks for TP=2, PP=1.*Fix: resume at tensor_model_parallel_size=1"):
        launch.train(replace(cfg, tensor_model_parallel_size=2, train_iters=16), nproc_per_node=2, progress=False)
    assert (cfg.run_path / "training.log").stat().st_mtime_ns == log and checkpointing.latest_iteration(cfg.checkpoint_path) == 12


@pytest.mark.parametrize("layout", [dict(tensor_model_parallel_size=2), dict(pipeline_model_parallel_size=2)],
                         ids=["tp1-to-tp2", "pp1-to-pp2"])
def test_a_run_resumes_at_another_tensor_or_pipeline_size(uninterrupted, data, tmp_path, layout):
    """Issue 39's resume matrix: without the distributed optimizer a torch_dist checkpoint of one process resumes
    on two at TP=2 or PP=2 (each tensor is stored whole and resharded on load), every loss within 1e-5 nats of
    the uninterrupted one-process run's (TP's partial sums add in another order)."""
    cfg = tiny_config(data, tmp_path / "run")
    launch.train(replace(cfg, exit_interval=6), nproc_per_node=1, timeout_s=300, progress=False)
    result = launch.train(replace(cfg, **layout), nproc_per_node=2, timeout_s=300, progress=False)
    assert any("loading distributed checkpoint" in line and "at iteration 6" in line for line in result.log)
    ours, reference = _losses(cfg), _losses(uninterrupted[0])
    assert sorted(ours) == list(range(1, 13))
    for it in ours:
        assert ours[it] == pytest.approx(reference[it], abs=1e-5), it
