"""Greedy decoding on both sides: megatron-core's ``GPTModel`` and transformers' ``GPT2LMHeadModel``.

Notebook 03 section 9 samples text from the trained checkpoint with :func:`greedy_generate`;
notebook 06 section 9 shows it gives the same tokens as transformers' ``generate(do_sample=False)``
(:func:`greedy_generate_hf`). megatron-core itself has no ``generate``.
"""

from __future__ import annotations

from typing import Sequence

import torch


def greedy_generate(gpt, prompt_ids: list[int], max_new_tokens: int = 32, eod_id: int | None = None,
                    repetition_penalty: float = 1.0, *, vocab_size: int | None = None) -> list[int]:
    """Greedy decoding with a (TP=1, single-stage) GPTModel: append the argmax token each step.

    No KV cache: the whole (cropped) context is recomputed per token; megatron-core has no ``generate``.
    Padded vocabulary rows (ids >= the tokenizer's size) are never chosen, as in Megatron's inference.
    Within the position table and with ``repetition_penalty=1.0`` this is transformers'
    ``generate(do_sample=False)`` (notebook 06 shows the same tokens).

    Args:
        prompt_ids: token ids of the prompt (at least one).
        eod_id: stop early at this id (``<|endoftext|>``).
        repetition_penalty: > 1 divides positive and multiplies negative logits of tokens already in the
            context (CTRL, Keskar et al. 2019; transformers' ``repetition_penalty``); 1.0: plain greedy.
        vocab_size: the tokenizer's size; default ``gpt.tokenizer_vocab_size``, else every row.

    Returns:
        prompt + generated token ids.

    Raises:
        ValueError: an empty prompt or a non-positive repetition_penalty.
    """

    if not prompt_ids:
        raise ValueError("prompt_ids is empty: give at least one token (e.g. the tokenizer's encoding of 'def ')")
    if repetition_penalty <= 0:
        raise ValueError(f"repetition_penalty={repetition_penalty} must be > 0 (1.0 = none)")
    device = next(gpt.parameters()).device
    max_len = gpt.max_sequence_length
    vocab_size = vocab_size if vocab_size is not None else getattr(gpt, "tokenizer_vocab_size", None)
    ids = list(prompt_ids)
    with torch.no_grad():
        for _ in range(max_new_tokens):
            ctx = torch.tensor([ids[-max_len:]], device=device)
            pos = torch.arange(ctx.shape[1], device=device).unsqueeze(0)
            logits = gpt(ctx, pos, None)[0, -1].float()
            if vocab_size is not None:
                logits[vocab_size:] = float("-inf")
            if repetition_penalty != 1.0:
                seen = torch.tensor(sorted(set(ids)), device=device)
                picked = logits[seen]
                logits[seen] = torch.where(picked > 0, picked / repetition_penalty, picked * repetition_penalty)
            nxt = int(logits.argmax())
            ids.append(nxt)
            if eod_id is not None and nxt == eod_id:
                break
    return ids


@torch.no_grad()
def greedy_generate_hf(hf_model, prompt_ids: Sequence[int], max_new_tokens: int) -> list[int]:
    """Greedy decoding with transformers ``generate(do_sample=False)`` (stops at the EOS of the
    generation config, or at the position table's end).

    Returns:
        The new token ids (without the prompt).
    """
    inp = torch.tensor([list(prompt_ids)], device=next(hf_model.parameters()).device)
    max_new = max(0, min(max_new_tokens, hf_model.config.max_position_embeddings - inp.shape[1]))
    out = hf_model.generate(inp, attention_mask=torch.ones_like(inp), max_new_tokens=max_new, do_sample=False, num_beams=1)
    return out[0, inp.shape[1]:].tolist()
