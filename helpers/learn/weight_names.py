"""The two things every weight map needs: a name's layer template, and the account of the keys.

Used by both converters (:mod:`helpers.learn.conversion` for GPT-2, :mod:`helpers.learn.llama`),
whose maps write one entry per weight with ``{}`` for the layer number (litgpt's
``convert_lit_checkpoint.py`` style).
"""

from __future__ import annotations

import re
from typing import Iterable

from helpers.support.safe_load import ConversionError

#: A layer's weight in megatron-core (``decoder.layers.N``), GPT-2 (``transformer.h.N``) or Llama (``model.layers.N``).
_LAYER_RE = re.compile(r"^(decoder\.layers|transformer\.h|model\.layers)\.(\d+)\.(.+)$")


def layer_template(key: str) -> tuple[str, int | None]:
    """``decoder.layers.3.mlp.linear_fc1.bias`` -> ``("decoder.layers.{}.mlp.linear_fc1.bias", 3)``;
    a name outside the layers -> ``(name, None)``."""
    m = _LAYER_RE.match(key)
    return (f"{m[1]}.{{}}.{m[3]}", int(m[2])) if m else (key, None)


def check_keys(found: Iterable[str], expected: Iterable[str], what: str, model: str, fix: str,
               allowed_extra: Iterable[str] = ()) -> None:
    """Refuse a state dict whose keys are not ``expected`` (``allowed_extra`` may be present too).

    Raises:
        ConversionError: ``"{what}: the keys do not match {model} (N weight keys expected)."``, the
            unknown and the missing keys listed, then ``"Nothing was converted. {fix}"``.
    """
    found, expected = set(found), list(expected)
    unknown, missing = sorted(found - set(expected) - set(allowed_extra)), [k for k in expected if k not in found]
    if unknown or missing:
        lines = [f"{what}: the keys do not match {model} ({len(expected)} weight keys expected)."]
        if unknown:
            lines.append(f"  unknown keys ({len(unknown)}): {unknown}")
        if missing:
            lines.append(f"  missing keys ({len(missing)}): {missing}")
        lines.append(f"Nothing was converted. {fix}")
        raise ConversionError("\n".join(lines))
