"""The learner's package: what the notebooks teach, one module per step, in reading order.

* ``corpus``, ``hub_datasets`` (01): the code corpus; ``tokenizer``, ``encoders`` (01 §3, §7): BPE.
* ``preprocess`` (01 §4): ``.bin/.idx``; ``dataloader`` (02): ``GPTDataset``.
* ``model`` (03 §3, 05), ``attention`` (04 §9), ``memory`` (05 §5, 05b): ``GPTModel`` and its bytes.
* ``distributed`` (02 §9, 04 §11), ``optimizer`` (03 §7): process groups, AdamW and the schedule.
* ``training_config``, ``pretrain_gpt`` (03 §6), ``rank_record`` (05b): a run of Megatron-LM's loop.
* ``checkpointing`` (03 §8, 06), ``megatron_lm`` (06 §10): checkpoints, ours and Megatron-LM's.
* ``conversion``, ``llama``, ``weight_names`` (06): megatron-core <-> transformers weight maps.
* ``evaluation`` (07): bits per byte against gzip, sampling, syntax validity, pass@k.

Each module names the Megatron-LM file or paper it follows; it imports its neighbours and ``helpers.support``.
"""
