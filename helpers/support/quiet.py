"""The one place that decides which of megatron-core's and torch's routine messages a learner sees.

Without Transformer Engine, Apex or CUDA, megatron-core 0.19.2 prints about a dozen warnings on
import, a ``GPTModel`` deprecation, and an async-save deprecation at each process's first save.
:data:`KNOWN` lists them with their source and meaning; :func:`apply` hides exactly those and
counts them (notebook 00 §4 shows the table, notebook 03 the ``GPTModel`` deprecation).
``import helpers`` calls :func:`apply`, so it runs before megatron-core in every notebook and
torchrun process. Set ``HELPERS_QUIET=0`` (or ``false``) to see everything.
"""

from __future__ import annotations

import logging
import os
import re
import warnings
from collections import Counter
from dataclasses import dataclass


@dataclass(frozen=True)
class KnownMessage:
    """One routine message the series hides, and why.

    Attributes:
        name: short id (counts in :func:`suppressed`).
        pattern: regular expression matched against the start of the message.
        kind: ``"warning"`` (``warnings.warn``, with its category) or ``"log"`` (a ``logging``
            record of ``logger``).
        source: where it is emitted (megatron-core 0.19.2 or torch 2.14.1 file and line).
        meaning: what it says about this machine, and where the series explains it.
        category: the warning class (``kind="warning"``).
        logger: the logger name (``kind="log"``).
    """

    name: str
    pattern: str
    kind: str
    source: str
    meaning: str
    category: type[Warning] = UserWarning
    logger: str = ""


KNOWN: tuple[KnownMessage, ...] = (
    KnownMessage(
        "timers_all_gather", r"`torch.distributed.all_gather_into_tensor` is deprecated", "warning",
        "megatron-core timers.py:320 (dist_all_gather_func), torch distributed/c10d_logger.py:83",
        "Megatron's timers gather their times with a torch call torch now renames; the times are right "
        "(notebook 04, section 11)", category=FutureWarning),
    KnownMessage(
        "te_apex_missing", r"Transformer Engine and Apex are not installed", "warning",
        "megatron-core optimizer/__init__.py:25, optimizer/optimizer.py:29, optimizer/clip_grads.py:32, "
        "distributed/fsdp/src/megatron_fsdp/mixed_precision.py:115",
        "no NVIDIA Apex or Transformer Engine: torch's optimizers and multi-tensor helpers are used "
        "(notebook 00's environment report says which path each part takes)"),
    KnownMessage(
        "apex_norm_missing", r"Apex is not installed\. Falling back to Torch Norm", "warning",
        "megatron-core models/backends.py:34, models/gpt/gpt_layer_specs.py:74",
        "LayerNorm is torch.nn.LayerNorm (megatron-core's WrappedTorchNorm) in the local layer spec"),
    KnownMessage(
        "inference_contexts_import", r"The following imports from `dynamic_context.py` will be removed", "warning",
        "megatron-core inference/contexts/__init__.py:9",
        "an internal import megatron-core itself still uses; nothing the series calls",
        category=DeprecationWarning),
    KnownMessage(
        "tp_group_default", r"Warning: tp_group is None, using default tp group", "warning",
        "megatron-core tensor_parallel/layers.py:830 (linear_with_grad_accumulation_and_async_allreduce)",
        "megatron-core's own output layer calls it without a tp_group on every forward; the default "
        "is parallel_state's tensor-parallel group, the one the series builds",
        category=DeprecationWarning),
    KnownMessage(
        "cuda_graph_full_scope", r"full scope is deprecated", "warning",
        "megatron-core transformer/transformer_config.py:2415",
        "TransformerConfig's own default cuda_graph_modules='full' sets off this deprecation on "
        "every config; CUDA graphs are off (cuda_graph_impl='none') in the series"),
    KnownMessage(
        "mlp_ffn_hidden_size", r"MLP requires ffn_hidden_size, but it was not provided", "warning",
        "megatron-core transformer/mlp.py:196",
        "the local layer spec builds its MLP without ffn_hidden_size; TransformerConfig's "
        "ffn_hidden_size is used, as the message says: the model's own width (4 x hidden size only by default)",
        category=DeprecationWarning),
    KnownMessage(
        "sharded_tensor_deprecated", r"Please use DTensor instead and we are deprecating ShardedTensor", "warning",
        "torch distributed/checkpoint/planner_helpers.py:523 and default_planner.py:508",
        "megatron-core's torch_dist format still hands torch.distributed.checkpoint ShardedTensors",
        category=FutureWarning),
    KnownMessage(
        "rank_unknown", r"Could not determine rank from torch.distributed, RANK, or SLURM_PROCID", "warning",
        "megatron-core _rank_utils.py:39",
        "a notebook builds its .bin/.idx or GPTDataset in its own single process, without "
        "torch.distributed: rank 0 is the right answer"),
    KnownMessage(
        "dcp_no_dist", r"torch.distributed is disabled, unavailable or uninitialized, assuming the intent is to load in a single process", "warning",
        "torch distributed/checkpoint/utils.py:486, :488",
        "megatron-core's torch_dist load reads each rank's own shards with no_dist=True "
        "(dist_checkpointing/strategies/torch.py:979); torch warns even when a process group exists"),
    KnownMessage(
        "dcp_load_argument_order", r"The argument order of load has been changed", "warning",
        "torch distributed/checkpoint/logger.py:90",
        "the same torch.distributed.checkpoint.load call, made by megatron-core with keyword arguments"),
    KnownMessage(
        "te_moe_version", r"Only transformer-engine>=1\.7\.0 supports MoE experts", "warning",
        "megatron-core extensions/transformer_engine_spec_provider.py:88",
        "building a layer spec asks Transformer Engine's version; without TE it reads 0.0.0. The series' "
        "experts (notebook 05b) use the local spec's linear layers, which need no TE"),
    KnownMessage(
        "no_cuda_runtime", r"No CUDA runtime is found", "log",
        "torch utils/cpp_extension.py:183, imported by megatron-core tensor_parallel/random.py",
        "PyPI's Linux torch is a CUDA build; on a machine without a GPU it finds no CUDA runtime",
        logger="torch.utils.cpp_extension"),
    KnownMessage(
        "gptmodel_deprecated", r"GPTModel IS DEPRECATED", "log",
        "megatron-core models/gpt/gpt_model.py:121",
        "megatron-core asks new work to use HybridModel; the series teaches GPTModel, the model of "
        "the reference guide (notebook 03, section 9, says why)",
        logger="megatron.core.models.gpt.gpt_model"),
    KnownMessage(
        "mcore_async_save_deprecated", r"MCore's async save is deprecated", "log",
        "megatron-core dist_checkpointing/strategies/torch.py:749",
        "logged by every process's first torch_dist save, synchronous saves included: the series "
        "saves synchronously, and NVRx (the suggested async path) is a GPU-cluster tool",
        logger="megatron.core.dist_checkpointing.strategies.torch"),
    KnownMessage(
        "rerun_state_machine_implicit", r"Implicit initialization of Rerun State Machine!", "log",
        "megatron-core rerun_state_machine.py:1387",
        "a loop written with megatron-core alone (notebook 03 section 5, its train_gpt.py) reaches the rerun state "
        "machine through the schedules without Megatron-LM's initialize_megatron, which sets it up explicitly",
        logger="megatron.core.rerun_state_machine"),
    KnownMessage(
        "rerun_state_machine_mode", r"RerunStateMachine initialized in mode RerunMode.DISABLED", "log",
        "megatron-core rerun_state_machine.py:241",
        "that implicit set-up, in the default mode: disabled, as Megatron-LM's --rerun-mode default is",
        logger="megatron.core.rerun_state_machine"),
    KnownMessage(
        "mimo_experimental", r"MimoModelConfig is experimental", "warning",
        "megatron-core models/mimo/config/base_configs.py:37, imported by optimizer/__init__.py:1019",
        "get_megatron_optimizer imports the multimodal MimoModel class to check whether it was given one; "
        "the series builds no multimodal model"),
)

_counts: Counter[str] = Counter()
_state = {"applied": False}


class _Filter(logging.Filter):
    """Drops (and counts) the log records of :data:`KNOWN` for one logger."""

    def __init__(self, messages: list[KnownMessage]) -> None:
        super().__init__()
        self.messages = [(m.name, re.compile(m.pattern)) for m in messages]

    def filter(self, record: logging.LogRecord) -> bool:
        text = record.getMessage()
        for name, pattern in self.messages:
            if pattern.match(text):
                _counts[name] += 1
                return False
        return True


def apply() -> None:
    """Hide the messages of :data:`KNOWN` in this process, and only those (idempotent).

    Also sets ``KINETO_LOG_LEVEL=6`` (unless set), so that ``torch.profiler`` logs neither an ERROR line
    about the GPU count on a machine without a GPU nor torch 2.14's ``USDT: ... profiler_start`` lines, and ``NO_VCS_VERSION=1`` (unless set): megatron-core's ``package_info.py`` otherwise
    runs ``git rev-parse`` at import and appends the hash of whatever git checkout encloses
    site-packages (this repository's commit when ``.venv`` lives in it) to ``__version__``.
    Must run before ``import megatron.core`` to hide its import-time warnings. Does nothing when
    the environment sets ``HELPERS_QUIET=0``.
    """
    if _state["applied"] or os.environ.get("HELPERS_QUIET", "").lower() in ("0", "false", "no", "off"):
        return
    os.environ.setdefault("NO_VCS_VERSION", "1")
    os.environ.setdefault("KINETO_LOG_LEVEL", "6")  # torch.profiler: no "gpuGetDeviceCount failed", no "USDT: ... profiler_start"
    for m in KNOWN:
        if m.kind == "warning":
            warnings.filterwarnings("ignore", message=m.pattern, category=m.category)
    by_logger: dict[str, list[KnownMessage]] = {}
    for m in KNOWN:
        if m.kind == "log":
            by_logger.setdefault(m.logger, []).append(m)
    for name, messages in by_logger.items():
        logging.getLogger(name).addFilter(_Filter(messages))
    _state["applied"] = True


def suppressed() -> dict[str, int]:
    """``{name: count}`` of the log messages :func:`apply` hid in this process so far.

    (Hidden ``warnings.warn`` messages are not counted: Python's filters drop them before any
    hook sees them.)
    """
    return dict(_counts)


def table() -> str:
    """:data:`KNOWN` as a Markdown table (notebook 00): message, source, what it means here."""
    from helpers.support.results import markdown_table

    rows = [[m.pattern.replace("\\.", ".").replace("`", ""), m.source, m.meaning] for m in KNOWN]
    return markdown_table(rows, ["message starts with", "emitted by", "what it means here"])
