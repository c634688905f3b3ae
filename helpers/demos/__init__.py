"""Notebook-specific demonstrations: what one notebook section uses to *show* a point; ``helpers.learn`` never imports them.

* 01-02: ``preprocessing`` (the data stage checked), ``dataset_indices`` (01 §5, 02 §3-8: the indices drawn).
* 03: ``core_loop`` (notebook 03's loop as functions), ``training_curves`` (03 §7-8), ``generation`` (03 §9, 06 §9).
* 04: ``timing``, ``roofline``, ``fused_ops``, ``model_fusions``, ``adamw`` (fused kernels and fused AdamW measured).
* 05: ``rank_groups``, ``launch_plans``, ``layout_runs``, ``shards``, ``memory_plot``, ``pipeline_schedule``.
* 05b: ``memory_toolbox`` (the memory savers trained, measured per rank beside the predictions).
* 06-07: ``conversion_proofs``, ``conversion_way_back``, ``tensor_parallel_run``, ``megatron_lm_layout`` (the
  conversion proven exact), ``evaluation_curve`` (07's curve).
"""
