"""tools/wheelhouse.py (make wheelhouse / make install from it): a wheelhouse of a small subset of
the pins, installed into a fresh venv with pip --no-index and every network path closed."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tools"))
import wheelhouse  # noqa: E402  (tools/ is not a package)

pytestmark = pytest.mark.timeout(600)


def _pin(name: str) -> str:
    return next(line for line in (ROOT / "requirements.txt").read_text().splitlines() if line.startswith(f"{name}=="))


def test_a_wheelhouse_installs_the_pins_and_the_project_without_a_network(tmp_path):
    project = tmp_path / "project"
    (project / "tinypkg").mkdir(parents=True)
    (project / "tinypkg" / "__init__.py").write_text("VALUE = 42\n")
    (project / "requirements.txt").write_text(_pin("tqdm") + "\n")  # a pin of the series, pure Python
    (project / "pyproject.toml").write_text(  # the series' own build backend (setuptools), read offline too
        '[build-system]\nrequires = ["setuptools>=68"]\nbuild-backend = "setuptools.build_meta"\n'
        '[project]\nname = "tinypkg"\nversion = "0"\n[tool.setuptools]\npackages = ["tinypkg"]\n')
    house = tmp_path / "wheelhouse"
    result = wheelhouse.download(house, project / "requirements.txt", [], "3.12", [sys.executable, "-m", "pip"])
    assert result["files"] >= 2 and result["bytes"] > 10_000  # tqdm and setuptools
    assert any(p.name.startswith("tqdm-") for p in house.glob("*.whl"))
    assert any(p.name.startswith("setuptools-") for p in house.glob("*.whl"))

    subprocess.run([sys.executable, "-m", "venv", str(tmp_path / "venv")], check=True)
    python = str(tmp_path / "venv" / "bin" / "python")
    closed = {k: v for k, v in os.environ.items() if not k.startswith("PIP_") and "proxy" not in k.lower()}
    closed |= {"PIP_CONFIG_FILE": os.devnull,  # no /etc/pip.conf: no extra index, no find-links of this machine
               "http_proxy": "http://127.0.0.1:9", "https_proxy": "http://127.0.0.1:9"}  # any index access fails
    out = subprocess.run([sys.executable, str(ROOT / "tools" / "wheelhouse.py"), "install", "--python", python,
                          "--wheelhouse", str(house), "--requirements", str(project / "requirements.txt")],
                         env=closed, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    assert "without an index" in out.stdout
    check = subprocess.run([python, "-c", "import tqdm, tinypkg; print(tqdm.__version__, tinypkg.VALUE)"],
                           capture_output=True, text=True, check=True).stdout.split()
    assert check == [_pin("tqdm").split("==")[1], "42"]


def test_an_empty_wheelhouse_says_what_to_do(tmp_path, capsys):
    (tmp_path / "empty").mkdir()
    assert wheelhouse.main(["install", "--python", sys.executable, "--wheelhouse", str(tmp_path / "empty")]) == 2
    assert "make wheelhouse" in capsys.readouterr().err


def test_the_install_commands_never_name_an_index():
    cmds = wheelhouse.install_command("py", Path("/w"), ROOT / "requirements.txt")
    assert all("--no-index" in c and "--find-links" in c for c in cmds) and cmds[1][-2:] == ["-e", str(ROOT)]
