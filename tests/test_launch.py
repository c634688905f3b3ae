import socket
import sys
import time

import pytest

from helpers import launch


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
            launch.torchrun(["helpers.environment", "allreduce"], nproc_per_node=2, master_port=port, timeout_s=30)


def test_torchrun_command_shape():
    cmd = launch.torchrun_command(["helpers.training", "--config", "c.json"], nproc_per_node=2, nnodes=2,
                                  node_rank=1, master_addr="10.0.0.1", master_port=29500)
    assert cmd[:3] == [sys.executable, "-m", "torch.distributed.run"]
    assert "--nproc_per_node=2" in cmd and "--nnodes=2" in cmd and "--node_rank=1" in cmd
    assert "--master_addr=10.0.0.1" in cmd and "--master_port=29500" in cmd
    assert cmd[-4:] == ["-m", "helpers.training", "--config", "c.json"]


def test_two_rank_allreduce_over_gloo():
    lines = []
    result = launch.torchrun(["helpers.environment", "allreduce"], nproc_per_node=2, timeout_s=120, on_line=lines.append)
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
