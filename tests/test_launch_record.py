"""What a launch's command and log say about it (issue 38): the flags a layout adds, and where its wall time went."""

from __future__ import annotations

from dataclasses import replace

import pytest

from helpers.learn import training_config
from helpers.runner import megatron_args, metrics


def test_the_flag_difference_names_what_a_layout_adds_and_nothing_else(tmp_path):
    """Notebooks 05 and 05b print it: another run folder is no difference, a layout is, and a dropped flag is named."""
    cfg = training_config.profile("cpu", str(tmp_path / "one"))
    one = megatron_args.command(cfg, cpu=True)
    elsewhere = megatron_args.command(replace(cfg, run_dir=str(tmp_path / "two")), cpu=True)
    assert elsewhere != one and megatron_args.flag_difference(one, elsewhere) == []
    other = replace(cfg, run_dir=str(tmp_path / "two"), tensor_model_parallel_size=2, use_distributed_optimizer=True)
    added = megatron_args.flag_difference(one, megatron_args.command(other, nproc_per_node=2, cpu=True))
    assert added == ["--nproc-per-node 2", "--tensor-model-parallel-size 2", "--use-distributed-optimizer"]
    assert megatron_args.flag_difference(["--lr", "-1", "--a"], ["--lr", "-2"]) == ["--lr -2", "without --a"]
    plan = ["-m", "torch.distributed.run", "--nproc_per_node={n}", "--master_port={port}", "helpers.learn.pretrain_gpt", "--a", "1"]
    one, two = ([w.format(n=n, port=port) for w in plan] for n, port in ((1, 29500), (2, 41234)))
    assert megatron_args.flag_difference(one, two) == ["--nproc_per_node 2"]  # the port is rendezvous, not layout


LOG = """[launched] datetime: 2026-12-07 11:00:00.000000
using world size: 1
INFO:megatron.core.timers:(min, max) time across ranks (ms):
    startup-library-setup ..........................: (7000.00, 7200.00)
    startup-program-setup ..........................: (1500.00, 1500.00)
    startup-megatron-init-local ....................: (120.00, 130.00)
[before library-setup] datetime: 2026-12-07 11:00:04.000000
    model-and-optimizer-setup ......................: (40.00, 50.00)
    train/valid/test-data-iterators-setup ..........: (10.00, 20.00)
[before the start of training step] datetime: 2026-12-07 11:00:13.000000
 [2026-12-07 11:00:14.000000] iteration        1/       6 | elapsed time per iteration (ms): 793.5 |
[after training is done] datetime: 2026-12-07 11:00:15.500000
"""


def test_the_startup_table_splits_a_launch_by_megatron_lms_own_timers():
    rows = {r["phase"]: r["seconds"] for r in metrics.startup_table(LOG, 20.0)}
    assert list(rows.values()) == [4.0, 7.2, 1.5, 0.13, 0.05, 0.02, 2.5, pytest.approx(20 - 15.4)]
    assert list(rows)[1] == metrics.STARTUP_PHASES["startup-library-setup"]
    resumed = LOG.replace("7200.00", "1.00") + LOG  # two launches in one log: the last one counts
    assert metrics.startup_table(resumed, 20.0)[1]["seconds"] == 7.2
    assert metrics.startup_table("no timers here", 5.0) == []
