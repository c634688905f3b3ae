"""One archive of a finished run folder, and back: a workshop's slow laptops skip training.

Command line (the Makefile's ``pack`` and ``unpack``)::

    python -m helpers.runner.run_pack pack runs/latest                  # -> runs/<name>.tar.gz, prints its size
    python -m helpers.runner.run_pack unpack run.tar.gz --name mine     # -> runs/mine/ (+ runs/latest if absent)

An instructor packs one ``make tutorial`` run folder; a learner unpacks it, and the notebooks find the
data, checkpoints and converted model where :data:`helpers.runner.series.PRODUCES` says and skip the work.
No absolute path inside a run folder is read back to find a file, so it works at another path.

Sources: Python's ``tarfile`` documentation, "Extraction filters" (``filter="data"``); PEP 706.
"""

from __future__ import annotations

import argparse
import contextlib
import fcntl
import io
import json
import os
import shutil
import socket
import sys
import tarfile
import tempfile
import time
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path, PurePosixPath
from typing import Iterator

from helpers.support import results, run_guard

ROOT = Path(__file__).resolve().parents[2]
RUNS_DIR = ROOT / "runs"
#: The file ``pack`` adds to the archive's folder: what was packed, from where, and what was left out.
MANIFEST_NAME = "run_pack.json"
#: The lock files of a run folder: the series runner's (``helpers.runner.series.RUNNER_LOCK``) and training's.
LOCK_NAMES = ("series.lock", run_guard.LOCK_NAME)
#: What ``pack`` leaves out, as paths relative to the run folder (a folder leaves out all it holds):
#: failed attempts (``executed/last-attempt``: not results), the locks, and megatron-core's dataset index
#: caches (``data/cache`` and each layout run's): their file names are an MD5 of the data's absolute path
#: (``GPTDatasetConfig``'s unique description), so at another path they are never read; they are rebuilt
#: in seconds where needed.
LEFT_OUT = ("executed/last-attempt", *LOCK_NAMES)
#: Folder names left out wherever they are: Python's and Jupyter's caches, the index caches under ``data/``.
LEFT_OUT_NAMES = ("__pycache__", ".ipynb_checkpoints")
#: gzip level: 6 packs a cpu run's checkpoints (float32 weights, nearly incompressible) in about a third
#: of level 9's time for under 1 % more bytes.
COMPRESSLEVEL = 6


class PackError(ValueError):
    """A run folder that cannot be packed, or an archive that cannot be unpacked; nothing was written."""


@dataclass
class PackResult:
    """What :func:`pack` wrote: the archive, its size in bytes, files and bytes packed, what was left out."""

    archive: Path
    archive_bytes: int
    files: int
    file_bytes: int
    left_out: list[str] = field(default_factory=list)
    seconds: float = 0.0


@dataclass
class UnpackResult:
    """What :func:`unpack` made: the run folder, its files, and whether ``runs/latest`` now points at it."""

    run_dir: Path
    files: int
    latest: bool
    packed_from: str | None = None


def _left_out(rel: PurePosixPath, is_dir: bool) -> bool:
    """Whether ``rel`` (relative to the run folder) is left out of the archive (:data:`LEFT_OUT`)."""
    text = rel.as_posix()
    if text in LEFT_OUT or any(part in LEFT_OUT_NAMES for part in rel.parts):
        return True
    if rel.name.startswith(".write-probe.") or (rel.name.startswith(".") and rel.name.endswith(".tmp")):
        return True  # run_guard's probe and write_atomic's temporary files
    return is_dir and rel.name == "cache" and rel.parent.name == "data"  # megatron-core's index cache


def is_run_folder(folder: str | os.PathLike) -> bool:
    """A run folder is a folder with a ``summary.json`` (the series runner writes it first)."""
    return (Path(folder) / results.SUMMARY_FILE).is_file()


@contextlib.contextmanager
def _not_busy(folder: Path) -> Iterator[None]:
    """Hold the run folder's existing lock files (:data:`LOCK_NAMES`) for the block.

    Raises:
        helpers.support.run_guard.RunFolderBusyError: a series runner or a training job holds one; the
            message names the job (from the lock file) and the fixes.
    """
    with contextlib.ExitStack() as stack:
        for name in LOCK_NAMES:
            path = folder / name
            if not path.is_file():
                continue
            handle = stack.enter_context(open(path, "rb"))  # flock needs no write access
            try:
                fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                raise run_guard.RunFolderBusyError(
                    f"{folder} is being written ({name} is held by {run_guard.describe_holder(path)}): a pack of it would hold half-written "
                    "files. Wait for the run to finish (or stop it: kill <pid>), then pack it. Nothing was written.") from None
        yield


def default_archive(run_dir: str | os.PathLike) -> Path:
    """``runs/<name>.tar.gz`` for run folder ``run_dir`` (``runs/latest`` is named after the folder it points at)."""
    return RUNS_DIR / f"{Path(run_dir).expanduser().resolve().name}.tar.gz"


def pack(run_dir: str | os.PathLike, out: str | os.PathLike | None = None) -> PackResult:
    """Write run folder ``run_dir`` as one gzip'd tar ``out`` (default :func:`default_archive`).

    The archive holds ``<name>/...`` (the run folder's own name) less :data:`LEFT_OUT`, plus
    ``<name>/run_pack.json``; it is written to a temporary file and renamed, so a failed pack leaves nothing.

    Returns:
        :class:`PackResult` (archive bytes, files and bytes packed, seconds).

    Raises:
        PackError: ``run_dir`` is not a run folder (no ``summary.json``), or ``out`` lies inside it.
        helpers.support.run_guard.RunFolderBusyError: a series runner or training job is writing the folder.
        helpers.support.run_guard.DiskFullError: the disk of ``out`` filled up (the partial file is removed).
    """
    start = time.perf_counter()
    folder = Path(run_dir).expanduser().resolve()
    if not folder.is_dir() or not is_run_folder(folder):
        what = "does not exist" if not folder.exists() else "is not a folder" if not folder.is_dir() else \
            f"has no {results.SUMMARY_FILE}"
        raise PackError(f"RUN={run_dir} is not a run folder: {folder} {what}. Pack the folder a series run made "
                        "(make tutorial writes runs/<profile>-<time>/ and points runs/latest at it): "
                        "make pack RUN=runs/latest")
    target = Path(out).expanduser().resolve() if out is not None else default_archive(folder)
    if target == folder or folder in target.parents:
        raise PackError(f"PACK={out} lies inside the run folder {folder}: write the archive elsewhere "
                        f"(default {default_archive(folder)})")
    target.parent.mkdir(parents=True, exist_ok=True)
    name = folder.name
    with _not_busy(folder):
        files, left_out = [], []
        for dirpath, dirnames, filenames in os.walk(folder):
            here = Path(dirpath)
            rel_dir = PurePosixPath(here.relative_to(folder).as_posix())
            for d in sorted(dirnames):
                if _left_out(rel_dir / d, True) or (here / d).is_symlink():
                    left_out.append((rel_dir / d).as_posix() + "/")
            dirnames[:] = sorted(d for d in dirnames if f"{(rel_dir / d).as_posix()}/" not in left_out)
            for f in sorted(filenames):
                rel = rel_dir / f
                if _left_out(rel, False) or not (here / f).is_file() or (here / f).is_symlink():
                    left_out.append(rel.as_posix())
                else:
                    files.append(rel)
        file_bytes = sum((folder / rel).stat().st_size for rel in files)
        manifest = {"format": 1, "name": name, "packed_from": str(folder), "host": socket.gethostname(),
                    "packed": datetime.now().isoformat(timespec="seconds"), "files": len(files),
                    "file_bytes": file_bytes, "left_out": sorted(left_out)}
        with run_guard.explain_disk_full(target.parent, None, f"the archive {target.name}",
                                         "write it onto another disk (PACK=/path/to/file.tar.gz)"):
            fd, tmp = results.mkstemp_readable(target.parent, f".{target.name}.", ".tmp")
            os.close(fd)
            try:
                with tarfile.open(tmp, "w:gz", compresslevel=COMPRESSLEVEL, format=tarfile.PAX_FORMAT) as tar:
                    tar.add(folder, arcname=name, recursive=False, filter=_anonymous)
                    for rel in files:
                        tar.add(folder / rel, arcname=f"{name}/{rel.as_posix()}", recursive=False, filter=_anonymous)
                    data = (json.dumps(manifest, indent=2, sort_keys=True) + "\n").encode()
                    info = tarfile.TarInfo(f"{name}/{MANIFEST_NAME}")
                    info.size, info.mtime, info.mode = len(data), int(time.time()), 0o644
                    tar.addfile(info, io.BytesIO(data))
                os.replace(tmp, target)
            except BaseException:
                Path(tmp).unlink(missing_ok=True)
                raise
    return PackResult(target, target.stat().st_size, len(files), file_bytes, sorted(left_out),
                      time.perf_counter() - start)


def _anonymous(info: tarfile.TarInfo) -> tarfile.TarInfo:
    """A member without the packing machine's owner: uid/gid 0, no user or group names."""
    info.uid = info.gid = 0
    info.uname = info.gname = ""
    return info


def check_archive(archive: str | os.PathLike) -> tuple[str, list[tarfile.TarInfo]]:
    """Read an archive's member list and check it is one run folder that stays inside itself.

    Returns:
        ``(name, members)``: the run folder's name (the archive's one top folder) and its members.

    Raises:
        PackError: not a file, not a (gzip'd) tar, no single top folder with a ``summary.json``, or a
            member that is an absolute path, holds ``..``, or is not a plain file or folder (a link,
            a device): the message names the member.
    """
    path = Path(archive).expanduser()
    if not path.is_file():
        raise PackError(f"PACK={archive}: no such file. Give the archive made by make pack (runs/<name>.tar.gz)")
    try:
        with tarfile.open(path, "r:*") as tar:
            members = tar.getmembers()
    except (tarfile.TarError, EOFError, OSError) as err:
        raise PackError(f"PACK={archive} is not a run archive made by make pack: it cannot be read as a tar.gz "
                        f"({type(err).__name__}: {err}). Copy it again (a damaged or partial copy?), or pack the "
                        "run again: make pack RUN=runs/<name>") from None
    tops = set()
    for m in members:
        p = PurePosixPath(m.name)
        if m.name.startswith(("/", "\\")) or p.is_absolute() or ".." in p.parts or (p.parts and ":" in p.parts[0]):
            raise PackError(f"PACK={archive}: member {m.name!r} would be written outside the run folder "
                            "(an absolute path or '..'); this is no archive make pack wrote. Nothing was unpacked.")
        if not (m.isfile() or m.isdir()):
            raise PackError(f"PACK={archive}: member {m.name!r} is a {_kind(m)}, not a file or folder; a run archive "
                            "holds none (make pack never writes one). Nothing was unpacked.")
        parts = [q for q in p.parts if q not in ("", ".")]
        if parts:
            tops.add(parts[0])
    if len(tops) != 1:
        raise PackError(f"PACK={archive} is not a run archive made by make pack: it holds {len(tops)} top-level "
                        f"entries ({', '.join(sorted(tops)[:5]) or 'none'}), not one run folder. Nothing was unpacked.")
    name = tops.pop()
    names = {PurePosixPath(m.name).as_posix().lstrip("./") for m in members}
    if f"{name}/{results.SUMMARY_FILE}" not in names:
        raise PackError(f"PACK={archive} is not a run archive made by make pack: {name}/ has no {results.SUMMARY_FILE}. "
                        "Nothing was unpacked.")
    if name.startswith(".") or name == "latest":
        raise PackError(f"PACK={archive}: its folder is named {name!r}; unpack it under another name (--name, AS=)")
    return name, members


def _kind(m: tarfile.TarInfo) -> str:
    return ("symbolic link" if m.issym() else "hard link" if m.islnk() else "device" if m.isdev()
            else "FIFO" if m.isfifo() else "special member")


def unpack(archive: str | os.PathLike, runs_dir: str | os.PathLike | None = None, *, name: str | None = None) -> UnpackResult:
    """Unpack a :func:`pack` archive into ``runs_dir/<name>`` (default ``runs/``, the archive's folder name);
    point ``runs_dir/latest`` at it when there is no ``latest`` yet. Every check of :func:`check_archive`
    runs first; members are extracted with ``filter="data"`` into a temporary folder, then renamed.

    Returns:
        :class:`UnpackResult`.

    Raises:
        PackError: the archive (see :func:`check_archive`), a bad ``name``, or ``runs_dir/<name>`` exists
            (the message names the two fixes). Nothing was written.
        helpers.support.run_guard.RunFolderNotWritableError: ``runs_dir`` cannot be written.
        helpers.support.run_guard.DiskFullError: the disk filled up (the temporary folder is removed).
    """
    top, members = check_archive(archive)
    name = name or top
    if not name or "/" in name or os.sep in name or name in (".", "..", "latest") or name.startswith("."):
        raise PackError(f"AS={name!r}: give a plain folder name (not 'latest', no '/', not starting with '.')")
    runs = run_guard.check_writable(Path(runs_dir) if runs_dir is not None else RUNS_DIR)
    runs.mkdir(parents=True, exist_ok=True)
    dest = runs / name
    if dest.exists() or dest.is_symlink():
        raise PackError(f"{dest} exists already; unpacking would overwrite a run. Remove it (rm -r {dest}), or unpack "
                        f"under another name: make unpack PACK={archive} AS=<other> (python -m helpers.runner.run_pack "
                        f"unpack {archive} --name <other>). Nothing was written.")
    size = sum(m.size for m in members)
    run_guard.check_free_space(runs, size, f"unpacking {Path(archive).name} ({len(members)} members)",
                               "unpack into a clone on a bigger disk")
    tmp = Path(tempfile.mkdtemp(prefix=f".unpack-{name}.", dir=runs))
    try:
        with run_guard.explain_disk_full(runs, size, f"unpacking {Path(archive).name}", "unpack on a bigger disk"), \
                tarfile.open(Path(archive).expanduser(), "r:*") as tar:
            tar.extractall(tmp, filter="data")
        results.default_modes(tmp)
        os.rename(tmp / top, dest)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    manifest = {}
    with contextlib.suppress(OSError, json.JSONDecodeError):
        manifest = json.loads((dest / MANIFEST_NAME).read_text())
    latest = runs / "latest"
    pointed = False
    if not (latest.is_symlink() or latest.exists()):
        latest.symlink_to(name)
        pointed = True
    files = sum(1 for m in members if m.isfile())
    return UnpackResult(dest, files, pointed, manifest.get("packed_from"))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m helpers.runner.run_pack", description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("pack", help="pack a run folder into one .tar.gz")
    p.add_argument("run_dir", nargs="?", default=str(RUNS_DIR / "latest"), help="run folder (default runs/latest)")
    p.add_argument("--out", default=None, help="archive path (default runs/<name>.tar.gz)")
    u = sub.add_parser("unpack", help="unpack an archive into runs/<name>")
    u.add_argument("archive", help="the .tar.gz made by pack")
    u.add_argument("--runs", default=str(RUNS_DIR), help="the runs folder to unpack into (default this clone's runs/)")
    u.add_argument("--name", default=None, help="folder name (default the packed run's name)")
    args = parser.parse_args(argv)
    try:
        if args.command == "pack":
            r = pack(args.run_dir, args.out)
            print(f"packed {r.files} files ({run_guard.human_bytes(r.file_bytes)}) into {r.archive}: "
                  f"{run_guard.human_bytes(r.archive_bytes)} in {r.seconds:.0f} s")
            if r.left_out:
                print(f"left out: {', '.join(r.left_out)}")
            print(f"a learner unpacks it into their clone with: make unpack PACK={r.archive.name}")
            return 0
        r = unpack(args.archive, args.runs, name=args.name)
        print(f"unpacked {r.files} files into {r.run_dir}" + (f" (packed from {r.packed_from})" if r.packed_from else ""))
        print(f"runs/latest -> {r.run_dir.name}" if r.latest else
              f"runs/latest was left as it is; use this run with --run-dir {r.run_dir} (or ln -sfn {r.run_dir.name} "
              f"{r.run_dir.parent}/latest)")
        return 0
    except (PackError, run_guard.RunFolderBusyError, run_guard.RunFolderNotWritableError, run_guard.DiskFullError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
