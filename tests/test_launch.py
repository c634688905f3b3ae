import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from helpers.runner import launch
from helpers.support import run_guard

ROOT = Path(__file__).resolve().parent.parent


def test_free_port_is_bindable():
    port = launch.free_port()
    assert launch.port_is_free(port)


def test_port_in_use_is_a_clear_error():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        assert not launch.port_is_free(port)
        with pytest.raises(launch.LaunchError, match=f"master_port={port} is already in use"):
            launch.torchrun(["helpers.support.environment", "allreduce"], nproc_per_node=2, master_port=port, timeout_s=30)


def test_torchrun_command_shape():
    cmd = launch.torchrun_command(["helpers.training", "--config", "c.json"], nproc_per_node=2, nnodes=2,
                                  node_rank=1, master_addr="10.0.0.1", master_port=29500)
    assert cmd[:3] == [sys.executable, "-m", "torch.distributed.run"]
    assert "--nproc_per_node=2" in cmd and "--nnodes=2" in cmd and "--node_rank=1" in cmd
    assert "--master_addr=10.0.0.1" in cmd and "--master_port=29500" in cmd
    assert cmd[-4:] == ["-m", "helpers.training", "--config", "c.json"]


def test_two_rank_allreduce_over_gloo():
    lines = []
    result = launch.torchrun(["helpers.support.environment", "allreduce"], nproc_per_node=2, timeout_s=120, on_line=lines.append)
    sums = sorted(l for l in result.lines if "all_reduce(sum)" in l)
    assert sums == [
        "rank 0/2 backend gloo: all_reduce(sum) = 3 (expected 3)",
        "rank 1/2 backend gloo: all_reduce(sum) = 3 (expected 3)",
    ]
    assert lines == result.lines


def test_failing_rank_is_named(tmp_path):
    script = tmp_path / "fail_rank1.py"
    script.write_text(
        "import os, sys\n"
        "rank = int(os.environ['RANK'])\n"
        "if rank == 1:\n"
        "    raise SystemExit('rank 1 gives up')\n"
    )
    with pytest.raises(launch.LaunchError) as err:
        launch.torchrun([str(script)], nproc_per_node=2, timeout_s=60, module=False, on_line=None)
    assert err.value.failed_rank == 1
    assert "rank 1 exited with an error" in str(err.value)


def test_failing_rank_error_line_is_in_the_message(tmp_path):
    """torchrun prints its own ChildFailedError traceback last; the message names the rank's exception."""
    script = tmp_path / "fail_value.py"
    script.write_text(
        "import os\n"
        "if int(os.environ['RANK']) == 1:\n"
        "    raise ValueError('num_layers=2 is not divisible by 3')\n"
    )
    with pytest.raises(launch.LaunchError) as err:
        launch.torchrun([str(script)], nproc_per_node=2, timeout_s=60, module=False, on_line=None)
    first_line = str(err.value).splitlines()[0]
    assert "rank 1 exited with an error" in first_line
    assert "ValueError: num_layers=2 is not divisible by 3" in first_line
    assert launch._rank_error(["[rank0]: KeyError: 'x'", "[rank1]:     raise ValueError(",
                               "[rank1]: ValueError: bad", "torch.distributed.elastic.multiprocessing.errors.ChildFailedError:"],
                              1) == "ValueError: bad"


def test_timeout_kills_the_job(tmp_path):
    script = tmp_path / "sleep.py"
    script.write_text("import time\nprint('started', flush=True)\ntime.sleep(600)\n")
    start = time.perf_counter()
    with pytest.raises(launch.LaunchError, match="did not finish within timeout_s=4"):
        launch.torchrun([str(script)], nproc_per_node=1, timeout_s=4, module=False, on_line=None)
    assert time.perf_counter() - start < 30


# --------------------------------------------------------------------------- issue 13: orphans, locks, causes
WORKER = """import os, sys, time
from helpers.support import run_guard
run_guard.watch_launcher(interval_s=0.2, grace_s=5)
open(sys.argv[1], "w").write(f"{os.getpid()} {os.getppid()}")
while True:
    print("tick", flush=True)
    time.sleep(0.05)
"""


def _alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def _wait_gone(pid: int, timeout_s: float) -> float:
    start = time.monotonic()
    while _alive(pid) and time.monotonic() - start < timeout_s:
        time.sleep(0.05)
    return time.monotonic() - start


def test_a_worker_stops_when_torchrun_is_killed(tmp_path, monkeypatch):
    """kill -9 of torchrun's process group does not reach the worker (its own session); the
    worker's watch_launcher ends it, and the launcher's reader thread raises nothing."""
    script, pid_file, log = tmp_path / "worker.py", tmp_path / "pid", tmp_path / "log.txt"
    script.write_text(WORKER)
    thread_errors, box = [], {}
    monkeypatch.setattr(threading, "excepthook", thread_errors.append)

    def launch_it():
        try:
            launch.torchrun([str(script), str(pid_file)], module=False, on_line=None, timeout_s=60, log_path=log)
        except launch.LaunchError as err:
            box["err"] = err

    thread = threading.Thread(target=launch_it)
    thread.start()
    deadline = time.monotonic() + 60
    while not (pid_file.exists() and pid_file.read_text()) and time.monotonic() < deadline:
        time.sleep(0.05)
    worker, agent = map(int, pid_file.read_text().split())
    assert os.getsid(worker) != os.getpgid(agent)  # torch elastic's own session: killpg misses it
    os.killpg(os.getpgid(agent), signal.SIGKILL)
    assert _wait_gone(worker, 10) < 5, "the worker outlived torchrun"
    thread.join(30)
    assert "torchrun was ended by SIGKILL (exit code -9)" in str(box["err"])
    assert thread_errors == []
    assert "its parent process" in log.read_text() and "(torchrun) ended" in log.read_text()


def test_a_worker_stops_when_its_launcher_process_ends(tmp_path):
    """The notebook kernel that launched the job (HELPERS_LAUNCHER_PID) dies: the job stops."""
    script, pid_file = tmp_path / "worker.py", tmp_path / "pid"
    script.write_text(WORKER)
    kernel = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
    env = {**os.environ, "PYTHONPATH": str(ROOT), run_guard.LAUNCHER_PID_ENV: str(kernel.pid)}
    worker = subprocess.Popen([sys.executable, str(script), str(pid_file)], env=env, stdout=subprocess.DEVNULL,
                              stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 30
        while not (pid_file.exists() and pid_file.read_text()) and time.monotonic() < deadline:
            time.sleep(0.05)
        time.sleep(0.5)
        assert worker.poll() is None  # runs while its launcher runs
        kernel.kill()
        kernel.wait()
        assert worker.wait(timeout=10) == -signal.SIGTERM
        assert f"its launcher process {kernel.pid} ended" in worker.stderr.read()
    finally:
        kernel.kill()
        worker.kill()


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return Path(f"/proc/{pid}/stat").read_text().split(") ")[-1][0] != "Z"


def test_a_save_leaves_no_process_behind_when_its_process_is_killed(tmp_path):
    """Issue 24: megatron-core's first dist_checkpointing.save spawns a multiprocessing Manager (and its
    resource tracker) that outlived a SIGKILLed notebook kernel; with the in-process queue a save
    starts no process at all."""
    code = ("import os, sys, time, tempfile\nfrom helpers.learn import distributed, model\n"
            "from megatron.core import dist_checkpointing\n"
            "distributed.initialize_distributed(1, 1, seed=1)\n"
            "gpt = model.build_model(model.ModelConfig(num_layers=1, hidden_size=32, num_attention_heads=2, seq_length=16,"
            " max_position_embeddings=16, vocab_size=100))\n"
            "t = time.perf_counter(); dist_checkpointing.save(gpt.sharded_state_dict(), sys.argv[1])\n"
            "print(time.perf_counter() - t, flush=True); time.sleep(120)\n")
    saver = subprocess.Popen([sys.executable, "-c", code, str(tmp_path)], env={**os.environ, "PYTHONPATH": str(ROOT)},
                             stdout=subprocess.PIPE, text=True)
    try:
        seconds = float(saver.stdout.readline())
        assert seconds < 3.0  # the spawned Manager alone took 5-8 s on 2 cores: it re-imports the program
        assert (tmp_path / ".metadata").is_file()
        children = Path(f"/proc/{saver.pid}/task/{saver.pid}/children").read_text().split()
        assert children == [], f"the save started processes {children}"
    finally:
        saver.kill()
        saver.wait()


def test_one_job_per_run_folder_and_the_message_names_it(tmp_path):
    holder = subprocess.Popen(
        [sys.executable, "-c", "import sys, time\nfrom helpers.support import run_guard\n"
         "with run_guard.run_folder_lock(sys.argv[1]):\n    print('locked', flush=True); time.sleep(120)\n",
         str(tmp_path)], env={**os.environ, "PYTHONPATH": str(ROOT)}, stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "locked"
        with pytest.raises(run_guard.RunFolderBusyError, match=rf"is being trained by another job \(pid {holder.pid} on "):
            run_guard.check_run_folder_free(tmp_path)
        with pytest.raises(run_guard.RunFolderBusyError, match=r"or use another run folder \(run_dir=\.\.\., --run-dir\)"):
            with run_guard.run_folder_lock(tmp_path):
                pass
    finally:
        holder.kill()
        holder.wait()
    run_guard.check_run_folder_free(tmp_path)  # the OS released the killed job's lock
    with run_guard.run_folder_lock(tmp_path) as lock:
        assert json.loads(lock.read_text())["pid"] == os.getpid()


def test_the_last_lines_name_the_rank_its_exception_and_where(tmp_path):
    """torch elastic's @record writes the failing rank's error file; the message ends with it."""
    script = tmp_path / "fail_shard.py"
    script.write_text(
        "import os, time\n"
        "from torch.distributed.elastic.multiprocessing.errors import record\n"
        "@record\n"
        "def main():\n"
        "    if os.environ['RANK'] == '1':\n"
        "        open('/nonexistent/__1_0.distcp', 'rb')\n"
        "    time.sleep(30)\n"
        "main()\n"
    )
    with pytest.raises(launch.LaunchError) as err:
        launch.torchrun([str(script)], nproc_per_node=2, timeout_s=60, module=False, on_line=None,
                        log_path=tmp_path / "training.log", log_dir=tmp_path / "torchrun_logs")
    assert err.value.failed_rank == 1
    assert err.value.headline.startswith("torchrun job failed: rank 1 exited with an error (exit code 1): "
                                         "FileNotFoundError: [Errno 2] No such file or directory: '/nonexistent/__1_0.distcp'")
    last = str(err.value).splitlines()[-5:]
    assert last[0] == "rank:       rank 1 (the first to fail)"
    assert last[1].startswith("exception:  FileNotFoundError") and "__1_0.distcp" in last[1]
    assert last[2] == f"raised at:  {script}:6 in main"
    error_file = Path(last[3].split(": ", 1)[1])
    assert error_file.is_file() and "__1_0.distcp" in json.loads(error_file.read_text())["message"]["message"]
    assert last[4] == f"the log of every rank: {tmp_path / 'training.log'}"


def test_a_trainer_started_by_hand_outlives_its_shell(tmp_path):
    """Without torchrun (no TORCHELASTIC_RUN_ID) a changed parent is no reason to stop: a
    `nohup python -m helpers.training ... &` run outlives the shell that started it."""
    script, pid_file = tmp_path / "worker.py", tmp_path / "pid"
    script.write_text(WORKER)
    env = {k: v for k, v in os.environ.items() if k not in ("TORCHELASTIC_RUN_ID", run_guard.LAUNCHER_PID_ENV)}
    env["PYTHONPATH"] = str(ROOT)
    subprocess.run(["bash", "-c", f"nohup {sys.executable} {script} {pid_file} > /dev/null 2>&1 &"], env=env, check=True)
    deadline = time.monotonic() + 30
    while not (pid_file.exists() and pid_file.read_text()) and time.monotonic() < deadline:
        time.sleep(0.05)
    worker = int(pid_file.read_text().split()[0])
    try:
        time.sleep(1.5)  # the shell is gone; the watcher checks every 0.2 s
        assert _alive(worker)
    finally:
        os.kill(worker, signal.SIGKILL)


def test_a_rank_killed_by_a_signal_and_a_signalled_torchrun_are_named(tmp_path):
    script = tmp_path / "self_kill.py"
    script.write_text("import os, signal, time\n"
                      "if os.environ['RANK'] == '1':\n    os.kill(os.getpid(), signal.SIGKILL)\n"
                      "time.sleep(30)\n")
    with pytest.raises(launch.LaunchError) as err:
        launch.torchrun([str(script)], nproc_per_node=2, timeout_s=60, module=False, on_line=None)
    assert err.value.failed_rank == 1
    assert "killed by SIGKILL (signal 9); the kernel's out-of-memory killer sends SIGKILL" in err.value.headline
    lines = ["torch.distributed.elastic.multiprocessing.api.SignalException: Process 8756 got signal: 15"]
    agent = launch._failure(1, lines, lines, [], None)
    assert agent.headline.startswith("torchrun received SIGTERM and stopped its workers (exit code 1)")


def test_the_suite_hides_the_gpus_from_its_child_processes():
    """Outside `pytest -m gpu` the tests run on the CPU on any machine, children included (tests/conftest.py)."""
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-c", "import os, torch; print(repr(os.environ['CUDA_VISIBLE_DEVICES']), "
                          "torch.cuda.is_available())"], capture_output=True, text=True, timeout=120, check=True)
    assert out.stdout.split() == ["''", "False"]
