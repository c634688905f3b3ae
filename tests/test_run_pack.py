"""helpers/runner/run_pack.py (make pack / make unpack): a run folder as one archive and back, its refusals,
and a packed smoke run unpacked at another path whose notebook 07 runs without training again."""

from __future__ import annotations

import io
import json
import os
import subprocess
import tarfile
from pathlib import Path

import pytest

from helpers.runner import run_pack
from helpers.support import run_guard

ROOT = Path(__file__).resolve().parent.parent


def _run_folder(path: Path) -> Path:
    """A tiny run folder with the layout of a real one (helpers/runner/series.py, helpers/support/results.py)."""
    files = {
        "summary.json": json.dumps({"03_training": {"checkpoint_path": str(path / "checkpoints" / "iter_0000012")}}),
        "run.json": json.dumps({"run_dir": str(path)}),
        "training.log": "iteration 12/12\n",
        "executed/03_training.ipynb": "{}",
        "executed/last-attempt/05_parallelism.ipynb": "{}",  # a failed attempt: left out
        "figures/loss.png": "png",
        "data/data_manifest.json": "{}",
        "data/cache/abc-GPTDataset-train-description.txt": str(path),  # keyed by the absolute path: left out
        "checkpoints/latest_checkpointed_iteration.txt": "12",
        "checkpoints/iter_0000012/__0_0.distcp": "x" * 5000,
        "series.lock": "",
        "training.lock": "",
    }
    for rel, text in files.items():
        (path / rel).parent.mkdir(parents=True, exist_ok=True)
        (path / rel).write_text(text)
    return path


def _tar(path: Path, members: dict[str, bytes | None], links: dict[str, str] | None = None) -> Path:
    with tarfile.open(path, "w:gz") as tar:
        for name, data in members.items():
            info = tarfile.TarInfo(name)
            if data is None:
                info.type = tarfile.DIRTYPE
                tar.addfile(info)
            else:
                info.size = len(data)
                tar.addfile(info, io.BytesIO(data))
        for name, target in (links or {}).items():
            info = tarfile.TarInfo(name)
            info.type, info.linkname = tarfile.SYMTYPE, target
            tar.addfile(info)
    return path


def test_pack_writes_one_folder_less_attempts_locks_and_index_caches(tmp_path):
    run = _run_folder(tmp_path / "runs" / "cpu-20261204-1500")
    r = run_pack.pack(run, tmp_path / "out" / "run.tar.gz")
    assert r.archive == tmp_path / "out" / "run.tar.gz" and r.archive_bytes == r.archive.stat().st_size > 0
    with tarfile.open(r.archive) as tar:
        names = set(tar.getnames())
        owners = {(m.uid, m.gid, m.uname, m.gname) for m in tar.getmembers()}
        manifest = json.load(tar.extractfile(f"cpu-20261204-1500/{run_pack.MANIFEST_NAME}"))
    assert "cpu-20261204-1500/checkpoints/iter_0000012/__0_0.distcp" in names
    assert "cpu-20261204-1500/summary.json" in names and "cpu-20261204-1500/executed/03_training.ipynb" in names
    assert not any("last-attempt" in n or n.endswith(".lock") or "/data/cache" in n for n in names), names
    assert all(n == "cpu-20261204-1500" or n.startswith("cpu-20261204-1500/") for n in names)
    assert owners == {(0, 0, "", "")}
    assert r.files == 8 and manifest["files"] == 8 and manifest["packed_from"] == str(run.resolve())
    assert manifest["left_out"] == ["data/cache/", "executed/last-attempt/", "series.lock", "training.lock"]
    assert r.file_bytes == sum((run / p).stat().st_size for p in
                               ["summary.json", "run.json", "training.log", "executed/03_training.ipynb", "figures/loss.png",
                                "data/data_manifest.json", "checkpoints/latest_checkpointed_iteration.txt",
                                "checkpoints/iter_0000012/__0_0.distcp"])


def test_pack_of_runs_latest_is_named_after_the_folder_it_points_at(tmp_path, monkeypatch):
    runs = tmp_path / "runs"
    _run_folder(runs / "base")
    (runs / "latest").symlink_to("base")
    monkeypatch.setattr(run_pack, "RUNS_DIR", runs)
    r = run_pack.pack(runs / "latest")
    assert r.archive == runs / "base.tar.gz"
    with tarfile.open(r.archive) as tar:
        assert "base/summary.json" in tar.getnames()


def test_unpack_at_another_path_gives_the_same_files_and_points_latest_once(tmp_path):
    run = _run_folder(tmp_path / "a" / "runs" / "base")
    archive = run_pack.pack(run, tmp_path / "base.tar.gz").archive
    runs = tmp_path / "b" / "clone" / "runs"
    r = run_pack.unpack(archive, runs)
    assert r.run_dir == runs / "base" and r.latest and os.readlink(runs / "latest") == "base"
    assert r.packed_from == str(run.resolve())
    for rel in ("summary.json", "checkpoints/iter_0000012/__0_0.distcp", "executed/03_training.ipynb"):
        assert (runs / "base" / rel).read_bytes() == (run / rel).read_bytes()
        assert (runs / "base" / rel).stat().st_mtime == pytest.approx((run / rel).stat().st_mtime, abs=1)
    assert not (runs / "base" / "executed" / "last-attempt").exists() and not (runs / "base" / "series.lock").exists()
    assert [p.name for p in runs.iterdir() if p.name.startswith(".")] == []  # no temporary folder left
    with pytest.raises(run_pack.PackError, match=r"exists already.*rm -r .*AS=<other>"):
        run_pack.unpack(archive, runs)
    again = run_pack.unpack(archive, runs, name="mine")
    assert again.run_dir == runs / "mine" and not again.latest and os.readlink(runs / "latest") == "base"


@pytest.mark.parametrize("members, links, match", [
    ({"base/": None, "base/summary.json": b"{}", "base/../../evil.txt": b"x"}, None, "outside the run folder"),
    ({"/etc/evil": b"x", "base/summary.json": b"{}"}, None, "outside the run folder"),
    ({"base/summary.json": b"{}"}, {"base/link": "/etc/passwd"}, "symbolic link"),
    ({"base/summary.json": b"{}", "other/summary.json": b"{}"}, None, "2 top-level entries"),
    ({"base/notes.txt": b"x"}, None, "has no summary.json"),
])
def test_unpack_refuses_an_archive_that_is_not_one_run_folder_inside_itself(tmp_path, members, links, match):
    archive = _tar(tmp_path / "bad.tar.gz", members, links)
    runs = tmp_path / "runs"
    with pytest.raises(run_pack.PackError, match=match):
        run_pack.unpack(archive, runs)
    assert not (tmp_path / "evil.txt").exists() and not runs.exists()


def test_unpack_refuses_a_file_that_is_not_a_tar_gz(tmp_path):
    not_tar = tmp_path / "notes.tar.gz"
    not_tar.write_bytes(b"this is a text file, not an archive\n" * 10)
    with pytest.raises(run_pack.PackError, match="cannot be read as a tar.gz"):
        run_pack.unpack(not_tar, tmp_path / "runs")
    with pytest.raises(run_pack.PackError, match="no such file"):
        run_pack.unpack(tmp_path / "missing.tar.gz", tmp_path / "runs")


def test_pack_refuses_a_folder_without_summary_and_an_archive_inside_the_run(tmp_path):
    (tmp_path / "empty").mkdir()
    with pytest.raises(run_pack.PackError, match="is not a run folder.*has no summary.json"):
        run_pack.pack(tmp_path / "empty", tmp_path / "x.tar.gz")
    with pytest.raises(run_pack.PackError, match="does not exist"):
        run_pack.pack(tmp_path / "nothing", tmp_path / "x.tar.gz")
    run = _run_folder(tmp_path / "run")
    with pytest.raises(run_pack.PackError, match="inside the run folder"):
        run_pack.pack(run, run / "run.tar.gz")
    assert not (tmp_path / "x.tar.gz").exists() and not (run / "run.tar.gz").exists()


@pytest.mark.parametrize("lock, doing", [("series.lock", "run by another series runner"), ("training.lock", "trained")])
def test_pack_refuses_a_run_folder_a_job_is_writing(tmp_path, lock, doing):
    run = _run_folder(tmp_path / "run")
    with run_guard.run_folder_lock(run, name=lock, doing=doing):  # as the series runner / a training job holds it
        with pytest.raises(run_guard.RunFolderBusyError, match=f"{lock} is held by pid {os.getpid()}.*Wait for the run"):
            run_pack.pack(run, tmp_path / "x.tar.gz")
    assert not (tmp_path / "x.tar.gz").exists()
    assert run_pack.pack(run, tmp_path / "x.tar.gz").files == 8  # once the job is gone


def test_make_pack_and_unpack_print_the_size_and_refuse_with_the_fix(tmp_path):
    run = _run_folder(tmp_path / "run")
    archive = tmp_path / "run.tar.gz"
    done = subprocess.run(["make", "-s", "pack", f"RUN={run}", f"PACK={archive}"], cwd=ROOT, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    assert f"into {archive}: " in done.stdout and ("kB in" in done.stdout or "bytes in" in done.stdout), done.stdout
    assert "left out: data/cache/, executed/last-attempt/, series.lock, training.lock" in done.stdout
    no_pack = subprocess.run(["make", "-s", "unpack"], cwd=ROOT, capture_output=True, text=True)
    assert no_pack.returncode != 0 and "make unpack PACK=<file.tar.gz>" in no_pack.stderr
    code = run_pack.main(["unpack", str(tmp_path / "missing.tar.gz"), "--runs", str(tmp_path / "runs")])
    assert code == 2
    assert run_pack.main(["unpack", str(archive), "--runs", str(tmp_path / "runs")]) == 0
    assert (tmp_path / "runs" / "run" / "summary.json").is_file()


@pytest.mark.slow
@pytest.mark.timeout(1800)
def test_a_packed_smoke_run_unpacked_elsewhere_evaluates_without_training_again(series_run, tmp_path):
    """The instructor's smoke run, packed, unpacked into another clone's runs/ while the original folder is
    moved away (nothing may read its absolute paths), then notebook 07 re-executed there: it needs the
    checkpoint and the converted model, and must not train (checkpoints and training.log untouched)."""
    from helpers.runner import series

    run_dir = series_run[0]
    archive = run_pack.pack(run_dir, tmp_path / "smoke.tar.gz").archive
    unpacked = run_pack.unpack(archive, tmp_path / "elsewhere" / "runs").run_dir
    watched = [unpacked / "training.log", *sorted((unpacked / "checkpoints").rglob("*.distcp"))]
    before = {p: p.stat().st_mtime_ns for p in watched}
    moved = run_dir.with_name(run_dir.name + "-moved")
    os.rename(run_dir, moved)
    try:
        runs = series.run("smoke", run_dir=unpacked, only=["07"])
    finally:
        os.rename(moved, run_dir)
    assert [r.stem for r in runs] == ["07_evaluation"]  # 01, 03 and 06 were found, not run again
    assert {p: p.stat().st_mtime_ns for p in watched} == before
    assert len(watched) > 1
