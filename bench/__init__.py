"""Benchmarks of the series against its references (not part of the test suite).

Run from the repository root, one command per benchmark (see ``bench/README.md``)::

    python -m bench.preprocess --megatron-lm /path/to/Megatron-LM --megatron-python /path/to/python3.12
    python -m bench.training
    python -m bench.series --run-dir runs/latest
"""
