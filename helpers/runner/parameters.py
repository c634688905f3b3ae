"""What each notebook of the series gets as parameters: profiles, ``-p`` overrides, type checks.

papermill injects a notebook's parameters after its ``parameters`` cell; the series runner
(:mod:`helpers.runner.series`) resolves them here first, so a misspelt name or a wrong type is an error
before anything runs (papermill itself only warns). A profile maps notebook stems (or ``"all"``,
for every notebook that has the parameter) to values; a notebook's own defaults are the ``cpu``
profile. ``-p name=value`` goes to every notebook that defines ``name``; ``-p NN_stem.name=value``
to one.
"""

from __future__ import annotations

import ast
import math
from pathlib import Path
from typing import Any

#: Parameters the runner itself passes to every notebook (each notebook must define them).
RUNNER_PARAMETERS = ("run_dir", "profile")

#: Profiles: {profile: {notebook stem or "all": {parameter: value}}}. The notebooks' own
#: defaults are the `cpu` profile, so it is empty. `smoke` is what the test suite runs.
PROFILES: dict[str, dict[str, dict[str, Any]]] = {
    "cpu": {},
    # about 40 minutes on 2 cores (2,399 s measured; notebook 03 2,001 s): notebook 03 trains the
    # same model 12x longer (about one epoch of the corpus), notebook 07 scores each checkpoint
    "cpu-long": {
        "03_training": {"train_iters": 12000, "lr_warmup_iters": 500, "eval_interval": 1000, "save_interval": 2000,
                        "log_interval": 100, "timeout_s": 5400},
    },
    # one GPU, the guide's 110M model (helpers.learn.training_config.PROFILES["gpu"]) on a corpus of every
    # package's files (up to 1,000 each) so that 197M training tokens repeat it a few times, not thousands
    "gpu": {
        "01_data_preprocessing": {"vocab_size": 32768, "package_files": 1000},
        "02_data_loader": {"seq_length": 1024, "global_batch_size": 64},
        "03_training": {  # the guide's GPT-2 (the cpu profile's Llama was chosen for a CPU's few minutes)
            "architecture": "gpt2", "num_layers": 12, "hidden_size": 768, "num_attention_heads": 12, "seq_length": 1024, "dropout": 0.1,
            "micro_batch_size": 32, "global_batch_size": 64, "train_iters": 3000, "lr": 6e-4, "min_lr": 6e-5,
            "lr_warmup_iters": 300, "log_interval": 50, "eval_interval": 500, "eval_iters": 10, "save_interval": 1000,
            "timeout_s": 7200,
        },
    },
    "codeparrot-small": {
        "01_data_preprocessing": {"vocab_size": 32768},
        "02_data_loader": {"seq_length": 1024, "global_batch_size": 192},
        "03_training": {  # the guide's exact hyperparameters (shared/notes/reference-recipe.md)
            "architecture": "gpt2", "num_layers": 12, "hidden_size": 768, "num_attention_heads": 12, "seq_length": 1024,
            "dropout": 0.1, "micro_batch_size": 12, "global_batch_size": 192, "train_iters": 150000,
            "lr": 5e-4, "min_lr": 0.0, "lr_warmup_iters": 2000, "log_interval": 10,
            "eval_interval": 200, "eval_iters": 10, "save_interval": 2000, "timeout_s": 172800,
        },
    },
    "smoke": {
        "00_container_setup": {"run_allreduce": True},
        "01_data_preprocessing": {"max_files": 150, "vocab_size": 1024, "split": "90,8,2"},
        "02_data_loader": {"seq_length": 64, "train_iters": 20, "blend_max_files": 60},
        "03_training": {"num_layers": 2, "hidden_size": 64, "num_attention_heads": 4, "seq_length": 64,
                        "micro_batch_size": 4, "global_batch_size": 8, "train_iters": 12, "lr_warmup_iters": 2,
                        "log_interval": 2, "eval_interval": 6, "eval_iters": 2, "save_interval": 6,
                        "sample_tokens": 8, "timeout_s": 300},
        "04_fused_kernels": {"micro_batch_size": 2, "num_threads": 1, "warmup": 1, "repeats": 5, "copy_mib": 32,
                             "matmul_n": 256, "adamw_check_steps": 3, "adamw_repeats": 5,
                             "step_micro_batch_size": 1, "step_repeats": 3},
        "05_parallelism": {"num_layers": 2, "hidden_size": 64, "num_attention_heads": 4, "seq_length": 64,
                           "micro_batch_size": 4, "global_batch_size": 8, "train_iters": 3, "timeout_s": 300,
                           "run_pp_own_init": False},
        "05b_memory_toolbox": {"hidden_size": 64, "num_attention_heads": 4, "seq_length": 64, "train_iters": 4,
                               "timeout_s": 300},
        "06_conversion": {"max_new_tokens": 8, "continue_iters": 2},
        "07_evaluation": {"valid_max_documents": 4, "valid_max_chars": 1500, "heldout_max_files": 2, "heldout_max_chars": 1500,
                          "num_samples": 2, "max_new_tokens": 16, "num_candidates": 2, "pass_k": 2, "candidate_tokens": 16,
                          "check_timeout_s": 1.0},
    },
}

class ParameterError(ValueError):
    """A parameter override names no notebook parameter, or has the wrong type."""


def notebook_parameters(path: Path) -> dict[str, dict[str, Any]]:
    """The parameters of a notebook's ``parameters`` cell, as papermill reads them.

    Returns:
        ``{name: {"default": str, "inferred_type_name": str, "help": str}}``.
    """
    import papermill

    return {name: dict(info) for name, info in papermill.inspect_notebook(str(path)).items()}


def parse_override(text: str) -> tuple[str, Any]:
    """``"train_iters=500"`` -> ``("train_iters", 500)``; values are Python literals or strings.
    A bare comma-separated value stays a string (``split=969,30,1`` -> ``"969,30,1"``).

    Raises:
        ParameterError: no ``=`` in ``text``, or nothing before it.
    """
    if "=" not in text:
        raise ParameterError(f"-p {text!r}: write overrides as name=value, e.g. -p train_iters=500")
    name, raw = text.split("=", 1)
    if not name.strip():
        raise ParameterError(f"-p {text!r}: the name before '=' is empty; write name=value, e.g. -p train_iters=500")
    try:
        value = ast.literal_eval(raw)
    except (ValueError, SyntaxError):
        value = raw
    if isinstance(value, tuple) and not raw.strip().startswith("("):
        value = raw  # split=969,30,1 is Megatron's split string, not the tuple (969, 30, 1)
    return name.strip(), value


_TYPE_CHECK = {"int": (int,), "float": (int, float), "str": (str,), "bool": (bool,)}


def _check_type(stem: str, name: str, value: Any, info: dict[str, Any]) -> Any:
    type_name = (info.get("inferred_type_name") or "None").split("[")[0]
    allowed = _TYPE_CHECK.get(type_name)
    if allowed is None or value is None:
        return value
    if type_name in ("int", "float") and isinstance(value, bool):
        allowed = ()
    if not isinstance(value, allowed):
        raise ParameterError(
            f"{stem}.{name} must be {type_name} (default {info.get('default')}), got {value!r}"
        )
    if type_name == "float" and not math.isfinite(value):
        raise ParameterError(f"{stem}.{name}={value!r} is not a finite number (1e400 reads as inf): "
                             f"give a value like the default, {info.get('default')}")
    return float(value) if type_name == "float" else value


def resolve_parameters(
    selected: list[Path],
    profile: str,
    overrides: dict[str, Any] | None = None,
    *,
    run_dir: str | None = None,
) -> dict[str, dict[str, Any]]:
    """The parameters papermill passes to each selected notebook.

    Args:
        selected: notebook paths, in order.
        overrides: ``{"name": value}`` (to every notebook defining it) or
            ``{"NN_stem.name": value}`` (to that notebook only).

    Returns:
        ``{stem: {parameter: value}}``.

    Raises:
        ParameterError: unknown profile, unknown parameter name (the message lists the valid
            ones), a wrong value type, or a notebook missing the runner's own parameters.
    """
    if profile not in PROFILES:
        raise ParameterError(f"profile {profile!r} is unknown: choose one of {sorted(PROFILES)}")
    declared = {p.stem: notebook_parameters(p) for p in selected}
    for stem, params in declared.items():
        missing = [n for n in RUNNER_PARAMETERS if n not in params]
        if missing:
            raise ParameterError(f"notebook {stem} has no parameter(s) {missing} in its parameters cell")
    resolved: dict[str, dict[str, Any]] = {stem: {"profile": profile} for stem in declared}
    if run_dir is not None:
        for stem in resolved:
            resolved[stem]["run_dir"] = run_dir

    def apply(key: str, value: Any, source: str, strict: bool) -> None:
        if "." in key:
            stem, name = key.split(".", 1)
            if stem not in declared:
                if strict:
                    raise ParameterError(f"{source} {key!r}: no selected notebook {stem!r}; selected: {sorted(declared)}")
                return
            targets = [stem]
        else:
            name = key
            targets = [s for s, params in declared.items() if name in params]
        valid = [s for s in targets if name in declared[s]]
        if not valid:
            if not strict:
                return
            scope = [targets[0]] if "." in key else list(declared)  # NN_stem.name: that notebook's names only
            names = sorted({n for stem in scope for n in declared[stem]} - set(RUNNER_PARAMETERS))
            raise ParameterError(
                f"{source} {key!r} is not a parameter of "
                + (f"{targets[0]}" if "." in key else "any selected notebook")
                + f". Valid names: {', '.join(names)}"
            )
        for stem in valid:
            resolved[stem][name] = _check_type(stem, name, value, declared[stem][name])

    for section, values in PROFILES[profile].items():
        for name, value in values.items():
            key = name if section == "all" else f"{section}.{name}"
            apply(key, value, f"profile {profile}:", strict=False)
    for key, value in (overrides or {}).items():
        apply(key, value, "-p", strict=True)
    return resolved
