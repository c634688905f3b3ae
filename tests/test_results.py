import json
import math
import os
from pathlib import Path

import numpy as np
import pytest
import torch

from helpers.support import results


def test_record_accumulates_per_notebook_and_converts_scalars(tmp_path):
    assert results.record(tmp_path, "01_x", "tokens", np.int64(7)) == 7
    results.record(tmp_path, "01_x", "loss", torch.tensor(2.5))
    results.record(tmp_path, "02_y", "bad", float("nan"))
    data = json.loads((tmp_path / "summary.json").read_text())
    assert data == {"01_x": {"tokens": 7, "loss": 2.5}, "02_y": {"bad": "nan"}}
    assert results.load_summary(tmp_path)["01_x"]["loss"] == 2.5


def test_record_leaves_no_temporary_files(tmp_path):
    for i in range(3):
        results.record(tmp_path, "n", f"k{i}", i)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["summary.json"]


def test_unserialisable_value_keeps_previous_summary(tmp_path):
    results.record(tmp_path, "n", "a", 1)
    with pytest.raises(TypeError):
        results.record(tmp_path, "n", "b", object())
    assert results.load_summary(tmp_path) == {"n": {"a": 1}}


def test_run_dir_that_is_a_file_is_refused(tmp_path):
    f = tmp_path / "file"
    f.write_text("x")
    with pytest.raises(NotADirectoryError, match="is a file"):
        results.record(f, "n", "a", 1)


def test_save_figure_writes_png(tmp_path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots()
    ax.plot([0, 1], [1, math.e])
    path = results.save_figure(fig, tmp_path, "curve")
    assert path == tmp_path / "figures" / "curve.png"
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_atomic_writes_are_readable_by_others(tmp_path):
    """mkstemp's 0600 survived os.replace: summary.json, the loose JSON, the data manifest and
    latest_checkpointed_iteration.txt were unreadable to anyone but their writer."""
    import stat

    from helpers.learn import corpus
    from helpers.runner import data_stage

    old = os.umask(0o022)
    try:
        results.record(tmp_path, "nb", "x", 1)
        corpus.write_jsonl([corpus.Document("x = 1\n", "a.py")], tmp_path / "c.json")
        data_stage._write_manifest(tmp_path, {"settings": {}})
        results.write_atomic(tmp_path / "t.txt", "1")
    finally:
        os.umask(old)
    for name in (results.SUMMARY_FILE, "c.json", data_stage.MANIFEST_NAME, "t.txt"):
        assert stat.S_IMODE((tmp_path / name).stat().st_mode) == 0o644, name


def test_markdown_table_from_dicts_and_from_rows_with_headers():
    assert results.markdown_table([[1, 2]], ["a", "b"]) == "| a | b |\n| --- | --- |\n| 1 | 2 |"
    text = results.markdown_table([{"op": "gelu", "ms": 0.000123456, "big": 123456.7, "pipe": "a|b"}])
    assert text.splitlines()[2] == "| gelu | 0.0001235 | 123457 | a\\|b |"
    with pytest.raises(ValueError, match="headers="):
        results.markdown_table([[1, 2]])



def test_markdown_table_refuses_a_row_of_another_length():
    """A short row gave '| 1 | 2 |' under three headers, a long one four cells: a broken table, no error."""
    with pytest.raises(ValueError, match=r"row 1 has 2 cells but there are 3 headers \['a', 'b', 'c'\]"):
        results.markdown_table([[1, 2, 3], [4, 5]], ["a", "b", "c"])
    with pytest.raises(ValueError, match=r"row 0 has 4 cells but there are 3 headers"):
        results.markdown_table([(1, 2, 3, 4)], ["a", "b", "c"])
    assert results.markdown_table([{"a": 1}, {"a": 2, "b": 3}]).splitlines()[3] == "| 2 |"  # dict rows: the headers' keys


def test_default_modes_gives_a_temporary_folder_mkdirs_and_opens_modes(tmp_path):
    """mkdtemp's 0700 folder and safetensors' 0600 file stayed so after the move into place."""
    import stat
    import tempfile

    folder = Path(tempfile.mkdtemp(dir=tmp_path))
    (folder / "sub").mkdir(mode=0o700)
    (folder / "sub" / "w.safetensors").touch(mode=0o600)
    old = os.umask(0o022)
    try:
        assert results.default_modes(folder) == folder
    finally:
        os.umask(old)
    modes = {p.name: stat.S_IMODE(p.stat().st_mode) for p in [folder, *folder.rglob("*")]}
    assert modes == {folder.name: 0o755, "sub": 0o755, "w.safetensors": 0o644}
