"""Shared fixtures. The end-to-end run of the whole series happens once per session."""

from __future__ import annotations

import os
import shutil

import pytest
import torch

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


def _gpu_session(config) -> bool:
    """``pytest -m gpu`` (``make test-gpu``): the GPU tests alone, with the GPUs visible."""
    return (config.option.markexpr or "").strip() == "gpu"


def pytest_configure(config):
    """The suite is written for a CPU: every other session hides the GPUs from this process and its children.

    Set before torch first asks for CUDA, so a GPU machine runs the same CPU tests (fp32, gloo, the shims on).
    """
    if not _gpu_session(config):
        os.environ["CUDA_VISIBLE_DEVICES"] = ""
        config.hid_gpus = os.path.exists("/dev/nvidiactl")  # an NVIDIA driver: there were GPUs to hide


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    why = ("needs a CUDA GPU: this session hides them (make test-gpu runs it)" if getattr(config, "hid_gpus", False)
           else "needs a CUDA GPU; this machine has none (CI never has one)")
    skip = pytest.mark.skip(reason=why)
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def series_run(tmp_path_factory):
    """Execute every notebook in order with the `smoke` profile into one run folder."""
    from helpers.support import results
    from helpers.runner import series

    run_dir = tmp_path_factory.mktemp("series-smoke")
    runs = series.run("smoke", run_dir=run_dir)
    yield run_dir, runs, results.load_summary(run_dir)
    if os.environ.get("KEEP_SMOKE_RUN"):
        print(f"smoke run kept in {run_dir}")
    else:
        shutil.rmtree(run_dir, ignore_errors=True)
