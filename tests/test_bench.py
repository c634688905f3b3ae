"""Unit tests of the helpers in bench/ (the benchmark runs themselves are not part of the suite)."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from bench import common
from bench import preprocess as bench_pre
from bench import series as bench_series
from bench import training as bench_train
from helpers.runner import preflight

pytestmark = pytest.mark.trains
ROOT = Path(__file__).resolve().parents[1]

ALLOC = "import numpy as np, time; a = np.ones({n}, dtype=np.uint8); time.sleep({s})"


# --------------------------------------------------------------------------- measuring processes
def test_run_measured_counts_the_peak_memory_of_the_whole_tree():
    child = ALLOC.format(n=150_000_000, s=1.0)
    parent = f"import subprocess, sys; subprocess.run([sys.executable, '-c', {child!r}], check=True)"
    m = common.run_measured([sys.executable, "-c", parent], timeout_s=60, sample_interval_s=0.02)
    assert m.returncode == 0
    assert m.wall_seconds >= 1.0
    assert m.peak_rss_bytes >= 150_000_000  # the grandchild's array, seen from the parent
    assert m.peak_rss_bytes < 1_500_000_000
    assert 0 < m.peak_pss_bytes <= m.peak_rss_bytes


def test_run_measured_kills_the_process_group_on_timeout(tmp_path):
    pid_file = tmp_path / "grandchild.pid"
    grandchild = "import time; time.sleep(60)"
    parent = (f"import subprocess, sys, time; p = subprocess.Popen([sys.executable, '-c', {grandchild!r}]); "
              f"open({str(pid_file)!r}, 'w').write(str(p.pid)); time.sleep(60)")
    start = time.perf_counter()
    with pytest.raises(common.BenchError, match="timeout_s=2"):
        common.run_measured([sys.executable, "-c", parent], timeout_s=2, what="a sleeper")
    assert time.perf_counter() - start < 20
    pid = int(pid_file.read_text())
    time.sleep(0.2)
    assert _gone(pid)


def _gone(pid: int) -> bool:
    """True when ``pid`` no longer runs (ended, or a zombie waiting to be reaped by its new parent)."""
    import psutil

    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def test_run_measured_failure_shows_the_stderr_tail():
    with pytest.raises(common.BenchError, match="status 3(.|\n)*boom"):
        common.run_measured([sys.executable, "-c", "import sys; print('boom', file=sys.stderr); sys.exit(3)"],
                            timeout_s=30, what="failing")
    m = common.run_measured([sys.executable, "-c", "import sys; sys.exit(3)"], timeout_s=30, check=False)
    assert m.returncode == 3


def test_interleaved_orders_alternate_the_sides():
    assert common.interleaved_orders(["a", "b"], 3) == [["a", "b"], ["b", "a"], ["a", "b"]]
    assert common.interleaved_orders(["a", "b", "c"], 2) == [["a", "b", "c"], ["b", "c", "a"]]
    with pytest.raises(ValueError):
        common.interleaved_orders(["a", "a"], 2)
    with pytest.raises(ValueError):
        common.interleaved_orders(["a"], 0)


def test_median_ratio_and_table():
    assert common.median([3.0, 1.0, 2.0]) == 2.0
    with pytest.raises(ValueError):
        common.median([])
    assert common.ratio(6.0, 2.0) == 3.0
    assert common.ratio(1.0, 0.0) != common.ratio(1.0, 0.0)  # NaN
    table = common.markdown_table(["side", "tokens/s"], [["ours", 1234567.0], ["ref", 2.5]])
    assert table.splitlines()[2] == "| ours | 1,234,567 |"
    assert table.splitlines()[3] == "| ref | 2.5 |"
    with pytest.raises(ValueError):
        common.markdown_table(["a", "b"], [[1]])


def test_machine_info_names_versions_and_load():
    info = common.machine_info()
    assert info["logical_cores"] >= 1
    assert info["packages"]["torch"] is not None
    assert len(info["load_average"]) == 3


# --------------------------------------------------------------------------- preprocessing
def _write_dataset(prefix: Path, docs: list[list[int]], dtype=np.uint16) -> None:
    from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder

    builder = IndexedDatasetBuilder(f"{prefix}.bin", dtype=dtype)
    for doc in docs:
        builder.add_document(np.array(doc, dtype=dtype), [len(doc)] if doc else [])
    builder.finalize(f"{prefix}.idx")


def test_compare_indexed_datasets_finds_identical_and_different_documents(tmp_path):
    docs = [[5, 6, 0], [7, 0], [8, 9, 10, 0]]
    _write_dataset(tmp_path / "a", docs)
    _write_dataset(tmp_path / "b", docs)
    same = bench_pre.compare_indexed_datasets(tmp_path / "a", tmp_path / "b")
    assert same["bin_identical"] and same["idx_identical"]
    assert same["documents"] == [3, 3] and same["tokens"] == [9, 9]
    assert same["documents_with_different_ids"] == 0 and same["first_different_document"] is None

    _write_dataset(tmp_path / "c", [[5, 6, 0], [7, 1], [8, 9, 10, 0]])
    diff = bench_pre.compare_indexed_datasets(tmp_path / "a", tmp_path / "c")
    assert not diff["bin_identical"]
    assert diff["documents_with_different_ids"] == 1 and diff["first_different_document"] == 1

    _write_dataset(tmp_path / "d", docs + [[]])  # Megatron's tool: an empty document, zero sequences
    more = bench_pre.compare_indexed_datasets(tmp_path / "a", tmp_path / "d")
    assert more["documents"] == [3, 4] and more["documents_with_different_ids"] == 1
    assert more["first_different_document"] == 3
    with pytest.raises(FileNotFoundError, match="did not finish"):
        bench_pre.compare_indexed_datasets(tmp_path / "a", tmp_path / "missing")


def test_megatron_checkout_is_checked_with_a_clear_message(tmp_path):
    with pytest.raises(FileNotFoundError, match="--megatron-lm"):
        bench_pre.check_megatron_checkout(None)
    with pytest.raises(FileNotFoundError, match="not a Megatron-LM checkout"):
        bench_pre.check_megatron_checkout(tmp_path)
    (tmp_path / "tools").mkdir()
    (tmp_path / "tools" / "preprocess_data.py").write_text("")
    (tmp_path / "megatron" / "core").mkdir(parents=True)
    assert bench_pre.check_megatron_checkout(tmp_path) == tmp_path / "tools" / "preprocess_data.py"


def test_megatron_command_and_progress_parsing():
    cmd = bench_pre.megatron_command("py", "tool.py", "in.json", "tok", "out/x", 2)
    assert cmd[:2] == ["py", "tool.py"]
    joined = " ".join(cmd)
    for flag in ("--tokenizer-type HuggingFaceTokenizer", "--tokenizer-model tok", "--json-keys content",
                 "--workers 2", "--append-eod", "--output-prefix out/x"):
        assert flag in joined
    stderr = ("Processed 1 documents (50.0 docs/s, 0.1 MB/s).\n"
              "Processed 800 documents (200.0 docs/s, 3.0 MB/s).\n")
    docs, seconds = bench_pre.parse_megatron_progress(stderr)
    assert docs == 800 and seconds == pytest.approx(4.0)
    with pytest.raises(ValueError, match="did not process"):
        bench_pre.parse_megatron_progress("Traceback ...")


def test_read_result_and_input_copies(tmp_path):
    assert common.read_result('noise\nBENCH_RESULT {"x": 1}\n') == {"x": 1}
    with pytest.raises(ValueError):
        common.read_result("nothing")
    src = tmp_path / "c.json"
    src.write_text('{"content": "a"}\n{"content": "b"}\n')
    assert bench_pre.input_file(src, 1, tmp_path) == src
    big = bench_pre.input_file(src, 3, tmp_path)
    assert big.read_text().count("\n") == 6 and big.stat().st_size == 3 * src.stat().st_size
    with pytest.raises(ValueError):
        bench_pre.input_file(src, 0, tmp_path)


def test_preprocess_cli_says_when_megatron_lm_is_absent(tmp_path, capsys):
    code = bench_pre.main(["--megatron-lm", str(tmp_path / "nowhere"), "--megatron-python", sys.executable,
                           "--run-dir", str(tmp_path / "run")])
    assert code == 2
    assert "not a Megatron-LM checkout" in capsys.readouterr().err
    assert not (tmp_path / "run").exists()  # nothing was made before the check
    with pytest.raises(SystemExit):
        bench_pre.main(["--run-dir", str(tmp_path / "run")])
    err = capsys.readouterr().err
    assert "--megatron-lm PATH (a Megatron-LM checkout) and --megatron-python PYTHON" in err


# --------------------------------------------------------------------------- training
def test_timed_iterations_drop_the_warmup():
    assert bench_train.timed_iterations([1.0, 3.0, 6.0], 0.0, 1) == [2.0, 3.0]
    with pytest.raises(ValueError, match="warmup"):
        bench_train.timed_iterations([1.0], 0.0, 1)


def test_mfu_and_peak_flops():
    assert preflight.peak_flops("NVIDIA H100 80GB HBM3") == 989e12
    assert preflight.peak_flops("NVIDIA A100-SXM4-80GB") == 312e12
    assert preflight.peak_flops("Some GPU") is None
    assert preflight.peak_flops("Some GPU", 100.0) == 100e12
    assert bench_train.mfu(1e9, 1e5, 1e15) == pytest.approx(0.1)
    assert bench_train.mfu(1e9, 1e5, None) is None


@pytest.mark.skipif(bench_train.cuda_available(), reason="checks the message printed without CUDA")
def test_training_gpu_path_says_cuda_is_absent(tmp_path):
    with pytest.raises(SystemExit, match="CUDA is not available"):
        bench_train.main(["--device", "cuda", "--run-dir", str(tmp_path)])


def test_training_config_is_the_same_for_both_sides(tmp_path):
    opts = {"profile": "cpu", "run_dir": str(tmp_path), "out_dir": str(tmp_path / "o"), "vocab_size": 8192,
            "seq_length": None, "micro_batch_size": 8, "global_batch_size": 16, "iters": 12}
    cfg = bench_train.training_config(opts)
    assert (cfg.model.num_layers, cfg.model.hidden_size, cfg.model.seq_length) == (4, 192, 128)  # the cpu profile: notebook 03's model
    assert cfg.global_batch_size // cfg.micro_batch_size == 2
    assert cfg.train_iters == 12 and cfg.save_interval is None


@pytest.mark.parametrize("bad", [["--repeats", "0"], ["--threads", "0"], ["--warmup", "-1"], ["--profile-steps", "-1"]])
def test_bad_numbers_are_refused_before_anything_runs(bad, capsys):
    with pytest.raises(SystemExit):
        bench_train.main(bad)
    assert f"{bad[0]}={bad[1]} must be" in capsys.readouterr().err


def test_profiled_steps_come_after_the_timed_ones(tmp_path):
    opts = {"profile": "cpu", "run_dir": str(tmp_path), "out_dir": str(tmp_path / "o"), "vocab_size": 8192,
            "seq_length": None, "micro_batch_size": None, "global_batch_size": None, "iters": 30, "profile_steps": 3}
    cfg = bench_train.training_config(opts)
    assert cfg.train_iters == 33 and cfg.decay_iters == 33  # the datasets and the schedule cover the profiled steps


def test_the_attribution_table_accounts_for_every_millisecond():
    assert bench_train.op_medians([{"aten::mm": 30.0, "aten::max": 2.0}, {"aten::mm": 34.0}]) == {
        "aten::mm": 32.0, "aten::max": 1.0}  # an operator missing from a run counts 0 there
    ops = {"megatron": {"aten::mm": 32.0, "aten::max": 2.4, "aten::add_": 1.6, "aten::gelu": 0.7},
           "trainer": {"aten::mm": 25.0, "aten::addmm": 5.0, "aten::_log_softmax": 2.1, "aten::gelu": 0.8}}
    table = bench_train.attribution_table(ops, top=2).splitlines()
    assert table[2] == "| aten::mm | 32.00 | 25.00 | +7.00 |"  # the largest difference first
    assert table[3] == "| aten::addmm | 0.00 | 5.00 | -5.00 |"
    assert table[4] == "| the other 4 operators | 4.70 | 2.90 | +1.80 |"
    assert table[5] == "| **total self CPU time per step** | 36.70 | 32.90 | +3.80 |"


def test_every_operator_lands_in_one_group():
    assert bench_train.op_category("aten::addmm") == "matrix multiplies"
    assert bench_train.op_category("aten::_log_softmax_backward_data") == "cross-entropy over the vocabulary"
    assert bench_train.op_category("aten::add_") == "gradient buffers: zero, copy, accumulate"
    assert bench_train.op_category("aten::add") == "other element-wise (add, mul, sum, cat)"
    assert bench_train.op_category("c10d::allreduce_") == "communication (gloo)"
    assert bench_train.op_category("aten::view").startswith("autograd, views")
    ops = {"megatron": {"aten::mm": 30.0, "aten::bmm": 2.0, "aten::max": 2.5, "aten::view": 0.5},
           "trainer": {"aten::addmm": 31.0, "aten::_log_softmax": 4.0, "aten::_scaled_dot_product_flash_attention_for_cpu": 1.5}}
    table = bench_train.category_table(ops).splitlines()
    assert table[2] == "| matrix multiplies | 32.00 | 31.00 | +1.00 |"
    assert table[3] == "| attention: softmax, mask, SDPA | 0.00 | 1.50 | -1.50 |"
    assert table[4] == "| cross-entropy over the vocabulary | 2.50 | 4.00 | -1.50 |"
    assert table[-1] == "| **total self CPU time per step** | 35.00 | 36.50 | -1.50 |"  # the groups add up to the totals


# --------------------------------------------------------------------------- series
def test_series_wall_times_from_summary(tmp_path):
    from helpers.support import results

    with pytest.raises(FileNotFoundError, match="run the series first"):
        bench_series.notebook_wall_times(tmp_path)
    results.record(tmp_path, "01_data", "wall_seconds", 100.0)
    results.record(tmp_path, "00_setup", "wall_seconds", 20.5)
    results.record(tmp_path, "00_setup", "other", 1)
    times = bench_series.notebook_wall_times(tmp_path)
    assert times == [("00_setup", 20.5), ("01_data", 100.0)]
    rep = bench_series.series_report(times, target_s=100.0)
    assert rep["total_seconds"] == 120.5 and rep["within_target"] is False
    assert rep["notebooks"][1]["share"] == pytest.approx(100.0 / 120.5)
    assert bench_series.series_report(times)["within_target"] is True


def test_count_pip_sources():
    out = ("Collecting torch==2.13.0\n  Processing /opt/wheels/torch-2.13.0-cp311.whl\n"
           "Collecting numpy\n  Using cached numpy-2.4.6.whl (16 MB)\n"
           "Collecting tqdm\n  Downloading tqdm-4.70.1-py3-none-any.whl (78 kB)\n"
           "  Using cached six.whl\n")
    assert bench_series.count_pip_sources(out) == {"cached": 2, "downloaded": 1, "local": 1}


def test_our_two_sides_name_their_engine_and_write_the_same_files(tmp_path, capsys):
    from helpers.learn import corpus, encoders, tokenizer

    texts = ["def f(x):\n    return x + 1\n", "s = '<|endoftext|>'  # a literal EOD string\n",
             "class A:\n    pass\n" * 20, "import os\nprint(os.sep)\n"]
    tok_dir = tokenizer.train_tokenizer(texts * 5, tmp_path / "tok", vocab_size=300)
    jsonl = tmp_path / "c.json"
    corpus.write_jsonl([corpus.Document(t, f"{i}.py") for i, t in enumerate(texts)], jsonl)
    info = {}
    for side, engine in bench_pre.ENGINE_OF.items():
        assert bench_pre.main(["_ours", str(jsonl), str(tok_dir), str(tmp_path / side), "2", engine]) == 0
        info[side] = common.read_result(capsys.readouterr().out)
    assert info["ours"]["engine"] == encoders.resolve_engine("auto")
    assert info["ours_tokenizers"]["engine"] == "tokenizers"
    assert info["ours"]["num_documents"] == 4 and info["ours"]["num_tokens"] == info["ours_tokenizers"]["num_tokens"]
    same = bench_pre.compare_indexed_datasets(tmp_path / "ours", tmp_path / "ours_tokenizers")
    assert same["documents_with_different_ids"] == 0 and same["bin_identical"] and same["idx_identical"]

    # Megatron-LM's tools turn the literal "<|endoftext|>" of document 1 into the EOD id: write
    # that encoding, plus a document 3 that differs for another reason, and check the diagnosis.
    import numpy as np
    from megatron.core.datasets.indexed_dataset import DType, IndexedDatasetBuilder

    mlm = tokenizer.load_fast_tokenizer(tok_dir)
    mlm.encode_special_tokens = False
    builder = IndexedDatasetBuilder(str(tmp_path / "mlm.bin"), dtype=DType.optimal_dtype(300))
    for i, t in enumerate(texts):
        ids = mlm.encode(t).ids + [0]
        builder.add_document(np.array(ids if i != 3 else ids[1:]), [len(ids) - (i == 3)])
    builder.finalize(str(tmp_path / "mlm.idx"))
    diff = bench_pre.compare_indexed_datasets(tmp_path / "ours", tmp_path / "mlm")
    assert diff["different_documents"] == [1, 3] and diff["documents_with_different_ids"] == 2
    assert bench_pre.literal_eod_explains(jsonl, tok_dir, tmp_path / "mlm", diff["different_documents"]) == {
        "checked": 2, "with_literal_eod": 1, "explained": 1}


def test_finish_writes_the_json_and_prints_the_report(tmp_path, capsys):
    status = common.finish({"ratio": 1.5}, tmp_path / "out" / "r.json", "| ratio | 1.5x |")
    assert status == 0
    assert json.loads((tmp_path / "out" / "r.json").read_text()) == {"ratio": 1.5}
    out = capsys.readouterr().out
    assert "| ratio | 1.5x |" in out and f"result: {tmp_path / 'out' / 'r.json'}" in out


@pytest.mark.skipif(bench_train.cuda_available(), reason="checks the message printed without CUDA")
def test_gpu_check_says_it_could_not_run_without_cuda(tmp_path, capsys):
    from bench import gpu_check

    assert gpu_check.main(["--run-dir", str(tmp_path / "g")]) == 2
    assert "could not run: CUDA is not available" in capsys.readouterr().err
    assert not (tmp_path / "g").exists()  # nothing was made
    for bad in (["--iters", "1"], ["--peak-tflops", "0"], ["--package-files", "-1"]):
        with pytest.raises(SystemExit):
            gpu_check.main(bad + ["--run-dir", str(tmp_path / "g")])
        assert bad[0] in capsys.readouterr().err


def test_gpu_smoke_runs_every_step_with_a_tiny_model_on_cpu(tmp_path):
    """make gpu-smoke's script with --cpu-smoke: the stack, notebook 00, bench.gpu_check (data, training, TP=2
    against TP=1, conversion), the way back with training on, and DP=2 against one process, with the real code paths."""
    record = tmp_path / "record.json"
    proc = subprocess.run([sys.executable, "-m", "bench.gpu_smoke", "--cpu-smoke", "--iters", "6", "--budget-s", "1200",
                           "--run-dir", str(tmp_path / "g"), "--record", str(record)],
                          cwd=ROOT, capture_output=True, text=True, timeout=1300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-2000:]
    r = json.loads(record.read_text())
    assert [n for n, s in r["steps"].items() if s["ok"]] == ["stack", "notebook_00", "training_and_conversion",
                                                             "way_back", "layout"]
    stack = r["steps"]["stack"]["result"]
    assert stack["gpus"] == 0 and stack["fused_weight_gradient_mlp_cuda"] is False and "target this machine" in stack["target"]
    result = r["gpu_check"]
    assert result["iterations"] == 6 and result["tokens_per_s"] > 0 and result["precision"] == "fp32"
    assert result["tensor_parallel"]["max_logit_difference"] < 1e-4 and result["tensor_parallel"]["argmax_agreement"] == 1.0
    conv = result["conversion"]
    assert conv["max_logit_difference"] < 1e-4 and conv["greedy_tokens_equal"] and conv["greedy_tokens"] > 0
    assert abs(conv["validation"]["hf_loss"] - conv["validation"]["megatron_loss_real_vocab"]) < 1e-5
    assert r["steps"]["way_back"]["result"]["iterations"] == 10
    layout = r["steps"]["layout"]["result"]
    assert len(layout["losses_2"]) == 6 and layout["max_difference"] < 1e-4  # DP=2 trains like one process
    assert "every step passed" in proc.stdout


def test_gpu_smoke_dry_run_prints_the_plan_and_imports_nothing_heavy(tmp_path):
    code = ("import sys; from bench import gpu_smoke; rc = gpu_smoke.main(['--dry-run', '--record', sys.argv[1]]); "
            "print('heavy:', sorted(m for m in ('torch', 'megatron', 'transformers') if m in sys.modules)); sys.exit(rc)")
    proc = subprocess.run([sys.executable, "-c", code, str(tmp_path / "r.json")], cwd=ROOT, capture_output=True,
                          text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert "make gpu-smoke: 5 steps, at most 300 s in all" in proc.stdout and "dry run: nothing was started" in proc.stdout
    assert "heavy: []" in proc.stdout and not (tmp_path / "r.json").exists()
    make = subprocess.run(["make", "-s", "gpu-smoke", "DRY_RUN=1"], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert make.returncode == 0 and "5. layout" in make.stdout, make.stderr


@pytest.mark.skipif(bench_train.cuda_available(), reason="checks the message printed without CUDA")
def test_gpu_smoke_says_it_could_not_run_without_cuda(tmp_path, capsys):
    from bench import gpu_smoke

    assert gpu_smoke.main(["--run-dir", str(tmp_path / "g"), "--record", str(tmp_path / "r.json")]) == 2
    assert "could not run: CUDA is not available" in capsys.readouterr().err
    assert not (tmp_path / "g").exists() and not (tmp_path / "r.json").exists()
