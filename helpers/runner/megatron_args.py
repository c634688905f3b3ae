"""Megatron-LM's command line for a run of the series, and the guide's 2022 command beside it.

A :class:`helpers.learn.training_config.TrainingConfig` becomes the flags of Megatron-LM's
``pretrain_gpt.py``; the series runs them with its copy of that script, :mod:`helpers.learn.pretrain_gpt`,
and the same flags run Megatron-LM's script in the NGC container. :func:`flag_table` sets every flag
beside the guide's 2022 flag and the series' parameter it comes from (notebook 03, section 6). The
implementation flags follow a :class:`Target` (GPUs, Transformer Engine, Apex, bf16), probed or named.

Sources: the guide's ``pretrain_gpt.py`` command (``GPT_ARGS``, 2022); Megatron-LM
``megatron/training/arguments.py`` and ``argument_utils.py`` (``core_v0.19.0``, the flags'
names and defaults today); ``examples/gpt3/train_gpt3_175b_distributed.sh``
(``CUDA_DEVICE_MAX_CONNECTIONS=1``).
"""

from __future__ import annotations

import shlex
from dataclasses import dataclass
from typing import Any, Callable, Sequence

from helpers.learn.training_config import TrainingConfig

#: The training script, run as a module of this repository (Megatron-LM: ``pretrain_gpt.py``).
SCRIPT = ("-m", "helpers.learn.pretrain_gpt")
#: The environment Megatron-LM's example scripts export: with TP > 1 before Blackwell GPUs,
#: ``validate_args`` asks for one CUDA connection so communication kernels run in issue order.
ENV = {"CUDA_DEVICE_MAX_CONNECTIONS": "1"}

#: The guide's training command (2022), flag by flag, with its values for CodeParrot small.
GUIDE_2022: dict[str, str | None] = {
    "--num-layers": "12", "--hidden-size": "768", "--num-attention-heads": "12", "--seq-length": "1024",
    "--max-position-embeddings": "1024", "--micro-batch-size": "12", "--global-batch-size": "192",
    "--lr": "0.0005", "--train-iters": "150000", "--lr-decay-iters": "150000", "--lr-decay-style": "cosine",
    "--lr-warmup-iters": "2000", "--weight-decay": ".1", "--adam-beta2": ".999", "--fp16": None,
    "--log-interval": "10", "--save-interval": "2000", "--eval-interval": "200", "--eval-iters": "10",
    "--tensorboard-dir": "experiments/tensorboard", "--tensor-model-parallel-size": "1",
    "--pipeline-model-parallel-size": "1", "--vocab-file": "vocab.json", "--merge-file": "merges.txt",
    "--save": "experiments/codeparrot-small", "--load": "experiments/codeparrot-small",
    "--data-path": "codeparrot_content_document",
}


#: Why a flag of the guide has no row in a run's command.
REMOVED_WHY = {"--fp16": "precision: fp32 on a CPU; --bf16 on GPUs that have it in hardware (Ampere and later)"}


@dataclass(frozen=True)
class Flag:
    """One flag of the command: how its value comes from the run, and what it was in 2022.

    Attributes:
        flag: today's flag (``--norm-epsilon``).
        value: the flag's value for a config (``None``: a switch that is present; a function
            returning ``False`` leaves the flag out).
        source: the series' parameter it comes from (``model.num_layers``), or why it is there.
        guide: the guide's 2022 flag it replaces (``--vocab-file``), or ``None`` when new.
    """

    flag: str
    value: Callable[[TrainingConfig], Any]
    source: str
    guide: str | None = None


def _model(name: str) -> Callable[[TrainingConfig], Any]:
    return lambda cfg: getattr(cfg.model, name)


def _cfg(name: str) -> Callable[[TrainingConfig], Any]:
    return lambda cfg: getattr(cfg, name)


def _switch(test: Callable[[TrainingConfig], bool]) -> Callable[[TrainingConfig], Any]:
    return lambda cfg: None if test(cfg) else False


#: The flags of a run, in the guide's order, then what the guide left to defaults, then what is new.
FLAGS: tuple[Flag, ...] = (
    Flag("--num-layers", _model("num_layers"), "model.num_layers", "--num-layers"),
    Flag("--hidden-size", _model("hidden_size"), "model.hidden_size", "--hidden-size"),
    Flag("--num-attention-heads", _model("num_attention_heads"), "model.num_attention_heads", "--num-attention-heads"),
    Flag("--ffn-hidden-size", _model("ffn_size"), "model.ffn_hidden_size (default 4 x hidden)"),
    Flag("--seq-length", _model("seq_length"), "model.seq_length", "--seq-length"),
    Flag("--max-position-embeddings", _model("max_position_embeddings"), "model.max_position_embeddings",
         "--max-position-embeddings"),
    Flag("--micro-batch-size", _cfg("micro_batch_size"), "micro_batch_size", "--micro-batch-size"),
    Flag("--global-batch-size", _cfg("global_batch_size"), "global_batch_size", "--global-batch-size"),
    Flag("--lr", _cfg("lr"), "lr", "--lr"),
    Flag("--train-iters", _cfg("train_iters"), "train_iters", "--train-iters"),
    Flag("--lr-decay-iters", lambda cfg: cfg.decay_iters, "lr_decay_iters (default train_iters)", "--lr-decay-iters"),
    Flag("--lr-decay-style", _cfg("lr_decay_style"), "lr_decay_style (default now linear)", "--lr-decay-style"),
    Flag("--lr-warmup-iters", _cfg("lr_warmup_iters"), "lr_warmup_iters", "--lr-warmup-iters"),
    Flag("--weight-decay", _cfg("weight_decay"), "weight_decay (default 0.01)", "--weight-decay"),
    Flag("--adam-beta2", _cfg("adam_beta2"), "adam_beta2", "--adam-beta2"),
    Flag("--log-interval", _cfg("log_interval"), "log_interval", "--log-interval"),
    Flag("--save-interval", lambda cfg: cfg.save_interval or cfg.train_iters, "save_interval (default: at the end)",
         "--save-interval"),
    Flag("--eval-interval", _cfg("eval_interval"), "eval_interval", "--eval-interval"),
    Flag("--eval-iters", _cfg("eval_iters"), "eval_iters", "--eval-iters"),
    Flag("--tensorboard-dir", lambda cfg: cfg.tensorboard_path, "tensorboard_dir (RUN/tensorboard)", "--tensorboard-dir"),
    Flag("--tensor-model-parallel-size", _cfg("tensor_model_parallel_size"), "tensor_model_parallel_size",
         "--tensor-model-parallel-size"),
    Flag("--pipeline-model-parallel-size", _cfg("pipeline_model_parallel_size"), "pipeline_model_parallel_size",
         "--pipeline-model-parallel-size"),
    Flag("--tokenizer-type", lambda cfg: "HuggingFaceTokenizer", "the tokenizer notebook 01 trained", "--vocab-file"),
    Flag("--tokenizer-model", lambda cfg: cfg.tokenizer_path, "tokenizer_dir (RUN/data/tokenizer)", "--merge-file"),
    Flag("--save", lambda cfg: cfg.checkpoint_path, "checkpoint_dir (RUN/checkpoints)", "--save"),
    Flag("--load", lambda cfg: cfg.checkpoint_path, "checkpoint_dir: resume from the latest checkpoint", "--load"),
    Flag("--data-path", lambda cfg: cfg.data_prefix_path, "data_prefix (RUN/data/codeparrot_content_document)",
         "--data-path"),
    # the guide's defaults, given explicitly
    Flag("--split", _cfg("split"), "split (default was 969,30,1; now none, with a warning)"),
    Flag("--min-lr", _cfg("min_lr"), "min_lr"),
    Flag("--adam-beta1", _cfg("adam_beta1"), "adam_beta1"),
    Flag("--adam-eps", _cfg("adam_eps"), "adam_eps"),
    Flag("--clip-grad", _cfg("clip_grad"), "clip_grad"),
    Flag("--seed", _cfg("seed"), "seed"),
    Flag("--init-method-std", _model("init_method_std"), "model.init_method_std"),
    Flag("--hidden-dropout", _model("hidden_dropout"), "model.hidden_dropout (default 0.1)"),
    Flag("--attention-dropout", _model("attention_dropout"), "model.attention_dropout (default 0.1)"),
    Flag("--norm-epsilon", _model("layernorm_epsilon"), "model.layernorm_epsilon (was --layernorm-epsilon)"),
    Flag("--make-vocab-size-divisible-by", _model("make_vocab_size_divisible_by"), "model.make_vocab_size_divisible_by"),
    Flag("--untie-embeddings-and-output-weights", _switch(lambda cfg: not cfg.model.share_embeddings_and_output_weights),
         "model.share_embeddings_and_output_weights=False"),
    Flag("--no-bias-gelu-fusion", _switch(lambda cfg: not cfg.model.bias_activation_fusion and not cfg.model.swiglu),
         "model.bias_activation_fusion=False: the exact (erf) GELU; the fused kernel computes the tanh one"),
    Flag("--no-bias-dropout-fusion", _switch(lambda cfg: not cfg.model.bias_dropout_fusion),
         "model.bias_dropout_fusion=False"),
    Flag("--no-masked-softmax-fusion", _switch(lambda cfg: not cfg.model.masked_softmax_fusion),
         "model.masked_softmax_fusion=False"),
    Flag("--override-opt_param-scheduler", _switch(lambda cfg: cfg.override_opt_param_scheduler),
         "override_opt_param_scheduler"),
    Flag("--use-checkpoint-opt_param-scheduler", _switch(lambda cfg: cfg.use_checkpoint_opt_param_scheduler),
         "use_checkpoint_opt_param_scheduler"),
    Flag("--exit-interval", lambda cfg: cfg.exit_interval if cfg.exit_interval else False, "exit_interval"),
    Flag("--pretrained-checkpoint", lambda cfg: cfg.pretrained_checkpoint or False,
         "pretrained_checkpoint: the weights to start from when --load holds no checkpoint"),
    # a Llama's blocks (model.ARCHITECTURES["llama"]); none of them for the guide's GPT-2
    Flag("--position-embedding-type", lambda cfg: cfg.model.position_embedding_type if cfg.model.position_embedding_type != "learned_absolute"
         else False, "model.position_embedding_type: rotary embeddings (a Llama)"),
    Flag("--rotary-base", lambda cfg: cfg.model.rotary_base if cfg.model.position_embedding_type == "rope" else False,
         "model.rotary_base"),
    Flag("--normalization", lambda cfg: cfg.model.normalization if cfg.model.normalization != "LayerNorm" else False,
         "model.normalization: RMSNorm (a Llama)"),
    Flag("--swiglu", _switch(lambda cfg: cfg.model.swiglu), "model.swiglu: the gated SiLU MLP (a Llama)"),
    Flag("--no-bias-swiglu-fusion", _switch(lambda cfg: cfg.model.swiglu and not cfg.model.bias_activation_fusion),
         "model.bias_activation_fusion=False: SiLU and the gate as separate ops"),
    Flag("--disable-bias-linear", _switch(lambda cfg: not cfg.model.add_bias_linear), "model.add_bias_linear=False (a Llama)"),
    Flag("--group-query-attention", _switch(lambda cfg: cfg.model.query_groups < cfg.model.num_attention_heads),
         "model.num_query_groups below the heads: grouped-query attention"),
    Flag("--num-query-groups", lambda cfg: cfg.model.query_groups if cfg.model.query_groups < cfg.model.num_attention_heads
         else False, "model.num_query_groups"),
    # a mixture of experts (model.num_experts) and expert parallelism
    Flag("--num-experts", lambda cfg: cfg.model.num_experts or False, "model.num_experts: a mixture of experts per layer"),
    Flag("--moe-router-topk", lambda cfg: cfg.model.moe_router_topk if cfg.model.num_experts else False,
         "model.moe_router_topk: experts per token"),
    Flag("--expert-model-parallel-size", lambda cfg: cfg.expert_model_parallel_size if cfg.expert_model_parallel_size > 1
         else False, "expert_model_parallel_size: the experts split over data-parallel ranks"),
    # the memory savers: activation recomputation (Korthikanti et al. 2022), the distributed optimizer (ZeRO-1)
    Flag("--use-distributed-optimizer", _switch(lambda cfg: cfg.use_distributed_optimizer),
         "use_distributed_optimizer: optimizer state sharded over the data-parallel ranks"),
    Flag("--num-virtual-stages-per-pipeline-rank", lambda cfg: cfg.num_virtual_stages_per_pipeline_rank or False,
         "num_virtual_stages_per_pipeline_rank: the interleaved pipeline schedule"),
    Flag("--sequence-parallel", _switch(lambda cfg: cfg.sequence_parallel),
         "sequence_parallel: norms and dropouts on each tensor-parallel rank's slice of the sequence"),
    Flag("--recompute-activations", _switch(lambda cfg: cfg.recompute == "selective"),
         "recompute='selective': attention's core recomputed in backward"),
    Flag("--recompute-granularity", lambda cfg: "full" if cfg.recompute == "full" else False,
         "recompute='full': each layer recomputed from its input"),
    Flag("--recompute-method", lambda cfg: "uniform" if cfg.recompute == "full" else False, "recompute='full'"),
    Flag("--recompute-num-layers", lambda cfg: 1 if cfg.recompute == "full" else False,
         "recompute='full': one layer per recomputed chunk"),
    # new: what a run today asks for
    Flag("--data-cache-path", lambda cfg: cfg.run_path / "data" / "cache", "the GPTDataset index cache (notebook 02)"),
    Flag("--exit-signal-handler", lambda cfg: None, "SIGTERM: save a checkpoint, then exit"),
    Flag("--log-timers-to-tensorboard", lambda cfg: None, "time per iteration into TensorBoard"),
    Flag("--log-validation-ppl-to-tensorboard", lambda cfg: None, "validation perplexity into TensorBoard"),
)

@dataclass(frozen=True)
class Target:
    """The machine a command is written for: what decides its implementation flags.

    Attributes:
        name: ``"cpu"``, ``"gpu-pip"``, ``"gpu-te"``, ``"gpu-te-apex"`` (:data:`TARGETS`) or ``"this machine"``.
        gpus: CUDA devices per node (0: a CPU run).
        transformer_engine: Transformer Engine imports (the NGC container; ``pip install`` has none).
        apex_gradient_fusion: Apex's ``fused_weight_gradient_mlp_cuda`` imports: megatron-core's
            ``ColumnParallelLinear`` (the output layer, even with TE) needs it for gradient-accumulation
            fusion (``megatron/core/tensor_parallel/layers.py``, lines 49-53 and 1070).
        apex_kernels: Apex's other kernels import (``scaled_masked_softmax_cuda``: the masked-softmax
            fusion of megatron-core's local attention, ``megatron/core/fusions/fused_softmax.py``).
        bf16: bf16 in hardware (compute capability 8.0 and later).
    """

    name: str
    gpus: int
    transformer_engine: bool
    apex_gradient_fusion: bool
    apex_kernels: bool
    bf16: bool

    def describe(self) -> str:
        """One line: ``target gpu-te: CUDA GPUs, Transformer Engine, no Apex gradient fusion, bf16`` (no count: the
        flags are the same for one GPU or many)."""
        if not self.gpus:
            return f"target {self.name}: no GPU (gloo, megatron-core's local layers, fp32)"
        parts = ["CUDA GPUs", "Transformer Engine" if self.transformer_engine else "no Transformer Engine",
                 "Apex's fused_weight_gradient_mlp_cuda" if self.apex_gradient_fusion else "no Apex gradient fusion",
                 "bf16" if self.bf16 else "no bf16 (fp16)"]
        return f"target {self.name}: " + ", ".join(parts)


#: The machines a command can be written for without being there (``--target``). ``gpu-te`` is the NGC
#: container as far as it is known without running in it: Transformer Engine; Apex's gradient-fusion
#: extension is not assumed (``make gpu-smoke`` reports it; ``gpu-te-apex`` when it imports).
TARGETS: dict[str, Target] = {
    "cpu": Target("cpu", 0, False, False, False, False),
    "gpu-pip": Target("gpu-pip", 1, False, False, False, True),
    "gpu-te": Target("gpu-te", 1, True, False, False, True),
    "gpu-te-apex": Target("gpu-te-apex", 1, True, True, True, True),
}


def probe_target() -> Target:
    """The target this process runs on: CUDA devices it sees, TE and Apex's extensions importable, bf16."""
    import importlib.util

    import torch

    from helpers.learn.model import transformer_engine_available

    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    found = lambda module: importlib.util.find_spec(module) is not None  # noqa: E731
    return Target("this machine", gpus, gpus > 0 and transformer_engine_available(),
                  gpus > 0 and found("fused_weight_gradient_mlp_cuda"), gpus > 0 and found("scaled_masked_softmax_cuda"),
                  gpus > 0 and torch.cuda.is_bf16_supported(including_emulation=False))


def resolve_target(target: Target | str | None = None, *, cpu: bool | None = None) -> Target:
    """``target`` as a :class:`Target`: a name of :data:`TARGETS`, or ``None`` to probe this process.

    ``cpu`` is another spelling of ``target``: ``True`` is ``"cpu"``, ``False`` is ``"gpu-te"``.

    Raises:
        ValueError: an unknown name (the message lists :data:`TARGETS`).
    """
    if target is None and cpu is not None:
        target = "cpu" if cpu else "gpu-te"
    if target is None:
        return probe_target()
    if isinstance(target, Target):
        return target
    if target not in TARGETS:
        raise ValueError(f"target={target!r} is unknown: choose one of {', '.join(TARGETS)} (or None: this machine)")
    return TARGETS[target]


def target_precision(precision: str, target: Target) -> str:
    """``cfg.precision`` on ``target``: ``"auto"`` is fp32 without a GPU, bf16 where the GPU has it, else fp16.

    Raises:
        ValueError: an unknown name, or bf16 / fp16 for a target without a GPU.
    """
    if precision not in ("auto", "fp32", "bf16", "fp16"):
        raise ValueError(f"precision={precision!r}: choose auto, fp32, bf16 or fp16")
    if precision == "auto":
        return "fp32" if not target.gpus else "bf16" if target.bf16 else "fp16"
    if precision != "fp32" and not target.gpus:
        raise ValueError(f"precision={precision!r} needs a CUDA GPU, and {target.describe()}; use 'fp32' or 'auto'")
    return precision


def target_flags(cfg: TrainingConfig, target: Target) -> list[tuple[str, str | None, str]]:
    """The implementation flags ``target`` needs for ``cfg``: ``(flag, value or None, why)``, in order.

    Each flag that turns off a fusion names the kernel that is missing. Sources: Megatron-LM
    ``megatron/training/arguments.py`` (0.19.2), ``megatron/core/tensor_parallel/layers.py``,
    ``megatron/core/models/gpt/gpt_layer_specs.py``; Megatron-LM's ``examples/gpt3`` scripts for the speed flags.
    """
    rope, moe = cfg.model.position_embedding_type == "rope", bool(cfg.model.num_experts)
    precision = target_precision(cfg.precision, target)
    out: list[tuple[str, str | None, str]] = []
    if precision in ("bf16", "fp16"):
        out.append((f"--{precision}", None, f"precision {cfg.precision!r}: {precision} on {target.name}"))
    if not target.gpus:
        out += [("--distributed-backend", "gloo", "NCCL needs GPUs"),
                ("--transformer-impl", "local", "Transformer Engine needs GPUs"),
                ("--use-cpu-initialization", None, "weights made on the CPU (a GPU run initialises on the GPU)"),
                ("--no-gradient-accumulation-fusion", None, "the fused weight-gradient kernel is Apex's or TE's (CUDA)"),
                ("--no-persist-layer-norm", None, "the persistent LayerNorm kernel is Apex's (CUDA)"),
                ("--num-workers", "0", "no DataLoader worker processes: 2 would compete with training for 2 cores")]
        out += [("--no-rope-fusion", None, "the fused rotary-embedding kernel is Transformer Engine's (CUDA)")] if rope else []
        out += [("--moe-token-dispatcher-type", "allgather", "the all-to-all dispatcher synchronises CUDA streams "
                 "(megatron-core 0.19.2 transformer/moe/token_dispatcher.py:469, 922-950)")] if moe else []
        return out
    te = target.transformer_engine and cfg.layer_spec != "local"
    out.append(("--transformer-impl", "transformer_engine" if te else "local",
                "Transformer Engine's fused layers and attention" if te else
                "megatron-core's own layers: " + ("layer_spec='local'" if target.transformer_engine
                                                  else "Transformer Engine is not installed")))
    if not target.apex_gradient_fusion:
        out.append(("--no-gradient-accumulation-fusion", None,
                    "Apex's fused_weight_gradient_mlp_cuda is missing: the output layer would raise"))
    if not te and not target.apex_kernels:
        out += [("--no-masked-softmax-fusion", None, "Apex's scaled_masked_softmax_cuda is missing"),
                ("--no-persist-layer-norm", None, "the persistent LayerNorm kernel is Apex's")]
    if rope and not te:
        out.append(("--no-rope-fusion", None, "the fused rotary-embedding kernel is Transformer Engine's"))
    out.append(("--cross-entropy-loss-fusion", None, "the logits' softmax and loss in one fused kernel"))
    if cfg.use_distributed_optimizer:
        out += [("--overlap-grad-reduce", None, "the gradients' reduce-scatter overlaps backward"),
                ("--overlap-param-gather", None, "the weights' all-gather overlaps the next forward")]
    return out


def _text(value: Any) -> str:
    return f"{value:g}" if isinstance(value, float) else str(value)


def arguments(cfg: TrainingConfig, *, target: Target | str | None = None, cpu: bool | None = None) -> list[str]:
    """Megatron-LM's flags for ``cfg`` on ``target``: :data:`FLAGS` in order, then :func:`target_flags`.

    Args:
        target: the machine that will run the flags (:data:`TARGETS` name or :class:`Target`);
            ``None``: this process's devices and libraries (:func:`probe_target`).
        cpu: another spelling of ``target``: ``True`` = ``"cpu"``, ``False`` = ``"gpu-te"``.

    Returns:
        ``["--num-layers", "4", ...]``: argv for ``pretrain_gpt.py``.

    Raises:
        ValueError: an unknown target, or a precision the target cannot run.
    """
    target = resolve_target(target, cpu=cpu)
    out: list[str] = []
    for f in FLAGS:
        value = f.value(cfg)
        if value is False:
            continue
        out += [f.flag] if value is None else [f.flag, _text(value)]
    for flag, value, _ in target_flags(cfg, target):
        out += [flag] if value is None else [flag, value]
    return out


def command(cfg: TrainingConfig, *, nproc_per_node: int = 1, target: Target | str | None = None,
            cpu: bool | None = None) -> list[str]:
    """``torchrun --nproc-per-node N -m helpers.learn.pretrain_gpt <flags>`` for ``cfg`` (run it with :data:`ENV`).

    Megatron-LM's own script takes the same flags: replace ``-m helpers.learn.pretrain_gpt`` by ``pretrain_gpt.py``.
    """
    return ["torchrun", f"--nproc-per-node={nproc_per_node}", *SCRIPT, *arguments(cfg, target=target, cpu=cpu)]


def parse(argv: Sequence[str], *, world_size: int = 1):
    """Megatron-LM's ``parse_args`` and ``validate_args`` (``megatron/training/arguments.py``) on ``argv``, in this process.

    They run as ``pretrain_gpt.py`` runs them, with ``WORLD_SIZE=world_size`` and :data:`ENV` set for the
    call (the data-parallel size is what TP x PP leaves of it). The argument table ``validate_args``
    prints is not shown. Without CUDA, ``cpu_compat.apply()`` runs first (``validate_args`` asks for the
    GPU's architecture when TP > 1).

    Returns:
        an ``argparse.Namespace``, the ``args`` of Megatron-LM's ``get_args()`` before the tokenizer is built.

    Raises:
        AssertionError: a combination ``validate_args`` refuses (its own message).
    """
    import contextlib
    import io
    import os
    import sys

    from megatron.training.arguments import parse_args, validate_args

    from helpers.support import cpu_compat

    cpu_compat.apply()
    saved_argv, saved_env = sys.argv, dict(os.environ)
    sys.argv = ["pretrain_gpt.py", *argv]
    os.environ.update({**ENV, "WORLD_SIZE": str(world_size)})
    try:
        with contextlib.redirect_stdout(io.StringIO()):
            args = parse_args()
            validate_args(args, {})
    finally:
        sys.argv = saved_argv
        os.environ.clear()
        os.environ.update(saved_env)
    return args


def parsed_args(cfg: TrainingConfig, *, world_size: int = 1, target: Target | str | None = None):
    """Megatron-LM's own ``args`` for a run: :func:`parse` of :func:`arguments`, with ``padded_vocab_size``.

    ``padded_vocab_size`` comes from megatron-core's ``vocab_size_with_padding``, as the tokenizer sets it
    at start-up. Notebook 05 passes these ``args`` to Megatron-LM's memory estimate.
    """
    from megatron.core.tokenizers.utils.build_tokenizer import vocab_size_with_padding

    args = parse(arguments(cfg, target=target), world_size=world_size)
    args.padded_vocab_size = vocab_size_with_padding(cfg.model.vocab_size, args, logging_enabled=False)
    return args


#: torchrun's rendezvous flags: their address and port differ from launch to launch, not from layout to layout.
_RENDEZVOUS = frozenset({"--master_port", "--master-port", "--master_addr", "--master-addr", "--rdzv_endpoint",
                         "--rdzv-endpoint"})


def flag_difference(reference: Sequence[str], command: Sequence[str]) -> list[str]:
    """The flags ``command`` adds to ``reference`` or sets otherwise, then those it drops (``"without --flag"``).

    Both are argument lists as :func:`command` or a launch plan writes them. A flag's value is what
    follows its ``=``, or else the words up to the next flag. Values that name files or folders (a
    ``/`` inside) and torchrun's rendezvous address and port are left out, so runs that differ only in
    their run folders differ in nothing. Notebooks 05 and 05b print it.
    """
    def is_flag(word: str) -> bool:
        try:
            float(word)  # a negative number is a value
            return False
        except ValueError:
            return word.startswith("-")

    def parse(words: Sequence[str]) -> dict[str, tuple[str, ...]]:
        flags: dict[str, list[str]] = {}
        last = None  # the flag that takes the next words, if any
        for word in words:
            if is_flag(word):
                flag, equals, value = word.partition("=")  # torchrun's --nproc_per_node=N
                flags[flag], last = ([value], None) if equals else ([], flag)
            elif last is not None:
                flags[last].append(word)
        return {f: tuple(v) for f, v in flags.items() if f not in _RENDEZVOUS and not any("/" in w for w in v)}

    ref, cmd = parse(reference), parse(command)
    added = [" ".join((f, *v)) for f, v in cmd.items() if ref.get(f) != v]
    return added + [f"without {f}" for f in ref if f not in cmd]


def shell_command(cfg: TrainingConfig, *, nproc_per_node: int = 1, target: Target | str | None = None,
                  cpu: bool | None = None, script: str | None = None) -> str:
    """:func:`command` as a shell line a learner can paste: a comment naming the target, then one flag per line.

    Args:
        script: what to run instead of ``-m helpers.learn.pretrain_gpt`` (``"pretrain_gpt.py"`` in a
            Megatron-LM checkout).
    """
    resolved = resolve_target(target, cpu=cpu)
    words = command(cfg, nproc_per_node=nproc_per_node, target=resolved)
    head = words[:2] + ([script] if script else list(SCRIPT))
    flags, lines = words[2 + len(SCRIPT):], []
    for word in flags:
        if word.startswith("--"):
            lines.append(word)
        else:
            lines[-1] += " " + shlex.quote(word)
    env = " ".join(f"{k}={v}" for k, v in ENV.items())
    return f"# written for {resolved.describe()}\n{env} {' '.join(head)} \\\n    " + " \\\n    ".join(lines)


def flag_table(cfg: TrainingConfig, *, target: Target | str | None = None, cpu: bool | None = None) -> list[dict[str, str]]:
    """Every flag of :func:`arguments` beside the guide's 2022 flag and the series' parameter.

    Returns:
        One row per flag: ``{"today", "value", "the guide (2022)", "change", "from the series"}``;
        ``change`` is ``same``, ``replaced``, ``new``, ``CPU only`` or ``GPU: <target>`` (the target's
        implementation flags, :func:`target_flags`). The guide's flags that have no row today are
        added at the end as ``not used``.
    """
    target = resolve_target(target, cpu=cpu)
    rows, used = [], set()
    for f in FLAGS:
        value = f.value(cfg)
        if value is False:
            continue
        if f.guide == f.flag:
            change, guide = "same", f"{f.guide} {GUIDE_2022.get(f.guide) or ''}".strip()
        elif f.guide:
            change, guide = "replaced", f"{f.guide} {GUIDE_2022.get(f.guide) or ''}".strip()
        else:
            change, guide = "new", ""
        if f.guide:
            used.add(f.guide)
        rows.append({"today": f.flag, "value": "" if value is None else _text(value), "the guide (2022)": guide,
                     "change": change, "from the series": f.source})
    for flag, value, why in target_flags(cfg, target):
        if flag in ("--bf16", "--fp16"):
            used.add("--fp16")
            rows.append({"today": flag, "value": "", "the guide (2022)": "--fp16", "change": "replaced" if flag == "--bf16"
                         else "same", "from the series": why})
            continue
        rows.append({"today": flag, "value": value or "", "the guide (2022)": "",
                     "change": "CPU only" if not target.gpus else f"GPU: {target.name}", "from the series": why})
    for flag in GUIDE_2022:
        if flag not in used:
            rows.append({"today": "", "value": "", "the guide (2022)": flag, "change": "not used",
                         "from the series": REMOVED_WHY.get(flag, "")})
    return rows


def optimizer_name() -> str:
    """The Adam Megatron-LM steps on this machine (``megatron/core/optimizer/__init__.py``, lines 13-35):
    Transformer Engine's FusedAdam, else Apex's, else torch's AdamW; on a CPU, torch's fused
    AdamW (the ``fused_adamw`` shim of :mod:`helpers.support.cpu_compat`)."""
    import importlib.util

    import torch

    if not torch.cuda.is_available():
        return "torch.optim.AdamW(fused=True)"
    for module, name in (("transformer_engine", "transformer_engine.pytorch.optimizers.FusedAdam"),
                         ("apex", "apex.optimizers.FusedAdam")):
        if importlib.util.find_spec(module) is not None:
            return name
    return "torch.optim.AdamW"


def main(argv: list[str] | None = None) -> int:
    """``python -m helpers.runner.megatron_args [RUN_DIR] [--target NAME | --gpu] [--script pretrain_gpt.py] [--nproc N]``:
    print the command of a run (its ``run.json``, written by ``helpers.runner.launch.train``) for a target machine.

    Returns:
        0, or 2 when the folder holds no ``run.json`` (the message says which notebook writes it).
    """
    import argparse
    import sys
    from pathlib import Path

    parser = argparse.ArgumentParser(prog="python -m helpers.runner.megatron_args",
                                     description="print Megatron-LM's command line for a run folder")
    parser.add_argument("run_dir", nargs="?", default="runs/latest", help="a run folder (default runs/latest)")
    parser.add_argument("--target", choices=list(TARGETS), default=None,
                        help="the machine that will run the command (default: this machine, probed)")
    parser.add_argument("--gpu", action="store_true", help="the same as --target gpu-te (the NGC container)")
    parser.add_argument("--script", default=None, help="instead of -m helpers.learn.pretrain_gpt, e.g. pretrain_gpt.py")
    parser.add_argument("--nproc", type=int, default=1, help="processes (--nproc-per-node)")
    args = parser.parse_args(argv)
    config = Path(args.run_dir) / "run.json"
    if not config.is_file():
        print(f"error: {config} not found: notebook 03 (helpers.runner.launch.train) writes it", file=sys.stderr)
        return 2
    import shutil

    cfg = TrainingConfig.from_json(config)
    if shutil.which("torchrun") is None:  # the command names torchrun, which lives in the project's environment
        print(f"# torchrun is not on PATH: activate the environment first (source {Path(sys.executable).parent}/activate)")
    target = args.target or ("gpu-te" if args.gpu else None)
    print(shell_command(cfg, nproc_per_node=args.nproc, target=target, script=args.script))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
