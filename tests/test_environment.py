import importlib.metadata
import re
import sys
from pathlib import Path

import pytest

from helpers.support import environment

ROOT = Path(__file__).resolve().parent.parent


def _pins() -> dict[str, str]:
    pins = {}
    for line in (ROOT / "requirements.txt").read_text().splitlines():
        line = line.split("#")[0].strip()
        if line:
            name, _, version = line.partition("==")
            assert version, f"requirements.txt: {line!r} is not pinned with =="
            pins[name.lower()] = version
    return pins


def test_every_requirement_is_pinned_and_apex_is_never_one():
    pins = _pins()
    assert "apex" not in pins, "the PyPI 'apex' is an unrelated project"
    for needed in ("torch", "megatron-core", "transformers", "tokenizers", "papermill", "psutil", "safetensors"):
        assert needed in pins


def test_installed_versions_match_the_pins():
    pins = _pins()
    wrong = {}
    for name, version in pins.items():
        installed = importlib.metadata.version(name)
        if installed.split("+")[0] != version:
            wrong[name] = (version, installed)
    assert not wrong, f"installed versions differ from requirements.txt: {wrong}"


def test_environment_yml_installs_the_same_pins():
    text = (ROOT / "environment.yml").read_text()
    assert re.search(r"^\s*-\s*python=3\.12\s*$", text, re.M)
    assert "conda-forge" in text
    pip_lines = re.findall(r"^\s{6}-\s*(.+)$", text, re.M)
    assert "-r requirements.txt" in pip_lines, "environment.yml must read requirements.txt, the one source of pins"
    # no package pinned a second time in environment.yml
    for name in _pins():
        assert not re.search(rf"^\s*-\s*{re.escape(name)}\b", text, re.M | re.I), f"{name} is pinned twice"


def test_docker_command_has_the_flags_multi_gpu_training_needs(tmp_path):
    cmd = environment.docker_run_command(tmp_path, gpus="2", shm_size="32g", jupyter_port=8899)
    for flag in ("--gpus 2", "--shm-size=32g", "--ulimit memlock=-1", "--ulimit stack=67108864",
                 "-p 8899:8899", f"-v {tmp_path}:", "nvcr.io/nvidia/pytorch:", "make install-ngc"):
        assert flag in cmd


def test_docker_command_keeps_the_quotes_of_a_device_list(tmp_path):
    """Unquoted, a shell hands docker device=0,1, which it reads as a device and a count and refuses."""
    import shlex

    cmd = environment.docker_run_command(tmp_path, gpus='"device=0,1"')
    words = shlex.split(cmd.replace("\\\n", " "))
    assert words[words.index("--gpus") + 1] == '"device=0,1"'


def test_docker_command_rejects_a_bad_port(tmp_path):
    with pytest.raises(ValueError, match="jupyter_port=70000"):
        environment.docker_run_command(tmp_path, jupyter_port=70000)


def test_unrelated_pypi_apex_is_not_mistaken_for_nvidia_apex(tmp_path, monkeypatch):
    fake = tmp_path / "apex"
    fake.mkdir()
    (fake / "__init__.py").write_text("# stand-in for the unrelated PyPI package 'apex'\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    for mod in [m for m in sys.modules if m == "apex" or m.startswith("apex.")]:
        monkeypatch.delitem(sys.modules, mod)
    assert environment.nvidia_apex() == {"apex": False, "FusedAdam": False, "FusedLayerNorm": False}


def test_report_names_a_fallback_for_every_missing_component():
    rows = environment.report()
    names = [r.name for r in rows]
    for needed in ("torch", "CUDA", "NCCL", "gloo", "megatron-core", "transformers", "gigatoken", "Apex FusedAdam",
                   "Transformer Engine"):
        assert needed in names
    for r in rows:
        if not r.found:
            assert r.used_instead not in ("", "-"), r
    table = environment.report_table(rows)
    assert len(table.splitlines()) == len(rows) + 2


@pytest.mark.parametrize("gpus, world, backend, why", [
    (0, 2, "gloo", "no CUDA GPU here"),
    (1, 2, "gloo", "2 ranks but 1 GPU(s): NCCL needs one GPU per rank"),
    (2, 2, "nccl", "2 rank(s) on 2 GPU(s), one GPU each"),
    (8, 2, "nccl", "2 rank(s) on 8 GPU(s)"),
])
def test_the_allreduce_uses_nccl_only_with_a_gpu_per_rank(monkeypatch, gpus, world, backend, why):
    """On a one-GPU machine, rank 1 would ask NCCL for cuda:1, which is not there."""
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: gpus > 0)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: gpus)
    chosen, reason = environment.allreduce_backend(world)
    assert chosen == backend and why in reason


def test_the_report_says_whether_apexs_gradient_fusion_extension_imports(tmp_path, monkeypatch):
    row = next(r for r in environment.report() if r.name == "Apex gradient fusion")
    assert row.found is False and row.used_instead == "--no-gradient-accumulation-fusion"
    (tmp_path / "fused_weight_gradient_mlp_cuda.py").write_text("")  # a stand-in for Apex's compiled extension
    monkeypatch.syspath_prepend(str(tmp_path))
    assert environment.apex_gradient_fusion() is True


def test_ieee_fp32_turns_tf32_off_on_cuda_and_restores_it(monkeypatch):
    """torch's settings can be read and set without a GPU; the context restores what it found."""
    import torch

    backends = (torch.backends.cuda.matmul, torch.backends.cudnn)
    before = [b.fp32_precision for b in backends]
    monkeypatch.delenv("TORCH_ALLOW_TF32_CUBLAS_OVERRIDE", raising=False)
    with environment.ieee_fp32("cuda:0") as arithmetic:
        assert [b.fp32_precision for b in backends] == ["ieee", "ieee"]
        assert arithmetic == "IEEE fp32 on cuda:0 (TF32 off)"
    assert [b.fp32_precision for b in backends] == before
    with environment.ieee_fp32("cpu") as arithmetic:
        assert arithmetic == "IEEE fp32 on cpu" and [b.fp32_precision for b in backends] == before


def test_ieee_fp32_refuses_a_process_whose_tf32_is_forced_on(monkeypatch):
    monkeypatch.setenv("TORCH_ALLOW_TF32_CUBLAS_OVERRIDE", "1")  # as the NGC container sets it
    with pytest.raises(RuntimeError, match="TORCH_ALLOW_TF32_CUBLAS_OVERRIDE=0 NVIDIA_TF32_OVERRIDE=0"):
        with environment.ieee_fp32("cuda"):
            pass
    with environment.ieee_fp32("cpu") as arithmetic:  # a CPU has no TF32 to force
        assert arithmetic == "IEEE fp32 on cpu"


def test_the_docker_command_turns_tf32_off_for_the_fp32_proofs(tmp_path):
    cmd = environment.docker_run_command(tmp_path)
    assert "-e NVIDIA_TF32_OVERRIDE=0" in cmd and "-e TORCH_ALLOW_TF32_CUBLAS_OVERRIDE=0" in cmd
