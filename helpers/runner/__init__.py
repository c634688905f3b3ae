"""The runner: what runs the series, its notebooks' launches and the workshop tools; ``helpers.learn`` never imports it.

* ``data_stage`` (01 §1, §3-4): notebook 01's data stage in one cached call; ``data_paths`` reads it back (02-07).
* ``series`` (``make tutorial``): papermill runs the notebooks into one run folder, in stage order.
* ``parameters``: the profiles and ``-p`` overrides of the notebooks' parameters cells.
* ``megatron_args`` (03 §6, 04 §10, 05 §6): a configuration as Megatron-LM's flags, beside the guide's 2022 flags.
* ``launch`` (00 §5, 03 §6, 05, 06): torchrun from a notebook; ``launch.train``: Megatron-LM's loop for one config.
* ``preflight`` (03 §6.3, §9): every check of a run before it starts, and its epochs, memory, disk and time.
* ``metrics`` (03 §7, 07 §2, §4): what Megatron-LM's loop logged, read back.
* ``readiness`` (``make check``, 00); ``report`` (a run's report card); ``book`` (``make book``: a static site).
* ``widget_text``: progress bars as their final text; ``timings``: the recorded cpu run behind every stated time.
* ``run_pack`` (``make pack`` / ``make unpack``): a finished run folder as one archive.
"""
