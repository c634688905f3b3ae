"""Launching a layout on many machines: per-node torchrun commands, Megatron-LM arguments, sbatch.

Notebook 05, section 6 ("Past one machine: the multi-node launch": :func:`launch_plan`,
:meth:`LaunchPlan.commands`, :func:`sbatch_script`; the flags come from
:mod:`helpers.runner.megatron_args`) and section 4
("Training for real": every run of :func:`helpers.demos.layout_runs.run_layout` is the node-0
command of a one-node :class:`LaunchPlan`); section 7 shows :func:`launch_plan` refusing a
node count that does not match the layout.

Sources: PyTorch "torchrun (Elastic Launch)" (static and c10d rendezvous); SLURM ``sbatch`` and
``srun``; Megatron-LM ``examples/gpt3/train_gpt3_175b_distributed.sh``; Narayanan et al. 2021
(arXiv:2104.04473) section 3.3 (TP inside a node).
"""

from __future__ import annotations

import posixpath
import shlex
import sys
import warnings
from dataclasses import dataclass
from typing import Sequence

from helpers.learn.model import Layout


@dataclass(frozen=True)
class LaunchPlan:
    """A torchrun launch of ``target`` for a layout on ``nnodes`` machines.

    Attributes:
        layout: the parallel layout (its world size = nnodes x nproc_per_node).
        nnodes, nproc_per_node: machines and processes (GPUs) per machine.
        master_addr, master_port: the rendezvous (node 0's address and a free port on it).
        target: the module and its arguments, e.g. ``["helpers.learn.pretrain_gpt", "--num-layers", "12", ...]``.
    """

    layout: Layout
    nnodes: int
    nproc_per_node: int
    master_addr: str
    master_port: int
    target: tuple[str, ...]

    def node_command(self, node_rank: int, torchrun: Sequence[str] = ("torchrun",)) -> list[str]:
        """The command to start on machine ``node_rank`` (static rendezvous, as
        ``helpers.runner.launch.torchrun_command`` writes it). ``torchrun`` is the launcher's argv
        prefix: ``("torchrun",)`` on a cluster, ``(sys.executable, "-m", "torch.distributed.run")``
        here.

        Raises:
            ValueError: ``node_rank`` outside [0, nnodes).
        """
        from helpers.runner import launch

        if not 0 <= node_rank < self.nnodes:
            raise ValueError(f"node_rank={node_rank} must be in [0, {self.nnodes})")
        cmd = launch.torchrun_command(list(self.target), nproc_per_node=self.nproc_per_node, nnodes=self.nnodes,
                                      node_rank=node_rank, master_addr=self.master_addr, master_port=self.master_port)
        return list(torchrun) + cmd[3:]

    def commands(self) -> list[str]:
        """One shell line per node (``torchrun ...``)."""
        return [shlex.join(self.node_command(n)) for n in range(self.nnodes)]

    def local_command(self) -> list[str]:
        """Node 0's command with this Python's ``-m torch.distributed.run`` (what
        ``helpers.runner.launch.torchrun`` executes on one machine)."""
        return self.node_command(0, (sys.executable, "-m", "torch.distributed.run"))


def launch_plan(layout: Layout, target: Sequence[str], *, nnodes: int = 1, nproc_per_node: int | None = None,
                master_addr: str = "127.0.0.1", master_port: int | None = None,
                warn_tp_across_nodes: bool = True) -> LaunchPlan:
    """Plan the torchrun launch of ``target`` for ``layout`` on ``nnodes`` machines.

    Args:
        layout: TP, PP, DP sizes; world size = nnodes x nproc_per_node.
        nnodes: machines; ``nproc_per_node`` GPUs each (default world size / nnodes).
        master_addr, master_port: node 0's address and port (a free local port by default).

    Raises:
        ValueError: ``nnodes`` below 1, or the world size is not nnodes x nproc_per_node.

    Warns:
        UserWarning: a TP group spans machines (Megatron keeps TP's all-reduces inside a node's NVLink
            domain; Narayanan et al. 2021, section 3.3).
    """
    from helpers.runner import launch

    if nnodes < 1:
        raise ValueError(f"nnodes={nnodes} must be >= 1")
    if nproc_per_node is None:
        if layout.world_size % nnodes:
            raise ValueError(f"world size {layout.world_size} ({layout.label}) is not divisible by nnodes={nnodes}")
        nproc_per_node = layout.world_size // nnodes
    if nnodes * nproc_per_node != layout.world_size:
        raise ValueError(
            f"nnodes x nproc_per_node = {nnodes} x {nproc_per_node} = {nnodes * nproc_per_node} processes, but "
            f"{layout.label} needs TP x PP x DP = {layout.world_size}: change nnodes, nproc_per_node or the DP size"
        )
    if warn_tp_across_nodes and layout.tensor_model_parallel_size > nproc_per_node:
        warnings.warn(f"tensor_model_parallel_size={layout.tensor_model_parallel_size} > {nproc_per_node} GPUs per "
                      "node: each TP group spans machines and its all-reduces cross the network", stacklevel=2)
    port = master_port if master_port is not None else launch.free_port()
    return LaunchPlan(layout, nnodes, nproc_per_node, master_addr, int(port), tuple(target))


#: The Python of the project's image: the Dockerfile's ``VENV`` (a venv over the NGC container's torch).
IMAGE_PYTHON = "/opt/venv/bin/python"
#: NVIDIA's bare PyTorch images: torch, Apex and Transformer Engine, but no megatron-core or transformers.
NGC_PYTORCH = "nvcr.io/nvidia/pytorch:"
#: The Megatron-LM tag of the installed megatron-core (0.19.x), whose ``pretrain_gpt.py`` takes these flags.
MEGATRON_LM_TAG = "core_v0.19.0"
MEGATRON_LM_URL = "https://github.com/NVIDIA/Megatron-LM.git"


def sbatch_script(plan: LaunchPlan, *, job_name: str = "megatron-gpt", time_limit: str = "24:00:00",
                  partition: str | None = None, container_image: str | None = None,
                  workdir: str = "$SLURM_SUBMIT_DIR", rdzv_port: int = 29500, script: str | None = None,
                  megatron_lm_tag: str = MEGATRON_LM_TAG) -> str:
    """A SLURM batch script that starts ``plan`` with one torchrun per node.

    ``srun`` runs one task per node; the torchruns meet through the c10d rendezvous on the allocation's
    first node (``--rdzv-backend c10d --rdzv-endpoint head:port --rdzv-id $SLURM_JOB_ID``).

    Args:
        container_image: run the tasks in it (pyxis ``--container-image``). The repository's ``Dockerfile``
            image runs :data:`IMAGE_PYTHON`; a bare ``nvcr.io/nvidia/pytorch`` image first gets ``make install``
            (``.venv`` in ``workdir``, needs a network). None: the cluster's own ``torchrun``.
        workdir: the repository's folder on a file system every node mounts.
        script: None runs ``-m helpers.learn.pretrain_gpt``; a path such as ``"Megatron-LM/pretrain_gpt.py"``
            runs Megatron-LM's script, from a checkout at ``megatron_lm_tag`` (cloned if missing).

    Returns:
        The script text (submit it with ``sbatch``).

    Raises:
        ValueError: ``script`` is empty, or ``megatron_lm_tag`` is empty while ``script`` is given.

    Source: pyxis ``srun --container-image``; Megatron-LM ``examples/gpt3/train_gpt3_175b_distributed.sh``.
    """
    if script is not None and not script.strip():
        raise ValueError("script='' names no file: leave it None for -m helpers.learn.pretrain_gpt, or give "
                         "Megatron-LM's, e.g. script='Megatron-LM/pretrain_gpt.py'")
    if script is not None and not megatron_lm_tag:
        raise ValueError(f"megatron_lm_tag is empty: the checkout of {script} must be pinned, e.g. {MEGATRON_LM_TAG!r}")
    lines = [
        "#!/bin/bash",
        f"#SBATCH --job-name={job_name}",
        f"#SBATCH --nodes={plan.nnodes}",
        "#SBATCH --ntasks-per-node=1",
        f"#SBATCH --gpus-per-node={plan.nproc_per_node}",
        "#SBATCH --exclusive",
        f"#SBATCH --time={time_limit}",
    ]
    if partition:
        lines.append(f"#SBATCH --partition={partition}")
    lines += [
        f"#SBATCH --output={job_name}-%j.out",
        "",
        f"# {plan.layout.label}: world size {plan.layout.world_size} = {plan.nnodes} nodes x {plan.nproc_per_node} GPUs",
        "# Packages: the project's image (the repository's Dockerfile: NGC PyTorch + make install), pushed where",
        "# the nodes pull from: docker build -t <registry>/megatron-gpt-notebooks . && docker push <registry>/megatron-gpt-notebooks",
        "# and sbatch_script(..., container_image=\"<registry>/megatron-gpt-notebooks\"); without an image: make install here.",
        "set -euo pipefail",
        'HEAD_NODE=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)',
        "export OMP_NUM_THREADS=1",
        "export CUDA_DEVICE_MAX_CONNECTIONS=1  # Megatron-LM's examples: communication kernels in issue order (TP)",
        f"cd {workdir}",
        "",
    ]
    container = (f" --container-image={container_image} --container-mounts={workdir}:{workdir}"
                 f" --container-workdir={workdir}") if container_image else ""
    if not container_image:
        launcher = "torchrun"
    elif container_image.startswith(NGC_PYTORCH):
        lines.append(f"srun --nodes=1 --ntasks=1{container} make install  # the bare NGC image: .venv over its torch")
        launcher = ".venv/bin/python -m torch.distributed.run"
    else:
        launcher = f"{IMAGE_PYTHON} -m torch.distributed.run"
    if script is None:
        program = "-m " + shlex.join(plan.target)
    else:
        checkout = posixpath.dirname(script) or "."
        if checkout != ".":
            lines.append(f"[ -d {checkout} ] || git clone --depth 1 --branch {megatron_lm_tag} {MEGATRON_LM_URL} {checkout}")
        lines.append(f'[ "$(git -C {checkout} describe --tags --exact-match)" = {megatron_lm_tag} ] || '
                     f'{{ echo "{checkout} is not at {megatron_lm_tag}: git -C {checkout} checkout {megatron_lm_tag}" >&2; exit 1; }}')
        program = shlex.join([script, *plan.target[1:]])
    torchrun = [
        launcher, f"--nnodes={plan.nnodes}", f"--nproc_per_node={plan.nproc_per_node}",
        "--rdzv_backend=c10d", f"--rdzv_endpoint=$HEAD_NODE:{rdzv_port}", "--rdzv_id=$SLURM_JOB_ID",
        program,
    ]
    lines.append(f"srun{container} " + " \\\n    ".join(torchrun))
    return "\n".join(lines) + "\n"
