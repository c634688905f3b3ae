"""Notebook-specific demonstrations: measurements, simulations, drawings and proofs.

The learner's path through the series (corpus -> tokenizer -> ``.bin/.idx`` -> ``GPTDataset``
-> ``GPTModel`` -> training -> checkpoint -> conversion) lives in ``helpers/`` itself; these
modules are what one notebook uses to *show* something about it, and nothing on that path
imports them. Each module names the notebook and section it serves.
"""
