"""The learner's package: what the notebooks teach, one module per step, in reading order.

Each module implements one step of the CodeParrot recipe with megatron-core or Megatron-LM and
names the Megatron-LM file or paper it follows; it imports only its neighbours here and
``helpers.support``. Read it in about an hour, beside the notebooks:

* ``corpus`` (01 §1-2, §7): Python files found on this machine, cleaned and deduplicated the way
  CodeParrot cleaned GitHub code, written as loose JSON; ``hub_datasets`` (01 §7): a 🤗 dataset
  as the source instead.
* ``tokenizer`` (01 §3): the byte-level BPE tokenizer; ``encoders`` (01 §7): its two engines
  for the whole corpus.
* ``preprocess`` (01 §4-6): ``.bin/.idx`` with megatron-core's ``IndexedDatasetBuilder``.
* ``dataloader`` (02): ``GPTDatasetConfig`` and ``BlendedMegatronDatasetBuilder``.
* ``model`` (03 §3, 05): ``TransformerConfig`` and ``GPTModel``; ``attention`` (04 §9): core
  attention; ``memory`` (05 §5): bytes per GPU, the series' calculator.
* ``distributed`` (02, 03 §5.2): process groups; ``optimizer`` (03 §5.6, 04 §7): AdamW and the schedule.
* ``training_config`` (03 §1-2): what one run is; ``pretrain_gpt`` (03 §6, 05 §4): Megatron-LM's
  ``pretrain_gpt.py``, its own training loop.
* ``checkpointing`` (03 §8, 05 §8, 06 §1): ``dist_checkpointing`` checkpoints; ``megatron_lm``
  (06 §10): reading checkpoints Megatron-LM wrote itself (torch_dist and legacy).
* ``conversion`` (06): megatron-core <-> transformers GPT-2, one weight map both ways.
* ``evaluation`` (07): bits per byte against gzip, sampling, syntax validity, pass@k.
"""
