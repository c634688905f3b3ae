"""Notebook 00: the container command, the environment report, the distributed smoke test.

The reference guide runs everything inside NVIDIA's NGC PyTorch container, which brings a
matched CUDA / cuDNN / NCCL / PyTorch plus NVIDIA Apex and Transformer Engine. This module
writes the ``docker run`` command for this repository, reports what this machine has (and
what the series uses in place of anything missing), and holds the torchrun entry point of a
2-process all-reduce that proves the distributed launch path works::

    python -m torch.distributed.run --nproc_per_node 2 -m helpers.support.environment allreduce

:func:`ieee_fp32` turns TF32 off for the proofs that compare fp32 results (notebooks 05b, 06).
"""

from __future__ import annotations

import contextlib
import importlib
import importlib.metadata
import importlib.util
import os
import platform
import shlex
import sys
from dataclasses import dataclass
from pathlib import Path

#: NGC PyTorch container image used in the README, the Dockerfile and notebook 00.
NGC_IMAGE = "nvcr.io/nvidia/pytorch"
NGC_TAG = "26.09-py3"


#: The environment of a child process whose fp32 matmuls must be IEEE fp32 on a GPU (layout proofs): cuBLAS
#: and cuDNN without TF32 (NVIDIA_TF32_OVERRIDE=0), and torch's own override, which the NGC container sets to 1, off.
IEEE_FP32_ENV = {"NVIDIA_TF32_OVERRIDE": "0", "TORCH_ALLOW_TF32_CUBLAS_OVERRIDE": "0"}


@contextlib.contextmanager
def ieee_fp32(device="cpu"):
    """Inside the block, fp32 matmuls and convolutions run in IEEE fp32 (TF32 off), restored after.

    On Ampere and later GPUs TF32 rounds fp32 matmul inputs to 10 mantissa bits (relative error
    about 5e-4), too coarse for proofs at 1e-4. Uses torch's ``fp32_precision`` settings
    (``torch.backends.cuda.matmul``, ``torch.backends.cudnn``); on a CPU nothing changes.

    Yields:
        str: what ran, e.g. ``"IEEE fp32 on cuda:0 (TF32 off)"`` or ``"IEEE fp32 on cpu"``.

    Raises:
        RuntimeError: on CUDA with ``TORCH_ALLOW_TF32_CUBLAS_OVERRIDE=1`` (set in the NGC container),
            which keeps TF32 on whatever torch's settings say: restart with :data:`IEEE_FP32_ENV`.
    """
    import torch

    device = torch.device(device)
    if device.type != "cuda":
        yield f"IEEE fp32 on {device}"
        return
    if os.environ.get("TORCH_ALLOW_TF32_CUBLAS_OVERRIDE", "0") not in ("", "0"):
        raise RuntimeError("TORCH_ALLOW_TF32_CUBLAS_OVERRIDE=1 keeps TF32 on in this process, so an fp32 proof on the "
                           "GPU would compare TF32 results. Restart the kernel (or the script) with "
                           "TORCH_ALLOW_TF32_CUBLAS_OVERRIDE=0 NVIDIA_TF32_OVERRIDE=0, or run the proof on the CPU.")
    backends = (torch.backends.cuda.matmul, torch.backends.cudnn)
    saved = [b.fp32_precision for b in backends]
    try:
        for b in backends:
            b.fp32_precision = "ieee"
        yield f"IEEE fp32 on {device} (TF32 off)"
    finally:
        for b, value in zip(backends, saved):
            b.fp32_precision = value


def docker_run_command(
    repo_dir: str | os.PathLike,
    *,
    image: str = f"{NGC_IMAGE}:{NGC_TAG}",
    gpus: str = "all",
    shm_size: str = "16g",
    jupyter_port: int = 8888,
    workdir: str = "/workspace/megatron-gpt-notebooks",
) -> str:
    """The ``docker run`` command that starts the NGC container with this repository mounted.

    NVIDIA's flags for PyTorch containers: ``--gpus``, ``--shm-size`` (Docker's 64 MB default
    crashes multi-process training), the ``memlock`` / ``stack`` ulimits, and JupyterLab's port.

    Args:
        repo_dir: this repository on the host (mounted read-write at ``workdir``).
        image: the container image, ``nvcr.io/nvidia/pytorch:<YY.MM>-py3``.
        gpus: ``"all"``, a count such as ``"2"``, or ``'"device=0,1"'``.
        shm_size: shared-memory size for ``/dev/shm``.
        jupyter_port: host and container port of JupyterLab.

    Raises:
        ValueError: ``jupyter_port`` outside 1-65535 or an empty ``image``.
    """
    if not 0 < int(jupyter_port) < 65536:
        raise ValueError(f"jupyter_port={jupyter_port} is not a TCP port: use 1-65535, e.g. 8888")
    if not image:
        raise ValueError("image is empty: use e.g. nvcr.io/nvidia/pytorch:26.09-py3")
    repo = Path(repo_dir).resolve()
    parts = [
        "docker run --rm -it",
        f"--gpus {shlex.quote(gpus)}",  # '"device=0,1"' must reach docker with its double quotes
        f"--shm-size={shm_size}",
        "--ulimit memlock=-1 --ulimit stack=67108864",
        f"-p {jupyter_port}:{jupyter_port}",
        *[f"-e {k}={v}" for k, v in IEEE_FP32_ENV.items()],  # the fp32 proofs of 05b and 06 without TF32
        f"-v {shlex.quote(str(repo))}:{workdir}",
        f"-w {workdir}",
        image,
        "bash -c " + shlex.quote(
            f"make install-ngc && .venv/bin/python -m jupyter lab --ip=0.0.0.0 --port={jupyter_port} --allow-root --no-browser notebooks/"
        ),
    ]
    return " \\\n    ".join(parts)


@dataclass
class Component:
    """One row of the environment report."""

    name: str
    found: bool
    version: str
    used_instead: str

    def as_row(self) -> dict[str, str]:
        return {
            "component": self.name,
            "status": "found" if self.found else "missing",
            "version / details": self.version,
            "the series uses": self.used_instead,
        }


def package_version(dist: str) -> str | None:
    """The installed version of distribution ``dist`` (e.g. ``"megatron-core"`` -> ``"0.19.2"``),
    read from its package metadata; None when it is not installed.

    Not ``module.__version__``: megatron-core's ``package_info.py`` appends ``+<hash>`` of
    whatever git checkout encloses site-packages unless ``NO_VCS_VERSION=1`` is set.
    """
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None


def gigatoken_available() -> bool:
    """Whether ``gigatoken`` (Rust BPE) and ``awkward`` (its array library) are importable: then
    ``helpers.learn.encoders`` tokenizes with it (``engine="auto"``)."""
    return all(importlib.util.find_spec(m) is not None for m in ("gigatoken", "awkward"))


def nvidia_apex() -> dict[str, bool]:
    """Which parts of NVIDIA Apex import: ``{"apex": ..., "FusedAdam": ..., "FusedLayerNorm": ...}``.

    The PyPI package named ``apex`` is an unrelated project; it has no ``apex.optimizers``,
    so it is reported as missing here. NVIDIA Apex is built from source or comes with the
    NGC container.
    """
    found = {"apex": False, "FusedAdam": False, "FusedLayerNorm": False}
    if importlib.util.find_spec("apex") is None:
        return found
    try:
        from apex.optimizers import FusedAdam  # noqa: F401

        found["FusedAdam"] = True
    except Exception:
        pass
    try:
        from apex.normalization import FusedLayerNorm  # noqa: F401

        found["FusedLayerNorm"] = True
    except Exception:
        pass
    found["apex"] = found["FusedAdam"] or found["FusedLayerNorm"]
    return found


def apex_gradient_fusion() -> bool:
    """Whether Apex's ``fused_weight_gradient_mlp_cuda`` extension imports.

    megatron-core's ``ColumnParallelLinear`` (the output layer, even with Transformer Engine) raises a
    ``RuntimeError`` without it unless ``--no-gradient-accumulation-fusion`` is given
    (``megatron/core/tensor_parallel/layers.py``, lines 49-53 and 1070).
    """
    return importlib.util.find_spec("fused_weight_gradient_mlp_cuda") is not None


def transformer_engine_version() -> str | None:
    """Transformer Engine's version when ``import transformer_engine`` works, else ``None``."""
    if importlib.util.find_spec("transformer_engine") is None:
        return None
    try:
        import transformer_engine  # noqa: F401
    except Exception:
        return None
    return package_version("transformer_engine") or package_version("transformer-engine") or "unknown"


def report() -> list[Component]:
    """What this machine has, one :class:`Component` per line of the report.

    Covers Python, torch, CUDA and the GPUs, NCCL and gloo, megatron-core, transformers,
    gigatoken (the fast tokenizing engine of notebook 01), NVIDIA Apex (FusedAdam, fused
    LayerNorm) and Transformer Engine; for each missing piece, the fallback the series uses.
    """
    import torch
    import torch.distributed as dist

    rows = [Component("Python", True, platform.python_version(), sys.executable)]
    rows.append(Component("torch", True, torch.__version__, "-"))
    cuda = torch.cuda.is_available()
    if cuda:
        names = ", ".join(torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count()))
        rows.append(Component("CUDA", True, f"CUDA {torch.version.cuda}; {torch.cuda.device_count()} GPU(s): {names}", "GPU, bf16"))
    else:
        rows.append(Component("CUDA", False, f"built for CUDA {torch.version.cuda}" if torch.version.cuda else "CPU build of torch",
                              "the CPU, fp32, with helpers.support.cpu_compat's shims for megatron-core"))
    nccl = dist.is_available() and dist.is_nccl_available() and cuda
    rows.append(Component("NCCL", nccl, ".".join(map(str, torch.cuda.nccl.version())) if nccl else "-",
                          "NCCL" if nccl else "gloo (CPU collectives)"))
    rows.append(Component("gloo", dist.is_available() and dist.is_gloo_available(), "torch.distributed backend", "-"))
    mcore = package_version("megatron-core")
    rows.append(Component("megatron-core", mcore is not None, mcore or "-", "-" if mcore else "install requirements.txt"))
    tf = package_version("transformers")
    rows.append(Component("transformers", tf is not None, tf or "-", "-" if tf else "install requirements.txt"))
    giga = package_version("gigatoken") if gigatoken_available() else None
    rows.append(Component("gigatoken", giga is not None, giga or "-",
                          "gigatoken (Rust BPE) for .bin/.idx" if giga else "HF tokenizers (slower, byte-identical files)"))
    apex = nvidia_apex()
    rows.append(Component("Apex FusedAdam", apex["FusedAdam"], "apex.optimizers.FusedAdam" if apex["FusedAdam"] else "-",
                          "Apex FusedAdam" if apex["FusedAdam"] else ("torch AdamW(fused=True)")))
    rows.append(Component("Apex fused LayerNorm", apex["FusedLayerNorm"], "apex.normalization" if apex["FusedLayerNorm"] else "-",
                          "Apex" if apex["FusedLayerNorm"] else "torch.nn.LayerNorm (megatron-core's WrappedTorchNorm)"))
    fusion = apex_gradient_fusion()
    rows.append(Component("Apex gradient fusion", fusion, "fused_weight_gradient_mlp_cuda" if fusion else "-",
                          "fused wgrad accumulation" if fusion else "--no-gradient-accumulation-fusion"))
    te = transformer_engine_version()
    rows.append(Component("Transformer Engine", te is not None, te or "-",
                          "TE layer spec" if te else "megatron-core's local layer spec (torch modules)"))
    return rows


def report_table(rows: list[Component] | None = None) -> str:
    """The report as a Markdown table (one line per component)."""
    from helpers.support.results import markdown_table

    return markdown_table([r.as_row() for r in (report() if rows is None else rows)])


def allreduce_backend(world_size: int) -> tuple[str, str]:
    """``("nccl" or "gloo", why)`` for an all-reduce of ``world_size`` ranks, one per GPU where there are enough.

    NCCL needs one GPU per rank (rank R uses ``cuda:R``); with fewer GPUs than ranks the ranks use gloo on the CPU.
    """
    import torch

    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if gpus >= world_size:
        return "nccl", f"{world_size} rank(s) on {gpus} GPU(s), one GPU each"
    if gpus == 0:
        return "gloo", "no CUDA GPU here: the ranks reduce on the CPU"
    return "gloo", f"{world_size} ranks but {gpus} GPU(s): NCCL needs one GPU per rank, so the ranks reduce on the CPU"


def allreduce_main() -> None:
    """torchrun entry point: every rank contributes ``rank + 1``; all must see the same sum.

    Uses NCCL with one GPU per rank, else gloo (:func:`allreduce_backend`). Prints rank 0's reason, then one line per rank:
    ``rank R/W backend B: all_reduce(sum) = S (expected E)``, and exits non-zero on a mismatch.
    """
    import torch
    import torch.distributed as dist

    backend, why = allreduce_backend(int(os.environ.get("WORLD_SIZE", 1)))
    dist.init_process_group(backend=backend)
    rank, world = dist.get_rank(), dist.get_world_size()
    if rank == 0:
        sys.stdout.write(f"backend {backend}: {why}\n")
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0))) if backend == "nccl" else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    value = torch.tensor([float(rank + 1)], device=device)
    dist.all_reduce(value, op=dist.ReduceOp.SUM)
    expected = world * (world + 1) / 2
    sys.stdout.write(f"rank {rank}/{world} backend {backend}: all_reduce(sum) = {value.item():g} (expected {expected:g})\n")
    sys.stdout.flush()
    dist.destroy_process_group()
    if value.item() != expected:
        sys.exit(1)


if __name__ == "__main__":
    if sys.argv[1:] == ["allreduce"]:
        allreduce_main()
    else:
        print("usage: torchrun --nproc_per_node N -m helpers.support.environment allreduce", file=sys.stderr)
        sys.exit(2)
