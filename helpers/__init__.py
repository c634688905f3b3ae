"""Helpers for the megatron-core GPT notebook series: one small module per stage.

Import modules explicitly, e.g. ``from helpers import corpus, results``. Nothing here
imports megatron-core or torch at package import time, so ``import helpers`` is instant.

Importing the package applies :func:`helpers.quiet.apply`, the series' one decision on which
routine megatron-core and torch messages to hide (each listed with its source and meaning in
``helpers/quiet.py``). Every notebook and every torchrun entry point (``-m helpers.training``)
imports ``helpers`` before megatron-core, so the decision holds in every process.
"""

from helpers import quiet as _quiet

_quiet.apply()

__version__ = "0.1.0"
