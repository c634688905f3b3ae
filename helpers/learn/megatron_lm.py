"""Reading Megatron-LM's own checkpoints: the architecture from their ``args``, the weights in megatron-core names.

Notebooks 03 §8 and 06 §10. :func:`read_checkpoint` reads both formats Megatron-LM's
``megatron/training/checkpointing.py`` writes and returns megatron-core weight names at TP=1 and a
``ModelConfig.to_metadata()`` dict, as the series' own checkpoints give:

* ``--ckpt-format torch``: ``iter_NNNNNNN/mp_rank_00/model_optim_rng.pt``; old model names are
  renamed by :data:`LEGACY_NAMES`;
* ``--ckpt-format torch_dist``: ``.distcp`` shards with the series' own keys, ``args`` in the common state.

:func:`metadata_from_args` reads the architecture from ``args`` (``megatron/training/arguments.py``).
The files are unpickled without running code (:mod:`helpers.support.safe_load`).
"""

from __future__ import annotations

import argparse
import io
import os
import re
from pathlib import Path
from typing import Any, Mapping

import torch

from helpers.learn.model import ModelConfig
from helpers.support import safe_load
from helpers.support.safe_load import ConversionError  # noqa: F401 (raised here; helpers.learn.conversion re-exports it)

#: Megatron-LM's marker of the last complete save (``megatron/training/checkpointing.py``).
TRACKER_FILE = "latest_checkpointed_iteration.txt"


def iteration_dir(checkpoint_dir: str | os.PathLike, iteration: int) -> Path:
    """``checkpoint_dir/iter_0000300`` for ``iteration=300`` (Megatron-LM's ``iter_%07d``)."""
    return Path(checkpoint_dir) / f"iter_{iteration:07d}"


def iteration_of(folder: str | os.PathLike) -> int | None:
    """The iteration an ``iter_NNNNNNN`` folder holds (the inverse of :func:`iteration_dir`); None for another name."""
    m = re.match(r"^iter_(\d+)$", Path(folder).name)
    return int(m[1]) if m else None


def latest_iteration(checkpoint_dir: str | os.PathLike) -> int | None:
    """The iteration named by ``latest_checkpointed_iteration.txt``; None when there is none.

    Raises:
        ValueError: the tracker file does not hold an integer, or names a missing folder.
    """
    tracker = Path(checkpoint_dir) / TRACKER_FILE
    if not tracker.exists():
        return None
    text = tracker.read_text().strip()
    try:
        iteration = int(text)
    except ValueError:
        iteration = -1
    if iteration >= 0 and iteration_dir(checkpoint_dir, iteration).is_dir():
        return iteration
    if iteration >= 0:
        what = f"names iteration {iteration}, but {iteration_dir(checkpoint_dir, iteration).name} is missing"
    else:
        what = f"holds {text!r}, not an iteration number"
    saved = sorted(i for p in Path(checkpoint_dir).iterdir() if p.is_dir() and (i := iteration_of(p)) is not None)
    fix = "delete it to start over"
    if saved:
        fix = (f"write {saved[-1]} into it to resume from {iteration_dir(checkpoint_dir, saved[-1]).name}, the latest "
               f"folder there (check it is whole), or {fix}")
    raise ValueError(f"{tracker} {what}. Nothing was changed. Fix: {fix}.")


MODEL_FILE = "model_optim_rng.pt"
COMMON_FILE = "common.pt"
#: Top-level entries of a Megatron-LM state dict that describe the checkpoint, not training state.
_DESCRIPTIVE = ("model", "args", "checkpoint_version", "iteration")
#: GPTModel's weights in a torch_dist checkpoint (``mtp.*`` & co. are refused through the args).
_MODEL_KEY_PREFIXES = ("embedding.", "decoder.", "output_layer.")
_OLD = r"^language_model\.(?:encoder|transformer)\."
#: The old Megatron-LM model's names (flattened with dots) -> megatron-core's (local spec).
LEGACY_NAMES: tuple[tuple[str, str], ...] = (
    (r"^language_model\.embedding\.(word|position)_embeddings\.", r"embedding.\1_embeddings."),
    (_OLD + r"layers\.(\d+)\.input_(?:layer)?norm\.", r"decoder.layers.\1.input_layernorm."),
    (_OLD + r"layers\.(\d+)\.(?:self_)?attention\.query_key_value\.", r"decoder.layers.\1.self_attention.linear_qkv."),
    (_OLD + r"layers\.(\d+)\.(?:self_)?attention\.dense\.", r"decoder.layers.\1.self_attention.linear_proj."),
    (_OLD + r"layers\.(\d+)\.post_attention_(?:layer)?norm\.", r"decoder.layers.\1.pre_mlp_layernorm."),
    (_OLD + r"layers\.(\d+)\.mlp\.dense_h_to_4h\.", r"decoder.layers.\1.mlp.linear_fc1."),
    (_OLD + r"layers\.(\d+)\.mlp\.dense_4h_to_h\.", r"decoder.layers.\1.mlp.linear_fc2."),
    (_OLD + r"final_(?:layer)?norm\.", "decoder.final_layernorm."),
    (r"^language_model\.output_layer\.", "output_layer."),
    (r"^word_embeddings_for_head\.", "output_layer."),  # the last pipeline stage's copy of a tied embedding
)
#: Tensor-parallel split dimension of each weight (megatron-core ``ColumnParallelLinear``: 0,
#: ``RowParallelLinear``: 1, ``VocabParallelEmbedding``: 0); the rest is replicated on every rank.
_TP_DIM = ((re.compile(r"(word_embeddings\.weight|output_layer\.weight|linear_qkv\.(weight|bias)|"
                       r"linear_fc1\.(weight|bias))$"), 0), (re.compile(r"(linear_proj|linear_fc2)\.weight$"), 1))


# =========================================================================== unpickling
# =========================================================================== finding the checkpoint
def _tracker_target(folder: Path, iteration: int | None) -> tuple[Path, int | None] | None:
    """The folder ``latest_checkpointed_iteration.txt`` names (an integer or ``release``, Megatron-LM ``read_metadata``)."""
    tracker = folder / TRACKER_FILE
    if iteration is not None:
        return iteration_dir(folder, iteration), iteration
    if not tracker.is_file():
        return None
    text = tracker.read_text().strip()
    if text == "release":
        return folder / "release", None
    return (iteration_dir(folder, int(text)), int(text)) if text.isdigit() else None


def _rank_dirs(folder: Path) -> list[Path]:
    return sorted(p for p in folder.iterdir() if p.is_dir() and p.name.startswith("mp_rank_"))


def find_checkpoint(path: str | os.PathLike, iteration: int | None = None) -> tuple[Path, int | None, str] | None:
    """Recognise a Megatron-LM legacy (``torch`` format) checkpoint, or a ``release`` one.

    Accepts a ``model_optim_rng.pt`` file (one inside ``mp_rank_XX/`` stands for its whole
    iteration folder, all tensor-parallel ranks), an ``iter_NNNNNNN`` / ``release`` folder holding
    ``mp_rank_*/``, or a save folder whose ``latest_checkpointed_iteration.txt`` (or ``iteration``)
    names one; a tracker saying ``release`` also resolves to a torch_dist ``release/`` folder.

    Returns:
        ``(file or folder, iteration or None, "torch" | "torch_dist")``, or None when ``path`` is
        none of these (the series' own layouts: ``helpers.learn.conversion.find_checkpoint`` goes on).

    Raises:
        FileNotFoundError: the tracker (or ``iteration``) names a folder that does not exist.
    """
    p = Path(path).expanduser()
    if p.is_file():
        if p.name != MODEL_FILE:
            return None
        folder = p.parent.parent if p.parent.name.startswith("mp_rank_") else None
        return (folder, iteration_of(folder), "torch") if folder else (p, iteration_of(p.parent), "torch")
    if not p.is_dir():
        return None
    if _rank_dirs(p):
        return p, iteration_of(p), "torch"
    target = _tracker_target(p, iteration)
    if target is None:
        return None
    folder, it = target
    if not folder.is_dir():
        if folder.name == "release" or _rank_dirs(folder.parent):
            raise FileNotFoundError(f"{p}: {TRACKER_FILE} names {folder.name}, which is missing")
        return None
    if _rank_dirs(folder):
        return folder, it, "torch"
    return (folder, it, "torch_dist") if folder.name == "release" and (folder / ".metadata").is_file() else None


# =========================================================================== the architecture
def metadata_from_args(args: argparse.Namespace | Mapping[str, Any], *, old_model: bool = False) -> dict[str, Any]:
    """``ModelConfig.to_metadata()`` of the GPT that Megatron-LM's ``args`` describe, refusing what neither GPT-2
    nor a Llama (:data:`helpers.learn.model.ARCHITECTURES`) can hold.

    A Llama has all of ``--position-embedding-type rope``, ``--normalization RMSNorm``, ``--swiglu``
    and ``--disable-bias-linear``; one of them without the others is neither model.

    Args:
        args: the checkpoint's ``args`` (``argparse.Namespace`` or a dict of its attributes).
        old_model: the weights carry the old model's names (``language_model.*``), whose MLP
            honoured ``openai_gelu``; megatron-core ignores that flag.

    Returns:
        The metadata dict, with ``vocab_size`` = ``padded_vocab_size`` (``args`` do not record the
        tokenizer's size unless ``vocab_size`` was given) and ``vocab_size_range`` = the sizes that
        pad to it (``_vocab_size_with_padding``: a multiple of ``make_vocab_size_divisible_by`` x TP),
        plus ``tensor_model_parallel_size``, ``pipeline_model_parallel_size``, ``tokenizer_dir``
        (the folder of ``vocab_file``, or ``tokenizer_model`` if a folder), ``layer_spec="local"``.

    Raises:
        ConversionError: every argument GPT-2 cannot express, named with its value; a missing
            size argument; sizes ``ModelConfig`` rejects.
    """
    a = dict(args) if isinstance(args, Mapping) else dict(vars(args))
    heads, hidden = a.get("num_attention_heads"), a.get("hidden_size")
    missing = [k for k in ("num_layers", "hidden_size", "num_attention_heads", "seq_length") if a.get(k) is None]
    if missing:
        raise ConversionError(f"the checkpoint's args lack {missing}: pass model_config= (a helpers.learn.model.ModelConfig "
                              "of the trained model; Python only)")
    rope = a.get("position_embedding_type") == "rope" or bool(a.get("use_rotary_position_embeddings"))
    is_llama = (rope and a.get("normalization") == "RMSNorm" and bool(a.get("swiglu"))
                and a.get("add_bias_linear", True) is False)
    refuse = {  # argument: True when its value is one neither GPT-2 nor (for the first group) a Llama can express
        "position_embedding_type": a.get("position_embedding_type", "learned_absolute") != "learned_absolute" and not is_llama,
        "use_rotary_position_embeddings": bool(a.get("use_rotary_position_embeddings")) and not is_llama,
        "normalization": a.get("normalization", "LayerNorm") != "LayerNorm" and not is_llama,
        "swiglu": bool(a.get("swiglu")) and not is_llama,
        "add_bias_linear": a.get("add_bias_linear", True) is False and not is_llama,
        "num_query_groups": (bool(a.get("group_query_attention")) and a.get("num_query_groups") not in (None, heads)
                             and not is_llama),
        "rotary_percent": is_llama and float(a.get("rotary_percent", 1.0)) != 1.0,
        "rotary_interleaved": is_llama and bool(a.get("rotary_interleaved")),
        "use_rope_scaling": is_llama and bool(a.get("use_rope_scaling")),
        "rotary_seq_len_interpolation_factor": a.get("rotary_seq_len_interpolation_factor") not in (None, 1, 1.0),
        "no_rope_freq": a.get("no_rope_freq") is not None, "glu_linear_offset": bool(a.get("glu_linear_offset")),
        "activation_func_clamp_value": a.get("activation_func_clamp_value") is not None,
        "add_qkv_bias": is_llama and bool(a.get("add_qkv_bias")),  # Megatron-LM sets it with add_bias_linear (GPT-2)
        "add_position_embedding": a.get("add_position_embedding", True) is False and not is_llama,
        "squared_relu": bool(a.get("squared_relu")),
        "quick_geglu": bool(a.get("quick_geglu")), "gated_linear_unit": bool(a.get("gated_linear_unit")) and not is_llama,
        "kv_channels": a.get("kv_channels") not in (None, hidden // heads if hidden and heads else None),
        # a mixture of experts is read (a Llama's MLP in each of num_experts experts, to resume or reshard it; the
        # converters to transformers refuse it), but only Megatron-LM's plain one: every layer, no shared expert
        "num_experts": bool(a.get("num_experts")) and not is_llama,
        "moe_layer_freq": bool(a.get("num_experts")) and a.get("moe_layer_freq", 1) not in (None, 1),
        "moe_ffn_hidden_size": bool(a.get("num_experts")) and a.get("moe_ffn_hidden_size") not in (None, a.get("ffn_hidden_size")),
        "moe_shared_expert_intermediate_size": a.get("moe_shared_expert_intermediate_size") is not None,
        "multi_latent_attention": bool(a.get("multi_latent_attention")),
        "qk_layernorm": bool(a.get("qk_layernorm")), "apply_layernorm_1p": bool(a.get("apply_layernorm_1p")),
        "layernorm_zero_centered_gamma": bool(a.get("layernorm_zero_centered_gamma")),
        "apply_residual_connection_post_layernorm": bool(a.get("apply_residual_connection_post_layernorm")),
        "softmax_scale": a.get("softmax_scale") is not None, "mtp_num_layers": bool(a.get("mtp_num_layers")),
        "hybrid_layer_pattern": a.get("hybrid_layer_pattern") is not None,
        "heterogeneous_layers_config_path": a.get("heterogeneous_layers_config_path") is not None,
        # TransformerConfig fields (arguments of the same name) that change the computation but add no tensor
        "window_size": a.get("window_size") is not None, "qk_l2_norm": bool(a.get("qk_l2_norm")),
        "use_mup": bool(a.get("use_mup")), "softmax_type": a.get("softmax_type", "vanilla") not in (None, "vanilla"),
        "attention_output_gate": bool(a.get("attention_output_gate")),
        "enable_mhc_connections": bool(a.get("enable_mhc_connections")),
    }
    bad = [f"{k}={a.get(k)!r}" for k, v in refuse.items() if v]
    if bad:
        raise ConversionError(
            f"the checkpoint's args describe a model neither GPT-2 nor a Llama can represent: {', '.join(bad)} (GPT-2 is "
            "learned absolute positions, LayerNorm with bias, a GELU MLP without gate, biases everywhere, one key/value "
            "head per query head; a Llama is all of rotary positions, RMSNorm, SwiGLU and no biases, "
            "with any number of key/value heads, its output layer tied or not). Convert it with a tool that knows these features.")
    padded = a.get("padded_vocab_size")
    tp = int(a.get("tensor_model_parallel_size") or a.get("model_parallel_size") or 1)  # before 3.0: model_parallel_size
    multiple = int(a.get("make_vocab_size_divisible_by") or 128) * tp
    if padded is None and a.get("vocab_size"):
        padded = -(-int(a["vocab_size"]) // multiple) * multiple
    if padded is None:
        raise ConversionError("the checkpoint's args lack padded_vocab_size (and vocab_size): pass model_config= "
                              "(a helpers.learn.model.ModelConfig of the trained model; Python only)")
    bias_gelu = bool(a.get("bias_gelu_fusion")) and a.get("add_bias_linear", True) is not False
    tanh = not is_llama and (bias_gelu or bool(a.get("use_te_activation_func")) or (old_model and bool(a.get("openai_gelu"))))
    groups = int(a["num_query_groups"]) if is_llama and a.get("group_query_attention") and a.get("num_query_groups") else None
    llama = dict(position_embedding_type="rope", normalization="RMSNorm", swiglu=True, add_bias_linear=False,
                 num_query_groups=groups, rotary_base=int(a.get("rotary_base") or 10000)) if is_llama else {}
    if a.get("num_experts"):
        llama |= {"num_experts": int(a["num_experts"]), "moe_router_topk": int(a.get("moe_router_topk") or 2)}
    try:
        cfg = ModelConfig(
            num_layers=int(a["num_layers"]), hidden_size=int(hidden), num_attention_heads=int(heads),
            seq_length=int(a["seq_length"]), max_position_embeddings=int(a.get("max_position_embeddings") or a["seq_length"]),
            vocab_size=int(padded), ffn_hidden_size=a.get("ffn_hidden_size"),
            make_vocab_size_divisible_by=int(a.get("make_vocab_size_divisible_by") or 128),
            hidden_dropout=float(a.get("hidden_dropout", 0.1)), attention_dropout=float(a.get("attention_dropout", 0.1)),
            init_method_std=float(a.get("init_method_std", 0.02)),
            layernorm_epsilon=float(a.get("layernorm_epsilon", a.get("norm_epsilon", 1e-5))),
            bias_activation_fusion=tanh, share_embeddings_and_output_weights=not a.get("untie_embeddings_and_output_weights"),
            **llama)
    except (TypeError, ValueError) as err:
        raise ConversionError(f"the checkpoint's args do not describe a valid GPT: {err}") from err
    exact = a.get("vocab_size")
    vocab_file, tok_model = a.get("vocab_file"), a.get("tokenizer_model")
    tok_dir = (Path(vocab_file).parent if vocab_file and Path(vocab_file).is_absolute()  # relative: to a training folder unknown here
               else tok_model if tok_model and Path(str(tok_model)).is_absolute() and Path(str(tok_model)).is_dir() else None)
    sizes = [int(exact), int(exact)] if exact else [int(padded) - multiple + 1, int(padded)]
    return {**cfg.to_metadata(tp), "vocab_size_range": sizes, "tensor_model_parallel_size": tp,
            "pipeline_model_parallel_size": int(a.get("pipeline_model_parallel_size") or 1),
            "tokenizer_dir": str(tok_dir) if tok_dir else None, "layer_spec": "local", "written_by": "Megatron-LM"}


# =========================================================================== the weights
def _flatten(tree: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in tree.items():
        if isinstance(value, Mapping):
            out.update(_flatten(value, f"{prefix}{key}."))
        else:
            out[f"{prefix}{key}"] = value
    return out


def qkv_rows_to_current(tensor: torch.Tensor, checkpoint_version: float, num_heads: int) -> torch.Tensor:
    """An old ``query_key_value`` weight ``[3h', h]`` or bias ``[3h']`` in today's per-head ``[heads, 3, head_dim]`` row order.

    ``checkpoint_version`` 0 stored ``[3, heads, head_dim]`` (all q | all k | all v), 1.0
    ``[heads, head_dim, 3]``, 2.0 and later ``[heads, 3, head_dim]`` (megatron-core's
    ``linear_qkv``; unchanged). Megatron-LM ``checkpointing.py`` ``fix_query_key_value_ordering``
    / ``_transpose_first_dim``. ``num_heads`` are the heads in ``tensor`` (per tensor-parallel rank).

    Raises:
        ConversionError: another version, or rows not ``3 x num_heads x head_dim``.
    """
    if checkpoint_version >= 2.0:
        return tensor
    rows, rest = tensor.shape[0], tuple(tensor.shape[1:])
    if rows % (3 * num_heads):
        raise ConversionError(f"query_key_value has {rows} rows, not a multiple of 3 x {num_heads} heads")
    d = rows // (3 * num_heads)
    if checkpoint_version == 0:
        tensor = tensor.reshape(3, num_heads, d, *rest).transpose(0, 1)
    elif checkpoint_version == 1.0:
        tensor = tensor.reshape(num_heads, d, 3, *rest).transpose(1, 2)
    else:
        raise ConversionError(f"checkpoint_version={checkpoint_version} is none Megatron-LM wrote (0, 1.0, or 2.0 and later)")
    return tensor.reshape(rows, *rest).contiguous()


def megatron_core_names(model: Mapping[str, Any], checkpoint_version: float, num_heads: int) -> dict[str, Any]:
    """One rank's ``model`` entry with megatron-core names: nested dicts flattened, :data:`LEGACY_NAMES`
    applied, old QKV orders made current (:func:`qkv_rows_to_current`; ``num_heads`` on this rank).
    Names no rule matches stay as they are (the converter lists them as unknown).

    Returns:
        ``{megatron-core name: value}``, values unchanged but for the old QKV rows.
    """
    out = {}
    for key, value in _flatten(model).items():
        new = key
        for pattern, repl in LEGACY_NAMES:
            new = re.sub(pattern, repl, key)
            if new != key:
                if ".query_key_value." in key and torch.is_tensor(value):
                    value = qkv_rows_to_current(value, checkpoint_version, num_heads)
                break
        out[new] = value
    return out


def merge_tensor_parallel(shards: list[dict[str, Any]], where: str, *, swiglu: bool = False) -> dict[str, Any]:
    """Per-rank state dicts (megatron-core names, rank order) as one TP=1 state dict.

    Column-parallel weights (``linear_qkv``, ``linear_fc1``, word embeddings, output layer;
    each rank holds whole heads, so concatenating ``linear_qkv`` keeps ``[heads, 3, head_dim]``)
    are concatenated along dim 0, row-parallel ones (``linear_proj``, ``linear_fc2`` weights)
    along dim 1; the rest must be equal on every rank. Non-tensors are rank 0's. With ``swiglu`` each
    rank's ``linear_fc1`` is its own ``[gate_r; up_r]`` (megatron-core ``MLP.glu`` chunks the local
    output): the gates are joined, then the ups (Megatron-LM ``tools/checkpoint/loader_mcore.py``).

    Raises:
        ConversionError: ranks with different keys, or a replicated tensor that differs.
    """
    if any(set(s) != set(shards[0]) for s in shards[1:]):
        diff = sorted(set().union(*shards) - set(shards[0]).intersection(*shards))
        raise ConversionError(f"{where}: the tensor-parallel ranks hold different keys ({diff[:8]})")
    out = {}
    for key, first in shards[0].items():
        parts = [s[key] for s in shards]
        dim = next((d for pattern, d in _TP_DIM if pattern.search(key)), None)
        if len(shards) == 1 or not torch.is_tensor(first) or key.endswith("_extra_state"):  # FP8 state differs per rank
            out[key] = first
        elif swiglu and "linear_fc1." in key:
            halves = [p.chunk(2, dim=0) for p in parts]
            out[key] = torch.cat([h[0] for h in halves] + [h[1] for h in halves], dim=0)
        elif dim is not None:
            out[key] = torch.cat(parts, dim)
        elif all(torch.equal(p, first) for p in parts[1:]):
            out[key] = first
        else:
            raise ConversionError(f"{where}: {key} should be the same on every tensor-parallel rank but differs")
    return out


def _args_dict(args: Any) -> dict[str, Any]:
    return {} if args is None else dict(args) if isinstance(args, Mapping) else dict(vars(args))


def _read_torch(path: Path, meta: dict[str, Any] | None, weights_only: bool):
    files = [path] if path.is_file() else [d / MODEL_FILE for d in _rank_dirs(path)]
    if path.is_dir() and any(not re.fullmatch(r"mp_rank_\d\d", f.parent.name) for f in files):
        raise ConversionError(
            f"{path} holds {[f.parent.name for f in files]}: a pipeline- (mp_rank_TT_PPP) or expert-parallel legacy "
            "checkpoint. Re-save it with PP=1 (Megatron-LM tools/checkpoint/convert.py --target-pipeline-parallel-size 1) "
            "or as torch_dist (--ckpt-format torch_dist), which this reader merges whatever the layout")
    lacking = [str(f) for f in files if not f.is_file()]
    if path.is_dir() and files[0].parent.name != "mp_rank_00":
        lacking.insert(0, str(path / "mp_rank_00" / MODEL_FILE))
    if lacking:
        raise ConversionError(f"{path}: {lacking} missing; a torch-format Megatron-LM checkpoint has "
                              f"mp_rank_00/{MODEL_FILE} and one more per tensor-parallel rank: copy the whole iteration folder")
    expected = [f"mp_rank_{i:02d}" for i in range(len(files))]
    if path.is_dir() and [f.parent.name for f in files] != expected:
        raise ConversionError(f"{path} holds {[f.parent.name for f in files]}, not {expected}: a tensor-parallel rank "
                              "is missing; copy every mp_rank_XX folder of the iteration")
    first = safe_load.load_pickle(files[0], weights_only=weights_only)
    if not isinstance(first, Mapping) or not isinstance(first.get("model"), Mapping) or meta is None and "args" not in first:
        found = list(first)[:8] if isinstance(first, Mapping) else type(first).__name__
        raise ConversionError(f"no model_config.json next to {files[0]} and it is no Megatron-LM checkpoint "
                              f"with args and a model (found {found}): pass model_config= (a helpers.learn.model.ModelConfig "
                              "or its to_metadata() dict)")
    args, version = _args_dict(first.get("args")), float(first.get("checkpoint_version", 0))
    tp = int(args.get("tensor_model_parallel_size") or args.get("model_parallel_size") or len(files))
    if tp != len(files):
        raise ConversionError(f"{path}: args say tensor_model_parallel_size={tp} but {len(files)} rank file(s) "
                              f"were found: copy every mp_rank_XX folder of the iteration")
    old = any(str(k).startswith("language_model") for k in first["model"])  # the old model (nested or flat names)
    meta = meta if meta is not None else metadata_from_args(args, old_model=old)  # refuses before the other ranks are read
    shards = [megatron_core_names((first if i == 0 else safe_load.load_pickle(f, weights_only=weights_only))["model"], version,
                                  int(meta["num_attention_heads"]) // tp) for i, f in enumerate(files)]
    non_model = sorted(k for k in first if k not in _DESCRIPTIVE)
    return (merge_tensor_parallel(shards, str(path), swiglu=bool(meta.get("swiglu"))), meta, first.get("iteration"),
            non_model, version)


def read_common_state(folder: str | os.PathLike, *, weights_only: bool = True) -> dict[str, Any]:
    """The non-tensor entries of a torch_dist checkpoint (``args``, ``checkpoint_version``, ``iteration``...).

    ``common.pt`` when present (megatron-core <= 0.18, ``strategies/common.py``), else the
    ``common_state`` object in the ``.distcp`` files (0.19, ``serialization.py``
    ``load_common_state_dict``), read as bytes and unpickled by :func:`load_pickle` (torch's own
    planner would unpickle it with ``weights_only=False``).

    Raises:
        ConversionError: no common state, or what :func:`load_pickle` raises.
    """
    folder = Path(folder)
    if (folder / COMMON_FILE).is_file():
        return safe_load.load_pickle(folder / COMMON_FILE, weights_only=weights_only)
    from megatron.core.dist_checkpointing.mapping import ShardedObject
    from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner

    class _BytesPlanner(DefaultLoadPlanner):
        def load_bytes(self, read_item, value):  # keep the bytes (in the requested BytesIO); load_pickle unpickles
            self.state_dict[read_item.dest_index.fqn].write(value.read())

    key = ShardedObject("common_state", None, (1,), (0,)).unique_key
    request = {key: io.BytesIO()}
    safe_load.dcp_load(request, folder, weights_only, planner=_BytesPlanner(flatten_state_dict=False))
    loaded = safe_load.load_pickle(request[key], weights_only=weights_only)
    return loaded[0] if isinstance(loaded, (list, tuple)) else loaded


def read_torch_dist_tensors(folder: str | os.PathLike, *, weights_only: bool = True) -> tuple[dict[str, torch.Tensor], list[str]]:
    """GPTModel's tensors of a torch_dist folder at their global shapes, per layer (``decoder.layers.{i}.*``).

    Reads through ``torch.distributed.checkpoint`` directly (tensors are loaded with
    ``weights_only=True``; the ``.metadata`` pickle, which torch reads with plain ``pickle``, with
    :class:`_RestrictedMetadataUnpickler` unless ``weights_only=False``; megatron-core's
    ``dist_checkpointing.load`` would unpickle both without restriction). Any tensor-parallel
    size: each request is a whole tensor.

    Returns:
        ``(tensors, non_model_keys)``; ``decoder.layers.X`` ``[layers, ...]`` split into layers.
    """
    from torch.distributed.checkpoint import TensorStorageMetadata

    folder = Path(folder)
    stored = safe_load.dcp_reader(folder, weights_only).read_metadata().state_dict_metadata
    want = {k: torch.empty(tuple(m.size), dtype=m.properties.dtype) for k, m in stored.items()
            if isinstance(m, TensorStorageMetadata) and k.startswith(_MODEL_KEY_PREFIXES)}
    safe_load.dcp_load(want, folder, weights_only)
    out: dict[str, torch.Tensor] = {}
    for key, tensor in want.items():
        if key.startswith("decoder.layers.") and not re.match(r"^decoder\.layers\.\d+\.", key):
            out.update({f"decoder.layers.{i}.{key[len('decoder.layers.'):]}": tensor[i].clone() for i in range(tensor.shape[0])})
        else:
            out[key] = tensor
    return out, sorted(set(stored) - set(want))


def read_checkpoint(path: str | os.PathLike, fmt: str, meta: Mapping[str, Any] | None = None, *,
                    weights_only: bool = True) -> tuple[dict[str, Any], dict[str, Any], int | None, str, list[str]]:
    """A Megatron-LM checkpoint as megatron-core weights (TP=1 layout) and the series' model metadata.

    Args:
        path: what :func:`find_checkpoint` (or ``helpers.learn.conversion.find_checkpoint``) resolved: a
            ``model_optim_rng.pt`` file, an iteration folder with ``mp_rank_XX/`` (``fmt="torch"``),
            a torch_dist folder (``"torch_dist"``), or any ``.pt`` holding Megatron-LM's dict (``"state_dict"``).
        meta: a ``ModelConfig.to_metadata()`` dict to use instead of the args (e.g. checkpoints without args).
        weights_only: see :func:`load_pickle`.

    Returns:
        ``(state_dict, meta, iteration, fmt, non_model_keys)``: names as ``GPTModel.state_dict()``
        (local or Transformer Engine spec, ``_extra_state`` entries included), tensors at their
        global shape and saved dtype (fp16/bf16/fp32), word embeddings ``[padded_vocab_size, h]``;
        ``meta`` from :func:`metadata_from_args` with ``iteration`` and ``checkpoint_version``.

    Raises:
        ConversionError: an architecture GPT-2 cannot hold (named from the args, before tensors
            are read where the format allows), a missing ``mp_rank_00`` file, pipeline parallelism,
            a rank count that differs from ``tensor_model_parallel_size``, no args and no ``meta``,
            a ``weights_only`` refusal (:func:`load_pickle`).
    """
    path = Path(path)
    meta = dict(meta) if meta is not None else None
    if fmt != "torch_dist":
        tensors, meta, iteration, non_model, version = _read_torch(path, meta, weights_only)
        return tensors, {**meta, "iteration": iteration, "checkpoint_version": version}, iteration, "torch", non_model
    common = read_common_state(path, weights_only=weights_only)
    if meta is None and common.get("args") is None:
        raise ConversionError(f"no model_config.json next to {path} and its common state holds no "
                              "Megatron-LM args: pass model_config= (a helpers.learn.model.ModelConfig of the trained model)")
    meta = meta if meta is not None else metadata_from_args(_args_dict(common["args"]))
    tensors, non_model = read_torch_dist_tensors(path, weights_only=weights_only)
    iteration, version = common.get("iteration"), common.get("checkpoint_version", 3.0)
    return tensors, {**meta, "iteration": iteration, "checkpoint_version": version}, iteration, fmt, non_model
