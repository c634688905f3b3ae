"""helpers.runner.readiness (make check): each check on real values, the verdict line, and the time it takes."""

from __future__ import annotations

import socket
import subprocess
import sys
import time
from pathlib import Path

from helpers.runner import readiness

ROOT = Path(__file__).resolve().parent.parent


def test_python_versions_outside_3_12_and_3_13_are_named_with_the_fix():
    assert readiness.python_check((3, 12)).ok and readiness.python_check((3, 13)).ok
    old = readiness.python_check((3, 11))
    assert old.ok is False and "3.12 or 3.13" in old.fix and "tools/find-python" in old.fix


def test_packages_installed_or_a_wheelhouse_or_what_to_do(tmp_path, monkeypatch):
    assert readiness.packages_check(tmp_path).ok  # this interpreter has the series' packages
    monkeypatch.setattr(readiness, "KEY_PACKAGES", ("no_such_package_here",))  # as the system Python before install
    missing = readiness.packages_check(tmp_path)
    assert missing.ok is False and "make install" in missing.fix and "wheelhouse" in missing.fix
    (tmp_path / "wheelhouse").mkdir()
    assert "holds no wheels" in readiness.packages_check(tmp_path).found  # make install would read only it
    (tmp_path / "wheelhouse" / "tqdm-4.70.1-py3-none-any.whl").write_bytes(b"")
    (tmp_path / "wheelhouse" / "torch-2.14.1-cp312-none-macosx_11_0_arm64.whl").write_bytes(b"")
    wrong = readiness.packages_check(tmp_path)  # another platform's torch, no megatron-core
    assert wrong.ok is False and "torch" in wrong.found and "megatron_core" in wrong.found
    import platform

    py = f"cp{sys.version_info[0]}{sys.version_info[1]}"
    for name in (f"torch-2.14.1-{py}-{py}-manylinux_2_28_{platform.machine()}.whl",
                 f"megatron_core-0.19.2-{py}-{py}-manylinux_2_28_{platform.machine()}.whl"):
        (tmp_path / "wheelhouse" / name).write_bytes(b"")
    wheels = readiness.packages_check(tmp_path)
    assert wheels.ok and "4 wheels" in wheels.found and "offline" in wheels.found
    (tmp_path / ".venv" / "bin").mkdir(parents=True)
    (tmp_path / ".venv" / "bin" / "python").symlink_to(tmp_path / "gone")  # a venv whose interpreter was removed
    broken = readiness.packages_check(tmp_path)
    assert broken.ok is False and "no longer runs" in broken.found and broken.fix.startswith("rm -rf")
    (tmp_path / ".venv" / "bin" / "python").unlink()
    (tmp_path / ".venv" / "bin" / "python").symlink_to(sys.executable)
    (tmp_path / ".venv" / ".installed").write_text("")
    assert readiness.packages_check(tmp_path).found.startswith("installed in")


def test_disk_memory_and_cores_report_this_machine(tmp_path):
    disk = readiness.disk_check(tmp_path, minimum_gb=1e9)  # more than any disk: must say how much to free
    assert disk.ok is False and "free" in disk.fix and "GB free" in disk.found
    assert readiness.disk_check(tmp_path, minimum_gb=0.0).ok
    assert readiness.cores_check(minimum=1).ok and readiness.cores_check(minimum=10_000).ok is False
    mem = readiness.memory_check(minimum_gb=0.0)
    assert mem.ok in (True, None) and "GB" in mem.found


def test_a_port_in_use_is_reported_not_refused():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        busy = readiness.port_check(s.getsockname()[1])
    assert busy.ok is None and "in use" in busy.found


def test_the_verdict_is_ready_or_lists_every_fix():
    ok, info = readiness.Check("a", True, "fine"), readiness.Check("b", None, "note")
    assert readiness.verdict([ok, info]) == "ready"
    bad = [ok, readiness.Check("disk", False, "1 GB", "free 9 GB"), readiness.Check("python", False, "3.11", "install 3.12")]
    assert readiness.verdict(bad) == "not ready: disk: free 9 GB; python: install 3.12"


def test_the_speed_measurement_and_the_estimate():
    kind, value = readiness.measure_speed(None, seconds=0.2)
    assert kind == "python_loop_mops" and value > 0
    kind, value = readiness.measure_speed(sys.executable, seconds=0.2)  # this interpreter has torch
    assert kind == "matmul_gflops" and value > 0.1
    est = readiness.estimate_check(sys.executable)
    assert est.ok is None and "minutes for the cpu profile" in est.found


def test_make_check_runs_in_under_30_seconds_and_ends_with_the_verdict():
    start = time.perf_counter()
    out = subprocess.run([sys.executable, "-m", "helpers.runner.readiness"], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert time.perf_counter() - start < 30
    last = out.stdout.strip().splitlines()[-1]
    assert last == "ready" or last.startswith("not ready: ")
    assert out.returncode == (0 if last == "ready" else 1)
    assert "python" in out.stdout and "estimated series" in out.stdout
