"""Helpers for the megatron-core GPT notebook series, in three kinds.

**The learner's path** (what the notebooks teach, in reading order; each module a sitting):
``corpus`` (CodeParrot's cleaning; ``hub_datasets``: a 🤗 dataset as the source) -> ``tokenizer`` (byte-level BPE) -> ``preprocess``
(``.bin/.idx`` with ``IndexedDatasetBuilder``) -> ``dataloader`` (``GPTDatasetConfig`` +
``BlendedMegatronDatasetBuilder``) -> ``model`` (``TransformerConfig``, ``GPTModel``,
``attention``; ``memory``: bytes per GPU) -> ``distributed`` (process groups) -> ``optimizer`` (AdamW, the schedule)
-> ``core_loop`` (notebook 03's loop, call by call) -> ``training_config`` + ``megatron_args`` (a run as
Megatron-LM's flags) + ``pretrain_gpt`` (Megatron-LM's ``pretrain_gpt.py``: its own training loop) -> ``checkpointing``
(``dist_checkpointing``) -> ``conversion`` (megatron-core <-> GPT-2 weight map; ``megatron_lm``:
checkpoints Megatron-LM wrote itself) -> ``evaluation``
(bits per byte against gzip, sampling, syntax validity, pass@k).

**Demonstrations** (``helpers.demos``): what one notebook uses to *show* something (timings,
simulations, drawings, proofs); each module names its notebook and nothing above imports them.

**Plumbing**: ``series`` (the papermill runner and the stage order), ``parameters`` (profiles and
``-p`` overrides of the notebooks' parameters), ``data_stage`` (notebook 01's
cached stage), ``preflight`` (epochs, memory and time of a run before it starts), ``launch``
(torchrun from a notebook; Megatron-LM's loop for a config), ``run_guard`` (a job stops with its launcher;
one job per run folder; a read-only or too-full folder refused), ``metrics`` (what Megatron-LM's loop logged), ``encoders`` (fast tokenizing), ``results``, ``report`` (the report card), ``environment``,
``cpu_compat`` (megatron-core and megatron.training on a CPU), ``quiet``.

Import modules explicitly, e.g. ``from helpers import corpus, results``. Nothing here
imports megatron-core or torch at package import time, so ``import helpers`` is instant.

Importing the package applies :func:`helpers.quiet.apply`, the series' one decision on which
routine megatron-core and torch messages to hide (each listed with its source and meaning in
``helpers/quiet.py``). Every notebook and every torchrun entry point (``-m helpers.pretrain_gpt``)
imports ``helpers`` before megatron-core, so the decision holds in every process.
"""

from helpers import quiet as _quiet

_quiet.apply()

__version__ = "0.1.0"
