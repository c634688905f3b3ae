"""Helpers for the megatron-core GPT notebook series: one small module per stage.

Import modules explicitly, e.g. ``from helpers import corpus, results``. Nothing here
imports megatron-core or torch at package import time, so ``import helpers`` is instant.
"""

__version__ = "0.1.0"
