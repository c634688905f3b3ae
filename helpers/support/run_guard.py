"""Guards for a run folder: its training job stops when its launcher dies, one job trains it at a
time, and a folder that cannot be written or has too little space is refused before anything starts.

torch elastic starts every worker in a session of its own, so killing the launcher's process group
does not reach the trainer. :func:`watch_launcher` sends the trainer SIGTERM when its launcher is
gone (Megatron-LM's ``--exit-signal-handler`` then saves and exits); :func:`run_folder_lock` holds
an ``fcntl.flock`` on ``{run folder}/training.lock``; :func:`checkpoint_queue_in_process` keeps
megatron-core's checkpoint writer from spawning a ``multiprocessing`` Manager; :func:`check_writable`,
:func:`check_free_space` and :func:`explain_disk_full` refuse or explain a folder that cannot hold
the run.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import os
import shutil
import signal
import socket
import sys
import tempfile
import threading
import time
from datetime import datetime
from pathlib import Path
from typing import Iterator

LAUNCHER_PID_ENV = "HELPERS_LAUNCHER_PID"
LOCK_NAME = "training.lock"


class RunFolderBusyError(RuntimeError):
    """Another job holds the run folder's training lock."""


class RunFolderNotWritableError(PermissionError):
    """The run folder (or the folder it would be made in) cannot be written."""


class DiskFullError(OSError):
    """The disk of a run folder has, or had, too little free space for what a step writes (``errno.ENOSPC``)."""

    def __init__(self, message: str):
        super().__init__(errno.ENOSPC, message)

    def __str__(self) -> str:
        return self.strerror


def _start_time(pid: int) -> str | None:
    """The process's start time from ``/proc/PID/stat`` (field 22), so that a reused pid is not
    taken for the launcher; ``None`` when the process does not exist. Without ``/proc``
    (macOS) the existence test alone is used."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
        return stat.rsplit(")", 1)[1].split()[19]
    except FileNotFoundError:
        if not Path("/proc/self/stat").exists():
            try:
                os.kill(pid, 0)
                return "alive"
            except ProcessLookupError:
                return None
            except PermissionError:
                return "alive"
        return None
    except (OSError, IndexError):
        return None


def watch_launcher(interval_s: float = 1.0, grace_s: float = 120.0) -> threading.Thread:
    """Stop this process (SIGTERM, then ``os._exit(1)`` after ``grace_s`` s) once its launcher is gone.

    The launcher is gone when, under torchrun (``TORCHELASTIC_RUN_ID`` set), the parent pid
    changes (the orphan was re-parented to init or a subreaper), or when the process named by
    ``$HELPERS_LAUNCHER_PID`` has exited. A trainer started by hand (``nohup python -m
    helpers.learn.pretrain_gpt ...``) outlives its shell, as it should. Checked every ``interval_s``
    seconds by a daemon thread, which is returned. The job's output goes to a file
    (:func:`helpers.runner.launch.torchrun`), so its last prints and the save do not depend on the
    dead launcher.
    """
    parent = os.getppid() if os.environ.get("TORCHELASTIC_RUN_ID") else None  # only torchrun's workers
    launcher = int(os.environ.get(LAUNCHER_PID_ENV, "0") or 0)
    launcher_started = _start_time(launcher) if launcher else None

    def gone() -> str | None:
        if parent is not None and os.getppid() != parent:
            return f"its parent process {parent} (torchrun) ended"
        if launcher and _start_time(launcher) != launcher_started:
            return f"its launcher process {launcher} ended"
        return None

    def watch() -> None:
        while (why := gone()) is None:
            time.sleep(interval_s)
        print(f"> stopping pid {os.getpid()}: {why}; saving a checkpoint at the end of this iteration "
              f"(SIGTERM), ending it in {grace_s:g} s otherwise", file=sys.stderr, flush=True)
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(grace_s)
        os._exit(1)

    thread = threading.Thread(target=watch, name="watch_launcher", daemon=True)
    thread.start()
    return thread


def describe_holder(lock_path: Path) -> str:
    """Who holds ``lock_path``, as the lock file names it (pid, host, start time, command)."""
    try:
        job = json.loads(lock_path.read_text() or "{}")
    except (OSError, json.JSONDecodeError):
        job = {}
    if not job:
        return "a job that has not written its name yet"
    return f"pid {job.get('pid')} on {job.get('host')}, started {job.get('started')}: {job.get('command')}"


@contextlib.contextmanager
def run_folder_lock(run_path: str | os.PathLike, *, enabled: bool = True, name: str = LOCK_NAME,
                    doing: str = "trained by another job") -> Iterator[Path | None]:
    """Hold ``{run_path}/{name}`` for the block; ``enabled=False`` (ranks other than 0) does nothing.

    ``training.lock`` guards training; the series runner holds ``series.lock`` (``doing="run by
    another series runner"``) for a whole run.

    Raises:
        RunFolderBusyError: another job holds the lock; the message names it (pid, host,
            start time, command) and the fixes. Nothing in the folder is touched.
    """
    if not enabled:
        yield None
        return
    lock_path = Path(run_path) / name
    lock_path.parent.mkdir(parents=True, exist_ok=True)
    with open(lock_path, "a+", encoding="utf-8") as handle:
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise RunFolderBusyError(
                f"{run_path} is being {doing} ({describe_holder(lock_path)}). Wait for it to "
                f"finish, stop it (kill <pid>), or use another run folder (run_dir=..., --run-dir)."
            ) from None
        handle.truncate(0)
        handle.write(json.dumps({"pid": os.getpid(), "host": socket.gethostname(),
                                 "started": datetime.now().isoformat(timespec="seconds"),
                                 "command": " ".join(sys.argv)}) + "\n")
        handle.flush()
        try:
            yield lock_path
        finally:
            handle.truncate(0)


@contextlib.contextmanager
def environ(name: str, value: str | None, *, keep_existing: bool = False) -> Iterator[None]:
    """Set the environment variable ``name`` to ``value`` for the block (processes started in it
    inherit it), then restore what was there.

    ``value=None``, or ``keep_existing`` with ``name`` already set, leaves the variable alone.
    """
    before = os.environ.get(name)
    if value is None or (keep_existing and before is not None):
        yield
        return
    os.environ[name] = value
    try:
        yield
    finally:
        if before is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = before


def check_run_folder_free(run_path: str | os.PathLike) -> None:
    """Raise :class:`RunFolderBusyError` now if another job trains ``run_path`` (the launcher's check
    before it starts any process); takes and releases the lock at once."""
    if (Path(run_path) / LOCK_NAME).exists():
        with run_folder_lock(run_path):
            pass


def checkpoint_queue_in_process() -> bool:
    """Give megatron-core's checkpoint writer an in-process result queue; no helper process is started.

    megatron-core 0.19.2 ``dist_checkpointing/strategies/filesystem_async.py:53``
    (``get_write_results_queue``) spawns a ``Manager().Queue()`` at a process's first save; the
    server re-imports ``__main__`` (7.6 s per launch on 2 busy cores) and outlives a killed parent.
    A synchronous save (no ``--async-save``) uses the queue within one process, so this sets
    ``filesystem_async._results_queue`` to a ``queue.Queue``.

    Returns:
        True when the queue was set; False when megatron-core has no such cache (another
        version: its own behaviour stays) or a queue exists already.
    """
    import queue

    try:
        from megatron.core.dist_checkpointing.strategies import filesystem_async
    except ImportError:
        return False
    if getattr(filesystem_async, "_results_queue", False) is not None:
        return False
    filesystem_async._results_queue = queue.Queue()
    return True


def _existing(path: Path) -> Path:
    """``path`` or its nearest ancestor that exists (where a new folder would be made)."""
    while not path.exists() and path != path.parent:
        path = path.parent
    return path


def check_writable(folder: str | os.PathLike) -> Path:
    """Refuse a run folder this process cannot write, before anything is made in it.

    Writes and deletes a probe file in ``folder``, or in its nearest existing ancestor when it does
    not exist yet (where ``mkdir`` would make it). ``os.access`` is not enough: it reports a
    root-owned folder writable to root even on a read-only mount in some containers.

    Returns:
        ``folder`` resolved.

    Raises:
        RunFolderNotWritableError: a read-only file system (``EROFS``), no write permission
            (``EACCES``/``EPERM``) or another error of the probe; the message names the folder and the fix.
        NotADirectoryError: ``folder`` (or the ancestor) is a file.
    """
    path = Path(folder).expanduser().resolve()
    where = _existing(path)
    if not where.is_dir():
        raise NotADirectoryError(f"run folder {path}: {where} is a file, not a folder; pass a folder path")
    try:
        fd, probe = tempfile.mkstemp(dir=where, prefix=".write-probe.")
        os.close(fd)
        os.unlink(probe)
    except OSError as err:
        why = {errno.EROFS: "it is on a read-only file system", errno.EACCES: "this user may not write there",
               errno.EPERM: "this user may not write there", errno.ENOSPC: "its disk is full"}.get(err.errno, err.strerror)
        inside = "" if where == path else f" (it does not exist yet; it would be made in {where})"
        raise RunFolderNotWritableError(
            f"the run folder {path} cannot be written{inside}: {why} ([Errno {err.errno}]). Pick a folder you can "
            f"write: --run-dir ~/runs/NAME for python -m helpers.runner.series, run_dir= in a notebook; or make this one "
            f"writable. Nothing was started and nothing was changed.") from None
    return path


def free_bytes(folder: str | os.PathLike) -> int:
    """Free bytes, for this user, on the disk that holds ``folder`` (or would: its nearest existing ancestor)."""
    return shutil.disk_usage(_existing(Path(folder).expanduser().resolve())).free


def human_bytes(n: float) -> str:
    """``1536`` -> ``"1.5 KB"``; decimal units (kB = 1000 bytes), as ``df -H`` and disk makers count."""
    for unit in ("bytes", "kB", "MB", "GB", "TB"):
        if abs(n) < 1000 or unit == "TB":
            return f"{n:,.0f} {unit}" if unit == "bytes" else f"{n:,.1f} {unit}"
        n /= 1000
    raise AssertionError("unreachable")


def disk_full_message(folder: str | os.PathLike, needed: float | None, what: str, fix: str) -> str:
    """The message of a :class:`DiskFullError`: the folder, what needs the space, needed (``None``:
    unknown) and free, the fix."""
    path = Path(folder).expanduser().resolve()
    need = f"needs about {human_bytes(needed)}" if needed is not None else "needs more"
    return (f"The disk holding {path} has {human_bytes(free_bytes(path))} free, and {what} {need}. "
            f"Free space there (delete old runs: rm -r runs/<old run>), or {fix}.")


def check_free_space(folder: str | os.PathLike, needed: float, what: str, fix: str) -> None:
    """Refuse a step that would write ``needed`` bytes into ``folder`` when its disk has less free.

    Args:
        folder: where the step writes (need not exist yet).
        needed: bytes the step will write (an estimate: name its source in ``what``).
        what: what needs the space, e.g. ``"training (4 checkpoints of 41 MB, helpers.learn.memory.checkpoint_bytes)"``.
        fix: the other way out besides freeing space, e.g. ``"train into a run folder on a bigger disk (run_dir=)"``.

    Raises:
        DiskFullError: too little free space; nothing was written.
    """
    if free_bytes(folder) < needed:
        raise DiskFullError(disk_full_message(folder, needed, what, fix) + " Nothing was written.")


@contextlib.contextmanager
def explain_disk_full(folder: str | os.PathLike, needed: float | None, what: str, fix: str) -> Iterator[None]:
    """Turn an ``OSError`` with ``errno.ENOSPC`` (a disk that filled up during the block) into a
    :class:`DiskFullError` naming ``folder``, the space needed and free, and the fix (see
    :func:`check_free_space` for the arguments). Other errors pass through unchanged.
    """
    try:
        yield
    except DiskFullError:
        raise
    except OSError as err:
        if err.errno != errno.ENOSPC:
            raise
        raise DiskFullError(f"The disk filled up while {what} was written ([Errno 28] {err.strerror}"
                            + (f": {err.filename}" if err.filename else "") + "). "
                            + disk_full_message(folder, needed, "it", fix)) from err
