"""The report card of a run: ``runs/<name>/report.md``, written from what the run recorded.

In the spirit of nanochat's ``report.md`` (karpathy/nanochat, ``nanochat/report.py``): one page
with the environment, the git commit, the hardware, each notebook's wall time, the data, the
training and the evaluation figures of a run. The series runner calls :func:`record_start`
before the first notebook and :func:`finish` after the last. The report itself measures
nothing: every number comes from the run folder (``summary.json``, ``training_summary.json``,
``data/data_manifest.json``, ``metrics.jsonl``, ``figures/``), and a piece that is missing
(a partial run with ``--only``) is named as missing. To (re)write the report of any run folder::

    python -m helpers.runner.report runs/latest
"""

from __future__ import annotations

import json
import os
import platform
import subprocess
import sys
from datetime import datetime
from pathlib import Path
from typing import Any, Iterable

from helpers.support import environment, results
from helpers.runner import readiness
from helpers.runner.metrics import read_metrics

#: The entry of ``summary.json`` holding the runner's own facts (``{"start": {...}, "end": {...}}``).
SECTION = "series"
REPORT_FILE = "report.md"
#: The columns of :func:`helpers.support.environment.report`'s table, in its order (summary.json sorts keys).
ENVIRONMENT_HEADERS = list(environment.Component("", False, "", "").as_row())


def _git(*args: str) -> str | None:
    try:
        out = subprocess.run(["git", *args], cwd=Path(__file__).resolve().parent, capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return out.stdout.strip() if out.returncode == 0 else None


def _load_average() -> list[float] | None:
    """The 1, 5 and 15 minute load averages (runnable processes), None where the OS has none."""
    return [round(x, 2) for x in os.getloadavg()] if hasattr(os, "getloadavg") else None


def _cpu_model() -> str:
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
        return next(ln.split(":", 1)[1].strip() for ln in lines if ln.startswith("model name"))
    except (OSError, StopIteration):
        return platform.processor() or platform.machine()


def record_start(run_dir: str | os.PathLike, *, profile: str, overrides: dict[str, Any] | None = None,
                 notebooks: Iterable[str] = ()) -> dict[str, Any]:
    """Record the facts of the start of a run as ``summary["series"]["start"]``.

    The environment table of :func:`helpers.support.environment.report`, the git commit and whether the tree
    had changes (untracked files included), the CPU, cores, memory (GiB), load average (1/5/15 min), a matrix
    multiply's and a Python loop's speed (about 1 s), the profile, the overrides and the series' notebooks.
    The last finished series run stays as ``summary["series"]["last_finished"]``, so a failed rerun keeps it.

    Returns:
        The recorded dict.
    """
    status = _git("status", "--porcelain")
    facts = {"started": datetime.now().isoformat(timespec="seconds"), "profile": profile,
             "overrides": dict(overrides or {}), "notebooks": list(notebooks), "commit": _git("rev-parse", "HEAD"),
             "changed_files": None if status is None else len(status.splitlines()),
             "environment": [row.as_row() for row in environment.report()],
             "cpu_model": _cpu_model(), "logical_cpus": os.cpu_count(),
             "usable_cpus": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count(),
             "memory_gib": round(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30, 1),
             "load_average_start": _load_average(),
             # this machine's speed, by the measurements make check scales the recorded run's time with (timings)
             "matmul_gflops": round(readiness.matmul_gflops(0.5), 1), "python_loop_mops": round(readiness.python_loop_mops(0.5), 2)}
    previous = results.load_summary(run_dir).get(SECTION, {})
    kept = {"last_finished": {"start": previous["start"], "end": previous["end"]}} if previous.get("end") else {}
    return results.record_many(run_dir, SECTION, {"start": facts, "end": {}, **kept})["start"]  # {}: not finished yet


def finish(run_dir: str | os.PathLike) -> Path:
    """Record the end of a run (time, load average) as ``summary["series"]["end"]`` and write the report.

    Returns:
        The path of ``report.md``.
    """
    results.record(run_dir, SECTION, "end", {"finished": datetime.now().isoformat(timespec="seconds"),
                                             "load_average_end": _load_average()})
    return write(run_dir)


def write(run_dir: str | os.PathLike) -> Path:
    """Write :func:`render`'s Markdown to ``<run_dir>/report.md`` and return its path."""
    path = Path(run_dir).expanduser().resolve() / REPORT_FILE
    path.write_text(render(run_dir), encoding="utf-8")
    return path


def _v(value: Any) -> str:
    """A value as the report shows it: ints with thousands separators, floats to 4 significant digits."""
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, int):
        return f"{value:,}"
    if isinstance(value, float):
        return f"{value:,.0f}" if abs(value) >= 1e4 else f"{value:.4g}"
    if isinstance(value, dict):
        return ", ".join(f"{k} {_v(x)}" for k, x in value.items())
    return "-" if value is None else ", ".join(map(_v, value)) if isinstance(value, list) else str(value)


def _table(pairs: Iterable[tuple[str, Any]]) -> str:
    return results.markdown_table([(k, _v(v)) for k, v in pairs if v is not None], ["", "value"])


def _json(path: Path) -> dict[str, Any]:
    return json.loads(path.read_text(encoding="utf-8")) if path.is_file() else {}


def render(run_dir: str | os.PathLike) -> str:
    """The report card of a run folder as Markdown, from its recorded files only.

    Sections: the run (profile, commit, times), Environment (and what ran), Hardware,
    Notebooks (wall seconds; the series' notebooks that did not run), Data, Training,
    Evaluation (figures and samples), Figures.

    Raises:
        FileNotFoundError: ``run_dir`` has no ``summary.json`` (the message names the folder).
    """
    folder = Path(run_dir).expanduser().resolve()
    if not (folder / results.SUMMARY_FILE).is_file():
        raise FileNotFoundError(f"{folder} has no {results.SUMMARY_FILE}: not a run folder, or nothing ran in it "
                                f"yet; run python -m helpers.runner.series run --run-dir {folder}")
    summary = results.load_summary(folder)
    start, end = summary.get(SECTION, {}).get("start", {}), summary.get(SECTION, {}).get("end", {})
    train, manifest = _json(folder / "training_summary.json"), _json(folder / "data" / "data_manifest.json")
    dirty = start.get("changed_files")
    tree = "" if dirty is None else f" with {dirty} changed or untracked file(s)" if dirty else " (clean)"
    out = [f"# Report card: {folder.name}", f"Profile `{start.get('profile', '?')}`, started {start.get('started', '?')}, "
           f"finished {end.get('finished', 'never (the runner stopped before the end)')}. Commit "
           f"`{(start.get('commit') or 'unknown')[:12]}`{tree}" + (f"; overrides {start['overrides']}" if start.get("overrides") else "") + "."]
    last = summary.get(SECTION, {}).get("last_finished")
    if last and not end:
        out.append(f"The last series run that finished here: started {last['start'].get('started', '?')}, finished "
                   f"{last['end'].get('finished', '?')} (commit `{(last['start'].get('commit') or 'unknown')[:12]}`).")
    if start.get("environment"):
        out += ["## Environment", results.markdown_table(start["environment"], ENVIRONMENT_HEADERS)]
    paths = [("device", summary.get("00_container_setup", {}).get("device")),
             ("tokenizing engine", manifest.get("preprocess", {}).get("engine")), ("optimizer", train.get("optimizer")),
             ("precision", train.get("precision")),
             ("fusion flags 04 recommends", summary.get("04_fused_kernels", {}).get("recommended_fusion_flags"))]
    if any(v is not None for _, v in paths):
        out += ["What ran:", _table(paths)]
    out += _hardware(start, end) + _notebooks(summary, start) + _data(manifest, summary.get("01_data_preprocessing", {}))
    out += _training(folder, train, summary.get("03_training", {})) + _evaluation(summary)
    figures = sorted((folder / "figures").glob("*.png"))
    if figures:
        out += ["## Figures", " · ".join(f"[{p.stem}](figures/{p.name})" for p in figures)]
    return "\n\n".join(out) + "\n"


def _hardware(start: dict[str, Any], end: dict[str, Any]) -> list[str]:
    load0, load1, cores = start.get("load_average_start"), end.get("load_average_end"), start.get("usable_cpus")
    cuda = next((r for r in start.get("environment", []) if r["component"] == "CUDA"), {})
    lines = ["## Hardware", _table([
        ("CPU", start.get("cpu_model")), ("cores (logical / usable)", cores and f"{start['logical_cpus']} / {cores}"),
        ("memory (GiB)", start.get("memory_gib")),
        ("GPU", cuda and (cuda["version / details"] if cuda["status"] == "found" else "none")),
        ("load average 1/5/15 min, start", load0), ("load average 1/5/15 min, end", load1)])]
    if load0 and load1 and cores:
        lines.append(f"The 1-minute load average was {load0[0]:.2f} when the run started, before any notebook, on "
                     f"{cores} usable cores: " + ("other work kept more processes runnable than there are cores, so "
                                                  "the wall times below are upper bounds" if load0[0] > cores else
                                                  f"other work held about {100 * load0[0] / cores:.0f}% of them")
                     + f". At the end it was {load1[0]:.2f}, the run's own processes included.")
    return lines


def _notebooks(summary: dict[str, dict[str, Any]], start: dict[str, Any]) -> list[str]:
    ran = {s: v["wall_seconds"] for s, v in summary.items() if s != SECTION and "wall_seconds" in v}
    total = sum(ran.values())
    lines = ["## Notebooks", results.markdown_table(
        [(s, t, f"{100 * t / total:.0f}%") for s, t in ran.items()] + [("total", round(total, 2), "100%")],
        ["notebook", "wall seconds", "share"]) if ran else "No notebook finished in this folder."]
    missing = [s + (" (started, did not finish)" if s in summary else "") for s in start.get("notebooks", []) if s not in ran]
    if missing:
        lines.append(f"Did not run: {', '.join(missing)} ({len(ran)} of {len(start['notebooks'])} notebooks ran).")
    return lines


def _data(m: dict[str, Any], s01: dict[str, Any]) -> list[str]:
    if not m:
        return ["## Data", "No data/data_manifest.json: 01_data_preprocessing did not run in this folder."]
    corpus, pre = m.get("corpus", {}), m.get("preprocess", {})
    removed = corpus.get("removed") or {}
    lines = ["## Data", _table([
        ("source", corpus.get("source")),
        ("installed packages read (files)", f"{len(corpus['packages'])} ({sum(corpus['packages'].values()):,})"
         if corpus.get("packages") else None),
        ("files read", corpus.get("num_read")), ("removed by filter", removed or None),
        ("documents", corpus.get("num_documents")), ("corpus bytes", corpus.get("num_bytes")),
        ("split", m.get("settings", {}).get("split")), ("vocabulary (tokens)", m.get("tokenizer", {}).get("vocab_size")),
        ("tokens written", pre.get("num_tokens")), ("tokens/s tokenizing", pre.get("tokens_per_second")),
        ("third-party share of the kept bytes", s01.get("third_party_share_of_bytes")),
        ("held-out bytes per token", s01.get("held_out_bytes_per_token"))])]
    if corpus.get("num_read") and pre.get("num_tokens") and corpus.get("num_documents"):
        lines.append(f"The filters removed {sum(removed.values()):,} of {corpus['num_read']:,} files read; the "
                     f"{corpus['num_documents']:,} documents left became {pre['num_tokens']:,} tokens, "
                     f"{pre['num_tokens'] / corpus['num_documents']:,.0f} per document.")
    return lines


def _training(folder: Path, t: dict[str, Any], s03: dict[str, Any]) -> list[str]:
    if not t:
        return ["## Training", "No training_summary.json: 03_training did not run in this folder."]
    first_train = (read_metrics(folder / "metrics.jsonl")["train"] or [{}])[0].get("lm_loss")
    lines = ["## Training", _table([
        ("parameters", t.get("parameters")), ("iterations", f"{t.get('iterations')} of {t.get('train_iters')}"),
        ("first / final train loss", [first_train, t.get("final_train_loss")]),
        ("first / final validation loss", [t.get("first_valid_loss"), t.get("final_valid_loss")]),
        ("tokens/s (median)", t.get("tokens_per_s")), ("achieved GFLOP/s", s03.get("achieved_gflops_per_s")),
        ("precision", t.get("precision")), ("optimizer", t.get("optimizer")),
        ("TP / PP / DP", [t.get(f"{p}_parallel_size") for p in ("tensor_model", "pipeline_model", "data")])])]
    v0, v1 = t.get("first_valid_loss"), t.get("final_valid_loss")
    if v0 is not None and v1 is not None:
        lines.append(f"Validation loss went from {v0:.3f} to {v1:.3f} in {t['iterations']} iterations "
                     f"({'down' if v1 < v0 else 'up'} {abs(v0 - v1):.3f} nats per token).")
    return lines


#: What the Evaluation section shows: {notebook: recorded names}; a notebook named *evaluation* shows all it records.
EVALUATION = {"05_parallelism": ("all_layouts_match",),
              "05b_memory_toolbox": ("all_savers_match", "moe_ep2_max_abs_loss_diff", "tp2_pp2_to_hf_max_abs_logit_diff"),
              "06_conversion": ("max_abs_logit_diff", "training_validation_loss", "hf_validation_loss",
                                "greedy_tokens_equal", "tp2_bit_identical", "round_trip_bit_identical")}
#: Recorded text samples: {notebook: name}.
SAMPLES = {"03_training": "greedy_sample", "06_conversion": "pipeline_text"}


def _evaluation(summary: dict[str, dict[str, Any]]) -> list[str]:
    picked = [(stem, k, v) for stem, vals in summary.items() for k, v in vals.items() if k != "wall_seconds"
              and (k in EVALUATION.get(stem, ()) or k == SAMPLES.get(stem) or "evaluation" in stem)]
    rows = [(stem, k, _v(v)) for stem, k, v in picked if not isinstance(v, str)]
    samples = [f"{k} ({stem}):\n\n```text\n{v}\n```" for stem, k, v in picked if isinstance(v, str)]
    if not picked:
        return ["## Evaluation", f"Nothing recorded: {', '.join(sorted({*EVALUATION, *SAMPLES}))} did not run."]
    return ["## Evaluation"] + ([results.markdown_table(rows, ["notebook", "recorded", "value"])] if rows else []) + samples


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit("usage: python -m helpers.runner.report RUN_DIR   (writes RUN_DIR/report.md)")
    try:
        print(write(sys.argv[1]))
    except FileNotFoundError as err:
        sys.exit(f"error: {err}")
    except OSError as err:  # a read-only folder, a full disk
        sys.exit(f"error: cannot write {Path(sys.argv[1]).resolve() / REPORT_FILE} ({err.strerror}); the report is "
                 f"rendered from the folder's files, so copy the folder somewhere writable and run this again there")
