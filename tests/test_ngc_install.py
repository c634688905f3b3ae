"""The NGC route of ``make install`` on a CPU machine: the container detection, the install plan against a
made-up constraint file and a stand-in torch (fake ``*.dist-info`` folders), the Makefile's wiring with a
stand-in Python that records the pip commands, and the GPU image's Dockerfile (tools/ngc_requirements.py)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tools"))
import container_check  # noqa: E402  (tools/ is not a package)
import ngc_requirements  # noqa: E402

needs_make = pytest.mark.skipif(shutil.which("make") is None, reason="needs make")

#: What a container's Python sees: its own torch, Transformer Engine and Apex builds, and a numpy.
CONTAINER = {"torch": "2.9.0a0+50eac811a6", "transformer_engine": "2.8.0+40c69e7", "apex": "0.1",
             "numpy": "1.26.4", "Jinja2": "3.1.4"}
CONSTRAINTS = "# NGC 26.09\ntorch==2.9.0a0+50eac811a6\nnumpy==1.26.4\njinja2==3.1.4 ; python_version>='3'\n"


def _site_packages(folder: Path, dists: dict[str, str]) -> Path:
    """A folder of ``name-version.dist-info/METADATA`` stand-ins, as pip would leave them."""
    folder.mkdir(parents=True, exist_ok=True)
    for name, version in dists.items():
        info = folder / f"{name}-{version}.dist-info"
        info.mkdir()
        (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n")
    return folder


def test_the_container_is_detected_by_nvidia_pytorch_version_and_ngc_forces_either_route(tmp_path):
    constraint = tmp_path / "constraint.txt"
    constraint.write_text(CONSTRAINTS)
    ngc, why = ngc_requirements.container_route({"NVIDIA_PYTORCH_VERSION": "26.09", "PIP_CONSTRAINT": str(constraint)})
    assert ngc is True and why == f"NVIDIA_PYTORCH_VERSION=26.09 (NGC PyTorch container; {constraint})"
    assert ngc_requirements.container_route({}) == (False, "not an NGC PyTorch container (NVIDIA_PYTORCH_VERSION unset)")
    assert ngc_requirements.container_route({"PIP_CONSTRAINT": str(constraint)})[0] is False  # a site's pip policy alone
    assert ngc_requirements.container_route({"NVIDIA_PYTORCH_VERSION": "26.09", "NGC": "0"})[0] is False
    assert ngc_requirements.container_route({"NGC": "1"})[0] is True
    with pytest.raises(ValueError, match="NGC='yes': use NGC=1"):
        ngc_requirements.container_route({"NGC": "yes"})


def test_the_route_command_prints_the_route_and_its_reason():
    env = {**os.environ, "NVIDIA_PYTORCH_VERSION": "26.09", "NGC": ""}
    env.pop("PIP_CONSTRAINT", None)
    out = subprocess.run([sys.executable, str(ROOT / "tools" / "ngc_requirements.py"), "route"], env=env,
                         capture_output=True, text=True)
    assert out.returncode == 0 and out.stdout == "ngc\n"
    assert "make install: the NGC route, NVIDIA_PYTORCH_VERSION=26.09 (NGC PyTorch container; no pip constraint file)" in out.stderr
    bad = subprocess.run([sys.executable, str(ROOT / "tools" / "ngc_requirements.py"), "route"],
                         env={**env, "NGC": "2"}, capture_output=True, text=True)
    assert bad.returncode == 2 and bad.stdout == "" and "NGC='2'" in bad.stderr


def test_installed_versions_reads_the_dist_info_folders(tmp_path):
    site = _site_packages(tmp_path / "site", CONTAINER)
    assert ngc_requirements.installed_versions([str(site)]) == {
        "torch": "2.9.0a0+50eac811a6", "transformer-engine": "2.8.0+40c69e7", "apex": "0.1", "numpy": "1.26.4",
        "jinja2": "3.1.4"}


def test_the_plan_keeps_the_containers_torch_and_pins_and_holds_its_builds(tmp_path):
    installed = ngc_requirements.installed_versions([str(_site_packages(tmp_path / "site", CONTAINER))])
    requirements = (ROOT / "requirements.txt").read_text().splitlines()
    plan = ngc_requirements.install_plan(requirements, CONSTRAINTS.splitlines(), installed)
    assert "megatron-core==0.19.2" in plan.requirements and "transformers==5.24.0" in plan.requirements
    assert not any(r.startswith(("torch==", "numpy==")) for r in plan.requirements)
    assert len(plan.requirements) == len(ngc_requirements.pinned_names(requirements)) - 2  # torch and numpy left
    assert plan.notes == ["torch==2.14.1: skipped, the container's own torch 2.9.0a0+50eac811a6 stays",
                          "numpy==2.4.6: skipped, the container pins numpy==1.26.4"]
    # pip -c: the container's constraint lines, then its builds not already pinned, at their installed versions
    assert plan.constraints == ["torch==2.9.0a0+50eac811a6", "numpy==1.26.4", "jinja2==3.1.4 ; python_version>='3'",
                                "apex==0.1", "transformer-engine==2.8.0+40c69e7"]


def test_the_plan_refuses_a_python_without_torch(tmp_path):
    installed = ngc_requirements.installed_versions([str(_site_packages(tmp_path / "site", {"numpy": "1.26.4"}))])
    with pytest.raises(RuntimeError, match="has none: run make install inside nvcr.io/nvidia/pytorch.*NGC=0"):
        ngc_requirements.install_plan(["torch==2.14.1"], [], installed)


def test_a_venv_that_does_not_fit_the_route_is_named_with_the_fix(tmp_path):
    (tmp_path / "pyvenv.cfg").write_text("home = /usr/bin\ninclude-system-site-packages = false\n")
    assert "rm -rf" in ngc_requirements.venv_mismatch(tmp_path, ngc=True)
    assert "without the container's packages" in ngc_requirements.venv_mismatch(tmp_path, ngc=True)
    assert ngc_requirements.venv_mismatch(tmp_path, ngc=False) is None
    (tmp_path / "pyvenv.cfg").write_text("home = /usr/bin\ninclude-system-site-packages = true\n")
    assert ngc_requirements.venv_mismatch(tmp_path, ngc=True) is None
    assert "over an NGC container's site-packages" in ngc_requirements.venv_mismatch(tmp_path, ngc=False)
    assert ngc_requirements.venv_mismatch(tmp_path / "none", ngc=True) is None  # no venv yet: nothing to refuse


def test_the_plan_command_writes_the_requirements_and_constraints_for_pip(tmp_path):
    site = _site_packages(tmp_path / "site", CONTAINER)  # first on sys.path: it stands in for the container's
    constraint = tmp_path / "constraint.txt"
    constraint.write_text(CONSTRAINTS)
    env = {**os.environ, "PYTHONPATH": str(site), "PIP_CONSTRAINT": str(constraint)}
    out = subprocess.run([sys.executable, str(ROOT / "tools" / "ngc_requirements.py"), "plan",
                          str(ROOT / "requirements.txt"), "--out-dir", str(tmp_path)], env=env, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    wanted = (tmp_path / "requirements-ngc.txt").read_text().splitlines()
    assert "megatron-core==0.19.2" in wanted and not any(w.startswith(("torch==", "numpy==")) for w in wanted)
    held = (tmp_path / "constraints-ngc.txt").read_text().splitlines()
    assert held[0] == "torch==2.9.0a0+50eac811a6" and "transformer-engine==2.8.0+40c69e7" in held
    assert "the container's own torch 2.9.0a0+50eac811a6 stays" in out.stderr and str(constraint) in out.stderr
    missing = subprocess.run([sys.executable, str(ROOT / "tools" / "ngc_requirements.py"), "plan",
                              str(ROOT / "requirements.txt"), "--out-dir", str(tmp_path)],
                             env={**env, "PIP_CONSTRAINT": str(tmp_path / "gone.txt")}, capture_output=True, text=True)
    assert missing.returncode == 1 and "gone.txt" in missing.stderr and "fix or unset PIP_CONSTRAINT" in missing.stderr


def _stand_in_python(tmp_path: Path) -> tuple[Path, Path]:
    """An executable that runs this Python for everything but ``-m pip``, whose arguments it records."""
    log = tmp_path / "pip.log"
    py = tmp_path / "python"
    py.write_text(f'#!/bin/sh\nif [ "$1" = -m ] && [ "$2" = pip ]; then shift 2; echo "pip $*" >> {log}; exit 0; fi\n'
                  f'exec {sys.executable} "$@"\n')
    py.chmod(0o755)
    return py, log


@needs_make
def test_make_install_in_the_container_installs_only_the_missing_pins_with_the_containers_constraints(tmp_path):
    site = _site_packages(tmp_path / "site", CONTAINER)
    constraint = tmp_path / "constraint.txt"
    constraint.write_text(CONSTRAINTS)
    venv = tmp_path / "venv"
    venv.mkdir()
    (venv / "pyvenv.cfg").write_text("include-system-site-packages = true\n")  # as the NGC route makes it
    py, log = _stand_in_python(tmp_path)
    env = {**os.environ, "NVIDIA_PYTORCH_VERSION": "26.09", "PIP_CONSTRAINT": str(constraint), "PYTHONPATH": str(site)}
    env.pop("NGC", None)
    out = subprocess.run(["make", "-C", str(ROOT), "install", f"VENV={venv}", f"PY={py}", f"WHEELHOUSE={tmp_path}/none"],
                         env=env, capture_output=True, text=True)
    assert out.returncode == 0, out.stdout + out.stderr
    assert log.read_text().splitlines() == [
        f"pip install --disable-pip-version-check -q -c {venv}/constraints-ngc.txt -r {venv}/requirements-ngc.txt",
        "pip install --disable-pip-version-check -q --no-deps -e ."]
    assert "torch==2.14.1" not in (venv / "requirements-ngc.txt").read_text()
    assert "torch==2.9.0a0+50eac811a6" in (venv / "constraints-ngc.txt").read_text().splitlines()
    assert (venv / ".installed").exists()
    outside = subprocess.run(["make", "-C", str(ROOT), "install", f"VENV={venv}", f"PY={py}", "NGC=0"],
                             env=env, capture_output=True, text=True)
    assert outside.returncode != 0 and f"rm -rf {venv} && make install" in outside.stderr


@needs_make
def test_make_creates_the_containers_venv_over_its_site_packages(tmp_path):
    venv = tmp_path / "venv"
    out = subprocess.run(["make", "-C", str(ROOT), "venv-python", f"VENV={venv}", "NGC=1"], capture_output=True, text=True)
    if "No supported Python found" in out.stderr:
        pytest.skip("no Python 3.12/3.13 on PATH for tools/find-python")
    assert out.returncode == 0, out.stderr
    assert "over the container's site-packages" in out.stdout and "the NGC route, NGC=1" in out.stderr
    assert "include-system-site-packages = true" in (venv / "pyvenv.cfg").read_text()
    again = subprocess.run(["make", "-C", str(ROOT), "venv-python", f"VENV={venv}", "NGC=0"], capture_output=True, text=True)
    assert again.returncode != 0 and "made over an NGC container's site-packages" in again.stderr


def test_the_gpu_image_runs_make_install_into_a_venv_outside_the_mounted_clone():
    from helpers.demos import launch_plans

    instrs = container_check.instructions(ROOT / "Dockerfile")
    assert instrs[1] == ("FROM", "nvcr.io/nvidia/pytorch:${NGC_TAG}") and ("ARG", "NGC_TAG=26.09-py3") in instrs
    assert ("RUN", "make install") in instrs
    assert container_check.env(instrs)["VENV"] == "/opt/venv" == str(Path(launch_plans.IMAGE_PYTHON).parent.parent)
    assert container_check.env(instrs)["PATH"].startswith("/opt/venv/bin:")
    assert container_check.cmd(instrs)[:4] == ["python", "-m", "jupyter", "lab"]  # the venv's Python: its kernel too
    missing = [s for s in container_check.copy_sources(instrs) if not (ROOT / s).exists()]
    assert not missing
