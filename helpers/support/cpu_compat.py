"""The one place that patches megatron-core so it trains on a machine without CUDA (notebook 03 §4).

megatron-core 0.19.2 and its ``megatron.training`` loop ask for a CUDA device, stream, RNG state
or synchronisation even when every tensor is on the CPU. Each :class:`Shim` names the version and
``file:line`` it works around; ``tests/test_cpu_compat.py`` shows the unpatched call still fails
on CPU. Kinds: a device redirect (the module's ``torch`` becomes :class:`CpuTorch`), method wrappers
(:data:`METHOD_SHIMS`), function replacements (:data:`FUNCTION_SHIMS`), and
:class:`CpuRNGStatesTracker` for ``tensor_parallel/random.py``'s ``CudaRNGStatesTracker``.
:data:`TRAINING_SHIMS` are what ``helpers/learn/pretrain_gpt.py`` needs. :func:`apply` applies
them (idempotent; a no-op with CUDA).
"""

from __future__ import annotations

import contextlib
import copy
import functools
import importlib
import importlib.abc
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator

import torch

#: The megatron-core version these shims were written for and tested against.
MEGATRON_CORE_VERSION = "0.19.2"

_CUDA_NAMES = ("cuda",)


def _to_cpu_device(device: Any) -> Any:
    """``"cuda"``, ``"cuda:0"``, ``torch.device("cuda", 1)`` or an int (a CUDA index) -> ``"cpu"``."""
    if device is None:
        return None
    if isinstance(device, int) and not isinstance(device, bool):
        return torch.device("cpu")
    if isinstance(device, str) and device.split(":")[0] in _CUDA_NAMES:
        return torch.device("cpu")
    if isinstance(device, torch.device) and device.type == "cuda":
        return torch.device("cpu")
    return device


class _CpuCuda:
    """``torch.cuda`` as megatron-core sees it after :func:`apply`: the "current device" is the CPU."""

    def __getattr__(self, name: str) -> Any:
        return getattr(torch.cuda, name)

    @staticmethod
    def current_device() -> torch.device:
        return torch.device("cpu")

    @staticmethod
    def current_stream(device: Any = None) -> Any:
        return torch.cpu.current_stream()

    @staticmethod
    def synchronize(device: Any = None) -> None:
        return None

    @staticmethod
    def manual_seed(seed: int) -> None:
        torch.manual_seed(seed)

    @staticmethod
    def get_rng_state(device: Any = "cuda") -> torch.Tensor:
        return torch.get_rng_state()

    @staticmethod
    def set_rng_state(new_state: torch.Tensor, device: Any = "cuda") -> None:
        torch.set_rng_state(new_state)

    @staticmethod
    def Stream(*args: Any, **kwargs: Any) -> Any:  # noqa: N802 (torch's name)
        return torch.cpu.Stream()

    @staticmethod
    def stream(stream: Any = None) -> Any:
        return torch.cpu.stream(stream)

    @staticmethod
    def get_device_properties(device: Any = None) -> Any:
        """No CUDA architecture: ``major`` 0 (Megatron-LM then asks for ``CUDA_DEVICE_MAX_CONNECTIONS=1``
        with TP > 1, as before Blackwell)."""
        return _CPU_PROPERTIES


_CPU_PROPERTIES = type("CpuDeviceProperties", (), {"name": "cpu", "major": 0, "minor": 0, "multi_processor_count": 0})()


class _CpuAsTheDevice(_CpuCuda):
    """``torch.cuda`` for Megatron-LM's ``initialize.py``: the CPU is the one device of each process.

    ``initialize_megatron`` asserts CUDA, and builds the model-parallel groups and seeds the RNG
    tracker only when ``torch.cuda.device_count() > 0``; here the process's CPU counts as its device.
    """

    @staticmethod
    def is_available() -> bool:
        return True

    @staticmethod
    def device_count() -> int:
        return 1

    @staticmethod
    def set_device(device: Any) -> None:
        return None


_FACTORIES = ("zeros", "ones", "empty", "full", "tensor", "arange", "randn", "rand",
              "zeros_like", "ones_like", "empty_like", "full_like", "as_tensor")


class CpuTorch:
    """A proxy of the ``torch`` module whose CUDA device requests land on the CPU.

    Installed as the global ``torch`` of selected megatron-core modules only. Everything not
    overridden (``torch.Tensor``, ``torch.float32``, ``torch.distributed``...) is the real
    ``torch`` attribute.
    """

    cuda = _CpuCuda()

    def __init__(self, cuda: _CpuCuda | None = None) -> None:
        if cuda is not None:
            self.cuda = cuda

    def __getattr__(self, name: str) -> Any:
        attr = getattr(torch, name)
        if name in _FACTORIES:
            def factory(*args: Any, **kwargs: Any) -> Any:
                if "device" in kwargs:
                    kwargs["device"] = _to_cpu_device(kwargs["device"])
                kwargs.pop("pin_memory", None)
                return attr(*args, **kwargs)

            factory.__name__ = name
            return factory
        return attr

    def __repr__(self) -> str:
        return "<helpers.support.cpu_compat.CpuTorch proxy of torch>"


@dataclass(frozen=True)
class Shim:
    """One patch: the megatron-core module it applies to and the lines it works around.

    Attributes:
        name: short id used by the tests (``"schedules"``...).
        module: the megatron-core module whose global ``torch`` is replaced (device shims).
        lines: ``{line number in megatron-core 0.19.2: code found on that line}``; the tests
            check each line still holds that CUDA-only call (else the shim may be stale).
        why: what fails without the shim.
        proxy: what the module's ``torch`` becomes: ``"cpu"`` (:class:`CpuTorch`),
            ``"cpu-is-the-device"`` (``torch.cuda`` is :class:`_CpuAsTheDevice`), ``"fused-adamw"``
            (:class:`CpuTorch` whose ``torch.optim.AdamW`` is torch's fused CPU kernel), or
            ``None`` (the module's ``torch`` is left alone: method and function shims).
        package: the module is a package (its file is ``.../__init__.py``).
    """

    name: str
    module: str
    lines: dict[int, str]
    why: str
    proxy: str | None = "cpu"
    package: bool = False

    @property
    def file(self) -> str:
        """The module's file relative to site-packages, e.g. ``megatron/core/utils.py``."""
        base = self.module.replace(".", "/")
        return base + "/__init__.py" if self.package else base + ".py"

    @property
    def works_around(self) -> str:
        """``megatron-core 0.19.2 megatron/core/utils.py:715: why``."""
        where = ", ".join(f":{n}" for n in sorted(self.lines))
        return f"megatron-core {MEGATRON_CORE_VERSION} {self.file}{where}: {self.why}"


_CUR = "torch.cuda.current_device()"
_SYNC = "torch.cuda.synchronize()"
_STREAM = "torch.cuda.current_stream()"
_CUDA = 'device="cuda"'
_CUDA1 = "device='cuda'"

#: Device shims: modules whose global ``torch`` becomes :class:`CpuTorch`.
DEVICE_SHIMS: tuple[Shim, ...] = (
    Shim("causal_mask", "megatron.core.transformer.utils", {39: _CUDA, 44: _CUDA},
         "get_default_causal_mask builds the causal mask with torch.ones(sq, sq, device='cuda') "
         "(attention_mask=None, as GPTDataset batches have it); get_sliding_window_causal_mask likewise"),
    Shim("rotary_pos_embedding", "megatron.core.models.common.embeddings.rotary_pos_embedding", {162: _CUR},
         "RotaryEmbedding.get_emb moves its inv_freq to torch.cuda.current_device() at the first forward "
         "(rotary position embeddings: a Llama, --position-embedding-type rope)"),
    Shim("global_memory_buffer", "megatron.core.utils", {715: _CUR, 1332: _CUDA},
         "GlobalMemoryBuffer.get_tensor allocates on torch.cuda.current_device() (every attention forward); "
         "local_multi_tensor_l2_norm, the gradient norm without Apex, returns it on device='cuda'"),
    Shim("schedules", "megatron.core.pipeline_parallel.schedules", {749: _CUDA, 1121: _CUDA, 2292: _CUDA},
         "every forward-backward schedule makes torch.zeros([], device='cuda'), even at PP=1"),
    Shim("tensor_parallel_mappings", "megatron.core.tensor_parallel.mappings",
         {95: _CUR, 145: _CUR, 152: _CUR, 185: _CUR, 447: _CUR},
         "the all-gathers and reduce-scatters along the sequence (--sequence-parallel) allocate their outputs "
         "on torch.cuda.current_device()"),
    Shim("tensor_parallel_layers", "megatron.core.tensor_parallel.layers", {647: _CUR},
         "under sequence parallelism the linear layers' backward all-gathers the input it saved sharded into a "
         "buffer on torch.cuda.current_device()"),
    Shim("p2p_communication", "megatron.core.pipeline_parallel.p2p_communication",
         {211: _CUR, 215: _CUR, 219: _CUR, 223: _CUR, 263: _SYNC, 334: _CUR, 342: _CUR, 419: _SYNC},
         "pipeline send/receive buffers on torch.cuda.current_device() and torch.cuda.synchronize() (PP>1)"),
    Shim("param_and_grad_buffer", "megatron.core.distributed.param_and_grad_buffer",
         {632: _STREAM, 1145: _CUDA, 1162: _CUR, 1180: _CUR, 1186: _CUR},
         "DistributedDataParallel's contiguous grad buffers on torch.cuda.current_device(); "
         "start_grad_sync (reached through finalize_model_grads on every iteration) waits on "
         "torch.cuda.current_stream() (new in 0.19)"),
    Shim("filesystem_async", "megatron.core.dist_checkpointing.strategies.filesystem_async", {248: _SYNC},
         "torch.cuda.synchronize() before a torch_dist checkpoint is written"),
    Shim("state_dict_saver", "megatron.core.dist_checkpointing.strategies.state_dict_saver", {252: _CUR},
         "the failure flag all-reduced after a torch_dist save lives on torch.cuda.current_device()"),
    Shim("async_utils", "megatron.core.dist_checkpointing.strategies.async_utils",
         {224: _CUR, 273: _SYNC, 698: _CUR},
         "async checkpoint bookkeeping tensors on torch.cuda.current_device() and torch.cuda.synchronize()"),
    Shim("fully_parallel", "megatron.core.dist_checkpointing.strategies.fully_parallel", {287: _SYNC, 296: _SYNC},
         "torch.cuda.synchronize() in fully parallel save/load (DP>1)"),
    Shim("timers", "megatron.core.timers", {152: _SYNC, 165: _SYNC, 303: _CUR},
         "Megatron's timers synchronise CUDA at start and stop and gather their times on the current device"),
    Shim("rerun_state_machine", "megatron.core.rerun_state_machine",
         {268: _CUDA1, 979: "torch.cuda.get_rng_state()"},
         "the rerun state machine (NaN and spiky-loss checks) all-reduces a flag on device='cuda' and saves "
         "the CUDA generator's state before every step"),
    Shim("clip_grads", "megatron.core.optimizer.clip_grads", {108: _CUDA1, 112: _CUDA1},
         "get_grad_norm_fp32 accumulates the norm on device='cuda'"),
    Shim("optimizer", "megatron.core.optimizer.optimizer", {315: _CUDA1, 1249: _CUDA1},
         "FP32Optimizer keeps its loss scale, and the optimizer its found-inf flag, on device='cuda'"),
    Shim("distrib_optimizer_load", "megatron.core.optimizer.distrib_optimizer", {998: _CUR},
         "a resumed --use-distributed-optimizer run allocates its optimizer state on torch.cuda.current_device() "
         "before the checkpoint's values overwrite it (DistributedOptimizer.load_state_dict)"),
    Shim("moe_router", "megatron.core.transformer.moe.router", {98: _CUR, 184: _CUR, 193: _CUR, 207: _CUR, 213: _CUR},
         "a mixture-of-experts router (--num-experts) moves its weight to torch.cuda.current_device() at its first "
         "forward, and keeps its expert-bias and global aux-loss counters there"),
    Shim("fused_adamw", "megatron.core.optimizer",
         {557: "adam_cls = torch.optim.AdamW if config.decoupled_weight_decay else torch.optim.Adam"},
         "without Transformer Engine or Apex, whose FusedAdam is CUDA only, Megatron-LM steps torch's "
         "for-loop AdamW; torch's fused AdamW is the fused kernel a CPU has: the same update to float32 "
         "rounding in fewer passes over memory (notebook 04 measures it)", proxy="fused-adamw", package=True),
)

#: Megatron-LM's training loop (``megatron/training``, shipped in the megatron-core wheel): what
#: ``helpers/learn/pretrain_gpt.py`` needs for ``megatron.training.pretrain`` on a CPU at TP, PP and DP up
#: to 2, with checkpoints and resume. Applied when the process imports ``megatron.training``, before or after
#: :func:`apply` (:class:`_TrainingImportHook`): its ``training.py`` sets the root logger to INFO on import, which
#: a notebook that only uses megatron-core should not inherit, so :func:`apply` does not import it.
TRAINING_SHIMS: tuple[Shim, ...] = (
    Shim("initialize", "megatron.training.initialize",
         {66: "torch.cuda.is_available()", 270: "torch.cuda.device_count()", 282: "torch.cuda.set_device(",
          447: "torch.cuda.device_count() > 0"},
         "initialize_megatron asserts torch.cuda.is_available(), and sets up the model-parallel groups and "
         "seeds the RNG tracker only when torch.cuda.device_count() > 0: the CPU counts as each process's device",
         proxy="cpu-is-the-device"),
    Shim("training_loop", "megatron.training.training",
         {1131: _CUDA1, 1137: _CUDA1, 2613: _CUDA1, 2884: _CUDA1, 4270: _CUDA1, 4588: _CUDA1},
         "pretrain's start-time all-reduce, the loss sums of training_log and evaluate, and the "
         "do-train/valid/test flags live on device='cuda'"),
    Shim("checkpointing", "megatron.training.checkpointing", {375: _CUDA1, 417: "torch.cuda.get_rng_state()"},
         "save_checkpoint all-reduces the iteration on device='cuda' and stores the CUDA generator's state"),
    Shim("common_utils", "megatron.training.utils.common_utils",
         {285: _CUR, 308: _CUR, 504: "torch.cuda.get_device_properties("},
         "reductions of statistics and of update_successful on torch.cuda.current_device(); "
         "validate_args reads the GPU's architecture (get_device_arch_version) when TP > 1"),
    Shim("dist_utils", "megatron.training.models.dist_utils",
         {303: "torch.cuda.Stream()", 304: _STREAM, 306: "torch.cuda.stream("},
         "the model is wrapped in DistributedDataParallel on a side CUDA stream"),
)

#: Function shims: a megatron function replaced by the same function without its CUDA-only line.
#: {shim: (module that holds the name the caller looks up, attribute)}.
FUNCTION_SHIMS: dict[str, tuple[str, str]] = {
    "clip_grad_by_total_norm": ("megatron.core.optimizer.optimizer", "clip_grad_by_total_norm_fp32"),
    "warmup_jit": ("megatron.training.initialize", "_warmup_jit_function"),
}

_FUNCTION_SHIM_LIST: tuple[Shim, ...] = (
    Shim("clip_grad_by_total_norm", "megatron.core.optimizer.clip_grads",
         {174: "assert param.grad.type() == 'torch.cuda.FloatTensor'"},
         "clip_grad_by_total_norm_fp32 asserts that every gradient is a CUDA tensor before scaling it",
         proxy=None),
    Shim("warmup_jit", "megatron.training.initialize", {509: _CUDA, 518: _CUDA},
         "set_jit_fusion_options warms the fused bias-GELU and bias-dropout-add kernels up on CUDA tensors "
         "drawn with torch.rand; on a CPU those draws come from the generator that then initialises the "
         "weights, so the same seed would give other weights than on a GPU", proxy=None),
)

#: Not a CPU matter: the megatron-core wheel ships its dataset index helpers prebuilt
#: (``helpers_cpp``) but not their Makefile, and ``initialize_megatron`` runs ``make`` on rank 0,
#: which then exits. Applied on GPUs too, by :func:`use_prebuilt_dataset_helpers`.
WHEEL_SHIM = Shim("dataset_helpers", "megatron.core.datasets.utils",
                  {25: 'command = ["make", "-C", os.path.abspath(os.path.dirname(__file__))]'},
                  "compile_helpers runs make in a folder without a Makefile and calls sys.exit(1)", proxy=None)

#: Not CPU matters: three gaps of the distributed optimizer's resume (``--use-distributed-optimizer``), which
#: stopped every such run from loading its checkpoint. Applied on GPUs too, by :func:`resume_distributed_optimizer`.
RESUME_SHIMS: tuple[Shim, ...] = (
    Shim("torch_adam_resume", "megatron.core.optimizer.distrib_optimizer",
         {838: 's["step"].item() for s in inner_state_dict["state"].values()', 839: "assert len(steps) == 1"},
         "without Transformer Engine or Apex, DistributedOptimizer.state_dict asserts exactly one AdamW step "
         "among torch's per-parameter states; a fresh optimizer has none yet, and Megatron-LM's load_checkpoint "
         "builds that state dict before it loads (generate_state_dict -> sharded_state_dict)", proxy=None),
    Shim("torch_adam_shared_step", "megatron.core.optimizer.distrib_optimizer",
         {1028: 'step = torch.tensor(steps[0], dtype=torch.float)', 1032: 's["step"] = step'},
         "without Transformer Engine or Apex, DistributedOptimizer.load_state_dict gives every parameter's AdamW "
         "state the same step tensor; torch increments each parameter's step in place, so the first step after "
         "a resume counted one step per parameter (a model of 28 tensors went from step 5 to 33) and the "
         "bias corrections, hence every later loss, left the uninterrupted run's", proxy=None),
    Shim("dp_reshardable_resume", "megatron.core.optimizer.distrib_optimizer",
         {2061: "def load_parameter_state_from_dp_reshardable(self, state_dict):",
          1115: "if isinstance(v, torch.Tensor):", 1225: "dst_tensors[key].copy_(tensors[key])"},
         "loading the default dp_reshardable format copies every tensor of torch's AdamW state into place: "
         "outside torch.no_grad() (its siblings for the other formats have it), which fails in fp32, where the "
         "main parameters are views of the weights (a view of a leaf Variable used in-place); and with the "
         "'step' tensor of the empty state the load was planned on, which sets AdamW's step back to 0 after "
         "load_state_dict restored it", proxy=None),
)

#: Method shims: a method of a megatron-core class runs with ``Tensor.cuda()`` returning the
#: tensor itself (CPU), only for the duration of that call. {shim: (class name, method name)}.
METHOD_SHIMS: dict[str, tuple[str, str]] = {
    "language_module": ("LanguageModule", "setup_embeddings_and_output_layer"),
    "distrib_optimizer": ("DistributedOptimizer", "__init__"),
    "torch_norm": ("WrappedTorchNorm", "__new__"),
}

_METHOD_SHIM_LIST: tuple[Shim, ...] = (
    Shim("language_module", "megatron.core.models.common.language_module.language_module",
         {307: "weight.data.cuda()"},
         "with PP>1 and tied embeddings, the last stage's copy of the word embeddings is moved with "
         "weight.data.cuda() before the first/last-stage all-reduce"),
    Shim("distrib_optimizer", "megatron.core.optimizer.distrib_optimizer",
         {466: "model_param.type() == 'torch.cuda.FloatTensor'", 477: "raise TypeError("},
         "the distributed optimizer (--use-distributed-optimizer) sorts the parameters it shards by "
         "Tensor.type(), and refuses one that is not torch.cuda.Half/BFloat16/FloatTensor", proxy=None),
    Shim("torch_norm", "megatron.core.transformer.torch_norm",
         {50: "assert not config.sequence_parallel"},
         "without Apex and Transformer Engine the local spec's norms are torch's, which megatron-core refuses "
         "under sequence parallelism (--sequence-parallel) because nothing marks their weights for the "
         "tensor-parallel gradient sum; not a CUDA call, but no CPU has Apex or TE", proxy=None),
)

#: The RNG shim (not only a module proxy: a tracker class with CPU generator states).
RNG_SHIM = Shim("rng_tracker", "megatron.core.tensor_parallel.random",
                {118: "torch.cuda.random.get_rng_state", 303: "torch.cuda.get_rng_state()"},
                "CudaRNGStatesTracker.add and _get_cuda_rng_state read the CUDA generator "
                "(model_parallel_cuda_manual_seed; fork() runs in every attention forward)")

SHIMS: tuple[Shim, ...] = DEVICE_SHIMS + TRAINING_SHIMS + _METHOD_SHIM_LIST + _FUNCTION_SHIM_LIST + (RNG_SHIM,)

_state: dict[str, Any] = {"applied": False, "training_applied": False, "hook": None, "originals": {}}


def needed() -> bool:
    """True when the shims are needed: no CUDA device is available to torch."""
    return not torch.cuda.is_available()


def is_applied() -> bool:
    """True after :func:`apply` patched megatron-core (and :func:`revert` did not undo it)."""
    return bool(_state["applied"])


# --------------------------------------------------------------------------- RNG tracker
def _cpu_get_rng_state(device: Any = "cuda", clone: bool = False, graph_safe: bool = False) -> torch.Tensor:
    """CPU stand-in for ``random._get_cuda_rng_state`` (megatron-core 0.19.2 random.py:104)."""
    return torch.get_rng_state()


def _cpu_set_rng_state(new_state: torch.Tensor, device: int = -1, graph_safe: bool = False) -> None:
    """CPU stand-in for ``random._set_cuda_rng_state`` (megatron-core 0.19.2 random.py:135)."""
    torch.set_rng_state(new_state)


def _make_cpu_tracker_class(base: type) -> type:
    class CpuRNGStatesTracker(base):  # type: ignore[misc, valid-type]
        """megatron-core's ``CudaRNGStatesTracker`` with CPU generator states.

        Same streams and seeds as on GPU (``model_parallel_cuda_manual_seed``: data-parallel
        stream ``seed``, tensor-model-parallel stream ``seed + 2718 + tp_rank``, expert stream
        ``seed + 1024 + 100 * ep_rank + etp_rank``); ``fork(name)`` swaps the CPU generator to the
        named state and back. Source: megatron/core/tensor_parallel/random.py (0.19.2).
        """

        def add(self, name: str, seed: int) -> None:
            self._is_initialized = True
            if seed in self.seeds_:
                raise Exception(f"seed {seed} already exists")
            self.seeds_.add(seed)
            if name in self.states_:
                raise Exception(f"rng state {name} already exists")
            orig = torch.get_rng_state()
            torch.manual_seed(seed)
            self.states_[name] = torch.get_rng_state()
            torch.set_rng_state(orig)

        @contextlib.contextmanager
        def fork(self, name: str = "model-parallel-rng") -> Iterator[None]:
            if name not in self.states_:
                raise Exception(f"rng state {name} is not added")
            orig = torch.get_rng_state()
            orig_name = self._current_state_name
            if orig_name != "default-rng":
                self.states_[orig_name] = orig
            torch.set_rng_state(self.states_[name])
            self._current_state_name = name
            try:
                yield
            finally:
                self.states_[name] = torch.get_rng_state()
                if orig_name != "default-rng":
                    orig = self.states_[orig_name]
                torch.set_rng_state(orig)
                self._current_state_name = orig_name

    return CpuRNGStatesTracker


def _apply_rng() -> None:
    random = importlib.import_module(RNG_SHIM.module)
    originals = _state["originals"]
    originals[("rng", "CudaRNGStatesTracker")] = random.CudaRNGStatesTracker
    originals[("rng", "_get_cuda_rng_state")] = random._get_cuda_rng_state
    originals[("rng", "_set_cuda_rng_state")] = random._set_cuda_rng_state
    originals[("rng", "torch")] = random.torch
    random.CudaRNGStatesTracker = _make_cpu_tracker_class(random.CudaRNGStatesTracker)
    random._get_cuda_rng_state = _cpu_get_rng_state
    random._set_cuda_rng_state = _cpu_set_rng_state
    random.torch = CpuTorch()
    # A tracker made before apply() holds the CUDA class: make the next get_cuda_rng_tracker() rebuild it.
    random._CUDA_RNG_STATE_TRACKER = None
    random._CUDA_RNG_STATE_TRACKER_INITIALIZED = False


def _revert_rng() -> None:
    random = importlib.import_module(RNG_SHIM.module)
    originals = _state["originals"]
    for attr in ("CudaRNGStatesTracker", "_get_cuda_rng_state", "_set_cuda_rng_state", "torch"):
        setattr(random, attr, originals.pop(("rng", attr)))
    random._CUDA_RNG_STATE_TRACKER = None
    random._CUDA_RNG_STATE_TRACKER_INITIALIZED = False


# --------------------------------------------------------------------------- proxies, function shims
class _FusedAdamWOptim:
    """``torch.optim`` with ``AdamW`` / ``Adam`` built as torch's fused CPU kernel (``fused=True``)."""

    def __getattr__(self, name: str) -> Any:
        return getattr(torch.optim, name)

    @staticmethod
    def AdamW(*args: Any, **kwargs: Any) -> torch.optim.Optimizer:  # noqa: N802 (torch's name)
        kwargs.setdefault("fused", True)
        return torch.optim.AdamW(*args, **kwargs)

    @staticmethod
    def Adam(*args: Any, **kwargs: Any) -> torch.optim.Optimizer:  # noqa: N802 (torch's name)
        kwargs.setdefault("fused", True)
        return torch.optim.Adam(*args, **kwargs)


def _proxy_for(shim: Shim) -> CpuTorch:
    proxy = CpuTorch(_CpuAsTheDevice()) if shim.proxy == "cpu-is-the-device" else CpuTorch()
    if shim.proxy == "fused-adamw":
        proxy.optim = _FusedAdamWOptim()
    return proxy


def clip_grad_by_total_norm_fp32(parameters: Any, max_norm: float, total_norm: float,
                                 use_decoupled_grad: bool = False) -> None:
    """megatron-core's ``clip_grad_by_total_norm_fp32`` (optimizer/clip_grads.py:143) without its
    assertion that each gradient is a ``torch.cuda.FloatTensor``: gradients are scaled in place by
    ``max_norm / (total_norm + 1e-6)`` when that is below 1, with the same ``multi_tensor_applier``
    call (its CPU fallback, ``local_multi_tensor_scale``, when Apex is absent).

    Args:
        parameters: parameters (or one tensor) whose ``.grad`` (``.decoupled_grad``) is clipped.
        max_norm: the clipping threshold (``--clip-grad``).
        total_norm: the gradients' global L2 norm, from ``get_grad_norm_fp32``.
    """
    from megatron.core.optimizer import clip_grads

    if isinstance(parameters, torch.Tensor):
        parameters = [parameters]
    attr = "decoupled_grad" if use_decoupled_grad else "grad"
    grads = [clip_grads.to_local_if_dtensor(getattr(p, attr)).detach()
             for p in parameters if getattr(p, attr, None) is not None]
    clip_coeff = max_norm / (total_norm + 1.0e-6)
    if clip_coeff < 1.0 and grads:
        clip_grads.multi_tensor_applier(clip_grads.multi_tensor_scale_impl, torch.zeros(1, dtype=torch.int),
                                        [grads, grads], clip_coeff)


def _no_jit_warmup(tp_size: Any = None) -> None:
    """Megatron-LM's ``_warmup_jit_function`` compiles CUDA kernels; a CPU has none to warm up."""
    return None


_FUNCTION_REPLACEMENTS = {"clip_grad_by_total_norm": clip_grad_by_total_norm_fp32, "warmup_jit": _no_jit_warmup}


def _prebuilt_helpers_or_make() -> None:
    """``compile_helpers`` as the wheel needs it: nothing to build when ``helpers_cpp`` imports."""
    try:
        importlib.import_module("megatron.core.datasets.helpers_cpp")
    except ImportError:
        _state["originals"][("dataset_helpers", "compile_helpers")]()
    return None


def use_prebuilt_dataset_helpers() -> None:
    """Let ``initialize_megatron`` use the wheel's prebuilt dataset helpers instead of running ``make``
    (see :data:`WHEEL_SHIM`; idempotent; needed with the pip wheel on GPUs too). A source checkout
    of Megatron-LM, which has the Makefile and no prebuilt module, still builds them."""
    utils = importlib.import_module(WHEEL_SHIM.module)
    if utils.compile_helpers is not _prebuilt_helpers_or_make:
        _state["originals"][("dataset_helpers", "compile_helpers")] = utils.compile_helpers
        utils.compile_helpers = _prebuilt_helpers_or_make


def _state_dict_of_a_fresh_optimizer(original):
    """``DistributedOptimizer.state_dict`` that also works before torch's AdamW has stepped: it then holds no
    per-parameter state, and the state dict gets step 0, as torch's own optimizer would start from. Loading
    replaces it with the checkpoint's step (``load_state_dict`` reads it from the param groups)."""
    def state_dict(self):
        from megatron.core.optimizer import distrib_optimizer

        inner = self.optimizer
        params = [p for group in inner.param_groups for p in group["params"]]
        if distrib_optimizer.HAVE_APEX_OR_TE or len(inner.state) > 0 or not params:
            return original(self)
        inner.state[params[0]] = {"step": torch.tensor(0.0)}  # one step value for the assertion to find
        try:
            return original(self)
        finally:
            inner.state.clear()  # fresh again: load_state_dict allocates the real state
    return state_dict


def _load_with_a_step_per_parameter(original):
    """``DistributedOptimizer.load_state_dict`` whose AdamW states end with a step tensor each (equal values)."""
    def load_state_dict(self, state_dict):
        out = original(self, state_dict)
        for state in self.optimizer.state.values():
            if isinstance(state.get("step"), torch.Tensor):
                state["step"] = state["step"].clone()
        return out
    return load_state_dict


def _load_keeping_the_step(original):
    """``load_parameter_state_from_dp_reshardable`` under ``torch.no_grad()``, without the ``step`` tensors the
    loaded buckets carry (torch's AdamW keeps its step per parameter; the checkpoint's step is the param
    groups', which ``load_state_dict`` has restored already). Tensors of other names load as before."""
    def forget_steps(value: Any) -> None:
        if isinstance(value, dict):
            if "param" in value and isinstance(value.get("step"), torch.Tensor):
                value["step"] = None  # not a tensor: _set_main_param_and_optimizer_states skips it
            for item in value.values():
                forget_steps(item)
        elif isinstance(value, list):
            for item in value:
                forget_steps(item)

    @torch.no_grad()
    def load(self, state_dict):
        forget_steps(state_dict)
        return original(self, state_dict)
    return load


def resume_distributed_optimizer() -> None:
    """Let a ``--use-distributed-optimizer`` run resume from its checkpoint (see :data:`RESUME_SHIMS`): with
    torch's AdamW the state dict of a fresh optimizer gets step 0, each parameter its own step tensor, and the
    dp_reshardable format loads under ``torch.no_grad()`` and keeps the checkpoint's step. Idempotent; needed on
    GPUs too (torch's AdamW without TE or Apex; fp32 weights). Source: megatron/core/optimizer/distrib_optimizer.py."""
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    for shim, method, wrap in ((RESUME_SHIMS[0], "state_dict", _state_dict_of_a_fresh_optimizer),
                               (RESUME_SHIMS[1], "load_state_dict", _load_with_a_step_per_parameter),
                               (RESUME_SHIMS[2], "load_parameter_state_from_dp_reshardable", _load_keeping_the_step)):
        if (shim.name, method) not in _state["originals"]:
            original = getattr(DistributedOptimizer, method)
            _state["originals"][(shim.name, method)] = original
            setattr(DistributedOptimizer, method, functools.wraps(original)(wrap(original)))


# --------------------------------------------------------------------------- method shims
@contextlib.contextmanager
def _tensor_cuda_is_identity() -> Iterator[None]:
    original = torch.Tensor.cuda
    torch.Tensor.cuda = lambda self, *args, **kwargs: self  # type: ignore[method-assign]
    try:
        yield
    finally:
        torch.Tensor.cuda = original  # type: ignore[method-assign]


@contextlib.contextmanager
def _tensor_type_reports_cuda() -> Iterator[None]:
    """``Tensor.type()`` (no argument) names a CPU float tensor as its CUDA type: ``torch.cuda.FloatTensor``."""
    original = torch.Tensor.type

    def type_(self, *args: Any, **kwargs: Any) -> Any:
        name = original(self, *args, **kwargs)
        if not args and not kwargs and name in ("torch.FloatTensor", "torch.HalfTensor", "torch.BFloat16Tensor"):
            return "torch.cuda." + name[len("torch."):]
        return name

    torch.Tensor.type = type_  # type: ignore[method-assign]
    try:
        yield
    finally:
        torch.Tensor.type = original  # type: ignore[method-assign]


def _within(context):
    """A method wrapper that runs the method inside ``context``."""
    def wrap(original):
        def wrapped(self, *args: Any, **kwargs: Any) -> Any:
            with context():
                return original(self, *args, **kwargs)
        return wrapped
    return wrap


def _norm_marks_sequence_parallel(original):
    """``WrappedTorchNorm.__new__`` that builds torch's norm under sequence parallelism too, its weights marked
    ``sequence_parallel`` as Apex's and Transformer Engine's norms mark theirs: each tensor-parallel rank then
    normalises its own slice of the sequence, and ``finalize_model_grads`` sums the norm's gradients over them."""
    def wrapped(cls, config, *args: Any, **kwargs: Any) -> Any:
        if not config.sequence_parallel:
            return original(cls, config, *args, **kwargs)
        plain = copy.copy(config)
        plain.sequence_parallel = False  # the assertion's reason is the missing mark, added below
        norm = original(cls, plain, *args, **kwargs)
        for param in norm.parameters():
            param.sequence_parallel = True
        return norm
    return wrapped


#: How each method shim wraps its method.
_METHOD_WRAPPERS = {"language_module": _within(_tensor_cuda_is_identity),
                    "distrib_optimizer": _within(_tensor_type_reports_cuda), "torch_norm": _norm_marks_sequence_parallel}


def _apply_methods() -> None:
    for shim in _METHOD_SHIM_LIST:
        cls_name, method = METHOD_SHIMS[shim.name]
        cls = getattr(importlib.import_module(shim.module), cls_name)
        original = getattr(cls, method)
        _state["originals"][(shim.name, method)] = original
        wrapped = _METHOD_WRAPPERS[shim.name](original)
        wrapped.__name__ = method
        wrapped.__doc__ = original.__doc__
        setattr(cls, method, wrapped)


def _revert_methods() -> None:
    for shim in _METHOD_SHIM_LIST:
        cls_name, method = METHOD_SHIMS[shim.name]
        cls = getattr(importlib.import_module(shim.module), cls_name)
        setattr(cls, method, _state["originals"].pop((shim.name, method)))


# --------------------------------------------------------------------------- apply / revert
class _TrainingImportHook(importlib.abc.MetaPathFinder):
    """Installs :data:`TRAINING_SHIMS` the moment the ``megatron.training`` package finishes importing.

    Megatron-LM's ``pretrain_gpt.py`` imports ``megatron.training`` at its top, so a call of :func:`apply`
    placed before those imports would otherwise leave ``initialize_megatron``'s ``assert
    torch.cuda.is_available()`` (megatron/training/initialize.py:66) in place. The package's
    ``__init__`` imports ``initialize`` and ``training``; the hook patches once it has run.
    """

    def find_spec(self, fullname: str, path: Any = None, target: Any = None) -> Any:
        if fullname != "megatron.training":
            return None
        import sys

        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(fullname, path, target)
            if spec is not None:
                break
        else:
            return None
        exec_module = spec.loader.exec_module

        def exec_and_patch(module: Any) -> None:
            exec_module(module)
            _remove_hook()
            if _state["applied"] and not _state["training_applied"]:
                _patch(training=True)
                _state["training_applied"] = True

        spec.loader.exec_module = exec_and_patch  # this spec's own loader instance only
        return spec


def _install_hook() -> None:
    import sys

    if _state["hook"] is None:
        _state["hook"] = _TrainingImportHook()
        sys.meta_path.insert(0, _state["hook"])


def _remove_hook() -> None:
    import sys

    if _state["hook"] is not None:
        with contextlib.suppress(ValueError):
            sys.meta_path.remove(_state["hook"])
        _state["hook"] = None


def _is_training(module_name: str) -> bool:
    return module_name.startswith("megatron.training")


def _patch(training: bool) -> None:
    """Install the device and function shims of megatron-core (``training=False``) or of megatron.training."""
    for shim in (TRAINING_SHIMS if training else DEVICE_SHIMS):
        module = importlib.import_module(shim.module)
        _state["originals"][(shim.name, "torch")] = module.torch
        module.torch = _proxy_for(shim)
    for name, (module_name, attr) in FUNCTION_SHIMS.items():
        if _is_training(module_name) == training:
            module = importlib.import_module(module_name)
            _state["originals"][(name, attr)] = getattr(module, attr)
            setattr(module, attr, _FUNCTION_REPLACEMENTS[name])


def _unpatch(training: bool) -> None:
    for shim in (TRAINING_SHIMS if training else DEVICE_SHIMS):
        importlib.import_module(shim.module).torch = _state["originals"].pop((shim.name, "torch"))
    for name, (module_name, attr) in FUNCTION_SHIMS.items():
        if _is_training(module_name) == training:
            setattr(importlib.import_module(module_name), attr, _state["originals"].pop((name, attr)))


def apply(force: bool = False, training: bool | None = None) -> bool:
    """Patch megatron-core for CPU-only training (idempotent).

    Makes ``GPTModel`` (local spec), the RNG tracker, the pipeline schedules, ``DistributedDataParallel``,
    ``get_megatron_optimizer``, MoE routing, ``dist_checkpointing`` and ``megatron.training.pretrain``
    (:data:`TRAINING_SHIMS`) work on CPU over gloo. :data:`SHIMS` names the megatron-core 0.19.2 lines.

    Args:
        force: apply even when CUDA is available (tests only).
        training: ``True``: import ``megatron.training`` and patch it now; ``False``: leave it alone;
            default: patch it when it is imported (``apply()`` never imports it: its ``training.py``
            sets the root logger to INFO).

    Returns:
        True when the shims are (now) applied; False when CUDA is available and nothing
        was done.

    Warns:
        UserWarning: the installed megatron-core is not 0.19.2 (the shims may be stale).
    """
    import sys

    if not force and not needed():
        return False
    if training is None:
        training = "megatron.training" in sys.modules
        if not training and not _state["training_applied"]:
            _install_hook()
    if not _state["applied"]:
        from helpers.support.environment import package_version

        version = package_version("megatron-core")
        if version != MEGATRON_CORE_VERSION:
            warnings.warn(
                f"helpers.support.cpu_compat was written for megatron-core {MEGATRON_CORE_VERSION}, found {version}: "
                "run tests/test_cpu_compat.py to see which shims are still needed",
                stacklevel=2,
            )
        _patch(training=False)
        _apply_methods()
        _apply_rng()
        from helpers.support import run_guard

        run_guard.checkpoint_queue_in_process()  # not a CUDA matter: no helper process left behind by a save
        use_prebuilt_dataset_helpers()  # nor these two: so that Megatron-LM's own pretrain_gpt.py runs after apply()
        resume_distributed_optimizer()
        _state["applied"] = True
    if training and not _state["training_applied"]:
        _remove_hook()
        _patch(training=True)
        _state["training_applied"] = True
    return True


def revert() -> None:
    """Undo :func:`apply` (used by the tests to show each unpatched call still fails)."""
    _remove_hook()
    if _state["training_applied"]:
        _unpatch(training=True)
        _state["training_applied"] = False
    if not _state["applied"]:
        return
    _unpatch(training=False)
    _revert_methods()
    _revert_rng()
    _state["applied"] = False


@contextlib.contextmanager
def unpatched() -> Iterator[None]:
    """Temporarily undo the shims inside a ``with`` block (tests), re-applying them (and the
    RNG tracker that was in use) after."""
    random = importlib.import_module(RNG_SHIM.module)
    was, was_training, was_waiting = is_applied(), _state["training_applied"], _state["hook"] is not None
    tracker = (random._CUDA_RNG_STATE_TRACKER, random._CUDA_RNG_STATE_TRACKER_INITIALIZED)
    revert()
    try:
        yield
    finally:
        if was:
            apply(force=True, training=True if was_training else (None if was_waiting else False))
            random._CUDA_RNG_STATE_TRACKER, random._CUDA_RNG_STATE_TRACKER_INITIALIZED = tracker


def describe() -> list[str]:
    """One line per shim: ``name: file:line and the failing call`` (for notebooks and logs)."""
    return [f"{s.name}: {s.works_around}" for s in SHIMS]


def source_lines(shim: Shim) -> dict[int, str]:
    """The installed megatron-core's text of each line ``shim`` names (for the tests)."""
    import megatron.core

    path = Path(megatron.core.__file__).resolve().parent.parent.parent / shim.file
    text = path.read_text().splitlines()
    return {n: (text[n - 1] if n <= len(text) else "") for n in shim.lines}
