"""The learner's package: what the notebooks teach, one module per step, in reading order.

Each module implements one step of the CodeParrot recipe with megatron-core or Megatron-LM and
names the Megatron-LM file or paper it follows; it imports only its neighbours here and
``helpers.support``. Read it in about an hour, beside the notebooks:

* ``corpus`` (01 §1, §3-4, §7; 02 §9; 07 §1): Python files found on this machine, cleaned and deduplicated the way
  CodeParrot cleaned GitHub code, written as loose JSON; ``hub_datasets`` (01 §7): a 🤗 dataset
  as the source instead.
* ``tokenizer`` (01 §3): the byte-level BPE tokenizer; ``encoders`` (01 §7): its two engines
  for the whole corpus.
* ``preprocess`` (01 §4, §7; read back in 02, 03 and 07): ``.bin/.idx`` with megatron-core's
  ``IndexedDatasetBuilder``, the split of its documents, and a damaged pair named.
* ``dataloader`` (02; 01 §2, 06 §13, 07 §2): ``GPTDatasetConfig`` and ``BlendedMegatronDatasetBuilder``.
* ``model`` (03 §3, 05): ``TransformerConfig`` and ``GPTModel``, GPT-2's blocks or a Llama's; ``attention`` (04 §9): core
  attention; ``memory`` (05 §5, 05b): bytes per GPU, the series' calculator.
* ``distributed`` (02 §9, 04 §11): process groups in one process; ``optimizer`` (03 §7, 04 §7):
  AdamW and the schedule.
* ``training_config`` (03 §1-2, 04, 05, 05b, 07): what one run is; ``pretrain_gpt`` (03 §6, 05 §4): Megatron-LM's
  ``pretrain_gpt.py``, its own training loop; ``rank_record`` (05b): what each rank of it held in memory
  (the tensors saved for backward, by saved-tensor hooks) and when it ran each micro-batch.
* ``checkpointing`` (03 §8, 05 §8, 06, 07): ``dist_checkpointing`` checkpoints; ``megatron_lm``
  (03 §8, 06 §10): reading checkpoints Megatron-LM wrote itself (torch_dist and legacy; the files
  are unpickled by ``helpers.support.safe_load``).
* ``conversion`` (06): megatron-core <-> transformers GPT-2, one weight map both ways.
  ``llama``: the same for the Llama-style model (RoPE, RMSNorm, SwiGLU, grouped-query attention)
  <-> ``LlamaForCausalLM``; ``weight_names``: the layer templates and key accounting both maps use.
* ``evaluation`` (07): bits per byte against gzip, sampling, syntax validity, pass@k.
"""
