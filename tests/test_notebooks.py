"""Notebook hygiene (shape, stripped outputs, parameters) and the end-to-end papermill run."""

from __future__ import annotations

import ast
import json
import re

import nbformat
import pytest

from helpers.learn import encoders, preprocess
from helpers.runner import series
from helpers.support import results

NOTEBOOKS = series.notebooks()
IDS = [p.stem for p in NOTEBOOKS]
REQUIRED_HEADINGS = ("## Summary", "## What's next", "## Exercises", "## References")


def _read(path):
    return nbformat.read(path, as_version=4)


def test_series_is_numbered_from_00_without_gaps():
    """NN_name, numbered from 00 without gaps; a notebook inserted after NN is NNb_name (05b), right after NN."""
    stems = [p.stem.split("_")[0] for p in NOTEBOOKS]
    numbers = [int(s) for s in stems if s.isdigit()]
    assert numbers == list(range(len(numbers))), stems
    inserted = [i for i, s in enumerate(stems) if not s.isdigit()]
    assert all(re.fullmatch(r"\d\db", stems[i]) and stems[i - 1] == stems[i][:2] for i in inserted), stems
    assert all(re.fullmatch(r"\d\db?_[a-z0-9_]+", p.stem) for p in NOTEBOOKS)


@pytest.mark.parametrize("path", NOTEBOOKS, ids=IDS)
def test_outputs_are_stripped(path):
    nb = _read(path)
    dirty = [i for i, c in enumerate(nb.cells) if c.cell_type == "code" and (c.outputs or c.execution_count)]
    assert not dirty, f"{path.name}: cells {dirty} have outputs or execution counts; strip them before committing"
    assert "widgets" not in nb.metadata and "colab" not in nb.metadata
    raw = json.loads(path.read_text(encoding="utf-8"))
    missing = [i for i, c in enumerate(raw["cells"]) if "id" not in c]
    assert not missing, f"{path.name}: cells {missing} have no id (nbformat 4.5 warns on every read)"


@pytest.mark.parametrize("path", NOTEBOOKS, ids=IDS)
def test_title_cell_and_closing_sections(path):
    nb = _read(path)
    first = nb.cells[0]
    assert first.cell_type == "markdown" and first.source.startswith("# ")
    for needed in ("What you will learn", "Prerequisites", "Hardware", "Time to run"):
        assert needed in first.source, f"{path.name}: title cell lacks '{needed}'"
    markdown = "\n".join(c.source for c in nb.cells if c.cell_type == "markdown")
    h1 = [l for l in markdown.splitlines() if re.match(r"#\s", l)]
    assert len(h1) == 1, f"{path.name}: {len(h1)} H1 headings"
    positions = [markdown.find(h) for h in REQUIRED_HEADINGS]
    assert all(p >= 0 for p in positions), f"{path.name} lacks one of {REQUIRED_HEADINGS}"
    assert positions == sorted(positions), f"{path.name}: {REQUIRED_HEADINGS} out of order"


def test_03s_recorded_comparison_table_is_the_recording():
    """03 section 3.2 copies data/architectures_cpu.json into a markdown table: each run's row must still be the file's."""
    recording = json.loads((series.ROOT / "data" / "architectures_cpu.json").read_text())
    markdown = "\n".join(c.source for c in _read(series.ROOT / "notebooks" / "03_training.ipynb").cells
                         if c.cell_type == "markdown" and "### 3.2" in c.source)
    table = {cells[0].strip("` "): [c.strip() for c in cells[1:]] for cells in
             (line.strip("|").split("|") for line in markdown.splitlines() if line.startswith("| `"))}
    at_800 = {r["candidate"]: next(v["lm_loss"] for v in r["valid_curve"] if v["iteration"] == 800) for r in recording["rows"]}
    expected = {r["candidate"]: [f"{r['train_iters']:,}", f"{r['s_per_iter']:.4f}", f"{r['train_wall_s']:.1f}",
                                 f"{at_800[r['candidate']]:.3f}", f"{r['valid_loss']:.3f}", f"{r['unseen_bpb']:.3f}",
                                 f"{r['unseen_gzip_bpb']:.3f}"] for r in recording["rows"]}
    assert table == expected


@pytest.mark.parametrize("path", NOTEBOOKS, ids=IDS)
def test_one_parameters_cell_of_typed_commented_literals(path):
    nb = _read(path)
    tagged = [i for i, c in enumerate(nb.cells) if "parameters" in c.metadata.get("tags", [])]
    assert len(tagged) == 1, f"{path.name}: {len(tagged)} cells tagged 'parameters'"
    assert tagged[0] == 1, "the parameters cell comes right after the title cell"
    source = nb.cells[1].source
    for line in source.splitlines():
        if not line.strip():
            continue
        assert re.match(r"^\w+: [\w\[\], |]+ = .+  # \S", line), f"{path.name}: {line!r} is not `name: type = literal  # comment`"
    tree = ast.parse(source)
    for node in tree.body:
        assert isinstance(node, ast.AnnAssign), f"{path.name}: only annotated assignments belong in the parameters cell"
        ast.literal_eval(node.value)
    declared = series.notebook_parameters(path)
    assert len(declared) == len(tree.body), f"{path.name}: papermill could not parse every parameter line"
    for name in series.RUNNER_PARAMETERS:
        assert name in declared


def _cell_with(path, text):
    cells = [c.source for c in _read(path).cells if c.cell_type == "code" and text in c.source]
    assert len(cells) == 1, f"{path.name}: {len(cells)} code cells contain {text!r}"
    return cells[0]


def test_cells_accept_a_split_part_of_weight_0(tmp_path):
    """The split guard suggests weight 0 ('969,0,1'); notebook 02's split table and notebook
    03's summary line crashed on the missing part (TypeError on None)."""
    from types import SimpleNamespace

    from helpers.learn import corpus, dataloader
    from helpers.support import results

    nb_dir = NOTEBOOKS[0].parent
    shown = []
    env = dict(dataloader=dataloader, corpus=corpus, results=results, run_dir=str(tmp_path), NOTEBOOK="x",
               Markdown=str, display=shown.append, train_iters=10, global_batch_size=8, eval_interval=5,
               eval_iters=2, seq_length=64)
    env["data_stage"] = SimpleNamespace(data_paths=lambda run_dir: SimpleNamespace(num_documents=300, split="99,0,1"))
    env["preprocess"] = preprocess
    exec(_cell_with(nb_dir / "02_data_loader.ipynb", "split_document_ranges(paths.num_documents"), env)
    assert "none" in shown[0]
    summary = dict(optimizer="adamw", tokens_per_s=1.0, first_valid_loss=None, final_valid_loss=None, iterations=1,
                   final_train_loss=1.0, checkpoint_path="c")
    (tmp_path / "training.log").write_text("")
    env03 = dict(results=results, run_dir=str(tmp_path), NOTEBOOK="x", timeout_s=1, nproc=1, max_epochs=16.0,
                 cfg=SimpleNamespace(run_path=tmp_path),
                 launch=SimpleNamespace(train=lambda *a, **k: SimpleNamespace(summary=summary, skipped=True,
                                                                     metrics={"valid": [], "train": []})))
    exec(_cell_with(nb_dir / "03_training.ipynb", "run = launch.train(cfg"), env03)


@pytest.mark.parametrize("path", NOTEBOOKS, ids=IDS)
def test_exercises_that_raise_a_parameter_name_a_new_value(path):
    """'Raise `train_iters` to 200' when the default is already 200 asks for a no-op rerun."""
    nb = _read(path)
    defaults = {node.target.id: ast.literal_eval(node.value) for node in ast.parse(nb.cells[1].source).body}
    text = "\n".join(c.source for c in nb.cells if c.cell_type == "markdown")
    for name, value in re.findall(r"[Rr]aise `(\w+)` to ([\d.]+)", text):
        if name in defaults:
            assert float(value) > float(defaults[name]), f"{path.name}: exercise raises {name} to {value}, default {defaults[name]}"


#: The two functions megatron-core's schedules make every user write (notebook 03, section 5.5):
#: they are the lesson, so they are written on the page, not hidden in helpers/.
MEGATRON_CONTRACT = {"forward_step", "loss_func"}
#: A cell that is a part of a standalone script a notebook writes out (first line ``# NAME.py · ...``,
#: issue 25) may define what that script needs without the series' helpers.
SCRIPT_PART = re.compile(r"^# \w+\.py · ")
#: Functions a notebook measures with, written on the page so the learner sees what is measured (issue 25): the
#: function 04 times, and the pack hook 05b hands torch.autograd.graph.saved_tensors_hooks (issue 29).
MEASURED_ON_THE_PAGE = {"04_fused_kernels": {"bias_gelu"}, "05b_memory_toolbox": {"pack"}}


@pytest.mark.parametrize("path", NOTEBOOKS, ids=IDS)
def test_no_logic_or_installs_in_notebooks(path):
    nb = _read(path)
    for cell in nb.cells:
        if cell.cell_type != "code":
            continue
        assert "import *" not in cell.source
        assert not re.search(r"^\s*[!%]\s*pip", cell.source, re.M), "no pip cells: the environment comes from requirements.txt"
        defined = set(re.findall(r"^(?:def|class) (\w+)", cell.source, re.M))
        if SCRIPT_PART.match(cell.source):
            continue
        assert defined <= MEGATRON_CONTRACT | MEASURED_ON_THE_PAGE.get(path.stem, set()), f"{path.name}: define {sorted(defined - MEGATRON_CONTRACT)} in helpers/, not in the notebook"


@pytest.mark.parametrize("profile", sorted(series.PROFILES))
def test_profiles_name_only_real_parameters(profile):
    by_stem = {p.stem: series.notebook_parameters(p) for p in NOTEBOOKS}
    for section, values in series.PROFILES[profile].items():
        if section == "all":
            for name in values:
                assert any(name in params for params in by_stem.values()), f"{profile}: {name} is in no notebook"
            continue
        assert section in by_stem, f"profile {profile} names a notebook {section} that does not exist"
        unknown = set(values) - set(by_stem[section])
        assert not unknown, f"profile {profile}: {section} has no parameters {sorted(unknown)}"


@pytest.mark.parametrize("path", NOTEBOOKS, ids=IDS)
def test_every_notebook_has_smoke_parameters(path):
    assert series.PROFILES["smoke"].get(path.stem), f"{path.stem} has no entry in PROFILES['smoke']"


# ---------------------------------------------------------------------------------------------
# End to end: the whole series with the smoke profile, in order, in one run folder.


@pytest.mark.slow
def test_series_runs_end_to_end(series_run):
    run_dir, runs, summary = series_run
    assert [r.stem for r in runs] == IDS
    for stem in IDS:
        recorded = set(summary[stem]) - {"wall_seconds"}
        assert recorded, f"{stem} recorded no results"
        assert summary[stem]["wall_seconds"] > 0
        nb = _read(run_dir / "executed" / f"{stem}.ipynb")
        errors = [o for c in nb.cells if c.cell_type == "code" for o in c.outputs if o.output_type == "error"]
        assert not errors


@pytest.mark.slow
def test_the_default_is_the_llama_and_the_guides_gpt2_still_trains_and_converts(series_run, tmp_path):
    """Issue 28: notebook 03's default is the Llama (section 3.2's measurement), converted by notebook 06 to a
    LlamaForCausalLM; architecture="gpt2", the guide's model and the gpu profiles', still trains in 03 and
    converts in 06 to a GPT2LMHeadModel with every proof (smoke size, its own run folder)."""
    run_dir, _, summary = series_run
    s03 = summary["03_training"]
    assert s03["architecture"] == "llama" and s03["rope_relative_spread"] < 1e-4
    assert s03["kv_cache_bytes_per_token"]["llama"] * 2 == s03["kv_cache_bytes_per_token"]["gpt2"]  # 2 of 4 heads
    assert json.loads((run_dir / "hf_model" / "config.json").read_text())["architectures"] == ["LlamaForCausalLM"]
    runs = series.run("smoke", {"architecture": "gpt2"}, run_dir=tmp_path / "gpt2", only=["03", "06"])
    assert [r.stem for r in runs][-2:] == ["03_training", "06_conversion"]  # after notebook 01, which 03 requires
    gpt2 = results.load_summary(tmp_path / "gpt2")
    assert gpt2["03_training"]["architecture"] == "gpt2" and gpt2["03_training"]["script_losses_equal"] is True
    s06 = gpt2["06_conversion"]
    assert s06["standalone_converter_bit_identical"] is True and s06["greedy_tokens_equal"] is True
    assert s06["max_abs_logit_diff"] < 1e-4 and s06["tp2_bit_identical"] is True
    assert s06["megatron_lm_legacy_bit_identical"] is True and s06["round_trip_bit_identical"] is True
    assert json.loads((tmp_path / "gpt2" / "hf_model" / "config.json").read_text())["architectures"] == ["GPT2LMHeadModel"]


@pytest.mark.slow
def test_00_environment_results(series_run):
    _, _, summary = series_run
    s = summary["00_container_setup"]
    assert s["allreduce_ranks_ok"] == 2
    assert s["found_torch"] is True and s["found_megatron-core"] is True
    assert s["device"] in ("cpu", "cuda")


@pytest.mark.slow
def test_01_data_results(series_run):
    _, _, summary = series_run
    s = summary["01_data_preprocessing"]
    assert 0 < s["num_documents"] <= 150 and s["read_back_documents"] == s["num_documents"]
    assert s["round_trip_failures"] == 0
    assert s["num_tokens"] > s["num_documents"] and s["bin_bytes"] == 2 * s["num_tokens"]
    assert s["engines_identical"] is True
    assert ("gigatoken_speedup" in s) == (encoders.resolve_engine() == "gigatoken")


@pytest.mark.slow
def test_03_writes_its_loop_as_a_standalone_script_that_prints_the_cells_losses(series_run):
    """Issue 25: notebook 03's section 5 cells, written out as train_gpt.py, run in a process of their
    own and print the cells' losses; the script needs megatron-core, torch, numpy and one helper line."""
    run_dir, _, summary = series_run
    assert summary["03_training"]["script_losses_equal"] is True
    tree = ast.parse((run_dir / "train_gpt.py").read_text())
    imported = {n.module if isinstance(n, ast.ImportFrom) else a.name for n in ast.walk(tree)
                if isinstance(n, (ast.Import, ast.ImportFrom)) for a in n.names}
    third_party = {m.split(".")[0] for m in imported} - set(__import__("sys").stdlib_module_names)
    assert third_party == {"torch", "numpy", "megatron", "helpers"}
    from_helpers = [a.name for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module.startswith("helpers") for a in n.names]
    assert from_helpers == ["cpu_compat"]
    assert summary["03_training"]["script_lines"] < 200


@pytest.mark.slow
def test_the_library_calls_on_the_page_equal_the_helpers_and_the_proofs_hold(series_run):
    """Each notebook's own megatron-core / tokenizers calls give what the helper gives, and the
    later notebooks' proofs are recorded true (issue 12: show the call, then wrap it)."""
    _, _, summary = series_run
    assert summary["01_data_preprocessing"]["by_hand_identical"] is True  # IndexedDatasetBuilder by hand
    assert summary["02_data_loader"]["builder_call_equals_helper"] is True  # GPTDatasetConfig + builder
    s05, s06 = summary["05_parallelism"], summary["06_conversion"]
    assert s05["all_layouts_match"] is True and s05["per_rank_formula_and_allreduces_match"] is True
    assert s05["bubble_fraction_simulated"] == pytest.approx(s05["bubble_fraction_formula"])
    assert s06["standalone_converter_bit_identical"] is True and s06["greedy_tokens_equal"] is True
    assert s06["max_abs_logit_diff"] < 1e-4 and s06["tp2_bit_identical"] is True and s06["megatron_lm_legacy_bit_identical"] is True and s06["round_trip_bit_identical"] is True
    assert s06["hf_validation_loss"] == pytest.approx(s06["training_validation_loss"], abs=1e-5)


@pytest.mark.slow
def test_the_memory_toolbox_trains_like_one_process_and_its_memory_is_predicted(series_run):
    """Issue 29, notebook 05b in the smoke series: every saver (recomputation, the distributed optimizer, sequence
    parallelism, the interleaved pipeline) and a mixture of experts over 2 ranks train the one-process losses; the
    series' calculator predicts the states each rank measured exactly (Adam's step counters aside) and the
    activations of the dense runs within 2 %; one layer's saved bytes equal the formula; the TP=2 x PP=2 checkpoint
    converts to transformers with notebook 06's proofs."""
    run_dir, _, summary = series_run
    s = summary["05b_memory_toolbox"]
    assert s["all_savers_match"] is True and s["moe_ep2_max_abs_loss_diff"] <= 1e-4
    assert s["recompute selective_max_abs_loss_diff"] == 0 and s["recompute full_max_abs_loss_diff"] == 0
    assert s["one_layer_saved_bytes"] == s["one_layer_formula_local"] > s["one_layer_formula_fused"]
    err = s["largest_relative_error"]
    assert err["series, states"] < 1e-3 and err["series, activations"] < 0.02 and 0.1 < err["Megatron-LM, states"] < 0.15
    rows = {r["technique"]: r for r in s["memory"]}
    assert rows["DP=2 distributed optimizer"]["states MiB"] < rows["DP=2"]["states MiB"]
    assert rows["recompute full"]["activations MiB"] < rows["recompute selective"]["activations MiB"] < rows["baseline"]["activations MiB"]
    assert rows["TP=2 sequence parallel"]["activations MiB"] < rows["TP=2"]["activations MiB"]
    assert s["pipeline_in_flight"] == {"PP=2 1F1B": [2, 1], "PP=2 interleaved v=2": [5, 3]}
    assert s["tp2_pp2_to_hf_max_abs_logit_diff"] < 1e-4 and s["tp2_pp2_greedy_tokens_equal"] is True
    for name in ("05b_memory_measured", "05b_pipeline_timelines"):
        assert (run_dir / "figures" / f"{name}.png").stat().st_size > 10_000
