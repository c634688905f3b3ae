"""tools/: the interpreter picker the Makefile runs before it creates .venv, and the NGC
requirements filter of ``make install-ngc``."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
FIND_PYTHON = ROOT / "tools" / "find-python"
sys.path.insert(0, str(ROOT / "tools"))
import ngc_requirements  # noqa: E402


def _fake_python(folder: Path, name: str, version: str) -> Path:
    """An executable that answers the version probe the way a real ``python`` would."""
    path = folder / name
    path.write_text(f"#!/bin/sh\necho {version}\n")
    path.chmod(0o755)
    return path


def _bin(tmp_path: Path, tools=("sh", "cat", "make", "mkdir", "touch", "grep")) -> Path:
    """A PATH folder holding only the named system tools (and no Python)."""
    folder = tmp_path / "bin"
    folder.mkdir()
    for tool in tools:
        (folder / tool).symlink_to(shutil.which(tool))
    return folder


def _find(path: Path, **env) -> subprocess.CompletedProcess:
    return subprocess.run([str(FIND_PYTHON)], env={"PATH": str(path), **env}, capture_output=True, text=True)


def test_supported_versions_agree_everywhere():
    supported = re.search(r'^SUPPORTED="([^"]+)"', FIND_PYTHON.read_text(), re.M).group(1).split()
    assert supported == ["3.12", "3.13"]
    assert 'requires-python = ">=3.12,<3.14"' in (ROOT / "pyproject.toml").read_text()
    assert re.search(r"^\s*-\s*python=3\.12\s*$", (ROOT / "environment.yml").read_text(), re.M)


def test_only_python_3_11_stops_with_the_versions_and_the_fix(tmp_path):
    folder = _bin(tmp_path)
    _fake_python(folder, "python3", "3.11")
    out = _find(folder)
    assert out.returncode == 1 and out.stdout == ""
    assert "needs Python 3.12 or 3.13" in out.stderr
    assert "python3 -> 3.11" in out.stderr and "pyenv install 3.12" in out.stderr and "PYTHON=" in out.stderr


def test_first_supported_interpreter_wins(tmp_path):
    folder = _bin(tmp_path)
    _fake_python(folder, "python3", "3.11")
    py313 = _fake_python(folder, "python3.13", "3.13")
    assert _find(folder).stdout.strip() == str(py313)
    py312 = _fake_python(folder, "python3.12", "3.12")
    assert _find(folder).stdout.strip() == str(py312)


def test_pyenv_versions_are_found_when_their_shims_do_not_run(tmp_path):
    folder = _bin(tmp_path)
    (folder / "python3.12").write_text("#!/bin/sh\necho 'pyenv: python3.12: command not found' >&2\nexit 127\n")
    (folder / "python3.12").chmod(0o755)
    root = tmp_path / "pyenv"
    (root / "versions" / "3.12.1" / "bin").mkdir(parents=True)
    real = _fake_python(root / "versions" / "3.12.1" / "bin", "python3.12", "3.12")
    (folder / "pyenv").write_text(f"#!/bin/sh\n[ \"$1\" = root ] && echo {root}\n")
    (folder / "pyenv").chmod(0o755)
    assert _find(folder).stdout.strip() == str(real)


def test_an_explicit_python_of_the_wrong_version_is_refused(tmp_path):
    folder = _bin(tmp_path)
    py311 = _fake_python(folder, "python3.11", "3.11")
    _fake_python(folder, "python3.12", "3.12")
    out = _find(folder, PYTHON=str(py311))
    assert out.returncode == 1 and "is Python 3.11" in out.stderr


@pytest.mark.skipif(shutil.which("make") is None, reason="needs make")
def test_make_install_with_only_3_11_creates_nothing(tmp_path):
    """The README's commands, given only Python 3.11, stop at once and leave no .venv behind."""
    repo = tmp_path / "repo"
    (repo / "tools").mkdir(parents=True)
    for name in ("Makefile", "requirements.txt", "pyproject.toml"):
        shutil.copy(ROOT / name, repo / name)
    shutil.copy(FIND_PYTHON, repo / "tools" / "find-python")
    folder = _bin(tmp_path)
    _fake_python(folder, "python3", "3.11")
    for target in ("tutorial", "test"):
        out = subprocess.run(["make", "-C", str(repo), target], env={"PATH": str(folder)},
                             capture_output=True, text=True)
        assert out.returncode != 0
        assert "needs Python 3.12 or 3.13" in out.stderr
        assert not (repo / ".venv").exists()


def _repo_with_venv_dir(tmp_path):
    """A copy of the Makefile, its inputs and tools/find-python, with an empty ``.venv/bin``."""
    repo = tmp_path / "repo"
    (repo / "tools").mkdir(parents=True)
    (repo / ".venv" / "bin").mkdir(parents=True)
    for name in ("Makefile", "requirements.txt", "pyproject.toml"):
        shutil.copy(ROOT / name, repo / name)
    shutil.copy(FIND_PYTHON, repo / "tools" / "find-python")
    return repo


@pytest.mark.skipif(shutil.which("make") is None, reason="needs make")
def test_make_refuses_a_venv_left_from_python_3_11(tmp_path):
    repo = _repo_with_venv_dir(tmp_path)
    _fake_python(repo / ".venv" / "bin", "python", "3.11")
    out = subprocess.run(["make", "-C", str(repo), "test"], env={"PATH": str(_bin(tmp_path))},
                         capture_output=True, text=True)
    assert out.returncode != 0
    assert ".venv was made with Python 3.11;" in out.stderr and "rm -rf .venv" in out.stderr  # once, not 3.113.11
    assert (repo / ".venv" / "bin" / "python").exists(), "the old venv is reported, not deleted"


def test_ngc_requirements_keep_the_containers_torch_and_constrained_pins():
    requirements = ["# comment", "torch==2.14.1", "megatron-core==0.19.2", "numpy==2.4.6", "Typing_Extensions==4.15"]
    constraints = ["numpy<=2.1", "typing-extensions==4.12.2  # NGC", "triton==3.5.0"]
    keep, notes = ngc_requirements.ngc_requirements(requirements, constraints)
    assert keep == ["megatron-core==0.19.2"]
    assert notes == ["torch==2.14.1: skipped, the container's own torch stays",
                     "numpy==2.4.6: skipped, the container pins numpy<=2.1",
                     "Typing_Extensions==4.15: skipped, the container pins typing-extensions==4.12.2"]


def test_a_missing_constraint_file_is_named(tmp_path):
    with pytest.raises(FileNotFoundError, match="nope.txt"):
        ngc_requirements.constraint_files({"PIP_CONSTRAINT": f"{tmp_path}/nope.txt"})


@pytest.mark.skipif(shutil.which("make") is None, reason="needs make")
def test_make_refuses_a_venv_whose_interpreter_is_gone(tmp_path):
    repo = _repo_with_venv_dir(tmp_path)
    (repo / ".venv" / "bin" / "python").symlink_to(tmp_path / "uninstalled-python3.11")
    out = subprocess.run(["make", "-C", str(repo), "install"], env={"PATH": str(_bin(tmp_path))},
                         capture_output=True, text=True)
    assert out.returncode != 0 and "an interpreter that no longer runs" in out.stderr
    assert (repo / ".venv" / "bin" / "python").is_symlink(), "the old venv is reported, not touched"


def test_ngc_requirements_script_reads_pip_constraint(tmp_path):
    constraint = tmp_path / "constraint.txt"
    constraint.write_text("numpy==1.26.4\n")
    out = subprocess.run([sys.executable, str(ROOT / "tools" / "ngc_requirements.py"), str(ROOT / "requirements.txt")],
                         env={**os.environ, "PIP_CONSTRAINT": str(constraint)}, capture_output=True, text=True, check=True)
    lines = out.stdout.split()
    assert "megatron-core==0.19.2" in lines and not any(l.startswith(("torch==", "numpy==")) for l in lines)
    assert str(constraint) in out.stderr and "the container pins numpy==1.26.4" in out.stderr
