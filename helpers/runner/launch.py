"""Launch ``torchrun`` jobs from a notebook: free port, streamed log, timeout, failing rank.

Real Megatron-LM runs start with ``torchrun --nproc_per_node N pretrain_gpt.py ...``; the
notebooks start their distributed work the same way, as a subprocess, so that the code that
runs on a laptop is the code that runs on many GPUs. This module makes that safe to do from
a notebook: every launch has a timeout, the whole process group is killed when it expires,
and a failure names the rank that failed and shows the end of its log.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any, Callable, Sequence

from helpers.support import run_guard


class LaunchError(RuntimeError):
    """A torchrun job failed, timed out, or could not start.

    ``str()`` is the one-line headline, then the job's last log lines (``log_tail``), then, for a
    failed rank, ``failure``: the rank, its exception and message, where it was raised, the
    rank's error file and the full log, so the cause is in the last lines a learner reads.
    """

    def __init__(self, message: str, log_tail: str = "", failed_rank: int | None = None, failure: str = ""):
        super().__init__(message + (f"\n--- last lines of the log ---\n{log_tail}" if log_tail else "")
                         + (f"\n--- the failure ---\n{failure}" if failure else ""))
        self.headline = message
        self.log_tail = log_tail
        self.failed_rank = failed_rank
        self.failure = failure


@dataclass
class LaunchResult:
    """What a finished launch returns: the command, its wall time (seconds) and all output lines."""

    command: list[str]
    wall_seconds: float
    lines: list[str] = field(default_factory=list)

    @property
    def output(self) -> str:
        return "\n".join(self.lines)


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that is free on ``host`` right now (the OS picks it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def port_is_free(port: int, host: str = "127.0.0.1") -> bool:
    """True when nothing listens on ``host:port`` and it can be bound."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        try:
            s.bind((host, port))
        except OSError:
            return False
    return True


def torchrun_command(
    target: str | Sequence[str],
    *,
    nproc_per_node: int,
    nnodes: int = 1,
    node_rank: int = 0,
    master_addr: str = "127.0.0.1",
    master_port: int,
    module: bool = True,
) -> list[str]:
    """The ``torchrun`` command line (as run through ``python -m torch.distributed.run``).

    Args:
        target: a module name (``module=True``, run as ``-m target``) or a script path, plus
            its arguments when a sequence is given: ``["helpers.learn.pretrain_gpt", "--num-layers", "4", ...]``.
        nproc_per_node: processes (ranks) on this node; one per GPU on a GPU machine.
        nnodes, node_rank, master_addr, master_port: the static rendezvous of a multi-node job
            (torchrun's ``--nnodes/--node-rank/--master-addr/--master-port``).
    """
    if isinstance(target, str):
        target = [target]
    cmd = [
        sys.executable, "-m", "torch.distributed.run",
        f"--nproc_per_node={nproc_per_node}",
        f"--nnodes={nnodes}",
        f"--node_rank={node_rank}",
        f"--master_addr={master_addr}",
        f"--master_port={master_port}",
    ]
    if module:
        cmd.append("-m")
    return cmd + list(target)


_ROOT_CAUSE_RANK = re.compile(r"Root Cause.*?rank\s*:\s*(\d+)\s*\(local_rank", re.S)
_EXCEPTION_LINE = re.compile(r"^(?:\[rank(\d+)\]:\s*)?((?:\w+\.)*\w*(?:Error|Exception)\b.*)$")
_SIGNALLED = re.compile(r"Signal (\d+) \((SIG\w+)\) received by PID (\d+)")  # torchrun's line for a killed rank
_AGENT_SIGNAL = re.compile(r"SignalException: Process \d+ got signal: (\d+)")  # torchrun itself got a signal
_FRAME = re.compile(r'File "([^"]+)", line (\d+), in (\S+)')
_ROOT = Path(__file__).resolve().parents[2]


def _rank_error(lines: Sequence[str], rank: int | None) -> str | None:
    """The last ``SomeError: message`` line of the failing rank (torchrun prints its own
    ``ChildFailedError`` traceback after it, so the log tail alone often hides the cause)."""
    found = None
    for line in lines:
        match = _EXCEPTION_LINE.match(line.strip())
        if (match and "ChildFailedError" not in match.group(2)
                and (rank is None or match.group(1) in (None, str(rank)))):
            found = match.group(2)
    return found


_MEGATRON_ERROR = re.compile(r"^ERROR:megatron[\w.]*:(.+)$")
#: Exit codes Megatron-LM's loop ends with on purpose (``megatron/core/rerun_state_machine.py``).
MEGATRON_EXIT_CODES = {16: "Megatron-LM's rerun state machine found an unexpected result (NaN or Inf loss, a spiky "
                           "loss), saved a checkpoint for a diagnostic rerun and stopped (exit code 16)"}


#: What to do about a failure Megatron-LM reports in its own words (found in the cause).
MEGATRON_HINTS = {
    "OptimizerParamScheduler: class input value": (
        "the checkpoint was trained with another learning-rate schedule (Megatron-LM counts it in samples: "
        "iterations x global batch size). Say which to follow: override_opt_param_scheduler=True (this run's, "
        "--override-opt_param-scheduler) or use_checkpoint_opt_param_scheduler=True (the checkpoint's), or train "
        "into a new run folder"),
    "in local forward loss calculation": (
        "the loss is not finite: lower lr, keep clip_grad on, check model.init_method_std; Megatron-LM saved the "
        "last step for a rerun, so delete that checkpoint (or train into a new run folder) before training again"),
}


def _megatron_error(lines: Sequence[str]) -> str | None:
    """The cause Megatron-LM logged before a deliberate exit: the first ``ERROR:megatron...`` line
    that carries a ``message=`` (the rerun state machine's check that failed), else the last one."""
    found = [m.group(1).strip() for line in lines if (m := _MEGATRON_ERROR.match(line.strip()))]
    return next((f for f in found if "message=" in f), found[-1] if found else None)


def error_files(log_dir: str | os.PathLike, since: float = 0.0) -> list[dict[str, Any]]:
    """The ``error.json`` files that failing ranks wrote under torchrun's ``log_dir`` (torch elastic's
    ``@record``), modified at or after ``since`` (a ``time.time()``), first failure first.

    Returns:
        ``[{"rank", "message", "traceback", "timestamp", "path"}]``; ``rank`` is the local rank.
    """
    found = []
    for path in Path(log_dir).glob("*/attempt_*/*/error.json"):
        try:
            if path.stat().st_mtime < since - 1:
                continue
            data = json.loads(path.read_text())["message"]
        except (OSError, ValueError, KeyError, TypeError):
            continue
        extra = data.get("extraInfo", {}) if isinstance(data, dict) else {}
        message = data.get("message", "") if isinstance(data, dict) else str(data)
        found.append({"rank": int(path.parent.name) if path.parent.name.isdigit() else None, "message": message,
                      "traceback": extra.get("py_callstack", ""), "timestamp": int(extra.get("timestamp") or 0),
                      "path": path})
    return sorted(found, key=lambda e: (e["timestamp"], e["rank"] if e["rank"] is not None else 1 << 30))


def _raised_at(traceback: str) -> str | None:
    """``file:line in function`` of the innermost frame in this project's code (else the innermost)."""
    frames = _FRAME.findall(traceback)
    ours = [f for f in frames if f[0].startswith(str(_ROOT)) and "site-packages" not in f[0]]
    if not frames:
        return None
    file, line, func = (ours or frames)[-1]
    shown = os.path.relpath(file, _ROOT) if ours else file
    return f"{shown}:{line} in {func}"


def torchrun(
    target: str | Sequence[str],
    *,
    nproc_per_node: int = 1,
    timeout_s: float = 600.0,
    master_port: int | None = None,
    env: dict[str, str] | None = None,
    log_path: str | os.PathLike | None = None,
    on_line: Callable[[str], None] | None = print,
    cwd: str | os.PathLike | None = None,
    module: bool = True,
    log_dir: str | os.PathLike | None = None,
) -> LaunchResult:
    """Run ``target`` under torchrun on this machine and wait for it, streaming its output.

    Args:
        target: module (or script) and its arguments, see :func:`torchrun_command`.
        nproc_per_node: number of processes; each gets ``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``.
        timeout_s: wall-clock limit in seconds; past it the whole process group is killed.
        master_port: rendezvous port; a free one is picked when ``None``.
        log_path: where to also write the full log (appended).
        on_line: called with each output line (``print`` by default, ``None`` for silence).
        log_dir: torchrun's ``--log-dir`` (``PET_LOG_DIR``) for the ranks' error files (default: a
            temporary folder, removed after a success).

    The processes get ``HELPERS_LAUNCHER_PID``: ``helpers.learn.pretrain_gpt`` stops when this process dies.

    Returns:
        A :class:`LaunchResult` with the wall time and every output line.

    Raises:
        LaunchError: the port is in use, the job timed out, or a rank exited non-zero
            (``failed_rank`` says which; ``failure`` names its exception, its error file and the log).
    """
    if nproc_per_node < 1:
        raise LaunchError(f"nproc_per_node={nproc_per_node}: need at least 1 process")
    if master_port is None:
        master_port = free_port()
    elif not port_is_free(master_port):
        raise LaunchError(
            f"master_port={master_port} is already in use on this machine: pick another port "
            "or pass master_port=None to let the launcher choose a free one"
        )
    # No PYTHONUNBUFFERED: unbuffered stdout writes a print's text and its newline in two
    # system calls, so lines of different ranks interleave. Programs print with flush=True.
    full_env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // nproc_per_node)))}
    if env:
        full_env.update({k: str(v) for k, v in env.items()})
    # The project root on the path, so `-m helpers.x` works without installation too.
    full_env["PYTHONPATH"] = str(_ROOT) + (os.pathsep + full_env["PYTHONPATH"] if full_env.get("PYTHONPATH") else "")

    full_env[run_guard.LAUNCHER_PID_ENV] = str(os.getpid())  # the job stops if this process dies
    made_log_dir = log_dir is None
    log_dir = Path(tempfile.mkdtemp(prefix="torchrun-") if log_dir is None else log_dir)
    log_dir.mkdir(parents=True, exist_ok=True)
    # torchrun's --log-dir, given as its PET_LOG_DIR variable so the command stays the one a
    # cluster runs: a failing rank under @record writes {log_dir}/{run id}/attempt_0/{rank}/error.json
    full_env["PET_LOG_DIR"] = str(log_dir)
    cmd = torchrun_command(target, nproc_per_node=nproc_per_node, master_port=master_port, module=module)
    tail: deque[str] = deque(maxlen=40)
    lines: list[str] = []
    stop = threading.Event()
    # The job writes its output straight into the log file, not into a pipe to this process: if
    # this process dies, the workers' prints still land (a pipe would break them, BrokenPipeError,
    # before they could save). The reader follows the file, as `tail -f` does.
    log = Path(log_path) if log_path else log_dir / "output.log"
    log.parent.mkdir(parents=True, exist_ok=True)
    started_at, start = time.time(), time.perf_counter()
    with open(log, "ab") as out:
        # in Megatron-LM's form ([...] datetime: ...), read by metrics.startup_table; not echoed
        out.write(f"[launched] datetime: {datetime.fromtimestamp(started_at):%Y-%m-%d %H:%M:%S.%f}\n".encode())
        out.flush()
        offset = out.tell()
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=full_env, cwd=cwd,
                                start_new_session=True)

    def emit(raw: bytes) -> None:
        line = raw.decode("utf-8", errors="replace").rstrip("\n")
        lines.append(line)
        tail.append(line)
        if on_line is not None:
            on_line(line)

    def pump() -> None:
        with open(log, "rb") as f:
            f.seek(offset)
            pending = b""
            while not stop.is_set():
                chunk = f.readline()
                if chunk:
                    pending += chunk
                    if pending.endswith(b"\n"):
                        emit(pending)
                        pending = b""
                elif proc.poll() is not None:
                    if pending:
                        emit(pending)
                    return
                else:
                    time.sleep(0.05)

    reader = threading.Thread(target=pump, daemon=True)
    reader.start()
    try:
        proc.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        _kill_group(proc)
        raise LaunchError(
            f"torchrun {' '.join(map(str, target if not isinstance(target, str) else [target]))} "
            f"did not finish within timeout_s={timeout_s:g} s; all its processes were killed. "
            "Raise timeout_s or make the job smaller.",
            "\n".join(tail),
        ) from None
    except BaseException:
        _kill_group(proc)
        raise
    finally:
        reader.join(timeout=5)  # after the job ends the reader drains the file, then returns
        stop.set()
    wall = time.perf_counter() - start
    if proc.returncode != 0:
        raise _failure(proc.returncode, lines, tail, error_files(log_dir, since=started_at), log)
    for sub in list(log_dir.iterdir()):  # torchrun's per-run folders: empty after a success
        if sub.is_dir() and not any(sub.rglob("error.json")):
            shutil.rmtree(sub, ignore_errors=True)
    if made_log_dir or not any(log_dir.iterdir()):
        shutil.rmtree(log_dir, ignore_errors=True)
    return LaunchResult(command=cmd, wall_seconds=wall, lines=lines)


def _failure(returncode: int, lines: list[str], tail: Sequence[str], errors: list[dict[str, Any]],
             log_path: str | os.PathLike | None) -> LaunchError:
    """The :class:`LaunchError` of a failed job: the first failing rank (by its error file's time,
    else torchrun's "Root Cause" block), its exception, where it was raised and the files to read."""
    first = errors[0] if errors else None
    text = "\n".join(lines)
    if first is None and (agent := _AGENT_SIGNAL.search(text)):
        name = signal.Signals(int(agent.group(1))).name
        return LaunchError(f"torchrun received {name} and stopped its workers (exit code {returncode}); on SIGTERM "
                           "Megatron-LM's loop (--exit-signal-handler) saves a checkpoint first: see the log", "\n".join(tail))
    if first is None and returncode < 0:
        name = signal.Signals(-returncode).name if -returncode in signal.valid_signals() else str(-returncode)
        return LaunchError(f"torchrun was ended by {name} (exit code {returncode}); its workers stop on their own "
                           f"within seconds (helpers.support.run_guard.watch_launcher)", "\n".join(tail))
    if first is not None:
        rank, cause = first["rank"], first["message"]
    else:
        match = _ROOT_CAUSE_RANK.search(text)
        rank = int(match.group(1)) if match else None
        cause = _rank_error(lines, rank) or _megatron_error(lines)
        root = text[text.find("Root Cause"):] if "Root Cause" in text else ""
        if (killed := _SIGNALLED.search(root)) is not None:
            cause = (f"killed by {killed.group(2)} (signal {killed.group(1)})"
                     + ("; the kernel's out-of-memory killer sends SIGKILL" if killed.group(2) == "SIGKILL" else ""))
    who = f"rank {rank}" if rank is not None else "a process"
    code = re.search(r"exitcode\s*:\s*(\d+)", text)
    why = MEGATRON_EXIT_CODES.get(int(code.group(1)) if code else -1)
    hint = next((h for k, h in MEGATRON_HINTS.items() if cause and k in cause), None)
    headline = (f"torchrun job failed: {who} exited with an error (exit code {returncode})"
                + (f": {cause.splitlines()[0]}" if cause else ".") + (f" [{why}]" if why else "")
                + (f". Fix: {hint}" if hint else ""))
    failure = [f"rank:       {who} (the first to fail)"]
    if cause:
        failure.append(f"exception:  {' '.join(cause.split())}")
    if first is not None and (where := _raised_at(first["traceback"])):
        failure.append(f"raised at:  {where}")
    if first is not None:
        failure.append(f"its traceback (torch elastic error file): {first['path']}")
    if log_path:
        failure.append(f"the log of every rank: {Path(log_path).resolve()}")
    return LaunchError(headline, "\n".join(tail), failed_rank=rank, failure="\n".join(failure))


def _kill_group(proc: subprocess.Popen) -> None:
    """SIGTERM the job's process group, then SIGKILL whatever is left after 5 s."""
    try:
        pgid = os.getpgid(proc.pid)
    except ProcessLookupError:
        return
    for sig, wait in ((signal.SIGTERM, 5.0), (signal.SIGKILL, 5.0)):
        try:
            os.killpg(pgid, sig)
        except ProcessLookupError:
            return
        try:
            proc.wait(timeout=wait)
            return
        except subprocess.TimeoutExpired:
            continue


@dataclass
class TrainingResult:
    """What :func:`train` returns: the summary, the metrics and the launch's wall time (s)."""

    summary: dict[str, Any]
    metrics: dict[str, list[dict[str, Any]]]
    wall_seconds: float
    skipped: bool
    log: list[str]


_ITERATION = re.compile(r"\biteration\s+(\d+)/\s*\d+ \|")
#: Lines of Megatron-LM's log a notebook shows under the progress bar.
_SHOWN = ("validation loss at", "successfully saved checkpoint", "exiting program", "number of parameters on",
          "loading distributed checkpoint", "could not find arguments in the checkpoint")


def _disk_filled(err: LaunchError, folder: Path, checkpoint_bytes: int) -> bool:
    """Whether a failed training job ran out of disk: the log says so (``ENOSPC``), or the checkpoint
    folder's disk has less free space than one checkpoint. megatron-core 0.19.2 loses the ``OSError``
    of a save's writer (``filesystem_async.py``: "Worker failure ... <class 'RuntimeError'>"), so
    the free space is the sure sign."""
    text = str(err)
    return ("No space left on device" in text or "[Errno 28]" in text
            or run_guard.free_bytes(folder) < checkpoint_bytes)


def _disk_full_text(cfg, plan, log_path: Path, since: float) -> str:
    """The message of a training job that filled its disk; removes the checkpoint it could not finish
    (an ``iter_*`` folder past the tracker's iteration, made at or after ``since``, a ``time.time()``)."""
    from helpers.learn import checkpointing

    latest = checkpointing.latest_iteration(cfg.checkpoint_path)
    partial = sorted(p for p in Path(cfg.checkpoint_path).glob("iter_*")
                     if p.is_dir() and checkpointing.iteration_of(p) is not None
                     and checkpointing.iteration_of(p) > (latest or 0) and p.stat().st_mtime >= since - 1)
    for folder in partial:  # never named by the tracker file: not a checkpoint, only space taken
        shutil.rmtree(folder, ignore_errors=True)
    kept = (f"the last complete checkpoint, iteration {latest}, is kept (training resumes from it)" if latest
            else "no checkpoint was complete")
    from helpers.runner import preflight

    removed = f"; the unfinished {', '.join(p.name for p in partial)} was deleted" if partial else ""
    saves = preflight.checkpoint_saves(cfg, latest or 0)
    rest = dataclasses.replace(plan, checkpoint_saves=saves)
    return (f"training stopped: the disk filled up while a checkpoint was saved ({kept}{removed}). "
            + run_guard.disk_full_message(cfg.checkpoint_path, rest.disk_bytes,
                                          f"the rest of the run ({saves} checkpoints of about "
                                          f"{run_guard.human_bytes(plan.checkpoint_bytes)} each, plus "
                                          f"{run_guard.human_bytes(preflight.DISK_MARGIN_BYTES)} for logs)",
                                          "train into a run folder on a bigger disk (run_dir=), or save fewer "
                                          "checkpoints (a larger save_interval)")
            + f" The log: {log_path}")


def train(cfg, *, nproc_per_node: int = 1, timeout_s: float = 3600.0,
          master_port: int | None = None, progress: bool = True, echo: bool = False,
          config_name: str = "run.json", env: dict[str, str] | None = None,
          max_epochs: float = 16.0) -> TrainingResult:
    """Run Megatron-LM's training loop on ``cfg`` under torchrun, with a progress bar.

    The command is :func:`helpers.runner.megatron_args.command`; the run folder gets ``run.json`` (``cfg``),
    ``training.log`` and what the loop logged (:mod:`helpers.runner.metrics`). Megatron-LM resumes from the
    latest checkpoint itself (``--load``); a run already at ``train_iters`` is skipped. Every check runs first
    (:func:`helpers.runner.preflight.check_run`), so bad input fails before any process starts.

    Args:
        nproc_per_node: processes (one per GPU on a GPU machine), a multiple of TP x PP.
        timeout_s: wall-clock limit (s); past it every process gets SIGTERM (the loop saves a checkpoint).
        progress: show a tqdm bar over iterations; ``echo`` also prints every log line.
        env: extra environment variables (CPU results are bit-identical only with the same thread count).
        max_epochs: refuse a run reading its training data more often (default
            :data:`helpers.runner.preflight.MAX_EPOCHS`; 0: no limit).

    Raises:
        ValueError / FileNotFoundError: bad config (see :meth:`TrainingConfig.check`).
        checkpointing.CheckpointMismatchError: the checkpoint folder holds another model shape.
        checkpointing.CheckpointReadError: the checkpoint to resume from has a missing or short shard.
        run_guard.RunFolderBusyError: another job trains ``cfg.run_path`` (named in the message).
        ValueError: also when the folder holds a finished run trained with other settings.
        helpers.runner.launch.LaunchError: port in use, timeout, or a rank failed (its log tail).
        helpers.runner.preflight.RepeatedDataError: more than ``max_epochs`` epochs (nothing started).
        helpers.support.run_guard.RunFolderNotWritableError: the run or checkpoint folder cannot be written.
        helpers.support.run_guard.DiskFullError: the checkpoints need more space than the disk has free
            (nothing started), or the disk filled up (the unfinished checkpoint is deleted).
    """
    from tqdm.auto import tqdm

    from helpers.learn import checkpointing
    from helpers.runner import megatron_args, metrics, preflight

    plan = preflight.check_run(cfg, nproc=nproc_per_node, max_epochs=max_epochs, config_name=config_name)
    if plan is None:  # this run, finished: its results
        return TrainingResult(json.loads(cfg.summary_file.read_text()), metrics.read_metrics(cfg.metrics_file), 0.0, True, [])
    latest = plan.start_iteration  # None: a fresh start
    config_path = cfg.run_path / config_name
    previous = config_path.read_text() if config_path.exists() else None  # put back if the launch trains nothing
    command = [*megatron_args.SCRIPT[1:], *megatron_args.arguments(cfg)]  # Megatron-LM's flags for cfg
    cfg.to_json(config_path)
    log_path = cfg.run_path / "training.log"
    earlier = [p for p in (log_path, cfg.metrics_file) if p.exists()] if latest is None else []
    for path in earlier:  # a fresh start in a folder that holds an earlier run's records: they are kept aside
        path.replace(path.with_name(path.name + ".previous"))
    if earlier:
        print(f"no checkpoint in {cfg.checkpoint_path}: this run starts at iteration 0. The earlier run's "
              f"{' and '.join(p.name for p in earlier)} are kept as *.previous beside them.", flush=True)
    bar = tqdm(total=cfg.train_iters, initial=latest or 0, desc="training", unit="it") if progress else None

    def on_line(line: str) -> None:
        match = _ITERATION.search(line)
        if bar is not None and match:
            bar.update(int(match[1]) - bar.n)
            if "lm loss:" in line:
                bar.set_postfix(loss=float(line.split("lm loss:")[1].split("|")[0]))
        if echo or (bar is None and line.strip()):
            print(line, flush=True)
        elif any(s in line for s in _SHOWN):
            (bar.write if bar is not None else print)(line.strip())

    started = time.time()
    try:
        res = torchrun(command, nproc_per_node=nproc_per_node,
                       timeout_s=timeout_s, master_port=master_port, on_line=on_line, log_path=log_path,
                       env={**megatron_args.ENV, **(env or {})}, log_dir=cfg.run_path / "torchrun_logs")
    except BaseException as err:  # a failed job, a timeout, Ctrl-C
        if checkpointing.latest_iteration(cfg.checkpoint_path) == latest:  # nothing saved: run.json describes the checkpoint again
            if previous is None:
                config_path.unlink(missing_ok=True)
            else:
                config_path.write_text(previous)
        if isinstance(err, LaunchError) and _disk_filled(err, cfg.checkpoint_path, plan.checkpoint_bytes):
            raise run_guard.DiskFullError(_disk_full_text(cfg, plan, log_path, started)) from None
        raise
    finally:
        if bar is not None:
            bar.close()
    records = metrics.from_megatron_lm(cfg, log_path.read_text(errors="replace"))
    summary = metrics.summary(cfg, records, nproc_per_node=nproc_per_node, optimizer=megatron_args.optimizer_name())
    summary.update(launch_wall_seconds=round(res.wall_seconds, 2), train_tokens=plan.train_tokens,  # the preflight's
                   estimated_seconds=plan.estimated_seconds and round(plan.estimated_seconds, 2))  # estimate, and the launch
    cfg.summary_file.write_text(json.dumps(summary, indent=2) + "\n")
    return TrainingResult(summary, records, res.wall_seconds, False, res.lines)
