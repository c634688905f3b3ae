"""helpers.support.cpu_compat: each shim is still needed (the unpatched megatron-core call fails on CPU)
and works once applied. When megatron-core stops needing a shim, a test here fails: delete
the shim and its test."""

from __future__ import annotations

import contextlib

import pytest
import torch

from helpers.support import cpu_compat

pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="the shims are for machines without CUDA")

CUDA_ERRORS = (AssertionError, RuntimeError)


@pytest.fixture(scope="module")
def dist1():
    """A one-process gloo group with megatron-core's parallel state (TP=PP=1), seeded."""
    from helpers.learn import distributed

    info = distributed.initialize_distributed(1, 1, seed=1234)
    yield info
    distributed.destroy_distributed()


def _tiny_model():
    from megatron.core import tensor_parallel

    from helpers.learn import model

    tensor_parallel.model_parallel_cuda_manual_seed(1234, force_reset_rng=True)
    cfg = model.ModelConfig(num_layers=1, hidden_size=32, num_attention_heads=2, seq_length=16,
                            max_position_embeddings=16, vocab_size=100)
    return model.build_model(cfg)


@pytest.mark.parametrize("shim", cpu_compat.SHIMS + (cpu_compat.WHEEL_SHIM,) + cpu_compat.RESUME_SHIMS,
                         ids=lambda s: s.name)
def test_named_lines_still_hold_the_cuda_only_call(shim):
    """The megatron-core lines each shim names still make the CUDA-only call it works around."""
    from helpers.support.environment import package_version

    assert package_version("megatron-core") == cpu_compat.MEGATRON_CORE_VERSION
    source = cpu_compat.source_lines(shim)
    for line, snippet in shim.lines.items():
        assert snippet in source[line], f"{shim.file}:{line} no longer has {snippet!r}: {source[line]!r}"


def _failing_expression(module, snippet: str):
    if snippet.endswith(".cuda()"):  # method shim: Tensor.cuda() inside the wrapped method only
        cls_name, method = cpu_compat.METHOD_SHIMS["language_module"]

        def probe():
            current = getattr(getattr(module, cls_name), method)
            if cpu_compat.is_applied():
                if current.__code__ is _original_code(module):
                    raise LookupError("the method shim is not installed")
                with cpu_compat._tensor_cuda_is_identity():
                    return torch.zeros(1).cuda()
            if current.__code__ is not _original_code(module):
                raise LookupError("the method shim was not reverted")
            return torch.zeros(1).cuda()

        return probe
    cuda = lambda: module.torch.cuda  # noqa: E731 (the module's torch.cuda at call time: patched or not)
    if "is_available" in snippet:
        return lambda: _none(assert_true(cuda().is_available()))
    if "device_count" in snippet:
        return lambda: _none(assert_true(cuda().device_count() > 0))
    if "set_device" in snippet:
        return lambda: cuda().set_device(0)
    if "get_device_properties" in snippet:
        return lambda: _none(cuda().get_device_properties(torch.device("cuda:0")).major)
    if snippet == "torch.cuda.Stream()":
        return lambda: cuda().Stream()
    if "torch.cuda.stream(" in snippet:
        def enter_stream():
            with cuda().stream(cuda().Stream()):
                return None
        return enter_stream
    if "current_device" in snippet:
        return lambda: torch.empty(1, device=module.torch.cuda.current_device())
    if "current_stream" in snippet:
        return lambda: module.torch.cuda.current_stream()
    if "synchronize" in snippet:
        return lambda: module.torch.cuda.synchronize()
    if "get_rng_state" in snippet:
        return lambda: module.torch.cuda.get_rng_state()
    return lambda: module.torch.zeros([], dtype=torch.int, device="cuda")


def assert_true(value):
    assert value
    return value


def _none(_):
    return None


def _original_code(module):
    cls_name, method = cpu_compat.METHOD_SHIMS["language_module"]
    original = cpu_compat._state["originals"].get(("language_module", method))
    return (original or getattr(getattr(module, cls_name), method)).__code__


#: Shims tested by their own test below: a function replaced, or a faster kernel rather than a failure.
_OWN_TEST = {"clip_grad_by_total_norm", "warmup_jit", "fused_adamw", "distrib_optimizer", "torch_norm"}


def test_torch_norms_build_under_sequence_parallelism_with_their_weights_marked():
    """megatron-core refuses torch's norms under --sequence-parallel (torch_norm.py:50); the shim builds them
    and marks their weights ``sequence_parallel``, so finalize_model_grads sums their gradients over the
    tensor-parallel ranks (tests/test_training.py trains TP=2 with it)."""
    from megatron.core.transformer import TransformerConfig
    from megatron.core.transformer.torch_norm import WrappedTorchNorm

    config = TransformerConfig(num_layers=1, hidden_size=8, num_attention_heads=2, normalization="RMSNorm",
                               use_cpu_initialization=True)
    config.sequence_parallel = True  # as Megatron-LM sets it for TP > 1; the config's own checks want a TP group
    cpu_compat.apply()
    norm = WrappedTorchNorm(config, 8)
    assert isinstance(norm, torch.nn.RMSNorm) and all(p.sequence_parallel for p in norm.parameters())
    original = cpu_compat._state["originals"][("torch_norm", "__new__")]
    with pytest.raises(AssertionError, match="sequence parallel not supported by torch LayerNorm"):
        original(WrappedTorchNorm, config, 8)
    config.sequence_parallel = False
    assert not hasattr(WrappedTorchNorm(config, 8).weight, "sequence_parallel")


def test_the_distributed_optimizer_sees_cuda_types_only_inside_its_constructor():
    """The shim of --use-distributed-optimizer: inside DistributedOptimizer.__init__ a CPU float tensor names
    its CUDA type (the constructor sorts and refuses parameters by it); outside, types are untouched.
    tests/test_training.py trains with it on two ranks."""
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    cpu_compat.apply()
    assert DistributedOptimizer.__init__ is not cpu_compat._state["originals"][("distrib_optimizer", "__init__")]
    with cpu_compat._tensor_type_reports_cuda():
        assert torch.zeros(1).type() == "torch.cuda.FloatTensor" and torch.zeros(1, dtype=torch.int64).type() == "torch.LongTensor"
    assert torch.zeros(1).type() == "torch.FloatTensor"


@pytest.mark.parametrize("shim", [s for s in cpu_compat.SHIMS if s.name not in _OWN_TEST], ids=lambda s: s.name)
def test_unpatched_call_fails_patched_call_runs(shim):
    """Each named call raises on CPU without the shim and runs on the CPU with it."""
    import importlib

    module = importlib.import_module(shim.module)
    cpu_compat.apply(training=shim.module.startswith("megatron.training"))
    for snippet in set(shim.lines.values()):
        call = _failing_expression(module, snippet)
        with cpu_compat.unpatched():
            with pytest.raises(CUDA_ERRORS):
                call()
        out = call()
        if isinstance(out, torch.cpu.Stream):
            continue
        assert out is None or out.device.type == "cpu"
    with pytest.raises(CUDA_ERRORS):  # nothing leaks out of a method shim
        torch.zeros(1).cuda()


def test_causal_mask_end_to_end():
    from megatron.core.transformer import utils

    cpu_compat.apply()
    with cpu_compat.unpatched():
        with pytest.raises(CUDA_ERRORS):
            utils.get_default_causal_mask.__wrapped__(5) if hasattr(utils.get_default_causal_mask, "__wrapped__") \
                else utils.get_default_causal_mask(5)
    mask = (utils.get_default_causal_mask.__wrapped__ if hasattr(utils.get_default_causal_mask, "__wrapped__")
            else utils.get_default_causal_mask)(5)
    assert mask.device.type == "cpu"
    assert torch.equal(mask, torch.triu(torch.ones(5, 5), diagonal=1).bool())


def test_global_memory_buffer_end_to_end():
    from megatron.core.utils import GlobalMemoryBuffer

    cpu_compat.apply()
    with cpu_compat.unpatched():
        with pytest.raises(CUDA_ERRORS):
            GlobalMemoryBuffer().get_tensor((2, 3), torch.float32, "probe")
    t = GlobalMemoryBuffer().get_tensor((2, 3), torch.float32, "probe")
    assert t.shape == (2, 3) and t.device.type == "cpu"


def test_rng_tracker_seeds_streams_like_megatron(dist1):
    """Unpatched model_parallel_cuda_manual_seed fails; patched, the tracker's streams are the
    seeds megatron-core uses (data-parallel seed, tensor-parallel seed + 2718 + tp_rank)."""
    from megatron.core import tensor_parallel
    from megatron.core.tensor_parallel import random as mrandom

    cpu_compat.apply()
    with cpu_compat.unpatched():
        with pytest.raises(CUDA_ERRORS):
            tensor_parallel.model_parallel_cuda_manual_seed(7, force_reset_rng=True)
    tensor_parallel.model_parallel_cuda_manual_seed(7, force_reset_rng=True)
    tracker = tensor_parallel.get_cuda_rng_tracker()
    assert type(tracker).__name__ == "CpuRNGStatesTracker"
    before = torch.get_rng_state()
    with tracker.fork():
        inside = torch.rand(4)
    assert torch.equal(torch.get_rng_state(), before), "fork() must restore the default stream"
    torch.manual_seed(7 + 2718)
    assert torch.equal(inside, torch.rand(4)), "model-parallel stream is seed + 2718 + tp_rank"
    with tracker.fork():
        second = torch.rand(4)
    assert not torch.equal(inside, second), "the stream advances between forks"
    assert mrandom._MODEL_PARALLEL_RNG_TRACKER_NAME in tracker.get_states()


def test_schedule_end_to_end(dist1):
    """get_forward_backward_func() at PP=1 fails unpatched (schedules.py:2292) and runs patched."""
    from megatron.core.pipeline_parallel import get_forward_backward_func

    cpu_compat.apply()
    model = _tiny_model()
    tokens = torch.randint(0, 100, (2, 16))
    pos = torch.arange(16).expand(2, 16)

    def step(it, m):
        b = next(it)
        out = m(b, pos, None, labels=b)
        return out, lambda o: (o.mean(), {"lm loss": o.mean().detach().clone()})

    def run():
        return get_forward_backward_func()(forward_step_func=step, data_iterator=iter([tokens]), model=[model],
                                           num_microbatches=1, seq_length=16, micro_batch_size=2, forward_only=True)

    with cpu_compat.unpatched():
        with pytest.raises(CUDA_ERRORS):
            run()
    losses = run()
    assert len(losses) == 1 and 3.0 < float(losses[0]["lm loss"]) < 6.0  # ~ln(128) at init


def test_apply_is_idempotent_and_revertible():
    import megatron.core.pipeline_parallel.schedules as schedules

    assert cpu_compat.needed() is (not torch.cuda.is_available())
    assert cpu_compat.apply() is True and cpu_compat.apply() is True
    assert isinstance(schedules.torch, cpu_compat.CpuTorch)
    cpu_compat.revert()
    assert schedules.torch is torch and not cpu_compat.is_applied()
    cpu_compat.apply()
    assert cpu_compat.is_applied()


def test_cpu_torch_redirects_only_cuda():
    proxy = cpu_compat.CpuTorch()
    assert proxy.zeros(2, device="cuda").device.type == "cpu"
    assert proxy.zeros(2, device=torch.device("cuda", 0)).device.type == "cpu"
    assert proxy.zeros(2, device="meta").device.type == "meta"
    assert proxy.float32 is torch.float32 and proxy.Tensor is torch.Tensor
    assert proxy.cuda.current_device() == torch.device("cpu")
    assert proxy.cuda.is_available() is torch.cuda.is_available()


def test_clip_grad_by_total_norm_asserts_cuda_unpatched_and_scales_patched():
    """megatron-core's clip asserts torch.cuda.FloatTensor gradients (clip_grads.py:174); the
    replacement scales them by max_norm / (total_norm + 1e-6), as the original does on a GPU."""
    from megatron.core.optimizer import clip_grads, optimizer

    cpu_compat.apply()
    p = torch.nn.Parameter(torch.zeros(3))
    p.grad = torch.tensor([3.0, 4.0, 0.0])
    with cpu_compat.unpatched():
        with pytest.raises(AssertionError):
            optimizer.clip_grad_by_total_norm_fp32([p], 1.0, 5.0)
    optimizer.clip_grad_by_total_norm_fp32([p], 1.0, 5.0)
    assert torch.allclose(p.grad, torch.tensor([3.0, 4.0, 0.0]) / (5.0 + 1e-6), rtol=0, atol=1e-7)
    before = p.grad.clone()
    optimizer.clip_grad_by_total_norm_fp32([p], 10.0, 1.0)  # below the threshold: untouched
    assert torch.equal(p.grad, before)
    assert optimizer.clip_grad_by_total_norm_fp32 is cpu_compat.clip_grad_by_total_norm_fp32
    assert clip_grads.clip_grad_by_total_norm_fp32 is not cpu_compat.clip_grad_by_total_norm_fp32


def test_jit_warmup_would_draw_from_the_weights_generator():
    """Megatron-LM's _warmup_jit_function draws torch.rand on 'cuda' (initialize.py:509, 518): on a
    CPU, behind the device proxy, those draws move the generator that then initialises the weights."""
    from argparse import Namespace

    from megatron.training import global_vars, initialize

    cpu_compat.apply(training=True)
    args = Namespace(bf16=False, fp16=False, ffn_hidden_size=16, tensor_model_parallel_size=1, seq_length=4,
                     context_parallel_size=1, micro_batch_size=1, swiglu=False, sequence_parallel=False, hidden_size=4)
    saved = global_vars._GLOBAL_ARGS
    global_vars._GLOBAL_ARGS = args
    try:
        original = cpu_compat._state["originals"][("warmup_jit", "_warmup_jit_function")]
        torch.manual_seed(0)
        seeded = torch.get_rng_state()
        original()
        assert not torch.equal(torch.get_rng_state(), seeded), "the original warm-up draws from the CPU generator"
        torch.manual_seed(0)
        initialize._warmup_jit_function()
        assert torch.equal(torch.get_rng_state(), seeded), "the shimmed warm-up leaves the generator alone"
    finally:
        global_vars._GLOBAL_ARGS = saved


def test_fused_adamw_is_the_same_numbers_faster():
    """Unpatched, Megatron-LM's optimizer on a CPU is torch's for-loop AdamW; patched, torch's fused
    AdamW, whose steps agree to float32 rounding: a few elements differ by an ulp or two of the weights' scale
    (on a 2-core AMD EPYC, 25 of 2,048 elements by at most 2.4e-7, one of them 1.6e-6 relative to its small
    value; on the Intel Xeon within 1e-6 relative), so the bound is relative plus 4 float32 epsilons absolute."""
    import megatron.core.optimizer as mopt

    cpu_compat.apply()
    made = {}
    for label, ctx in (("loop", cpu_compat.unpatched()), ("fused", contextlib.nullcontext())):
        with ctx:
            torch.manual_seed(0)
            params = [torch.nn.Parameter(torch.randn(64, 32)), torch.nn.Parameter(torch.randn(32))]
            opt = mopt.torch.optim.AdamW(params, lr=1e-2, weight_decay=0.1)
            for step in range(3):
                for q in params:
                    q.grad = torch.full_like(q, 0.01 * (step + 1)) + 0.001 * q.detach()
                opt.step()
            made[label] = (opt.defaults.get("fused"), [q.detach().clone() for q in params])
    assert not made["loop"][0] and made["fused"][0] is True
    eps = torch.finfo(torch.float32).eps
    assert all(torch.allclose(a, b, rtol=1e-6, atol=4 * eps) for a, b in zip(made["loop"][1], made["fused"][1]))
    assert any(not torch.equal(a, b) for a, b in zip(made["loop"][1], made["fused"][1]))  # two implementations ran


def test_the_wheel_lacks_the_dataset_helpers_makefile():
    """initialize_megatron runs compile_helpers (make) on rank 0, which exits: the wheel has no
    Makefile but ships helpers_cpp prebuilt; use_prebuilt_dataset_helpers skips the build."""
    from megatron.core.datasets import utils

    original = cpu_compat._state["originals"].get(("dataset_helpers", "compile_helpers"), utils.compile_helpers)
    with pytest.raises(SystemExit):
        original()
    cpu_compat.use_prebuilt_dataset_helpers()
    cpu_compat.use_prebuilt_dataset_helpers()  # idempotent
    assert utils.compile_helpers() is None


def test_megatron_training_is_patched_only_in_a_process_that_runs_it():
    """megatron/training/training.py sets the root logger to INFO when imported: a notebook that only
    uses megatron-core must not import it through apply(). A fresh process shows both cases."""
    import subprocess
    import sys

    probe = ("import logging, sys\nfrom helpers.support import cpu_compat\ncpu_compat.apply()\n"
             "print('megatron.training.training' in sys.modules, logging.getLogger().level)\n"
             "import megatron.training.training\ncpu_compat.apply()\n"
             "print(cpu_compat._state['training_applied'], type(megatron.training.initialize.torch).__name__)")
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=300,
                         cwd=str(__import__("pathlib").Path(__file__).resolve().parent.parent))
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split() == ["False", "30", "True", "CpuTorch"]


def test_moe_router_end_to_end(dist1):
    """A mixture of experts' router moves its weight to torch.cuda.current_device() at its first forward
    (moe/router.py:98): unpatched that fails on a CPU; patched it stays on the CPU and scores every expert.
    tests/test_moe.py trains with it on two expert-parallel ranks."""
    from megatron.core.transformer import TransformerConfig
    from megatron.core.transformer.moe.moe_layer import get_default_pg_collection
    from megatron.core.transformer.moe.router import TopKRouter

    cpu_compat.apply()
    config = TransformerConfig(num_layers=1, hidden_size=8, num_attention_heads=2, num_moe_experts=4, moe_router_topk=2,
                               add_bias_linear=False, use_cpu_initialization=True)
    router = TopKRouter(config, pg_collection=get_default_pg_collection())
    tokens = torch.randn(3, 2, 8)
    with cpu_compat.unpatched():
        with pytest.raises(CUDA_ERRORS):
            router.gating(tokens)
    logits = router.gating(tokens)
    assert logits.shape == (3, 2, 4) and router.weight.device.type == "cpu"
    probs, routing_map = router(tokens)
    assert probs.shape == routing_map.shape == (6, 4) and routing_map.sum(dim=1).eq(2).all()


def test_apply_before_megatron_training_is_imported_patches_it_on_import():
    """The README's recipe for Megatron-LM's own pretrain_gpt.py: cpu_compat.apply() first, then the script's
    `from megatron.training import ...`. apply() alone leaves megatron.training unimported (root logger at
    WARNING, 30); the import installs the shims, so initialize_megatron's `assert torch.cuda.is_available()`
    (initialize.py:66) sees the CPU as the device, and the JIT warm-up on CUDA tensors is replaced; the wheel's
    prebuilt dataset helpers are used instead of `make` (which exits). Tried against Megatron-LM's own
    pretrain_gpt.py (core_v0.19.0) with the series' CPU flags: it then stops in get_batch's `.cuda()`, as the
    README says."""
    import subprocess
    import sys

    probe = ("import logging, sys\nfrom helpers.support import cpu_compat\nprint(cpu_compat.apply())\n"
             "print('megatron.training' in sys.modules, logging.getLogger().level)\n"
             "from megatron.training import initialize_megatron, pretrain\n"
             "from megatron.training import initialize, training, checkpointing\n"
             "print(cpu_compat._state['training_applied'], cpu_compat._state['hook'] is None)\n"
             "print(type(initialize.torch).__name__, initialize.torch.cuda.is_available(),\n"
             "      initialize.torch.cuda.device_count(), type(training.torch).__name__,\n"
             "      type(checkpointing.torch).__name__)\n"
             "print(initialize._warmup_jit_function is cpu_compat._no_jit_warmup,\n"
             "      initialize_megatron.__globals__['torch'] is initialize.torch)\n"
             "from megatron.core.datasets import utils\nprint(utils.compile_helpers())\n"
             "cpu_compat.revert()\nprint(initialize.torch.cuda.is_available())\n")
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=300,
                         cwd=str(__import__("pathlib").Path(__file__).resolve().parent.parent))
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split() == ["True", "False", "30", "True", "True", "CpuTorch", "True", "1", "CpuTorch",
                                  "CpuTorch", "True", "True", "None", "False"]


def _distributed_optimizer():
    """megatron-core's DistributedOptimizer (torch's AdamW, fp32) over a tiny GPT, as Megatron-LM builds it."""
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

    gpt = _tiny_model()
    ddp = DistributedDataParallel(gpt.config, DistributedDataParallelConfig(use_distributed_optimizer=True), gpt)
    optimizer = get_megatron_optimizer(OptimizerConfig(optimizer="adam", lr=1e-3, use_distributed_optimizer=True), [ddp])
    return optimizer.chained_optimizers[0] if hasattr(optimizer, "chained_optimizers") else optimizer


def _buckets(opt):
    """The optimizer's dp_reshardable state, each entry marked as the checkpoint marks it (no padding)."""
    state = opt.get_parameter_state_dp_reshardable()
    for dtypes in (v for k, v in state.items() if isinstance(k, int)):
        for buckets in dtypes.values():
            for bucket in buckets:
                for entry in bucket:
                    entry["padding"] = False
    return state


def _one_step(opt):
    for group in opt.optimizer.param_groups:
        for p in group["params"]:
            p.grad = torch.full_like(p, 0.01)
    opt.optimizer.step()


def test_a_distributed_optimizer_resumes_with_torch_adam(dist1):
    """Issue 39: without TE or Apex, megatron-core's DistributedOptimizer could not be resumed. Unpatched, each of
    the three steps of a load fails: a fresh optimizer's state_dict asserts (no AdamW step yet), load_state_dict
    gives all parameters one shared step tensor (torch then counts a step per parameter), and the dp_reshardable
    load copies into fp32 views of the weights outside no_grad and puts the planned state's step back.
    tests/test_training.py resumes whole runs and compares their losses with uninterrupted ones."""
    from megatron.core.optimizer import distrib_optimizer
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    assert not distrib_optimizer.HAVE_APEX_OR_TE
    cpu_compat.apply()
    cpu_compat.resume_distributed_optimizer()
    cpu_compat.resume_distributed_optimizer()  # idempotent
    originals = {method: cpu_compat._state["originals"][(shim.name, method)] for shim, method in
                 zip(cpu_compat.RESUME_SHIMS, ("state_dict", "load_state_dict", "load_parameter_state_from_dp_reshardable"))}

    fresh = _distributed_optimizer()
    with pytest.raises(AssertionError):
        originals["state_dict"](fresh)
    planned = fresh.state_dict()  # patched: the fresh optimizer says step 0 and stays empty
    assert {g["step"] for g in planned["optimizer"]["param_groups"]} == {0} and len(fresh.optimizer.state) == 0

    trained = _distributed_optimizer()
    _one_step(trained)
    saved = trained.state_dict()
    assert {g["step"] for g in saved["optimizer"]["param_groups"]} == {1}

    shared = _distributed_optimizer()
    originals["load_state_dict"](shared, saved)
    assert len({id(s["step"]) for s in shared.optimizer.state.values()}) == 1 < len(shared.optimizer.state)
    fresh.load_state_dict(saved)  # patched: one step tensor per parameter, each at the saved step
    steps = [s["step"] for s in fresh.optimizer.state.values()]
    assert len({id(t) for t in steps}) == len(steps) > 1 and {t.item() for t in steps} == {1.0}

    with pytest.raises(RuntimeError, match="leaf Variable"):
        originals["load_parameter_state_from_dp_reshardable"](fresh, _buckets(trained))
    planned_buckets = _buckets(fresh)  # what a load plans on: this optimizer's own tensors, its step included
    for dtypes in (v for k, v in planned_buckets.items() if isinstance(k, int)):
        for buckets in dtypes.values():
            for bucket, theirs in zip(buckets, _buckets(trained)[0][next(iter(dtypes))]):
                for entry, src in zip(bucket, theirs):
                    entry.update({k: src[k].clone() for k in ("param", "exp_avg", "exp_avg_sq")}, step=torch.tensor(0.0))
    fresh.load_parameter_state_from_dp_reshardable(planned_buckets)
    for mine, theirs in zip(fresh.optimizer.state.values(), trained.optimizer.state.values()):
        assert torch.equal(mine["exp_avg"], theirs["exp_avg"]) and torch.equal(mine["exp_avg_sq"], theirs["exp_avg_sq"])
    assert {s["step"].item() for s in fresh.optimizer.state.values()} == {1.0}
    assert DistributedOptimizer.state_dict.__doc__ == originals["state_dict"].__doc__
