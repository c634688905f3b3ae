"""Issue 24: what a demanding user found, each case reproduced. A full disk (a small tmpfs in a
mount namespace: ``unshare -rm``), a read-only run folder (a read-only mount), a ``.bin`` cut
short, a tokenizer folder missing ``merges.txt``. Each ends with a message that names the input
and the fix, leaves earlier results intact and leaves no process running. (Rows without text:
tests/test_datasets_source.py; a failed rerun keeping the last good results: tests/test_series.py;
a killed save leaving no process: tests/test_launch.py.)"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from helpers.learn import dataloader, preprocess, tokenizer, training_config
from helpers.runner import data_stage
from test_training import TINY_MODEL, data, tiny_config  # noqa: F401  (data is a fixture)

pytestmark = pytest.mark.trains

ROOT = Path(__file__).resolve().parent.parent


def _unshare_works() -> bool:
    if shutil.which("unshare") is None:
        return False
    probe = subprocess.run(["unshare", "-rm", "sh", "-c", "mount -t tmpfs -o size=1m tmpfs /mnt"], capture_output=True)
    return probe.returncode == 0


needs_mounts = pytest.mark.skipif(not _unshare_works(), reason="needs unshare -rm (user and mount namespaces) to mount a small tmpfs")


def _in_small_disk(tmp_path: Path, script: str, size: str, *, read_only: bool = False, timeout: int = 600) -> dict:
    """Run ``script`` (Python; ``DISK`` is the mounted folder) in a mount namespace where ``DISK`` is a
    tmpfs of ``size`` (``mount -o size=``), read-only if asked; returns the JSON its last line prints."""
    disk = tmp_path / "disk"
    disk.mkdir(exist_ok=True)
    body = f"import json, sys\nsys.path[:0] = [{str(ROOT)!r}, {str(ROOT / 'tests')!r}]\nDISK = {str(disk)!r}\n" + textwrap.dedent(script)
    (tmp_path / "script.py").write_text(body)
    options = f"size={size}" + (",ro" if read_only else "")
    proc = subprocess.run(["unshare", "-rm", "sh", "-c", f"mount -t tmpfs -o {options} tmpfs {disk} && exec "
                           f"{sys.executable} {tmp_path / 'script.py'}"], capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


# --------------------------------------------------------------------------- damaged data
def test_a_bin_shorter_than_its_idx_is_named_with_both_files_and_notebook_01(data, tmp_path):
    shutil.copytree(data.data_prefix.parent, tmp_path / "data")
    prefix = tmp_path / "data" / data.data_prefix.name
    bin_path = Path(f"{prefix}.bin")
    size = bin_path.stat().st_size
    with open(bin_path, "r+b") as f:
        f.truncate(size - 1000)  # a copy cut short
    for open_it in (lambda: preprocess.open_indexed_dataset(prefix),
                    lambda: dataloader.build_gpt_datasets(prefix, tmp_path / "data" / "tokenizer", seq_length=64,
                                                          num_samples=(8, 8, 8), split="90,8,2",
                                                          cache_dir=tmp_path / "cache"),
                    lambda: tiny_config(data, tmp_path / "run", data_prefix=str(prefix)).check()):
        with pytest.raises(preprocess.DamagedDataError) as err:
            open_it()
        text = str(err.value)
        assert f"{bin_path} has {size - 1000:,} bytes but {prefix}.idx describes {size:,}" in text
        assert "run notebook 01 again" in text and "it remakes both from the loose JSON" in text


def test_a_tokenizer_folder_missing_merges_names_the_file_and_how_to_rebuild(data, tmp_path):
    run = tmp_path / "run"
    shutil.copytree(data.data_prefix.parent, run / "data")
    (run / "data" / "tokenizer" / "merges.txt").unlink()
    for read_it in (lambda: data_stage.data_paths(run), lambda: tokenizer.load_tokenizer(run / "data" / "tokenizer"),
                    lambda: dataloader.MegatronTokenizerAdapter(run / "data" / "tokenizer"),
                    lambda: training_config.profile("cpu", str(run), model=dict(TINY_MODEL), split="90,8,2").check()):
        with pytest.raises(FileNotFoundError, match=r"tokenizer folder .*/tokenizer lacks merges.txt.*Rebuild it: delete "
                                                    r".*run notebook 01 again.*retrains it from the loose JSON"):
            read_it()


def test_a_save_the_disk_cuts_short_leaves_no_checkpoint_folder(tmp_path, monkeypatch):
    """Breaker (issue 24): notebook 06's way-back checkpoint was left with a shard cut short."""
    import errno

    from megatron.core import dist_checkpointing

    from helpers.learn import checkpointing, distributed, model

    def full_disk(state, folder, *args, **kwargs):
        (Path(folder) / "__0_0.distcp").write_bytes(b"\0" * 100)
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(dist_checkpointing, "save", full_disk)
    with distributed.single_process():
        cfg = model.ModelConfig(**TINY_MODEL)
        with pytest.raises(OSError, match="No space left"):
            checkpointing.save_model(model.build_model(cfg), tmp_path / "ck", 0, cfg.to_metadata())
    assert not (tmp_path / "ck" / "iter_0000000").exists() and checkpointing.latest_iteration(tmp_path / "ck") is None


# --------------------------------------------------------------------------- read-only run folders
@needs_mounts
def test_a_read_only_run_folder_is_refused_by_name_before_anything_starts(data, tmp_path):
    out = _in_small_disk(tmp_path, f"""
        import contextlib, io, os
        from helpers.runner import data_stage, launch, series
        from helpers.support import run_guard
        from test_training import tiny_config
        from types import SimpleNamespace
        out = {{}}
        for name, run_dir in (("folder", DISK), ("new subfolder", DISK + "/new/run")):
            err = io.StringIO()
            with contextlib.redirect_stderr(err):
                out[name] = [series.main(["run", "--run-dir", run_dir, "--only", "01"]), err.getvalue()]
        try:
            data_stage.build_data(DISK, max_files=5, progress=False)
        except run_guard.RunFolderNotWritableError as e:
            out["build_data"] = str(e)
        data = SimpleNamespace(data_prefix={str(data.data_prefix)!r}, tokenizer_dir={str(data.tokenizer_dir)!r})
        try:
            launch.train(tiny_config(data, DISK + "/train"), progress=False)
        except run_guard.RunFolderNotWritableError as e:
            out["train"] = str(e)
        out["left"] = os.listdir(DISK)
        print(json.dumps(out))
    """, "1m", read_only=True)
    for name, where in (("folder", ""), ("new subfolder", "/new/run")):
        code, err = out[name]
        assert code == 2 and len(err.strip().splitlines()) == 1, err  # one line, not a 34-line traceback
        assert f"the run folder {tmp_path / 'disk'}{where} cannot be written" in err
        assert "it is on a read-only file system ([Errno 30])" in err and "--run-dir ~/runs/NAME" in err
    assert "would be made in" in out["new subfolder"][1]
    assert f"{tmp_path / 'disk' / 'data'} cannot be written" in out["build_data"]
    assert f"{tmp_path / 'disk' / 'train'} cannot be written" in out["train"] and "Nothing was started" in out["train"]
    assert out["left"] == []


# --------------------------------------------------------------------------- a full disk
@needs_mounts
def test_training_on_a_disk_too_small_for_its_checkpoints_is_refused_before_it_starts(data, tmp_path):
    out = _in_small_disk(tmp_path, f"""
        import os
        from types import SimpleNamespace
        from helpers.runner import launch
        from helpers.support import run_guard
        from test_training import tiny_config
        data = SimpleNamespace(data_prefix={str(data.data_prefix)!r}, tokenizer_dir={str(data.tokenizer_dir)!r})
        try:
            launch.train(tiny_config(data, DISK + "/run"), progress=False)
        except run_guard.DiskFullError as e:
            print(json.dumps({{"error": str(e), "left": sorted(os.listdir(DISK + "/run")) if os.path.isdir(DISK + "/run") else []}}))
    """, "2m")
    assert f"The disk holding {tmp_path / 'disk' / 'run' / 'checkpoints'} has 2.1 MB free" in out["error"]
    assert "training (3 checkpoints of about" in out["error"] and "save fewer checkpoints (a larger save_interval)" in out["error"]
    assert out["error"].endswith("Nothing was written.") and "run.json" not in out["left"]


@needs_mounts
def test_a_disk_that_fills_during_training_ends_with_the_folder_the_space_and_the_fix(data, tmp_path):
    """The preflight passes (another job fills the disk later, or an estimate falls short): the save
    fails in megatron-core, which reports only "Worker failure"; the message names the folder,
    the space needed and free and the fix, the unfinished checkpoint is gone, nothing runs on."""
    out = _in_small_disk(tmp_path, f"""
        import os
        from types import SimpleNamespace
        from helpers.runner import launch, preflight
        from helpers.support import run_guard
        from test_training import tiny_config
        preflight.check_disk = lambda plan, folder: None  # the preflight saw enough space
        data = SimpleNamespace(data_prefix={str(data.data_prefix)!r}, tokenizer_dir={str(data.tokenizer_dir)!r})
        try:
            launch.train(tiny_config(data, DISK + "/run"), progress=False, env={{"OMP_NUM_THREADS": "1"}})
        except run_guard.DiskFullError as e:
            error = str(e)
        mine = str(os.getpid())
        others = [p for p in os.listdir("/proc") if p.isdigit() and p != mine
                  and DISK.encode() in open(f"/proc/{{p}}/cmdline", "rb").read()]
        print(json.dumps({{"error": error, "checkpoints": sorted(os.listdir(DISK + "/run/checkpoints")),
                          "processes": others}}))
    """, "1500k")
    error = out["error"]
    assert error.startswith("training stopped: the disk filled up while a checkpoint was saved (no checkpoint was "
                            "complete; the unfinished iter_0000004 was deleted)")
    assert f"The disk holding {tmp_path / 'disk' / 'run' / 'checkpoints'} has" in error
    assert "the rest of the run (3 checkpoints of about" in error and "train into a run folder on a bigger disk" in error
    assert error.endswith(f"The log: {tmp_path / 'disk' / 'run' / 'training.log'}")
    assert out["checkpoints"] == [] and out["processes"] == []


@needs_mounts
def test_the_data_stage_checks_the_space_first_and_a_full_disk_leaves_no_half_written_file(tmp_path):
    out = _in_small_disk(tmp_path, """
        import os
        from helpers.runner import data_stage
        from helpers.support import run_guard
        out = {}
        try:
            data_stage.build_data(DISK + "/a", max_files=300, progress=False)
        except run_guard.DiskFullError as e:
            out["refused"], out["a"] = str(e), sorted(os.listdir(DISK + "/a/data"))
        data_stage.run_guard.check_free_space = lambda *args: None  # the check passed; the disk fills later
        try:
            data_stage.build_data(DISK + "/b", max_files=300, progress=False)
        except run_guard.DiskFullError as e:
            out["filled"], out["b"] = str(e), sorted(os.listdir(DISK + "/b/data"))
        print(json.dumps(out))
    """, "1m")
    assert out["refused"].startswith(f"The disk holding {tmp_path / 'disk' / 'a' / 'data'} has")
    assert "notebook 01's data (the loose JSON and the .bin/.idx of" in out["refused"] and out["a"] == []
    assert out["filled"].startswith("The disk filled up while notebook 01's data (the loose JSON and the .bin/.idx of")
    assert "was written ([Errno 28] No space left on device" in out["filled"]
    assert "read fewer files (max_files=)" in out["filled"]
    assert out["b"] == []  # the loose JSON is written under a temporary name: nothing half-written is left


@needs_mounts
def test_a_notebook_the_runner_cannot_save_leaves_the_last_good_one_and_names_the_disk(tmp_path):
    """The runner's own write (papermill saving the executed notebook) hits ENOSPC: a clear error,
    and the finished notebook and its results from the earlier run stay."""
    out = _in_small_disk(tmp_path, """
        import nbformat
        from nbformat.v4 import new_code_cell, new_notebook
        from pathlib import Path
        from helpers.support import results, run_guard
        from helpers.runner import series
        nbdir = Path(DISK).parent / "notebooks"
        nbdir.mkdir(exist_ok=True)
        nb = new_notebook()
        nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3", "language": "python"}
        params = new_code_cell('run_dir: str = "x"  # run folder\\nprofile: str = "cpu"  # profile\\nfill: bool = False  # fill the disk')
        params.metadata["tags"] = ["parameters"]
        nb.cells = [params, new_code_cell("from helpers.support import results\\nresults.record(run_dir, '00_fill', 'ok', 1)"),
                    new_code_cell("if fill:\\n    with open(run_dir + '/filler', 'wb') as f:\\n        try:\\n"
                                  "            f.write(b'x' * 10_000_000)\\n        except OSError:\\n            pass\\n"
                                  "print('x' * 200_000)")]
        nbformat.write(nb, nbdir / "00_fill.ipynb")
        series.NOTEBOOK_DIR = nbdir
        run = DISK + "/run"
        series.run("cpu", run_dir=run)
        good = (Path(run, "executed", "00_fill.ipynb").read_bytes(), results.load_summary(run)["00_fill"])
        out = {}
        try:
            series.run("cpu", {"fill": True}, run_dir=run)
        except run_guard.DiskFullError as e:
            out["error"] = str(e)
        out["kept"] = (Path(run, "executed", "00_fill.ipynb").read_bytes(), results.load_summary(run)["00_fill"]) == good
        print(json.dumps(out))
    """, "1m")
    assert out["error"].startswith("The disk filled up while notebook 00_fill (its executed notebook ")
    assert "last-attempt/00_fill.ipynb, kept as it is: not a result) was written" in out["error"]
    assert "--run-dir" in out["error"]
    assert out["kept"] is True
