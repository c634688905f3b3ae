"""helpers.support.quiet: it hides exactly the known routine messages, each of which megatron-core or
torch really prints here (so an entry megatron-core no longer needs fails its test), and
nothing else."""

from __future__ import annotations

import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from helpers.support import quiet

ROOT = Path(__file__).resolve().parent.parent

# Import megatron-core, build a GPTModel and save it: everything that sets off a KNOWN message.
SCRIPT = textwrap.dedent("""
    import sys, tempfile, warnings
    sys.path.insert(0, {root!r})
    if not {use_helpers}:
        warnings.simplefilter("default")
    import helpers
    import megatron.core
    from megatron.core import dist_checkpointing
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from helpers.learn import distributed, model
    from helpers.support import quiet
    import logging
    from megatron.core.utils import log_single_rank
    log_single_rank(logging.getLogger("probe"), logging.INFO, "before torch.distributed")  # rank unknown
    distributed.initialize_distributed(1, 1, seed=1)
    cfg = model.ModelConfig(num_layers=1, hidden_size=32, num_attention_heads=2, seq_length=16,
                            max_position_embeddings=16, vocab_size=100)
    gpt = model.build_model(cfg)
    folder = tempfile.mkdtemp()
    dist_checkpointing.save(gpt.sharded_state_dict(), folder)
    dist_checkpointing.load(gpt.sharded_state_dict(), folder)
    import torch
    tokens = torch.randint(0, 100, (2, 16))
    gpt(tokens, torch.arange(16).expand(2, 16), None)
    import megatron.training.theoretical_memory_usage  # notebook 05's Megatron-LM estimate imports megatron.training
    import megatron.core.models.mimo.model.base  # what get_megatron_optimizer imports at each call
    from megatron.core.rerun_state_machine import get_rerun_state_machine
    get_rerun_state_machine()  # as the schedules do in a loop without Megatron-LM's initialize_megatron
    from megatron.core.timers import Timers
    timers = Timers(2, "minmax")  # notebook 04's section 11: Megatron's timers, printed
    timers("forward-backward", log_level=1).start(); timers("forward-backward").stop()
    timers.get_all_timers_string()
    from torch.profiler import ProfilerActivity, profile
    with profile(activities=[ProfilerActivity.CPU]):  # notebook 04's section 11 profiles a training step
        torch.mm(torch.ones(4, 4), torch.ones(4, 4))
    warnings.warn("a message nobody listed")
    print("VERSION", megatron.core.__version__)
    print("SUPPRESSED", sorted(quiet.suppressed().items()))
""")


def _run(use_helpers: bool) -> subprocess.CompletedProcess:
    code = SCRIPT.format(root=str(ROOT), use_helpers=use_helpers)
    env = {"PATH": "/usr/bin:/bin", "HOME": str(ROOT), **({} if use_helpers else {"HELPERS_QUIET": "0"})}
    return subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300, env=env)


@pytest.fixture(scope="module")
def raw():
    out = _run(use_helpers=False)
    assert out.returncode == 0, out.stderr[-2000:]
    return out


@pytest.fixture(scope="module")
def hidden():
    out = _run(use_helpers=True)
    assert out.returncode == 0, out.stderr[-2000:]
    return out


def _expected_here(m: quiet.KnownMessage) -> bool:
    # torch prints "No CUDA runtime is found" only where it is a CUDA build without a GPU.
    return m.name != "no_cuda_runtime" or (torch.version.cuda is not None and not torch.cuda.is_available())


@pytest.mark.parametrize("message", quiet.KNOWN, ids=lambda m: m.name)
def test_each_known_message_is_really_printed_without_quiet(raw, message):
    if not _expected_here(message):
        pytest.skip("torch is a CPU build, or a GPU is present: torch prints no 'No CUDA runtime' line")
    assert re.search(message.pattern, raw.stdout + raw.stderr), f"{message.name} no longer printed: drop it from KNOWN"


def test_importing_helpers_hides_them_and_only_them(hidden):
    text = hidden.stdout + hidden.stderr
    for m in quiet.KNOWN:
        assert not re.search(m.pattern, text), f"{m.name} was printed"
    assert "a message nobody listed" in text, "an unknown warning must still reach the learner"
    assert "VERSION 0.19.2\n" in hidden.stdout, "NO_VCS_VERSION keeps the repository's git hash out of __version__"
    counted = dict(eval(re.search(r"SUPPRESSED (.*)", hidden.stdout).group(1)))
    assert counted["gptmodel_deprecated"] == 1 and counted["mcore_async_save_deprecated"] == 1


def test_table_lists_every_message_with_its_source():
    table = quiet.table().splitlines()
    assert len(table) == 2 + len(quiet.KNOWN)
    assert all(row.count("|") == 4 and ("megatron-core" in row or "torch" in row) for row in table[2:])


def test_torch_profiler_logs_no_kineto_lines_under_helpers(raw, hidden):
    """KINETO_LOG_LEVEL=6 (quiet.apply): torch 2.14 logs "USDT: ... profiler_start" at level 5, once per profile."""
    assert "profiler_start" in raw.stderr  # what a learner would see without helpers
    assert "profiler_start" not in hidden.stderr + hidden.stdout and "gpuGetDeviceCount" not in hidden.stderr
