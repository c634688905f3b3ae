"""What every benchmark of ``bench/`` shares: measured subprocesses, interleaving, the machine.

Each side of a comparison runs as its own process, started and watched from here, so that
both sides are measured the same way: wall time of the whole process (imports included),
and peak memory of the whole process tree (the tool's worker processes included), sampled
with ``psutil``. Repeats of the two sides are interleaved (A B, B A, A B, ...) so that a
machine whose speed drifts (other jobs, thermal limits) does not favour one side; the
median of the repeats is reported, with the load average before and after.
"""

from __future__ import annotations

import datetime as _dt
import importlib.metadata
import json
import os
import platform
import signal
import statistics
import subprocess
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Iterable, Mapping, Sequence

#: The repository root (``bench/..``): subprocesses of the benchmarks run from here.
ROOT = Path(__file__).resolve().parent.parent

#: Packages whose versions every result file records.
VERSIONED_PACKAGES: tuple[str, ...] = (
    "torch", "megatron-core", "transformers", "tokenizers", "gigatoken", "accelerate", "numpy", "psutil",
)


class BenchError(RuntimeError):
    """A measured command failed or timed out; the message ends with the tail of its output."""


@dataclass
class Measured:
    """One measured process run.

    Attributes:
        command: the command line.
        wall_seconds: wall time from start to exit, in seconds (imports included).
        peak_rss_bytes: peak of the summed RSS of the process and all its descendants, in
            bytes (pages shared by forked workers are counted once per process).
        peak_pss_bytes: peak of the summed PSS (proportional set size: shared pages split
            between the processes sharing them), in bytes; 0 where the OS does not report it.
        returncode: the exit status.
        stdout, stderr: everything the process printed.
        samples: memory samples taken.
    """

    command: list[str]
    wall_seconds: float
    peak_rss_bytes: int
    peak_pss_bytes: int
    returncode: int
    stdout: str = ""
    stderr: str = ""
    samples: int = 0

    @property
    def peak_rss_mb(self) -> float:
        """Peak RSS of the process tree in MB (10^6 bytes)."""
        return self.peak_rss_bytes / 1e6

    @property
    def peak_pss_mb(self) -> float:
        """Peak PSS of the process tree in MB (10^6 bytes)."""
        return self.peak_pss_bytes / 1e6


def _tree_memory(root, with_pss: bool = True) -> tuple[int, int]:
    """(sum of RSS, sum of PSS) in bytes over ``root`` (a ``psutil.Process``) and its
    descendants; PSS is 0 when ``with_pss`` is False or the OS does not report it."""
    import psutil

    try:
        procs = [root] + root.children(recursive=True)
    except psutil.Error:
        return 0, 0
    rss = pss = 0
    for proc in procs:
        try:
            rss += proc.memory_info().rss
            if with_pss:
                pss += getattr(proc.memory_full_info(), "pss", 0)
        except psutil.AccessDenied:
            pass
        except psutil.Error:  # the process ended between listing and reading
            pass
    return rss, pss


def _tail(text: str, lines: int = 25) -> str:
    return "\n".join(text.rstrip().splitlines()[-lines:])


def run_measured(
    command: Sequence[str],
    *,
    env: Mapping[str, str] | None = None,
    cwd: str | os.PathLike | None = None,
    timeout_s: float = 300.0,
    sample_interval_s: float = 0.05,
    pss_every: int = 20,
    what: str = "command",
    check: bool = True,
) -> Measured:
    """Run ``command`` to completion, measuring wall time and the peak memory of its tree.

    The process starts in its own session; on timeout the whole process group is killed
    (SIGKILL), so a tool that hangs (Megatron-LM's ``preprocess_data.py`` waits forever
    when a worker process dies) cannot hang the benchmark. Output is drained by threads, so
    a chatty process cannot block on a full pipe.

    Args:
        command: program and arguments.
        env: the full environment of the process (default: this process's).
        cwd: working directory (default: the current one).
        timeout_s: wall-clock limit in seconds.
        sample_interval_s: seconds between RSS samples (a peak shorter than this can be
            missed; the wall time is exact).
        pss_every: read PSS every this many samples only (reading it slows the process).
        what: a name for the command in error messages.
        check: raise :class:`BenchError` on a non-zero exit status.

    Returns:
        :class:`Measured`.

    Raises:
        FileNotFoundError: the program does not exist.
        BenchError: the process ran past ``timeout_s`` (then it was killed), or exited
            non-zero with ``check`` (the message ends with its stderr tail).
    """
    import psutil

    start = time.perf_counter()
    proc = subprocess.Popen(
        list(command), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        env=dict(env) if env is not None else None, cwd=cwd, start_new_session=True,
    )
    out_chunks: list[str] = []
    err_chunks: list[str] = []
    readers = [
        threading.Thread(target=lambda: out_chunks.append(proc.stdout.read()), daemon=True),
        threading.Thread(target=lambda: err_chunks.append(proc.stderr.read()), daemon=True),
    ]
    for t in readers:
        t.start()
    root = psutil.Process(proc.pid)
    peak_rss = peak_pss = samples = 0
    timed_out = False
    while proc.poll() is None:
        # RSS every sample (cheap: /proc/PID/statm); PSS every pss_every-th sample only, because
        # reading it walks the process's page tables (/proc/PID/smaps_rollup) and slows it down.
        rss, pss = _tree_memory(root, with_pss=samples % pss_every == 0)
        peak_rss, peak_pss, samples = max(peak_rss, rss), max(peak_pss, pss), samples + 1
        if time.perf_counter() - start > timeout_s:
            timed_out = True
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            break
        time.sleep(sample_interval_s)
    proc.wait()
    wall = time.perf_counter() - start
    for t in readers:
        t.join(timeout=10)
    try:  # workers left behind by a parent that exited
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    stdout, stderr = "".join(out_chunks), "".join(err_chunks)
    result = Measured(list(command), wall, peak_rss, peak_pss, proc.returncode, stdout, stderr, samples)
    if timed_out:
        raise BenchError(
            f"{what} ran past timeout_s={timeout_s:.0f} s and was killed with its process group. "
            f"Raise --timeout-s if the machine is just slow.\n--- stderr tail ---\n{_tail(stderr)}"
        )
    if check and proc.returncode != 0:
        raise BenchError(
            f"{what} exited with status {proc.returncode}: {' '.join(map(str, command))}\n"
            f"--- stderr tail ---\n{_tail(stderr)}\n--- stdout tail ---\n{_tail(stdout, 10)}"
        )
    return result


def interleaved_orders(sides: Sequence[str], repeats: int) -> list[list[str]]:
    """The order of the sides in each repeat: rotated by one every repeat (A B, B A, A B...).

    With two sides each runs first in half of the repeats (for an even ``repeats``), so a
    machine that speeds up or slows down during the benchmark does not favour either.

    Raises:
        ValueError: no sides, a duplicate side, or ``repeats < 1``.
    """
    if not sides or len(set(sides)) != len(sides):
        raise ValueError(f"sides={list(sides)!r}: give at least one side, each once")
    if repeats < 1:
        raise ValueError(f"repeats={repeats} must be >= 1")
    n = len(sides)
    return [[sides[(i + r) % n] for i in range(n)] for r in range(repeats)]


def median(values: Iterable[float]) -> float:
    """Median of ``values``.

    Raises:
        ValueError: ``values`` is empty.
    """
    values = list(values)
    if not values:
        raise ValueError("median of no values: run at least one repeat")
    return float(statistics.median(values))


def ratio(numerator: float, denominator: float) -> float:
    """``numerator / denominator``, NaN when the denominator is 0 (no division error in a report)."""
    return numerator / denominator if denominator else float("nan")


def load_average() -> list[float]:
    """The 1, 5 and 15 minute load averages (runnable processes; compare with the core count)."""
    return [round(x, 2) for x in os.getloadavg()]


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def package_versions(names: Iterable[str] = VERSIONED_PACKAGES) -> dict[str, str | None]:
    """Installed versions of ``names`` in this interpreter (``None`` when not installed)."""
    out: dict[str, str | None] = {}
    for name in names:
        try:
            out[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            out[name] = None
    return out


def git_commit(root: Path = ROOT) -> str | None:
    """The repository's HEAD commit (``None`` outside a git checkout)."""
    try:
        return subprocess.run(["git", "-C", str(root), "rev-parse", "HEAD"], capture_output=True,
                              text=True, check=True, timeout=10).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return None


def machine_info() -> dict[str, Any]:
    """The machine and software a result was measured on: date (UTC), CPU, cores, memory,
    OS, Python, package versions, load average and the repository commit."""
    import psutil

    try:
        usable = len(os.sched_getaffinity(0))
    except AttributeError:
        usable = os.cpu_count()
    return {
        "date_utc": _dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "cpu": _cpu_model(),
        "logical_cores": os.cpu_count(),
        "usable_cores": usable,
        "memory_gb": round(psutil.virtual_memory().total / 2**30, 1),
        "os": f"{platform.system()} {platform.release()}",
        "python": platform.python_version(),
        "packages": package_versions(),
        "load_average": load_average(),
        "repo_commit": git_commit(),
    }


def markdown_table(headers: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    """A GitHub markdown table; floats are shown with 3 significant digits at least.

    Raises:
        ValueError: a row has another number of cells than ``headers``.
    """
    def cell(value: Any) -> str:
        if isinstance(value, float):
            if value != value:  # NaN
                return "n/a"
            return f"{value:,.0f}" if abs(value) >= 1000 else f"{value:.3g}" if abs(value) < 10 else f"{value:.1f}"
        return str(value)

    for row in rows:
        if len(row) != len(headers):
            raise ValueError(f"row {list(row)!r} has {len(row)} cells, headers have {len(headers)}")
    lines = ["| " + " | ".join(headers) + " |", "|" + "|".join(" --- " for _ in headers) + "|"]
    lines += ["| " + " | ".join(cell(v) for v in row) + " |" for row in rows]
    return "\n".join(lines)


def write_json(path: str | os.PathLike, data: Any) -> Path:
    """Write ``data`` as indented JSON (folders created); returns the path."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data, indent=2, default=_json_default) + "\n")
    return path


def _json_default(value: Any) -> Any:
    if isinstance(value, Path):
        return str(value)
    if hasattr(value, "__dataclass_fields__"):
        return asdict(value)
    if hasattr(value, "item"):
        return value.item()
    raise TypeError(f"cannot store {type(value).__name__} as JSON")


def child_env(extra: Mapping[str, str] | None = None, drop: Iterable[str] = ()) -> dict[str, str]:
    """This process's environment with ``extra`` set and the names in ``drop`` removed."""
    env = {k: v for k, v in os.environ.items() if k not in set(drop)}
    env.update(extra or {})
    return env


def python_version_of(python: str | os.PathLike, timeout_s: float = 60.0) -> tuple[int, int]:
    """``(major, minor)`` of another Python interpreter.

    Raises:
        FileNotFoundError: ``python`` is not an executable file.
        BenchError: it does not run.
    """
    if not (Path(python).is_file() and os.access(python, os.X_OK)):
        raise FileNotFoundError(f"{python} is not an executable Python interpreter")
    res = subprocess.run([str(python), "-c", "import sys; print(sys.version_info[0], sys.version_info[1])"],
                         capture_output=True, text=True, timeout=timeout_s)
    if res.returncode != 0:
        raise BenchError(f"{python} does not run: {_tail(res.stderr)}")
    major, minor = res.stdout.split()
    return int(major), int(minor)


@dataclass
class SideStats:
    """Medians of one side over its repeats (seconds, bytes) plus the raw values."""

    name: str
    wall_seconds: list[float] = field(default_factory=list)
    phase_seconds: list[float] = field(default_factory=list)
    peak_rss_bytes: list[int] = field(default_factory=list)
    peak_pss_bytes: list[int] = field(default_factory=list)

    def add(self, measured: Measured, phase_seconds: float | None = None) -> None:
        self.wall_seconds.append(measured.wall_seconds)
        if phase_seconds is not None:
            self.phase_seconds.append(phase_seconds)
        self.peak_rss_bytes.append(measured.peak_rss_bytes)
        self.peak_pss_bytes.append(measured.peak_pss_bytes)

    def summary(self) -> dict[str, Any]:
        return {
            "wall_seconds_median": median(self.wall_seconds),
            "phase_seconds_median": median(self.phase_seconds) if self.phase_seconds else None,
            "peak_rss_mb_median": median(self.peak_rss_bytes) / 1e6,
            "peak_pss_mb_median": median(self.peak_pss_bytes) / 1e6,
            "wall_seconds": [round(x, 3) for x in self.wall_seconds],
            "phase_seconds": [round(x, 3) for x in self.phase_seconds],
            "peak_rss_mb": [round(x / 1e6, 1) for x in self.peak_rss_bytes],
            "peak_pss_mb": [round(x / 1e6, 1) for x in self.peak_pss_bytes],
        }


#: Prefix of the one line on which a benchmark side (a child process) prints its JSON result.
RESULT_LINE = "BENCH_RESULT "


def emit_result(result: dict) -> None:
    """Print ``result`` as JSON on a ``BENCH_RESULT`` line (what a side's child process reports)."""
    print(RESULT_LINE + json.dumps(result), flush=True)


def read_result(stdout: str) -> dict:
    """The JSON a side printed on its ``BENCH_RESULT`` line (the last one wins).

    Raises:
        ValueError: no such line.
    """
    for line in reversed(stdout.splitlines()):
        if line.startswith(RESULT_LINE):
            return json.loads(line[len(RESULT_LINE):])
    raise ValueError(f"no {RESULT_LINE.strip()} line in the output:\n{stdout[-2000:]}")


def finish(result: dict, json_path, report_text: str) -> int:
    """A benchmark's last step: write ``result`` as JSON, print the report and where it went.

    Returns 0, the command's exit status.
    """
    path = write_json(json_path, result)
    print()
    print(report_text)
    print(f"result: {path}")
    return 0
