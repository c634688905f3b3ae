"""Fair timings of several callables, in seconds per call: notebook 04's clock.

Every measurement of notebook 04 goes through :func:`time_calls`: the roofline's copy and
matmul (sections 2 and 5), the fused-op benchmark (section 4), the AdamW steps (section 7),
the training step with the fusion flags off and on (section 8) and the core attention
(section 9). Warm-up first, then repeats interleaved round-robin, median and quartiles
(:class:`Timing`); ``time.perf_counter`` on a CPU, ``torch.cuda.Event`` pairs on CUDA.

Sources: torch ``torch/utils/benchmark`` (warm-up, median and IQR reporting);
CUDA C Programming Guide, "Events" (timing GPU work asynchronously).
"""

from __future__ import annotations

import math
import statistics
import time
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Mapping

import torch


@dataclass(frozen=True)
class Timing:
    """Repeated timings of one call, in seconds per call.

    Attributes:
        name: what was timed.
        times_s: one entry per repeat (seconds per call, averaged over ``number`` calls).
        number: calls per repeat.
        device: ``"cpu"`` or ``"cuda"``.
        clock: ``"time.perf_counter"`` or ``"torch.cuda.Event"``.
        first_call_s: the first warm-up call alone (includes any compilation).
    """

    name: str
    times_s: tuple[float, ...]
    number: int
    device: str
    clock: str
    first_call_s: float = float("nan")

    @property
    def median_s(self) -> float:
        """Median seconds per call."""
        return statistics.median(self.times_s)

    def quantile_s(self, q: float) -> float:
        """The ``q`` quantile (0..1) of seconds per call, linear interpolation."""
        xs = sorted(self.times_s)
        pos = q * (len(xs) - 1)
        lo, hi = math.floor(pos), math.ceil(pos)
        return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)

    @property
    def q25_s(self) -> float:
        """25th percentile, seconds per call."""
        return self.quantile_s(0.25)

    @property
    def q75_s(self) -> float:
        """75th percentile, seconds per call."""
        return self.quantile_s(0.75)

    @property
    def spread(self) -> float:
        """Interquartile range relative to the median (0.1 = the middle half within 10%)."""
        return (self.q75_s - self.q25_s) / self.median_s


def device_type(device: str | torch.device | None) -> str:
    """``"cpu"`` or ``"cuda"`` for ``device`` (``None``: CUDA when torch sees a GPU, else CPU).

    Raises:
        ValueError: CUDA asked for without a GPU, or a device type other than CPU and CUDA.
    """
    if device is None:
        return "cuda" if torch.cuda.is_available() else "cpu"
    dev = torch.device(device)
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device={str(device)!r} but torch sees no CUDA GPU: pass device='cpu'")
    if dev.type not in ("cpu", "cuda"):
        raise ValueError(f"device={str(device)!r}: choose 'cpu' or 'cuda'")
    return dev.type


def synchronize(device: str) -> None:
    """Wait for the GPU's queued work on ``"cuda"`` (``torch.cuda.synchronize``); nothing on a CPU."""
    if device == "cuda":
        torch.cuda.synchronize()


def _time_once(fn: Callable[[], Any], number: int, device: str) -> float:
    """Seconds per call of ``number`` back-to-back calls (CUDA events on a GPU)."""
    if device == "cuda":
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(number):
            fn()
        end.record()
        end.synchronize()
        return start.elapsed_time(end) / 1e3 / number
    t0 = time.perf_counter()
    for _ in range(number):
        fn()
    return (time.perf_counter() - t0) / number


def time_calls(fns: Mapping[str, Callable[[], Any]], *, device: str = "cpu", warmup: int = 3,
               repeats: int = 15, min_repeat_s: float = 0.005,
               progress: bool = False) -> dict[str, Timing]:
    """Time several callables fairly: warm-up, then repeats interleaved round-robin (A B C A B C ...).

    Interleaving spreads a shared machine's drift evenly over the candidates. Each repeat makes
    ``number`` calls, so that it lasts at least ``min_repeat_s`` seconds (above the clock's noise).

    Args:
        fns: ``{name: zero-argument callable}``.
        device: ``"cpu"`` (``time.perf_counter``) or ``"cuda"`` (``torch.cuda.Event`` pairs, synchronised
            after each repeat).
        warmup: untimed calls first, >= 1; repeats: timed repeats per callable, >= 3.

    Returns:
        ``{name: Timing}``.

    Raises:
        ValueError: no callables, warmup < 1, repeats < 3, or an unusable device.
    """
    device = device_type(device)
    if not fns:
        raise ValueError("fns is empty: pass {name: callable}")
    if warmup < 1 or repeats < 3:
        raise ValueError(f"warmup={warmup} must be >= 1 and repeats={repeats} >= 3 (a median needs a few)")
    clock = "torch.cuda.Event" if device == "cuda" else "time.perf_counter"
    first, number = {}, {}
    for name, fn in fns.items():
        synchronize(device)
        t0 = time.perf_counter()
        fn()
        synchronize(device)
        first[name] = time.perf_counter() - t0
        for _ in range(warmup - 1):
            fn()
        one = _time_once(fn, 1, device)
        number[name] = max(1, math.ceil(min_repeat_s / max(one, 1e-9)))
    times: dict[str, list[float]] = {name: [] for name in fns}
    rounds: Iterable[int] = range(repeats)
    if progress:
        from tqdm.auto import tqdm

        rounds = tqdm(rounds, desc="timing", leave=False)
    for _ in rounds:
        for name, fn in fns.items():
            times[name].append(_time_once(fn, number[name], device))
    return {name: Timing(name, tuple(times[name]), number[name], device, clock, first[name]) for name in fns}
