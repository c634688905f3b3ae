"""Notebook 05's demonstrations (helpers/demos): layouts and bad input, rank groups
(``rank_groups``), pipeline schedules (``pipeline_schedule``), the memory calculator
(``memory``; values derived by hand below), launch generation (``launch_plans``), and real
2-process runs (``layout_runs``, ``shards``)."""

from __future__ import annotations

import re
import time

from dataclasses import replace
from functools import partial

import pytest

from helpers.support import results
from helpers.demos import launch_plans, layout_runs, pipeline_schedule, rank_groups, shards
from helpers.learn import memory
from helpers.learn import model as model_lib
from helpers.learn.model import Layout, ModelConfig, check_layout, count_parameters

pytestmark = pytest.mark.trains

# A model small enough to count by hand: h=8, f=32, 2 heads, 2 layers, V=16 (padded to 16 for
# TP 1 and 2 with make_vocab_size_divisible_by=8), 4 positions.
HAND = ModelConfig(num_layers=2, hidden_size=8, num_attention_heads=2, seq_length=4, max_position_embeddings=4,
                   vocab_size=16, make_vocab_size_divisible_by=8)


# ----------------------------------------------------------------------------- bad input
@pytest.mark.parametrize("layout, message", [
    (Layout(3, 1, 1), "does not divide num_attention_heads=4"),
    (Layout(1, 8, 1), "pipeline_model_parallel_size=8 is larger than num_layers=4"),
    (Layout(1, 3, 1), "does not divide num_layers=4"),
])
def test_check_layout_refuses_what_megatron_cannot_build(layout, message):
    model = ModelConfig(num_layers=4, hidden_size=64, num_attention_heads=4)
    with pytest.raises(ValueError, match=message):
        check_layout(model, layout)


def test_check_layout_refuses_tp_not_dividing_the_mlp_width_or_world_size_mismatch():
    model = ModelConfig(num_layers=2, hidden_size=64, num_attention_heads=4, ffn_hidden_size=102)
    with pytest.raises(ValueError, match="ffn_hidden_size=102"):
        check_layout(model, Layout(4, 1, 1))
    with pytest.raises(ValueError, match=r"world size 3 != TP x PP x DP = 2 x 1 x 1 = 2.*impossible"):
        check_layout(HAND, Layout(2, 1, 1), world_size=3)
    with pytest.raises(ValueError, match=r"world size 8 != .* = 4.*= 4"):
        check_layout(HAND, Layout(2, 1, 2), world_size=8)
    with pytest.raises(ValueError, match="global_batch_size=12 is not divisible by micro_batch_size x data_parallel_size = 4 x 2 = 8: use a multiple of 8 \\(e.g. 8\\), or micro_batch_size=3"):
        check_layout(HAND, Layout(1, 1, 2), micro_batch_size=4, global_batch_size=12)
    with pytest.raises(ValueError, match="must be an integer >= 1"):
        Layout(0, 1, 1)


@pytest.mark.parametrize("layout", [Layout(3, 1, 1), Layout(1, 4, 1)])
def test_run_layout_fails_before_any_process_starts(layout, monkeypatch, tmp_path):
    from helpers.runner import launch

    def must_not_launch(*args, **kwargs):
        raise AssertionError("a process was started for a bad layout")

    monkeypatch.setattr(launch, "torchrun", must_not_launch)
    model = ModelConfig(num_layers=2, hidden_size=64, num_attention_heads=4, seq_length=64, max_position_embeddings=64,
                        vocab_size=1024)
    base = layout_runs.comparison_config(tmp_path, model=model, micro_batch_size=2, global_batch_size=4, train_iters=2)
    start = time.perf_counter()
    with pytest.raises(ValueError, match="tensor_model_parallel_size=3|pipeline_model_parallel_size=4"):
        layout_runs.run_layout(base, layout, progress=False)
    assert time.perf_counter() - start < 5
    assert not (tmp_path / "parallelism").exists()


def test_comparison_config_refuses_dropout_and_tp_dependent_vocab_padding(tmp_path):
    with pytest.raises(ValueError, match="dropout"):
        layout_runs.comparison_config(tmp_path, model=ModelConfig(hidden_dropout=0.1), micro_batch_size=1,
                                      global_batch_size=1, train_iters=2)
    with pytest.raises(ValueError, match="pads to 128 rows at TP=1 but 256 at TP=2"):
        layout_runs.comparison_config(tmp_path, model=ModelConfig(vocab_size=100), micro_batch_size=1,
                                      global_batch_size=1, train_iters=2)


# ----------------------------------------------------------------------------- rank groups
def test_rank_groups_are_megatrons_for_tp2_pp2_dp2():
    groups = rank_groups.rank_groups(Layout(2, 2, 2))
    # rank = tp_rank + 2 * dp_rank + 4 * pp_rank (order tp-cp-ep-dp-pp)
    assert groups["tp"] == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert groups["dp"] == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert groups["pp"] == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert groups["mp"] == [[0, 1, 4, 5], [2, 3, 6, 7]]
    assert groups["embedding"] == [[0, 4], [1, 5], [2, 6], [3, 7]]
    coords = rank_groups.rank_coordinates(Layout(2, 2, 2))
    assert coords[5] == {"rank": 5, "tp_rank": 1, "pp_rank": 1, "dp_rank": 0}
    assert coords[6] == {"rank": 6, "tp_rank": 0, "pp_rank": 1, "dp_rank": 1}


def test_layouts_for_lists_every_factorisation_the_model_allows():
    assert len(rank_groups.layouts_for(8)) == 10  # ordered factorisations of 8 into 3 factors
    model = ModelConfig(num_layers=2, hidden_size=64, num_attention_heads=2)
    allowed = rank_groups.layouts_for(8, model)
    assert all(l.tensor_model_parallel_size <= 2 and l.pipeline_model_parallel_size <= 2 for l in allowed)
    assert {l.name for l in allowed} == {"tp1_pp1_dp8", "tp1_pp2_dp4", "tp2_pp1_dp4", "tp2_pp2_dp2"}


# ----------------------------------------------------------------------------- pipeline schedules
@pytest.mark.parametrize("p, m", [(2, 2), (2, 4), (4, 8), (4, 2), (3, 5), (8, 32)])
@pytest.mark.parametrize("schedule", ["1f1b", "gpipe"])
def test_simulated_bubble_equals_the_formula(p, m, schedule):
    stats = pipeline_schedule.schedule_stats(pipeline_schedule.pipeline_schedule(p, m, schedule=schedule))
    assert stats["bubble_fraction"] == pytest.approx((p - 1) / (m + p - 1))
    assert stats["makespan"] == pytest.approx((m + p - 1) * 3.0)  # forward 1 + backward 2 per slot
    if schedule == "1f1b":
        assert stats["peak_in_flight"] == [min(p - r, m) for r in range(p)]
    else:
        assert stats["peak_in_flight"] == [m] * p


def test_one_stage_has_no_bubble_and_1f1b_order_matches_megatron_warmup():
    assert pipeline_schedule.schedule_stats(pipeline_schedule.pipeline_schedule(1, 4))["bubble_fraction"] == 0.0
    assert pipeline_schedule.bubble_fraction(4, 12) == pytest.approx(3 / 15)
    ops = pipeline_schedule.pipeline_schedule(4, 6)
    stage0 = [(o.kind, o.microbatch) for o in ops if o.stage == 0]
    assert stage0[:4] == [("F", 0), ("F", 1), ("F", 2), ("F", 3)]  # p - 0 - 1 = 3 warm-up forwards, then 1F1B
    assert stage0[4] == ("B", 0)
    with pytest.raises(ValueError, match="schedule="):
        pipeline_schedule.pipeline_schedule(2, 2, schedule="interleaved")
    with pytest.raises(ValueError):
        pipeline_schedule.bubble_fraction(0, 4)


def test_schedule_ops_and_bubble_table():
    ops = pipeline_schedule.pipeline_schedule(2, 2)
    assert ops[0] == pipeline_schedule.PipelineOp(stage=0, kind="F", microbatch=0, start=0.0, end=1.0)
    assert ops[1] == pipeline_schedule.PipelineOp(stage=0, kind="F", microbatch=1, start=1.0, end=2.0)
    rows = pipeline_schedule.bubble_table(4, (4, 12))
    assert [r["micro-batches m"] for r in rows] == [4, 12]
    assert rows[1]["bubble (p-1)/(m+p-1), p=4"] == rows[1]["simulated 1F1B bubble"] == "20.0%"
    assert rows[0]["1F1B peak micro-batches held"] == 4 and rows[0]["GPipe peak"] == 4
    assert rows[1]["GPipe peak"] == 12
    assert results.markdown_table(rows).count("\n") == 3


# ----------------------------------------------------------------------------- memory calculator
def test_parameters_per_rank_by_hand():
    # Per layer: LayerNorms 4h = 32; QKV 3h^2 + 3h = 216; proj h^2 + h = 72; fc1 hf + f = 288; fc2 fh + h = 264.
    per_layer = 32 + 216 + 72 + 288 + 264
    assert per_layer == 872
    # Tied embeddings at PP=1: word 16*8 + positions 4*8 + final LayerNorm 16, no output weight.
    assert memory.parameters_per_rank(HAND) == 2 * 872 + 128 + 32 + 16 == count_parameters(HAND) == 1920
    # TP=2, PP=2: one layer per stage. Sharded: QKV 216/2, proj weight 64/2, fc1 288/2, fc2 weight 256/2;
    # replicated: LayerNorms 32, proj bias 8, fc2 bias 8.
    layer_tp2 = 32 + 108 + 32 + 8 + 144 + 128 + 8
    assert layer_tp2 == 460
    assert memory.parameters_per_rank(HAND, 2, 2, 0) == 460 + 128 // 2 + 32  # + word embeddings/2 + positions
    assert memory.parameters_per_rank(HAND, 2, 2, 1) == 460 + 16 + 128 // 2  # + final LN + output copy/2
    with pytest.raises(ValueError, match="pipeline_rank=2"):
        memory.parameters_per_rank(HAND, 1, 2, 2)


def test_activation_bytes_per_layer_by_hand():
    # s=4, b=2, h=8, a=2 -> s*b*h = 64; 5*a*s/h = 5.
    # Korthikanti et al.'s equations 2 and 4: 16-bit values, dropout on, GELU MLP of 4h, one K/V head per head.
    act = partial(memory.activation_bytes_per_layer, dropout=True)
    assert act(HAND, 2) == 64 * (10 + 24 + 5)
    assert act(HAND, 2, recompute="selective") == 64 * 34
    assert act(HAND, 2, recompute="full") == 128
    assert act(HAND, 2, 2) == 64 * (10 + 12 + 2.5)
    assert act(HAND, 2, 2, sequence_parallel=True) == 32 * (34 + 5)
    assert act(HAND, 2, 2, recompute="selective", sequence_parallel=True) == 34 * 32
    with pytest.raises(ValueError, match="recompute="):
        act(HAND, 2, recompute="some")


def test_activation_terms_without_dropout_in_fp32_and_for_a_llama():
    """The series' runs: no dropout (no masks, the softmax output is the only s^2 tensor), 4-byte values;
    a Llama's grouped K/V (g*d wide) and SwiGLU MLP (fc1's 2f output, the SiLU output, the product: 4f)."""
    act = memory.activation_bytes_per_layer
    assert not HAND.hidden_dropout and not HAND.attention_dropout
    # e=4, s*b*h = 64: whole 4e*sbh = 1024; split e*(Q + projection input 2 sbh, K and V 2 sbh, GELU in and out
    # 2*s*b*4h = 8 sbh) = 4*768; softmax output e*a*s^2*b = 4*2*16*2 = 256
    assert act(HAND, 2, bytes_per_value=4) == 1024 + 4 * 768 + 256
    assert act(HAND, 2, bytes_per_value=4, recompute="full") == 4 * 64
    llama = replace(HAND, swiglu=True, num_query_groups=1, ffn_hidden_size=16, add_bias_linear=False,
                    normalization="RMSNorm", position_embedding_type="rope")
    # K, V: 2*s*b*g*d = 2*8*1*4 = 64 values; MLP 4*s*b*f = 4*8*16 = 512 values; Q + projection input 128 values
    assert act(llama, 2, bytes_per_value=4, recompute="selective") == 4 * (4 * 64) + 4 * (128 + 64 + 512)


def test_bytes_per_parameter_follow_megatrons_distributed_optimizer_table():
    # Megatron-LM distrib_optimizer.md: 20 / 18 / 16 bytes; distributed 4 + 16/d, 6 + 12/d, 8 + 8/d.
    for precision, total, fixed in (("fp16", 20, 4), ("bf16", 18, 6), ("fp32", 16, 8)):
        b = memory.BYTES_PER_PARAMETER[precision]
        assert b["weights"] + b["gradients"] + b["optimizer_state"] == total
        assert b["weights"] + b["gradients"] == fixed


def test_memory_per_gpu_by_hand():
    est = memory.memory_per_gpu(HAND, Layout(1, 1, 2), micro_batch_size=2, num_microbatches=4, precision="bf16",
                                distributed_optimizer=True, recompute="full")
    assert est.parameters == 1920
    assert (est.weights, est.gradients, est.optimizer_state) == (2 * 1920, 4 * 1920, 12 * 1920 / 2)
    # full recompute 2*s*b*h = 128 per layer x 2 layers x 1 micro-batch in flight; output layer
    # 4*s*b*h*(1 + V/h) = 256 * 3 = 768; with dropout also the embedding's dropout mask, s*b*h = 64.
    assert est.activations == 256 + 768
    assert est.total == 3840 + 7680 + 11520 + 1024
    with_dropout = memory.memory_per_gpu(replace(HAND, hidden_dropout=0.1), Layout(1, 1, 2), micro_batch_size=2,
                                         num_microbatches=4, precision="bf16", recompute="full")
    assert with_dropout.activations == 256 + 64 + 768
    # Without the distributed optimizer the fp32 master weights and Adam moments are not sharded.
    assert memory.memory_per_gpu(HAND, Layout(1, 1, 2), precision="bf16").optimizer_state == 12 * 1920


def test_pipeline_first_stage_holds_p_microbatches_of_activations():
    model = memory.MODEL_SHAPES["gpt-1.3b"]
    one = memory.activation_bytes_per_layer(model, 1)
    est = memory.memory_per_gpu(model, Layout(1, 4, 1), micro_batch_size=1, num_microbatches=8, stage=0)
    sbh = model.seq_length * model.hidden_size
    assert est.microbatches_in_flight == 4
    assert est.activations == pytest.approx(one * 6 * 4 + sbh * 4)  # 24/4 layers x 4 micro-batches + embedding
    last = memory.memory_per_gpu(model, Layout(1, 4, 1), micro_batch_size=1, num_microbatches=8, stage=3)
    assert last.microbatches_in_flight == 1
    assert memory.memory_per_gpu(model, Layout(1, 4, 1), num_microbatches=8).stage in (0, 3)


def test_the_interleaved_schedule_holds_more_micro_batches_in_flight():
    """megatron-core's interleaved warm-up, 2*(p - r - 1) + (v - 1)*p forwards of chunks of L/(p*v) layers, plus
    one: measured in notebook 05b (PP=2, v=2: 5 chunks on rank 0, 3 on rank 1); Megatron-LM's penalty 1 + (p-1)/(p*v)."""
    from helpers.learn.memory import microbatches_in_flight

    assert microbatches_in_flight(2, 4, 0, 2) * 2 == 5 and microbatches_in_flight(2, 4, 1, 2) * 2 == 3
    assert microbatches_in_flight(4, 16, 0, 2) == pytest.approx(4 * (1 + 3 / 8))
    assert microbatches_in_flight(4, 2, 0) == 2 and microbatches_in_flight(1, 8) == 1
    with pytest.raises(ValueError, match="pipeline_rank=2"):
        microbatches_in_flight(2, 4, 2)


def test_memory_table_leaves_out_refused_layouts_and_reports_gib():
    model = memory.MODEL_SHAPES["gpt-1.3b"]
    est = memory.memory_per_gpu(model, Layout(2, 2, 2))
    assert isinstance(est, memory.MemoryEstimate)
    assert est.gib()["total"] == pytest.approx(est.total / 2 ** 30, abs=0.01)
    rows = memory.memory_table(model, [Layout(2, 2, 2), Layout(3, 1, 1)])
    assert [r["layout"] for r in rows] == ["TP=2 PP=2 DP=2"]  # 16 heads: TP=3 is refused
    assert rows[0]["parameters"] == est.parameters and rows[0]["total"] == est.gib()["total"]


def test_model_shapes_have_the_advertised_sizes():
    sizes = {k: count_parameters(m) for k, m in memory.MODEL_SHAPES.items()}
    assert 105e6 < sizes["codeparrot-small"] < 115e6
    assert 1.2e9 < sizes["gpt-1.3b"] < 1.4e9
    assert 6.5e9 < sizes["gpt-7b"] < 6.8e9
    assert 60e9 < sizes["gpt-70b"] < 70e9


# ----------------------------------------------------------------------------- launch generation
def test_launch_plan_node_commands_and_the_local_one():
    from helpers.runner import launch

    plan = launch_plans.launch_plan(Layout(8, 2, 2), ["helpers.training", "--config", "run.json"], nnodes=4,
                                    master_addr="node0", master_port=29500)
    assert isinstance(plan, launch_plans.LaunchPlan) and plan.nproc_per_node == 8
    assert len(plan.commands()) == 4 and plan.commands()[0].startswith("torchrun ")
    cmds = [plan.node_command(n) for n in range(4)]
    assert cmds[0][:1] == ["torchrun"] and "--nnodes=4" in cmds[0] and "--master_addr=node0" in cmds[0]
    assert [c for c in cmds[0] if c.startswith("--node_rank")] == ["--node_rank=0"]
    assert all(a == b or a.startswith("--node_rank") for a, b in zip(cmds[0], cmds[3]))
    assert cmds[0][-4:] == ["-m", "helpers.training", "--config", "run.json"]
    local = launch_plans.launch_plan(Layout(2, 1, 1), ["helpers.training"], master_port=12345)
    assert local.local_command() == launch.torchrun_command(["helpers.training"], nproc_per_node=2, master_port=12345)
    with pytest.raises(ValueError, match="nnodes x nproc_per_node = 2 x 4 = 8"):
        launch_plans.launch_plan(Layout(2, 2, 1), ["x"], nnodes=2, nproc_per_node=4)
    with pytest.raises(ValueError, match="node_rank=4"):
        plan.node_command(4)
    with pytest.warns(UserWarning, match="spans machines"):
        launch_plans.launch_plan(Layout(16, 1, 1), ["x"], nnodes=2, master_port=1)


def test_sbatch_script_runs_megatron_lms_loop_with_its_flags(tmp_path):
    from dataclasses import replace

    from helpers.runner import megatron_args
    from helpers.learn import training_config

    cfg = replace(training_config.PROFILES["gpu"], run_dir=str(tmp_path), tensor_model_parallel_size=2,
                  pipeline_model_parallel_size=2)
    plan = launch_plans.launch_plan(Layout(2, 2, 4), [megatron_args.SCRIPT[1], *megatron_args.arguments(cfg, cpu=False)],
                                    nnodes=2, master_port=29500)
    script = launch_plans.sbatch_script(plan, job_name="gpt", partition="gpu",
                                        container_image="nvcr.io/nvidia/pytorch:26.09-py3")
    assert script.startswith("#!/bin/bash\n")
    for line in ("#SBATCH --nodes=2", "#SBATCH --gpus-per-node=8", "#SBATCH --ntasks-per-node=1",
                 "#SBATCH --partition=gpu", "--rdzv_endpoint=$HEAD_NODE:29500", "--rdzv_id=$SLURM_JOB_ID",
                 "--container-image=nvcr.io/nvidia/pytorch:26.09-py3", "export CUDA_DEVICE_MAX_CONNECTIONS=1",
                 "\n    -m helpers.learn.pretrain_gpt --num-layers 12 --hidden-size 768",
                 "--tensor-model-parallel-size 2 --pipeline-model-parallel-size 2"):
        assert line in script, line
    assert "--distributed-backend" not in script and "--use-cpu-initialization" not in script  # GPU flags only
    # the bare NGC image lacks megatron-core: make install once, then the .venv over the container's torch
    assert "srun --nodes=1 --ntasks=1 --container-image=nvcr.io/nvidia/pytorch:26.09-py3" in script
    assert " make install  #" in script and ".venv/bin/python -m torch.distributed.run \\\n" in script
    assert "docker build -t <registry>/megatron-gpt-notebooks ." in script


def test_sbatch_script_runs_the_projects_image_and_megatron_lms_own_script():
    plan = launch_plans.launch_plan(Layout(1, 1, 8), ["helpers.learn.pretrain_gpt", "--num-layers", "12"], master_port=1)
    plain = launch_plans.sbatch_script(plan)
    assert "\nsrun torchrun \\\n    --nnodes=1 \\\n" in plain and "make install  #" not in plain  # the cluster's environment
    image = launch_plans.sbatch_script(plan, container_image="reg.example/megatron-gpt-notebooks",
                                       script="Megatron-LM/pretrain_gpt.py")
    assert launch_plans.IMAGE_PYTHON == "/opt/venv/bin/python"
    assert "--container-image=reg.example/megatron-gpt-notebooks" in image and "make install  #" not in image
    assert "/opt/venv/bin/python -m torch.distributed.run \\\n" in image
    assert image.endswith("\n    Megatron-LM/pretrain_gpt.py --num-layers 12\n")
    assert ("[ -d Megatron-LM ] || git clone --depth 1 --branch core_v0.19.0 "
            "https://github.com/NVIDIA/Megatron-LM.git Megatron-LM\n") in image
    assert '[ "$(git -C Megatron-LM describe --tags --exact-match)" = core_v0.19.0 ] ||' in image
    here = launch_plans.sbatch_script(plan, script="pretrain_gpt.py", megatron_lm_tag="core_v0.19.1")
    assert "git clone" not in here and '[ "$(git -C . describe --tags --exact-match)" = core_v0.19.1 ]' in here
    with pytest.raises(ValueError, match="script=''"):
        launch_plans.sbatch_script(plan, script=" ")
    with pytest.raises(ValueError, match="megatron_lm_tag is empty"):
        launch_plans.sbatch_script(plan, script="Megatron-LM/pretrain_gpt.py", megatron_lm_tag="")


def _run(name, losses, wall=10.0):
    return layout_runs.LayoutRun(layout=Layout(1, 1, 1), name=name, losses=losses, s_per_iter=[0.5, 0.25, 0.5],
                                 valid_losses=[9.0, 8.0], wall_seconds=wall, command=["x"],
                                 generated_command=["x"], checkpoint_dir="c", initial="shared")


def test_loss_comparison_and_timing_tables_without_launching():
    ref, same, off = _run("tp1", [3.0, 2.5, 2.0]), _run("tp2", [3.0, 2.5 + 5e-7, 2.0]), _run("pp2", [3.1, 2.5, 2.0])
    assert layout_runs.LayoutRun.from_dict(same.to_dict()) == same
    rows = layout_runs.compare_losses(ref, [same, off])
    assert rows[0]["max_abs_diff"] == pytest.approx(5e-7) and rows[0]["within_atol"] is True
    assert rows[1]["first_iteration_diff"] == pytest.approx(0.1) and rows[1]["within_atol"] is False
    assert layout_runs.LOSS_ATOL_FP32 == 1e-4
    with pytest.raises(ValueError, match="logged 2 iterations"):
        layout_runs.compare_losses(ref, [_run("short", [3.0, 2.5])])
    table = layout_runs.loss_table([ref, same])
    assert table[1] == {"iteration": 2, "tp1": 2.5, "tp2": 2.5 + 5e-7}
    assert "| 2 | 2.5 | 2.5000005 |" in results.markdown_table(table, digits=8)
    timing = layout_runs.timing_table([ref], tokens_per_iteration=1000)
    assert timing == [{"run": "tp1", "processes": 1, "wall_s": 10.0, "cached": False, "median_s_per_iter": 0.5,
                       "tokens_per_s": 2000}]


def test_launch_env_hides_gpus_only_when_too_few(monkeypatch):
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert layout_runs.launch_env(4) == {}
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    ieee = {"NVIDIA_TF32_OVERRIDE": "0", "TORCH_ALLOW_TF32_CUBLAS_OVERRIDE": "0"}  # the GPUs' fp32 proofs without TF32
    assert layout_runs.launch_env(1) == ieee and layout_runs.launch_env(2) == ieee
    assert layout_runs.launch_env(4) == {"CUDA_VISIBLE_DEVICES": ""}


def test_expected_tp_allreduces():
    assert shards.expected_tp_allreduces(4, True, True) == {"forward": 12, "forward_backward": 21}
    assert shards.expected_tp_allreduces(2, True, False) == {"forward": 5, "forward_backward": 9}


# ----------------------------------------------------------------------------- real runs (torchrun)
@pytest.fixture(scope="module")
def base(tmp_path_factory):
    """Data of 60 stdlib files (BPE 512) and a 2-layer model, 3 iterations of 2 micro-batches."""
    from helpers.runner import data_stage

    run = tmp_path_factory.mktemp("par")
    data = data_stage.build_data(run, max_files=60, vocab_size=512, split="90,10,0", progress=False)
    model = ModelConfig(num_layers=2, hidden_size=64, num_attention_heads=4, seq_length=64,
                        max_position_embeddings=64, vocab_size=data.vocab_size)
    return layout_runs.comparison_config(run, model=model, micro_batch_size=2, global_batch_size=4, train_iters=3,
                                         split="90,10,0")


def test_tp2_trains_like_tp1_from_megatrons_own_cpu_initialisation(base):
    """Both initialise on the CPU with the same seed (full master weights, then split): the
    per-iteration losses agree to float tolerance, and the executed command is the generated one."""
    ref = layout_runs.run_layout(base, Layout(1, 1, 1), initial="own", progress=False, timeout_s=300)
    tp2 = layout_runs.run_layout(base, Layout(2, 1, 1), initial="own", progress=False, timeout_s=300,
                                 checkpoint_dir=base.run_path.parent / "checkpoints_tp2")
    assert len(ref.losses) == len(tp2.losses) == 3
    assert ref.losses[-1] < ref.losses[0]
    row = layout_runs.compare_losses(ref, [tp2])[0]
    assert row["within_atol"], row
    assert tp2.command == tp2.generated_command and "--nproc_per_node=2" in tp2.command
    assert tp2.command[3:7] == ["--nproc_per_node=2", "--nnodes=1", "--node_rank=0", "--master_addr=127.0.0.1"]
    from helpers.learn import checkpointing

    saved = checkpointing.read_model_config(base.run_path.parent / "checkpoints_tp2")
    assert saved["tensor_model_parallel_size"] == 2 and saved["iteration"] == 3
    again = layout_runs.run_layout(base, Layout(2, 1, 1), initial="own", progress=False,
                                   checkpoint_dir=base.run_path.parent / "checkpoints_tp2")
    assert again.skipped and again.losses == tp2.losses
    # Nothing already produced is overwritten: another config in the same folder, or a foreign checkpoint.
    from dataclasses import replace

    with pytest.raises(ValueError, match="holds a run of another config"):
        layout_runs.run_layout(replace(base, lr=2e-3), Layout(2, 1, 1), initial="own", progress=False,
                               checkpoint_dir=base.run_path.parent / "checkpoints_tp2")
    with pytest.raises(ValueError, match="did not make"):
        layout_runs.run_layout(base, Layout(2, 1, 1), initial="own", name="other", progress=False,
                               checkpoint_dir=base.run_path.parent / "checkpoints_tp2")
    assert checkpointing.latest_iteration(base.run_path.parent / "checkpoints_tp2") == 3
    # A copied run folder keeps its finished runs: the paths in their run.json are the old folder's.
    import shutil

    moved = base.run_path.parent / (base.run_path.name + "_moved")
    shutil.copytree(base.run_path, moved)
    paths = {k: getattr(base, k).replace(str(base.run_path), str(moved)) for k in ("data_prefix", "tokenizer_dir")
             if getattr(base, k)}
    copied = layout_runs.run_layout(replace(base, run_dir=str(moved), **paths), Layout(1, 1, 1), initial="own",
                                    progress=False)
    assert copied.skipped and copied.losses == ref.losses


def test_shards_on_real_tp2_ranks_match_the_formulas(base):
    ranks = shards.inspect_shards(base, Layout(2, 1, 1), timeout_s=300)
    assert [r["rank"] for r in ranks] == [0, 1]
    for r in ranks:
        assert r["groups"]["tp"] == [0, 1] and r["tp_rank"] == r["rank"]
        assert r["num_parameters"] == memory.parameters_per_rank(base.model, 2, 1, 0)
        assert r["parameter_bytes"] == 4 * r["num_parameters"]
        assert r["tp_allreduce"] == shards.expected_tp_allreduces(2, True, True)
        shapes = {n: (s, d) for n, s, d in r["params"]}
        assert shapes["decoder.layers.1.self_attention.linear_qkv.weight"] == ([96, 64], 0)
        assert shapes["decoder.layers.1.mlp.linear_fc2.weight"] == ([64, 128], 1)
        assert shapes["decoder.layers.1.input_layernorm.weight"] == ([64], None)
    rows = shards.shard_table(ranks)
    assert list(rows[0])[1] == "full shape" and list(rows[0].values())[2:] == ["0-1", "0-1"]
    qkv = next(r for r in rows if r["parameter"] == "decoder.layers.N.self_attention.linear_qkv.weight")
    assert qkv["full shape"] == "[192, 64]"
    assert qkv["rank 0 (tp0 pp0)"] == "[96, 64] split dim 0"
    summary = shards.rank_summary(ranks, base.model)
    assert [r["match"] for r in summary] == [True, True]
    table = results.markdown_table(rows)
    assert table.splitlines()[0].startswith("| parameter | full shape | rank 0 (tp0 pp0) | rank 1 (tp1 pp0) |")


def test_the_interleaved_pipeline_trains_like_one_process_from_the_same_weights(tmp_path):
    """Issue 29: PP=2 with two virtual stages per rank (--num-virtual-stages-per-pipeline-rank 2, the interleaved
    1F1B schedule: rank 0 holds layers 0 and 2, rank 1 layers 1 and 3), started from the one-process model's
    initial weights: the per-iteration losses agree with one process to float tolerance."""
    from dataclasses import replace

    from helpers.runner import data_stage

    data = data_stage.build_data(tmp_path, max_files=60, vocab_size=512, split="90,10,0", progress=False)
    model = ModelConfig(num_layers=4, hidden_size=64, num_attention_heads=4, seq_length=64, max_position_embeddings=64,
                        vocab_size=data.vocab_size)
    four = layout_runs.comparison_config(tmp_path, model=model, micro_batch_size=2, global_batch_size=4, train_iters=3,
                                         split="90,10,0")
    ref = layout_runs.run_layout(four, Layout(1, 1, 1), progress=False, timeout_s=300)
    interleaved = replace(four, num_virtual_stages_per_pipeline_rank=2)
    v2 = layout_runs.run_layout(interleaved, Layout(1, 2, 1), name="tp1_pp2_dp1_vp2", progress=False, timeout_s=300)
    assert "--num-virtual-stages-per-pipeline-rank" in v2.command and len(v2.losses) == 3
    row = layout_runs.compare_losses(ref, [v2])[0]
    assert row["within_atol"], row
    with pytest.raises(ValueError, match="needs at least 2 virtual stages on each of at least 2 pipeline ranks"):
        replace(four, num_virtual_stages_per_pipeline_rank=3, pipeline_model_parallel_size=2).check(world_size=2, files=False)


def test_local_layers_keep_what_torchs_unfused_operations_save():
    """fused=False: what megatron-core's local layers save beyond the fused kernels (measured in notebook 05b):
    RMSNorm's normalized output and fp32 rstd, K and V repeated to every head, SwiGLU's extra copy, RoPE's cos
    and sin, a causal mask per layer."""
    act = memory.activation_bytes_per_layer
    llama = replace(HAND, swiglu=True, num_query_groups=1, ffn_hidden_size=16, add_bias_linear=False,
                    normalization="RMSNorm", position_embedding_type="rope")
    s, b, h, d, f, e = 4, 2, 8, 4, 16, 4
    extra = 2 * (e * s * b * h + 4 * s * b) + e * 2 * s * b * (h - d) + e * s * b * f + 4 * e * s * d + s * s
    assert act(llama, 2, bytes_per_value=4, fused=False) == act(llama, 2, bytes_per_value=4) + extra
    gpt2 = act(HAND, 2, bytes_per_value=4, fused=False) - act(HAND, 2, bytes_per_value=4)
    assert gpt2 == 2 * 8 * s * b + s * s  # LayerNorm's mean and rstd; the mask (no RoPE, MHA, GELU)
    full = act(llama, 2, bytes_per_value=4, recompute="full", fused=False)
    assert full == e * s * b * h  # only the layer's input, whatever the kernels


def test_the_calculator_refuses_what_megatron_core_cannot_run():
    """Breaker (issue 29): impossible interleaving, expert parallelism and stages are named, not computed."""
    from helpers.learn.memory import memory_per_gpu

    llama = replace(HAND, num_layers=4, swiglu=True, add_bias_linear=False, normalization="RMSNorm",
                    position_embedding_type="rope", num_experts=4)
    for kwargs, named in (({"num_virtual_stages": 3}, "num_virtual_stages=3"), ({"num_virtual_stages": 1}, "num_virtual_stages=1"),
                          ({"expert_model_parallel_size": 0}, "expert_model_parallel_size=0"),
                          ({"expert_model_parallel_size": 4}, "divide the data-parallel size 2"), ({"stage": -1}, "stage=-1")):
        with pytest.raises(ValueError, match=re.escape(named)):
            memory_per_gpu(llama, Layout(1, 2, 2), **kwargs)
    with pytest.raises(ValueError, match="num_virtual_stages=2"):
        memory_per_gpu(llama, Layout(1, 1, 2), num_virtual_stages=2)  # no pipeline to interleave
    assert memory_per_gpu(llama, Layout(1, 2, 2), num_microbatches=4, num_virtual_stages=2).microbatches_in_flight == 2.5


@pytest.mark.parametrize("distributed_optimizer,bytes_per_parameter", [(False, 18), (True, 6 + 12 / 8)])
def test_megatron_lms_estimate_reads_the_args_its_parser_makes(distributed_optimizer, bytes_per_parameter, tmp_path):
    """memory.megatron_lm_estimate on megatron_args.parsed_args: 18 bytes per parameter in bf16, 6 + 12/DP with the
    distributed optimizer (Megatron-LM's theoretical_memory_usage.py), at TP = PP = 1 and DP = 8; for a Llama too,
    whose SwiGLU and grouped-query attention come from its flags."""
    from helpers.learn import training_config
    from helpers.runner import megatron_args

    for shape in (memory.MODEL_SHAPES["codeparrot-small"], model_lib.profile("cpu-llama")):
        run = training_config.profile("gpu", str(tmp_path), model=shape, micro_batch_size=1, global_batch_size=8,
                                      precision="bf16", use_distributed_optimizer=distributed_optimizer)
        args = megatron_args.parsed_args(run, world_size=8, target="gpu-pip")
        assert (args.data_parallel_size, args.swiglu) == (8, shape.swiglu)
        est = memory.megatron_lm_estimate(args, num_microbatches=1)
        # Megatron-LM's count leaves out the position embeddings and the norms' and biases' weights: within 1 %
        assert est["weights_and_optimizer"] == pytest.approx(bytes_per_parameter * count_parameters(shape), rel=0.01)
        assert est["activations"] > 0 and est["total"] == est["weights_and_optimizer"] + est["activations"]
