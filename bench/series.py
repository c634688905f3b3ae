"""Series benchmark: wall time per notebook of a run, and the time of a clean install.

* ``--run-dir DIR`` reads ``DIR/summary.json`` (the series runner records each notebook's
  ``wall_seconds`` there) and checks the whole series against the 10-minute target;
  ``--execute`` first runs the series into ``DIR`` (``python -m helpers.runner.series run``, CPU
  profile by default) and also records the runner's own wall time (kernel start-ups included).
* ``--install`` times a clean install into a new venv in a temporary folder:
  ``python -m venv`` then ``pip install -r requirements.txt`` then ``pip install --no-deps -e .``
  (what ``make install`` does). pip's cache is allowed; whether it was warm is reported from
  pip's own output (``Using cached`` / ``Downloading`` / local ``Processing`` lines) and the
  size of the cache before the install. ``--no-cache`` installs with ``--no-cache-dir``.

Run (from the repository root)::

    python -m bench.series --run-dir runs/latest
    python -m bench.series --run-dir runs/bench-series --execute --install
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from bench import common

#: The issue's target for the whole series on 2 CPU cores, in seconds.
SERIES_TARGET_SECONDS = 600.0


def notebook_wall_times(run_dir: str | os.PathLike) -> list[tuple[str, float]]:
    """``[(notebook stem, wall seconds)]`` in notebook order, from ``run_dir/summary.json``.

    Raises:
        FileNotFoundError: no ``summary.json`` in ``run_dir`` (run the series first).
        ValueError: no notebook in it has a ``wall_seconds`` entry.
    """
    from helpers.support import results

    path = Path(run_dir) / results.SUMMARY_FILE
    if not path.is_file():
        raise FileNotFoundError(f"{path} not found: run the series first (python -m helpers.runner.series run "
                                f"--run-dir {run_dir}) or pass --execute")
    summary = results.load_summary(run_dir)
    times = [(stem, float(v["wall_seconds"])) for stem, v in sorted(summary.items())
             if isinstance(v, dict) and "wall_seconds" in v]
    if not times:
        raise ValueError(f"{path} has no notebook with a wall_seconds entry: was it written by helpers.runner.series?")
    return times


def series_report(times: list[tuple[str, float]], target_s: float = SERIES_TARGET_SECONDS) -> dict[str, Any]:
    """Total and per-notebook share of the series' wall time, against ``target_s``."""
    total = sum(t for _, t in times)
    return {
        "notebooks": [{"notebook": stem, "wall_seconds": round(t, 1), "share": t / total if total else 0.0}
                      for stem, t in times],
        "total_seconds": round(total, 1), "target_seconds": target_s, "within_target": total <= target_s,
    }


def execute_series(run_dir: Path, profile: str, timeout_s: float) -> common.Measured:
    """Run the series into ``run_dir`` with the runner's CLI, measured as one process tree.

    Raises:
        common.BenchError: the runner failed or ran past ``timeout_s``.
    """
    cmd = [sys.executable, "-m", "helpers.runner.series", "run", "--profile", profile, "--run-dir", str(run_dir)]
    return common.run_measured(cmd, cwd=common.ROOT, timeout_s=timeout_s, sample_interval_s=0.5,
                               what="the series run")


_CACHED = re.compile(r"^\s*Using cached ", re.M)
_DOWNLOADED = re.compile(r"^\s*Downloading ", re.M)
_LOCAL = re.compile(r"^\s*Processing (/|file:)", re.M)


def count_pip_sources(pip_output: str) -> dict[str, int]:
    """How pip got each distribution, from its (non-quiet) output: ``{"cached": n,
    "downloaded": n, "local": n}`` (``local``: a wheel from a folder or a ``file://`` index)."""
    return {"cached": len(_CACHED.findall(pip_output)), "downloaded": len(_DOWNLOADED.findall(pip_output)),
            "local": len(_LOCAL.findall(pip_output))}


def _folder_bytes(path: Path) -> int:
    total = 0
    for root, _, files in os.walk(path):
        for name in files:
            try:
                total += os.path.getsize(os.path.join(root, name))
            except OSError:
                pass
    return total


def pip_cache_dir(python: str) -> Path | None:
    """pip's cache folder for ``python`` (``None`` when pip reports none, e.g. caching is off)."""
    res = subprocess.run([python, "-m", "pip", "cache", "dir"], capture_output=True, text=True, timeout=60)
    return Path(res.stdout.strip()) if res.returncode == 0 and res.stdout.strip() else None


def time_clean_install(python: str, requirements: Path, *, no_cache: bool = False, timeout_s: float = 1500.0,
                       keep: bool = False) -> dict[str, Any]:
    """Time ``venv`` + ``pip install -r requirements`` + ``pip install --no-deps -e .`` in a new folder.

    Args:
        python: the base interpreter for the venv (3.10-3.12, as pyproject.toml says).
        requirements: the requirements file.
        no_cache: pass ``--no-cache-dir`` to pip (a cold install, everything fetched again).
        timeout_s: limit for each pip step, seconds.
        keep: keep the venv (default: deleted afterwards).

    Returns:
        Seconds of each step and in all, pip's sources (:func:`count_pip_sources`), the cache
        folder and its size before the install, and ``cache_warm``: True when pip took at
        least one distribution from its cache.

    Raises:
        common.BenchError: a step failed or timed out (with pip's output tail).
    """
    cache = None if no_cache else pip_cache_dir(python)
    cache_bytes = _folder_bytes(cache) if cache and cache.is_dir() else 0
    folder = Path(tempfile.mkdtemp(prefix="bench-install-"))
    venv = folder / "venv"
    vpy = str(venv / "bin" / "python")
    nocache = ["--no-cache-dir"] if no_cache else []
    steps: dict[str, float] = {}
    try:
        t0 = time.perf_counter()
        common.run_measured([python, "-m", "venv", str(venv)], timeout_s=timeout_s, what="python -m venv")
        steps["venv_seconds"] = time.perf_counter() - t0
        m = common.run_measured([vpy, "-m", "pip", "install", "--disable-pip-version-check", *nocache, "-r", str(requirements)],
                                cwd=common.ROOT, timeout_s=timeout_s, sample_interval_s=0.5, what="pip install -r requirements.txt")
        steps["requirements_seconds"] = m.wall_seconds
        sources = count_pip_sources(m.stdout + m.stderr)
        m2 = common.run_measured([vpy, "-m", "pip", "install", "--disable-pip-version-check", *nocache, "--no-deps", "-e", str(common.ROOT)],
                                 cwd=common.ROOT, timeout_s=timeout_s, what="pip install --no-deps -e .")
        steps["editable_seconds"] = m2.wall_seconds
        check = common.run_measured([vpy, "-c", "import torch, megatron.core, transformers, helpers; print('ok')"],
                                    cwd=str(folder), timeout_s=timeout_s, what="the import check")
        steps["import_check_seconds"] = check.wall_seconds
        size = _folder_bytes(venv)
    finally:
        if not keep:
            shutil.rmtree(folder, ignore_errors=True)
    total = steps["venv_seconds"] + steps["requirements_seconds"] + steps["editable_seconds"]
    return {**{k: round(v, 1) for k, v in steps.items()}, "install_seconds": round(total, 1),
            "pip_sources": sources, "pip_cache_dir": str(cache) if cache else None,
            "pip_cache_bytes_before": cache_bytes, "cache_warm": sources["cached"] > 0,
            "no_cache": no_cache, "venv_bytes": size, "python": python,
            "python_version": "%d.%d" % common.python_version_of(python)}


def base_python() -> str:
    """The interpreter this venv was made from (the one a user would make a new venv with)."""
    return getattr(sys, "_base_executable", None) or sys.executable


def report(result: dict[str, Any]) -> str:
    """Markdown: notebook wall times and the install time."""
    parts = []
    if "series" in result:
        s = result["series"]
        rows = [[n["notebook"], n["wall_seconds"], f"{100 * n['share']:.0f} %"] for n in s["notebooks"]]
        rows.append(["**total**", s["total_seconds"], "100 %"])
        parts.append(common.markdown_table(["notebook", "wall s", "share"], rows))
        verdict = "within" if s["within_target"] else "OVER"
        parts.append(f"Series total {s['total_seconds']:.0f} s: {verdict} the {s['target_seconds']:.0f} s target.")
        if "runner_wall_seconds" in result:
            parts.append(f"Runner process (kernel start-ups included): {result['runner_wall_seconds']:.0f} s, "
                         f"peak RSS {result['runner_peak_rss_mb']:.0f} MB.")
    if "install" in result:
        i = result["install"]
        src = i["pip_sources"]
        parts.append(common.markdown_table(
            ["step", "seconds"],
            [["python -m venv", i["venv_seconds"]], ["pip install -r requirements.txt", i["requirements_seconds"]],
             ["pip install --no-deps -e .", i["editable_seconds"]], ["**clean install**", i["install_seconds"]]]))
        parts.append(f"pip cache {'warm' if i['cache_warm'] else 'cold'}: {src['cached']} from the cache, "
                     f"{src['downloaded']} downloaded, {src['local']} from local wheel folders/indexes; cache "
                     f"{i['pip_cache_bytes_before'] / 1e6:.0f} MB before ({i['pip_cache_dir']}); venv "
                     f"{i['venv_bytes'] / 1e9:.2f} GB; Python {i['python_version']}.")
    return "\n\n".join(parts) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.series", description=__doc__.split("\n\n")[0])
    parser.add_argument("--run-dir", default=None, help="run folder with summary.json (e.g. runs/latest)")
    parser.add_argument("--execute", action="store_true", help="run the series into --run-dir first")
    parser.add_argument("--profile", default="cpu", help="profile for --execute (default cpu)")
    parser.add_argument("--install", action="store_true", help="time a clean install in a temporary venv")
    parser.add_argument("--no-cache", action="store_true", help="with --install: pip --no-cache-dir")
    parser.add_argument("--python", default=base_python(), help="base interpreter of the new venv")
    parser.add_argument("--timeout-s", type=float, default=1800.0, help="limit for the series run / each pip step")
    parser.add_argument("--json", default=None, help="write the result here (default {run_dir}/bench_series.json)")
    args = parser.parse_args(argv)
    if not args.run_dir and not args.install:
        parser.error("give --run-dir (notebook wall times) and/or --install (clean install time)")
    result: dict[str, Any] = {"benchmark": "series", "machine": common.machine_info()}
    try:
        if args.run_dir:
            run_dir = Path(args.run_dir).expanduser().resolve()
            if args.execute:
                m = execute_series(run_dir, args.profile, args.timeout_s)
                result.update(runner_wall_seconds=m.wall_seconds, runner_peak_rss_mb=m.peak_rss_mb, profile=args.profile)
            result["series"] = series_report(notebook_wall_times(run_dir))
        if args.install:
            result["install"] = time_clean_install(args.python, common.ROOT / "requirements.txt",
                                                   no_cache=args.no_cache, timeout_s=args.timeout_s)
    except (FileNotFoundError, ValueError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    except common.BenchError as err:
        print(f"error: {err}", file=sys.stderr)
        return 1
    result["load_average_after"] = common.load_average()
    default_json = Path(args.run_dir) / "bench_series.json" if args.run_dir else common.ROOT / "runs" / "bench_series.json"
    path = common.write_json(args.json or default_json, result)
    print(report(result))
    print(f"result: {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
