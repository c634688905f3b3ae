"""What one rank of a Megatron-LM run held in memory, and when it computed: measured (notebook 05b).

With ``SERIES_RANK_RECORD=<folder>`` set, ``helpers/learn/pretrain_gpt.py`` makes each rank write
``<folder>/rank_<r>.json`` at the end of training:

* **states**: parameters, megatron-core's fp32 ``main_grad`` buffers and the optimizer's state;
* **activations**: the tensors autograd saves for backward (``saved_tensors_hooks``), per micro-batch;
* **timeline**: ``time.monotonic()`` start and end of every forward and backward.

It wraps ``schedules.forward_step`` / ``backward_step`` (``megatron/core/pipeline_parallel/schedules.py``)
and ``training.train_step`` / ``train`` (``megatron/training/training.py``); losses are unchanged.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any

import torch

#: The environment variable that switches the probe on: the folder the ranks write into.
ENV = "SERIES_RANK_RECORD"


def tensor_bytes(tensors) -> int:
    """Bytes of distinct tensors (by data pointer and size), e.g. a module's ``parameters()``."""
    seen = {}
    for t in tensors:
        if torch.is_tensor(t) and t.numel():
            seen[(t.data_ptr(), t.numel(), t.dtype)] = t.numel() * t.element_size()
    return sum(seen.values())


class SavedTensors:
    """Counts what autograd saves for backward inside a ``with`` block, each storage once.

    Usage (the notebook shows it on one layer)::

        with SavedTensors(exclude=model.parameters()) as saved:
            loss = model(x).sum()
        saved.bytes, saved.count   # activations this forward keeps for its backward

    Args:
        exclude: tensors whose storages are not counted (the parameters: weights saved for
            the input gradient are not activations).
        also_held: storages already counted elsewhere (another micro-batch in flight), not counted again.

    Attributes:
        storages: ``{storage data pointer: bytes}`` of what was saved (``untyped_storage().nbytes()``).
    """

    def __init__(self, exclude=(), also_held=()):
        self._exclude = {t.untyped_storage().data_ptr() for t in exclude} | set(also_held)
        self.storages: dict[int, int] = {}
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, lambda t: t)

    def _pack(self, t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        key = storage.data_ptr()
        if key not in self._exclude:
            self.storages.setdefault(key, storage.nbytes())
        return t

    @property
    def bytes(self) -> int:
        return sum(self.storages.values())

    @property
    def count(self) -> int:
        return len(self.storages)

    def __enter__(self) -> "SavedTensors":
        self._hooks.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        self._hooks.__exit__(*exc)


def optimizer_state_bytes(optimizer: Any, model_storages: set[int]) -> int:
    """Bytes of a megatron-core optimizer's own tensors: Adam's state and master weights that are
    not the model's (fp32 training steps the model's own parameters; bf16 keeps fp32 copies).

    Args:
        optimizer: a ``MegatronOptimizer`` or ``ChainedOptimizer`` (``megatron/core/optimizer``).
        model_storages: data pointers of the model parameters' storages.
    """
    inner = [o.optimizer for o in getattr(optimizer, "chained_optimizers", [optimizer]) if o.optimizer is not None]
    tensors = [t for opt in inner for state in opt.state.values() for t in state.values() if torch.is_tensor(t)]
    masters = [p for opt in inner for group in opt.param_groups for p in group["params"]
               if p.untyped_storage().data_ptr() not in model_storages]
    return tensor_bytes(tensors + masters)


class Recorder:
    """The probe of one rank (see the module docstring); :func:`install` makes one from ``SERIES_RANK_RECORD``."""

    def __init__(self, folder: Path):
        self.folder = folder
        self.rank = int(os.environ.get("RANK", "0"))
        self.iteration = 0
        self.training = False
        self.events: list[dict[str, Any]] = []
        self._open: dict[int, tuple[int, SavedTensors]] = {}  # id(forward output) -> (event index, its saved tensors)
        self._counts: dict[tuple[int, int], int] = {}  # (iteration, chunk) -> forwards so far
        self._parameters: set[int] = set()

    def wrap_forward(self, forward_step):
        def forward_step_recorded(forward_step_func, data_iterator, model, *args, **kwargs):
            if not self.training:
                return forward_step(forward_step_func, data_iterator, model, *args, **kwargs)
            chunk = kwargs.get("vp_stage") or 0
            held = [k for _, s in self._open.values() for k in s.storages]
            saved = SavedTensors(also_held=[*held, *self._parameters])  # other micro-batches' and the weights' storages
            start = time.monotonic()
            with saved:
                result = forward_step(forward_step_func, data_iterator, model, *args, **kwargs)
            counted = self._counts.get((self.iteration, chunk), 0)
            self._counts[(self.iteration, chunk)] = counted + 1
            microbatch = kwargs.get("current_microbatch")
            microbatch = counted if microbatch is None else microbatch
            self.events.append({"kind": "forward", "iteration": self.iteration, "chunk": chunk, "microbatch": microbatch,
                                "start": start, "end": time.monotonic(), "saved_bytes": saved.bytes,
                                "saved_tensors": saved.count})
            self._open[id(result[0])] = (len(self.events) - 1, saved)
            return result

        return forward_step_recorded

    def wrap_backward(self, backward_step):
        def backward_step_recorded(input_tensor, output_tensor, output_tensor_grad, config):
            start = time.monotonic()
            result = backward_step(input_tensor, output_tensor, output_tensor_grad, config)
            opened = self._open.pop(id(output_tensor), None)
            if self.training and opened is not None:
                fwd = self.events[opened[0]]
                self.events.append({"kind": "backward", "iteration": fwd["iteration"], "chunk": fwd["chunk"],
                                    "microbatch": fwd["microbatch"], "start": start, "end": time.monotonic()})
            return result

        return backward_step_recorded

    def wrap_train_step(self, train_step):
        def train_step_recorded(forward_step_func, data_iterator, model, *args, **kwargs):
            if not self._parameters:
                self._parameters = {p.untyped_storage().data_ptr() for chunk in model for p in chunk.parameters()}
            self.iteration += 1
            self.training = True
            try:
                return train_step(forward_step_func, data_iterator, model, *args, **kwargs)
            finally:
                self.training = False

        return train_step_recorded

    def wrap_train(self, train):
        def train_recorded(forward_step_func, model, optimizer, *args, **kwargs):
            result = train(forward_step_func, model, optimizer, *args, **kwargs)
            self.write(model, optimizer)
            return result

        return train_recorded

    def write(self, model: list, optimizer: Any) -> Path:
        """Measure the states now (after the last step) and write ``rank_<r>.json`` with the events."""
        from megatron.core import parallel_state as ps

        params = [p for chunk in model for p in chunk.parameters()]
        buffers = [b for chunk in model for b in getattr(chunk, "buffers", []) + getattr(chunk, "expert_parallel_buffers", [])]
        storages = {p.untyped_storage().data_ptr() for p in params}
        record = {
            "rank": self.rank,
            "tensor_rank": ps.get_tensor_model_parallel_rank(), "pipeline_rank": ps.get_pipeline_model_parallel_rank(),
            "data_rank": ps.get_data_parallel_rank(), "expert_rank": ps.get_expert_model_parallel_rank(),
            "chunks": len(model), "parameters": sum(p.numel() for p in params),
            "weights": tensor_bytes(params),
            "gradients": tensor_bytes([b.grad_data for b in buffers]) if buffers else tensor_bytes([p.grad for p in params]),
            "gradient_values": sum(p.numel() * 4 for p in params),  # fp32 main_grad, without the buffer's padding
            "optimizer_state": optimizer_state_bytes(optimizer, storages),
            "events": self.events,
        }
        self.folder.mkdir(parents=True, exist_ok=True)
        path = self.folder / f"rank_{self.rank}.json"
        path.write_text(json.dumps(record) + "\n")
        return path


def install() -> Recorder | None:
    """Wrap megatron-core's schedule steps and Megatron-LM's loop when ``SERIES_RANK_RECORD`` is set.

    Returns:
        The :class:`Recorder`, or ``None`` (variable unset: nothing is wrapped).
    """
    folder = os.environ.get(ENV)
    if not folder:
        return None
    from megatron.core.pipeline_parallel import schedules
    from megatron.training import training

    recorder = Recorder(Path(folder))
    schedules.forward_step = recorder.wrap_forward(schedules.forward_step)
    schedules.backward_step = recorder.wrap_backward(schedules.backward_step)
    training.train_step = recorder.wrap_train_step(training.train_step)
    training.train = recorder.wrap_train(training.train)
    return recorder


def read(folder: str | os.PathLike) -> list[dict[str, Any]]:
    """The ``rank_<r>.json`` records of a run, by rank.

    Raises:
        FileNotFoundError: the folder holds none (the run did not set ``SERIES_RANK_RECORD``).
    """
    paths = sorted(Path(folder).glob("rank_*.json"), key=lambda p: int(p.stem.split("_")[1]))
    if not paths:
        raise FileNotFoundError(f"{folder} holds no rank_<r>.json: run with {ENV}={folder} to record one")
    return [json.loads(p.read_text()) for p in paths]


def activation_peak(record: dict[str, Any], iteration: int | None = None) -> dict[str, Any]:
    """The activations one rank held at its peak, from its recorded events.

    Walks the forward (adds that micro-batch's saved bytes) and backward (frees them) events of
    ``iteration`` (default: the last) in time order.

    Returns:
        ``{"bytes": peak bytes, "in_flight": micro-batch chunks held at the peak, "max_in_flight": the most
        held at any time, "per_microbatch": the largest bytes one micro-batch chunk saved}``.

    Raises:
        ValueError: the record holds no events, or none of ``iteration``.
    """
    if not record.get("events"):
        raise ValueError(f"rank {record.get('rank')} recorded no forward or backward: was the run recorded "
                         f"({ENV}) and did it train?")
    if iteration is None:
        iteration = max(e["iteration"] for e in record["events"])
    events = [e for e in record["events"] if e["iteration"] == iteration]
    if not events:
        raise ValueError(f"rank {record.get('rank')} recorded no iteration {iteration}: it recorded "
                         f"{sorted({e['iteration'] for e in record['events']})}")
    held, peak, in_flight, at_peak = {}, 0, 0, 0
    for e in sorted(events, key=lambda e: (e["start"], e["kind"] == "forward")):
        key = (e["chunk"], e["microbatch"])
        if e["kind"] == "forward":
            held[key] = e["saved_bytes"]
        else:
            held.pop(key, None)
        if sum(held.values()) > peak:
            peak, at_peak = sum(held.values()), len(held)
        in_flight = max(in_flight, len(held))
    return {"bytes": peak, "in_flight": at_peak, "max_in_flight": in_flight,
            "per_microbatch": max((e["saved_bytes"] for e in events if e["kind"] == "forward"), default=0)}
