"""Issue 13, end to end on the tiny model: a trainer whose torchrun dies stops (and saves), one
job trains a run folder at a time, and a damaged checkpoint shard fails with the rank, the
exception, the folder and the files to read in the last lines."""

from __future__ import annotations

import os
import shutil
import signal
import threading
import time
from pathlib import Path

import pytest

from helpers.learn import checkpointing
from helpers.runner import launch
from helpers.support import run_guard
from test_training import data, tiny_config  # noqa: F401  (data is a fixture)

pytestmark = pytest.mark.trains


def _ppid(pid: int) -> int:
    return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])


def _alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def test_an_orphaned_trainer_saves_and_stops_and_frees_the_run_folder(data, tmp_path):
    cfg = tiny_config(data, tmp_path, train_iters=100_000, eval_interval=100_000, save_interval=0, log_interval=1)
    box = {}

    def train():
        try:
            launch.train(cfg, progress=False, timeout_s=300, env={"OMP_NUM_THREADS": "1"}, max_epochs=0)  # killed long before
        except Exception as err:
            box["err"] = err

    thread = threading.Thread(target=train)
    thread.start()
    log, lock = cfg.run_path / "training.log", cfg.run_path / run_guard.LOCK_NAME
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and not (log.exists() and "iteration        3/" in log.read_text()):
        assert thread.is_alive(), box
        time.sleep(0.2)
    with pytest.raises(run_guard.RunFolderBusyError, match="is being trained by another job"):
        launch.train(cfg, progress=False)  # a second job on the same folder is refused, naming the first
    trainer = int(__import__("json").loads(lock.read_text())["pid"])
    os.killpg(os.getpgid(_ppid(trainer)), signal.SIGKILL)  # torchrun's group; the trainer has its own session
    start = time.monotonic()
    while _alive(trainer) and time.monotonic() - start < 60:
        time.sleep(0.1)
    assert not _alive(trainer), "the trainer outlived its launcher"
    thread.join(60)
    assert "torchrun was ended by SIGKILL" in str(box["err"])
    time.sleep(1)  # the launcher's reader logs the trainer's last lines as the pipe drains
    text = log.read_text()
    assert "(torchrun) ended" in text and "exiting program after receiving SIGTERM" in text  # Megatron-LM saved first
    saved = checkpointing.latest_iteration(cfg.checkpoint_path)
    assert saved is not None and 3 <= saved < cfg.train_iters
    run_guard.check_run_folder_free(cfg.run_path)  # free again


def test_a_damaged_shard_names_rank_exception_and_folder(data, tmp_path):
    first = tiny_config(data, tmp_path / "a", train_iters=4, save_interval=4, eval_interval=4)
    launch.train(first, progress=False, env={"OMP_NUM_THREADS": "1"})
    cfg = tiny_config(data, tmp_path / "b", train_iters=4, save_interval=4, eval_interval=4)
    shutil.copytree(first.checkpoint_path, cfg.checkpoint_path)
    folder = checkpointing.iteration_dir(cfg.checkpoint_path, 4)
    shard = max(folder.glob("*.distcp"), key=lambda p: p.stat().st_size)
    shard.write_bytes(shard.read_bytes()[: shard.stat().st_size // 2])  # a partly copied shard
    before = {p: p.stat().st_mtime_ns for p in cfg.checkpoint_path.rglob("*")}
    with pytest.raises(checkpointing.CheckpointReadError) as err:
        launch.train(cfg, progress=False, env={"OMP_NUM_THREADS": "1"})  # no summary in b: it would load iteration 4
    message = str(err.value)
    assert message.startswith(f"could not read the checkpoint {folder}: {shard.name} holds ")
    assert "its index (.metadata) expects" in message and "a partly copied or damaged shard" in message
    assert "Fix: delete iter_0000004" in message
    assert not (cfg.run_path / "training.log").exists()  # refused before torchrun started
    assert {p: p.stat().st_mtime_ns for p in cfg.checkpoint_path.rglob("*")} == before  # nothing destroyed
    (folder / shard.name).unlink()
    with pytest.raises(checkpointing.CheckpointReadError, match=f"{shard.name} is missing"):
        checkpointing.check_readable(folder)
    checkpointing.check_readable(checkpointing.iteration_dir(first.checkpoint_path, 4))  # the whole one passes
    copy = shutil.copytree(checkpointing.iteration_dir(first.checkpoint_path, 4), tmp_path / "copy" / folder.name)
    (copy / "metadata.json").unlink()  # Megatron-LM would fail after start-up: "Missing key in checkpoint state_dict: args"
    with pytest.raises(checkpointing.CheckpointReadError, match="metadata.json is missing. Fix: delete iter_0000004"):
        checkpointing.check_readable(copy)


def test_a_trainer_whose_kernel_dies_saves_its_checkpoint(data, tmp_path):
    """The launching process (a notebook kernel) is killed: the trainer's output goes to the log
    file, not to a pipe into the dead kernel, so it notices, saves and exits instead of dying of
    BrokenPipeError on its next print (a breaker found that)."""
    import subprocess
    import sys

    cfg = tiny_config(data, tmp_path, train_iters=100_000, eval_interval=100_000, save_interval=0, log_interval=1)
    script = tmp_path / "kernel.py"
    script.write_text("import sys\nfrom helpers.learn import training_config\nfrom helpers.runner import launch\n"
                      "cfg = training_config.TrainingConfig.from_json(sys.argv[1])\n"
                      "launch.train(cfg, progress=False, timeout_s=300, env={'OMP_NUM_THREADS': '1'}, max_epochs=0)\n")
    config = cfg.to_json(tmp_path / "given.json")
    root = Path(__file__).resolve().parent.parent
    kernel = subprocess.Popen([sys.executable, str(script), str(config)], cwd=root, start_new_session=True,
                              env={**os.environ, "PYTHONPATH": str(root)},
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    log, lock = cfg.run_path / "training.log", cfg.run_path / run_guard.LOCK_NAME
    try:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and not (log.exists() and "iteration        3/" in log.read_text()):
            assert kernel.poll() is None
            time.sleep(0.2)
        trainer = int(__import__("json").loads(lock.read_text())["pid"])
        kernel.kill()  # the kernel only: torchrun and the trainer live on, in their own sessions
        kernel.wait()
        start = time.monotonic()
        while _alive(trainer) and time.monotonic() - start < 60:
            time.sleep(0.1)
        assert not _alive(trainer), "the trainer outlived its kernel"
    finally:
        kernel.kill()
    text = log.read_text()
    assert f"its launcher process {kernel.pid} ended" in text
    assert "exiting program after receiving SIGTERM" in text and "BrokenPipeError" not in text
    assert checkpointing.latest_iteration(cfg.checkpoint_path) >= 3
