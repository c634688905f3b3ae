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
