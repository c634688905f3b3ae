"""Is this machine ready for the series? ``make check`` and notebook 00, in seconds.

An instructor runs it on every laptop before the day (under 30 s); a learner sees the same facts in
notebook 00. Standard library only, so it runs before anything is installed; it ends with one line,
``ready`` or what to fix. Checked: the Python version (3.12 or 3.13, megatron-core 0.19.2's), free
disk, memory, usable cores, the installed packages or a wheelhouse, JupyterLab's port, and an estimated
series time: a short matrix multiply (else a pure-Python loop) scaled by the same measurement on the
recorded run (:mod:`helpers.runner.timings`).
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SUPPORTED_PYTHON = ((3, 12), (3, 13))
#: What the series needs: the .venv (about 6.4 GB: PyPI's torch is a CUDA build) plus one cpu run
#: folder (about 0.5 GB) and room for pip's unpacking; memory: the series' process tree peaks
#: near 3.3 GB (bench/RESULTS.md), twice that leaves the notebook, browser and OS their share.
MIN_FREE_DISK_GB = 10.0
MIN_MEMORY_GB = 6.0
MIN_CORES = 2
JUPYTER_PORT = 8888


@dataclass
class Check:
    """One line of the report: ``ok`` (None: information only), what was found, what to do if not ok."""

    name: str
    ok: bool | None
    found: str
    fix: str = ""


def python_check(version: tuple[int, int] | None = None) -> Check:
    """The interpreter running this (or ``version``) against :data:`SUPPORTED_PYTHON`."""
    v = version or sys.version_info[:2]
    ok = tuple(v) in SUPPORTED_PYTHON
    return Check("python", ok, f"{sys.executable} is Python {v[0]}.{v[1]}",
                 "" if ok else "install Python 3.12 or 3.13 (make finds it with tools/find-python; or make PYTHON=/path)")


def disk_check(folder: Path = ROOT, minimum_gb: float = MIN_FREE_DISK_GB) -> Check:
    """Free space where the series writes (``.venv``, ``runs/``)."""
    free = shutil.disk_usage(folder).free / 1e9
    installed = (folder / ".venv" / ".installed").exists()
    need = 1.0 if installed else minimum_gb  # installed: only run folders are still to come
    return Check("disk", free >= need, f"{free:,.1f} GB free in {folder} (need {need:g} GB)",
                 "" if free >= need else f"free {need - free:,.1f} GB more, or clone the repository onto a larger disk")


def memory_check(minimum_gb: float = MIN_MEMORY_GB) -> Check:
    """Available memory (Linux ``/proc/meminfo`` ``MemAvailable``; elsewhere unknown)."""
    try:
        info = dict(line.split(":", 1) for line in Path("/proc/meminfo").read_text().splitlines() if ":" in line)
        available = int(info["MemAvailable"].split()[0]) * 1024 / 1e9
        total = int(info["MemTotal"].split()[0]) * 1024 / 1e9
    except (OSError, KeyError, ValueError):
        return Check("memory", None, "unknown (no /proc/meminfo)", f"make sure {minimum_gb:g} GB are free")
    ok = available >= minimum_gb
    return Check("memory", ok, f"{available:,.1f} GB available of {total:,.1f} GB (need {minimum_gb:g} GB)",
                 "" if ok else "close other programs (a browser with many tabs) or use a larger machine")


def cores_check(minimum: int = MIN_CORES) -> Check:
    """Cores this process may use (``os.sched_getaffinity`` where it exists)."""
    n = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    ok = n >= minimum
    return Check("cores", ok, f"{n} usable", "" if ok else f"the series runs 2 processes at once (TP=2, DP=2): use a machine with {minimum} cores")


#: Packages whose presence in the running interpreter means the series is installed there.
KEY_PACKAGES = ("torch", "megatron", "transformers", "papermill")
#: Wheels a wheelhouse must hold for this machine (their names' prefixes).
KEY_WHEELS = ("torch-", "megatron_core-")


def _venv_python_version(folder: Path) -> str | None:
    """``"3.12"`` for a ``.venv`` whose interpreter runs, else None."""
    python = folder / ".venv" / "bin" / "python"
    try:
        out = subprocess.run([str(python), "-c", "import sys; print('%d.%d' % sys.version_info[:2])"],
                             capture_output=True, text=True, timeout=20)
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.strip() or None


def _wheel_fits(name: str, version: tuple[int, int]) -> bool:
    """A wheel file name for this machine: pure Python, or this CPython and this OS and architecture."""
    import platform

    tags = name[:-len(".whl")].split("-")[-3:]  # python, abi, platform tags (PEP 427)
    py_ok = any(t in ("py3", f"cp{version[0]}{version[1]}") for t in tags[0].split("."))
    arch = platform.machine().lower()
    os_ok = tags[2] == "any" or (sys.platform.startswith("linux") and "linux" in tags[2] and arch in tags[2]) or \
        (sys.platform == "darwin" and "macosx" in tags[2])
    return py_ok and os_ok


def packages_check(folder: Path = ROOT) -> Check:
    """Installed (a ``.venv`` whose Python runs and is 3.12/3.13 with ``.installed``, written by ``make
    install``, or :data:`KEY_PACKAGES` importable by this interpreter), or a wheelhouse holding
    :data:`KEY_WHEELS` for this machine to install from offline."""
    import importlib.util

    venv = folder / ".venv"
    if venv.exists():
        v = _venv_python_version(folder)
        if v not in ("%d.%d" % s for s in SUPPORTED_PYTHON):
            made = f"Python {v}" if v else "an interpreter that no longer runs"
            return Check("packages", False, f"{venv} was made with {made}", f"rm -rf {venv} && make install")
    if (venv / ".installed").exists() or all(importlib.util.find_spec(n) for n in KEY_PACKAGES):
        return Check("packages", True, "installed" + (f" in {venv}" if venv.exists() else f" in {sys.prefix}"))
    house = folder / "wheelhouse"
    wheels = sorted(p.name for p in house.glob("*.whl")) if house.is_dir() else []
    if wheels:
        target = tuple(int(x) for x in (_venv_python_version(folder) or "%d.%d" % sys.version_info[:2]).split("."))
        missing = [k.rstrip("-") for k in KEY_WHEELS if not any(w.startswith(k) and _wheel_fits(w, target) for w in wheels)]
        if missing:
            return Check("packages", False, f"a wheelhouse of {len(wheels)} wheels, none of {missing} for this machine "
                         f"(Python {target[0]}.{target[1]}, {sys.platform})",
                         "make a wheelhouse for this platform and Python (make wheelhouse PLATFORMS=... WHEELHOUSE_PYTHON=...)")
        return Check("packages", True, f"not installed; a wheelhouse of {len(wheels)} wheels: make install uses it, offline")
    if house.is_dir():
        return Check("packages", False, f"not installed and {house} holds no wheels",
                     f"remove the empty {house} (make install would read only it) or copy the wheels into it")
    return Check("packages", False, "not installed and no wheelhouse/",
                 "run make install (downloads about 3 GB), or copy an instructor's wheelhouse/ folder here first")


def port_check(port: int = JUPYTER_PORT) -> Check:
    """Whether JupyterLab's default port is free on localhost (it picks the next one otherwise)."""
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(("127.0.0.1", port))
            return Check("jupyter port", True, f"{port} free")
        except OSError:
            return Check("jupyter port", None, f"{port} in use (another JupyterLab?): make lab will take the next free one")


def matmul_gflops(seconds: float = 1.0, bursts: int = 5) -> float:
    """GFLOP/s of a 512x512 fp32 matrix multiply in this process's torch, on the threads torch picks: the fastest of
    ``bursts`` timings of ``seconds / bursts`` each, after three warm-up products (2 x 512^3 floating-point operations
    each). The fastest, because other work on the cores slows a burst by whatever share it takes (on 2 cores under a
    load of 10, single bursts measured 2 to 16 GFLOP/s against about 200 when quiet); the caller states the load."""
    import torch

    a, b = torch.randn(512, 512), torch.randn(512, 512)
    for _ in range(3):
        a @ b
    best = 0.0
    for _ in range(bursts):
        n, start = 0, time.perf_counter()
        while time.perf_counter() - start < seconds / bursts:
            a @ b
            n += 1
        best = max(best, 2 * 512 ** 3 * n / (time.perf_counter() - start) / 1e9)
    return best


def python_loop_mops(seconds: float = 1.0) -> float:
    """Millions of iterations per second of a pure-Python loop (``n += i & 1``) in this interpreter, for about ``seconds``."""
    n, start = 0, time.perf_counter()
    while time.perf_counter() - start < seconds:
        for i in range(10_000):
            n += i & 1
    return n * 2 / (time.perf_counter() - start) / 1e6


def measure_speed(python: str | None = None, seconds: float = 1.0) -> tuple[str, float]:
    """``("matmul_gflops", GFLOP/s)`` of a 512x512 fp32 matrix multiply in ``python``'s torch, or
    ``("python_loop_mops", million loop iterations per s)`` of this interpreter when there is no torch.

    The matrix multiply runs in a subprocess of the ``.venv`` interpreter (timeout 20 s), on the
    threads torch picks, for about ``seconds``.
    """
    if python and Path(python).exists():
        code = f"from helpers.runner.readiness import matmul_gflops; print(matmul_gflops({seconds}))"
        try:
            out = subprocess.run([python, "-c", code], capture_output=True, text=True, timeout=20, check=True, cwd=ROOT)
            return "matmul_gflops", float(out.stdout.strip().splitlines()[-1])
        except (subprocess.SubprocessError, ValueError, IndexError, OSError):
            pass
    return "python_loop_mops", python_loop_mops(seconds)


def estimate_check(python: str | None = None) -> Check:
    """The cpu series' time here: the recorded run's (:mod:`helpers.runner.timings`) scaled by the measured speed."""
    from helpers.runner import timings

    kind, value = measure_speed(python)
    measured = timings.load()
    if not measured or value <= 0:
        return Check("estimated series", None, f"{kind} {value:,.1f} (no recorded run to scale by)")
    recorded, ref = sum(measured["notebooks"].values()), measured["machine"][kind]
    est = timings.series_estimate(value, measured, kind)
    how, unit = ("torch matmul", "GFLOP/s") if kind == "matmul_gflops" else \
        ("a Python loop, before install: rough", "million iterations/s")
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else 0.0
    busy = (f"; load average {load:.1f}: other work shares the cores, and the series takes longer than this while it does"
            if load > 1.0 else "")  # the speed is the fastest burst: it estimates the machine when it is quiet
    slow = ("; over 3x the recorded run, which is still ready: in a workshop, show notebooks 03 and 05 from the "
            "instructor's machine rather than run them on this one" if est > 3 * recorded else "")
    return Check("estimated series", None, f"about {est / 60:,.0f} minutes for the cpu profile ({how}: {value:,.1f} {unit} "
                 f"against {ref:,.1f} where the series took {recorded / 60:.1f} minutes "
                 f"({measured['machine']['cpu_model']}), higher is faster{busy}{slow})")


def report(folder: Path = ROOT) -> list[Check]:
    """Every check, in order (about 2 s: the speed measurement is most of it)."""
    venv_python = folder / ".venv" / "bin" / "python"
    return [python_check(), disk_check(folder), memory_check(), cores_check(), packages_check(folder), port_check(),
            estimate_check(str(venv_python) if venv_python.exists() else None)]


def verdict(checks: list[Check]) -> str:
    """``"ready"``, or ``"not ready: "`` and every fix, in order."""
    fixes = [f"{c.name}: {c.fix}" for c in checks if c.ok is False]
    return "ready" if not fixes else "not ready: " + "; ".join(fixes)


def lines(checks: list[Check]) -> list[str]:
    """One printed line per check (``ok``, ``FIX`` with its fix below, ``info``), then the verdict."""
    out = []
    for c in checks:
        mark = {True: "ok  ", False: "FIX ", None: "info"}[c.ok]
        out.append(f"{mark} {c.name:<17} {c.found}" + (f"\n     {'':<17} -> {c.fix}" if c.ok is False else ""))
    return out + [verdict(checks)]


def main(argv: list[str] | None = None) -> int:
    """Print the report and the verdict; exit 0 when ready, 1 when not."""
    checks = report()
    print("\n".join(lines(checks)))
    return 0 if verdict(checks) == "ready" else 1


if __name__ == "__main__":
    sys.exit(main())
