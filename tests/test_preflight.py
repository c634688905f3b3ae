"""helpers.runner.preflight: the epochs, tokens, memory and time a run will cost, and the refusal of a
run that repeats its data too often (notebook 03, launch.train and the series runner)."""

from __future__ import annotations

import dataclasses
import inspect
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from helpers.runner import data_stage, launch, preflight, series, timings
from helpers.learn import checkpointing, memory, model, preprocess, training_config


@pytest.fixture(scope="module")
def run_with_data(tmp_path_factory):
    """A run folder whose data/ notebook 01's stage made: 60 stdlib files, BPE of 512."""

    run = tmp_path_factory.mktemp("preflight-run")
    data_stage.build_data(run, max_files=60, vocab_size=512, split="90,8,2", progress=False)
    return run


def test_tokens_per_epoch_are_the_training_documents_of_the_idx(run_with_data):
    paths = data_stage.data_paths(run_with_data)
    ds = preprocess.open_indexed_dataset(paths.data_prefix)
    lengths = np.asarray(ds.sequence_lengths, dtype=np.int64)
    first, end = preprocess.split_document_ranges(paths.num_documents, "90,8,2")[0]
    assert first == 0 and 0 < end < paths.num_documents
    expected = int(lengths[:end].sum())
    assert preflight.train_tokens_per_epoch(paths.data_prefix, "90,8,2") == expected
    assert expected < int(lengths.sum())  # the validation and test documents are not counted
    assert preflight.train_tokens_per_epoch(paths.data_prefix, "0,1,0") == 0


def test_an_unreadable_idx_is_named_with_the_fix(tmp_path):
    (tmp_path / "d.bin").write_bytes(b"")
    (tmp_path / "d.idx").write_bytes(b"not an index")
    with pytest.raises(ValueError, match=r"d.bin/.idx cannot be read .*run notebook 01 again"):
        preflight.train_tokens_per_epoch(tmp_path / "d", "90,8,2")
    with pytest.raises(FileNotFoundError, match="notebook 01"):
        preflight.train_tokens_per_epoch(tmp_path / "missing", "90,8,2")


def test_the_plan_is_the_arithmetic_of_the_config(run_with_data):
    cfg = training_config.profile("cpu", str(run_with_data), model={"vocab_size": 512}, train_iters=50, lr_warmup_iters=5,
                                  split="90,8,2")  # the split training reads with: the data's own, as notebook 03 passes it
    plan = preflight.preflight(cfg, nproc=1, device="cpu", matmul_gflops=100.0)
    paths = data_stage.data_paths(run_with_data)
    per_epoch = preflight.train_tokens_per_epoch(paths.data_prefix, paths.split)
    assert plan.tokens_per_iteration == 4 * 128 and plan.train_tokens == 50 * 4 * 128
    assert plan.tokens_per_epoch == per_epoch and plan.epochs == pytest.approx(50 * 512 / per_epoch)
    # a CPU runs megatron-core's local layers: fused=False counts what they save for backward (measured in 05b)
    expected_memory = memory.memory_per_gpu(cfg.model, model.Layout(1, 1, 1), micro_batch_size=4, precision="fp32",
                                            fused=False)
    assert plan.memory_per_gpu_bytes == expected_memory.total > 0
    # the recorded cpu run's launch (data/measured_cpu_run.json), scaled by this CPU's speed against that run's
    seconds, rate = timings.training_estimate(50 * 512, model.flops_per_token(cfg.model), 100.0)
    assert plan.estimated_seconds == pytest.approx(seconds) and plan.flops_per_s == pytest.approx(rate)
    recorded = timings.load()["machine"]["matmul_gflops"]
    slower = preflight.preflight(cfg, nproc=1, device="cpu", matmul_gflops=50.0)  # a CPU half as fast: twice the time
    assert slower.estimated_seconds == pytest.approx(2 * plan.estimated_seconds)
    text = plan.text()
    assert f"{per_epoch:,}" in text and f"scaled by this CPU's matmul, 100 against {recorded:,.0f} GFLOP/s" in text
    full = preflight.preflight(dataclasses.replace(cfg, recompute="full"), nproc=1, device="cpu", matmul_gflops=100.0)  # the memory savers count
    assert full.memory_per_gpu_bytes == memory.memory_per_gpu(cfg.model, model.Layout(1, 1, 1), micro_batch_size=4,
                                                              precision="fp32", recompute="full", fused=False).total
    assert full.memory_per_gpu_bytes < plan.memory_per_gpu_bytes


def test_gpu_estimate_uses_the_peak_and_an_unknown_gpu_has_none():
    cfg = training_config.profile("gpu", "/nonexistent-run", model={"vocab_size": 32768}, precision="fp32")
    h200 = preflight.preflight(cfg, nproc=1, tokens_per_epoch=40_000_000, device="cuda:NVIDIA H200")
    assert h200.train_tokens == 3000 * 64 * 1024 and h200.epochs == pytest.approx(196_608_000 / 40e6)
    rate = 989e12 * preflight.STATED_GPU_MFU
    assert h200.estimated_seconds == pytest.approx(196_608_000 * model.flops_per_token(cfg.model) / rate)
    assert 5 * 60 < h200.estimated_seconds < 20 * 60  # the profile's design: a run of minutes on one GPU
    other = preflight.preflight(cfg, nproc=1, tokens_per_epoch=None, device="cuda:Some GPU")
    assert other.estimated_seconds is None and other.epochs is None and "PEAK_BF16_FLOPS" in other.text()


def test_a_run_that_repeats_its_data_too_often_is_refused_unless_asked():
    cfg = training_config.profile("codeparrot-small", "/nonexistent-run", model={"vocab_size": 8192}, precision="fp32")
    plan = preflight.preflight(cfg, nproc=8, tokens_per_epoch=5_675_565, device="cpu", matmul_gflops=100.0)
    assert plan.epochs == pytest.approx(150_000 * 192 * 1024 / 5_675_565)  # the guide over this corpus: ~5,200
    with pytest.raises(preflight.RepeatedDataError, match=r"5,196.17 epochs .* max_epochs=16 .*max_epochs=0"):
        preflight.check_repeats(plan)
    preflight.check_repeats(plan, max_epochs=0)  # asked for: no limit
    preflight.check_repeats(plan, max_epochs=6000)
    unknown = preflight.preflight(cfg, nproc=8, tokens_per_epoch=None, device="cpu")
    preflight.check_repeats(unknown)  # no data yet: nothing to refuse (notebook 03 checks once it exists)


def test_max_epochs_must_be_a_finite_number_at_least_zero():
    cfg = training_config.profile("cpu", "/nonexistent-run", model={"vocab_size": 512})
    plan = preflight.preflight(cfg, tokens_per_epoch=10**9, device="cpu")
    for bad in (-1, float("nan"), float("inf"), "16", True):
        with pytest.raises(ValueError, match="max_epochs=.* must be a finite number >= 0"):
            preflight.check_repeats(plan, bad)


def test_values_no_run_can_have_are_refused_by_the_preflight(monkeypatch):
    cfg = training_config.profile("cpu", "/nonexistent-run", model={"vocab_size": 512})
    from dataclasses import replace
    with pytest.raises(ValueError, match="train_iters=0 must be >= 1"):
        preflight.preflight(replace(cfg, train_iters=0), device="cpu")
    with pytest.raises(ValueError, match="global_batch_size=6 is not divisible"):
        preflight.preflight(replace(cfg, global_batch_size=6), device="cpu")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a: "NVIDIA H200")
    with pytest.raises(ValueError, match="nproc_per_node=2 but this machine has 1 GPU"):
        preflight.preflight(replace(cfg, precision="fp32", global_batch_size=8), nproc=2)


def test_peak_flops_prefers_the_longest_name_and_refuses_a_bad_override():
    assert preflight.peak_flops("NVIDIA L40S") == 362e12 and preflight.peak_flops("NVIDIA L40") == 181e12
    assert preflight.peak_flops("NVIDIA L4") == 121e12 and preflight.peak_flops("NVIDIA H100 NVL") == 835e12
    with pytest.raises(ValueError, match="positive"):
        preflight.peak_flops("NVIDIA H200", 0)


def test_a_data_prefix_given_explicitly_is_read_too(run_with_data, tmp_path):
    """launch.train's check must not depend on where the data lives (it passed a 56,000-epoch run)."""
    paths = data_stage.data_paths(run_with_data)
    cfg = training_config.profile("codeparrot-small", str(tmp_path / "elsewhere"), model={"vocab_size": 512},
                                  data_prefix=str(paths.data_prefix), tokenizer_dir=str(paths.tokenizer_dir),
                                  split=paths.split, precision="fp32")
    plan = preflight.preflight(cfg, nproc=8, device="cpu")
    assert plan.tokens_per_epoch == preflight.train_tokens_per_epoch(paths.data_prefix, paths.split) > 0
    with pytest.raises(preflight.RepeatedDataError):
        preflight.check_repeats(plan)


def test_launch_train_refuses_before_anything_starts(run_with_data):
    cfg = training_config.profile("cpu", str(run_with_data), model={"vocab_size": 512, "num_layers": 1,
                                  "hidden_size": 32, "num_attention_heads": 2, "seq_length": 64,
                                  "max_position_embeddings": 64},
                                  split="90,8,2", train_iters=100_000, save_interval=None)
    with pytest.raises(preflight.RepeatedDataError, match="Nothing was started"):
        launch.train(cfg, progress=False)  # the default limit, preflight.MAX_EPOCHS
    assert inspect.signature(launch.train).parameters["max_epochs"].default == preflight.MAX_EPOCHS
    assert not (run_with_data / "run.json").exists() and not (run_with_data / "training.log").exists()


def test_the_runner_prints_the_plan_and_refuses_the_guides_run_over_a_small_corpus(run_with_data, capsys):
    with pytest.raises(series.ParameterError, match=r"epochs .* max_epochs=16.*-p max_epochs=0"):
        series.run("codeparrot-small", run_dir=run_with_data, only=["03"])
    out = capsys.readouterr().out
    assert "Preflight of 03_training" in out and "29,491,200,000" in out  # 150,000 x 192 x 1,024 tokens
    assert not (run_with_data / "executed").exists()  # refused before any notebook ran
    for bad, match in (("global_batch_size=6", "global_batch_size=6 is not divisible"), ("train_iters=0", "train_iters=0"),
                       ("max_epochs=-1", "max_epochs=-1")):
        with pytest.raises(series.ParameterError, match=f"notebook 03 cannot train with these parameters: .*{match}"):
            series.run("cpu", dict([series.parse_override(bad)]), run_dir=run_with_data, only=["03"])
    assert not (run_with_data / "executed").exists()


def test_gpu_is_the_default_profile_with_a_gpu_and_matches_its_training_profile(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert series.default_profile() == "gpu"
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert series.default_profile() == "cpu"
    runner = series.PROFILES["gpu"]["03_training"]
    cfg = training_config.PROFILES["gpu"]
    for name in ("micro_batch_size", "global_batch_size", "train_iters", "lr", "min_lr", "lr_warmup_iters",
                 "eval_interval", "eval_iters", "save_interval", "log_interval"):
        assert runner[name] == getattr(cfg, name), name
    for name in ("num_layers", "hidden_size", "num_attention_heads", "seq_length"):
        assert runner[name] == getattr(cfg.model, name) == getattr(model.PROFILES["codeparrot-small"], name), name
    assert series.PROFILES["gpu"]["01_data_preprocessing"]["vocab_size"] == cfg.model.vocab_size


def test_the_runner_checks_again_once_notebook_01_has_made_the_data(run_with_data, tmp_path, monkeypatch):
    """A fresh folder: the epochs are unknown at the start; the refusal comes before notebook 03 runs."""
    import shutil

    import papermill

    ran = []

    def fake_execute(path, output, **kwargs):  # notebook 01 "makes" the data: a copy of the fixture's
        ran.append(Path(path).stem)
        if Path(path).stem == "01_data_preprocessing":
            shutil.copytree(run_with_data / "data", tmp_path / "fresh" / "data")

    monkeypatch.setattr(papermill, "execute_notebook", fake_execute)
    monkeypatch.setattr(preflight, "check_disk", lambda plan, folder: None)  # the guide's 75 checkpoints: ~100 GB
    with pytest.raises(series.ParameterError, match="epochs .* more than max_epochs=16"):
        series.run("codeparrot-small", run_dir=tmp_path / "fresh", only=["01", "03"])
    assert ran == ["01_data_preprocessing"]  # notebook 03 never started


def configuration_path(cfg, run) -> list[tuple[str, str]]:
    """The helpers functions ``run()`` calls with ``cfg`` or ``cfg.model`` (as an argument or as
    ``self``), from another module, in call order: ``[(module below helpers, function), ...]``;
    private functions and property reads are not stops."""
    path: list[tuple[str, str]] = []

    def profile(frame, event, arg):
        name, module = frame.f_code.co_name, frame.f_globals.get("__name__", "")
        caller = frame.f_back.f_globals.get("__name__", "") if frame.f_back else ""
        if (event != "call" or not module.startswith("helpers.") or module == caller or name.startswith("_")
                or isinstance(getattr(type(cfg), name, None) or getattr(type(cfg.model), name, None), property)):
            return
        if any(v is cfg or v is cfg.model for v in frame.f_locals.values()):
            path.append((module.removeprefix("helpers."), name))

    sys.setprofile(profile)
    try:
        run()
    finally:
        sys.setprofile(None)
    return path


def climbs_back_up(path: list[tuple[str, str]]) -> list[str]:
    """The stops of ``path`` that re-enter a module the configuration already went through and
    that sits higher in the import graph than the stop before (``tests/test_house.py``'s graph):
    a check that calls back into a caller's module instead of finishing in one pass."""
    from test_house import import_graph

    graph = import_graph()
    floors: dict[str, int] = {}

    def floor(m: str) -> int:
        if m not in floors:
            floors[m] = 1 + max((floor(d) for d in graph.get(m, ())), default=-1)
        return floors[m]

    seen, out = set(), []
    for (before, _), (module, name) in zip(path, path[1:]):
        if module in seen and floor(module) > floor(before):
            out.append(f"{before} -> {module}.{name}")
        seen |= {before, module}
    return out


def test_a_runs_configuration_goes_from_the_runner_to_the_trainer_in_one_pass(run_with_data, monkeypatch):
    """Every check of a run happens in preflight.check_run, once; following the configuration from
    launch.train to the torchrun call climbs back up into a module it left at most twice."""
    cfg = training_config.profile("cpu", str(run_with_data / "one-pass"), model={"vocab_size": 512}, train_iters=10,
                                  lr_warmup_iters=1, split="90,8,2", data_prefix=str(data_stage.data_paths(run_with_data).data_prefix),
                                  tokenizer_dir=str(run_with_data / "data" / "tokenizer"))

    class Launched(Exception):
        pass

    def torchrun(*args, **kwargs):
        raise Launched

    monkeypatch.setattr(launch, "torchrun", torchrun)
    path = configuration_path(cfg, lambda: pytest.raises(Launched, launch.train, cfg, progress=False))
    modules = [m.split(".")[1] for m, _ in path]
    assert modules[:4] == ["launch", "preflight", "training_config", "model"], path
    assert path[-3:] == [("runner.megatron_args", "arguments"), ("learn.training_config", "to_json"), ("learn.model", "to_dict")]
    checks = [f"{m}.{f}" for m, f in path if f.startswith("check")]
    assert checks.count("learn.training_config.check") == 1 and "runner.preflight.check_run" in checks, checks
    assert len(climbs_back_up(path)) <= 2, (climbs_back_up(path), path)
    assert climbs_back_up([("runner.launch", "train"), ("learn.training_config", "check"), ("learn.model", "check_layout"),
                           ("learn.training_config", "check")]) == ["learn.model -> learn.training_config.check"]


def test_a_checkpoint_at_iteration_0_is_resumed_from_and_a_failed_launch_puts_the_run_back(run_with_data, monkeypatch):
    """Breaker (issue 27): iteration 0 is a checkpoint, not a fresh start: the plan says so, and a launch
    that fails keeps the earlier log and puts the earlier run.json back (it deleted and overwrote them)."""
    from helpers.learn import checkpointing, distributed

    run = run_with_data / "resume-at-0"
    cfg = training_config.profile("cpu", str(run), model={"vocab_size": 512, "num_layers": 2, "hidden_size": 64},
                                  train_iters=10, lr_warmup_iters=1, split="90,8,2",
                                  data_prefix=str(data_stage.data_paths(run_with_data).data_prefix),
                                  tokenizer_dir=str(run_with_data / "data" / "tokenizer"), save_interval=5)
    with distributed.single_process():
        checkpointing.save_model(model.build_model(cfg.model), cfg.checkpoint_path, 0, cfg.model.to_metadata())
    plan = preflight.check_run(cfg, nproc=1)
    assert plan.start_iteration == 0 and plan.checkpoint_saves == 2
    fresh = preflight.check_run(dataclasses.replace(cfg, checkpoint_dir=str(run / "elsewhere")), nproc=1)
    assert fresh.start_iteration is None and fresh.checkpoint_saves == 2
    (run / "training.log").write_text("the earlier run's log\n")
    (run / "run.json").write_text("PREVIOUS")

    def failing(*args, **kwargs):
        raise launch.LaunchError("rank 0 failed")

    monkeypatch.setattr(launch, "torchrun", failing)
    with pytest.raises(launch.LaunchError, match="rank 0 failed"):
        launch.train(cfg, progress=False)
    assert (run / "training.log").read_text() == "the earlier run's log\n" and (run / "run.json").read_text() == "PREVIOUS"
    with pytest.raises(ValueError, match=r"world_size=0: the number of processes \(nproc_per_node\), an integer >= 1"):
        preflight.check_run(cfg, nproc=0)
    (cfg.checkpoint_path / "latest_checkpointed_iteration.txt").write_text("-3")
    with pytest.raises(ValueError, match="holds '-3', not an iteration number. Nothing was changed. Fix: write 0 into it"):
        preflight.check_run(cfg, nproc=1)
    (cfg.checkpoint_path / "latest_checkpointed_iteration.txt").write_text("7")  # a folder deleted by hand
    with pytest.raises(ValueError, match="names iteration 7, but iter_0000007 is missing. Nothing was changed. Fix: write 0"):
        preflight.check_run(cfg, nproc=1)


def test_a_resume_the_load_would_refuse_is_refused_up_front(tmp_path):
    """Issue 39's resume matrix, the combinations Megatron-LM's load refuses after start-up (measured on 0.19.2):
    a distributed-optimizer checkpoint at another TP or PP size, and switching the distributed optimizer on or off.
    Everything else resumes: DP 1 <-> 2 with and without it, TP and PP 1 <-> 2 without it."""
    saved = {"iteration": 6, "tensor_model_parallel_size": 1, "pipeline_model_parallel_size": 1,
             "use_distributed_optimizer": True, "dist_ckpt_optim_fully_reshardable": False}
    checkpointing.check_layout(saved, 1, 1, True, tmp_path)  # any DP size: no TP/PP in the call
    with pytest.raises(checkpointing.CheckpointMismatchError, match="asks for TP=1, PP=2.*dp_reshardable"):
        checkpointing.check_layout(saved, 1, 2, True, tmp_path)
    checkpointing.check_layout({**saved, "dist_ckpt_optim_fully_reshardable": True}, 2, 1, True, tmp_path)
    with pytest.raises(checkpointing.CheckpointMismatchError, match="saved with the distributed optimizer.*"
                       "Fix: resume with use_distributed_optimizer=True"):
        checkpointing.check_layout(saved, 1, 1, False, tmp_path)
    plain = {**saved, "use_distributed_optimizer": False}
    with pytest.raises(checkpointing.CheckpointMismatchError, match="saved without the distributed optimizer"):
        checkpointing.check_layout(plain, 1, 1, True, tmp_path)
    for tp, pp in ((2, 1), (1, 2)):
        checkpointing.check_layout(plain, tp, pp, False, tmp_path)
    checkpointing.check_layout({"iteration": 0}, 2, 2, True, tmp_path)  # the series' own weights-only save

