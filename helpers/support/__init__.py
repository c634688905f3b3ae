"""What the learner's package, the runner and the demonstrations stand on; imports none of them.

* ``cpu_compat``: the shims that let megatron-core and ``megatron.training`` run on a CPU over
  gloo, each naming the megatron-core line it works around (03 §4 shows the one a CPU needs).
* ``quiet``: which routine megatron-core and torch messages a learner does not see (00 §4 lists them).
* ``run_guard``: a job stops with its launcher, one job per run folder, a read-only or too-full
  folder refused with the fix.
* ``safe_load`` (06 §10): reading Megatron-LM's pickles and torch_dist metadata without running
  code from them.
* ``results``: a run's ``summary.json``, its figures and the one table formatter.
* ``environment`` (00 §2, §4, §5): what this machine has (Apex, Transformer Engine, CUDA, gloo) and the
  NGC container command.
"""
