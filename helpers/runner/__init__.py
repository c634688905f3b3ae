"""The runner: what runs the series, its notebooks' launches and the workshop tools.

A learner reads it only to see how the series is run; nothing in ``helpers.learn`` imports it.

* ``data_stage`` (01 §1, §3-4): notebook 01's stage in one cached call (``stop_after=``: one step at
  a time): the learner's ``corpus`` -> ``tokenizer`` -> ``preprocess``, with the run folder's manifest;
  ``data_stage.data_paths`` reads back where it put them (02-07).
* ``series`` (``make tutorial``): papermill runs the notebooks into one run folder, in stage
  order; ``parameters``: profiles and ``-p`` overrides of the notebooks' parameters cells.
* ``megatron_args`` (03 §6, 04 §10, 05 §6): a run's configuration as Megatron-LM's flags, each beside the
  guide's 2022 flag; ``launch`` (00 §5, 03 §6, 05, 06): torchrun from a notebook (timeout, failing
  rank, progress bar) and ``launch.train``, Megatron-LM's loop for one configuration;
  ``preflight`` (03 §6.3, §9): every check of a run in one pass before it starts (the configuration,
  the folders, the checkpoint to resume, a finished run's settings) and its epochs, memory, disk and time;
  ``metrics`` (03 §7, 07 §2, §4): what Megatron-LM's loop logged, read back.
* ``readiness`` (``make check``, 00): is this machine ready; ``report`` (the report card of a
  run); ``book`` (``make book``: the executed notebooks as a static site); ``widget_text`` (a notebook's
  progress bars kept as the text of their final state, for JupyterLab and the book).
* ``timings``: the recorded cpu run (``data/measured_cpu_run.json``) behind every time the series states:
  the runner's time left, ``make check``'s and the preflight's estimates, the instructor guide's tables.
* ``run_pack`` (``make pack`` / ``make unpack``): a finished run folder as one archive, unpacked into
  another clone whose notebooks then skip the training.
"""
