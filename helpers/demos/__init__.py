"""Notebook-specific demonstrations: measurements, simulations, drawings and proofs.

The learner's package (``helpers.learn``) is what the notebooks teach; these modules are what one
notebook section uses to *show* something about it, and nothing in the learner's package imports
them. Each module's docstring names the notebook and section it serves:

* 01-02: ``preprocessing`` (the steps of the data stage timed), ``dataset_indices`` (01 §5, 02 §3-8: megatron-core's
  document, sample and shuffle indices drawn).
* 03-04: ``core_loop`` (notebook 03's loop, call by call, for 04's timers, the tests and
  ``bench.training``), ``training_curves`` (03 §7-8: loss, learning rate and throughput as logged, a
  kill and resume), ``generation`` (03 §9, 06 §9: greedy samples), ``timing``, ``roofline``, ``fused_ops``,
  ``model_fusions``, ``adamw`` (04's measurements of fused kernels and fused AdamW).
* 05: ``rank_groups``, ``launch_plans``, ``layout_runs``, ``shards``, ``memory``, ``pipeline_schedule``
  (tensor, pipeline and data parallelism: the groups, the runs, the shards, the memory, the schedule).
* 05b: ``memory_toolbox`` (the memory savers trained, measured per rank beside the predictions; the
  pipeline schedules as they ran).
* 06-07: ``conversion_proofs``, ``conversion_way_back``, ``tensor_parallel_run``,
  ``megatron_lm_layout`` (the conversion proven exact; ``conversion_proofs.validation_loss`` also
  in 07 §2), ``evaluation_curve`` (07's curve).
"""
