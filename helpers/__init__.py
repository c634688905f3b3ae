"""Helpers for the megatron-core GPT notebook series, in four folders by who reads them.

* ``helpers.learn``, **the learner's package**: what the notebooks teach, in reading order
  (corpus -> tokenizer -> ``.bin/.idx`` -> ``GPTDataset`` -> ``GPTModel`` -> Megatron-LM's
  training loop -> checkpoint -> transformers -> evaluation). Read it beside the notebooks.
* ``helpers.demos``, **the demonstrations**: what one notebook section uses to *show* something
  (timings, simulations, drawings, proofs); each names its notebook and section.
* ``helpers.runner``, **the runner**: what runs the series and the workshop (papermill, the
  parameters, torchrun from a notebook, the preflight, the report card, the book).
* ``helpers.support``, **what the others stand on**: megatron-core's CPU shims, the warning
  filters, the run folder's guards, results files, the environment's detection.

What each folder may import (``tests/test_house.py`` checks it): ``support`` nothing of the
others; ``learn`` only ``support``; ``runner`` ``learn`` and ``support``; ``demos`` all three.
So the learner's package never needs the runner or a demonstration.
Import modules explicitly, e.g. ``from helpers.learn import corpus``. Nothing here imports
megatron-core or torch at package import time, so ``import helpers`` is instant.

Importing the package applies :func:`helpers.support.quiet.apply`, the series' one decision on which
routine megatron-core and torch messages to hide (each listed with its source and meaning in
``helpers/support/quiet.py``). Every notebook and every torchrun entry point (``-m helpers.learn.pretrain_gpt``)
imports ``helpers`` before megatron-core, so the decision holds in every process.
"""

from helpers.support import quiet as _quiet

_quiet.apply()

__version__ = "0.1.0"
