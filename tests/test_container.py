"""docker/cpu.Dockerfile without a container engine: its COPY sources, its install step run as a script in a
copy of what the image holds at that point, its CMD, and arm64 wheels for every pin (tools/container_check.py)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import urllib.request
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tools"))
import container_check  # noqa: E402  (tools/ is not a package)
import wheelhouse  # noqa: E402

INSTRS = container_check.instructions()
#: Tracked top-level entries the image leaves out, and why.
NOT_IN_IMAGE = {".ci": "the CI script", ".gitignore": "git's", "docker": "only the Dockerfile and its ignore file are copied"}


def _index_reachable() -> bool:
    try:
        urllib.request.urlopen("https://pypi.org/simple/pip/", timeout=10).close()
        return True
    except OSError:
        return False


def _install_index() -> int:
    """Index of the RUN instruction that installs (the one calling tools/container-install.sh)."""
    return next(i for i, (k, a) in enumerate(INSTRS) if k == "RUN" and "tools/container-install.sh" in a)


def test_the_dockerfile_is_parsed_into_its_instructions():
    keywords = [k for k, _ in INSTRS]
    assert keywords[:2] == ["ARG", "FROM"] and keywords[-1] == "CMD"
    assert dict(INSTRS)["ARG"] == "BASE=python:3.12-slim-bookworm"  # Python 3.12 on Debian, as the brief's pins
    assert container_check.env(INSTRS)["VENV"] == "/opt/venv"
    assert container_check.env(INSTRS)["PATH"].startswith("/opt/venv/bin:")


def test_every_copy_and_bind_source_exists_and_the_image_holds_the_whole_repository():
    sources = container_check.copy_sources(INSTRS) + container_check.bind_sources(INSTRS)
    assert "docker/wheels" in container_check.bind_sources(INSTRS)
    missing = [s for s in sources if not (ROOT / s).exists()]
    assert not missing, f"COPY/bind sources not in the repository: {missing}"
    tracked = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True, check=True).stdout.split()
    top = {p.split("/")[0] for p in tracked}
    copied = {s.rstrip("/").split("/")[0] for s in container_check.copy_sources(INSTRS)}
    left = sorted(top - copied - set(NOT_IN_IMAGE))
    assert not left, f"tracked top-level entries the image would lack (COPY them or list them in NOT_IN_IMAGE): {left}"


def test_the_install_step_has_only_the_files_copied_before_it_and_its_script():
    before = container_check.copy_sources(INSTRS, _install_index())
    assert {"requirements.txt", "pyproject.toml", "helpers/", "tools/"} <= set(before)
    script = (ROOT / "tools" / "container-install.sh").read_text()
    for used in ("tools/find-python", "tools/wheelhouse.py", "requirements.txt", "-e ."):
        assert used in script
    assert "WHEELHOUSE=/wheelhouse" in INSTRS[_install_index()][1]


def test_the_cmd_starts_jupyterlab_on_port_8888_from_the_venv():
    command = container_check.cmd(INSTRS)
    assert command[:2] == ["jupyter", "lab"] and "--port=8888" in command and "--ip=0.0.0.0" in command
    assert ("EXPOSE", "8888") in INSTRS
    venv_bin = Path(sys.executable).parent  # the same pins: requirements.txt's jupyterlab gives both scripts
    assert (venv_bin / "jupyter").exists() and (venv_bin / "jupyter-lab").exists()


def test_compatible_platforms_lists_every_older_glibc_and_the_legacy_aliases():
    tags = wheelhouse.compatible_platforms("manylinux_2_28_aarch64")
    assert tags[0] == "manylinux_2_28_aarch64" and tags[-4:-3] == ["manylinux_2_5_aarch64"]
    assert "manylinux_2_17_aarch64" in tags and "manylinux2014_aarch64" in tags and "manylinux1_aarch64" in tags
    assert len(tags) == 24 + 3
    assert wheelhouse.compatible_platforms("manylinux_2_12_x86_64")[-2:] == ["manylinux2010_x86_64", "manylinux1_x86_64"]
    assert wheelhouse.compatible_platforms("macosx_11_0_arm64") == ["macosx_11_0_arm64"]


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_every_pin_has_a_linux_arm64_wheel_for_the_image():
    """pip --dry-run --no-deps for linux/arm64 (about 45 s: the index); with dependencies: make container-check."""
    if not _index_reachable():
        pytest.skip("the package index is not reachable: pip cannot resolve the arm64 wheels")
    r = container_check.resolve("aarch64", no_deps=True)
    pins = [container_check.normalize(line.split("==")[0]) for line in (ROOT / "requirements.txt").read_text().splitlines()
            if "==" in line and not line.startswith("#")]
    assert sorted(r["wheels"]) == sorted(pins)
    for name in ("torch", "megatron-core", "tokenizers", "gigatoken", "safetensors", "numpy"):
        assert "aarch64" in r["wheels"][name], r["wheels"][name]  # compiled, and built for arm64


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_the_install_script_runs_in_a_copy_of_the_image_at_its_install_step(tmp_path):
    """tools/container-install.sh with only what the Dockerfile copied before it, a fresh venv, and pip's
    --dry-run (PIP_EXTRA): the same commands the image runs, resolved against the index, nothing installed."""
    if not _index_reachable():
        pytest.skip("the package index is not reachable: pip cannot resolve the pins")
    repo = tmp_path / "image"
    repo.mkdir()
    for source in container_check.copy_sources(INSTRS, _install_index()):
        src = ROOT / source
        if src.is_dir():
            shutil.copytree(src, repo / source, ignore=shutil.ignore_patterns("__pycache__"))
        else:
            shutil.copy2(src, repo / source)
    wheels = tmp_path / "wheels"
    wheels.mkdir()  # as docker/wheels/ holds no wheel: the index route
    env = {**os.environ, "VENV": str(tmp_path / "venv"), "WHEELHOUSE": str(wheels), "PYTHON": sys.executable,
           "PIP_EXTRA": "--dry-run --no-deps"}
    proc = subprocess.run(["sh", "tools/container-install.sh"], cwd=repo, env=env, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "from the package index" in proc.stdout
    assert "Would install" in proc.stdout and "torch-2.14.1" in proc.stdout and "megatron-core-0.19.2" in proc.stdout
    assert (tmp_path / "venv" / "bin" / "python").exists()


def test_the_install_script_refuses_a_python_the_series_cannot_use(tmp_path):
    fake = tmp_path / "python3.11"
    fake.write_text("#!/bin/sh\necho 3.11\n")
    fake.chmod(0o755)
    env = {**os.environ, "VENV": str(tmp_path / "venv"), "PYTHON": str(fake)}
    proc = subprocess.run(["sh", "tools/container-install.sh"], cwd=ROOT, env=env, capture_output=True, text=True)
    assert proc.returncode == 1
    assert "needs Python 3.12 or 3.13" in proc.stderr
    assert not (tmp_path / "venv").exists()
