"""The flags of a command come from the machine that will run it (issue 37), checked on a CPU.

A capability matrix (0 / 1 / 8 GPUs x Transformer Engine yes / no x Apex's gradient-fusion extension
yes / no), every argv parsed and validated by Megatron-LM's own ``parse_args`` and ``validate_args``
(they run without CUDA), and the two failures a GPU run met when TE and Apex were assumed,
reproduced with megatron-core's own code.
"""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest

from helpers.learn import training_config
from helpers.runner import megatron_args
from helpers.runner.megatron_args import Target

ROOT = Path(__file__).resolve().parents[1]
HAVE_TE = importlib.util.find_spec("transformer_engine") is not None
HAVE_APEX_FUSION = importlib.util.find_spec("fused_weight_gradient_mlp_cuda") is not None




MATRIX = [(gpus, te, apex) for gpus in (0, 1, 8) for te in (False, True) for apex in (False, True)]


@pytest.mark.parametrize("gpus,te,apex", MATRIX, ids=[f"{g}gpu-te{int(t)}-apex{int(a)}" for g, t, a in MATRIX])
@pytest.mark.parametrize("profile", ["cpu", "gpu", "codeparrot-small"])
def test_the_capability_matrix(gpus, te, apex, profile, tmp_path):
    target = Target("matrix", gpus, te and gpus > 0, apex and gpus > 0, apex and gpus > 0, gpus > 0)
    cfg = training_config.profile(profile, str(tmp_path))
    argv = megatron_args.arguments(cfg, target=target)
    args = megatron_args.parsed_args(cfg, target=target)  # Megatron-LM's parse_args and validate_args on argv
    rope = cfg.model.position_embedding_type == "rope"
    if not gpus:
        assert (args.distributed_backend, args.transformer_impl, args.use_cpu_initialization) == ("gloo", "local", True)
        assert not args.bf16 and not args.gradient_accumulation_fusion and args.num_workers == 0
        assert args.apply_rope_fusion is False if rope else True
        assert "--cross-entropy-loss-fusion" not in argv
        return
    assert args.distributed_backend == "nccl" and not args.use_cpu_initialization
    assert args.bf16 is True, "precision 'auto' on a GPU with bf16 in hardware"
    assert args.transformer_impl == ("transformer_engine" if te else "local")
    assert args.gradient_accumulation_fusion is apex, "the output layer's fusion needs Apex's extension"
    assert args.cross_entropy_loss_fusion is True
    if rope:
        assert args.apply_rope_fusion is te, "fused RoPE is Transformer Engine's"
    if not te and not apex:
        assert args.masked_softmax_fusion is False, "the local attention's fused softmax is Apex's"
    if cfg.use_distributed_optimizer:  # codeparrot-small: the guide's 8-GPU run
        assert args.use_distributed_optimizer and args.overlap_grad_reduce and args.overlap_param_gather


def test_a_named_target_writes_the_gpu_command_on_this_cpu(tmp_path):
    cfg = training_config.profile("gpu", str(tmp_path))
    text = megatron_args.shell_command(cfg, target="gpu-te", script="pretrain_gpt.py", nproc_per_node=8)
    first, rest = text.split("\n", 1)
    assert first == "# written for target gpu-te: CUDA GPUs, Transformer Engine, no Apex gradient fusion, bf16"
    assert "    --bf16 \\\n" in rest and "    --transformer-impl transformer_engine \\\n" in rest
    assert "--distributed-backend" not in rest and "--use-cpu-initialization" not in rest
    assert "--micro-batch-size 32" in rest  # a micro-batch that fills the GPU (32 x 1,024 tokens)


def test_a_precision_the_target_cannot_run_is_refused_by_name(tmp_path):
    cfg = training_config.profile("cpu", str(tmp_path), precision="bf16")  # a config may name bf16 anywhere
    assert "--bf16" in megatron_args.arguments(cfg, target="gpu-pip")
    with pytest.raises(ValueError, match=r"precision='bf16' needs a CUDA GPU.*target cpu.*use 'fp32' or 'auto'"):
        megatron_args.arguments(cfg, target="cpu")
    with pytest.raises(ValueError, match="target='h100' is unknown: choose one of cpu, gpu-pip, gpu-te, gpu-te-apex"):
        megatron_args.arguments(cfg, target="h100")
    fp16 = megatron_args.arguments(cfg, target=replace(megatron_args.TARGETS["gpu-pip"], bf16=False))
    assert "--bf16" in fp16, "an explicit precision is kept"
    auto = training_config.profile("cpu", str(tmp_path))
    assert "--fp16" in megatron_args.arguments(auto, target=replace(megatron_args.TARGETS["gpu-pip"], bf16=False))


def test_the_probe_reads_the_devices_and_libraries_this_process_sees(monkeypatch):
    import torch

    assert megatron_args.probe_target() == Target("this machine", 0, False, False, False, False)  # this CPU machine
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 8)
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda including_emulation=True: True)
    probed = megatron_args.probe_target()
    assert (probed.gpus, probed.bf16, probed.transformer_engine, probed.apex_gradient_fusion) == (8, True, HAVE_TE, HAVE_APEX_FUSION)
    flags = megatron_args.arguments(training_config.profile("gpu", "/tmp/x"))
    assert "--bf16" in flags and flags[flags.index("--transformer-impl") + 1] == ("transformer_engine" if HAVE_TE else "local")


def test_the_flag_table_labels_each_target_flag(tmp_path):
    cfg = training_config.profile("codeparrot-small", str(tmp_path))
    rows = {r["today"]: r for r in megatron_args.flag_table(cfg, target="gpu-te")}
    assert rows["--bf16"]["the guide (2022)"] == "--fp16" and rows["--bf16"]["change"] == "replaced"
    assert rows["--transformer-impl"]["change"] == "GPU: gpu-te" and rows["--transformer-impl"]["value"] == "transformer_engine"
    assert "fused_weight_gradient_mlp_cuda" in rows["--no-gradient-accumulation-fusion"]["from the series"]
    assert {"--overlap-grad-reduce", "--overlap-param-gather", "--cross-entropy-loss-fusion"} <= set(rows)


def test_the_command_line_tool_states_its_target(tmp_path):
    cfg = training_config.profile("gpu", str(tmp_path))
    cfg.to_json(tmp_path / "run.json")
    run = lambda *a: subprocess.run([sys.executable, "-m", "helpers.runner.megatron_args", str(tmp_path), *a],  # noqa: E731
                                    capture_output=True, text=True, cwd=ROOT, timeout=120)
    gpu = run("--gpu")
    assert gpu.returncode == 0, gpu.stderr
    assert "# written for target gpu-te:" in gpu.stdout and "--bf16" in gpu.stdout
    assert "--transformer-impl transformer_engine" in gpu.stdout
    pip = run("--target", "gpu-pip")
    assert "--transformer-impl local" in pip.stdout and "--no-masked-softmax-fusion" in pip.stdout
    here = run()
    assert "# written for target this machine: no GPU" in here.stdout and "--distributed-backend gloo" in here.stdout
    bad = run("--target", "tpu")
    assert bad.returncode == 2 and "invalid choice: 'tpu'" in bad.stderr


@pytest.mark.skipif(HAVE_TE, reason="Transformer Engine is installed: its spec builds")
def test_without_te_megatron_cores_te_spec_fails_so_the_flags_say_local(tmp_path):
    """The failure of issue 37 (1): Megatron-LM's default --transformer-impl builds the TE spec."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_with_transformer_engine_spec

    with pytest.raises(Exception):  # megatron-core 0.19.2: TypeError 'NoneType' object is not callable
        get_gpt_layer_with_transformer_engine_spec()
    argv = megatron_args.arguments(training_config.profile("gpu", str(tmp_path)), target="gpu-pip")
    assert argv[argv.index("--transformer-impl") + 1] == "local"


@pytest.mark.skipif(HAVE_APEX_FUSION, reason="Apex's fused_weight_gradient_mlp_cuda is installed")
def test_without_apex_the_output_layer_refuses_gradient_fusion_so_the_flags_turn_it_off(tmp_path):
    """The failure of issue 37 (2): megatron-core's ColumnParallelLinear (the output layer, TE or not)."""
    from megatron.core.model_parallel_config import ModelParallelConfig
    from megatron.core.tensor_parallel.layers import ColumnParallelLinear
    from megatron.training.arguments import core_transformer_config_from_args

    from helpers.learn import distributed

    with distributed.single_process():
        def layer(fusion: bool):
            config = ModelParallelConfig(gradient_accumulation_fusion=fusion, use_cpu_initialization=True)
            return ColumnParallelLinear(8, 8, config=config, init_method=lambda w: w, bias=False)

        with pytest.raises(RuntimeError, match="fused_weight_gradient_mlp_cuda"):
            layer(True)
        for name in ("gpu-pip", "gpu-te"):
            args = megatron_args.parsed_args(training_config.profile("gpu", str(tmp_path)), target=name)
            fusion = core_transformer_config_from_args(args).gradient_accumulation_fusion
            assert fusion is False
            assert layer(fusion).weight.shape == (8, 8)


def _fake_gpus(monkeypatch, count: int) -> None:
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: count > 0)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: count)
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda including_emulation=True: count > 0)


@pytest.mark.parametrize("gpus", [1, 2])
def test_a_layouts_children_get_the_flags_of_the_devices_they_see(gpus, monkeypatch, tmp_path):
    """With one GPU a DP=2 comparison hides it from the children: their flags are the CPU's though the parent sees CUDA."""
    from helpers.demos import layout_runs
    from helpers.support.environment import IEEE_FP32_ENV

    _fake_gpus(monkeypatch, gpus)
    cfg = replace(training_config.profile("cpu", str(tmp_path)), precision="fp32")
    argv, env = layout_runs.child_arguments(cfg, world_size=2)
    flag = lambda name: argv[argv.index(name) + 1] if name in argv else None  # noqa: E731
    if gpus == 1:
        assert env == {"CUDA_VISIBLE_DEVICES": ""}
        assert flag("--distributed-backend") == "gloo" and flag("--transformer-impl") == "local"
    else:
        assert env == IEEE_FP32_ENV  # TF32 off for the fp32 comparison
        assert flag("--distributed-backend") is None and "--use-cpu-initialization" not in argv
    megatron_args.parse(argv)  # Megatron-LM's parse_args and validate_args accept the child's flags
