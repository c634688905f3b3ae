"""What every weight map needs: a name's layer template, the account of the keys, the tied output layer.

Used by both converters (:mod:`helpers.learn.conversion` for GPT-2, :mod:`helpers.learn.llama`),
whose maps write one entry per weight with ``{}`` for the layer number (litgpt's
``convert_lit_checkpoint.py`` style).
"""

from __future__ import annotations

import re
from typing import Iterable, Mapping

import torch

from helpers.support.safe_load import ConversionError

#: A layer's weight in megatron-core (``decoder.layers.N``), GPT-2 (``transformer.h.N``) or Llama (``model.layers.N``).
_LAYER_RE = re.compile(r"^(decoder\.layers|transformer\.h|model\.layers)\.(\d+)\.(.+)$")


def layer_template(key: str) -> tuple[str, int | None]:
    """``decoder.layers.3.mlp.linear_fc1.bias`` -> ``("decoder.layers.{}.mlp.linear_fc1.bias", 3)``;
    a name outside the layers -> ``(name, None)``."""
    m = _LAYER_RE.match(key)
    return (f"{m[1]}.{{}}.{m[3]}", int(m[2])) if m else (key, None)


def check_keys(found: Iterable[str], expected: Iterable[str], what: str, model: str, fix: str) -> None:
    """Refuse a state dict whose keys are not ``expected``.

    Raises:
        ConversionError: ``"{what}: the keys do not match {model} (N weight keys expected)."``, the
            unknown and the missing keys listed, then ``"Nothing was converted. {fix}"``.
    """
    found, expected = set(found), list(expected)
    unknown, missing = sorted(found - set(expected)), [k for k in expected if k not in found]
    if unknown or missing:
        lines = [f"{what}: the keys do not match {model} ({len(expected)} weight keys expected)."]
        if unknown:
            lines.append(f"  unknown keys ({len(unknown)}): {unknown}")
        if missing:
            lines.append(f"  missing keys ({len(missing)}): {missing}")
        lines.append(f"Nothing was converted. {fix}")
        raise ConversionError("\n".join(lines))


def without_tied_copy(state_dict: Mapping[str, torch.Tensor], copy_key: str, embedding_key: str, tied: bool,
                      fix: str) -> dict[str, torch.Tensor]:
    """``state_dict`` without ``copy_key`` when the output layer is tied to the word embeddings.

    A tied model's output layer is its embedding (megatron-core may store it as ``output_layer.weight``,
    transformers lists ``lm_head.weight``); the copy carries nothing, but it must be the embedding.

    Raises:
        ConversionError: ``tied``, yet ``copy_key`` differs from ``embedding_key``; ``fix`` says what to set.
    """
    if not (tied and copy_key in state_dict and embedding_key in state_dict):
        return dict(state_dict)
    if not torch.equal(state_dict[copy_key], state_dict[embedding_key]):
        raise ConversionError(f"{copy_key} differs from {embedding_key}, but the model is tied (its output layer is "
                              f"its word embeddings): {fix}")
    return {k: v for k, v in state_dict.items() if k != copy_key}
