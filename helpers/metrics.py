"""Where the training log goes: the console, ``metrics.jsonl`` and TensorBoard.

Plumbing of :func:`helpers.training.pretrain` (what it logs, Megatron-LM's ``training_log``
fields, is in that loop); :func:`read_metrics` reads the file back for notebooks 03, 05, 06.
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path
from typing import Any

class MetricsLogger:
    """Writes each log record to the console, ``metrics.jsonl`` and TensorBoard.

    Only the logging rank (the last one, which holds the loss, as Megatron's
    ``print_rank_last``) writes. On resume from iteration ``start``, records after ``start``
    from an interrupted run are dropped from ``metrics.jsonl`` and TensorBoard
    (``purge_step``) so curves have no duplicates; a run from scratch starts a new file.
    """
    def __init__(self, cfg, active: bool, start_iteration: int = 0):
        self.active = active
        self.path = cfg.metrics_file
        self.writer = None
        if not active:
            return
        self.path.parent.mkdir(parents=True, exist_ok=True)
        if self.path.exists():
            kept = [line for line in self.path.read_text().splitlines()
                    if start_iteration and line.strip() and json.loads(line).get("iteration", 0) <= start_iteration]
            tmp = self.path.with_suffix(".jsonl.tmp")
            tmp.write_text("".join(line + "\n" for line in kept))
            os.replace(tmp, self.path)
        try:
            from torch.utils.tensorboard import SummaryWriter

            self.writer = SummaryWriter(str(cfg.tensorboard_path), purge_step=start_iteration + 1 if start_iteration else None)
        except ImportError:  # tensorboard not installed: console + JSON Lines only
            self.writer = None

    def log(self, record: dict[str, Any], console: str | None = None) -> None:
        """Append ``record`` (``kind``, ``iteration`` and numbers) everywhere; print ``console``."""
        if not self.active:
            return
        if console:
            print(console, flush=True)
        with open(self.path, "a", encoding="utf-8") as f:
            f.write(json.dumps(record) + "\n")
        if self.writer is not None:
            step = record["iteration"]
            for key, value in record.items():
                if key not in ("kind", "iteration") and isinstance(value, (int, float)) and math.isfinite(value):
                    self.writer.add_scalar(f"{record['kind']}/{key}", value, step)
            self.writer.flush()

    def close(self) -> None:
        """Flush and close TensorBoard."""
        if self.writer is not None:
            self.writer.close()


def read_metrics(path: str | os.PathLike) -> dict[str, list[dict[str, Any]]]:
    """``metrics.jsonl`` split by kind: ``{"train": [...], "valid": [...]}`` in iteration order."""
    out: dict[str, list[dict[str, Any]]] = {"train": [], "valid": []}
    path = Path(path)
    if path.exists():
        for line in path.read_text().splitlines():
            if line.strip():
                rec = json.loads(line)
                out.setdefault(rec["kind"], []).append(rec)
    return out
