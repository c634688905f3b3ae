"""helpers.learn.rank_record (notebook 05b's probe) and helpers.demos.memory_toolbox's arithmetic, without a launch:
saved tensors counted once per storage and without the parameters, the peak over micro-batches in flight, the
optimizer's own tensors, the bubble of recorded events, Megatron-LM's printed estimate read back. The probe inside
Megatron-LM's loop is tested in tests/test_training.py (recomputation) and the smoke series (notebook 05b)."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from helpers.demos import memory_toolbox
from helpers.learn import rank_record


def test_saved_tensors_are_counted_once_per_storage_without_the_parameters():
    linear = torch.nn.Linear(8, 16)
    x = torch.randn(4, 8, requires_grad=True)
    with rank_record.SavedTensors(exclude=linear.parameters()) as saved:
        h = linear(x)  # saves x (its weight is a parameter, left out)
        y = torch.sigmoid(h)  # saves its output
        z = (y * y).sum()  # saves y twice: one storage
    assert saved.count == 2 and saved.bytes == 4 * 8 * 4 + 4 * 16 * 4
    z.backward()
    assert x.grad.shape == (4, 8)  # the hooks hand autograd the same tensors back
    with rank_record.SavedTensors(also_held=saved.storages) as again:
        (y * y).sum()  # y is already held by the micro-batch above: not counted twice
    assert again.count == 0


def test_the_peak_is_the_largest_sum_over_the_micro_batches_in_flight():
    def ev(kind, mb, start, saved=0, it=1, chunk=0):
        return {"kind": kind, "iteration": it, "chunk": chunk, "microbatch": mb, "start": start, "end": start + 0.5,
                "saved_bytes": saved}
    # 1F1B on a first stage of 2: F0 F1 B0 F2 B1 B2, 100 bytes each
    record = {"events": [ev("forward", 0, 0, 100), ev("forward", 1, 1, 100), ev("backward", 0, 2), ev("forward", 2, 3, 100),
                         ev("backward", 1, 4), ev("backward", 2, 5), ev("forward", 0, 0, 999, it=0)]}
    assert rank_record.activation_peak(record) == {"bytes": 200, "in_flight": 2, "max_in_flight": 2, "per_microbatch": 100}
    assert rank_record.activation_peak(record, iteration=0)["bytes"] == 999
    bubble = memory_toolbox.measured_bubble([record | {"pipeline_rank": 0}])
    # iteration 1: span 5.5 s, busy 6 x 0.5 = 3 s -> idle 2.5 s over 3 s
    assert bubble == {"bubble": pytest.approx(2.5 / 3), "iterations": 1}


def test_the_optimizers_own_tensors_are_counted_not_the_models():
    model = torch.nn.Linear(4, 4)
    opt = torch.optim.AdamW(model.parameters())
    model(torch.randn(2, 4)).sum().backward()
    opt.step()
    wrapper = type("MegatronOptimizer", (), {"optimizer": opt})()
    storages = {p.untyped_storage().data_ptr() for p in model.parameters()}
    assert rank_record.optimizer_state_bytes(wrapper, storages) == 8 * 20 + 2 * 4  # exp_avg, exp_avg_sq; 2 steps
    master = [p.detach().clone() for p in model.parameters()]  # bf16 training's fp32 copies are the optimizer's own
    wrapper.optimizer = torch.optim.AdamW(master)
    assert rank_record.optimizer_state_bytes(wrapper, storages) == 4 * 20


def test_megatron_lms_printed_estimate_is_read_back_in_bytes():
    log = "... Theoretical memory footprints: weight and optimizer=2.82 MB, activation=1.69 MB, total=4.52 MB\n"
    assert memory_toolbox.megatron_lm_printed(log) == {"states": 2.82 * 2 ** 20, "activations": 1.69 * 2 ** 20}
    assert memory_toolbox.megatron_lm_printed("no estimate") is None


def test_reading_a_run_without_records_names_the_variable(tmp_path):
    with pytest.raises(FileNotFoundError, match="SERIES_RANK_RECORD"):
        rank_record.read(tmp_path)


def test_a_record_without_events_or_iteration_is_named():
    with pytest.raises(ValueError, match="rank 3 recorded no forward or backward"):
        rank_record.activation_peak({"rank": 3, "events": []})
    event = {"kind": "forward", "iteration": 2, "chunk": 0, "microbatch": 0, "start": 0.0, "end": 1.0, "saved_bytes": 8}
    with pytest.raises(ValueError, match=r"rank 0 recorded no iteration 5: it recorded \[2\]"):
        rank_record.activation_peak({"rank": 0, "events": [event]}, iteration=5)
    with pytest.raises(ValueError, match="was the run recorded"):
        memory_toolbox.measured_bubble([{"rank": 0, "events": []}])


def test_every_technique_is_checked_before_any_launch(tmp_path):
    """Breaker (issue 29): a model of 2 layers cannot interleave 2 chunks on 2 pipeline ranks; the refusal names the
    technique and comes before the first launch, not after the runs before it have trained."""
    from helpers.learn import training_config

    base = training_config.profile("cpu", str(tmp_path), model={"num_layers": 2, "hidden_size": 64, "num_attention_heads": 4,
                                                                "seq_length": 64, "max_position_embeddings": 64},
                                   micro_batch_size=2, global_batch_size=8)
    with pytest.raises(ValueError, match=r"technique 'PP=2 interleaved v=2' \(TP=1 PP=2 DP=1, "
                                         r"num_virtual_stages_per_pipeline_rank=2\) cannot run .* nothing was launched"):
        memory_toolbox.run_techniques(base)
    assert not any(tmp_path.iterdir())
    memory_toolbox.check_techniques(replace(base, model=replace(base.model, num_layers=4)))
