"""Helpers for the megatron-core GPT notebook series, in four folders by who reads them.

* ``helpers.learn``, **the learner's package**: what the notebooks teach, in reading order.
* ``helpers.demos``, **the demonstrations**: what one notebook section uses to *show* something.
* ``helpers.runner``, **the runner**: papermill, parameters, torchrun from a notebook, the report card.
* ``helpers.support``, **what the others stand on**: CPU shims, warning filters, run-folder guards.

Imports (``tests/test_house.py`` checks them): ``support`` none of the others, ``learn`` only
``support``, ``runner`` both, ``demos`` all three. Import modules explicitly (``from helpers.learn
import corpus``); ``import helpers`` loads neither torch nor megatron-core. It applies
:func:`helpers.support.quiet.apply`, so every notebook and torchrun process hides the same messages.
"""

from helpers.support import quiet as _quiet

_quiet.apply()

__version__ = "0.1.0"
