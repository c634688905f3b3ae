"""helpers.cpu_compat: each shim is still needed (the unpatched megatron-core call fails on CPU)
and works once applied. When megatron-core stops needing a shim, a test here fails: delete
the shim and its test."""

from __future__ import annotations

import pytest
import torch

from helpers import cpu_compat

pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="the shims are for machines without CUDA")

CUDA_ERRORS = (AssertionError, RuntimeError)


@pytest.fixture(scope="module")
def dist1():
    """A one-process gloo group with megatron-core's parallel state (TP=PP=1), seeded."""
    from helpers import distributed

    info = distributed.initialize_distributed(1, 1, seed=1234)
    yield info
    distributed.destroy_distributed()


def _tiny_model():
    from megatron.core import tensor_parallel

    from helpers import model

    tensor_parallel.model_parallel_cuda_manual_seed(1234, force_reset_rng=True)
    cfg = model.ModelConfig(num_layers=1, hidden_size=32, num_attention_heads=2, seq_length=16,
                            max_position_embeddings=16, vocab_size=100)
    return model.build_model(cfg)


@pytest.mark.parametrize("shim", cpu_compat.SHIMS, ids=lambda s: s.name)
def test_named_lines_still_hold_the_cuda_only_call(shim):
    """The megatron-core lines each shim names still make the CUDA-only call it works around."""
    from helpers.environment import package_version

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
    if "current_device" in snippet:
        return lambda: torch.empty(1, device=module.torch.cuda.current_device())
    if "current_stream" in snippet:
        return lambda: module.torch.cuda.current_stream()
    if "synchronize" in snippet:
        return lambda: module.torch.cuda.synchronize()
    if "get_rng_state" in snippet:
        return lambda: module.torch.cuda.get_rng_state()
    return lambda: module.torch.zeros([], dtype=torch.int, device="cuda")


def _original_code(module):
    cls_name, method = cpu_compat.METHOD_SHIMS["language_module"]
    original = cpu_compat._state["originals"].get(("language_module", method))
    return (original or getattr(getattr(module, cls_name), method)).__code__


@pytest.mark.parametrize("shim", cpu_compat.SHIMS, ids=lambda s: s.name)
def test_unpatched_call_fails_patched_call_runs(shim):
    """Each named call raises on CPU without the shim and runs on the CPU with it."""
    import importlib

    module = importlib.import_module(shim.module)
    cpu_compat.apply()
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
